"""Plain Python/torch versions of every native routine: the oracle the tests compare against.

Nothing here is fast; everything here is meant to be obviously right. The float arithmetic of the
time models follows the same operation order as ``csrc/`` so results can be compared exactly.

The native communication hook (``csrc/hook/weighted_hook.cpp``) has its plain version here too,
:func:`weighted_allreduce_hook`: a Python DDP hook over the same native step core (the one store
of the row, weight and table), issuing the same collectives, so the two can be compared on real
process groups (tests/test_comm_hook.py) and even mixed across ranks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from hetlb.core.models import TimeModel


__all__ = [
    "raw_time", "effective_times", "allocate", "proportional_shares", "allocate_proportional",
    "schedule", "rebalance", "rebalance_level", "continuous_bound", "ref_scale_", "ref_flatten_scaled", "ref_unflatten_", "ref_delay_compensate_",
    "ReferenceHookState", "weighted_allreduce_hook", "ref_block_slots",
]


# ----------------------------------------------------------------------------------------------
# Time models and allocation
# ----------------------------------------------------------------------------------------------

def raw_time(model: TimeModel, b: int) -> float:
    """The model at one integer batch size, with the native core's arithmetic."""
    kind, p, _ = model._native
    x = float(b)
    if kind == 0:
        return p[0] + p[1] * x
    if kind == 1:
        y = 0.0
        for c in p:
            y = y * x + c
        return y
    k = p.size // 2
    xs, ts = p[:k], p[k:]
    if k == 1:
        return ts[0] * (x / xs[0])
    j = min(max(int(np.searchsorted(xs, x, side="right")) - 1, 0), k - 2)
    return ts[j] + (ts[j + 1] - ts[j]) * ((x - xs[j]) / (xs[j + 1] - xs[j]))


def effective_times(model: TimeModel, bmax: int) -> np.ndarray:
    """``tau[0..bmax]``: 0 at 0, else the running maximum of the model over 1..b, clamped at 0."""
    tau = np.zeros(bmax + 1)
    run = 0.0
    for b in range(1, bmax + 1):
        run = max(run, float(raw_time(model, b)))
        tau[b] = run
    return tau


def allocate(models: Sequence[TimeModel], total: int, lower: Optional[Sequence[int]] = None,
             upper: Optional[Sequence[int]] = None) -> np.ndarray:
    """Reference for :func:`hetlb.allocate`, written from the definition with whole tables.

    1. ``M*`` = least value ``v`` such that every ``tau_i(lower_i) <= v`` and the largest sizes
       ``c_i(v) = max{b in [lower_i, upper_i] : tau_i(b) <= v}`` sum to at least ``total``.
    2. ``L*`` = largest value ``L > 0`` such that every worker with ``c_i(M*) >= 1`` has a size in
       ``[lower_i, c_i(M*)]`` with ``tau >= L`` and the least such sizes ``l_i`` sum to at most
       ``total`` (else ``L* = 0`` and ``l_i = lower_i``).
    3. Water level ``X`` = least value with ``sum clip(cap_i(X), l_i, c_i) >= total``; each worker
       gets ``clip(largest b with tau < X, l_i, c_i)`` and what is left goes in index order.
    """
    n = len(models)
    lo = np.zeros(n, np.int64) if lower is None else np.asarray(lower, np.int64)
    hi = np.full(n, total, np.int64) if upper is None else np.minimum(np.asarray(upper, np.int64), total)
    hi = np.maximum(hi, lo)
    if lo.sum() > total or hi.sum() < total:
        raise ValueError("infeasible bounds")
    if total == 0:
        return np.zeros(n, np.int64)
    tau = [effective_times(m, int(h)) for m, h in zip(models, hi)]
    values = sorted({0.0}.union(*[set(t.tolist()) for t in tau]))

    def cap(i: int, v: float, strict: bool = False) -> int:
        ok = [b for b in range(int(hi[i]) + 1) if (tau[i][b] < v if strict else tau[i][b] <= v)]
        return max(ok, default=0)

    clip = lambda v, a, z: min(max(v, a), z)
    mstar = next(v for v in values
                 if all(tau[i][lo[i]] <= v for i in range(n))
                 and sum(clip(cap(i, v), lo[i], hi[i]) for i in range(n)) >= total)
    c = [clip(cap(i, mstar), lo[i], hi[i]) for i in range(n)]

    def floors(L: float) -> Optional[List[int]]:
        out = []
        for i in range(n):
            if c[i] == 0:
                out.append(0)
                continue
            ok = [b for b in range(lo[i], c[i] + 1) if tau[i][b] >= L]
            if not ok:
                return None
            out.append(min(ok))
        return out if sum(out) <= total else None

    feasible = [L for L in values if 0 < L <= mstar and floors(L) is not None]
    l = floors(max(feasible)) if feasible else [0 if c[i] == 0 else int(lo[i]) for i in range(n)]

    x = next(v for v in values if v <= mstar and sum(clip(cap(i, v), l[i], c[i]) for i in range(n)) >= total)
    out = [clip(cap(i, x, strict=True), l[i], c[i]) for i in range(n)]
    for i in range(n):
        add = min(clip(cap(i, x), l[i], c[i]) - out[i], total - sum(out))
        out[i] += add
    return np.asarray(out, np.int64)


