"""hetlb.integrations.transformers under a real Hugging Face Trainer (DDP, 2 Gloo ranks on CPU,
launched by torchrun): each step's gradient is the gradient over the step's samples under the
Trainer's loss normalisations (a Llama whose loss the Trainer divides by the step's global label
count, also with the Trainer's gradient checkpointing; a module whose loss is its batch's mean,
with an idle rank), the sizes change between
steps, the Trainer evaluates between steps, and a checkpoint taken mid-way through the second
epoch resumes the rest of that epoch with the Trainer's step count right. In one process: the
refusals and their messages."""
import os
import sys

import pytest
from distributed import torchrun, torchrun_each
from extras import extra

extra("transformers", "hf")
extra("accelerate", "hf")  # (the Trainer runs on it)
import transformers_worker as w  # noqa: E402 (this directory is on the path: pytest's rootdir)

N = w.N  # samples (tests/transformers_worker.py)
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transformers_worker.py")


#: The runs of one launch (a launch costs seconds of imports, a run a fraction of that), each
#: its own Trainer: "first", token means, stopped after step 6, mid-way through epoch 1 of 4
#: steps (48 samples in steps of 12; its resume is the second launch); "accumulated", 54 samples
#: in steps of 12, windows of 2 micro-steps [0, 1], [2, 3] and the short [4] (6 samples), whose
#: weight hetlb scales, with average_tokens_across_devices=False (each rank's own token mean over
#: its window): the same exact step as with the flag on, the default; "classify",
#: LlamaForSequenceClassification, which takes loss kwargs (its forward has **kwargs) and returns
#: its batch's mean: weighed as the token mean ("world"), its steps were the mean of the ranks'
#: means (windows of 2 with a short one, LBB at emulated 1:2); "mean", a loss of the worker's
#: trainer's own (the short window's scaling does not rely on the Trainer's compute_loss) with
#: rank 0 idle in window 1; "checkpointed", the token means with the Trainer's
#: gradient_checkpointing (the Llama's layers recomputed in the backward, transformers'
#: non-reentrant checkpoint).
WINDOWS = ("--samples", 54, "--accumulate", 2, "--check", "0,1,2")
RUNS = {"first": ("--case", "tokens", "--epochs", 3, "--check", "0,1,5", "--stop-at", 6),
        "accumulated": ("--case", "tokens", *WINDOWS, "--own-token-means"),
        "classify": ("--case", "classify", *WINDOWS),
        "mean": ("--case", "mean", *WINDOWS, "--idle"),
        "checkpointed": ("--case", "tokens", *WINDOWS, "--checkpointing")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{name: result}`` of :data:`RUNS`, and the folder the first one saved its checkpoint in."""
    tmp = tmp_path_factory.mktemp("trainer")
    results = torchrun_each(WORKER, [(tmp / f"{name}.json", (*args, "--dir", tmp / name))
                                     for name, args in RUNS.items()])
    return dict(zip(RUNS, results)), tmp


def by_epoch(result, steps):
    epochs = {}
    for rank in result["trained"]:
        for step, samples in rank:
            epochs.setdefault(step // steps, []).extend(samples)
    return epochs


def test_token_mean_gradients_and_a_resume_in_the_second_epoch(runs):
    steps = 4
    results, tmp = runs
    first = results["first"]
    assert first["weighting"] == "world" and first["global_step"] == first["steps"] == 6
    assert len({tuple(s) for s in first["sizes"]}) > 1  # LBB moved samples between the ranks
    assert sorted(first["errors"]) == ["0", "1", "5"]
    assert max(first["errors"].values()) < 1e-5, first["errors"]
    rest = torchrun(WORKER, tmp / "rest.json", "--dir", tmp / "first", "--case", "tokens",
                    "--epochs", 3, "--resume")
    assert rest["global_step"] == rest["steps"] == 3 * steps
    a, b = by_epoch(first, steps), by_epoch(rest, steps)
    assert sorted(a[0]) == list(range(N)) and 0 not in b
    assert sorted(a[1] + b[1]) == list(range(N))  # the rest of epoch 1, nothing twice
    assert sorted(b[2]) == list(range(N))


def test_accumulated_token_means_each_rank_s_own_or_the_step_s(runs):
    r = runs[0]["accumulated"]
    assert r["weighting"] == "world" and r["global_step"] == r["steps"] == 3
    assert len({tuple(s) for s in r["sizes"]}) > 1
    assert sorted(r["errors"]) == ["0", "1", "2"]
    assert max(r["errors"].values()) < 1e-5, r["errors"]
    assert sorted(i for rank in r["trained"] for _, idx in rank for i in idx) == list(range(54))


def test_a_classifier_whose_loss_ignores_the_item_count(runs):
    r = runs[0]["classify"]
    assert r["weighting"] == "samples" and r["global_step"] == r["steps"] == 3
    assert len({tuple(s) for s in r["sizes"]}) > 1
    assert sorted(r["errors"]) == ["0", "1", "2"]
    assert max(r["errors"].values()) < 1e-5, r["errors"]


def test_accumulated_mean_losses_with_an_idle_rank(runs):
    r = runs[0]["mean"]
    assert r["weighting"] == "samples" and r["steps"] == 3
    # per micro-step, fixed per window; the short last step scaled to its 6 samples
    assert r["sizes"][:2] == [[6, 6], [0, 12]]  # rank 0 idle in window 1
    assert sorted(r["errors"]) == ["0", "1", "2"]
    assert max(r["errors"].values()) < 1e-6, r["errors"]
    assert "make a new BalancedTrainer with model=trainer.model" in r["again"]


def test_gradient_checkpointing_trains_the_same_gradients(runs):
    r = runs[0]["checkpointed"]
    assert r["checkpointing"] and not runs[0]["accumulated"]["checkpointing"]
    assert r["weighting"] == "world" and r["global_step"] == r["steps"] == 3
    assert sorted(r["errors"]) == ["0", "1", "2"]
    assert max(r["errors"].values()) < 1e-5, r["errors"]
    assert sorted(i for rank in r["trained"] for _, idx in rank for i in idx) == list(range(54))


def one_process(tmp_path, model, trainer_kwargs=None, **args):
    """A BalancedTrainer of one process on the worker's sequences."""
    from transformers import TrainingArguments
    from hetlb.integrations.transformers import BalancedTrainer

    class Trainer(BalancedTrainer):
        def training_step(self, model, batch, num_items_in_batch=None):
            return super().training_step(model, w.inputs("tokens", batch), num_items_in_batch)

    kw = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=12, use_cpu=True,
              report_to=[], remove_unused_columns=False, disable_tqdm=True,
              logging_strategy="no", save_strategy="no", num_train_epochs=1)
    kw.update(args)
    args = TrainingArguments(**kw)
    return Trainer(model=model, args=args, train_dataset=w.sequences(), **(trainer_kwargs or {})), args


