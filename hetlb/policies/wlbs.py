"""WLBS: weight-based load balancing (initial division, partial adjustments, redistribution).

Section 3.2 of the WLBS paper, on a synchronous data-parallel step:

* **Initial division**: sizes proportional to a performance indicator of each rank's hardware
  (``ctx.hardware``, see :func:`hetlb.telemetry.hardware_info`).
* **Small adjustment** (every step): while the per-step times of the ranks differ by more than
  ``theta_b``, move samples between the slowest and the fastest rank only (the paper tunes "only
  between the best-performing and the worst-performing node"), splitting their joint batch by
  their measured speeds ``b / t`` so the pair would finish together.
* **Major adjustment** (at an epoch boundary): if the ranks' epoch times (sum of their step times
  over the epoch) differ by more than ``theta_e``, re-split all ranks in proportion to their
  epoch speeds (samples / seconds over the epoch).
* **Redistribution**: a rank that stops making progress is dropped to its lower bound and its
  share goes to the others in proportion to their speeds.

Interpretations:

* The paper's ``theta_b`` / ``theta_e`` are absolute time precisions (``|t_i - t_j| <= theta``);
  here they are fractions of the mean time, ``(max t - min t) / mean t <= theta``, so one default
  fits any model and cluster.
* "Stops making progress": a step time of ``+inf`` (a rank reporting a timeout), or at least
  ``stall`` times the median step time of the other working ranks. NaN, negative times and zero
  time with samples remain invalid telemetry (``ValueError``), as for every policy.
* A failed rank stays at its lower bound; if that bound is above 0 it keeps reporting, and at the
  end of an epoch in which it never stalled it is taken back at its measured epoch speed.
* The indicator ratio is ``gpu_sms * gpu_clock`` (``gpu_sms`` alone if the clock is unknown)
  when every rank has a GPU, else ``cpus``; with ``memory_weight = w > 0`` it is the weighted
  geometric mean ``compute^(1-w) * memory^w`` (``gpu_memory`` or RAM), each normalised by its
  maximum. Missing indicators on any rank give the equal split.
* Small adjustments act only on a record whose ``batch`` equals the policy's last decision (a
  decision can take effect steps late); a small move is made only if the pair's predicted
  slower time improves, so integer rounding cannot make two ranks swap samples back and forth.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ..telemetry import StepRecord, validate_record
from .base import Context
from .uniform import _SizedPolicy

__all__ = ["WLBS"]


def _indicator(hardware: Sequence[Dict[str, float]], memory_weight: float) -> Optional[np.ndarray]:
    """Per-rank performance indicator from hardware info, or None if it is missing somewhere."""

    def column(key: str) -> Optional[np.ndarray]:
        vals = np.array([float(h.get(key, np.nan)) for h in hardware])
        return vals if vals.size and np.all(np.isfinite(vals)) and np.all(vals > 0) else None

    sms = column("gpu_sms")
    if sms is not None:
        clock = column("gpu_clock")
        compute = sms * clock if clock is not None else sms
        memory = column("gpu_memory")
    else:
        compute = column("cpus")
        memory = column("memory")
    if compute is None:
        return None
    score = compute / compute.max()
    if memory_weight > 0 and memory is not None:
        score = score ** (1.0 - memory_weight) * (memory / memory.max()) ** memory_weight
    return score


class WLBS(_SizedPolicy):
    """Weight-based load balancing.

    Args:
        theta_b: relative per-step time gap ``(max t - min t) / mean t`` above which a small
            adjustment moves samples between the slowest and the fastest rank.
        theta_e: relative per-epoch time gap above which the epoch boundary re-splits all ranks.
        stall: a rank whose step time is at least ``stall`` times the median of the other working
            ranks (or ``+inf``) has stopped making progress.
        memory_weight: weight in ``[0, 1)`` of memory size in the initial hardware indicator.
        steps_per_epoch: steps per epoch if known, so the major adjustment applies from the first
            step of the next epoch; otherwise the boundary is noticed at the first record of the
            new epoch (``record.epoch`` changes) and applies a step later.

    Attributes:
        failed: bool per rank, ranks currently held at their lower bound.
        actions: ``"none"``, ``"small"``, ``"major"`` or ``"redistribute"`` per :meth:`decide`.
    """

    name = "wlbs"

    def __init__(self, theta_b: float = 0.05, theta_e: float = 0.05, stall: float = 10.0,
                 memory_weight: float = 0.0, steps_per_epoch: Optional[int] = None) -> None:
        theta_b, theta_e, stall = float(theta_b), float(theta_e), float(stall)
        w = float(memory_weight)
        for name, v in (("theta_b", theta_b), ("theta_e", theta_e)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"WLBS: {name} must be a finite number >= 0, got {v}")
        if not (stall > 1):
            raise ValueError(f"WLBS: stall must be > 1 (a multiple of the median time), "
                             f"got {stall}")
        if not (0 <= w < 1):
            raise ValueError(f"WLBS: memory_weight must be in [0, 1), got {w}")
        if steps_per_epoch is not None and (isinstance(steps_per_epoch, bool)
                                            or int(steps_per_epoch) != steps_per_epoch
                                            or steps_per_epoch < 1):
            raise ValueError(f"WLBS: steps_per_epoch must be None or an integer >= 1, "
                             f"got {steps_per_epoch!r}")
        self.theta_b, self.theta_e, self.stall, self.memory_weight = theta_b, theta_e, stall, w
        self.steps_per_epoch = None if steps_per_epoch is None else int(steps_per_epoch)
        self.actions: List[str] = []

    # -- protocol ---------------------------------------------------------------------------

    def start(self, ctx: Context) -> np.ndarray:
        """Initial division by the hardware indicator ratio (equal split without one)."""
        self._setup(ctx)
        self.failed = np.zeros(self.world, dtype=bool)
        self.actions = []
        self._reset_epoch(-1)
        score = _indicator(ctx.hardware, self.memory_weight)
        return self._emit(self._uniform() if score is None else self._proportional(score))

    def decide(self, history: Any) -> np.ndarray:
        """Redistribute a stalled rank, else major adjustment at an epoch end, else small one."""
        rec = self._latest(history)
        stalled = self._stalled(rec)
        epoch_end = None
        if rec.epoch != self.acc_epoch and self.acc_steps:
            epoch_end = self._close_epoch()  # noticed at the first record of the next epoch
        if not self.acc_steps:
            self._reset_epoch(rec.epoch)
        self._accumulate(rec, stalled)
        if self.steps_per_epoch is not None and (rec.step + 1) % self.steps_per_epoch == 0:
            epoch_end = self._close_epoch()
            self._reset_epoch(rec.epoch + 1)

        action, sizes = "none", self.last
        # Keep at least one working rank: with none left there is nothing to share to.
        if (stalled & ~self.failed).any() and not (stalled | self.failed).all():
            self.failed |= stalled
            action, sizes = "redistribute", self._redistribute(rec)
        elif epoch_end is not None:
            major = self._major(*epoch_end)
            if major is not None:
                action, sizes = "major", major
        elif np.array_equal(rec.batch, self.last):
            small = self._small(rec)
            if small is not None:
                action, sizes = "small", small
        self.actions.append(action)
        return self._emit(sizes)

    def _validate(self, rec: StepRecord) -> None:
        # +inf is how a rank says it made no progress (handled as a failure); everything else
        # that validate_record rejects is still an error.
        finite = np.where(np.isposinf(rec.compute), 1.0, rec.compute)
        validate_record(dataclasses.replace(rec, compute=finite))
        if np.isposinf(rec.compute).all():
            raise ValueError(f"step {rec.step}: no rank made progress "
                             f"(compute is inf on every rank)")

    # -- epoch bookkeeping ------------------------------------------------------------------

    def _reset_epoch(self, epoch: int) -> None:
        self.acc_epoch = int(epoch)
        self.acc_steps = 0
        self.acc_samples = np.zeros(self.world)
        self.acc_time = np.zeros(self.world)
        self.acc_stalled = np.zeros(self.world, dtype=bool)

    def _accumulate(self, rec: StepRecord, stalled: np.ndarray) -> None:
        self.acc_steps += 1
        self.acc_samples = self.acc_samples + rec.batch
        self.acc_time = self.acc_time + rec.compute
        self.acc_stalled = self.acc_stalled | stalled

    def _close_epoch(self) -> tuple:
        """Samples, time and stall flags of the finished epoch; the accumulators are cleared."""
        out = (self.acc_samples, self.acc_time, self.acc_stalled)
        self._reset_epoch(self.acc_epoch)
        return out

    # -- adjustments ------------------------------------------------------------------------

    def _stalled(self, rec: StepRecord) -> np.ndarray:
        t = rec.compute
        out = np.isposinf(t)
        ref = (rec.batch > 0) & np.isfinite(t) & ~self.failed
        idx = np.flatnonzero(ref)
        m = idx.size
        if m >= 1:
            v = np.sort(t[idx])
            # Median of the others: for a rank outside ``ref`` all of v; for one inside, v without
            # that rank's sorted position p (w[i] = v[i] for i < p, v[i + 1] after).
            med = np.full(self.world, float(np.median(v)))
            if m >= 2:
                pos = np.empty(m, np.int64)
                pos[np.argsort(t[idx], kind="stable")] = np.arange(m)
                lo, hi = (m - 2) // 2, (m - 1) // 2
                w_lo = np.where(lo < pos, v[lo], v[min(lo + 1, m - 1)])
                w_hi = np.where(hi < pos, v[hi], v[min(hi + 1, m - 1)])
                med[idx] = 0.5 * (w_lo + w_hi)
            else:
                med[idx] = np.inf  # no other working rank to compare with
            check = (rec.batch > 0) & np.isfinite(t)
            out |= check & (t >= self.stall * med)
        if out.all():
            raise ValueError(f"step {rec.step}: every rank looks stalled (compute={t.tolist()})")
        return out

    def _speeds(self, samples: np.ndarray, time: np.ndarray) -> np.ndarray:
        """Samples/s of working ranks (failed: 0; unmeasured: median of the measured)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            v = np.where((samples > 0) & np.isfinite(time) & (time > 0), samples / time, np.nan)
        v[self.failed] = 0.0
        known = np.isfinite(v) & ~self.failed
        fill = float(np.median(v[known])) if known.any() else 1.0
        return np.where(np.isfinite(v), v, fill)

    def _redistribute(self, rec: StepRecord) -> np.ndarray:
        # Zero speed keeps a failed rank at its lower bound; the rest is shared by speed.
        return self._proportional(self._speeds(rec.batch.astype(np.float64), rec.compute))

    def _major(self, samples: np.ndarray, time: np.ndarray,
               stalled: np.ndarray) -> Optional[np.ndarray]:
        # Take back failed ranks that worked all epoch (only possible with a lower bound > 0).
        back = self.failed & ~stalled & (samples > 0) & np.isfinite(time)
        self.failed = self.failed & ~back
        working = ~self.failed & (samples > 0) & np.isfinite(time)
        if not working.any():
            return None
        t = time[working]
        gap = float((t.max() - t.min()) / t.mean()) if t.mean() > 0 else 0.0
        if gap <= self.theta_e and not back.any():
            return None
        return self._proportional(self._speeds(samples, time))

    def _small(self, rec: StepRecord) -> Optional[np.ndarray]:
        t, last = rec.compute, self.last
        active = ~self.failed & (last > 0)
        if active.sum() < 2:
            return None
        ta = t[active]
        if not (ta.max() - ta.min() > self.theta_b * ta.mean()):
            return None
        s = int(np.argmax(np.where(active, t, -np.inf)))
        f = int(np.argmin(np.where(active, t, np.inf)))
        pair = int(last[s] + last[f])
        vs, vf = last[s] / t[s], last[f] / t[f]
        # Split the pair's samples by speed, so both would take pair / (vs + vf) seconds.
        bf = int(round(pair * vf / (vs + vf)))
        bf = min(max(bf, int(self.lower[f]), pair - int(self.upper[s])),
                 int(self.upper[f]), pair - int(self.lower[s]))
        bs = pair - bf
        if not max(bs / vs, bf / vf) < t[s]:
            return None  # rounding or bounds leave nothing to gain
        new = last.copy()
        new[s], new[f] = bs, bf
        return new
