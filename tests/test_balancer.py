"""Balancer in one process (no process group): API, errors, checkpoints, aggregation weights.

The multi-process behaviour (real DDP over Gloo) is in test_balancer_dist.py.
"""
import io
import time
from collections import namedtuple

from hypothesis import given, strategies as st
import numpy as np
import pytest
import torch

import hetlb
from hetlb.comm.weights import weights_for
from hetlb.data.collate import _empty_like

from fixed_policy import Fixed


def dataset(n=50):
    return torch.utils.data.TensorDataset(torch.arange(n, dtype=torch.float32)[:, None])


def train(loader, model, steps=None, explicit=None):
    """The plain loop: every batch handed out is one step (``explicit``: a Balancer whose
    bal.step() wraps forward and backward instead)."""
    seen = []
    for k, (x,) in enumerate(loader):
        if explicit is not None:
            with explicit.step():
                model(x).sum().backward()
        else:
            model(x).sum().backward()
        seen.extend(int(v) for v in x[:, 0])
        if steps is not None and k + 1 == steps:
            break
    return seen


@pytest.mark.parametrize("explicit", [False, True])
def test_single_process_training_records_telemetry(explicit):
    model = torch.nn.Linear(1, 1)
    bal = hetlb.Balancer(model, 8)
    loader = bal.loader(dataset(50), seed=2)
    seen = train(loader, model, explicit=bal if explicit else None)
    assert sorted(seen) == list(range(50))
    assert bal.steps == 7 and len(bal.history) == 7
    r = bal.history[-1]
    assert r.batch.tolist() == [2] and r.step == 6 and r.epoch_end  # 50 = 6 * 8 + 2
    assert not bal.history[-2].epoch_end
    assert np.all(bal.history.column("compute") > 0)
    assert bal.batch_sizes.tolist() == [8]
    assert 0 < bal.last_overhead < 0.1
    assert bal.rank == 0 and bal.world == 1


def test_step_without_a_loader_uses_the_decision():
    model = torch.nn.Linear(2, 1)
    bal = hetlb.Balancer(model, 5, policy=hetlb.Uniform())
    for _ in range(3):
        with bal.step():
            model(torch.randn(int(bal.batch_sizes[0]), 2)).sum().backward()
    assert bal.steps == 3 and bal.history[-1].batch.tolist() == [5]


def test_compute_is_timed_from_the_first_forward():
    model = torch.nn.Linear(1, 1)
    bal = hetlb.Balancer(model, 4, policy=hetlb.Uniform())
    for (x,) in bal.loader(dataset(8)):
        time.sleep(0.2)  # the loop's own work before the forward (e.g. copies to the device)
        model(x).sum().backward()
    assert bal.history.column("compute").max() < 0.1


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"global_batch": 0}, ValueError, "integer >= 1"),
    ({"global_batch": 2.5}, ValueError, "must be an integer"),
    ({"global_batch": True}, ValueError, "must be an integer"),
    ({}, ValueError, "global_batch is required"),
    ({"global_batch": 4, "weighting": "mean"}, ValueError, "weighting must be one of"),
    ({"global_batch": 4, "policy": Fixed([3])}, ValueError, "summing to 3"),
    ({"global_batch": 4, "policy": Fixed([4.0])}, ValueError, "expected 1 integers"),
    ({"global_batch": 4, "upper": 2}, ValueError, "exceeds the sum of upper"),
    ({"global_batch": 4, "accumulate": 0}, ValueError, "accumulate must be an integer >= 1"),
    ({"global_batch": 4, "accumulate": 2, "weighting": "sizes"}, ValueError, "cannot be exact"),
    ({"global_batch": 4, "transport": "udp"}, ValueError, "transport must be"),
    ({"global_batch": 4, "batch_dim": -1}, ValueError, "batch_dim must be an integer >= 0"),
    ({"global_batch": 4, "transport": "carry"}, ValueError, "carry"),
])
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        hetlb.Balancer(torch.nn.Linear(1, 1), **kwargs)


def test_policy_that_breaks_the_sum_later_is_caught():
    class Drifting(Fixed):
        def decide(self, history):
            return self.sizes + 1

    model = torch.nn.Linear(1, 1)
    bal = hetlb.Balancer(model, 4, policy=Drifting([4]))
    with pytest.raises(ValueError, match="Drifting returned sizes \\[5\\] summing to 5"):
        with bal.step():
            model(torch.randn(4, 1)).sum().backward()