def makespan(models: Sequence[TimeModel], sizes: Sequence[int]) -> float:
    """``max_i tau_i(b_i)`` (0 for ``b_i = 0``)."""
    return max(float(effective_times(m, int(b))[int(b)]) for m, b in zip(models, sizes))


def proportional_shares(speeds: Sequence[float], total: int, lower: Optional[Sequence[int]] = None,
                        upper: Optional[Sequence[int]] = None) -> List[Fraction]:
    """Exact continuous shares ``clip(lambda * v_i, lower_i, upper_i)`` summing to ``total``."""
    n = len(speeds)
    vmax = Fraction(max(float(s) for s in speeds))
    v = [max(Fraction(float(s)) / vmax, Fraction(1e-200)) if s > 0 else Fraction(0) for s in speeds]
    lo = [0] * n if lower is None else [int(x) for x in lower]
    hi = [min(total, int(x)) for x in ([total] * n if upper is None else upper)]
    hi = [max(a, z) for a, z in zip(lo, hi)]
    if sum(hi[i] if v[i] > 0 else lo[i] for i in range(n)) < total:
        # The others full, speed-0 workers share the rest as if equally fast.
        lo = [hi[i] if v[i] > 0 else lo[i] for i in range(n)]
        v = [Fraction(0) if v[i] > 0 else Fraction(1) for i in range(n)]

    def shares(lam: Fraction) -> List[Fraction]:
        return [min(max(lam * v[i], Fraction(lo[i])), Fraction(hi[i])) for i in range(n)]

    # The sum is piecewise linear in lambda with breakpoints lo/v and hi/v: find the piece.
    bps = sorted({Fraction(0)} | {Fraction(b) / v[i] for i in range(n) if v[i] > 0 for b in (lo[i], hi[i])})
    lam = bps[-1]
    for a, z in zip(bps, bps[1:]):
        sa, sz = sum(shares(a)), sum(shares(z))
        if sa >= total:
            lam = a
            break
        if sz >= total:
            lam = a + (z - a) * (total - sa) / (sz - sa)
            break
    return shares(lam)


def allocate_proportional(speeds: Sequence[float], total: int, lower: Optional[Sequence[int]] = None,
                          upper: Optional[Sequence[int]] = None) -> np.ndarray:
    """Reference for :func:`hetlb.allocate_proportional`, in exact rational arithmetic."""
    n = len(speeds)
    hi = [min(total, int(x)) for x in ([total] * n if upper is None else upper)]
    hi = [max(a, z) for a, z in zip([0] * n if lower is None else lower, hi)]
    x = proportional_shares(speeds, total, lower, upper)
    out = [int(xi) for xi in x]  # floor: shares are >= 0
    rest = total - sum(out)
    order = sorted(range(n), key=lambda i: (-(x[i] - out[i]), i))
    for i in order:
        if rest == 0:
            break
        if out[i] < hi[i]:
            out[i] += 1
            rest -= 1
    return np.asarray(out, np.int64)


