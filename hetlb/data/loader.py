"""The balanced DataLoader: this rank's slice of each global batch, in the order the board draws.

The sizes of a step are fixed when its indices are drawn (:class:`hetlb.data.board.PlanBoard`). A
DataLoader with workers draws ``num_workers * prefetch_factor`` batches ahead, so a decision made at
the end of step ``t`` is used from step ``t + 1 + lag`` on, with ``lag`` that prefetch depth (0
without workers). The draw happens at the same point of the program on every rank, so every rank
uses the same sizes; the Balancer verifies it each step against the sizes the ranks report.

What counts as consumed: a batch counts once a training step has run on it (its backward, or its
``with bal.step():`` block). A batch handed out and not trained, as by a peek such as
``next(iter(loader))``, a checkpoint taken at the top of the loop body or a loop left with batches
fetched ahead, is handed out again by the next iteration or after a resume.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate

from hetlb.core.checks import flag, integer
from hetlb.data.board import PlanBoard
from hetlb.data.collate import EmptySafeCollate
from hetlb.data.early import check_loader_config
from hetlb.data.handout import Board
from hetlb.data.porting import StraySamplers, warn_unbound_training, warn_unshuffled
from hetlb.data.protocol import Stateful, StepOwner
from hetlb.data.sampler import (GlobalOrderSampler, MAX_SEED, RankSampler, check_sample_sizes,
                                dataset_sample_sizes)
from hetlb.data.shards import Migration, Partition, even_partition


__all__ = ["BalancedLoader", "check_loader_config"]

_REFUSED = {
    "sampler": "hetlb draws every step's indices itself (the global order); drop sampler= and pass "
               "shuffle=, seed= and drop_last= to the loader instead",
    "batch_sampler": "hetlb draws every step's indices itself (the global order); drop batch_sampler=",
    "generator": "the permutation of each epoch is seeded by seed + epoch (the same on every "
                 "rank); pass seed= instead of generator=",
    "sizes": "per-sample data amounts are called sample_sizes= (sizes means per-rank batch sizes "
             "in hetlb)",
}


def _refuse_non_numbers(values: Any, n: int) -> None:
    """Refuse strings and bools among per-sample sizes (NumPy would read ``"1"`` as 1.0)."""
    if isinstance(values, torch.Tensor):
        if values.dtype == torch.bool:
            raise ValueError(f"sample_sizes must be {n} numbers (one per sample), got a bool tensor")
        return
    try:
        raw = np.asarray(values)
    except (TypeError, ValueError):
        return  # ragged or odd: the float conversion that follows says what is wrong
    if raw.dtype.kind in "USb" or (raw.dtype.kind == "O" and any(
            isinstance(v, (str, bytes, bool, np.bool_)) for v in raw.ravel().tolist())):
        bad = next((v for v in raw.ravel().tolist() if isinstance(v, (str, bytes, bool))), raw.dtype)
        raise ValueError(f"sample_sizes must be {n} numbers (one per sample), got {bad!r}: strings "
                         f"and bools are not taken for numbers")


class BalancedLoader:
    """This rank's batches of every step, sized by a :class:`hetlb.Balancer`; a thin shell over a
    ``torch.utils.data.DataLoader``. Public as ``hetlb.DataLoader``.

    Made by :meth:`hetlb.Balancer.loader`, or directly (before the model exists, as a DataLoader
    often is) and then bound with ``hetlb.Balancer(ddp_model, loader=loader)``. Iterating yields
    what the DataLoader yields (collated batches, empty ones for a rank given no samples);
    ``set_epoch`` (also ``loader.sampler.set_epoch``) selects the permutation; ``state_dict`` /
    ``load_state_dict`` save and restore the Balancer with the data position (one checkpoint
    object, also when resumed on a different world size).

    A loader no Balancer is bound to iterates as a plain distributed evaluation loader: each step
    of ``batch_size * world`` samples of the epoch's order split evenly over the ranks (within one
    sample), every sample once and every rank the same number of steps; the position does not
    move. So a script's test-set loader made by the same helper as its training loader works.

    Args:
        dataset: a map-style dataset.
        batch_size: samples per rank and step *on average*: the global batch is ``batch_size *
            world``. Optional with :meth:`hetlb.Balancer.loader` (which knows the global batch;
            if given it must equal ``global_batch / world``).
        shuffle, seed, drop_last: the permutation of each epoch (``seed + epoch``) and whether to
            drop the short last step. ``seed`` must be the same on every rank (checked).
        sample_sizes: per-sample data amounts (frames, tokens), required for
            ``weighting="sizes"`` and read by size-aware policies (:class:`hetlb.Chronica`).
            Default: the dataset's own, from a ``sample_size(index)`` method, or from a
            ``__sizeof__(index)`` override taking an index (datasets written for CHRONICA's
            released code); else none.
        partition: sharded mode (see :mod:`hetlb.data.shards`): each rank reads only the samples it
            holds. ``"even"`` (a seeded permutation cut into equal data per rank) or the rank
            holding each sample (int ``[N]``, the same on every rank; e.g. where the files lie).
            Default None: the global order, every rank reads any sample.
        rebalance: sharded mode: move the fewest samples at the end of every epoch so the
            predicted epoch times are equal (CHRONICA's shuffler; :attr:`migration`).
        **dataloader_kwargs: passed to ``torch.utils.data.DataLoader`` (num_workers,
            collate_fn, pin_memory, prefetch_factor, persistent_workers, ...).
    """

    def __init__(self, dataset: Any, batch_size: Optional[int] = None, shuffle: bool = True, *,
                 sample_sizes: Optional[Any] = None, seed: int = 0, drop_last: bool = False,
                 partition: Any = None, rebalance: bool = True,
                 board: Optional[Board] = None, **dataloader_kwargs: Any) -> None:
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise TypeError("hetlb loader: the dataset must be map-style (__getitem__ and "
                            "__len__): the Balancer assigns each step's samples to ranks by "
                            "index, and an IterableDataset cannot be indexed. Wrap the data in a "
                            "map-style dataset")
        shuffle, drop_last = flag(shuffle, "shuffle"), flag(drop_last, "drop_last")
        rebalance = flag(rebalance, "rebalance")
        seed = integer(seed, "seed", 0, MAX_SEED)
        for key, why in _REFUSED.items():
            if key in dataloader_kwargs:
                raise ValueError(f"hetlb loader: {key}= is not accepted: {why}")
        if dataloader_kwargs.get("in_order") is False:
            raise ValueError("hetlb loader: in_order=False is not accepted: each batch must arrive "
                             "with the plan it was drawn for")
        if batch_size is not None:
            batch_size = integer(batch_size, "batch_size", 1)
        if board is None:
            board = _board_from_process_group(batch_size)
        elif batch_size is not None and batch_size * board.world != board.global_batch:
            avg = board.global_batch / board.world
            raise ValueError(
                f"batch_size={batch_size} is not the Balancer's per-rank average "
                f"global_batch / world = {board.global_batch} / {board.world} = {avg:g}; the "
                f"Balancer sets every rank's size each step. Leave batch_size out, or make "
                f"global_batch = batch_size * world")
        n = len(dataset)
        if sample_sizes is None:
            sample_sizes = dataset_sample_sizes(dataset)
        if sample_sizes is not None:
            _refuse_non_numbers(sample_sizes, n)
            try:
                # The loader's own read-only copy: sizes changed in place later would change the
                # plans (and a sharded epoch's steps) under a running epoch.
                sample_sizes = np.array(sample_sizes, dtype=np.float64)
            except (TypeError, ValueError) as e:
                raise ValueError(f"sample_sizes must be {n} numbers (one per sample): {e}") from None
            if sample_sizes.shape != (n,):
                raise ValueError(f"sample_sizes must be {n} finite non-negative numbers (one per "
                                 f"sample), got shape {sample_sizes.shape}")
            check_sample_sizes(sample_sizes, "sample_sizes")
            sample_sizes.flags.writeable = False
        if partition is not None:
            _shard(board, partition, rebalance, n, sample_sizes, seed, shuffle, drop_last)
        self.dataset = dataset
        self.batch_size = batch_size
        self.sample_sizes = sample_sizes
        #: The global order this loader's steps are drawn from (its batch sampler).
        self.order = GlobalOrderSampler(n, board, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                        sample_sizes=sample_sizes)
        #: What scripts read of a ``DistributedSampler`` (see :class:`RankSampler`).
        self.sampler = RankSampler(self.order, dataset)
        self.board = board
        self._state: Optional[Stateful] = None  # owns the checkpoint state (see bind)
        # DistributedSamplers over the dataset that no loader reads, found by the first training
        # iteration (see hetlb.data.porting)
        self._strays: Optional[StraySamplers] = None
        self._said_unbound = False  # an evaluation iteration with gradients enabled was named
        collate = dataloader_kwargs.pop("collate_fn", None) or default_collate
        self._steps = _Steps(self.order)
        self._dl = DataLoader(dataset, batch_sampler=self._steps,
                              collate_fn=EmptySafeCollate(dataset, collate), **dataloader_kwargs)

    @property
    def _owner(self) -> Optional[StepOwner]:
        """What runs the steps of the batches (see :meth:`bind`), or None."""
        return self.order.owner

    @property
    def sharded(self) -> bool:
        """Whether each rank reads only its own partition (``partition=``)."""
        return self.board.partition is not None

    @property
    def owners(self) -> np.ndarray:
        """Sharded mode: int64 ``[N]`` the rank holding each sample now (before a pending
        :attr:`migration`)."""
        return self._partition().home.copy()

    @property
    def shard(self) -> np.ndarray:
        """Sharded mode: the samples this rank holds now (int64, increasing)."""
        return np.flatnonzero(self._partition().home == self.board.rank)

    @property
    def migration(self) -> Optional[Migration]:
        """Sharded mode: the moves decided for the next epoch (sample, source, target), or None
        when nothing moves. Set when an epoch ends (and when a checkpoint is resumed on another
        world size); applied when the next iteration starts, so move the files in between:
        ``migration.incoming(rank)`` and ``migration.outgoing(rank)``."""
        m = self._partition().pending
        return m if m is not None and len(m) else None

    def _partition(self) -> Partition:
        if self.board.partition is None:
            raise AttributeError("this loader is not sharded (pass partition= to the loader)")
        return self.board.partition

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to (after a complete epoch: the next one), so
        ``for epoch in range(loader.epoch, epochs)`` resumes where a checkpoint stopped."""
        if self._owner is not None:
            self._owner.settle()
        b = self.board
        return b.epoch + 1 if b.epoch_finished() else b.epoch

    def __len__(self) -> int:
        """Steps the next iteration runs (the rest of a partly trained epoch, else a whole one;
        a step whose backward ran counts as trained)."""
        if self._owner is not None:
            self._owner.settle()
        return len(self.order)

    @property
    def lag(self) -> int:
        """Steps between a decision and the first step that uses it (the prefetch depth)."""
        if self._dl.num_workers == 0:
            return 0
        return self._dl.num_workers * (self._dl.prefetch_factor or 2)

    @property
    def balancer(self) -> Optional[Stateful]:
        """The Balancer (or DelayedSync) this loader is bound to, or None (an evaluation loader)."""
        return self._state

    def bind(self, steps: StepOwner, state: Stateful) -> Optional[Dict[str, Any]]:
        """Bind the loader for training: ``steps`` runs the steps of its batches, ``state`` owns
        its checkpoint state. A checkpoint loaded before binding is applied here
        (:meth:`hetlb.data.handout.Board.bind`, which refuses one of another order); returns its
        part for ``state`` to load (None if there is none). Called by the Balancer and
        DelayedSync."""
        if self._state is not None:
            raise ValueError("this loader is already bound to a Balancer")
        pending = self.board.bind(self.order.config())
        self.order.owner, self._state = steps, state
        if not self.order.shuffle:
            warn_unshuffled(self.board.rank)
        return pending

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's permutation, as ``DistributedSampler.set_epoch``.

        A partly trained epoch keeps its position when selected again. Epochs run in order and
        each once: selecting an epoch that is already complete, or an earlier one, raises, and
        so does skipping the rest of the epoch a loaded checkpoint stopped in; that is how a
        script whose epoch counter disagrees with the checkpoint finds out. Like
        ``DistributedSampler.set_epoch``, it is for the next loop: a ``for`` loop still running over
        an epoch with steps left raises at its next batch.
        """
        self.order.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        n = len(self.dataset)
        if n != self.order.length:
            raise ValueError(
                f"len(dataset) is {n} now, {self.order.length} when this loader was made: the "
                f"loader's global order (every rank's, and the checkpoint's position) covers the "
                f"first {self.order.length} samples, so the dataset must not change length under "
                f"it. To train on the changed dataset, checkpoint at the end of an epoch and make a "
                f"new Balancer and loader over it (in a restarted job); the checkpoint resumes "
                f"there at the next epoch")
        if self._owner is None:
            return self._evaluation()
        return _Iteration(self)

    def _evaluation(self) -> Iterator[Any]:
        """A loader no Balancer is bound to iterates as a plain distributed evaluation loader
        (:meth:`GlobalOrderSampler.evaluation`): a test set's loader made by the same helper as
        the training loader works without a Balancer of its own."""
        if self.board.holds_checkpoint():
            raise RuntimeError(
                "this hetlb loader holds a loaded checkpoint and is not bound to a Balancer yet: "
                "make the Balancer with hetlb.Balancer(ddp_model, loader=loader) before iterating "
                "(an unbound hetlb.DataLoader iterates as an evaluation loader, which reads no "
                "checkpoint)")
        if self.board.partition is not None:
            raise RuntimeError(
                "this sharded hetlb loader (partition=) is not bound to a Balancer: each rank "
                "holds only its shard, so it cannot serve as an evaluation loader. Bind it with "
                "hetlb.Balancer(ddp_model, loader=loader), or evaluate with a loader without "
                "partition=")
        if torch.is_grad_enabled() and not self._said_unbound:
            self._said_unbound = True
            warn_unbound_training(self.board.rank)
        self._steps.evaluating = True
        try:  # the DataLoader asks its batch sampler for an iterator here, and only here
            return iter(self._dl)
        finally:
            self._steps.evaluating = False

    def state_dict(self) -> Dict[str, Any]:
        """The whole Balancer state with the data position (the same object as
        :meth:`hetlb.Balancer.state_dict`, which one rank may take alone). A
        :class:`hetlb.DelayedSync` loader's is :meth:`hetlb.DelayedSync.state_dict`, which flushes:
        a collective every rank must call at the same update."""
        if self._state is not None:
            return self._state.state_dict()
        pending = self.board.owner_state()
        if pending is not None:
            return pending
        return {"position": self.board.position(), "loader": self.order.config()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` (or the Balancer's: they are the same); before
        the loader is bound, the Balancer part is kept until it is. Loading twice is harmless.

        A state taken in the middle of an epoch needs the same dataset, shuffle, seed and
        drop_last (and the same global batch, and ``partition=`` set or not as then); a state
        taken at an epoch boundary resumes over another dataset at the next epoch. Another world
        size is always fine. Anything else is a ValueError naming the field and both values."""
        if self._state is not None:
            self._state.load_state_dict(state)
            return
        if not isinstance(state, dict) or "position" not in state:
            got = f"a dict with keys {sorted(state)}" if isinstance(state, dict) else type(state).__name__
            raise ValueError("not a hetlb loader state (loader.state_dict() or bal.state_dict(): a "
                             f"dict with a 'position'), got {got}")
        check_loader_config(state, self.order.config())
        pos = state["position"]
        if "policy" in state and isinstance(pos, dict) and pos.get("global_batch") != self.board.global_batch:
            # A Balancer's state of another global batch: its Balancer converts the position
            # when it binds this loader (or refuses it, naming why)
            self.board.keep_for_owner(state)
            return
        self.board.load_position(pos)
        self.board.keep_for_owner(state if "policy" in state else None)


def _shard(board: Board, partition: Any, rebalance: bool, n: int,
           sample_sizes: Optional[np.ndarray], seed: int, shuffle: bool, drop_last: bool) -> None:
    """Put the board in sharded mode (see :mod:`hetlb.data.shards`)."""
    if not isinstance(board, PlanBoard):
        raise ValueError("partition= is for balanced steps; a stream shards the epoch itself")
    if board.accumulate > 1:
        raise ValueError("partition= cannot run with gradient accumulation (accumulate > 1): a "
                         "sharded step's sizes follow the shards, not a window's decision")
    if drop_last:
        raise ValueError("partition= with drop_last=True is not supported: a sharded epoch trains "
                         "every sample of every shard (drop samples from the partition instead)")
    work = np.ones(n) if sample_sizes is None else sample_sizes
    if isinstance(partition, str):
        if partition != "even":
            raise ValueError(f"partition must be 'even' or one rank per sample, got {partition!r}")
        home = even_partition(work, board.world, seed)
    else:
        home = partition
    board.set_partition(Partition(home, board.world, board.global_batch, work, seed=seed,
                                  shuffle=shuffle, rebalance=rebalance, sized=sample_sizes is not None))


def _board_from_process_group(batch_size: Optional[int]) -> PlanBoard:
    import torch.distributed as dist
    if batch_size is None:
        raise ValueError("hetlb.DataLoader needs batch_size= (the per-rank average) when made "
                         "before its Balancer; or make it with bal.loader(dataset, ...)")
    on = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if on else 1
    rank = dist.get_rank() if on else 0
    return PlanBoard(world, rank, batch_size * world)


class _Iteration:
    """One pass over a :class:`BalancedLoader`: hands out batches with their plans and marks the
    step boundaries for the Balancer."""

    def __init__(self, loader: BalancedLoader) -> None:
        self._owner = loader._owner
        self._board = loader.board
        self._owner.iteration_starts()
        self._board.restart()
        self._generation = self._board.generation
        self._iteration = self._board.iteration
        self._epoch = self._board.epoch
        if loader._strays is None:
            loader._strays = StraySamplers(loader.dataset, self._board.rank)
        loader._strays.check(self._epoch)
        self._dl = loader._dl
        self._it = iter(self._dl)
        self._collate = loader._dl.collate_fn
        self._done = False

    def __iter__(self) -> "_Iteration":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        if self._board.generation != self._generation:
            raise RuntimeError("the loader's state was loaded while this iteration was running; "
                               "start a new `for` loop over the loader")
        if self._board.iteration != self._iteration:
            self._done, self._it = True, None
            raise RuntimeError(
                "a newer iteration over this loader started (another `for` loop or iter(loader)) "
                "while this one was running; it went on from the position, so this older "
                "iterator cannot go on (its next batches would repeat the newer one's samples). "
                "Use one loop over the loader at a time (a loop for evaluation needs a loader "
                "of its own)")
        if self._board.epoch != self._epoch:
            return self._epoch_left()
        self._owner.before_next()
        try:
            if self._it is None:
                raise StopIteration
            batch = next(self._it)
        except StopIteration:
            self._it = None  # a DataLoader iterator is not asked again once it has stopped
            # Delayed sync: a rank whose shard is used up gets empty batches (its steps take
            # part in the iterations) until every rank's shard is trained and applied; then the
            # epoch's next round starts, or the epoch ends.
            what = self._owner.exhausted()
            if what == "empty":
                return self._empty()
            if what == "round":
                self._it = iter(self._dl)
                return next(self)
            self._done = True
            self._board.ran_out = True
            raise
        self._owner.handed(self._board.hand())
        return batch

    def _epoch_left(self) -> Any:
        """``set_epoch`` moved the loader off this iteration's epoch while it ran: the loop ends
        if that epoch had nothing left to hand out, and otherwise refuses to go on (its batches
        would train outside any epoch the position counts)."""
        board = self._board
        if board.left == (self._epoch, True):
            self._owner.before_next()  # the last step counts, as at the end of any loop
            self._done, self._it = True, None
            raise StopIteration
        raise RuntimeError(
            f"set_epoch({board.epoch}) was called inside a `for` loop over epoch {self._epoch}, "
            f"which had steps left: that loop cannot go on. Call set_epoch before the loop "
            f"(`for epoch in range(loader.epoch, E): loader.set_epoch(epoch); for batch in "
            f"loader: ...`), or leave the loop (`break`) before moving to the next epoch")

    def _empty(self) -> Any:
        # The collate's own batch of no samples (one sample collated once and twice): a tensor
        # shared by the samples (a mask) stays whole, which cutting the last batch would not do.
        return self._collate([])


class _Steps:
    """The DataLoader's batch sampler: the sampler's steps, or an evaluation pass while
    ``evaluating`` (it holds nothing else, so no cycle runs through the DataLoader and a
    persistent-workers iterator is freed promptly)."""

    def __init__(self, sampler: GlobalOrderSampler) -> None:
        self.sampler = sampler
        self.evaluating = False

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self) -> Iterator[List[int]]:
        return self.sampler.evaluation() if self.evaluating else iter(self.sampler)