def test_refusals_and_what_they_say(tmp_path):
    from functools import partial
    from hetlb.integrations.epoch import check_windows
    from hetlb.integrations.transformers import _loss_mismatch
    _check_windows = partial(check_windows, accumulate="gradient_accumulation_steps",
                             drop="dataloader_drop_last=True")
    # the Trainer's windows and hetlb's agree, or the run is refused before its first batch
    _check_windows(54, 12, False, 2)  # [0, 1] [2, 3] [4: short]
    _check_windows(48, 12, False, 3)  # [0, 1, 2] [3]
    _check_windows(50, 12, True, 3)  # (the short step dropped)
    with pytest.raises(ValueError, match="dataloader_drop_last=True"):
        _check_windows(48, 10, False, 3)  # the Trainer's [3, 4: short] mixes sizes
    t, _ = one_process(tmp_path, w.llama(), gradient_accumulation_steps=3,
                       per_device_train_batch_size=10)
    with pytest.raises(ValueError, match="make the whole steps a multiple of 3"):
        t.train()
    # each normalisation against each weighting: only the exact pairs pass
    assert _loss_mismatch("world", 7) is None
    assert _loss_mismatch("samples", None) is None
    assert "1/world" in _loss_mismatch("samples", 7)
    assert "weighting='samples'" in _loss_mismatch("world", None)
    # (b), each rank's own token mean: training counts the step's items (the torchrun test of
    # accumulated token means), evaluation keeps the flag as given
    t, _ = one_process(tmp_path, w.llama(), average_tokens_across_devices=False)
    with t._items_across_ranks():
        assert t.args.average_tokens_across_devices
    assert not t.args.average_tokens_across_devices
    # a compute_loss_func that ignores the item count: the Trainer would take its batch means
    # for a loss normalised over the window
    mean = {"compute_loss_func": lambda out, labels, num_items_in_batch=None: out["logits"].square().mean()}
    t, _ = one_process(tmp_path, w.llama(), trainer_kwargs=mean)
    with pytest.raises(ValueError, match="compute_loss_func ignores num_items_in_batch"):
        t.train()
    assert all(p.grad is None for p in t.model.parameters())
    # dividing by the count passes the same check
    summed = {"compute_loss_func": lambda out, labels, num_items_in_batch=None:
              out["logits"].square().sum() / num_items_in_batch}
    t, _ = one_process(tmp_path, w.llama(), trainer_kwargs=summed, max_steps=1)
    t.train()
    assert t.balancer.weighting == "world" and t.model_accepts_loss_kwargs
    # what the trainer does not support
    with pytest.raises(ValueError, match="auto_find_batch_size"):
        one_process(tmp_path, w.llama(), auto_find_batch_size=True)
    with pytest.raises(ValueError, match="hyperparameter search"):
        t.hyperparameter_search()