# ----------------------------------------------------------------------------------------------
# Size-aware scheduling (CHRONICA)
# ----------------------------------------------------------------------------------------------

def _eft(sizes: Sequence[float], items: Sequence[int], slope: Sequence[float], intercept: Sequence[float],
         load: List[float], dest: List[int]) -> None:
    order = sorted(items, key=lambda i: (-sizes[i], i))
    for i in order:
        s = float(sizes[i])
        now = [intercept[r] + slope[r] * load[r] for r in range(len(slope))]
        # Earliest finish; equal finishes (also by rounding) go to the rank free first, then the lowest.
        r = min(range(len(slope)), key=lambda r: (now[r] + slope[r] * s, now[r], r))
        dest[i] = r
        load[r] += s


def continuous_bound(total: float, slope: Sequence[float], intercept: Sequence[float]) -> float:
    """Least T with ``sum_r max(0, (T - intercept_r) / slope_r) >= total``: the makespan if samples
    could be split at will, a lower bound for :func:`hetlb.schedule` and :func:`hetlb.rebalance`."""
    slope = np.asarray(slope, np.float64)
    intercept = np.asarray(intercept, np.float64)
    lo, hi = float(intercept.min()), float(intercept.max() + total * slope.max() + 1)
    for _ in range(200):
        mid = (lo + hi) / 2
        cap = float(np.sum(np.maximum(0.0, (mid - intercept) / slope)))
        lo, hi = (lo, mid) if cap >= total else (mid, hi)
    return max(hi, float(intercept.max()))


def schedule(sizes: Sequence[float], slope: Sequence[float], intercept: Sequence[float],
             first: Optional[int] = None, cap: Optional[Sequence[float]] = None) -> np.ndarray:
    """Reference for :func:`hetlb.schedule`: the ``first`` sample, then largest first, each to the
    earliest finish among the ranks it fits in (``cap``)."""
    sizes = [float(s) for s in sizes]
    slope = [float(a) for a in slope]
    intercept = [float(b) for b in intercept]
    dest = [-1] * len(sizes)
    if first is None and cap is None:
        _eft(sizes, range(len(sizes)), slope, intercept, [0.0] * len(slope), dest)
        return np.asarray(dest, np.int64)
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    if first is not None:
        order.remove(first)
        order.insert(0, first)
    caps = [math.inf] * len(slope) if cap is None else [float(c) for c in cap]
    load = [0.0] * len(slope)
    for i in order:
        s = sizes[i]
        fits = [r for r in range(len(slope)) if load[r] + s <= caps[r]]
        if not fits:
            raise ValueError(f"schedule: sample {i} (size {s}) fits in no rank's cap")
        now = {r: intercept[r] + slope[r] * load[r] for r in fits}
        r = min(fits, key=lambda r: (now[r] + slope[r] * s, now[r], r))
        dest[i] = r
        load[r] += s
    return np.asarray(dest, np.int64)


def rebalance_level(total: float, slope: Sequence[float], intercept: Sequence[float]) -> float:
    """The equal-time level of :func:`hetlb.rebalance`: ``sum_r max(0, (T - b_r) / a_r) = total``,
    solved by adding ranks in order of intercept (the same operations as the native code)."""
    R = len(slope)
    by_b = sorted(range(R), key=lambda r: (intercept[r], r))
    inv = wsum = 0.0
    level = intercept[by_b[0]]
    for k, r in enumerate(by_b):
        inv += 1.0 / slope[r]
        wsum += intercept[r] / slope[r]
        level = (total + wsum) / inv
        if k + 1 == R or level <= intercept[by_b[k + 1]]:
            break
    return level


