"""hetlb under Hugging Face's Trainer with DDP: :class:`BalancedTrainer`, a Trainer whose training
batches a :class:`hetlb.Balancer` sizes per rank every step::

    trainer = BalancedTrainer(model=model, args=TrainingArguments(per_device_train_batch_size=8,
                              ...), train_dataset=dataset, data_collator=collate, policy=hetlb.LBB())
    trainer.train()                              # launched with torchrun, as any DDP Trainer run

``per_device_train_batch_size`` is the average: the global batch is it times the world, and the
Balancer gives each rank its own share. The training loader is a :class:`hetlb.DataLoader` over
the dataset (the Trainer's collator and column removal, ``seed``/``data_seed``,
``dataloader_drop_last`` and the DataLoader settings of the arguments); evaluation keeps the
Trainer's own loaders. The Balancer is made on the Trainer's DDP model before the first batch is
drawn (the Trainer wraps the model after it made the loader); one ``train()`` per trainer
under DDP (DDP keeps the Balancer's hook for the model's life).

The loss: the Trainer normalises it one of three ways, and each needs its own weight. Which one
a model's loss follows is measured before the first batch: its loss on the first samples of the
dataset, with the model in eval mode, computed through ``compute_loss`` (a subclass's own
included) for two item counts. A loss that halves when the count doubles is divided by it;
one that does not change ignores it (transformers' classification models take loss kwargs and
return a plain mean).

* The loss is divided by the item count (``num_items_in_batch``: transformers' language models,
  or a ``compute_loss_func`` that divides by it) and ``average_tokens_across_devices`` is on (the
  default; training steps behave so whatever the flag, see the third case): the Trainer divides
  each rank's summed loss by the step's global item count and multiplies it by the world to undo
  DDP's mean. Every rank's weight is then ``1 / world``
  (``weighting="world"``), and the step's gradient is that of the token mean over all ranks.
* The loss is each batch's mean (a model without loss kwargs, or one that ignores the count:
  the trainer then stops passing it, ``model_accepts_loss_kwargs=False``): hetlb's own weight
  (the rank's share of the step's samples, ``weighting="samples"``) makes the step's gradient
  that of the mean over the step's samples.
* Divided by the item count with ``average_tokens_across_devices=False``: the Trainer would take
  each rank's token mean over its window, and plain DDP average those means (a rank's few
  tokens weighing as much as another's many, which per-rank batch sizes make systematic).
  Weighed by each rank's share of the step's tokens, they give the token mean over all ranks, the
  one-large-batch loss, and that is what training computes: the item counts and losses of
  training steps are made as under the flag (the Trainer gathers the ranks' counts, one
  all-gather of a number per window), so the first case applies, with no per-sample counts to
  know in advance. Evaluation keeps the flag as given.
* A ``compute_loss_func`` that ignores the count is refused (the Trainer takes its loss for one
  normalised over the window).

Each step checks that its weighting matches what the Trainer does to the loss, before the forward.

Checkpoints: the Balancer's state (with the data position) is written beside each checkpoint as
``hetlb.pt`` and read by ``train(resume_from_checkpoint=...)``, so a run resumes at the batch it
stopped at. The Trainer's own skipping of the batches already trained is off
(``ignore_data_skip=True`` in the trainer's copy of the arguments): hetlb's loader resumes at its
position, and skipping again would drop a part of the epoch.

Gradient accumulation: the Balancer runs with ``accumulate=gradient_accumulation_steps``, each
micro-batch of the Trainer is a ``with bal.step():`` micro-step, and the Trainer's ``no_sync`` on
all but a window's last batch is the window's own. Runs whose epochs the Trainer and hetlb would
cut into different windows are refused (:func:`hetlb.integrations.epoch.check_windows`), and so
is a resume inside an epoch whose last window is short (the Trainer would not step the optimizer
after it). An epoch's short last window: the Trainer normalises it by its own length (or its own
item count), hetlb's weight expects a loss normalised as a whole window's, so ``training_step``
has the Trainer divide that window's losses by ``gradient_accumulation_steps`` (or by its item
count times ``gradient_accumulation_steps / length``), whatever ``compute_loss`` a subclass has.

Not supported (refused): ``auto_find_batch_size`` and hyperparameter search (each trains the DDP
model again), several GPUs in one process (DataParallel).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Mapping
from functools import partial
from typing import Any, Dict, Iterator, Optional

import torch

try:
    import accelerate  # noqa: F401 (the Trainer runs on it)
    import transformers as _tf
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, seed_worker
except ImportError:
    raise ImportError("hetlb.integrations.transformers needs transformers and accelerate: "
                      "pip install hetlb[hf]") from None

from hetlb.data.loader import BalancedLoader
from hetlb.integrations.epoch import EpochLoader, check_windows
from hetlb.train.balancer import Balancer

__all__ = ["BalancedTrainer", "SaveBalance", "STATE_FILE"]

log = logging.getLogger(__name__)

#: The Balancer's state in a checkpoint folder.
STATE_FILE = "hetlb.pt"


class _FromFirstBatch:
    """An iteration over a loader that starts at the first batch asked for: the Trainer takes the
    iterator before its first window, and the loader must be bound to the Balancer by then."""

    def __init__(self, loader: BalancedLoader) -> None:
        self._loader = loader
        self._it: Optional[Iterator[Any]] = None

    def __iter__(self) -> "_FromFirstBatch":
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self._it = iter(self._loader)
        return next(self._it)


class TrainerLoader(EpochLoader):
    """The training loader the Trainer reads: :class:`EpochLoader`, whose iteration starts at the
    first batch asked for (the Balancer binds the loader in between)."""

    def __iter__(self) -> Iterator[Any]:
        return _FromFirstBatch(self.loader)


class SaveBalance(_tf.TrainerCallback):
    """Writes the training loader's state (the Balancer's, with the data position) into each
    checkpoint folder as :data:`STATE_FILE`. Every rank takes it (the ranks' states are the same,
    byte for byte); the process that saves the checkpoint writes it."""

    def on_save(self, args: Any, state: Any, control: Any, train_dataloader: Any = None,
                **kwargs: Any) -> None:
        if not isinstance(train_dataloader, EpochLoader):
            return
        balance = train_dataloader.state_dict()
        if args.should_save:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            torch.save(balance, os.path.join(folder, STATE_FILE))


def _loss_mismatch(weighting: str, items: Any) -> Optional[str]:
    """Why the Balancer's weighting does not fit the loss the Trainer computes this step, or
    None. ``items`` is the Trainer's item count (None when it normalises no loss by it)."""
    if items is not None and weighting != "world":
        return (f"the Trainer divides each rank's loss by the step's global item count "
                f"(average_tokens_across_devices with a model taking loss kwargs), so every "
                f"rank's weight must be 1/world: weighting='world' (BalancedTrainer's choice for "
                f"this case), not {weighting!r}")
    if items is None and weighting == "world":
        return ("this step's loss is each rank's own mean (the Trainer counted no items: the "
                "batches have no 'labels', or the model takes no loss kwargs), so the ranks' "
                "weights must be their shares of the step: weighting='samples'")
    return None


