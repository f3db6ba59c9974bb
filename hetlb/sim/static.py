"""Static planning: the split each rule gives a cluster described by time models, before renting it.

:func:`compare_splits` is what ``hetlb plan`` prints: for the given per-worker time models and
global batch, the equal split (SSGD), LBB's exact min-max allocation (Eq. 3, :func:`hetlb.allocate`)
and LB-BSP's proportional rule (``x_i = v_i / sum v * X`` with each worker's speed measured at
the equal split, what LB-BSP's CPU mode does after its first step), each with its per-worker
times, the step time (the slowest worker), the straggler effect and the speed-up over the
equal split. Times are in the models' unit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from hetlb.core.models import TimeModel
from hetlb.core.solve import allocate, allocate_proportional
from hetlb.core.telemetry import straggler_effect


__all__ = ["Split", "compare_splits"]


@dataclass
class Split:
    """One rule's split: ``sizes`` int64 ``[n]``, ``times`` ``[n]`` (0 for a worker with no
    samples), ``step`` the slowest time, ``se`` LBB's straggler effect, ``speedup`` the equal
    split's step over this one's."""

    rule: str
    sizes: np.ndarray
    times: np.ndarray
    step: float
    se: float
    speedup: float = 1.0

    def to_dict(self) -> Dict[str, Any]:
        return {"rule": self.rule, "sizes": self.sizes.tolist(), "times": self.times.tolist(),
                "step": self.step, "se": self.se, "speedup": self.speedup}


def _split(rule: str, models: Sequence[TimeModel], sizes: np.ndarray) -> Split:
    times = np.array([float(m.effective_time(int(b))) if b > 0 else 0.0 for m, b in zip(models, sizes)])
    return Split(rule, sizes.astype(np.int64), times, float(times.max()), straggler_effect(times, sizes))


def compare_splits(models: Sequence[TimeModel], global_batch: int, lower: Optional[Any] = None,
                   upper: Optional[Any] = None) -> List[Split]:
    """The equal split, LBB's exact allocation and LB-BSP's proportional rule on ``models``.

    Args:
        models: one time model per worker (seconds, or any unit, at batch ``b``).
        global_batch: samples per step over all workers.
        lower, upper: per-worker bounds (a number or ``[n]``); default 1 and ``global_batch``
            (``upper`` is the memory limit, ``Profile.limit``).

    Returns:
        ``[uniform, lbb, lbbsp]`` :class:`Split` objects.
    """
    n = len(models)
    if n < 1:
        raise ValueError("compare_splits: no workers (give one time model per worker)")
    lo = np.broadcast_to(np.asarray(1 if lower is None else lower, np.int64), (n,)).copy()
    up = np.broadcast_to(np.asarray(global_batch if upper is None else upper, np.int64), (n,)).copy()
    uniform = allocate_proportional(np.ones(n), global_batch, lo, up)
    u = _split("uniform", models, uniform)
    exact = _split("lbb", models, allocate(models, global_batch, lo, up))
    with np.errstate(divide="ignore"):
        speed = np.where(u.times > 0, uniform / np.where(u.times > 0, u.times, 1.0), 0.0)
    if not np.any(speed > 0):
        speed = np.ones(n)
    prop = _split("lbbsp", models, allocate_proportional(speed, global_batch, lo, up))
    out = [u, exact, prop]
    for s in out:
        # A worker predicted to take no time (or an infinite one) for the samples a rule gives
        # it leaves the comparison without meaning (speed-ups of x/0): refused. The times are
        # the solvers' (the running maximum, clamped at 0), so a fit dipping below zero at
        # batches no rule gives (a profile's curve extended down to 1) still plans.
        bad = np.flatnonzero((s.sizes > 0) & ~((s.times > 0) & np.isfinite(s.times)))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"worker {i}: its time model gives {s.times[i]:g} at batch "
                             f"{int(s.sizes[i])} (the {s.rule} split {s.sizes.tolist()}); a "
                             f"worker's time must be positive and finite for the batches it gets: "
                             f"add a start-up overhead or fix the coefficients")
        s.speedup = u.step / s.step  # (u, checked first, has a positive step)
    return out
