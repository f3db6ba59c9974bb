"""Balanced training on an emulated heterogeneous cluster: per-step time of each policy vs ideal.

ABS-SGD's static setting: ``world`` Gloo workers on this machine emulate speeds 1:2:3:4 with a
linear time model ``T_r(b) = (a0 + a1 * b) / s_r`` (:class:`hetlb.sim.emulate.Emulator`, applied when the
last gradient bucket is ready). The ideal step time, with every worker busy until the same moment,
is ``(a1 * B + n * a0) / sum(s)``; the all-reduce itself, which no batch split removes, is measured
separately (plain DDP step time minus its emulated compute on the homogeneous cluster) and
reported as "ideal + comm". Each policy trains a small model through :class:`hetlb.Balancer`
with real DDP and its loader; the per-step wall time on rank 0 after ``--warmup`` steps is compared
with the ideal and with Uniform (synchronous SGD with equal batches).

A second part measures the cost of hetlb on a homogeneous cluster: plain DDP with a
DistributedSampler DataLoader against the Balancer with the Uniform policy, same emulated compute,
interleaved rounds; and the Balancer's own time per step (telemetry probes, table check,
decision: ``Balancer.last_overhead``) in microseconds.

``--exchange-every 1 16`` runs the heterogeneous part once per value of
``Balancer(exchange_every=)`` (1, the default, is the papers' per-step decision; 16 exchanges the
telemetry of 16 steps at once, so the sizes change at most every 16 steps; ``16a`` adds
``adaptive_exchange=True``: blocks of one step while the sizes move, doubling up to 16 while they
hold still), side by side.

    python bench/bench_balance.py [--quick] [--exchange-every K ...] [--out FILE]

Prints markdown tables (and writes them to --out).
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

import torch

from report import emit
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import hetlb  # before init_process_group in the workers (see docs/restarts.md, Shutdown)

log = logging.getLogger("bench_balance")


POLICIES = ("Uniform", "DBS", "LBB", "LBBSP (gpu)", "LBBSP (cpu, NARX)", "WLBS")


def make_policy(name: str, steps_per_epoch: int) -> Any:
    return {
        "Uniform": lambda: hetlb.Uniform(),
        "DBS": lambda: hetlb.DBS(steps_per_epoch=steps_per_epoch),
        "LBB": lambda: hetlb.LBB(),
        "LBBSP (gpu)": lambda: hetlb.LBBSP("gpu"),
        "LBBSP (cpu, NARX)": lambda: hetlb.LBBSP("cpu"),
        "WLBS": lambda: hetlb.WLBS(steps_per_epoch=steps_per_epoch),
    }[name]()


def balanced_run(rank: int, args: argparse.Namespace, policy: str, speeds: List[float],
                 model: tuple, every: str = "1") -> Dict[str, Any]:
    """One training run with the Balancer; per-step wall times, sizes and overheads."""
    from hetlb.sim.emulate import Emulator
    from hetlb.core.models import LinearModel
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(16, 4))
    steps = args.warmup + args.steps
    emu = Emulator.for_rank(rank, speeds, model=LinearModel(*model))
    bal = hetlb.Balancer(ddp, args.global_batch, policy=make_policy(policy, args.steps_per_epoch),
                         emulator=emu, exchange_every=int(every.rstrip("a")),
                         adaptive_exchange=every.endswith("a"))
    n = args.global_batch * args.steps_per_epoch
    ds = torch.utils.data.TensorDataset(torch.randn(n, 16), torch.randn(n, 4))
    loader = bal.loader(ds, seed=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    times, overheads, sizes, load = [], [], [], []
    done, epoch = 0, 0
    while done < steps:
        loader.set_epoch(epoch)
        t_prev = time.perf_counter()
        for x, y in loader:
            load.append(time.perf_counter() - t_prev)
            with bal.step():
                torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
            now = time.perf_counter()
            times.append(now - t_prev)
            t_prev = now
            overheads.append(bal.last_overhead)
            sizes.append(bal.batch_sizes.tolist())  # the sizes the next step runs
            done += 1
            if done == steps:
                break
        epoch += 1
    return {"times": times, "overheads": overheads, "sizes": sizes, "load": load}


def plain_run(rank: int, args: argparse.Namespace, speeds: List[float], model: tuple) -> Dict[str, Any]:
    """Plain DDP, DistributedSampler, equal batches; the same emulated compute per step."""
    from hetlb.sim.emulate import Emulator
    from hetlb.core.models import LinearModel
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(16, 4))
    world = dist.get_world_size()
    emu = Emulator.for_rank(rank, speeds, model=LinearModel(*model))
    n = args.global_batch * args.steps_per_epoch
    ds = torch.utils.data.TensorDataset(torch.randn(n, 16), torch.randn(n, 4))
    sampler = torch.utils.data.distributed.DistributedSampler(ds, seed=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=args.global_batch // world, sampler=sampler)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    steps = args.warmup + args.steps
    times, load, done, epoch, step = [], [], 0, 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        t_prev = time.perf_counter()
        for x, y in loader:
            t0 = time.perf_counter()
            load.append(t0 - t_prev)
            out = ddp(x)
            # The Balancer stretches when the last bucket is ready; with a model this small the
            # backward is negligible, so stretching before it gives plain DDP the same wait.
            emu.stretch(step, len(x), t0)
            torch.nn.functional.mse_loss(out, y).backward()
            opt.step()
            opt.zero_grad()
            now = time.perf_counter()
            times.append(now - t_prev)
            t_prev = now
            done += 1
            step += 1
            if done == steps:
                break
        epoch += 1
    return {"times": times, "load": load}


def worker(rank: int, world: int, store: str, args: argparse.Namespace, jobs: List[tuple], out: str) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    results = []
    try:
        for kind, name, speeds, model, *every in jobs:
            dist.barrier()
            if kind == "plain":
                r = plain_run(rank, args, speeds, model)
            else:
                r = balanced_run(rank, args, name, speeds, model, *every)
            results.append((kind, name, r))
            if rank == 0:
                log.info("%-8s %-18s median step %.2f ms (data loading %.3f ms)", kind, name,
                         1e3 * statistics.median(r["times"][args.warmup:]),
                         1e3 * statistics.median(r["load"][args.warmup:]))
    finally:
        import gc
        gc.collect()  # DDP reducers must not outlive the process group
        dist.destroy_process_group()
    if rank == 0:
        torch.save(results, out)


def launch(world: int, args: argparse.Namespace, jobs: List[tuple]) -> List[tuple]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pt")
        mp.spawn(worker, args=(world, os.path.join(tmp, "store"), args, jobs, out), nprocs=world,
                 join=True)
        return torch.load(out, weights_only=False)


def converged_at(times: List[float], ideal: float, tol: float = 0.10, span: int = 5) -> int:
    """First step from which the median of every later ``span``-step window is within ``tol``."""
    meds = [statistics.median(times[k:k + span]) for k in range(len(times) - span + 1)]
    for k in range(len(meds)):
        if all(m <= ideal * (1 + tol) for m in meds[k:]):
            return k
    return -1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--a0", type=float, default=0.100, help="emulated start-up seconds per step")
    p.add_argument("--a1", type=float, default=0.050, help="emulated seconds per sample")
    p.add_argument("--homog-a0", type=float, default=0.020, help="a0 of the homogeneous part")
    p.add_argument("--homog-a1", type=float, default=0.002, help="a1 of the homogeneous part")
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--steps-per-epoch", type=int, default=20)
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the homogeneous part")
    p.add_argument("--homog-worlds", type=int, nargs="*", default=[2],
                   help="worker counts of the homogeneous part besides --world")
    p.add_argument("--quick", action="store_true", help="fewer steps, smaller times (a smoke run)")
    p.add_argument("--part", choices=["all", "homogeneous"], default="all")
    p.add_argument("--exchange-every", nargs="+", default=["1"],
                   help="Balancer(exchange_every=) values of the heterogeneous part, side by side "
                        "(Ka: exchange_every=K, adaptive_exchange=True)")
    p.add_argument("--policies", nargs="+", default=None, choices=POLICIES,
                   help="the policies of the heterogeneous part (default: all)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.quick:
        args.warmup, args.steps, args.rounds, args.a0, args.a1 = 30, 10, 1, 0.01, 0.004
    n = args.world
    speeds = [float(i + 1) for i in range(n)]
    names = args.policies or list(POLICIES)

    # Homogeneous part first: it also measures the all-reduce cost of this machine.
    hm = (args.homog_a0, args.homog_a1)
    homo_lines = [
        f"### Homogeneous cluster: Balancer (Uniform) vs plain DDP (speeds all 1, "
        f"T(b) = {1e3 * hm[0]:g} ms + {1e3 * hm[1]:g} ms/sample, {args.rounds} interleaved rounds "
        f"each)",
        "",
        "| workers | round | plain DDP (ms) | Balancer (ms) | ratio | hetlb overhead (µs/step) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    comm = 0.0
    for w in sorted({n, *args.homog_worlds}, reverse=True):
        jobs = []
        for _ in range(args.rounds):
            jobs += [("plain", "DDP", [1.0] * w, hm), ("balanced", "Uniform", [1.0] * w, hm)]
        res = launch(w, args, jobs)
        plain = [statistics.median(r["times"][args.warmup:]) for k, _, r in res if k == "plain"]
        bal = [statistics.median(r["times"][args.warmup:]) for k, _, r in res if k == "balanced"]
        over = [statistics.median(r["overheads"][args.warmup:]) for k, _, r in res if k == "balanced"]
        ratio = [b / q for b, q in zip(bal, plain)]
        if w == n:
            comm = max(statistics.median(plain) - (hm[0] + hm[1] * args.global_batch / n), 0.0)
        for i, (q, b, r, o) in enumerate(zip(plain, bal, ratio, over)):
            homo_lines.append(f"| {w} | {i} | {1e3 * q:.2f} | {1e3 * b:.2f} | {r:.4f} | {1e6 * o:.0f} |")
        homo_lines.append(f"| {w} | **median** | {1e3 * statistics.median(plain):.2f} | "
                          f"{1e3 * statistics.median(bal):.2f} | **{statistics.median(ratio):.4f}** | "
                          f"{1e6 * statistics.median(over):.0f} |")
    if args.part == "homogeneous":
        return emit(homo_lines, args.out)

    model = (args.a0, args.a1)
    ideal = (args.a1 * args.global_batch + n * args.a0) / sum(speeds)
    everies = args.exchange_every
    hetero = launch(n, args, [("balanced", name, speeds, model, k) for name in names for k in everies])
    rows = []
    uniform = {k: statistics.median(r["times"][args.warmup:])
               for (_, name, r), k in zip(hetero, everies * len(names)) if name == "Uniform"}
    for (_, name, r), k in zip(hetero, everies * len(names)):
        med = statistics.median(r["times"][args.warmup:])
        label = name if everies == ["1"] else f"{name}, exchange_every={k}"
        rows.append((label, 1e3 * med, med / ideal, med / (ideal + comm),
                     uniform[k] / med if k in uniform else None,  # (Uniform not run: --policies)
                     converged_at(r["times"], ideal + comm), r["sizes"][-1],
                     1e6 * statistics.median(r["overheads"][args.warmup:])))

    lines = [
        f"### Emulated 1:2:3:4 cluster ({n} Gloo workers, B = {args.global_batch}, "
        f"T(b) = {1e3 * args.a0:g} ms + {1e3 * args.a1:g} ms/sample, speeds {speeds})",
        "",
        f"Ideal step time `(a1*B + n*a0) / sum(s)` = **{1e3 * ideal:.2f} ms**; the all-reduce of "
        f"this machine (measured below) adds {1e3 * comm:.2f} ms, so ideal + comm = "
        f"{1e3 * (ideal + comm):.2f} ms. Medians of steps {args.warmup}..{args.warmup + args.steps - 1}; "
        f"'within 10 %' is the first step from which every later 5-step median is at most 1.1x "
        f"ideal + comm.",
        "",
        "| policy | step (ms) | / ideal | / (ideal + comm) | speed-up vs Uniform | within 10 % from step "
        "| final sizes | hetlb overhead (µs/step) |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name, ms, r_ideal, r_comm, sp, conv, sizes, us in rows:
        lines.append(f"| {name} | {ms:.2f} | {r_ideal:.3f} | {r_comm:.3f} | "
                     f"{'-' if sp is None else f'{sp:.2f}x'} | "
                     f"{conv if conv >= 0 else 'never'} | {sizes} | {us:.0f} |")
    return emit(lines + [""] + homo_lines, args.out)




if __name__ == "__main__":
    sys.exit(main())