def rebalance(owner: Sequence[int], sizes: Sequence[float], slope: Sequence[float],
              intercept: Sequence[float], tolerance: Optional[float] = None) -> np.ndarray:
    """Reference for :func:`hetlb.rebalance`: ranks above ``level + tolerance`` give up their
    largest samples until they are not; the given-up and unowned samples go largest first to the
    rank predicted to finish first."""
    sizes = [float(s) for s in sizes]
    slope = [float(a) for a in slope]
    intercept = [float(b) for b in intercept]
    R = len(slope)
    load = [0.0] * R
    total = 0.0
    storage: List[int] = []
    for i, r in enumerate(owner):
        if r < 0:
            storage.append(i)
        else:
            load[r] += sizes[i]
        total += sizes[i]
    tol = max(slope) * max(sizes, default=0.0) if tolerance is None else float(tolerance)
    eps = 1e-12 * total
    level = rebalance_level(total, slope, intercept)
    for r in range(R):
        bound = max(0.0, (level - intercept[r]) / slope[r]) + tol / slope[r] + eps
        mine = sorted((i for i in range(len(sizes)) if owner[i] == r), key=lambda i: (-sizes[i], i))
        for i in mine:
            if not load[r] > bound:
                break
            storage.append(i)
            load[r] -= sizes[i]
    dest = [int(r) for r in owner]
    for i in sorted(storage, key=lambda i: (-sizes[i], i)):
        r = min(range(R), key=lambda r: (intercept[r] + slope[r] * load[r], r))
        dest[i] = r
        load[r] += sizes[i]
    return np.asarray(dest, np.int64)


# ----------------------------------------------------------------------------------------------
# Tensor kernels (torch.ops.hetlb): one tensor at a time, in float32 (float64 for float64)
# ----------------------------------------------------------------------------------------------

def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def ref_scale_(tensors: Sequence[Tensor], weight: float) -> None:
    for t in tensors:
        t.copy_(t.to(_opmath(t.dtype)) * weight)


def ref_flatten_scaled(tensors: Sequence[Tensor], weight: float,
                       extra: Optional[Tensor] = None) -> Tensor:
    tensors = list(tensors)
    if not tensors:
        return extra.clone() if extra is not None else torch.empty(0, dtype=torch.float32)
    dtype = tensors[0].dtype
    parts: List[Tensor] = [(t.reshape(-1).to(_opmath(dtype)) * weight).to(dtype) for t in tensors]
    if extra is not None:
        parts.append(extra.reshape(-1).to(dtype))
    return torch.cat(parts) if parts else tensors[0].new_empty(0)


def ref_unflatten_(flat: Tensor, tensors: Sequence[Tensor], scale: float) -> None:
    off = 0
    for t in tensors:
        n = t.numel()
        t.copy_((flat[off:off + n].to(_opmath(flat.dtype)) * scale).view(t.shape))
        off += n


def ref_delay_compensate_(grad: Tensor, param: Tensor, prev_param: Tensor, lam: float) -> None:
    m = _opmath(grad.dtype)
    g, p, q = grad.to(m), param.to(m), prev_param.to(m)
    grad.copy_(g + lam * g * g * (p - q))


# ----------------------------------------------------------------------------------------------
# The weighted all-reduce communication hook (csrc/hook/weighted_hook.cpp), in Python
# ----------------------------------------------------------------------------------------------

def ref_block_slots(rows: Sequence[np.ndarray], rank: int, world: int) -> Tensor:
    """``StepCore.slots`` of a block: this rank's rows of positions ``0..len(rows)-1`` (each the
    row as stamped at that position; the last one the current step's) in a zeroed float64 region
    of ``len(rows)`` tables of ``[world, fields]``, step-major. Shape ``[len(rows) * world * fields]``."""
    fields = len(rows[0])
    region = torch.zeros(len(rows), world, fields, dtype=torch.float64)
    for j, r in enumerate(rows):
        region[j, rank] = torch.as_tensor(np.asarray(r, dtype=np.float64))
    return region.reshape(-1)


