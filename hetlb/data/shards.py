"""Sharded loading: each rank reads only the samples it holds (CHRONICA's epoch-level straggler).

In the default global-order mode every rank can read every sample. When a dataset is too large
for that, each rank holds a *partition* of it (its shard: files on its own disk) and an epoch is
the union of the shards. hetlb then runs, per epoch:

- **Steps from the shards.** Every rank shuffles the samples it holds (seeded by seed, epoch and
  rank) and spreads them over the epoch's ``ceil(N / global_batch)`` steps, equal data per step
  (cut at the quantiles of the shuffled shard's cumulative size; a step that this leaves without
  a sample on any rank takes one from the nearest step holding two or more). Every rank knows
  every shard, so all ranks agree on every step's sizes and on the end of the epoch without a
  collective; each sample is trained exactly once per epoch. Sizes follow the shards within an
  epoch: the policy's decisions do not move samples between ranks mid-epoch (the shards are on
  disk).
- **Rebalancing at the end of an epoch** (CHRONICA's data shuffler, Algorithm 3). A rank that
  holds more work than its speed can do in the common time is the epoch-level straggler.
  :func:`hetlb.rebalance` moves the fewest samples so that the predicted epoch times are equal
  (within one sample). The speeds are the size-aware policy's time models when it has them
  (:class:`hetlb.policies.Chronica`'s prophet: slope and per-step intercept), else each rank's
  measured compute time per unit of data over the epoch. The moves form a :class:`Migration`
  (sample, from, to) that the loader exposes before the next epoch starts (so the job can copy
  the files) and applies when it starts.
- **World-size changes.** Resumed on another number of ranks, the samples held by ranks that no
  longer exist, and the share of new ranks, are placed by :func:`hetlb.rebalance` at equal speed;
  in the middle of an epoch the samples already trained are kept out of the rest of it.

The :class:`Partition` is part of the data position: it is owned by the plan board and saved in
every checkpoint with the pending migration, so a resume at any point continues the same
partition.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from hetlb.core.checks import integer
from hetlb.core.solve import rebalance


__all__ = ["Migration", "Partition", "even_partition", "epoch_rates"]


@dataclass(frozen=True)
class Migration:
    """Samples that change rank before the next epoch.

    Attributes:
        sample: int64 ``[M]`` dataset indices, increasing.
        source: int64 ``[M]`` rank holding each now (-1: no rank of this job, e.g. one that left;
            a rank number that no longer exists keeps its number).
        target: int64 ``[M]`` rank that holds it from the next epoch on.
    """

    sample: np.ndarray
    source: np.ndarray
    target: np.ndarray

    def __len__(self) -> int:
        return int(self.sample.size)

    def incoming(self, rank: int) -> np.ndarray:
        """Samples ``rank`` must receive (int64)."""
        return self.sample[self.target == rank]

    def outgoing(self, rank: int) -> np.ndarray:
        """Samples ``rank`` gives away (int64)."""
        return self.sample[self.source == rank]

    def apply(self, home: np.ndarray) -> np.ndarray:
        """``home`` (owner of every sample) after the moves."""
        out = np.array(home, dtype=np.int64, copy=True)
        out[self.sample] = self.target
        return out

    def to_state(self) -> Dict[str, torch.Tensor]:
        return {"sample": torch.from_numpy(self.sample.copy()),
                "source": torch.from_numpy(self.source.copy()),
                "target": torch.from_numpy(self.target.copy())}

    @classmethod
    def from_state(cls, d: Dict[str, Any]) -> "Migration":
        return cls(*(np.asarray(torch.as_tensor(d[k]).numpy(), np.int64) for k in ("sample", "source", "target")))

    @classmethod
    def between(cls, home: np.ndarray, new: np.ndarray) -> "Migration":
        """The moves that turn ``home`` into ``new``."""
        moved = np.flatnonzero(home != new)
        return cls(moved.astype(np.int64), home[moved].astype(np.int64), new[moved].astype(np.int64))


def even_partition(work: np.ndarray, world: int, seed: int) -> np.ndarray:
    """Owner of every sample: a permutation seeded by ``seed`` cut into ``world`` contiguous parts
    of equal data (equal counts when every size is equal)."""
    n = work.size
    perm = np.random.default_rng([int(seed), 0x5EED]).permutation(n)
    home = np.empty(n, np.int64)
    total = float(work.sum())
    if total > 0:
        mid = np.cumsum(work[perm]) - work[perm] / 2
        part = np.minimum(world - 1, np.floor(mid * world / total)).astype(np.int64)
    else:
        part = (np.arange(n) * world) // max(n, 1)
    home[perm] = part
    return home


def epoch_rates(history: Any, epoch: int, world: int) -> Optional[np.ndarray]:
    """Each rank's measured compute seconds per unit of data over ``epoch``'s recorded steps
    (float64 ``[world]``), or None when some rank has no usable measurement."""
    comp, data = np.zeros(world), np.zeros(world)
    for rec in history:
        if rec.epoch != epoch:
            continue
        ok = np.isfinite(rec.compute) & (rec.data > 0)
        comp[ok] += rec.compute[ok]
        data[ok] += rec.data[ok]
    if np.any(data <= 0) or np.any(comp <= 0):
        return None
    return comp / data


class Partition:
    """Which rank holds each sample, the epoch's per-rank orders and steps, and the migration
    pending for the next epoch. Owned by :class:`hetlb.data.board.PlanBoard`.

    Args:
        home: int64 ``[N]`` rank holding each sample.
        world: ranks of the job.
        global_batch: samples per step over all ranks (sets the steps per epoch).
        work: float64 ``[N]`` data amount of every sample (ones when samples have no size).
        sized: whether ``work`` is the samples' sizes (plans then carry the sums of squares).
        seed, shuffle: each rank's order of its shard per epoch (``seed, epoch, rank``).
        rebalance: move samples at the end of every epoch (CHRONICA's shuffler); False keeps
            the partition (it is still re-placed when the world size changes).
    """

    def __init__(self, home: np.ndarray, world: int, global_batch: int, work: np.ndarray,
                 seed: int = 0, shuffle: bool = True, rebalance: bool = True, sized: bool = True) -> None:
        self.world = integer(world, "world", 1)
        self.global_batch = integer(global_batch, "global_batch", 1)
        self.work = np.asarray(work, np.float64)
        self.home = check_home(home, self.work.size, self.world)
        self.seed, self.shuffle, self.rebalance = int(seed), bool(shuffle), bool(rebalance)
        self.sized = bool(sized)  # whether ``work`` holds the samples' sizes (else ones)
        #: Moves to apply when the next iteration starts (computed at the end of an epoch, or
        #: when a checkpoint is resumed on another world size).
        self.pending: Optional[Migration] = None
        #: Samples of the current epoch trained before a world-size change (kept out of the
        #: rest of it), or None.
        self.trained: Optional[np.ndarray] = None
        self._layout: Optional[Tuple[Any, ...]] = None
        self._starts = np.zeros((self.world, 0), np.int64)
        self._sq = np.zeros((self.world, 0))

    # ------------------------------------------------------------------ the epoch's steps

    @property
    def steps(self) -> int:
        """Steps of the current epoch (of its remainder after a world-size change)."""
        left = self.work.size if self.trained is None else int(self.work.size - self.trained.sum())
        return math.ceil(left / self.global_batch)

    def layout(self, epoch: int) -> Tuple[List[np.ndarray], np.ndarray, np.ndarray, int]:
        """``(orders, counts, data, crc)`` of ``epoch``: every rank's shuffled shard (int64), the
        samples and data of every rank at every step (``[world, steps]``), and a CRC of the
        partition (every rank must hold the same). Cached until the partition changes."""
        key = (int(epoch), self.steps)
        if self._layout is not None and self._layout[0] == key:
            return self._layout[1:]
        steps = self.steps
        active = np.ones(self.work.size, bool) if self.trained is None else ~self.trained
        orders: List[np.ndarray] = []
        counts = np.zeros((self.world, steps), np.int64)
        data = np.zeros((self.world, steps))
        sq = np.zeros((self.world, steps))
        for r in range(self.world):
            mine = np.flatnonzero((self.home == r) & active)
            if self.shuffle:
                mine = mine[np.random.default_rng([self.seed, int(epoch), r, 0x5AAD]).permutation(mine.size)]
            mine.flags.writeable = False
            orders.append(mine)
            if steps == 0 or mine.size == 0:
                continue
            w = self.work[mine]
            total = float(w.sum())
            if total > 0:
                mid = np.cumsum(w) - w / 2
                step_of = np.minimum(steps - 1, np.floor(mid * steps / total)).astype(np.int64)
            else:
                step_of = (np.arange(mine.size) * steps) // mine.size
            counts[r] = np.bincount(step_of, minlength=steps)
        _fill_empty_steps(counts)
        for r in range(self.world):
            if steps == 0 or orders[r].size == 0:
                continue
            w = self.work[orders[r]]
            step_of = np.repeat(np.arange(steps), counts[r])
            data[r] = np.bincount(step_of, weights=w, minlength=steps)
            sq[r] = np.bincount(step_of, weights=w * w, minlength=steps)
        crc = zlib.crc32(self.home.tobytes())
        if self.trained is not None:
            crc = zlib.crc32(np.packbits(self.trained).tobytes(), crc)
        self._starts = np.cumsum(counts, axis=1) - counts
        self._sq = sq
        self._layout = (key, orders, counts, data, crc)
        return orders, counts, data, crc

    def step_indices(self, epoch: int, step: int, rank: int) -> np.ndarray:
        """``rank``'s samples at ``step`` of ``epoch`` (int64)."""
        orders, counts, _, _ = self.layout(epoch)
        start = int(self._starts[rank, step])
        return orders[rank][start:start + int(counts[rank, step])]

    def step_sq(self, epoch: int, step: int) -> Optional[np.ndarray]:
        """Every rank's sum of squared sample sizes at ``step`` (None when samples have no size)."""
        if not self.sized:
            return None
        self.layout(epoch)
        sq = self._sq[:, step].copy()
        sq.flags.writeable = False
        return sq

    def trained_upto(self, epoch: int, done: int) -> np.ndarray:
        """bool ``[N]``: samples of ``epoch`` trained in its first ``done`` steps (and before)."""
        mask = np.zeros(self.work.size, bool) if self.trained is None else self.trained.copy()
        orders, counts, _, _ = self.layout(epoch)
        for r in range(self.world):
            mask[orders[r][:int(counts[r, :done].sum())]] = True
        return mask

    # ------------------------------------------------------------------ rebalancing

    def plan(self, slope: np.ndarray, intercept: np.ndarray) -> Migration:
        """Compute (and keep as pending) the moves that equalise the next epoch's predicted times
        under per-rank ``slope`` (seconds per unit of data) and ``intercept`` (seconds per step)."""
        steps = math.ceil(self.work.size / self.global_batch)
        new = rebalance(self.home, self.work, slope, np.asarray(intercept, np.float64) * steps)
        self.pending = Migration.between(self.home, new)
        return self.pending

    def new_epoch(self) -> None:
        """A new epoch starts: apply the pending moves; every sample is untrained again."""
        self.apply_pending()
        self.trained = None
        self._layout = None

    def apply_pending(self) -> None:
        if self.pending is not None:
            self.home = self.pending.apply(self.home)
            self.pending = None
            self._layout = None

    # ------------------------------------------------------------------ checkpoints

    def state(self) -> Dict[str, Any]:
        """Tensors and plain values for a checkpoint (see :meth:`load`)."""
        return {"world": self.world, "home": torch.from_numpy(self.home.copy()),
                "trained": None if self.trained is None else torch.from_numpy(self.trained.copy()),
                "pending": None if self.pending is None else self.pending.to_state()}

    def load(self, state: Dict[str, Any], epoch: int, done: int, world: int) -> int:
        """Restore :meth:`state` (taken at step ``done`` of ``epoch``) on a job of ``world``
        ranks; returns the steps of the epoch already trained in the restored layout (``done``,
        or 0 when the world size changed and the rest of the epoch was re-partitioned, or the
        whole layout's :attr:`steps` when the epoch was complete)."""
        saved_world = integer(state["world"], "checkpoint partition world", 1)
        home = np.asarray(torch.as_tensor(state["home"]).numpy(), np.int64)
        if home.shape != self.home.shape:
            raise ValueError(f"the checkpoint's partition covers {home.size} samples, the dataset has "
                             f"{self.home.size}; resume with the same dataset")
        trained = state.get("trained")
        pending = None if state.get("pending") is None else Migration.from_state(state["pending"])
        # Before its pending moves the partition may still name ranks that left (a checkpoint taken
        # right after a world-size change); after them every sample is on a rank of the job.
        placed = check_home(home if pending is None else pending.apply(home), home.size, saved_world)
        self.world = saved_world
        self.home = home
        self.trained = None if trained is None else np.asarray(torch.as_tensor(trained).numpy(), bool)
        self.pending = pending
        self._layout = None
        if saved_world == world:
            return done
        # Another world size: the trained part of the epoch stays trained; what ranks that left
        # held, and the share of ranks that joined, are placed at equal speed now.
        finished = done >= self.steps
        self.trained = None if finished else self.trained_upto(epoch, done)
        self.world = int(world)
        new = rebalance(np.where(placed < world, placed, -1), self.work, np.ones(world), np.zeros(world))
        self.pending = Migration.between(self.home, new)
        self._layout = None
        # A complete epoch stays complete in the new layout (of every sample, trained is gone):
        # its steps are all done, whatever the old layout counted.
        return max(done, self.steps) if finished else 0


def _fill_empty_steps(counts: np.ndarray) -> None:
    """Give every step of a layout (``counts``: samples of every rank at every step, in place)
    at least one sample when there are enough: a shard cut at the quantiles of its data can leave
    steps empty (a large sample spans several), and a step with no sample on any rank has no
    gradient to weigh. Each empty step takes one sample from the nearest step holding two or
    more (earlier first), from the rank with the most there (lowest first): only the counts of
    that rank's steps between the two change, so its samples stay in order, each in one step."""
    total = counts.sum(axis=0)
    if total.size == 0 or int(total.sum()) < total.size:
        return
    for s in np.flatnonzero(total == 0):
        rich = np.flatnonzero(total >= 2)
        t = int(rich[np.argmin(np.abs(rich - s) * 2 + (rich > s))])
        r = int(np.argmax(counts[:, t]))
        counts[r, t] -= 1
        counts[r, s] += 1
        total[t] -= 1
        total[s] += 1


def check_home(home: Any, n: int, world: int) -> np.ndarray:
    """``home`` as int64 ``[n]`` in ``[0, world)``, or a ValueError saying what is wrong."""
    try:
        arr = np.asarray(home)
    except Exception as e:  # noqa: BLE001 - any conversion failure is the user's input
        raise ValueError(f"partition must be {n} ranks (one per sample): {e}") from None
    if arr.shape != (n,):
        raise ValueError(f"partition must hold one rank per sample ({n}), got shape {arr.shape}")
    if arr.size and (arr.dtype.kind not in "iu" and not (arr.dtype.kind == "f" and np.all(arr == np.round(arr)))):
        raise ValueError(f"partition must hold integer ranks, got dtype {arr.dtype}")
    # (in range before the cast: a float or uint64 of 2**63 or more would wrap around in int64)
    bad = np.flatnonzero((arr < 0) | (arr >= world))
    if bad.size:
        raise ValueError(f"partition: sample {int(bad[0])} is held by rank {arr[bad[0]].item()}, outside "
                         f"[0, {world}) ({bad.size} such samples)")
    arr = arr.astype(np.int64)
    return arr
