"""Host-solver microbenchmarks, side by side in one run (medians of repeated timings).

allocate  — hetlb.allocate against scipy's MILP (an ILP as in BOA), a pure-Python heap over marginal
            times (exact, O(B log n)) and LBB's SLSQP (scipy.optimize.minimize on max - min, then
            rounded), on linear time models of a heterogeneous cluster.
schedule  — hetlb.schedule (4096 samples over 256 ranks) against a lower bound (the larger of the
            continuous bound and the largest sample on its best rank) and a pure-Python
            earliest-finish loop (hetlb.reference.schedule).

    python bench/bench_solvers.py [--quick] [--part all|allocate|schedule] [--out FILE]

Prints markdown tables (and writes them to --out).
"""
from __future__ import annotations

import argparse
import heapq
import statistics
import sys
import time
from typing import Callable, List, Tuple

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp, minimize

import hetlb
from hetlb import reference as ref


def median_time(fn: Callable[[], object], min_time: float = 0.5, max_reps: int = 1000) -> Tuple[float, object]:
    """Median wall time of ``fn`` over repeats filling ``min_time`` seconds (at least 3 runs)."""
    times, out, spent = [], None, 0.0
    while len(times) < 3 or (spent < min_time and len(times) < max_reps):
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
    return statistics.median(times), out


def cluster(n: int, total: int, seed: int = 0):
    """Linear models of a mixed cluster: speeds 1-4x, start-up 5-20 ms, memory limits ~3x fair share."""
    rng = np.random.default_rng(seed)
    speed = rng.choice([1.0, 2.0, 3.0, 4.0], n) * rng.uniform(0.9, 1.1, n)
    a1 = 1e-3 / speed * 256 * 4 / (total / n + 1)  # ~ a few ms for a fair share on the slowest
    a0 = rng.uniform(5e-3, 20e-3, n)
    upper = np.maximum(np.ceil(3 * total / n * rng.uniform(0.8, 1.2, n)).astype(np.int64), 1)
    return a0, a1, upper


def makespan(a0, a1, b) -> float:
    b = np.asarray(b)
    return float(np.max(np.where(b > 0, a0 + a1 * b, 0.0)))


def heap_allocate(a0, a1, upper, total) -> np.ndarray:
    """Exact greedy: each next sample to the worker whose time after taking it is least."""
    b = [0] * len(a0)
    h = [(a0[i] + a1[i], i) for i in range(len(a0)) if upper[i] > 0]
    heapq.heapify(h)
    for _ in range(total):
        _, i = heapq.heappop(h)
        b[i] += 1
        if b[i] < upper[i]:
            heapq.heappush(h, (a0[i] + a1[i] * (b[i] + 1), i))
    return np.asarray(b)


def milp_allocate(a0, a1, upper, total, time_limit: float) -> Tuple[np.ndarray, bool]:
    """min M s.t. a0*y + a1*b <= M, b <= upper*y, sum b = total; b integer, y binary."""
    n = len(a0)
    c = np.r_[np.zeros(2 * n), 1.0]
    eye = np.eye(n)
    A = np.block([[eye * a1, eye * a0, -np.ones((n, 1))],
                  [eye, -eye * upper, np.zeros((n, 1))],
                  [np.ones((1, n)), np.zeros((1, n)), np.zeros((1, 1))]])
    lb = np.r_[np.full(2 * n, -np.inf), total]
    ub = np.r_[np.zeros(2 * n), total]
    res = milp(c, constraints=LinearConstraint(A, lb, ub), integrality=np.r_[np.ones(2 * n), 0],
               bounds=Bounds(np.zeros(2 * n + 1), np.r_[upper, np.ones(n), np.inf]),
               options={"time_limit": time_limit})
    if res.x is None:
        return np.zeros(n, np.int64), False
    return np.round(res.x[:n]).astype(np.int64), bool(res.status == 0)


def slsqp_allocate(a0, a1, upper, total) -> np.ndarray:
    """LBB's approach: SLSQP on max(T) - min(T) with sum = B, then largest-remainder rounding."""
    x0 = total * (1 / a1) / np.sum(1 / a1)
    t = lambda b: a0 + a1 * b
    res = minimize(lambda b: np.max(t(b)) - np.min(t(b)), x0, method="SLSQP",
                   bounds=list(zip(np.zeros(len(a0)), upper)),
                   constraints=[{"type": "eq", "fun": lambda b: np.sum(b) - total}],
                   options={"maxiter": 200})
    x = np.clip(res.x, 0, upper)
    return hetlb.allocate_proportional(np.maximum(x, 1e-12), total, upper=upper)


