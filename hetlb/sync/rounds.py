"""The data side of delayed synchronous training (:class:`hetlb.DelayedSync`): an epoch's rounds.

The epoch's global order is trained in rounds (one per epoch, plus a short equal-share probe round
first in a fresh run, when no speed is known); each round is cut into one shard per rank, sized by
the ranks' measured samples per second of compute, and each rank draws reference batches from its
own shard at its own pace (:class:`hetlb.data.stream.StreamBoard`). :class:`Rounds` owns that
board, the loader drawing from it, this rank's count of trained samples of its shard, and whether
the iteration applied last trained every shard of the round; it posts each round's shards from
the shared history, so every rank cuts the same.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from hetlb.core.solve import allocate_proportional
from hetlb.core.telemetry import MAX_COMPUTE, MIN_COMPUTE
from hetlb.data.loader import BalancedLoader
from hetlb.data.stream import StreamBoard, StreamPlan


__all__ = ["Rounds", "measured_speeds"]

log = logging.getLogger("hetlb")


def measured_speeds(records: Sequence[Any], world: int) -> Optional[np.ndarray]:
    """Samples per second of compute of every rank over ``records`` (the
    :class:`hetlb.sync.delayed.IterationRecord` of the iterations in which it computed), or None
    while some rank has none. A compute time that cannot describe work (NaN, infinite, or outside
    ``[MIN_COMPUTE, MAX_COMPUTE]``: a broken clock) is left out with its samples, as the
    Balancer's History refuses such records, instead of skewing every shard."""
    samples = np.zeros(world)
    seconds = np.zeros(world)
    for r in records:
        t = r.compute
        with np.errstate(invalid="ignore"):
            busy = (r.batch > 0) & np.isfinite(t) & (t >= MIN_COMPUTE) & (t <= MAX_COMPUTE)
        samples[busy] += r.batch[busy]
        seconds[busy] += t[busy]
    if not np.all(seconds > 0):
        return None
    return samples / seconds


