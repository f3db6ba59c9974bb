"""Global-order variable-batch loading (DESIGN.md, point 5).

Every rank draws the same permutation of the dataset per epoch (seeded by ``seed + epoch``). Step
``s`` of an epoch takes the next ``global_batch`` indices of the permutation and rank ``r`` takes
its contiguous slice ``[o + sum(B[:r]), o + sum(B[:r+1]))``. So each sample is seen exactly once per
epoch whatever the sizes do, and every rank runs ``ceil(N / global_batch)`` steps (``floor`` with
``drop_last``): uneven inputs never hang DDP. The short last step is split by the current shares.

The sizes of a step are fixed when its indices are drawn. A DataLoader with workers draws
``num_workers * prefetch_factor`` batches ahead, so a decision made at the end of step ``t`` is
used from step ``t + 1 + lag`` on with ``lag`` that prefetch depth (0 without workers). The draw
happens at the same point of the program on every rank, so every rank uses the same sizes; the
Balancer verifies it each step against the sizes the ranks report.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate

from .solve import allocate_proportional


def split_last(shares: np.ndarray, count: int) -> np.ndarray:
    """Split a short last step of ``count`` samples by the current ``shares`` (int64 ``[world]``).

    Largest-remainder rounding of ``count * shares / sum(shares)``; a rank may get 0 when
    ``count`` is smaller than the world.
    """
    shares = np.asarray(shares, dtype=np.float64)
    if count == int(shares.sum()):
        return shares.astype(np.int64)
    return allocate_proportional(shares, int(count))


class GlobalOrderSampler:
    """Batch sampler yielding this rank's index slice of every step, in the global order.

    Args:
        length: number of samples in the dataset.
        global_batch: samples per step over all ranks.
        rank, world: this rank and the number of ranks.
        plan: ``plan(count) -> int64[world]`` called once per drawn step with the number of
            samples of that step (``global_batch``, or fewer for the last step); returns the sizes.
        shuffle, seed, drop_last: as in ``DistributedSampler``.
    """

    def __init__(self, length: int, global_batch: int, rank: int, world: int,
                 plan: Callable[[int], np.ndarray], shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        if length < 0:
            raise ValueError(f"dataset length must be >= 0, got {length}")
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world of {world}")
        self.length, self.global_batch = int(length), int(global_batch)
        self.rank, self.world = int(rank), int(world)
        self.plan, self.shuffle, self.seed, self.drop_last = plan, bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0
        self.start_step = 0  # first step of the epoch still to hand out (resume point)
        self._perm: Optional[Tuple[tuple, np.ndarray]] = None

    @property
    def steps_per_epoch(self) -> int:
        if self.drop_last:
            return self.length // self.global_batch
        return math.ceil(self.length / self.global_batch)

    def __len__(self) -> int:
        return max(0, self.steps_per_epoch - self.start_step)

    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's global order (identical on every rank); read-only, cached per epoch
        because per-step lookups (data amounts, checks) would otherwise redraw it every step."""
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

    def slices(self, sizes: np.ndarray) -> List[Tuple[int, int]]:
        """``(begin, end)`` of every rank inside a step, from the sizes."""
        ends = np.cumsum(sizes)
        begins = ends - sizes
        return list(zip(begins.tolist(), ends.tolist()))

    def draw(self) -> Iterator[Tuple[int, np.ndarray, List[int]]]:
        """``(step, sizes, this rank's indices)`` for the rest of the epoch; sizes fixed on draw."""
        perm = self.permutation(self.epoch)
        for s in range(self.start_step, self.steps_per_epoch):
            count = self.step_count(s)
            sizes = np.asarray(self.plan(count), dtype=np.int64)
            if sizes.shape != (self.world,) or int(sizes.sum()) != count or np.any(sizes < 0):
                raise RuntimeError(f"step plan {sizes.tolist()} does not split {count} samples "
                                   f"over {self.world} ranks")
            o = s * self.global_batch
            b, e = self.slices(sizes)[self.rank]
            yield s, sizes, perm[o + b:o + e].tolist()

    def __iter__(self) -> Iterator[List[int]]:
        for _, _, idx in self.draw():
            yield idx

    def step_indices(self, epoch: int, step: int, sizes: np.ndarray) -> List[np.ndarray]:
        """Every rank's indices of one step (for checks and per-rank data amounts)."""
        perm = self.permutation(epoch)
        o = step * self.global_batch
        return [perm[o + b:o + e] for b, e in self.slices(np.asarray(sizes, dtype=np.int64))]


