"""The global-order sampler (docs/architecture.md).

Every rank draws the same permutation of the dataset per epoch (seeded by ``seed + epoch``). Step
``s`` of an epoch takes the next ``global_batch`` indices of the permutation and rank ``r`` takes
its contiguous slice ``[o + sum(B[:r]), o + sum(B[:r+1]))`` (or, for a size-aware step, the
samples the step's schedule assigns it). So each sample is seen exactly once per epoch whatever
the sizes do, and every rank runs ``ceil(N / global_batch)`` steps (``floor`` with ``drop_last``):
uneven inputs never hang DDP. The short last step is split by the current shares.

The dataset is fixed under a loader: its length is checked whenever an iteration starts, and a
checkpoint taken in the middle of an epoch resumes only over the same global order (length,
sample sizes, shuffle, seed, drop_last; a ValueError names what differs). A checkpoint taken at
an epoch boundary (before the epoch's first step, or one that closed its epoch) resumes over any
dataset at the next epoch: that is how a job moves onto a dataset that changed.
"""
from __future__ import annotations

import inspect
import math
import zlib
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch

from hetlb.core.checks import flag, integer
from hetlb.data.board import PlanBoard, StepPlan
from hetlb.data.handout import Board
from hetlb.data.protocol import StepOwner
from hetlb.data.stream import StreamBoard


