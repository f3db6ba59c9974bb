"""Host-solver microbenchmarks, side by side in one run (medians of repeated timings).

allocate  — hetlb.allocate against scipy's MILP (an ILP as in BOA), a pure-Python heap over marginal
            times (exact, O(B log n)) and LBB's SLSQP (scipy.optimize.minimize on max - min, then
            rounded), on linear time models of a heterogeneous cluster.
schedule  — hetlb.schedule (4096 samples over 256 ranks) against a lower bound (the larger of the
            continuous bound and the largest sample on its best rank) and a pure-Python
            earliest-finish loop (hetlb.reference.schedule).
decision  — what one step's decision costs a rank at 256, 1,024 and 4,096 ranks for LBB, LB-BSP and
            Chronica, the decision loop as training runs it: the step's record made from the
            telemetry table, recorded, decided and checked (DecisionLoop.advance), and for
            Chronica the assignment of the step's samples (hetlb.schedule, as the loader runs it).
            Emulated ranks of speeds 1-4x, 2 % noise, and every 50 steps 5 % of the ranks at half
            speed (LBB rapid-tunes then).

targets   — the rows of the targets alone (allocate at n = 1024, B = 2^20 and 4096 samples over 256
            ranks, wrapper included), quick enough to run against another checkout's hetlb side
            by side (run this file with that checkout's Python and working directory).

    python bench/bench_solvers.py [--quick] [--part all|allocate|schedule|decision|targets] [--out FILE]

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


def _decision_run(name: str, world: int, steps: int, seed: int = 0) -> dict:
    """Per-step seconds of one rank's decision loop under ``name`` on an emulated cluster."""
    from hetlb.core.telemetry import COL, NUM_FIELDS, StepRecord
    from hetlb.policies import LBB, LBBSP, Chronica
    from hetlb.policies.base import Context
    from hetlb.policies.loop import DecisionLoop

    rng = np.random.default_rng(seed)
    per_rank = 32
    total = per_rank * world
    speed = rng.choice([1.0, 2.0, 3.0, 4.0], world) * rng.uniform(0.9, 1.1, world)
    a0 = rng.uniform(2e-3, 5e-3, world)
    sized = name == "chronica"
    if sized:
        policy = Chronica()
        ctx = Context(world=world, global_batch=total, lower=0, upper=total)
    else:
        policy = LBB() if name == "lbb" else LBBSP()
        ctx = Context(world=world, global_batch=total, lower=1, upper=4 * per_rank)
    loop = DecisionLoop(policy, world, history=1024, ranks=[0])
    decision = loop.start(ctx)
    record_s, advance_s, assign_s = [], [], []
    slow = np.ones(world)
    for k in range(steps):
        if k % 50 == 25:
            slow = np.where(rng.random(world) < 0.05, 2.0, 1.0)
        sizes = data = None
        if sized:
            amounts = rng.lognormal(3, 1, total)
            rule = decision
            t0 = time.perf_counter()
            owner = hetlb.schedule(rule.work(amounts), rule.slope, rule.intercept,
                                   first=rule.first(0, 0, k, total), cap=rule.cap)
            assign_s.append(time.perf_counter() - t0)
            sizes = np.bincount(owner, minlength=world).astype(np.int64)
            data = np.bincount(owner, weights=amounts, minlength=world)
        else:
            sizes = np.asarray(decision, np.int64)
            data = sizes.astype(np.float64)
        work = data * 1e-4 if sized else sizes * 1e-3
        compute = (a0 + work / speed * slow) * (1 + 0.02 * rng.standard_normal(world))
        table = np.zeros((world, NUM_FIELDS))
        table[:, COL["batch"]] = sizes
        table[:, COL["compute"]] = compute
        table[:, COL["data"]] = data
        table[:, COL["memory"]] = 0.5
        table[:, COL["cpu"]] = 0.3
        table[:, COL["predicted"]] = np.nan
        t0 = time.perf_counter()
        cols = table[:, :6].T.copy()  # as the step driver makes a record from the table
        rec = StepRecord(step=k, epoch=0, batch=sizes, compute=cols[COL["compute"]],
                         data=cols[COL["data"]], memory=cols[COL["memory"]], cpu=cols[COL["cpu"]],
                         predicted=cols[COL["predicted"]])
        t1 = time.perf_counter()
        new = loop.advance([rec])
        t2 = time.perf_counter()
        record_s.append(t1 - t0)
        advance_s.append(t2 - t1)
        if new is not None:
            decision = new
    whole = [r + a + (assign_s[i] if assign_s else 0.0) for i, (r, a) in enumerate(zip(record_s, advance_s))]
    actions = getattr(policy, "actions", [])
    return {"record": statistics.median(record_s), "advance": statistics.median(advance_s),
            "assign": statistics.median(assign_s) if assign_s else float("nan"),
            "whole": statistics.median(whole), "worst": max(whole[1:]),
            "rapid": sum(a == "rapid" for a in actions)}


