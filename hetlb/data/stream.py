"""The plan board of streams: delayed synchronous training's rounds of per-rank shards.

In delayed synchronous training (:class:`hetlb.DelayedSync`) a rank computes as many reference
batches as fit before an all-reduce completes, so no step has sizes planned ahead. The epoch's
global order is trained in **rounds** (one per epoch, and a short first one while no speed has
been measured), and each round's samples are cut into one contiguous **shard** per rank (sizes
posted by :meth:`StreamBoard.post_shards`, fixed for the round); each rank draws reference
batches of its own size from its shard at its own pace. The position is where the round starts
(:attr:`StreamBoard.base`) and every rank's count of trained samples of its shard
(:meth:`StreamBoard.consumed`); a round ends when every shard is used up, the epoch when its last
round has.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np

from hetlb.core.checks import integer
from hetlb.data.handout import Board


__all__ = ["StreamPlan", "StreamBoard"]


@dataclass(frozen=True)
class StreamPlan:
    """One reference batch of a stream: ``count`` samples of this rank's shard of ``epoch``,
    starting ``start`` samples into it."""

    epoch: int
    start: int
    count: int
    data: Optional[float] = None  # summed sample sizes (None: samples have no size)


class StreamBoard(Board):
    """The shards of the round, every rank's trained samples of its shard and this rank's draws
    (one rank's copy; the rounds are posted by :class:`hetlb.DelayedSync`).

    Args:
        world, rank: the ranks.
        global_batch: ``world * reference`` (the unit a loader counts its steps in).
        reference: this rank's reference batch size.
    """

    def __init__(self, world: int, rank: int, global_batch: int, reference: int = 1) -> None:
        super().__init__(world, rank, global_batch)
        self._shards: Optional[np.ndarray] = None
        self._used = np.zeros(self.world, np.int64)
        self._reference = integer(reference, "reference batch", 1)
        self._base = 0  # samples of the epoch's order in the rounds before this one
        self._length: Optional[int] = None  # samples in the epoch (posted with the shards)
        self._cursor = 0  # how far this rank has drawn into its shard

    @property
    def shards(self) -> Optional[np.ndarray]:
        """The round's shard sizes (int64 ``[world]``), or None before they are posted."""
        return self._shards

    @property
    def used(self) -> np.ndarray:
        """Every rank's trained samples of its shard, as last reported (:meth:`consumed`)."""
        return self._used

    @property
    def base(self) -> int:
        """Samples of the epoch's order in the rounds before this one."""
        return self._base

    @property
    def length(self) -> Optional[int]:
        """Samples in the epoch (posted with the shards), or None before."""
        return self._length

    @property
    def reference(self) -> int:
        """This rank's reference batch size."""
        return self._reference

    # ------------------------------------------------------------------ rounds

    def post_shards(self, shards: Any, reference: int, length: int) -> None:
        """The round's shard sizes (int64 ``[world]``; fixed once the round has started), this
        rank's reference batch size and the epoch's samples (the round covers ``base .. base +
        sum(shards)`` of them)."""
        shards = np.asarray(shards, dtype=np.int64)
        length = integer(length, "epoch length", 0)
        if shards.shape != (self.world,) or np.any(shards < 0):
            raise ValueError(f"shards must be {self.world} non-negative integers, got {shards.tolist()}")
        if self._base + int(shards.sum()) > length:
            raise ValueError(f"shards {shards.tolist()} from sample {self._base} run past the epoch's {length}")
        if self._shards is not None and self._used.any() and not np.array_equal(shards, self._shards):
            raise ValueError("the shards of a round under way cannot change (post them at its start)")
        self._shards = shards.copy()
        self._length = length
        self._reference = integer(reference, "reference batch", 1)

    def next_round(self) -> None:
        """The round is trained: the next one starts after it (its shards are posted next)."""
        if not self.round_finished():
            raise RuntimeError("next_round: the round is not trained yet")
        self._base += int(self._shards.sum())
        self._shards, self._used = None, np.zeros(self.world, np.int64)
        self._cursor = 0
        self._forget()

    def move_on(self) -> None:
        """Past a trained epoch to the next one, or past a trained round to the next round (its
        shards are posted next); otherwise nothing changes."""
        if self.stream_finished():
            self._new_epoch(self.epoch + 1)
        elif self.round_finished():
            self.next_round()

    def consumed(self, used: Any) -> None:
        """Every rank's trained samples of its shard (from the shared telemetry): the stream's
        position. A new iteration draws this rank's shard from its count on."""
        used = np.asarray(used, dtype=np.int64)
        if used.shape != (self.world,) or np.any(used < 0) or (self._shards is not None and np.any(used > self._shards)):
            raise ValueError(f"used must be {self.world} counts within the shards, got {used.tolist()}")
        self._used = used.copy()

    def round_finished(self) -> bool:
        """Whether every shard of the round has been trained (an empty round never starts)."""
        return (self._shards is not None and int(self._shards.sum()) > 0
                and bool(np.array_equal(self._used, self._shards)))

    def stream_finished(self) -> bool:
        """Whether the epoch's last round has been trained."""
        return (self.round_finished() and self._length is not None
                and self._base + int(self._shards.sum()) >= self._length)

    # ------------------------------------------------------------------ drawing

    def draw_stream(self, length: int) -> Optional[StreamPlan]:
        """This rank's next reference batch of the epoch (None once its shard is drawn)."""
        if self._shards is None:
            raise RuntimeError("a stream needs shards: post_shards() first")
        if self._base + int(self._shards.sum()) > length:
            raise RuntimeError(f"shards {self._shards.tolist()} from sample {self._base} run past the epoch's {length}")
        left = int(self._shards[self.rank]) - self._cursor
        if left <= 0:
            return None
        # A shard's tail is split so no reference batch is tiny (an update of a few samples is
        # a noisy step when it is all a tail iteration has): between 1 and 2 batches' worth left
        # goes in two halves, each at most a reference batch.
        m = self._reference
        count = m if left >= 2 * m else (left + 1) // 2 if left > m else left
        plan = StreamPlan(self.epoch, self._cursor, count)
        self._cursor += plan.count
        self.drawn.append(plan)
        return plan

    def hand_empty(self) -> StreamPlan:
        """This rank's shard is used up: an empty reference batch at its end, handed out now (its
        step takes part in an iteration with nothing to add)."""
        plan = StreamPlan(self.epoch, int(self._shards[self.rank]), 0, 0.0)
        self.handed.append(plan)
        return plan

    def stream_offset(self) -> int:
        """Where this rank's shard starts in the epoch's global order."""
        if self._shards is None:
            raise RuntimeError(f"a stream needs the shards of epoch {self.epoch}: post_shards() first")
        return self._base + int(self._shards[:self.rank].sum())

    # ------------------------------------------------------------------ epochs and checkpoints

    def epoch_finished(self) -> bool:
        """Whether the epoch's last round has been trained (rounds of shards, not steps)."""
        return self.stream_finished()

    def _all_handed(self) -> bool:
        return self.stream_finished()

    def _new_epoch(self, epoch: int) -> None:
        super()._new_epoch(epoch)
        self._shards, self._used, self._base = None, np.zeros(self.world, np.int64), 0

    def restart(self) -> int:
        """A new iteration over the loader begins: forget reference batches drawn or handed out
        but not trained, move past a trained epoch or round, and return where this rank's shard
        is drawn from."""
        self._new_iteration()
        self.move_on()
        self._cursor = int(self._used[self.rank])
        return self._cursor

    def position(self) -> Dict[str, Any]:
        """The data position (plain values): the epoch, the round's shards and start, every
        rank's trained samples of its own shard and the epoch's samples."""
        return {"epoch": int(self.epoch), "global_batch": self.global_batch,
                "shards": None if self._shards is None else self._shards.tolist(),
                "used": self._used.tolist(), "base": int(self._base), "length": self._length}

    def load_position(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`position` output of the same number of ranks; iterators started earlier
        refuse to go on. (``set_epoch`` is not restricted after it: the owner resumes the rounds
        itself.)"""
        self.epoch = self._checked_position(state)
        shards = state.get("shards")
        self._shards = None if shards is None else np.asarray(shards, np.int64)
        self._used = np.asarray(state["used"], np.int64)
        self._base = int(state.get("base", 0))
        self._length = state.get("length")
        if self._used.shape != (self.world,):
            raise ValueError(f"a stream position of {self._used.size} ranks cannot resume on {self.world}")
        self._position_loaded(restored=False)

    def restore_stream_position(self, state: Dict[str, Any], world: int,
                                length: Optional[int]) -> None:
        """Restore a position saved on ``world`` ranks (``length``: the epoch's samples, where
        the position does not say). On another number of ranks only at a round's boundary: the
        next round's shards are then cut for this world (a position in the middle of a round is
        refused)."""
        shards, used = state.get("shards"), state.get("used")
        base = int(state.get("base", 0))
        finished = shards is not None and sum(shards) > 0 and list(used) == list(shards)
        if world == self.world:
            self.load_position(state)
        elif shards is None or finished or not any(used):
            # At a round boundary: the next round's shards are cut for the new world.
            length = state.get("length") or length
            base += sum(shards) if finished else 0
            self.epoch = int(state["epoch"]) + (1 if base >= length else 0)
            self._base = 0 if base >= length else base
            self._shards, self._used = None, np.zeros(self.world, np.int64)
        else:
            raise ValueError("DelayedSync resumes in the middle of a round only on the number of "
                             f"ranks it saved on ({world}, now {self.world}); resume at an "
                             "epoch boundary (or after a flush at a round's end) to change it")