def test_a_model_that_refuses_an_empty_batch_is_told_why(tmp_path):
    import torch
    t, _ = one_process(tmp_path, w.llama())  # (a Llama cannot reshape 0 rows)
    empty = {"input_ids": torch.zeros(0, w.L, dtype=torch.long),
             "labels": torch.zeros(0, w.L, dtype=torch.long), "idx": torch.zeros(0)}
    with pytest.raises(RuntimeError, match="refused this rank's empty batch"):
        t.training_step(t.model, empty)

    def step_error(*args, **kwargs):
        raise RuntimeError("hetlb: an error of the step's own")
    t.compute_loss = step_error  # hetlb's errors on an idle rank keep their own message
    with pytest.raises(RuntimeError, match="an error of the step's own"):
        t.training_step(t.model, empty)


def test_the_trainer_skips_nothing_and_a_checkpoint_needs_the_balancer_state(tmp_path):
    from hetlb.integrations.transformers import STATE_FILE
    args = dict(save_strategy="steps", save_steps=2, max_steps=2)
    t, given = one_process(tmp_path, w.llama(), **args)
    assert t.args.ignore_data_skip and not given.ignore_data_skip  # the trainer's copy
    t.train()
    folder = tmp_path / "run" / "checkpoint-2"
    assert (folder / STATE_FILE).exists() and t.balancer.steps == 2
    (folder / STATE_FILE).unlink()
    t, _ = one_process(tmp_path, w.llama(), **dict(args, max_steps=4))
    with pytest.raises(FileNotFoundError, match="not written by BalancedTrainer"):
        t.train(resume_from_checkpoint=True)
    with pytest.raises(FileNotFoundError, match="not written by BalancedTrainer"):
        t.train(resume_from_checkpoint=folder)  # (a path, not a str)


def test_a_mid_epoch_resume_before_a_short_window_is_refused(tmp_path, caplog):
    # 54 samples in steps of 12, windows of 2: [0, 1] [2, 3] [4: short]; stopped after window 0
    args = dict(gradient_accumulation_steps=2, save_strategy="steps", save_steps=1, max_steps=1)
    t, _ = one_process(tmp_path, w.llama(), **args)
    t.train_dataset = w.sequences(54)
    t.train()
    assert "a checkpoint taken inside an epoch cannot be resumed" in caplog.text  # said up front
    t, _ = one_process(tmp_path, w.llama(), **dict(args, max_steps=3))
    t.train_dataset = w.sequences(54)
    with pytest.raises(ValueError, match="would never step the optimizer after that window"):
        t.train(resume_from_checkpoint=True)


def test_without_transformers_the_import_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "hetlb.integrations.transformers", raising=False)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install hetlb\[hf\]"):
        import hetlb.integrations.transformers  # noqa: F401