def test_misuse_is_reported():
    model = torch.nn.Linear(1, 1)
    bal = hetlb.Balancer(model, 4, weighting="sizes")
    with pytest.raises(ValueError, match="needs per-sample sizes"):
        bal.loader(dataset())
    with pytest.raises(ValueError, match="sample_sizes must be 50 finite"):
        bal.loader(dataset(), sample_sizes=[1.0] * 49)
    with pytest.raises(ValueError, match="sizes= is not accepted.*sample_sizes="):
        bal.loader(dataset(), sizes=[1.0] * 50)
    with pytest.raises(ValueError, match="batch_size=3 is not the Balancer's per-rank average"):
        bal.loader(dataset(), batch_size=3, sample_sizes=[1.0] * 50)
    with pytest.raises(ValueError, match="sampler= is not accepted.*shuffle="):
        bal.loader(dataset(), sampler=torch.utils.data.RandomSampler(dataset()))
    with pytest.raises(ValueError, match="in_order=False"):
        bal.loader(dataset(), in_order=False)
    loader = bal.loader(dataset(), batch_size=4, sample_sizes=[1.0] * 50)  # the average: accepted
    with pytest.raises(ValueError, match="already drives a loader"):
        bal.loader(dataset(), sample_sizes=[1.0] * 50)
    with pytest.raises(RuntimeError, match="without a new batch"):
        with bal.step():
            pass
    for (x,) in loader:
        with bal.step():
            model(x).sum().backward()
        with pytest.raises(RuntimeError, match="without a new batch"):
            with bal.step():  # a second step on the same batch
                pass
        break
    bal2 = hetlb.Balancer(model, 4)
    with pytest.raises(RuntimeError, match="cannot nest"):
        with bal2.step():
            with pytest.raises(RuntimeError, match="inside `with bal.step"):
                bal2.state_dict()
            with bal2.step():
                pass


def test_backward_outside_a_step_is_an_error():
    model = torch.nn.Linear(2, 1)
    hetlb.Balancer(model, 4)
    # Without a process group there is no comm hook; the check that matters (the hook's) is in
    # test_balancer_dist.py. Here: a forward outside any step is free (no plan to check).
    model(torch.randn(3, 2)).sum().backward()


def test_bal_backward_in_one_process():
    model = torch.nn.Linear(2, 1)
    bal = hetlb.Balancer(model, 4)
    with pytest.raises(RuntimeError, match="outside a balanced step"):
        bal.backward(model(torch.randn(4, 2)).sum())
    x = torch.randn(4, 2)
    with bal.step():
        bal.backward(model(x).sum(), retain_graph=False)  # weight 1: plain backward
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(got, model.parameters()))
    assert bal.steps == 1 and np.isfinite(bal.history[-1].compute).all()


def test_exception_inside_a_step_leaves_the_balancer_usable():
    model = torch.nn.Linear(1, 1)
    bal = hetlb.Balancer(model, 4)
    with pytest.raises(KeyError):
        with bal.step():
            raise KeyError("user error")
    with bal.step():
        model(torch.randn(4, 1)).sum().backward()
    assert bal.steps == 1


# ---------------------------------------------------------------- the batch the model is given


def test_a_batch_of_another_size_than_planned_raises():
    model = torch.nn.Linear(1, 1)
    bal = hetlb.Balancer(model, 4, policy=Fixed([4]))
    dl = torch.utils.data.DataLoader(dataset(12), batch_size=3)  # not the Balancer's loader
    with pytest.raises(hetlb.BatchSizeError, match="batch of 3 samples, but the Balancer planned 4"):
        for (x,) in dl:
            with bal.step():
                model(x).sum().backward()