class GlobalOrderSampler:
    """Batch sampler yielding this rank's indices of every step, drawn from a :class:`PlanBoard`
    (or every reference batch, drawn from a :class:`StreamBoard`).

    Args:
        length: number of samples in the dataset.
        board: the plan board shared with the loader's owner (decisions, position).
        shuffle, seed, drop_last: as in ``DistributedSampler``.
        sample_sizes: float64 ``[length]`` data amount of every sample, or None.
    """

    def __init__(self, length: int, board: Board, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, sample_sizes: Optional[np.ndarray] = None) -> None:
        self.length = integer(length, "dataset length", 0)
        self.board = board
        self.shuffle, self.drop_last = flag(shuffle, "shuffle"), flag(drop_last, "drop_last")
        self.seed = integer(seed, "seed", 0, MAX_SEED)
        self.sample_sizes = sample_sizes
        self._perm: Optional[tuple] = None
        #: What runs the steps of the loader this sampler draws for, once it is bound (settled
        #: before the epoch moves: a step whose backward ran counts in the epoch it trained in).
        self.owner: Optional[StepOwner] = None
        board.attach(self.steps_per_epoch)

    def __getstate__(self) -> Dict[str, Any]:
        # A copy draws for no loop: the owner of steps (and the model it holds) stays behind.
        return {**self.__dict__, "owner": None}

    @property
    def global_batch(self) -> int:
        return self.board.global_batch

    @property
    def full_steps(self) -> int:
        """Steps of an epoch that hold a whole global batch."""
        return self.length // self.global_batch

    @property
    def epoch_length(self) -> int:
        """Samples an epoch trains (``drop_last`` drops the tail short of a global batch)."""
        return self.full_steps * self.global_batch if self.drop_last else self.length

    @property
    def steps_per_epoch(self) -> int:
        if self.board.partition is not None:
            return self.board.partition.steps
        if self.drop_last:
            return self.full_steps
        return math.ceil(self.length / self.global_batch)

    @property
    def epoch(self) -> int:
        return self.board.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (see :meth:`BalancedLoader.set_epoch`)."""
        if self.owner is not None:
            self.owner.settle()  # (a loop that fetched ahead trains its last batch after the end)
        self.board.set_epoch(epoch)

    def __len__(self) -> int:
        spe = self.steps_per_epoch
        if not isinstance(self.board, PlanBoard):  # a stream's position counts no steps
            return spe
        if self.board.epoch_finished():  # the next iteration runs the next epoch, whole
            part = self.board.partition
            return spe if part is None else math.ceil(part.work.size / part.global_batch)
        return max(spe - self.board.done, 0)

    def config(self) -> Dict[str, Any]:
        """What every rank must agree on for the global order to be one order."""
        sizes = self.sample_sizes
        sizes_sum = None if sizes is None else float(np.sum(sizes))
        # The sum alone misses sizes that changed but add up the same (a sharded epoch's steps
        # are cut by the sizes): a CRC of the values too.
        crc = None if sizes is None else zlib.crc32(np.ascontiguousarray(sizes, np.float64).tobytes())
        out = {"length": self.length, "shuffle": self.shuffle, "seed": self.seed,
               "drop_last": self.drop_last, "sample_sizes": sizes_sum, "sample_sizes_crc": crc}
        if self.board.partition is not None:
            # Not the partition itself: a checkpoint carries its own, which takes over on resume
            # (ranks that disagree on it fail the plan checksum of the first step).
            out["sharded"] = True
            out["rebalance"] = self.board.partition.rebalance
        return out

    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's global order (identical on every rank); read-only, cached per epoch."""
        key = (epoch, self.seed, self.shuffle, self.length)
        if self._perm is None or self._perm[0] != key:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + epoch)
                perm = torch.randperm(self.length, generator=g).numpy()
            else:
                perm = np.arange(self.length, dtype=np.int64)
            perm.flags.writeable = False
            self._perm = (key, perm)
        return self._perm[1]

    def step_count(self, step: int) -> int:
        """Samples in step ``step`` of an epoch (the last one may be short)."""
        return min(self.global_batch, self.length - step * self.global_batch)

    def step_indices(self, plan: StepPlan) -> List[np.ndarray]:
        """Every rank's indices of a drawn step (for checks and tests)."""
        part = self.board.partition
        if part is not None:
            return [part.step_indices(plan.epoch, plan.step, r) for r in range(self.board.world)]
        perm = self.permutation(plan.epoch)
        o = plan.step * self.global_batch
        step = perm[o:o + plan.count]
        return [step[plan.positions(r)] for r in range(self.board.world)]

    def __iter__(self) -> Iterator[List[int]]:
        board = self.board
        if isinstance(board, StreamBoard):
            yield from self._stream(board)
            return
        if board.epoch_finished():
            return  # (a new iteration moves on to the next epoch first: PlanBoard.restart)
        epoch, start = board.epoch, board.done
        part = board.partition
        if part is not None:
            for s in range(start, part.steps):
                board.draw_sharded(epoch, s)
                yield part.step_indices(epoch, s, board.rank).tolist()
            return
        perm = self.permutation(epoch)
        full, rank = self.full_steps, board.rank
        for s in range(start, self.steps_per_epoch):
            count = self.step_count(s)
            o = s * self.global_batch
            sizes = None if self.sample_sizes is None else self.sample_sizes[perm[o:o + count]]
            plan = board.draw(epoch, s, count, full, sizes, seed=self.seed)
            if plan.assignment is None and plan.sizes is board.decision:
                # The posted sizes (every whole step): this rank's slice was found once, when
                # they were posted (the step boundary's caches are cold; a NumPy call costs).
                begin, end = board.span
                yield perm[o + begin:o + end].tolist()
            else:
                yield perm[o:o + count][plan.positions(rank)].tolist()

    def evaluation(self) -> Iterator[List[int]]:
        """This rank's indices of every step of an evaluation pass over the epoch's order: each
        step's samples split evenly (the first ``count % world`` ranks one more), so every sample
        is read once across the ranks and every rank runs the same number of steps. Reads the
        order only; the position does not move."""
        board = self.board
        perm = self.permutation(board.epoch)
        world, rank = board.world, board.rank
        for s in range(self.steps_per_epoch):
            count = self.step_count(s)
            q, rem = divmod(count, world)
            begin = s * self.global_batch + rank * q + min(rank, rem)
            yield perm[begin:begin + q + (rank < rem)].tolist()

    def _stream(self, board: StreamBoard) -> Iterator[List[int]]:
        """This rank's reference batches of its shard (see :mod:`hetlb.data.stream`)."""
        perm = self.permutation(board.epoch)
        length = self.epoch_length
        base = board.stream_offset()
        while True:
            plan = board.draw_stream(length)
            if plan is None:
                return
            idx = perm[base + plan.start:base + plan.start + plan.count]
            if self.sample_sizes is not None:
                object.__setattr__(plan, "data", float(self.sample_sizes[idx].sum()))
            yield idx.tolist()