def bench_allocate(quick: bool) -> List[str]:
    rows = ["| n | B | hetlb (ms) | heap (ms) | MILP (ms) | SLSQP (ms) | hetlb vs MILP | hetlb vs heap | "
            "MILP makespan / hetlb | SLSQP makespan / optimal |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ns = [4, 64, 256, 1024]
    Bs = [4096, 65536, 1 << 20] if not quick else [4096, 65536]
    for n in ns:
        for B in Bs:
            if B < 4 * n:
                continue
            a0, a1, upper = cluster(n, B)
            models = [hetlb.LinearModel(x, y) for x, y in zip(a0, a1)]
            t_h, b = median_time(lambda: hetlb.allocate(models, B, upper=upper))
            opt = makespan(a0, a1, b)
            heap_ms = milp_ms = slsqp_ms = float("nan")
            vs_milp = vs_heap = milp_ratio = slsqp_ratio = "—"
            if B <= 65536 or not quick:
                t_p, bp = median_time(lambda: heap_allocate(a0, a1, upper, B), min_time=0.0, max_reps=1)
                assert abs(makespan(a0, a1, bp) - opt) <= 1e-12 * opt, "heap and hetlb disagree"
                heap_ms, vs_heap = t_p * 1e3, f"{t_p / t_h:,.0f}x"
            if n <= 256:
                t_m, (bm, proven) = median_time(lambda: milp_allocate(a0, a1, upper, B, 120.0),
                                                min_time=0.0, max_reps=1)
                milp_ms = t_m * 1e3
                vs_milp = f"{t_m / t_h:,.0f}x"
                milp_ratio = f"{makespan(a0, a1, bm) / opt:.6f}" + ("" if proven else " (time limit)")
            if n <= 256:
                t_s, bs = median_time(lambda: slsqp_allocate(a0, a1, upper, B), min_time=0.0, max_reps=1)
                slsqp_ms = t_s * 1e3
                slsqp_ratio = f"{makespan(a0, a1, bs) / opt:.4f}"
            rows.append(f"| {n} | {B} | {t_h * 1e3:.3f} | {heap_ms:.1f} | {milp_ms:.1f} | {slsqp_ms:.1f} | "
                        f"{vs_milp} | {vs_heap} | {milp_ratio} | {slsqp_ratio} |")
            print(rows[-1], flush=True)
    return rows


def bench_schedule() -> List[str]:
    rows = ["| samples | ranks | sizes | hetlb (ms) | Python EFT (ms) | speed-up | makespan / lower bound |",
            "|---:|---:|---|---:|---:|---:|---:|"]
    rng = np.random.default_rng(3)
    for dist, sizes in [("lognormal(3,1)", rng.lognormal(3, 1, 4096)), ("uniform(1,100)", rng.uniform(1, 100, 4096))]:
        for hetero in (False, True):
            slope = rng.uniform(0.5, 2.0, 256) if hetero else np.ones(256)
            intercept = rng.uniform(0, 5, 256) if hetero else np.zeros(256)
            t_h, d = median_time(lambda: hetlb.schedule(sizes, slope, intercept))
            t_p, dp = median_time(lambda: ref.schedule(sizes, slope, intercept), min_time=0.0, max_reps=1)
            assert np.array_equal(d, dp)
            load = np.bincount(d, weights=sizes, minlength=256)
            ms = float(np.max(intercept + slope * load))
            # Neither bound alone is reachable: fractional samples, or the largest sample on its best rank.
            lb = max(ref.continuous_bound(sizes.sum(), slope, intercept), float(np.min(intercept + slope * sizes.max())))
            rows.append(f"| 4096 | 256 | {dist}, {'heterogeneous' if hetero else 'uniform'} ranks | "
                        f"{t_h * 1e3:.3f} | {t_p * 1e3:.0f} | {t_p / t_h:,.0f}x | {ms / lb:.4f} |")
            print(rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="skip B = 2^20 and the slowest baselines")
    ap.add_argument("--part", choices=["all", "allocate", "schedule"], default="all")
    ap.add_argument("--out", default=None, help="also write the tables here")
    args = ap.parse_args()
    out = []
    if args.part in ("all", "allocate"):
        out += ["### allocate", ""] + bench_allocate(args.quick) + [""]
    if args.part in ("all", "schedule"):
        out += ["### schedule", ""] + bench_schedule()
    text = "\n".join(out)
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