def test_batch_dim_option_for_other_layouts():
    class SeqFirst(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def forward(self, x, mask=None):
            return self.lin(x)

    seq = torch.zeros(5, 4, 2)  # [time, batch, features]
    m = SeqFirst()
    bal = hetlb.Balancer(m, 4, policy=Fixed([4]), batch_dim=1)
    with bal.step():
        m(seq).sum().backward()
    m2 = SeqFirst()
    bal2 = hetlb.Balancer(m2, 4, policy=Fixed([4]), batch_dim=lambda args, kwargs: kwargs["mask"].shape[0])
    with bal2.step():
        m2(seq, mask=torch.ones(4)).sum().backward()
    with pytest.raises(hetlb.BatchSizeError):
        with bal2.step():
            m2(seq, mask=torch.ones(3)).sum().backward()
    m3 = SeqFirst()
    bal3 = hetlb.Balancer(m3, 4, policy=Fixed([4]), batch_dim=None)  # the opt-out
    with bal3.step():
        m3(seq).sum().backward()
    # no_grad forwards are not checked, nor eval() ones between steps; inside `with bal.step():`
    # a forward with gradients trains in eval() mode too, and is checked
    m.eval()
    m(torch.zeros(5, 9, 2))
    with pytest.raises(hetlb.BatchSizeError, match=r"eval\(\) mode inside"):
        with bal.step():
            m(torch.zeros(5, 9, 2)).sum().backward()
    with bal.step():
        with torch.no_grad():
            m(torch.zeros(5, 9, 2))
        m(seq).sum().backward()
    m.train()
    with torch.no_grad():
        m(torch.zeros(5, 9, 2))


# ---------------------------------------------------------------- checkpoints and resume


def test_resume_mid_epoch_continues_the_same_order():
    model = torch.nn.Linear(1, 1)
    whole = hetlb.Balancer(model, 6, policy=hetlb.LBB())
    ref = train(whole.loader(dataset(40), seed=4), model)

    a = hetlb.Balancer(model, 6, policy=hetlb.LBB())
    first = train(a.loader(dataset(40), seed=4), model, steps=3)
    state = a.state_dict()
    b = hetlb.Balancer(model, 6, policy=hetlb.LBB())
    loader = b.loader(dataset(40), seed=4)
    b.load_state_dict(state)
    b.load_state_dict(state)  # loading twice is harmless
    assert b.steps == 3 and len(b.history) == 3
    rest = train(loader, model)
    assert first + rest == ref
    with pytest.raises(ValueError, match="global_batch"):
        hetlb.Balancer(model, 7).load_state_dict(state)
    c = hetlb.Balancer(model, 6, policy=hetlb.LBB())
    c.loader(dataset(40), seed=0)
    with pytest.raises(ValueError, match="different global order.*seed=4 then, 0 now"):
        c.load_state_dict(state)


def test_load_before_the_loader_exists():
    model = torch.nn.Linear(1, 1)
    a = hetlb.Balancer(model, 4, policy=hetlb.Uniform())
    first = train(a.loader(dataset(40), seed=3), model, steps=3)
    state = a.state_dict()
    b = hetlb.Balancer(model, 4, policy=hetlb.Uniform())
    b.load_state_dict(state)  # before bal.loader(): the position waits on the plan board
    rest = train(b.loader(dataset(40), seed=3), model)
    assert sorted(first + rest) == list(range(40))


def test_checkpoint_at_the_top_of_the_loop_body_loses_nothing():
    model = torch.nn.Linear(1, 1)
    a = hetlb.Balancer(model, 4, policy=hetlb.Uniform())
    trained = []
    for k, (x,) in enumerate(a.loader(dataset(40), seed=3)):
        if k == 3:
            state = a.state_dict()  # this batch has not trained yet
            break
        model(x).sum().backward()
        trained += [int(v) for v in x[:, 0]]
    b = hetlb.Balancer(model, 4, policy=hetlb.Uniform())
    rest = train(b.loader(dataset(40), seed=3), model) if b.load_state_dict(state) is None else None
    assert sorted(trained + rest) == list(range(40))


def test_checkpoint_at_the_bottom_of_the_loop_body():
    model = torch.nn.Linear(1, 1)
    a = hetlb.Balancer(model, 4, policy=hetlb.LBB())
    loader = a.loader(dataset(40), seed=3)
    trained = []
    for k, (x,) in enumerate(loader):
        model(x).sum().backward()
        trained += [int(v) for v in x[:, 0]]
        if k == 3:
            state = loader.state_dict()  # the loader's: the same object as the Balancer's
            break
    assert state["position"]["step"] == 4 and state["steps"] == 4
    b = hetlb.Balancer(model, 4, policy=hetlb.LBB())
    loader = b.loader(dataset(40), seed=3)
    loader.load_state_dict(state)
    rest = train(loader, model)
    assert sorted(trained + rest) == list(range(40)) and b.steps == 10


def test_a_peek_does_not_consume_the_first_step():
    model = torch.nn.Linear(1, 1)
    bal = hetlb.Balancer(model, 4, policy=hetlb.Uniform())
    loader = bal.loader(dataset(40), seed=3)
    assert len(next(iter(loader))[0]) == 4  # the tutorial's b_sz = len(next(iter(...))[0])
    assert len(loader) == 10
    seen = train(loader, model)
    assert sorted(seen) == list(range(40)) and bal.steps == 10


def test_set_epoch_of_an_epoch_the_checkpoint_finished_raises():
    model = torch.nn.Linear(1, 1)
    a = hetlb.Balancer(model, 4, policy=hetlb.Uniform())
    la = a.loader(dataset(8), seed=3)
    la.sampler.set_epoch(0)  # the tutorial's train_data.sampler.set_epoch(epoch)
    train(la, model)
    state = a.state_dict()  # at the end of epoch 0
    b = hetlb.Balancer(model, 4, policy=hetlb.Uniform())
    lb = b.loader(dataset(8), seed=3)
    lb.load_state_dict(state)
    with pytest.raises(ValueError, match="epoch 0 is already complete.*set_epoch\\(1\\)"):
        lb.set_epoch(0)
    assert lb.epoch == 1  # the epoch the next batch belongs to: the loop resumes with it
    lb.set_epoch(1)
    train(lb, model)
    assert lb.epoch == 2 and b.steps == 4


def test_the_readme_resume_loop():
    model = torch.nn.Linear(1, 1)
    ckpts, seen = [], {}
    for attempt in range(3):  # stopped after 5 steps, then after 4 more, then to the end
        bal = hetlb.Balancer(model, 4, policy=hetlb.LBB())
        loader = bal.loader(dataset(12), seed=2)
        if ckpts:
            loader.load_state_dict(ckpts[-1])
        done = 0
        for epoch in range(loader.epoch, 3):
            loader.set_epoch(epoch)
            for (x,) in loader:
                model(x).sum().backward()
                seen.setdefault(epoch, []).extend(int(v) for v in x[:, 0])
                done += 1
                if attempt < 2 and done == 5 - attempt:
                    break
            else:
                continue
            break
        ckpts.append(loader.state_dict())
    assert all(sorted(seen[e]) == list(range(12)) for e in range(3)), seen


def test_standalone_loader_bound_later_and_loaded_before_binding():
    model = torch.nn.Linear(1, 1)
    dl = hetlb.DataLoader(dataset(40), batch_size=4, shuffle=True, seed=3)
    # Unbound, it is an evaluation loader: a whole pass, the position unmoved
    evaluated = [int(v) for (x,) in dl for v in x[:, 0]]
    assert sorted(evaluated) == list(range(40)) and len(dl) == 10
    bal = hetlb.Balancer(model, policy=hetlb.LBB(), loader=dl)
    assert bal.global_batch == 4
    first = train(dl, model, steps=5)
    state = dl.state_dict()
    dl2 = hetlb.DataLoader(dataset(40), batch_size=4, seed=3)
    dl2.load_state_dict(state)  # before its Balancer exists (the tutorial's _load_snapshot order)
    with pytest.raises(RuntimeError, match="holds a loaded checkpoint and is not bound"):
        iter(dl2)
    bal2 = hetlb.Balancer(model, policy=hetlb.LBB(), loader=dl2)
    assert bal2.steps == 5 and len(bal2.history) == 5
    rest = train(dl2, model)
    assert sorted(first + rest) == list(range(40))
    with pytest.raises(ValueError, match="global_batch=5 differs from the loader"):
        hetlb.Balancer(model, 5, loader=hetlb.DataLoader(dataset(), batch_size=4))
    with pytest.raises(ValueError, match="already bound"):
        hetlb.Balancer(model, loader=dl2)


POLICIES = [hetlb.Uniform, hetlb.LBB, lambda: hetlb.LBB(priority=0.1), lambda: hetlb.LBBSP("gpu"),
            lambda: hetlb.LBBSP("cpu", predictor=hetlb.EMA()),
            lambda: hetlb.LBBSP("cpu", predictor=hetlb.NARX(warmup=8, retrain_every=4, background=False)),
            hetlb.WLBS, hetlb.DBS]


@pytest.mark.parametrize("make", POLICIES)
def test_checkpoints_load_with_weights_only(make):
    model = torch.nn.Linear(1, 1)
    a = hetlb.Balancer(model, 6, policy=make())
    la = a.loader(dataset(60), seed=1)
    train(la, model, steps=7)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "loader": la.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)  # the default: weights_only=True
    b = hetlb.Balancer(model, 6, policy=make())
    lb = b.loader(dataset(60), seed=1)
    lb.load_state_dict(ckpt["loader"])
    assert b.steps == 7 and [r.batch.tolist() for r in b.history] == [r.batch.tolist() for r in a.history]
    assert b.batch_sizes.tolist() == a.batch_sizes.tolist()
    # The restored policy decides as the original would on the same next record.
    rec = a.history[-1]
    nxt = hetlb.core.telemetry.StepRecord(step=rec.step + 1, epoch=rec.epoch, batch=a.batch_sizes,
                                     compute=np.full(1, 0.01), data=a.batch_sizes.astype(float),
                                     memory=np.zeros(1), cpu=np.zeros(1))
    a.history.append(nxt)
    b.history.append(nxt)
    assert a.policy.decide(a.history).tolist() == b.policy.decide(b.history).tolist()


