"""DBS: dynamic batch sizing per epoch (baseline).

Within an epoch the sizes stay fixed. When an epoch ends, every rank's speed over it (samples
processed / compute seconds, summed over the epoch's records) sets the next epoch's sizes in
proportion (:func:`hetlb.allocate_proportional`). The first epoch runs the equal split.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..telemetry import StepRecord
from .base import Context
from .uniform import _SizedPolicy

__all__ = ["DBS"]


class DBS(_SizedPolicy):
    """Per-epoch proportional batch sizes from the previous epoch's speeds.

    Args:
        steps_per_epoch: steps in one epoch, if known (``ceil(dataset / global_batch)``). With it
            the policy sees that a record is the *last* of its epoch and the new sizes apply from
            the first step of the next epoch; without it the end of an epoch is noticed at the
            first record of the next one (``record.epoch`` changes), so the new sizes apply
            from the second step of that epoch.

    Attributes:
        speed: samples/s of each rank over the latest finished epoch (NaN before one finished).
    """

    name = "dbs"

    def __init__(self, steps_per_epoch: Optional[int] = None) -> None:
        if steps_per_epoch is not None and (isinstance(steps_per_epoch, bool)
                                            or int(steps_per_epoch) != steps_per_epoch
                                            or steps_per_epoch < 1):
            raise ValueError(f"DBS: steps_per_epoch must be None or an integer >= 1, "
                             f"got {steps_per_epoch!r}")
        self.steps_per_epoch = None if steps_per_epoch is None else int(steps_per_epoch)

    def start(self, ctx: Context) -> np.ndarray:
        """Remember ``ctx``; the first epoch runs the equal split."""
        self._setup(ctx)
        self.speed = np.full(self.world, np.nan)
        self.acc_epoch = -1  # epoch of the records being accumulated
        self.acc_steps = 0
        self.acc_samples = np.zeros(self.world)
        self.acc_time = np.zeros(self.world)
        return self._emit(self._uniform())

    def decide(self, history: Any) -> np.ndarray:
        """Accumulate the latest record; at the end of an epoch, re-split by its speeds."""
        rec = self._latest(history)
        if rec.epoch != self.acc_epoch and self.acc_steps:
            self._close_epoch()  # the epoch ended without us knowing its last step
        self.acc_epoch = rec.epoch
        self._accumulate(rec)
        if self.steps_per_epoch is not None and (rec.step + 1) % self.steps_per_epoch == 0:
            self._close_epoch()
        return self._emit(self.last)

    def _accumulate(self, rec: StepRecord) -> None:
        self.acc_steps += 1
        self.acc_samples = self.acc_samples + rec.batch
        self.acc_time = self.acc_time + rec.compute

    def _close_epoch(self) -> None:
        with np.errstate(divide="ignore", invalid="ignore"):
            v = np.where(self.acc_samples > 0, self.acc_samples / self.acc_time, np.nan)
        # A rank that had no samples this epoch keeps its last known speed, else the median of
        # the measured ones, so a rank at a lower bound of 0 can come back.
        v = np.where(np.isfinite(v), v, self.speed)
        known = np.isfinite(v)
        v = np.where(known, v, float(np.median(v[known])) if known.any() else 1.0)
        self.speed = v
        self.last = self._proportional(v)
        self.acc_steps = 0
        self.acc_samples = np.zeros(self.world)
        self.acc_time = np.zeros(self.world)