class BalancedTrainer(_tf.Trainer):
    """A ``transformers.Trainer`` whose training steps a :class:`hetlb.Balancer` balances (see the
    module docstring). Takes the Trainer's arguments, and:

    Args:
        policy: the Balancer's policy (default: its own, :class:`hetlb.LBB`).
        balancer_kwargs: more :class:`hetlb.Balancer` arguments (``lower``, ``emulator``,
            ``weighting``, ...), less the model, the global batch, the policy and the loader.
        loader_kwargs: more :class:`hetlb.DataLoader` arguments (``sample_sizes`` for
            :class:`hetlb.Chronica`, ...); they take precedence over those derived from the
            training arguments.

    Attributes:
        balancer: the :class:`hetlb.Balancer` of the current ``train()``, from its first batch on
            (None before).
    """

    def __init__(self, *args: Any, policy: Any = None,
                 balancer_kwargs: Optional[Dict[str, Any]] = None,
                 loader_kwargs: Optional[Dict[str, Any]] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.args.n_gpu > 1:
            raise ValueError("hetlb: BalancedTrainer runs one process per GPU (torchrun, DDP); "
                             "this process sees several GPUs and would use DataParallel: launch "
                             "with torchrun --nproc-per-node=<GPUs>")
        if self.args.auto_find_batch_size:
            raise ValueError("hetlb: BalancedTrainer does not support auto_find_batch_size (each "
                             "retry trains the DDP model again, and the Balancer sizes the "
                             "batches): set per_device_train_batch_size, and hetlb.profile finds "
                             "each rank's largest batch")
        if self.loss_is_scaled_for_ga is not None:
            raise ValueError("hetlb: BalancedTrainer measures how the loss is normalised (see "
                             "hetlb.integrations.transformers); leave loss_is_scaled_for_ga "
                             "unset (None)")
        if not self.args.ignore_data_skip or not self.args.average_tokens_across_devices:
            self.args = copy.copy(self.args)  # (the caller's arguments stay as they are)
            # hetlb's loader resumes at its own position: the Trainer must not skip batches too
            self.args.ignore_data_skip = True
        if not self.args.average_tokens_across_devices:
            log.info("hetlb: training counts the step's items over all ranks as "
                     "average_tokens_across_devices=True does (each rank's token mean weighed by "
                     "its share of the step's tokens is the step's token mean); evaluation keeps "
                     "the flag as given")
        self.policy = policy
        self.balancer_kwargs = dict(balancer_kwargs or {})
        self.loader_kwargs = dict(loader_kwargs or {})
        for key in ("model", "global_batch", "policy", "loader", "accumulate"):
            if key in self.balancer_kwargs:
                raise ValueError(f"hetlb: balancer_kwargs must not hold {key!r}: BalancedTrainer "
                                 f"passes it (policy= is an argument of its own)")
        self.balancer: Optional[Balancer] = None
        self._train_loader: Optional[TrainerLoader] = None
        self._resume: Optional[str] = None
        self._probe: Optional[Dict[str, Any]] = None  # a batch of the dataset's first samples
        self.add_callback(SaveBalance)

    def train(self, resume_from_checkpoint: Any = None, trial: Any = None, *args: Any,
              **kwargs: Any) -> Any:
        """``Trainer.train``; a checkpoint resumed from must hold the Balancer's state
        (:data:`STATE_FILE`, written by this trainer)."""
        if trial is not None:
            raise ValueError("hetlb: BalancedTrainer does not support hyperparameter search")
        if self.balancer is not None and self.model_wrapped is not self.model:
            raise RuntimeError(
                "hetlb: this BalancedTrainer has trained its DDP model once, and DDP keeps the "
                "Balancer's communication hook for the model's life. For another train() (a "
                "resume too), make a new BalancedTrainer with model=trainer.model (the module "
                "inside the DDP wrapper): it is wrapped anew")
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True
        if isinstance(resume_from_checkpoint, os.PathLike):
            resume_from_checkpoint = os.fspath(resume_from_checkpoint)
        self._resume = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        return super().train(resume_from_checkpoint, trial, *args, **kwargs)

    def hyperparameter_search(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: each trial would train the DDP model again (see :meth:`train`)."""
        raise ValueError("hetlb: BalancedTrainer does not support hyperparameter search")

    def get_train_dataloader(self) -> TrainerLoader:
        """The training loader: a :class:`hetlb.DataLoader` with the whole epoch's length (and the
        resumed checkpoint's state, applied when the Balancer binds it)."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        a = self.args
        dataset, collate = self.train_dataset, self.data_collator
        if _is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        kwargs: Dict[str, Any] = dict(
            collate_fn=collate, num_workers=a.dataloader_num_workers,
            pin_memory=a.dataloader_pin_memory, persistent_workers=a.dataloader_persistent_workers,
            prefetch_factor=a.dataloader_prefetch_factor,
            multiprocessing_context=a.dataloader_multiprocessing_context,
            in_order=a.dataloader_in_order,
            worker_init_fn=partial(seed_worker, num_workers=a.dataloader_num_workers,
                                   rank=a.process_index),
            seed=a.data_seed if a.data_seed is not None else a.seed,
            drop_last=a.dataloader_drop_last)
        kwargs.update(self.loader_kwargs)
        loader = BalancedLoader(dataset, a.per_device_train_batch_size, **kwargs)
        check_windows(len(dataset), a.per_device_train_batch_size * a.world_size,
                      loader.order.drop_last, a.gradient_accumulation_steps,
                      "gradient_accumulation_steps", "dataloader_drop_last=True")
        short = len(dataset) % (a.per_device_train_batch_size * a.world_size)
        if not loader.order.drop_last and 0 < short < a.world_size:
            log.warning("hetlb: the epoch's last step has %d sample(s) for %d ranks: a rank gets "
                        "an empty batch there, which transformers' models refuse; set "
                        "dataloader_drop_last=True", short, a.world_size)
        k, spe = a.gradient_accumulation_steps, loader.order.steps_per_epoch
        if k > 1 and spe % k and a.save_strategy != "no":
            log.warning("hetlb: the epoch's last accumulation window is short (%d of "
                        "gradient_accumulation_steps=%d): a checkpoint taken inside an epoch "
                        "cannot be resumed (only one at an epoch's end); make the epoch's "
                        "steps a multiple of %d to resume anywhere", spe % k, k, k)
        if self._resume is not None:
            loader.load_state_dict(_read_state(self._resume))
        first = [dataset[i] for i in range(min(len(dataset), 4))]
        self._probe = (kwargs["collate_fn"] or torch.utils.data.default_collate)(first)
        self.balancer = None
        self._train_loader = TrainerLoader(loader)
        return self._train_loader

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int,
                          device: torch.device) -> Any:
        """``Trainer.get_batch_samples``, making the Balancer before the first batch and checking
        each step's weighting against the Trainer's loss normalisation."""
        if self.balancer is None:
            self.balancer = self._make_balancer()
        with self._items_across_ranks():
            batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if batches:
            why = _loss_mismatch(self.balancer.weighting, items)
            if why is not None:
                raise ValueError(f"hetlb: {why}")
        return batches, items

    def training_step(self, model: torch.nn.Module, inputs: Dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """``Trainer.training_step``; a model that refuses this rank's empty batch (a rank given
        no samples still runs its forward and backward: DDP's all-reduce needs every rank) gets
        an error saying so."""
        with self._items_across_ranks():
            return self._training_step(model, inputs, num_items_in_batch)

    @contextlib.contextmanager
    def _items_across_ranks(self) -> Iterator[None]:
        """Training's item counts and losses as under ``average_tokens_across_devices=True``
        (see the module docstring), whatever the flag says; evaluation keeps it as given."""
        args = self.args
        given, args.average_tokens_across_devices = args.average_tokens_across_devices, True
        try:
            yield
        finally:
            args.average_tokens_across_devices = given

    def _training_step(self, model: torch.nn.Module, inputs: Dict[str, Any],
                       num_items_in_batch: Any) -> torch.Tensor:
        k = self.args.gradient_accumulation_steps
        try:
            if k == 1:
                return super().training_step(model, inputs, num_items_in_batch)
            length = self.current_gradient_accumulation_steps  # (this window's, set by the Trainer)
            if length < k:  # normalised as a whole window's, as the Balancer's weight expects
                if num_items_in_batch is not None:
                    num_items_in_batch = num_items_in_batch * (k / length)
                self.current_gradient_accumulation_steps = k
            try:
                with self.balancer.step():  # (a micro-step of the window: no_sync but on its last)
                    return super().training_step(model, inputs, num_items_in_batch)
            finally:
                self.current_gradient_accumulation_steps = length
        except RuntimeError as e:
            if not _empty(inputs) or str(e).startswith("hetlb:"):  # (hetlb's own says what to do)
                raise
            raise RuntimeError(
                "hetlb: the model refused this rank's empty batch. The Balancer gave the rank no "
                "samples this step (balancer_kwargs lower=0, or the epoch's short last step has "
                "fewer samples than ranks), and every rank must still run its forward and "
                "backward for DDP's all-reduce. Keep lower >= 1 (the default) and set "
                "dataloader_drop_last=True, or make the model take a batch of 0 samples") from e

    def _make_balancer(self) -> Balancer:
        if self._train_loader is None:
            raise RuntimeError("hetlb: BalancedTrainer draws batches only from the loader of its "
                               "get_train_dataloader()")
        kwargs = dict(self.balancer_kwargs)
        if "weighting" not in kwargs:
            by_items = self.model_accepts_loss_kwargs or self.compute_loss_func is not None
            if by_items and not self._divides_by_items():
                if self.compute_loss_func is not None:
                    raise ValueError(
                        "hetlb: the compute_loss_func ignores num_items_in_batch, and the Trainer "
                        "takes its loss for one normalised over the accumulation window (it "
                        "neither divides it by the window's length nor lets DDP's mean stand). "
                        "Divide the summed loss by num_items_in_batch, or drop compute_loss_func "
                        "and return each batch's mean loss from compute_loss")
                log.info("hetlb: the model's loss ignores num_items_in_batch (each batch's "
                         "mean): the Trainer stops passing it (model_accepts_loss_kwargs=False) "
                         "and the Balancer weighs each rank by its share of the step")
                self.model_accepts_loss_kwargs = by_items = False
            kwargs["weighting"] = "world" if by_items else "samples"
        loader = self._train_loader.loader
        bal = Balancer(self.model_wrapped, self.args.per_device_train_batch_size * self.args.world_size,
                       self.policy, loader=loader, accumulate=self.args.gradient_accumulation_steps,
                       **kwargs)
        k, spe = self.args.gradient_accumulation_steps, loader.order.steps_per_epoch
        left = len(loader)
        if k > 1 and spe % k and 0 < left < spe:
            raise ValueError(
                f"hetlb: this checkpoint stopped inside an epoch ({left} of its {spe} batches "
                f"left) whose last accumulation window is short ({spe % k} of "
                f"gradient_accumulation_steps={k}). The Trainer counts a resumed epoch's batches "
                f"from 0 (its own skip is off: hetlb's loader resumes at its position), so it "
                f"would never step the optimizer after that window. Resume from a checkpoint at "
                f"an epoch's end, or train with epochs of whole windows (dataloader_drop_last=True "
                f"and a number of steps per epoch that {k} divides)")
        if bal.steps != self.state.global_step:
            raise ValueError(
                f"hetlb: the Balancer's state is at step {bal.steps} and the Trainer's at "
                f"{self.state.global_step}: the checkpoint's {STATE_FILE} is not of the same run "
                f"and step as its trainer_state.json")
        return bal

    def _divides_by_items(self) -> bool:
        """Whether the training loss is divided by ``num_items_in_batch``: the loss of the
        dataset's first samples (the model in eval mode, no gradient) through ``compute_loss``
        with two item counts."""
        if self._probe is None:
            raise RuntimeError("hetlb: BalancedTrainer draws batches only from the loader of its "
                               "get_train_dataloader()")
        model, was_training = self.model, self.model.training
        model.eval()
        try:
            with torch.no_grad():
                losses = []
                for items in (3.0, 6.0):
                    inputs = self._prepare_inputs(dict(self._probe))
                    count = torch.tensor(items, device=self.args.device)
                    got = self.compute_loss(model, inputs, num_items_in_batch=count)
                    losses.append(float((got[0] if isinstance(got, tuple) else got).detach()))
        finally:
            model.train(was_training)
        ratio = losses[0] / losses[1] if losses[1] else float("nan")
        if abs(ratio - 2.0) < 0.05:
            return True
        if abs(ratio - 1.0) < 0.05:
            return False
        raise ValueError(
            f"hetlb: cannot tell how the training loss is normalised: on the dataset's first "
            f"samples it is {losses[0]!r} with num_items_in_batch=3 and {losses[1]!r} with 6 (a "
            f"loss divided by it halves, a batch mean stays the same). Pass "
            f"balancer_kwargs={{'weighting': 'world'}} if it is divided by num_items_in_batch, "
            f"else 'samples' (and set trainer.model_accepts_loss_kwargs = False)")


def _is_hf_dataset(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)


def _empty(inputs: Any) -> bool:
    """Whether a collated batch holds no samples (its tensors have 0 rows)."""
    if not isinstance(inputs, Mapping):
        return False
    rows = [v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return bool(rows) and max(rows) == 0


def _read_state(folder: str) -> Dict[str, Any]:
    path = os.path.join(folder, STATE_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"hetlb: the checkpoint {folder} has no {STATE_FILE}, the Balancer's state with the "
            f"data position: it was not written by BalancedTrainer. Resuming without it would "
            f"train the batches of the interrupted epoch again; resume from a checkpoint of a "
            f"BalancedTrainer run, or start anew")
    return torch.load(path, weights_only=True)