def test_weights_for():
    b = np.array([1, 3, 0, 4])
    np.testing.assert_allclose(weights_for("samples", b), [1 / 8, 3 / 8, 0, 4 / 8])
    np.testing.assert_allclose(weights_for("sizes", b, np.array([2.0, 2.0, 0.0, 4.0])), [.25, .25, 0, .5])
    # no data anywhere (a step of empty sequences): weighed by samples, not 0/0
    np.testing.assert_allclose(weights_for("sizes", b, np.zeros(4)), [1 / 8, 3 / 8, 0, 4 / 8])
    # "none": the plain mean over the ranks that had samples (an idle rank's gradient is of nothing)
    np.testing.assert_allclose(weights_for("none", b), [1 / 3, 1 / 3, 0, 1 / 3])
    np.testing.assert_allclose(weights_for("none", np.array([6, 0, 2])), [0.5, 0, 0.5])
    np.testing.assert_allclose(weights_for("world", np.array([6, 0, 2])), [1 / 3] * 3)
    with pytest.raises(ValueError, match="no samples"):
        weights_for("samples", np.zeros(3))
    with pytest.raises(ValueError, match="needs the data amount"):
        weights_for("sizes", b)
    with pytest.raises(ValueError, match="finite non-negative"):
        weights_for("sizes", b, np.array([1.0, np.nan, 1.0, 1.0]))
    with pytest.raises(ValueError, match="finite non-negative"):
        weights_for("samples", np.array([2, -1, 3]))  # integer sizes take a fast path first


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=80).filter(lambda b: sum(b) > 0))
def test_weights_for_integer_fast_path_matches_the_float_path(b):
    fast = weights_for("samples", np.asarray(b, np.int64))
    slow = weights_for("samples", [float(v) for v in b])
    assert fast.dtype == np.float64 and fast.tolist() == slow.tolist()


