"""The papers' algorithms against hetlb's opt-in improvements, side by side, and the cost of
LB-BSP's decision with NARX.

Part ``options`` (in-process emulated clusters, deterministic): every policy default (the paper's
algorithm) next to its named option, on the same cluster and the same seeded noise:

* LBB vs ``LBB(priority=0.1)`` and ``LBB(confirm=3)``: 4 workers with speeds 1:2:3:4 (``T = 10 ms
  + 1 ms/sample / s``), global batch 500, LBB's case study disturbance (+50 ms on one worker from
  step 30); and LBB vs ``LBB(confirm=3)`` on 2 identical workers whose times jitter by 12 %
  (5 seeds: the mean step over the noiseless even split, and the rapid-tunes per run);
* LBB-SP GPU mode vs ``settle=True`` and vs ``reequilibrate=0.3``: 4 GPU-like workers (launch
  overhead, per-sample cost, flat below 16 samples), global batch 512, one worker 2.3x slower per
  sample from step 400;
* ``settle``'s own case: 1:2:3:4 with a 64-sample batch, where the best integer split still has a
  straggler.

Reported: mean step time (the slowest rank's) over the run and over its last quarter, relative to
the best integer split of each phase (``hetlb.allocate`` on the true models), and the steps after
the disturbance until every later 5-step window stays within 10 % of the best.

Part ``narx``: the time ``LBBSP("cpu").decide`` takes per step at 4 and 64 ranks, in the training
pattern (one new record per call; NARX warm-up 500 steps, refit every 100): median and max over
the calls (the max is a refit). Before this change every rank trained all R networks inside
``decide``; now each rank fits its own in the background and ``decide`` reads the published
predictions. With ``--hetlb-path`` the older package is measured instead (its API as it was).

    python bench/bench_policies.py [--part options narx] [--hetlb-path /path/to/old/checkout]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, List

import numpy as np

from report import emit


SPEEDS = np.array([1.0, 2.0, 3.0, 4.0])


def lbb_times(k: int, r: int, b: int) -> float:
    """LBB's case study: speeds 1:2:3:4, ``T = 10 ms + 1 ms/sample / s``, +50 ms on rank 1 from
    step 30."""
    return 0.010 + 0.001 * b / SPEEDS[r] + (0.05 if (r == 1 and k >= 30) else 0.0)


def even_times(k: int, r: int, b: int) -> float:
    """Identical workers: ``T = 10 ms + 0.15 ms x b``."""
    return 0.010 + 0.00015 * b


def run_cluster(policy, world: int, total: int, times: Callable[[int, int, int], float], steps: int,
                lower: int = 1, seed: int = 0, noise: float = 0.01, sizes: list = None):
    """The makespan of every step (``sizes``, if given, receives every step's sizes)."""
    from hetlb.policies.base import Context
    from hetlb.core.telemetry import History, StepRecord
    rng = np.random.default_rng(seed)
    ctx = Context.simple(world, total, lower=lower)
    h = History(world)
    cur = policy.start(ctx)
    makespan = []
    for k in range(steps):
        t = np.array([times(k, r, int(cur[r])) for r in range(world)])
        t = np.where(cur > 0, t * (1 + rng.normal(0, noise, world)), 0.0)
        h.append(StepRecord(k, 0, cur.copy(), t, cur.astype(float), np.full(world, 0.5), np.full(world, 0.5)))
        makespan.append(float(t.max()))
        if sizes is not None:
            sizes.append(cur.copy())
        cur = policy.decide(h)
    return np.array(makespan)


def best_time(times: Callable[[int, int, int], float], world: int, total: int, step: int, lower: int = 1) -> float:
    import hetlb
    models = [hetlb.PiecewiseModel(list(range(1, total + 1)), [times(step, r, b) for b in range(1, total + 1)])
              for r in range(world)]
    sizes = hetlb.allocate(models, total, lower=[lower] * world)
    return max(times(step, r, int(b)) for r, b in enumerate(sizes))


def settled(ms: np.ndarray, best: np.ndarray, start: int, tol: float = 0.10, span: int = 5) -> int:
    for k in range(start, len(ms) - span + 1):
        if all(ms[j:j + span].mean() <= best[j] * (1 + tol) for j in range(k, len(ms) - span + 1, span)):
            return k - start
    return -1


def part_options() -> List[str]:
    import hetlb
    lines = ["### Paper defaults against the opt-in improvements (in-process emulated clusters)", "",
             "| cluster | policy | mean step / best | last quarter / best | steps to settle after the change |",
             "|---|---|---:|---:|---:|"]

    steps = 200
    best = np.array([best_time(lbb_times, 4, 500, k) for k in (0, 30)])
    best_k = np.where(np.arange(steps) < 30, best[0], best[1])
    for name, pol in (("LBB() (paper)", hetlb.LBB()), ("LBB(priority=0.1)", hetlb.LBB(priority=0.1)),
                      ("LBB(confirm=3)", hetlb.LBB(confirm=3))):
        ms = run_cluster(pol, 4, 500, lbb_times, steps)
        lines.append(f"| 1:2:3:4, +50 ms at 30 | {name} | {np.mean(ms / best_k):.3f} | "
                     f"{np.mean(ms[-steps // 4:] / best_k[-steps // 4:]):.3f} | {settled(ms, best_k, 30)} |")

    # Two identical workers whose step times jitter by 12 % (one sigma, per rank and step): a
    # single step's SE passes RT = 0.3 now and then. The mean over the seeds of the makespan
    # (the slower rank's time) relative to the noiseless even split, and the rapid-tunes.
    steps, even = 300, even_times(0, 0, 64)
    for name, make in (("LBB() (paper)", hetlb.LBB), ("LBB(confirm=3)", lambda: hetlb.LBB(confirm=3))):
        means, rapids = [], []
        for seed in range(5):
            pol = make()
            ms = run_cluster(pol, 2, 128, even_times, steps, seed=seed, noise=0.12)
            means.append(np.mean(ms) / even)
            rapids.append(pol.actions.count("rapid"))
        lines.append(f"| 2 identical, 12 % jitter (5 seeds, rapid-tunes {'/'.join(map(str, rapids))}) | "
                     f"{name} | {np.mean(means):.3f} | | |")

    c, a = np.array([0.02, 0.02, 0.03, 0.03]), np.array([0.001, 0.0015, 0.002, 0.003])

    def gpu_times(k, r, b):
        ar = 0.0035 if (r == 0 and k >= 400) else a[r]
        return c[r] + ar * max(b, 16)
    steps = 900
    best = np.array([best_time(gpu_times, 4, 512, k) for k in (0, 400)])
    best_k = np.where(np.arange(steps) < 400, best[0], best[1])
    for name, pol in (("LBBSP('gpu') (Algorithm 2)", hetlb.LBBSP("gpu")),
                      ("LBBSP('gpu', settle=True)", hetlb.LBBSP("gpu", settle=True)),
                      ("LBBSP('gpu', reequilibrate=0.3)", hetlb.LBBSP("gpu", reequilibrate=0.3))):
        ms = run_cluster(pol, 4, 512, gpu_times, steps)
        lines.append(f"| GPU-like, rank 0 slower at 400 | {name} | {np.mean(ms / best_k):.3f} | "
                     f"{np.mean(ms[-steps // 4:] / best_k[-steps // 4:]):.3f} | {settled(ms, best_k, 400)} |")

    def int_times(k, r, b):
        return (0.1 + 0.05 * b) / SPEEDS[r]
    steps = 400
    b0 = best_time(int_times, 4, 64, 0)
    for name, pol in (("LBBSP('gpu') (Algorithm 2)", hetlb.LBBSP("gpu")),
                      ("LBBSP('gpu', settle=True)", hetlb.LBBSP("gpu", settle=True))):
        ms = run_cluster(pol, 4, 64, int_times, steps, noise=0.0)
        lines.append(f"| 1:2:3:4, batch 64 (integer limit) | {name} | {np.mean(ms) / b0:.3f} | "
                     f"{np.mean(ms[-steps // 4:]) / b0:.3f} | |")
    return lines


def part_narx(worlds=(4, 64), steps=700) -> List[str]:
    import hetlb
    from hetlb.policies.base import Context
    from hetlb.core.telemetry import History, StepRecord
    new = hasattr(hetlb.policies, "narx")
    lines = ["### LB-BSP CPU mode with NARX: time per decide() call", "",
             f"{'This change: each rank fits its own NARX in the background; decide() reads the published predictions.' if new else 'Before: decide() trains every rank network itself.'}",
             "", "| ranks | decide median (ms) | decide max (ms) | per-rank fit (ms, background) | steps |",
             "|---:|---:|---:|---:|---:|"]
    for R in worlds:
        rng = np.random.default_rng(R)
        base = rng.uniform(50, 150, R)
        pol = hetlb.LBBSP("cpu")
        pol.start(Context.simple(R, 32 * R))
        h = History(R, maxlen=1024)
        local = [pol.local_predictor(r) for r in range(R)] if new else []
        for p in local:
            p.background = False  # time the fits here, one rank's worth
        fit_ms: List[float] = []
        times = []
        b = np.full(R, 32, np.int64)
        for k in range(steps):
            load = 0.3 * (np.sin(k / 40 + np.arange(R)) > 0)
            v = base * (1 - load) * (1 + rng.normal(0, 0.02, R))
            cpu = 0.25 + 0.7 * load
            mem = 0.3 + 0.1 * load
            pred = np.full(R, np.nan)
            if local:
                pred[0] = local[0].predict(mem[0])
            rec = StepRecord(k, 0, b, b / v, b.astype(float), mem, cpu) if not new else \
                StepRecord(k, 0, b, b / v, b.astype(float), mem, cpu, pred)
            h.append(rec)
            if local:  # rank 0's own predictor (each rank runs one, in parallel)
                t0 = time.perf_counter()
                before = local[0].fits
                local[0].observe(rec, 0)
                if local[0].fits > before:
                    fit_ms.append(1e3 * (time.perf_counter() - t0))
            t0 = time.perf_counter()
            pol.decide(h)
            times.append(1e3 * (time.perf_counter() - t0))
        fit = f"{statistics.median(fit_ms):.1f}" if fit_ms else "-"
        lines.append(f"| {R} | {statistics.median(times):.3f} | {max(times):.1f} | {fit} | {steps} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", nargs="+", choices=["options", "narx"], default=["options", "narx"])
    p.add_argument("--hetlb-path", default=None, help="import hetlb from this checkout instead")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.hetlb_path:
        sys.path.insert(0, args.hetlb_path)
    import torch
    torch.set_num_threads(1)
    lines: List[str] = []
    if "options" in args.part:
        lines += part_options() + [""]
    if "narx" in args.part:
        lines += part_narx()
    emit(lines, args.out)


if __name__ == "__main__":
    main()
