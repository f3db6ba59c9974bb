"""Host algorithms: batch allocation and size-aware scheduling (thin wrappers over ``hetlb._C``).

All functions take and return NumPy arrays, check their arguments and raise ``ValueError`` with a
message that says what is wrong. The native core re-checks values (NaN, negative coefficients,
infeasible bounds) so no input can reach it unchecked.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence

import numpy as np

from hetlb import _C
from hetlb.core.models import LinearModel, TimeModel


__all__ = ["allocate", "allocate_linear", "allocate_proportional", "schedule", "rebalance"]


_INT64_MAX = np.iinfo(np.int64).max


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer, float, np.floating)):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if isinstance(value, (float, np.floating)) and not float(value).is_integer():
        raise ValueError(f"{what} must be an integer, got {value!r}")
    v = int(value)
    if v < 0:
        raise ValueError(f"{what} must be >= 0, got {v}")
    if v > _INT64_MAX:
        raise ValueError(f"{what} must be below 2**63 (a 64-bit count), got {v}")
    return v


def _vector(x: Any, what: str, dtype: Any, n: Optional[int] = None) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if n is not None and arr.size != n:
        raise ValueError(f"{what} has {arr.size} entries, expected {n}")
    if dtype is np.int64:
        if arr.size and arr.dtype.kind == "f":
            if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
                raise ValueError(f"{what} must hold integers, got {arr.tolist()}")
            if np.any(np.abs(arr) >= 2.0 ** 63):  # (would wrap around to -2**63 in int64)
                raise ValueError(f"{what} must hold integers below 2**63, got {arr.tolist()}")
        elif arr.size and arr.dtype.kind == "u" and np.any(arr > _INT64_MAX):
            raise ValueError(f"{what} must hold integers below 2**63, got {arr.tolist()}")
        elif arr.size and arr.dtype.kind not in "iu":
            raise ValueError(f"{what} must hold integers, got dtype {arr.dtype}")
    elif arr.size and arr.dtype.kind not in "iuf":
        raise ValueError(f"{what} must be numeric, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=dtype)


def _bounds(lower: Any, upper: Any, n: int, total: int) -> tuple:
    lo = np.zeros(n, np.int64) if lower is None else _vector(lower, "lower", np.int64, n)
    hi = np.full(n, total, np.int64) if upper is None else _vector(upper, "upper", np.int64, n)
    return lo, hi


def allocate(models: Sequence[TimeModel], total: int, lower: Any = None, upper: Any = None) -> np.ndarray:
    """Exact integer min-max allocation of ``total`` samples over workers (LBB Eq. 3).

    Args:
        models: one :class:`~hetlb.TimeModel` per worker (n of them).
        total: global batch size ``B >= 0``.
        lower, upper: optional per-worker bounds, shape ``[n]`` (``upper`` is LBB's memory limit
            ``B_lim``); defaults 0 and ``total``.

    Returns:
        ``int64[n]`` with ``sum == total`` and ``lower <= b <= upper`` whose makespan
        ``max_i T_i(b_i)`` over workers with ``b_i > 0`` (effective times) is the least of all
        integer allocations. A worker given 0 samples costs 0 (it sits the step out).

        Among the allocations of least makespan it has the smallest spread in this precise sense:
        the least time ``min_i T_i(b_i)`` over the workers that *can take part* (those given
        samples in at least one allocation of least makespan), counting a worker given 0 samples
        at time 0, is as large as possible. So a worker that can help is kept busy rather than
        idled: two workers ``T(b) = b`` capped at 10 and one with ``T = 10`` whatever its batch,
        total 20, ``lower = 0``, gives ``[10, 9, 1]`` (least time 9), not ``[10, 10, 0]``, whose
        spread over the two workers it uses is 0 but whose least time, counting the idle one, is 0.
        Minimising the spread over the workers actually used, when idling some would shrink it,
        is a search over which subset of workers sits out (combinatorial in general): this
        solver does not attempt it. Remaining ties are filled level by level, the lowest-indexed
        worker first.

    Raises:
        ValueError: empty ``models``, a non-model entry, NaN/negative coefficients, negative
            ``total``, or bounds that cannot reach ``total``.
    """
    models = list(models)
    if not models:
        raise ValueError("allocate: no workers (empty model list)")
    if all(type(m) is LinearModel for m in models):  # (the common case: no packing per model)
        n = len(models)
        return allocate_linear(np.fromiter([m.a0 for m in models], np.float64, n),
                               np.fromiter([m.a1 for m in models], np.float64, n), total, lower, upper)
    for i, m in enumerate(models):
        if not isinstance(m, TimeModel):
            raise ValueError(f"allocate: models[{i}] is {type(m).__name__}, not a hetlb time model")
    total = _count(total, "total")
    n = len(models)
    lo, hi = _bounds(lower, upper, n, total)
    specs = [m._native for m in models]
    kinds = np.fromiter((s[0] for s in specs), np.int64, n)
    plen = np.fromiter((s[1].size for s in specs), np.int64, n)
    clen = np.fromiter((s[2].size for s in specs), np.int64, n)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(plen, out=offsets[1:])
    cand_offsets = np.zeros(n + 1, np.int64)
    np.cumsum(clen, out=cand_offsets[1:])
    params = np.concatenate([s[1] for s in specs])
    cands = np.concatenate([s[2] for s in specs]) if cand_offsets[-1] else np.zeros(0, np.int64)
    return _C.allocate(kinds, params, offsets, cands, cand_offsets, total, lo, hi)


def allocate_linear(a0: Any, a1: Any, total: int, lower: Any = None, upper: Any = None) -> np.ndarray:
    """:func:`allocate` over linear models ``T_i(b) = a0[i] + a1[i] * b`` given as arrays.

    The same allocation as ``allocate([LinearModel(a0[i], a1[i]) ...], total, lower, upper)``
    without making a model object per worker, which costs more than the solve at a thousand
    workers (a policy that holds its models as arrays calls this).

    Args:
        a0, a1: ``float[n]`` start-up and per-sample times (finite, >= 0).
        total, lower, upper: as for :func:`allocate`.

    Raises:
        ValueError: as :func:`allocate`; a negative or non-finite coefficient names its worker.
    """
    c0 = _vector(a0, "a0", np.float64)
    if c0.size == 0:
        raise ValueError("allocate: no workers (empty model list)")
    c1 = _vector(a1, "a1", np.float64, c0.size)
    total = _count(total, "total")
    n = c0.size
    lo, hi = _bounds(lower, upper, n, total)
    params = np.empty(2 * n, np.float64)
    params[0::2] = c0
    params[1::2] = c1
    return _C.allocate(np.zeros(n, np.int64), params, np.arange(0, 2 * n + 1, 2, dtype=np.int64),
                       np.zeros(0, np.int64), np.zeros(n + 1, np.int64), total, lo, hi)


def allocate_proportional(speeds: Any, total: int, lower: Any = None, upper: Any = None) -> np.ndarray:
    """LB-BSP's CPU rule ``x_i = v_i / sum(v) * total``, rounded by largest remainder.

    Args:
        speeds: ``float[n]``, samples per second of each worker (finite, >= 0).
        total: samples to share out.
        lower, upper: optional per-worker integer bounds, shape ``[n]``.

    Returns:
        ``int64[n]`` summing exactly to ``total`` within the bounds: the floors of the
        water-filled shares ``clip(lambda * v_i, lower_i, upper_i)``, topped up by the largest
        fractional parts (ties: lower index).

    Workers of speed 0 keep their lower bound unless the others, full to their upper bounds,
    cannot take the rest; then they share the rest equally (so all-zero speeds, i.e. no
    measurement yet, give equal shares). Speeds below ``1e-200`` of the fastest count as
    ``1e-200`` of it.
    """
    v = _vector(speeds, "speeds", np.float64)
    if v.size == 0:
        raise ValueError("allocate_proportional: no workers (empty speeds)")
    total = _count(total, "total")
    lo, hi = _bounds(lower, upper, v.size, total)
    return _C.allocate_proportional(v, total, lo, hi)


def _rates(slope: Any, intercept: Any) -> tuple:
    a = _vector(slope, "slope", np.float64)
    b = _vector(intercept, "intercept", np.float64)
    if a.size != b.size:
        raise ValueError(f"slope and intercept differ in length: {a.size} vs {b.size}")
    if a.size == 0:
        raise ValueError("no ranks (empty slope)")
    return a, b


def schedule(sizes: Any, slope: Any, intercept: Any, *, first: Optional[int] = None,
             cap: Any = None) -> np.ndarray:
    """Rank of every sample of one step (CHRONICA's data scheduler).

    Rank ``r`` is predicted to take ``intercept[r] + slope[r] * (sum of sizes it gets)``. Samples
    go largest first (first-fit-decreasing / LPT), each to the rank that would finish earliest with
    it (ties: the rank free first, then the lower rank).

    Args:
        sizes: ``float[N]`` data amount of each sample (>= 0).
        slope, intercept: ``float[R]`` per-rank time model (>= 0).
        first: index of a sample placed before all others (CHRONICA Algorithm 2's random first
            pivot, which varies the assignment from step to step); None: none.
        cap: ``float[R]`` largest summed size each rank may get (memory); a sample that fits no
            rank raises ``ValueError``.

    Returns:
        ``int64[N]``, values in ``[0, R)``.
    """
    a, b = _rates(slope, intercept)
    s = _vector(sizes, "sizes", np.float64)
    if first is not None and not (0 <= int(first) < s.size):
        raise ValueError(f"first={first} is not a sample index in [0, {s.size})")
    c = None if cap is None else _vector(cap, "cap", np.float64, a.size)
    return _C.schedule(s, a, b, first=-1 if first is None else int(first), cap=c)


def rebalance(owner: Any, sizes: Any, slope: Any, intercept: Any, *,
              tolerance: Optional[float] = None) -> np.ndarray:
    """New owner of every sample of a sharded dataset (CHRONICA's data shuffler, Algorithm 3).

    Rank ``r``'s predicted epoch time is ``intercept[r] + slope[r] * (sum of sizes it owns)``; the
    *level* is the equal time all ranks would reach if samples could be split
    (:func:`hetlb.reference.continuous_bound`). A rank predicted above ``level + tolerance``
    gives up its largest samples until it is not; those (and samples no rank holds) then go,
    largest first, each to the rank predicted to finish first. A sharding already within
    tolerance stays as it is (no churn from noisy estimates).

    Guarantee, with the default tolerance (the largest sample on the slowest rank, or any
    tolerance at least that): every rank ends within ``level + tolerance``, and no reassignment
    that achieves that moves fewer samples. A smaller tolerance holds the ranks that give up
    samples to it and the others to within one sample of the level.

    Args:
        owner: ``int64[N]`` current rank of each sample, in ``[0, R)``; -1 for a sample no rank
            holds (one of a rank that left), which is always placed.
        sizes: ``float[N]`` data amount of each sample (>= 0).
        slope: ``float[R]`` per-rank time per unit of data (> 0).
        intercept: ``float[R]`` per-rank fixed time of the epoch (>= 0).
        tolerance: seconds a rank may stay above the level; None: the largest sample's time
            on the slowest rank, ``max(sizes) * max(slope)``.

    Returns:
        ``int64[N]`` new owners, in ``[0, R)``; moved samples are those where it differs from
        ``owner``.
    """
    a, b = _rates(slope, intercept)
    own = _vector(owner, "owner", np.int64)
    s = _vector(sizes, "sizes", np.float64)
    if own.size != s.size:
        raise ValueError(f"owner and sizes differ in length: {own.size} vs {s.size}")
    tol = -1.0 if tolerance is None else float(tolerance)
    if tolerance is not None and not (tol >= 0 and math.isfinite(tol)):
        raise ValueError(f"tolerance must be a finite number of seconds >= 0, got {tolerance!r}")
    return _C.rebalance(own, s, a, b, tol)
