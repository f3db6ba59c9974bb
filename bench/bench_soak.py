"""Soak: 4 Gloo workers for 2000 steps under random disturbances and a speed change every 200 steps.

What runs: 4 real Gloo ranks (``report.on_gloo_ranks``) train a small MLP (32-64-64-10, DDP) on a
synthetic classification set of 50,000 samples whose last column is the sample's index, through
:class:`hetlb.Balancer` and its loader (``bal.loader``), global batch 1024, for ``--steps`` steps
over as many epochs as that takes (48 full steps and a short one of 848 samples per epoch).

Emulated hardware (:class:`hetlb.sim.emulate.Emulator`, the native step core holds each rank's last
gradient bucket): LBB's case-study worker, ``T(b) = 10 ms + 1 ms * b`` at speed 1, on a 1:2:3:4
cluster (about 106 ms per balanced step: long enough that the few milliseconds by which a
process on a loaded 2-core machine overruns its emulated time stay small beside it), plus

* **noise**: every step of every rank ``x (1 + 0.03 * U(-1, 1))`` (``Emulator(noise=0.03)``);
* **occasional slow steps**: each rank, each step, with probability 0.002 a slow episode starts,
  lasting 1-5 steps, the time ``x U(1.2, 2.0)`` (a co-located job, a GC pause);
* **one worker's speed changing every 200 steps**: rank 1 (base speed 2) runs at
  2, 1, 3, 1.5, 4, 0.8, 2.5, 1.2, 3.5, 2 in successive 200-step segments.

The Emulator's ``speed`` is a constant; a time-varying speed is expressed through its public API
as a ``Disturbance(start, stop, factor=base / new)`` per segment (``target * factor`` from
``start`` to ``stop``, i.e. ``T / new``), and each slow episode is a ``Disturbance(start, stop,
factor=f)``. Both schedules are a pure function of ``--seed`` and the same on every rank, so rank 0
knows where they are.

Policy: ``LBBSP("cpu")``, LB-BSP's Algorithm 1 with its paper default predictor (a NARX per rank,
EMA of the shared speeds until it is fitted after 500 steps). The LB-BSP paper ("semi-dynamic
load balancing ... in non-dedicated environments") is the one written for workers whose speed
changes during training on shared (CPU) nodes: it re-sizes every step from predicted speeds.
LBB's paper balances a profiled static cluster and recovers from a disturbance by rapid-tuning;
LB-BSP's GPU mode (Algorithm 2) enters a fine phase for good that approaches a later speed change
by one sample per 20 steps, which this soak would only measure as slow. ``--policy lbb`` runs
LBB's paper defaults for comparison.

Measured per step: the straggler effect as hetlb defines it (LBB's Eq. 4, ``(max T - min T) /
mean T`` over ranks with samples, :func:`hetlb.core.telemetry.straggler_effect`, on the step's record
of every rank's emulated compute), every rank's batch size, every rank's RSS
(``/proc/self/statm``), the wall time of the step on rank 0, and the sample indices each rank
trained (into a buffer allocated and touched before the first step, so the benchmark's own
bookkeeping does not grow). Reported: RSS per rank at the end of the warm-up (step 200, or a
quarter of a shorter run), at the middle and at the end, and growth in percent and MB; the share
of steps with SE < 0.1, overall and without the 10 steps from each speed change (no predictor
foresees a step change; LB-BSP's EMA, alpha 0.2, leaves 0.8^10 ~ 11 % of a jump after 10 steps),
and where the steps at SE >= 0.1 fall (a change, a slow episode, an epoch's short last step, a
rank whose measured compute overran its emulated target, i.e. real load on the machine); per
speed change the recovery (steps until SE stays below 0.1 for 5 steps) and rank 1's batch against
the ideal split; exactly-once coverage of every completed epoch (and no sample twice in the last,
partial one); wall time. A plot (``--plot``): SE per step, rank 1's batch against its speed and
the ideal split, RSS over time. Figures: ``bench/RESULTS.md`` ("Soak").

    python bench/bench_soak.py [--steps 2000] [--policy lbbsp-cpu|lbb] [--seed 0]
                               [--out FILE.md] [--plot bench/soak.png] [--json RAW.json]

``--steps 200`` is a short smoke run (one speed segment, no NARX fit).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from typing import Any, Dict, List, Tuple

import numpy as np

from report import emit, on_gloo_ranks

WORLD = 4
SPEEDS = [1.0, 2.0, 3.0, 4.0]
CHANGING = 1                      # the rank whose speed changes
PERIOD = 200                      # steps per speed segment
SCHEDULE = [2.0, 1.0, 3.0, 1.5, 4.0, 0.8, 2.5, 1.2, 3.5, 2.0]   # rank 1's speed per segment
A0, A1 = 0.010, 0.001             # LBB's case study: 10 ms + 1 ms/sample at speed 1
GLOBAL_BATCH = 1024
N_SAMPLES = 50_000                # 48 steps of 1024 and one of 848 per epoch
NOISE = 0.03
SLOW_P, SLOW_LEN, SLOW_FACTOR = 0.002, (1, 5), (1.2, 2.0)
SE_LEVEL = 0.1
SETTLE = 10                       # steps from a speed change left out of the second SE figure
OVERRUN = 0.002                   # seconds past the emulated target that count as machine load
HOLD = 5                          # recovery: SE below the level for this many steps in a row
WARMUP = 200

log = logging.getLogger("bench_soak")


def speed_at(step: int) -> float:
    """Rank 1's emulated speed at ``step``."""
    return SCHEDULE[(step // PERIOD) % len(SCHEDULE)]


def slow_episodes(steps: int, seed: int) -> List[Tuple[int, int, int, float]]:
    """``(rank, start, stop, factor)`` of the random slow episodes (the same on every rank)."""
    rng = np.random.default_rng([seed, 2026])
    out = []
    for r in range(WORLD):
        s = 0
        while s < steps:
            if rng.random() < SLOW_P:
                n = int(rng.integers(SLOW_LEN[0], SLOW_LEN[1] + 1))
                out.append((r, s, s + n, float(rng.uniform(*SLOW_FACTOR))))
                s += n
            else:
                s += 1
    return out


def disturbances(rank: int, steps: int, seed: int) -> list:
    """This rank's Disturbances: the speed schedule (rank 1) and its slow episodes."""
    from hetlb.sim.emulate import Disturbance
    out = []
    if rank == CHANGING:
        for start in range(0, steps, PERIOD):
            f = SPEEDS[CHANGING] / speed_at(start)
            if f != 1.0:
                out.append(Disturbance(start, start + PERIOD, factor=f))
    out += [Disturbance(a, b, factor=f) for r, a, b, f in slow_episodes(steps, seed) if r == rank]
    return out


def ideal_split(speeds: List[float]) -> np.ndarray:
    """The real-valued sizes that make every ``(A0 + A1 b) / s`` equal (sum: the global batch)."""
    s = np.asarray(speeds, float)
    t = (A1 * GLOBAL_BATCH + len(s) * A0) / s.sum()
    return (t * s - A0) / A1


def warmup_end(steps: int) -> int:
    """The step at which the warm-up ends for the memory figures (200; a quarter of a short run)."""
    return WARMUP if steps >= 2 * WARMUP else steps // 4


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_policy(name: str) -> Any:
    import hetlb
    return {"lbbsp-cpu": lambda: hetlb.LBBSP("cpu"), "lbb": lambda: hetlb.LBB()}[name]()


def _worker(rank: int, world: int, steps: int, policy: str, seed: int, every: int) -> Dict[str, Any]:
    import gc

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hetlb
    from hetlb.sim.emulate import Emulator
    from hetlb.core.telemetry import straggler_effect
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                              torch.nn.ReLU(), torch.nn.Linear(64, 10))
    ddp = DDP(net)
    emu = Emulator.for_rank(rank, SPEEDS, model=hetlb.LinearModel(A0, A1), noise=NOISE, seed=seed,
                            disturbances=disturbances(rank, steps, seed))
    bal = hetlb.Balancer(ddp, GLOBAL_BATCH, policy=make_policy(policy), emulator=emu)
    g = torch.Generator().manual_seed(1234)
    x_all = torch.randn(N_SAMPLES, 32, generator=g)
    y_all = (x_all @ torch.randn(32, 10, generator=g)).argmax(1)
    ds = torch.utils.data.TensorDataset(x_all, y_all, torch.arange(N_SAMPLES))
    loader = bal.loader(ds, seed=seed)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)

    # Everything recorded per step is allocated (and touched) before the first step.
    seen = np.full(steps * GLOBAL_BATCH, -1, np.int32)      # this rank's indices, in step order
    count = np.full(steps, -1, np.int64)                     # this rank's samples per step
    epoch_of = np.full(steps, -1, np.int64)
    rss = np.zeros(steps, np.int64)
    se = np.zeros(steps)
    batch = np.zeros((steps, world), np.int64)
    compute = np.zeros((steps, world))
    predicted = np.zeros((steps, world))
    wall = np.zeros(steps)
    loss_v = np.zeros(steps)
    used, done, epoch = 0, 0, 0
    dist.barrier()
    t_start = t_prev = time.perf_counter()
    while done < steps:
        loader.set_epoch(epoch)
        for x, y, idx in loader:
            with bal.step():
                loss = torch.nn.functional.cross_entropy(ddp(x), y)
                loss.backward()
            opt.step()
            opt.zero_grad()
            rec = bal.history[-1]
            assert rec.step == done, (rec.step, done)
            n = len(idx)
            seen[used:used + n] = idx.numpy()
            used += n
            count[done], epoch_of[done] = n, epoch
            batch[done] = rec.batch
            compute[done] = rec.compute
            predicted[done] = rec.predicted
            se[done] = straggler_effect(rec.compute, rec.batch)
            loss_v[done] = float(loss)
            rss[done] = rss_bytes()
            now = time.perf_counter()
            wall[done] = now - t_prev
            t_prev = now
            done += 1
            if rank == 0 and (done % every == 0 or done == steps):
                k = slice(max(done - every, 0), done)
                log.info("step %5d/%d epoch %3d | step %.1f ms (median of the last %d) | SE < %.1f in "
                         "%3.0f %% of them | rank %d speed %.1f, sizes %s | RSS %.1f MB", done, steps,
                         epoch, 1e3 * np.median(wall[k]), k.stop - k.start, SE_LEVEL,
                         100 * np.mean(se[k] < SE_LEVEL), CHANGING, speed_at(done - 1),
                         batch[done - 1].tolist(), rss[done - 1] / 2**20)
            if done == steps:
                break
        epoch += 1
    total = time.perf_counter() - t_start
    # Exactly-once: rank 0 gathers every rank's indices and per-step counts.
    mine = {"seen": seen[:used].copy(), "count": count, "rss": rss}
    everyone: List[Any] = [None] * world if rank == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    del loader, bal, ddp, opt
    gc.collect()  # DDP reducers must not outlive the process group
    if rank != 0:
        return {}
    coverage = []
    offsets = [np.concatenate([[0], np.cumsum(e["count"])]) for e in everyone]
    counts_match = all(np.array_equal(e["count"], batch[:, r]) for r, e in enumerate(everyone))
    spe = math.ceil(N_SAMPLES / GLOBAL_BATCH)
    for ep in range(int(epoch_of.max()) + 1):
        sl = np.flatnonzero(epoch_of == ep)
        a, b = int(sl[0]), int(sl[-1]) + 1
        idx = np.concatenate([e["seen"][o[a]:o[b]] for e, o in zip(everyone, offsets)])
        hits = np.bincount(idx, minlength=N_SAMPLES)
        complete = len(sl) == spe
        coverage.append({"epoch": ep, "steps": len(sl), "complete": complete, "samples": int(idx.size),
                         "max_hits": int(hits.max()), "missing": int((hits == 0).sum()),
                         "ok": bool(hits.max() == 1 and (not complete or (hits == 1).all()))})
    return {"steps": steps, "policy": policy, "seed": seed, "total_s": total, "wall": wall.tolist(),
            "se": se.tolist(), "batch": batch.tolist(), "compute": compute.tolist(),
            "predicted": np.where(np.isfinite(predicted), predicted, -1.0).tolist(),
            "loss": loss_v.tolist(), "epoch_of": epoch_of.tolist(),
            "rss": [e["rss"].tolist() for e in everyone], "coverage": coverage,
            "counts_match": counts_match}


