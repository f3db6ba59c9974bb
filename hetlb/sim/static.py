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

from ..models import TimeModel
from ..solve import allocate, allocate_proportional
from ..telemetry import straggler_effect

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
    for i, m in enumerate(models):
        # A worker that takes no time (or an infinite one) for a batch it may get leaves the
        # speed-ups without meaning (0/0, x/0): refused, as the simulator's scenarios refuse it.
        first, last = max(int(lo[i]), 1), max(int(min(up[i], global_batch)), 1)
        x = np.unique(np.concatenate([np.arange(first, min(last, first + 4095) + 1),
                                      np.round(np.linspace(first, last, 4096))])).astype(np.float64)
        t = np.asarray(m.time(x), np.float64)
        bad = np.flatnonzero(~(t > 0) | ~np.isfinite(t))
        if bad.size:
            raise ValueError(f"worker {i}: its time model gives {t[bad[0]]:g} at batch "
                             f"{x[bad[0]]:g}; a worker's time must be positive and finite for every "
                             f"batch it may get ({first}..{last}): add a start-up overhead or fix "
                             f"the coefficients")
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
        s.speedup = u.step / s.step if s.step > 0 else float("inf")
    return out