class BalancedLoader:
    """This rank's batches of every step, sized by the Balancer; a thin shell over a DataLoader.

    Made by :meth:`hetlb.Balancer.loader`. Iterating yields what the DataLoader yields (collated
    batches); ``set_epoch`` selects the permutation; ``state_dict``/``load_state_dict`` resume
    mid-epoch (also on a different world size: the position is counted in samples).
    """

    def __init__(self, sampler: GlobalOrderSampler, dataset: Any, sizes: Optional[np.ndarray],
                 on_batch: Callable[[int, int, np.ndarray, np.ndarray], None],
                 **dataloader_kwargs: Any) -> None:
        for bad in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
            if bad in dataloader_kwargs:
                raise ValueError(f"{bad}= is decided by the Balancer; pass shuffle/drop_last/seed to "
                                 f"Balancer.loader() and leave the rest to the policy")
        self.sampler = sampler
        self.sizes = sizes
        self._on_batch = on_batch
        self._drawn = _Drawn(sampler)
        collate = dataloader_kwargs.pop("collate_fn", None) or default_collate
        self._dl = DataLoader(dataset, batch_sampler=self._drawn,
                              collate_fn=_EmptySafeCollate(dataset, collate), **dataloader_kwargs)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def lag(self) -> int:
        """Steps between a decision and the first step that uses it (the prefetch depth)."""
        if self._dl.num_workers == 0:
            return 0
        return self._dl.num_workers * (self._dl.prefetch_factor or 2)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's permutation; a partly consumed epoch keeps its position."""
        if epoch != self.sampler.epoch:
            self.sampler.epoch = int(epoch)
            self.sampler.start_step = 0

    def __iter__(self) -> Iterator[Any]:
        s = self.sampler
        if s.start_step >= s.steps_per_epoch:
            # The epoch was finished: move on, as a DataLoader user would expect on re-iteration.
            s.epoch += 1
            s.start_step = 0
        pending = self._drawn.pending
        pending.clear()
        epoch = s.epoch
        for batch in self._dl:
            step, sizes = pending.popleft()
            data = self._data_amounts(epoch, step, sizes)
            s.start_step = step + 1
            self._on_batch(epoch, step, sizes, data)
            yield batch

    def _data_amounts(self, epoch: int, step: int, sizes: np.ndarray) -> np.ndarray:
        if self.sizes is None:
            return sizes.astype(np.float64)
        return np.array([float(self.sizes[idx].sum()) for idx in
                         self.sampler.step_indices(epoch, step, sizes)])

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.sampler.epoch, "next_sample": self.sampler.start_step * self.sampler.global_batch,
                "seed": self.sampler.seed, "global_batch": self.sampler.global_batch}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if int(state["global_batch"]) != self.sampler.global_batch:
            raise ValueError(f"checkpoint global_batch={state['global_batch']} differs from "
                             f"{self.sampler.global_batch}; the epoch position would not line up")
        self.sampler.epoch = int(state["epoch"])
        self.sampler.seed = int(state["seed"])
        self.sampler.start_step = int(state["next_sample"]) // self.sampler.global_batch


def _empty_like(batch: Any) -> Any:
    """``batch`` with zero rows: tensors and arrays sliced ``[:0]``, containers recursed."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return batch[:0]
    if isinstance(batch, dict):
        return type(batch)((k, _empty_like(v)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_empty_like(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_empty_like(v) for v in batch)
    return batch


class _EmptySafeCollate:
    """Collate that also handles a step where this rank has no samples (``lower=0``): it
    collates one sample and returns the result with zero rows, so the training loop sees
    correctly shaped empty tensors instead of a collate error. Picklable for DataLoader workers."""

    def __init__(self, dataset: Any, collate: Callable[[List[Any]], Any]) -> None:
        self.dataset, self.collate = dataset, collate

    def __call__(self, samples: List[Any]) -> Any:
        if len(samples) == 0:
            return _empty_like(self.collate([self.dataset[0]]))
        return self.collate(samples)


class _Drawn:
    """The DataLoader's batch sampler: records each drawn step's sizes for the loader.

    It holds the sampler, not the :class:`BalancedLoader`: a reference back would make the
    DataLoader part of a cycle, and a persistent-workers iterator freed by the garbage collector
    instead of by reference counting shuts its workers down only after a 5 s timeout each.
    """

    def __init__(self, sampler: GlobalOrderSampler) -> None:
        self.sampler = sampler
        self.pending: Deque[Tuple[int, np.ndarray]] = deque()

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[List[int]]:
        for step, sizes, idx in self.sampler.draw():
            self.pending.append((step, sizes))
            yield idx


__all__ = ["GlobalOrderSampler", "BalancedLoader", "split_last"]