def recovery(se: np.ndarray, start: int, stop: int) -> int:
    """Steps from ``start`` until SE stays below the level for ``HOLD`` steps (-1: not in the segment)."""
    for k in range(start, stop - HOLD + 1):
        if (se[k:k + HOLD] < SE_LEVEL).all():
            return k - start
    return -1


def analyse(res: Dict[str, Any], seed: int) -> Tuple[List[str], Dict[str, Any]]:
    steps = res["steps"]
    se = np.asarray(res["se"])
    batch = np.asarray(res["batch"])
    wall = np.asarray(res["wall"])
    rss = np.asarray(res["rss"], float) / 2**20
    epoch_of = np.asarray(res["epoch_of"])
    changes = list(range(PERIOD, steps, PERIOD))
    eps = slow_episodes(steps, seed)
    after_change = np.zeros(steps, bool)
    for c in changes:
        after_change[c:c + SETTLE] = True
    slow = np.zeros(steps, bool)
    for _, a, b, _ in eps:
        slow[a:min(b + SETTLE, steps)] = True     # the episode and the 10 steps after it
    spe = math.ceil(N_SAMPLES / GLOBAL_BATCH)
    first = {int(e): int(np.flatnonzero(epoch_of == e)[0]) for e in np.unique(epoch_of)}
    pos = np.arange(steps) - np.array([first[int(e)] for e in epoch_of])
    short = (pos == spe - 1) if N_SAMPLES % GLOBAL_BATCH else np.zeros(steps, bool)  # an epoch's short last step
    # What each rank's compute was meant to take (the Emulator is a pure function of the step):
    # a measured time above it is real CPU time on the (shared) machine, not emulation.
    from hetlb.sim.emulate import Emulator
    from hetlb.core.models import LinearModel
    from hetlb.core.telemetry import straggler_effect
    emus = [Emulator.for_rank(r, SPEEDS, model=LinearModel(A0, A1), noise=NOISE, seed=seed,
                              disturbances=disturbances(r, steps, seed)) for r in range(WORLD)]
    compute = np.asarray(res["compute"])
    target = np.array([[emus[r].target(k, int(batch[k, r])) for r in range(WORLD)] for k in range(steps)])
    se_target = np.array([straggler_effect(target[k], batch[k]) for k in range(steps)])
    overrun = (compute - target).max(1)
    late = overrun > OVERRUN
    bad = se >= SE_LEVEL
    frac = float(np.mean(~bad))
    frac_settled = float(np.mean(~bad[~after_change])) if (~after_change).any() else float("nan")
    lines = [f"### Soak: {steps} steps, 4 Gloo workers, {res['policy']}, seed {seed}", "",
             f"Global batch {GLOBAL_BATCH}, {N_SAMPLES} samples ({spe} steps per epoch, "
             f"{int(epoch_of.max()) + 1} epochs begun); emulated `T(b) = {A0 * 1e3:g} ms + "
             f"{A1 * 1e3:g} ms/sample` at speed 1, speeds {SPEEDS}, noise {NOISE}, slow episodes "
             f"p={SLOW_P}/rank/step of {SLOW_LEN[0]}-{SLOW_LEN[1]} steps x U{SLOW_FACTOR} "
             f"({len(eps)} episodes, {int(sum(min(b, steps) - a for _, a, b, _ in eps))} rank-steps), "
             f"rank {CHANGING}'s speed changing every {PERIOD} steps.", ""]
    # --- SE
    cats = [("within 10 steps of a speed change", after_change),
            ("in a slow episode or the 10 steps after it", ~after_change & slow),
            ("the short last step of an epoch", ~after_change & ~slow & short),
            (f"a rank's compute ran > {OVERRUN * 1e3:g} ms past its emulated target (machine load)",
             ~after_change & ~slow & ~short & late),
            ("other", ~after_change & ~slow & ~short & ~late)]
    lines += ["| straggler effect (LBB Eq. 4) | value |", "|---|---:|",
              f"| steps with SE < {SE_LEVEL} | **{100 * frac:.1f} %** ({int((~bad).sum())} of {steps}) |",
              f"| the same without the {SETTLE} steps from each of the {len(changes)} speed changes | "
              f"{100 * frac_settled:.1f} % |",
              f"| steps whose emulated targets alone (the sizes run, no machine load) have SE < {SE_LEVEL} | "
              f"{100 * np.mean(se_target < SE_LEVEL):.1f} % |",
              f"| steps where some rank's compute ran > {OVERRUN * 1e3:g} ms past its target | "
              f"{int(late.sum())} |",
              f"| median SE | {np.median(se):.3f} |",
              f"| 90th percentile SE | {np.quantile(se, 0.9):.3f} |"]
    for name, m in cats:
        lines.append(f"| steps with SE >= {SE_LEVEL}: {name} | {int((bad & m).sum())} "
                     f"(of {int(m.sum())} such steps) |")
    # --- speed changes
    lines += ["", f"| step | rank {CHANGING} speed | SE at the change | recovery (steps to {HOLD} in a "
              f"row < {SE_LEVEL}) | rank {CHANGING} batch (median, last 50 of segment) | ideal | "
              f"SE < {SE_LEVEL} in segment |", "|---:|---|---:|---:|---:|---:|---:|"]
    for start in range(0, steps, PERIOD):
        stop = min(start + PERIOD, steps)
        old = speed_at(start - 1) if start else None
        new = speed_at(start)
        ideal = ideal_split([new if r == CHANGING else s for r, s in enumerate(SPEEDS)])[CHANGING]
        rec = recovery(se, start, stop) if start else None
        got = float(np.median(batch[max(stop - 50, start):stop, CHANGING]))
        lines.append(f"| {start} | {'' if old is None else f'{old:g} -> '}{new:g} | "
                     f"{'' if not start else f'{se[start]:.2f}'} | "
                     f"{'' if rec is None else ('not within the segment' if rec < 0 else rec)} | "
                     f"{got:.0f} | {ideal:.1f} | {100 * np.mean(se[start:stop] < SE_LEVEL):.0f} % |")
    # --- memory
    w = warmup_end(steps) - 1
    mid = steps // 2
    lines += ["", "| rank | RSS at step %d (MB) | at step %d | at the end (step %d) | max after warm-up | "
              "growth warm-up -> end | growth middle -> end |" % (w + 1, mid, steps),
              "|---:|---:|---:|---:|---:|---:|---:|"]
    growth = []
    for r in range(WORLD):
        a, m, e = rss[r, w], rss[r, mid - 1], rss[r, -1]
        g = 100 * (e - a) / a
        growth.append(g)
        lines.append(f"| {r} | {a:.1f} | {m:.1f} | {e:.1f} | {rss[r, w:].max():.1f} | "
                     f"{g:+.2f} % ({e - a:+.1f} MB) | {100 * (e - m) / m:+.2f} % ({e - m:+.1f} MB) |")
    # --- coverage
    cov = res["coverage"]
    complete = [c for c in cov if c["complete"]]
    partial = [c for c in cov if not c["complete"]]
    lines += ["", f"Exactly-once: {len(complete)} completed epochs, "
              f"{sum(c['ok'] for c in complete)} of them cover every one of the {N_SAMPLES} samples "
              f"exactly once (**{'yes' if all(c['ok'] for c in complete) else 'NO'}**); "
              + (f"the last, partial epoch ({partial[0]['steps']} steps, {partial[0]['samples']} samples) "
                 f"has {'no sample twice' if partial[0]['ok'] else 'REPEATED samples'}; "
                 if partial else "")
              + f"each rank's sample count per step equals the plan's: "
                f"{'yes' if res['counts_match'] else 'NO'}."]
    lines.append("Per epoch (complete, exactly once): " + ", ".join(
        f"{c['epoch']}: {'yes' if c['ok'] else 'NO'}" if c["complete"] else
        f"{c['epoch']}: partial, {'no repeat' if c['ok'] else 'REPEATS'}" for c in cov) + ".")
    bad_epochs = [c for c in cov if not c["ok"]]
    if bad_epochs:
        lines.append(f"Epochs failing the check: {bad_epochs}")
    # --- time
    loss = np.asarray(res["loss"])
    ideal_t = [(A1 * GLOBAL_BATCH + WORLD * A0) /
               sum(speed_at(k) if r == CHANGING else s for r, s in enumerate(SPEEDS)) for k in range(steps)]
    lines += ["", f"Wall time {res['total_s']:.1f} s for {steps} steps; step time on rank 0: median "
              f"{1e3 * np.median(wall):.1f} ms (ideal emulated compute, median over the schedule: "
              f"{1e3 * np.median(ideal_t):.1f} ms), 90th percentile {1e3 * np.quantile(wall, 0.9):.1f} ms. "
              f"Rank 0's training loss: {np.mean(loss[:50]):.3f} (first 50 steps) -> "
              f"{np.mean(loss[-50:]):.3f} (last 50)."]
    summary = {"frac": frac, "frac_settled": frac_settled, "growth": growth,
               "exactly_once": all(c["ok"] for c in cov) and res["counts_match"]}
    return lines, summary