def test_empty_batches_keep_their_structure():
    Pair = namedtuple("Pair", "x y")
    batch = {"a": torch.ones(3, 2), "b": [torch.zeros(3), np.ones((3, 4))], "c": Pair(torch.ones(3), "s")}
    e = _empty_like(batch)
    assert e["a"].shape == (0, 2) and e["b"][0].shape == (0,) and e["b"][1].shape == (0, 4)
    assert isinstance(e["c"], Pair) and e["c"].x.shape == (0,) and e["c"].y == "s"


def test_balancer_and_persistent_workers_free_promptly():
    # No reference cycle: freed by reference counting, workers shut down at once (a cycle left
    # them to the garbage collector: 5 s per worker).
    import gc
    import weakref
    model = torch.nn.Linear(1, 1)
    bal = hetlb.Balancer(model, 6)
    loader = bal.loader(dataset(30), num_workers=2, persistent_workers=True)
    train(loader, model)
    train(loader, model)
    ref = weakref.ref(bal)
    gc.disable()
    try:
        t = time.perf_counter()
        del bal, loader
        assert ref() is None
        assert time.perf_counter() - t < 3.0
    finally:
        gc.enable()


def test_policy_refusing_the_context_leaves_the_model_unhooked():
    class Refuses(hetlb.policies.Uniform):
        def start(self, ctx):
            raise ValueError("this policy refuses the context")

    m = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="refuses"):
        hetlb.Balancer(m, 8, policy=Refuses())
    assert not m._forward_pre_hooks  # the failed Balancer left no hook behind
    hetlb.Balancer(m, 8)  # and the model can be balanced afterwards
    assert len(m._forward_pre_hooks) == 1


