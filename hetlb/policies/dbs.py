"""DBS: dynamic batch sizing per epoch (baseline).

Within an epoch the sizes stay fixed. When an epoch ends, every rank's speed over it (samples
processed / compute seconds, summed over the epoch's records) sets the next epoch's sizes in
proportion (:func:`hetlb.allocate_proportional`). The first epoch runs the equal split.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from hetlb.core.checks import optional_integer
from hetlb.core.telemetry import History
from hetlb.policies.base import Context, EpochPolicy


__all__ = ["DBS"]


class DBS(EpochPolicy):
    """Per-epoch proportional batch sizes from the previous epoch's speeds.

    Args:
        steps_per_epoch: steps in one epoch, for use without the Balancer's loader. The loader
            marks each epoch's last step in its record, so the new sizes apply from the first
            step of the next epoch (less the loader's prefetch); without either, the end of an
            epoch is noticed at the first record of the next one.

    Attributes:
        speed: samples/s of each rank over the latest finished epoch (NaN before one finished).
    """

    name = "dbs"

    def __init__(self, steps_per_epoch: Optional[int] = None) -> None:
        self.steps_per_epoch = optional_integer(steps_per_epoch, "DBS: steps_per_epoch", 1)

    def start(self, ctx: Context) -> np.ndarray:
        """Remember ``ctx``; the first epoch runs the equal split."""
        self._setup(ctx)
        self.speed = np.full(self.world, np.nan)
        self._start_meter()
        return self.emit(self.uniform())

    def decide(self, history: History) -> np.ndarray:
        """Count the new records; at the end of an epoch, re-split by its speeds."""
        rec = self.latest(history)
        done = self._meter.add_new(history, self.usable)
        if done is not None:
            self.last = self._resplit(done["samples"], done["time"])
        return self.emit(self.last)

    def _resplit(self, samples: np.ndarray, time: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            v = np.where(samples > 0, samples / time, np.nan)
        # A rank that had no samples this epoch keeps its last known speed, else the median of
        # the measured ones, so a rank at a lower bound of 0 can come back.
        v = np.where(np.isfinite(v), v, self.speed)
        known = np.isfinite(v)
        v = np.where(known, v, float(np.median(v[known])) if known.any() else 1.0)
        self.speed = v
        return self.proportional(v)