def plot(res: Dict[str, Any], seed: int, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = res["steps"]
    k = np.arange(steps)
    se = np.asarray(res["se"])
    batch = np.asarray(res["batch"])
    rss = np.asarray(res["rss"], float) / 2**20
    fig, ax = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    ax[0].plot(k, np.maximum(se, 1e-3), ".", ms=2, color="tab:blue")
    ax[0].axhline(SE_LEVEL, color="k", lw=0.8, ls="--", label=f"SE = {SE_LEVEL}")
    for r, a, b, f in slow_episodes(steps, seed):
        ax[0].axvspan(a, b, color="tab:red", alpha=0.25, lw=0)
    ax[0].set_yscale("log")
    ax[0].set_ylabel("straggler effect")
    ax[0].set_title(f"Soak: 4 Gloo ranks, {res['policy']}, {steps} steps "
                    f"(red: slow episodes, grey: rank {CHANGING}'s speed changes)")
    ax[0].legend(loc="upper right")
    ideal = np.array([ideal_split([speed_at(s) if r == CHANGING else v for r, v in enumerate(SPEEDS)])[CHANGING]
                      for s in k])
    ax[1].plot(k, batch[:, CHANGING], lw=0.8, color="tab:green", label=f"rank {CHANGING} batch")
    ax[1].plot(k, ideal, lw=1, ls="--", color="k", label="ideal split")
    ax[1].set_ylabel("batch size")
    tw = ax[1].twinx()
    tw.step(k, [speed_at(s) for s in k], where="post", color="tab:orange", lw=1, label="speed")
    tw.set_ylabel(f"rank {CHANGING} speed", color="tab:orange")
    tw.set_ylim(0, 1.1 * max(SCHEDULE))
    ax[1].legend(loc="upper left")
    for r in range(WORLD):
        ax[2].plot(k, rss[r], lw=1, label=f"rank {r}")
    ax[2].axvline(warmup_end(steps), color="k", lw=0.8, ls=":")
    ax[2].set_ylabel("RSS (MB)")
    ax[2].set_xlabel("step")
    ax[2].legend(loc="lower right", ncol=4)
    for a in ax:
        for c in range(PERIOD, steps, PERIOD):
            a.axvline(c, color="grey", lw=0.6, alpha=0.6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--policy", choices=["lbbsp-cpu", "lbb"], default="lbbsp-cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every", type=int, default=None, help="steps between progress lines (rank 0)")
    p.add_argument("--out", default=None, help="also write the markdown tables to this file")
    p.add_argument("--json", default=None, help="also write the raw per-step series to this file")
    p.add_argument("--plot", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "soak.png"))
    args = p.parse_args()
    if args.steps < 20:
        p.error("--steps must be at least 20")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    every = args.every or max(10, args.steps // 20)
    res = on_gloo_ranks(_worker, WORLD, args.steps, args.policy, args.seed, every)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f)
    lines, _ = analyse(res, args.seed)
    if args.plot:
        plot(res, args.seed, args.plot)
        lines += ["", f"Plot: {args.plot}"]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