@given(world=st.integers(2, 6), step=st.integers(0, 2 ** 24 - 1), data=st.data())
def test_a_table_that_is_not_this_steps_is_a_decision_mismatch_whatever_it_holds(world, step, data):
    """The step end's table check (verify_table) accepts the table of this step and raises
    DecisionMismatchError, naming what differs, for one that differs in a rank's batch, decision
    or plan checksum, step or epoch, including the NaN and infinities of a corrupt table (before, their
    message failed with ValueError/OverflowError from int())."""
    from types import SimpleNamespace
    from hetlb.train.verify import verify_table
    from hetlb.core.telemetry import COL, NUM_FIELDS
    sizes = np.asarray(data.draw(st.lists(st.integers(0, 2 ** 20), min_size=world, max_size=world)),
                       dtype=np.int64)
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    table = rng.normal(size=(world, NUM_FIELDS))
    table[:, COL["batch"]] = sizes
    table[:, COL["checksum"]], table[:, COL["plan"]] = rng.integers(0, 2 ** 24, 2)
    table[:, COL["step"]] = step
    table[:, COL["epoch"]] = data.draw(st.integers(0, 2 ** 24 - 1))
    plan = SimpleNamespace(sizes=sizes)
    verify_table(table, plan, step, sharded=False)
    col = data.draw(st.sampled_from(["batch", "checksum", "plan", "step", "epoch"]))
    r = data.draw(st.integers(0, world - 1))
    table[r, COL[col]] = data.draw(st.sampled_from([float("nan"), float("inf"), -float("inf"),
                                                    table[r, COL[col]] + 1, 0.5]))
    words = {"batch": "ran batch sizes", "checksum": "batch-size decision",
             "plan": "step plan", "step": "different steps", "epoch": "different epochs"}[col]
    with pytest.raises(hetlb.DecisionMismatchError, match=words):
        verify_table(table, plan, step, sharded=False)


@pytest.mark.parametrize("n, k", [(10, 2), (13, 3), (9, 2)])
def test_one_process_accumulation_gives_each_window_the_mean_over_its_samples(n, k):
    # A short window (an epoch's end) is scaled by accumulate / its length, in one process without
    # DDP as by a DDP hook: the micro-steps' losses are each divided by accumulate.
    torch.manual_seed(0)
    x, y = torch.randn(n, 3), torch.randn(n, 1)
    m = torch.nn.Linear(3, 1)
    ref = torch.nn.Linear(3, 1)
    ref.load_state_dict(m.state_dict())
    bal = hetlb.Balancer(m, 4, accumulate=k)
    windows, seen = [], 0
    for xb, yb in bal.loader(torch.utils.data.TensorDataset(x, y), shuffle=False):
        with bal.step():
            (torch.nn.functional.mse_loss(m(xb), yb) / k).backward()
        seen += len(xb)
        if bal.synced:
            windows.append((seen, [p.grad.clone() for p in m.parameters()]))
            seen = 0
            m.zero_grad()
    assert sum(c for c, _ in windows) == n and windows[-1][0] < 4 * k  # a short last window
    lo = 0
    for count, grads in windows:
        ref.zero_grad()
        torch.nn.functional.mse_loss(ref(x[lo:lo + count]), y[lo:lo + count]).backward()
        for g, p in zip(grads, ref.parameters()):
            torch.testing.assert_close(g, p.grad)
        lo += count
