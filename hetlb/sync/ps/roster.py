"""The parameter server's view of its workers: who said hello (with its hardware), who is alive,
who has no work left this epoch, each one's clock, and the latest push of each that the policy's
next record is made of."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np
import torch

from hetlb.core.telemetry import StepRecord
from hetlb.policies.base import Context


__all__ = ["Roster"]


class Roster:
    """The workers ``0..K-1`` (ranks ``1..K``) as the server sees them."""

    def __init__(self, workers: int) -> None:
        K = self.workers = workers
        #: Iterations applied per worker.
        self.clock = np.zeros(K, np.int64)
        #: False for a dropped worker.
        self.alive = np.ones(K, bool)
        self._hardware: List[Optional[Dict[str, float]]] = [None] * K  # None: no hello yet
        self._idle = np.zeros(K, bool)  # no work left this epoch
        self._fresh = np.zeros(K, bool)  # pushed since the last record
        self._last_batch = np.zeros(K, np.int64)
        self._last_time = np.full(K, np.nan)
        self._byes: set = set()

    def hello(self, worker: int, hardware: Optional[Dict[str, float]]) -> None:
        """``worker`` said hello with its hardware indicators."""
        self._hardware[worker] = dict(hardware or {})

    def greeted(self) -> bool:
        """Whether every live worker said hello."""
        return all(h is not None or not a for h, a in zip(self._hardware, self.alive))

    def silent(self) -> List[int]:
        """The live workers that have not said hello."""
        return [w for w in range(self.workers) if self._hardware[w] is None and self.alive[w]]

    def bye(self, worker: int) -> None:
        """``worker`` said goodbye."""
        self._byes.add(worker)

    def all_left(self) -> bool:
        """Whether every live worker said goodbye."""
        return all(w in self._byes for w in np.flatnonzero(self.alive).tolist())

    def drop(self, worker: int) -> None:
        """``worker`` is dead from now on."""
        self.alive[worker] = False

    def idle(self, worker: int) -> bool:
        """Mark ``worker`` without work this epoch; whether it had work until now."""
        was = not self._idle[worker]
        self._idle[worker] = True
        return was

    def new_epoch(self) -> None:
        """Every worker has work again."""
        self._idle[:] = False

    def working(self) -> np.ndarray:
        """Live workers with work left this epoch (bool ``[K]``)."""
        return self.alive & ~self._idle

    def min_clock(self) -> Optional[int]:
        """The smallest clock of a working worker (None: none works)."""
        work = self.working()
        return int(self.clock[work].min()) if work.any() else None

    def applied(self, worker: int, n: int, compute: float) -> None:
        """``worker``'s push of ``n`` samples, computed in ``compute`` seconds, was applied."""
        self.clock[worker] += 1
        self._last_batch[worker] = n
        self._last_time[worker] = compute
        self._fresh[worker] = True

    def record(self, step: int, epoch: int, epoch_end: bool = False,
               force: bool = False) -> Optional[StepRecord]:
        """The policy's record of a round (every working worker pushed since the last record;
        any time with ``force``), or None: no round, or a live worker that never pushed. A dead
        worker's compute is ``+inf``, a live one's that pushed nothing ``0``."""
        if not force and not (self._fresh | ~self.working()).all():
            return None
        if not np.isfinite(self._last_time[self.alive]).all():
            return None  # a worker that never pushed: nothing to compare yet
        batch = np.where(self.alive, self._last_batch, 0).astype(np.int64)
        compute = np.where(self.alive, self._last_time, np.inf)
        compute = np.where((batch == 0) & self.alive, 0.0, compute)
        zeros = np.zeros(self.workers)
        self._fresh[:] = False
        return StepRecord(step=step, epoch=epoch, batch=batch, compute=compute,
                          data=batch.astype(np.float64), memory=zeros, cpu=zeros, epoch_end=epoch_end)

    def context(self, global_batch: int, lower: int) -> Context:
        """The policy's context: bounds ``[lower, global_batch]`` and the hardware said at hello."""
        hw = [h if h is not None else {} for h in self._hardware]
        return Context(self.workers, global_batch, np.full(self.workers, lower),
                       np.full(self.workers, global_batch), hardware=hw)

    def share_dropped(self, sizes: np.ndarray, lower: int) -> np.ndarray:
        """``sizes`` with every dropped worker held at ``lower`` and the rest of its share spread
        evenly over the live ones (what WLBS's redistribution does by speed; this covers policies
        that know nothing of failures, e.g. the equal split)."""
        sizes = np.asarray(sizes, np.int64).copy()
        alive = np.flatnonzero(self.alive)
        if alive.size == 0:
            return sizes
        for w in np.flatnonzero(~self.alive).tolist():
            give = int(sizes[w]) - lower
            if give > 0:
                sizes[w] = lower
                sizes[alive] += give // alive.size
                sizes[alive[:give % alive.size]] += 1
        return sizes

    def state_dict(self) -> Dict[str, Any]:
        """The checkpoint's ``clock``."""
        return {"clock": torch.from_numpy(self.clock.copy())}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s keys (every worker alive, none said hello)."""
        self.clock = state["clock"].numpy().astype(np.int64).copy()