class RankSampler:
    """``loader.sampler`` of a :class:`hetlb.DataLoader`: what scripts read of the
    ``DistributedSampler`` of a loader, over the loader's global order.

    ``len(loader.sampler)`` is the samples per rank of an epoch as ``DistributedSampler`` counts
    them, ``ceil(N / world)`` (``N`` the samples an epoch reads: the dataset, less the short last
    step with ``drop_last``), the same on every rank; ``len(loader)`` is the loader's steps. A
    loader bound to no Balancer (an evaluation loader) reads exactly that many samples on some
    ranks and one fewer on the others, every sample once and none repeated to pad, so a script's
    "leftover" pass over ``len(loader.sampler) * world`` onward finds nothing left. A loader bound
    to a Balancer reads what the Balancer's sizes give each rank: ``N / world`` on average, never
    a fixed count. ``set_epoch``, ``epoch``, ``num_replicas``, ``rank``, ``shuffle``, ``seed``,
    ``drop_last``, ``num_samples``, ``total_size`` and ``dataset`` are ``DistributedSampler``'s.
    It draws no indices: iterate the loader.
    """

    def __init__(self, order: GlobalOrderSampler, dataset: Any) -> None:
        self.order, self.dataset = order, dataset

    @property
    def num_replicas(self) -> int:
        return self.order.board.world

    @property
    def rank(self) -> int:
        return self.order.board.rank

    @property
    def epoch(self) -> int:
        return self.order.board.epoch

    @property
    def shuffle(self) -> bool:
        return self.order.shuffle

    @property
    def seed(self) -> int:
        return self.order.seed

    @property
    def drop_last(self) -> bool:
        return self.order.drop_last

    @property
    def num_samples(self) -> int:
        """Samples per rank of an epoch, ``ceil(N / world)``."""
        return -(-self.order.epoch_length // self.num_replicas)

    @property
    def total_size(self) -> int:
        """``num_samples * world``, as ``DistributedSampler`` has it (at least ``N``)."""
        return self.num_samples * self.num_replicas

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (see :meth:`hetlb.data.loader.BalancedLoader.set_epoch`)."""
        self.order.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        raise TypeError("loader.sampler of a hetlb.DataLoader describes its split of the global "
                        "order (len, set_epoch, num_replicas, rank) and draws no indices: "
                        "iterate the loader itself")


def dataset_sample_sizes(dataset: Any) -> Optional[np.ndarray]:
    """Per-sample data amounts a dataset declares itself, or None: a ``sample_size(index)``
    method, or (CHRONICA's convention) ``__sizeof__`` overridden to take an index. Every object has
    a plain ``__sizeof__()``; only one whose signature takes an index counts."""
    fn = getattr(dataset, "sample_size", None)
    name = f"{type(dataset).__name__}.sample_size(index)"
    if fn is None:
        sizeof = type(dataset).__sizeof__
        if sizeof is object.__sizeof__:
            return None
        try:
            params = list(inspect.signature(sizeof).parameters.values())[1:]
        except (TypeError, ValueError):  # a builtin's __sizeof__: no index
            return None
        if not params or params[0].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                                inspect.Parameter.POSITIONAL_OR_KEYWORD):
            return None
        fn = dataset.__sizeof__
        name = f"{type(dataset).__name__}.__sizeof__(index)"
    elif not callable(fn):
        raise ValueError(f"{type(dataset).__name__}.sample_size must be a method sample_size(index)")
    out = np.empty(len(dataset))
    for i in range(len(dataset)):
        v = fn(i)
        try:
            out[i] = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{name}: the size of sample {i} is {v!r}, not a number") from None
    check_sample_sizes(out, name)
    return out


#: Largest sample size: a step sums sizes and their squares (the quadratic work term), which
#: stay finite and exact enough in float64 below this.
MAX_SAMPLE_SIZE = 1e15


def check_sample_sizes(sizes: np.ndarray, source: str) -> None:
    """A ValueError naming ``source``, the first bad samples and their values unless every size
    is finite, non-negative and at most :data:`MAX_SAMPLE_SIZE`."""
    big = np.flatnonzero(np.isfinite(sizes) & (sizes > MAX_SAMPLE_SIZE))
    if big.size:
        raise ValueError(
            f"{source}: sample {int(big[0])} has size {float(sizes[big[0]]):g}, above "
            f"{MAX_SAMPLE_SIZE:g} ({big.size} such of {sizes.size}): a step's sums of sizes and "
            f"their squares would lose precision or overflow. Express the sizes in a larger unit "
            f"(thousands of tokens, megabytes)")
    bad = np.flatnonzero(~np.isfinite(sizes) | (sizes < 0))
    if bad.size:
        first = ", ".join(f"sample {int(i)} has {float(sizes[i])!r}" for i in bad[:3])
        raise ValueError(
            f"{source}: sizes must be finite and non-negative (a data amount such as tokens or "
            f"frames); {first} ({bad.size} bad of {sizes.size}). Fix those sizes, or leave the "
            f"samples out of the dataset; a sample with no data has size 0")


#: Largest loader seed: an epoch's permutation is seeded with ``seed + epoch`` (a 64-bit seed).
MAX_SEED = 2 ** 62