@dataclass
class ReferenceHookState:
    """State of :func:`weighted_allreduce_hook`: the rank's native step core (``hetlb._C.StepCore``)
    and the process groups. ``buckets`` counts the buckets hooked since the object was made;
    ``attached``: the hook of another model on the same batches (weights only, no telemetry)."""

    core: Any
    group: Any = None
    side_group: Any = None
    buckets: int = 0
    #: The hook of a model attached to the Balancer (weights only: no step end, no table).
    attached: bool = False


def weighted_allreduce_hook(state: ReferenceHookState, bucket):  # noqa: ANN001, ANN201
    """``sum_r w_r * bucket_r`` with the telemetry table riding along: the Python version of the
    native hook, for Gloo groups (register with ``ddp.register_comm_hook(state, hook)``).

    ``bucket`` is a ``torch.distributed.GradBucket``; returns a ``torch.futures.Future`` of the
    reduced bucket, which for the step's last bucket also marks the step's reduction finished
    (``StepCore.reduced``, read by the watchdog). (No annotations: DDP compares them with its own
    types, and this module's postponed annotations would be strings.)
    """
    fut = _weigh_and_reduce(state, bucket)
    if not bucket.is_last() or state.attached:
        return fut
    core = state.core

    def reduced(f: torch.futures.Future) -> Tensor:
        core.mark_reduced()
        return f.value()
    return fut.then(reduced)


def _weigh_and_reduce(state: ReferenceHookState, bucket):  # noqa: ANN001, ANN202
    import torch.distributed as dist

    core = state.core
    if not core.open:
        raise RuntimeError("hetlb: a backward pass of the DDP model ran outside a balanced step. "
                           "A second DDP model trained on another Balancer's batches is attached "
                           "to that Balancer (bal.attach(model)) instead of given one of its own. "
                           "This DDP model cannot be used again (its reducer stopped inside the "
                           "backward pass): fix the loop and start over")
    state.buckets += 1
    buf = bucket.buffer()
    w = float(core.weight)
    # The loss was scaled (Balancer.backward): the gradient carries the weight, the hook sums.
    applied = 1.0 if core.prescaled else w
    if w == 0.0:
        buf.zero_()  # an idle rank's gradient may be NaN (mean over no samples)
    last = bucket.is_last() and not state.attached
    if last:
        core.last_ready()
    # With a block of steps (exchange_every) only the block's last step sends the table, of every
    # step of the block; the other steps send the gradient alone.
    send = last and core.ship
    if send and core.carry:
        n = buf.numel()
        flat = ref_flatten_scaled([buf], 1.0 if w == 0.0 else applied, extra=core.slots)
        fut = dist.all_reduce(flat, group=state.group, async_op=True).get_future()

        def unpack(f: torch.futures.Future) -> Tensor:
            out = f.value()[0]
            core.store_table(out[n:].to(torch.float64).view(-1, core.fields).numpy())
            return out[:n]  # DDP copies the result out of the view, as for the native hook
        return fut.then(unpack)
    # The table goes with the collectives of the native hook, in the same order: before the
    # last bucket's all-reduce on the gradient group itself (or with `side_first`), else from
    # that all-reduce's continuation once it is done (this step's row taken now).
    side = state.side_group if state.side_group is not None else state.group
    first = core.side_first or side is state.group
    if send and first:
        slots = core.slots
        core.adopt_side(dist.all_reduce(slots, group=side, async_op=True), slots)
    if w != 0.0 and applied != 1.0:
        ref_scale_([buf], applied)
    fut = dist.all_reduce(buf, group=state.group, async_op=True).get_future()
    if not send or first:
        return fut.then(lambda f: f.value()[0])
    slots = core.slots

    def then_table(f: torch.futures.Future) -> Tensor:
        out = f.value()[0]
        core.adopt_side(dist.all_reduce(slots, group=side, async_op=True), slots)
        return out
    return fut.then(then_table)
