"""WLBS: weight-based load balancing (initial division, partial adjustments, redistribution).

Section 3.2 of the WLBS paper, on a synchronous data-parallel step:

* **Initial division**: sizes proportional to a performance-indicator ratio aggregated from each
  rank's hardware indicators, the paper's "number of CPUs, number of cores, and memory size"
  (:func:`hetlb.comm.probes.hardware_info`): each normalised by its largest value over the ranks
  and averaged, with equal weights unless ``indicators`` says otherwise (GPU indicators such as
  ``gpu_sms`` or ``gpu_memory`` can be weighted in too).
* **Small adjustment** (every step): while the step times of the best and the worst rank of the
  last step differ by more than ``theta_b``, move samples between those two only (the paper tunes
  "only between the best-performing compute node and the worst-performing compute node in the
  previous cycle"): their joint batch is split by their measured speeds ``b / t``, so the pair
  would finish together.
* **Major adjustment** (at an epoch's end): if the epoch times (sum of step times over the epoch)
  of the best and the worst rank of that epoch differ by more than ``theta_e``, move samples
  between those two only: their joint batch split by their speeds over the epoch.
* **Redistribution**: a rank that makes no progress is dropped to its lower bound and its share
  goes to the others in proportion to their speeds.

Interpretations of what the paper leaves open:

* ``theta_b`` / ``theta_e`` are absolute time precisions in seconds, as in the paper
  (``|t_i - t_j| <= theta``); the paper gives no values. Defaults: ``theta_b`` 10 ms, and
  ``theta_e = None`` meaning ``theta_b`` times the number of steps in the epoch (the per-step
  precision accumulated over the epoch). ``relative=True`` reads both as fractions of the mean
  time instead, ``(max t - min t) / mean t <= theta``, which fits any model and cluster.
* "Makes no progress" (the paper has no detection mechanism): a step time of ``+inf`` (how a rank
  reports that it made no progress, e.g. ``Disturbance(fail=True)`` in :mod:`hetlb.emulate`), or
  at least ``stall`` times the median step time of the other working ranks.
* A failed rank stays at its lower bound; if that bound is above 0 it keeps reporting, and at the
  end of an epoch in which it never stalled it is taken back at its measured epoch speed.
* How much moves per adjustment is not given ("part or all"): the pair's joint batch is split by
  speed, and only if the pair's predicted slower time improves, so integer rounding cannot make two
  ranks swap samples back and forth. Small adjustments act only on a record that ran the policy's
  last decision (a decision can take effect steps late).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from hetlb.core.checks import flag, number, optional_integer
from hetlb.core.telemetry import History, StepRecord, UnusableTelemetry
from hetlb.policies.base import Context, EpochPolicy


log = logging.getLogger("hetlb.policies")

__all__ = ["WLBS"]

#: The paper's indicators, equally weighted.
DEFAULT_INDICATORS = {"cpus": 1.0, "cores": 1.0, "memory": 1.0}


def indicator(hardware: Sequence[Dict[str, float]], weights: Mapping[str, float]) -> Optional[np.ndarray]:
    """Per-rank performance indicator: the weighted mean of each indicator normalised by its
    largest value, or None if a weighted indicator is missing, not finite or not positive on some
    rank (then WLBS starts from the equal split)."""
    total = np.zeros(len(hardware))
    wsum = 0.0
    for key, w in weights.items():
        if w == 0:
            continue
        vals = np.array([float(h.get(key, np.nan)) for h in hardware])
        if not (vals.size and np.all(np.isfinite(vals)) and np.all(vals > 0)):
            return None
        total += w * vals / vals.max()
        wsum += w
    if not wsum > 0:
        return None
    score = total / wsum
    return score if np.all(np.isfinite(score)) and np.all(score > 0) else None


class WLBS(EpochPolicy):
    """Weight-based load balancing.

    Args:
        theta_b: per-step time precision: a small adjustment happens while the best and worst
            rank's step times differ by more than this (seconds; a fraction with ``relative``).
        theta_e: per-epoch time precision (seconds; a fraction with ``relative``); None:
            ``theta_b`` times the epoch's steps (or ``theta_b`` with ``relative``).
        relative: read ``theta_b``/``theta_e`` as fractions of the mean time.
        stall: a rank whose step time is at least ``stall`` times the median of the other working
            ranks (or ``+inf``) has stopped making progress.
        indicators: weights of the hardware indicators of the initial division (default: CPUs,
            cores and memory, equal weights).
        steps_per_epoch: steps per epoch, for use without the Balancer's loader (which marks each
            epoch's last step); otherwise the boundary is noticed at the first record of the next
            epoch.

    Attributes:
        failed: bool per rank, ranks currently held at their lower bound.
        actions: ``"none"``, ``"small"``, ``"major"`` or ``"redistribute"`` per :meth:`decide`
            (the latest :attr:`ACTIONS_KEPT`).
    """

    name = "wlbs"
    _optional_kinds = {"theta_e": 0.0, "steps_per_epoch": 0}
    _list_items = {"actions": str}
    accepts_no_progress = True
    ACTIONS_KEPT = 1024

    def __init__(self, theta_b: float = 0.01, theta_e: Optional[float] = None, *,
                 relative: bool = False, stall: float = 10.0,
                 indicators: Optional[Mapping[str, float]] = None,
                 steps_per_epoch: Optional[int] = None) -> None:
        self.theta_b = number(theta_b, "WLBS: theta_b", minimum=0.0)
        self.theta_e = None if theta_e is None else number(theta_e, "WLBS: theta_e", minimum=0.0)
        self.relative = flag(relative, "WLBS: relative")
        self.stall = number(stall, "WLBS: stall", above=1.0)
        if indicators is not None and not isinstance(indicators, Mapping):
            raise ValueError(f"WLBS: indicators must be a mapping of indicator name to weight "
                             f"(e.g. {DEFAULT_INDICATORS}), got {indicators!r}")
        weights = {}
        for k, w in (DEFAULT_INDICATORS if indicators is None else indicators).items():
            if not isinstance(k, str):
                raise ValueError(f"WLBS: indicators keys must be indicator names (str), got {k!r}")
            weights[k] = number(w, f"WLBS: indicators[{k!r}]", minimum=0.0)
        if not any(w > 0 for w in weights.values()):
            raise ValueError(f"WLBS: indicators needs a positive weight, got {weights}")
        self.indicators = weights
        self.steps_per_epoch = optional_integer(steps_per_epoch, "WLBS: steps_per_epoch", 1)
        self.actions: List[str] = []

    # -- protocol ---------------------------------------------------------------------------

    def start(self, ctx: Context) -> np.ndarray:
        """Initial division by the hardware indicator ratio (equal split without one)."""
        self._setup(ctx)
        self.failed = np.zeros(self.world, dtype=bool)
        self.actions = []
        self.stalled_epoch = np.zeros(self.world, dtype=bool)
        self._start_meter()
        score = indicator(ctx.hardware, self.indicators)
        missing = sorted({k for k, w in self.indicators.items() if w > 0
                          for h in ctx.hardware if h and k not in h})
        if missing:  # e.g. a misspelt name, or a GPU indicator on CPU ranks
            log.warning("WLBS: indicator(s) %s not reported by every rank (they report %s): "
                        "the initial division is the equal split", missing,
                        sorted(set().union(*ctx.hardware)))
        return self.emit(self.uniform() if score is None else self.proportional(score))

    def decide(self, history: History) -> np.ndarray:
        """Redistribute a stalled rank, else major adjustment at an epoch end, else small one."""
        rec = self.latest(history)
        if np.isinf(rec.compute).all():
            raise UnusableTelemetry(f"step {rec.step}: no rank made progress (compute is inf on "
                                    f"every rank)")
        stalled = self._stalled(rec)
        self.stalled_epoch = self.stalled_epoch | stalled
        epoch = self._meter.add_new(history, self.usable)
        action, sizes = "none", self.last
        # Keep at least one working rank: with none left there is nothing to share to.
        if (stalled & ~self.failed).any() and not (stalled | self.failed).all():
            self.failed |= stalled
            action, sizes = "redistribute", self._redistribute(rec)
        elif epoch is not None:
            major = self._major(epoch)
            if major is not None:
                action, sizes = "major", major
        elif self.ran_latest(rec):
            small = self._small(rec)
            if small is not None:
                action, sizes = "small", small
        if epoch is not None:
            self.stalled_epoch = np.zeros(self.world, dtype=bool)
        self.actions.append(action)
        if len(self.actions) > self.ACTIONS_KEPT:
            del self.actions[:-self.ACTIONS_KEPT]
        return self.emit(sizes)

    # -- adjustments ------------------------------------------------------------------------

    def _gap_exceeds(self, t: np.ndarray, theta: float) -> bool:
        gap = float(t.max() - t.min())
        if self.relative:
            mean = float(t.mean())
            return mean > 0 and gap > theta * mean
        return gap > theta

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
        return self.proportional(self._speeds(rec.batch.astype(np.float64), rec.compute))

    def _pair(self, s: int, f: int, vs: float, vf: float, now: float) -> Optional[np.ndarray]:
        """Split the joint batch of ranks ``s`` (worst) and ``f`` (best) by speeds ``vs``, ``vf``
        (samples/s); None unless the pair's predicted slower time beats ``now``."""
        last = self.last
        pair = int(last[s] + last[f])
        if not (0 < vs < np.inf and 0 < vf < np.inf and np.isfinite(vs + vf)):
            return None  # (records keep times within MIN_COMPUTE..MAX_COMPUTE; defensive)
        bf = int(round(pair * vf / (vs + vf)))
        bf = min(max(bf, int(self.lower[f]), pair - int(self.upper[s])),
                 int(self.upper[f]), pair - int(self.lower[s]))
        bs = pair - bf
        if not max(bs / vs, bf / vf) < now:
            return None  # rounding or bounds leave nothing to gain
        new = last.copy()
        new[s], new[f] = bs, bf
        return new

    def _major(self, epoch: Dict[str, Any]) -> Optional[np.ndarray]:
        samples, time = epoch["samples"], epoch["time"]
        stalled = self.stalled_epoch
        # Take back failed ranks that worked all epoch (only possible with a lower bound > 0).
        back = self.failed & ~stalled & (samples > 0) & np.isfinite(time)
        if back.any():
            self.failed = self.failed & ~back
            return self.proportional(self._speeds(samples, time))
        working = ~self.failed & (samples > 0) & np.isfinite(time) & (self.last > 0)
        if working.sum() < 2:
            return None
        theta = self.theta_e if self.theta_e is not None else \
            (self.theta_b if self.relative else self.theta_b * epoch["steps"])
        if not self._gap_exceeds(time[working], theta):
            return None
        s = int(np.argmax(np.where(working, time, -np.inf)))
        f = int(np.argmin(np.where(working, time, np.inf)))
        steps = max(int(epoch["steps"]), 1)
        # Per-step speeds over the epoch; "now": the worse of the pair's mean step times.
        return self._pair(s, f, samples[s] / time[s], samples[f] / time[f],
                          max(time[s], time[f]) / steps)

    def _small(self, rec: StepRecord) -> Optional[np.ndarray]:
        t, last = rec.compute, self.last
        active = ~self.failed & (last > 0) & np.isfinite(t)
        if active.sum() < 2 or not self._gap_exceeds(t[active], self.theta_b):
            return None
        s = int(np.argmax(np.where(active, t, -np.inf)))
        f = int(np.argmin(np.where(active, t, np.inf)))
        return self._pair(s, f, last[s] / t[s], last[f] / t[f], float(t[s]))