def bench_decision(quick: bool) -> List[str]:
    rows = ["| policy | ranks | steps | record (ms) | decide + check (ms) | assign (ms) | whole, median (ms) | "
            "whole, worst (ms) | LBB rapid-tunes |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in ("lbb", "lbbsp", "chronica"):
        for world in (256, 1024, 4096):
            steps = 30 if quick else (200 if world < 4096 else 100)
            if name == "chronica" and world == 4096:
                steps = 10 if quick else 20
            r = _decision_run(name, world, steps)
            ms = lambda v: "—" if v != v else f"{v * 1e3:.3f}"
            rows.append(f"| {name} | {world} | {steps} | {ms(r['record'])} | {ms(r['advance'])} | "
                        f"{ms(r['assign'])} | {ms(r['whole'])} | {ms(r['worst'])} | "
                        f"{r['rapid'] if name == 'lbb' else '—'} |")
            print(rows[-1], flush=True)
    return rows


def bench_targets() -> List[str]:
    rows = ["| what | hetlb (ms) |", "|---|---:|"]
    for n, B in ((256, 1 << 20), (1024, 1 << 20), (4096, 1 << 22)):
        a0, a1, upper = cluster(n, B)
        models = [hetlb.LinearModel(x, y) for x, y in zip(a0, a1)]
        t, _ = median_time(lambda: hetlb.allocate(models, B, upper=upper), min_time=2.0)
        rows.append(f"| allocate n={n} B={B} | {t * 1e3:.3f} |")
        print(rows[-1], flush=True)
    rng = np.random.default_rng(3)
    for dist, sizes in [("lognormal(3,1)", rng.lognormal(3, 1, 4096)), ("uniform(1,100)", rng.uniform(1, 100, 4096))]:
        for hetero in (False, True):
            slope = rng.uniform(0.5, 2.0, 256) if hetero else np.ones(256)
            intercept = rng.uniform(0, 5, 256) if hetero else np.zeros(256)
            t, _ = median_time(lambda: hetlb.schedule(sizes, slope, intercept), min_time=2.0)
            rows.append(f"| schedule 4096 x 256, {dist}, {'heterogeneous' if hetero else 'uniform'} | {t * 1e3:.3f} |")
            print(rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="skip B = 2^20 and the slowest baselines")
    ap.add_argument("--part", choices=["all", "allocate", "schedule", "decision", "targets"], default="all")
    ap.add_argument("--out", default=None, help="also write the tables here")
    args = ap.parse_args()
    out = []
    if args.part in ("all", "allocate"):
        out += ["### allocate", ""] + bench_allocate(args.quick) + [""]
    if args.part in ("all", "schedule"):
        out += ["### schedule", ""] + bench_schedule() + [""]
    if args.part == "targets":
        out += ["### targets", ""] + bench_targets()
    if args.part in ("all", "decision"):
        out += ["### decision", ""] + bench_decision(args.quick)
    text = "\n".join(out)
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