class Rounds:
    """One rank's rounds of an epoch (see the module docstring). Without a loader
    (:meth:`new_loader`, :meth:`drive`) there is no board and no position.

    Args:
        world, rank: the ranks.
        reference_batch: samples per reference batch.
        probe_batches: reference batches per rank of a probe round (0: no probe round).
    """

    def __init__(self, world: int, rank: int, reference_batch: int, probe_batches: int) -> None:
        self.world, self.rank = world, rank
        self.reference_batch, self.probe_batches = reference_batch, probe_batches
        self.board: Optional[StreamBoard] = None
        self.loader: Optional[BalancedLoader] = None
        self._used = 0  # samples of this rank's shard trained this round
        self._over = False  # the iteration applied last trained every shard of the round
        self._left: Optional[np.ndarray] = None  # every rank's samples left, in the last table
        #: A position loaded before a loader drives the rounds, and the world it was saved on
        #: (applied by :meth:`drive`).
        self._early: Optional[Tuple[Dict[str, Any], int]] = None

    # ------------------------------------------------------------------ the loader

    def new_loader(self, dataset: Any, shuffle: bool, seed: int, drop_last: bool,
                   sample_sizes: Any, dataloader_kwargs: Dict[str, Any]) -> BalancedLoader:
        """A loader of this rank's reference batches of ``dataset`` on a new board; it drives
        the rounds once checked and bound (:meth:`drive`)."""
        if self.loader is not None:
            raise ValueError("this DelayedSync already drives a loader; iterate it every epoch")
        for key in ("batch_size", "batch_sampler", "sampler"):
            if key in dataloader_kwargs:
                raise ValueError(f"DelayedSync.loader: {key}= is not accepted: reference batches are "
                                 f"reference_batch={self.reference_batch} samples of this rank's shard")
        # (the reference batch also for a round restored from a checkpoint, whose shards are
        # not posted again)
        self.board = StreamBoard(self.world, self.rank, self.world * self.reference_batch,
                                 reference=self.reference_batch)
        return BalancedLoader(dataset, None, shuffle, sample_sizes=sample_sizes, seed=seed,
                              drop_last=drop_last, board=self.board, **dataloader_kwargs)

    def drive(self, loader: BalancedLoader) -> None:
        """``loader`` (from :meth:`new_loader`), checked and bound, draws the rounds from now on,
        from a position loaded before it was made (:meth:`restore`) if there is one."""
        self.loader = loader
        early, self._early = self._early, None
        if early is not None:
            self.restore(*early)

    def config(self) -> Optional[Dict[str, Any]]:
        """The loader's global order (what every rank agrees on), or None without a loader."""
        return None if self.loader is None else self.loader.order.config()

    # ------------------------------------------------------------------ reference batches

    def plan(self) -> Optional[StreamPlan]:
        """The reference batch handed out last and not stepped yet, or None."""
        return None if self.board is None else self.board.current

    def trained(self, count: int) -> None:
        """The reference batch handed out last trained ``count`` samples."""
        self._used += count
        self.board.drop_current()

    def skipped(self) -> None:
        """The empty reference batch handed out last has been stepped."""
        self.board.drop_current()

    def left(self) -> int:
        """Samples of this rank's shard not trained yet (0 with no round)."""
        if self.board is None or self.board.shards is None:
            return 0
        return int(self.board.shards[self.rank]) - self._used

    def key(self) -> Any:
        """``(epoch, first sample)`` of the round, or None without a board."""
        b = self.board
        return None if b is None else (b.epoch, b.base)

    # ------------------------------------------------------------------ rounds

    @property
    def over(self) -> bool:
        """Whether the iteration applied last trained every rank's shard of the round: every
        rank then stops sending and ends the round at the same iteration."""
        return self._over

    def applied(self, left: np.ndarray, key: Any) -> None:
        """An iteration's table was applied: ``left`` is every rank's samples left of its shard
        in it, ``key`` the round (:meth:`key`) it was sent in. Only an iteration of this round
        ends it (a loop left on the last update of a round and moved to the next epoch
        completes that update's all-reduce in the new round)."""
        self._left = left
        self._over = bool(self.board is not None and self.board.shards is not None
                          and key == self.key() and np.all(left == 0))

    def start(self, history: Sequence[Any]) -> None:
        """An iteration over the loader starts: past a trained epoch or round (iterated again
        without set_epoch: the next epoch), with the round's shards posted."""
        b = self.board
        b.move_on()
        if b.shards is None:
            self._post(history)
        self._used = int(b.used[self.rank])

    def end_of_shard(self, history: Sequence[Any], in_flight: bool) -> Optional[str]:
        """This rank's shard is used up (see :meth:`hetlb.DelayedSync.exhausted`): ``"empty"``
        hands out an empty reference batch, ``"round"`` starts the next round, None ends the
        epoch (once every shard is trained and applied, ``in_flight`` being False)."""
        b = self.board
        if self._over and not in_flight:
            b.consumed(b.shards)
            if b.stream_finished():
                return None
            b.next_round()
            self._post(history)
            return "round"
        b.hand_empty()
        return "empty"

    def _post(self, history: Sequence[Any]) -> None:
        b = self.board
        self._over = False
        self._used = 0
        b.post_shards(self._shards(history), self.reference_batch, self.loader.order.epoch_length)
        log.info("epoch %d, samples %d on: shards %s", b.epoch, b.base, b.shards.tolist())

    def _shards(self, history: Sequence[Any]) -> np.ndarray:
        """The round's shard sizes, proportional to each rank's measured speed (samples per
        second of compute over the recent iterations in which it computed), largest-remainder
        rounded; the round is the rest of the epoch. While some rank's speed is unknown the round
        is a short probe of ``probe_batches`` reference batches per rank, equal shares. Every rank
        computes the same from the shared history."""
        n = self.loader.order.epoch_length - self.board.base
        speed = measured_speeds(list(history)[-256:], self.world)
        if speed is None:
            speed = np.ones(self.world)
            if self.probe_batches:
                n = min(n, self.world * self.reference_batch * self.probe_batches)
        return allocate_proportional(speed, n)

    # ------------------------------------------------------------------ checkpoints

    def position(self) -> Optional[Dict[str, Any]]:
        """The data position after a flush (every rank's trained samples from the last table),
        or None without a loader's board."""
        b = self.board
        if b is None:
            return None
        if b.shards is not None:
            b.consumed(np.maximum(b.shards - np.rint(self._left).astype(np.int64), 0))
        return b.position()

    def restore(self, position: Optional[Dict[str, Any]], world: int) -> None:
        """Resume :meth:`position` saved on ``world`` ranks (None: nothing to resume). Before a
        loader drives the rounds the position waits for it (:meth:`drive`)."""
        if position is None:
            return
        if self.loader is None:
            self._early = (position, world)
            return
        b = self.board
        b.restore_stream_position(position, world, self.loader.order.epoch_length)
        self._used = 0 if b.shards is None else int(b.used[self.rank])
