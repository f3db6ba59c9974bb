"""The simulator: how fast it runs at scale, and how closely it matches a real emulated run.

Part ``scale``: wall seconds of ``hetlb.sim.simulate`` on a generated mixed cluster
(``hetlb simulate --workers N --steps S``) for every synchronous policy, median of ``--repeats``
runs; LB-BSP's CPU mode with per-rank NARX predictors (one network per rank, fitted in the
foreground as each rank would in the background) at smaller worlds, as seconds per step.

Part ``agree``: one scenario run twice: on 4 real Gloo ranks on this machine (DDP, the Balancer,
each rank an :class:`hetlb.sim.emulate.Emulator` built from the scenario) and in the simulator, same
policy and steps, the simulated network set to this machine's all-reduce time (measured by the
ranks before training). Reported: final sizes of both, and the median step time per phase (before
and after the disturbance) of both, with their ratio; the largest size difference before the
disturbance and at the end, and the real compute times over the scenario's (a busy machine
lengthens them, and LBB then decides differently from the simulator). The real step time is
rank 0's wall time between batches.

Part ``exchange``: ``Balancer(exchange_every=k)`` (opt-in) against the papers' per-step decision
(k = 1), side by side in virtual time on the built-in scenarios: the policy sees k steps' records
at once and decides once per k steps (a block also ends at an epoch's end). ``Ka`` (e.g. ``16a``)
is ``exchange_every=K, adaptive_exchange=True``: blocks of one step while the sizes move, doubling
up to K while they hold still. Reported: total virtual time and its ratio to the first value, the
mean step over the last half, the exchanges (all, and in the last half), and the policy's wall
time.

Part ``quadratic``: attention-bound work (a sample's work ``s + c*s^2``, the scenario's
``"quadratic"``) scheduled by the paper's linear Chronica against ``Chronica(quadratic=c)`` and
``quadratic="fit"`` (opt-in), side by side in virtual time: 4 workers 1:2:3:4, ``2 ms + 2 us *
work / speed``, lengths lognormal(4.5, 1) clipped to 16-1024 (``bench_chronica.py --part
quadratic``'s emulated setting), per global batch and seed, the mean step after the first 100.

    python bench/bench_sim.py [--part scale agree exchange quadratic] [--exchange-every 1 16 16a] [--out F]
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from typing import List

import numpy as np

from report import emit


def part_scale(workers: int, steps: int, repeats: int) -> List[str]:
    from hetlb.sim import generate_cluster, simulate
    import hetlb
    sc = generate_cluster(workers, seed=0)
    lines = [f"### Simulator speed: {workers} workers x {steps} steps (generated mixed cluster)", "",
             "| policy | wall s (median of %d) | decide s | mean step (virtual ms) | speed-up over uniform |" % repeats,
             "|---|---:|---:|---:|---:|"]
    base = None
    for p in ("uniform", "lbb", "lbbsp", "wlbs", "dbs"):
        walls, res = [], None
        for _ in range(repeats):
            res = simulate(sc, p, steps)
            walls.append(res.wall_seconds)
        base = base or res.total_time
        lines.append(f"| {p} | {statistics.median(walls):.2f} | {res.decide_seconds:.2f} | "
                     f"{res.step_time.mean() * 1e3:.1f} | {base / res.total_time:.2f}x |")
    lines += ["", "LB-BSP CPU mode with NARX (one network per rank; warm-up 500 steps, refit every 100):", "",
              "| workers | steps | wall s | s per step |", "|---:|---:|---:|---:|"]
    for n, k in ((16, 1000), (64, 1000), (256, 600)):
        sc = generate_cluster(n, seed=0)
        t0 = time.perf_counter()
        simulate(sc, hetlb.LBBSP("cpu", predictor=hetlb.NARX()), k)
        dt = time.perf_counter() - t0
        lines.append(f"| {n} | {k} | {dt:.1f} | {dt / k * 1e3:.1f} ms |")
    return lines


def _real_worker(rank: int, world: int, store: str, name: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import hetlb
    from hetlb.sim import load_scenario
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        # This machine's all-reduce cost (the scenario's network term): back-to-back all-reduces
        # of a gradient-plus-telemetry-sized tensor.
        buf = torch.zeros(64)
        for _ in range(20):
            dist.all_reduce(buf)
        t0 = time.perf_counter()
        for _ in range(100):
            dist.all_reduce(buf)
        allreduce = (time.perf_counter() - t0) / 100
        sc = load_scenario(name)
        ddp = DDP(torch.nn.Linear(4, 1))
        bal = hetlb.Balancer(ddp, sc.global_batch, policy=hetlb.LBB(),
                             emulator=sc.emulator(rank, spin=0.0005))
        loader = bal.loader(torch.utils.data.TensorDataset(torch.randn(sc.global_batch * steps, 4)))
        stamps = []
        for (xb,) in loader:
            stamps.append(time.perf_counter())
            ddp(xb).sum().backward()
        stamps.append(time.perf_counter())
        if rank == 0:
            np.savez(out, sizes=np.array([r.batch for r in bal.history]), stamps=np.array(stamps),
                     compute=np.array([r.compute for r in bal.history]), allreduce=allreduce)
        del ddp, bal
    finally:
        dist.destroy_process_group()


def part_agree(name: str, steps: int, split: int) -> List[str]:
    import torch.multiprocessing as mp
    from hetlb.sim import load_scenario, simulate
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "real.npz")
        mp.spawn(_real_worker, args=(4, os.path.join(tmp, "store"), name, steps, out), nprocs=4)
        real = np.load(out)
        rs, stamps, allreduce = real["sizes"], real["stamps"], float(real["allreduce"])
        rc = real["compute"]
    rt = np.diff(stamps)  # the wall time of each step on rank 0 (a step ends at the next batch)
    sc = load_scenario(name)
    bare = simulate(sc, "lbb", steps)
    # The scenario's network set to this machine's measured all-reduce (a ring of 4: 6 hops).
    sc.network.latency = allreduce / (2 * (4 - 1))
    sim = simulate(sc, "lbb", steps)
    lines = [f"### Simulator against a real emulated run: `{name}`, LBB, {steps} steps, 4 Gloo ranks", "",
             f"The simulated network is this machine's all-reduce, measured before training: "
             f"{allreduce * 1e3:.2f} ms per all-reduce (ring latency {sc.network.latency * 1e3:.3f} ms per hop). "
             f"'no network' is the scenario as shipped (compute only).", "",
             "| phase | real median step (ms) | simulated (ms) | simulated / real | simulated, no network / real |",
             "|---|---:|---:|---:|---:|"]
    for what, sl in ((f"steps 5-{split - 1} (balanced)", slice(5, split)),
                     (f"steps {split}-{split + 9} (disturbance, tuning)", slice(split, split + 10)),
                     (f"steps {split + 10}-{steps - 1} (re-balanced)", slice(split + 10, steps))):
        r, s = float(np.median(rt[sl])), float(np.median(sim.step_time[sl]))
        b = float(np.median(bare.step_time[sl]))
        lines.append(f"| {what} | {r * 1e3:.1f} | {s * 1e3:.1f} | {s / r:.3f} | {b / r:.3f} |")
    lines += ["", f"Final sizes: real {rs[-1].tolist()}, simulated {sim.sizes[-1].tolist()}; "
              f"at step {split - 1}: real {rs[split - 1].tolist()}, simulated {sim.sizes[split - 1].tolist()}."]
    # On a quiet machine the sizes agree within 4 samples at both steps and the real compute
    # times are within 10 % of the scenario's (median); a busy machine lengthens the real times.
    diff = [int(np.abs(rs[k] - sim.sizes[k]).max()) for k in (split - 1, steps - 1)]
    want = np.stack([sc.workers[r].time_model.time(rs[:, r]) for r in range(rs.shape[1])], 1)
    for e in sc.events:  # the scenario's disturbances, as the emulator adds them
        if e.kind == "disturb":
            for w in e.workers:
                stop = steps if e.stop is None else min(e.stop, steps)
                want[e.start:stop, w] = want[e.start:stop, w] * e.factor + e.extra
    ratio = rc / want
    lines += ["", f"Largest size difference (real - simulated, any rank): {diff[0]} samples at step "
              f"{split - 1}, {diff[1]} at step {steps - 1}. Real compute time over the scenario's at the "
              f"size each rank ran: min {ratio.min():.3f}, median {np.median(ratio):.3f}, max {ratio.max():.3f} "
              f"(an idle machine gives min > 0.99, median < 1.1 and sizes within 4 at steps 29 and 89 of "
              f"90; LBB's fine-tune settles by about step 75; a busy one lengthens the real times)."]
    return lines


def exchange_spec(spec: str) -> dict:
    """``"16"`` -> exchange_every=16; ``"16a"`` -> also adaptive_exchange=True."""
    return {"exchange_every": int(spec.rstrip("a")), "adaptive_exchange": spec.endswith("a")}


def exchange_policy(spec: str):
    """A policy name for :func:`hetlb.sim.simulate`; ``"chronica@F"``: ``Chronica(forget=F)``;
    ``"chronica~H"``: ``Chronica(hold=H)`` (``"chronica@F~H"``: both)."""
    import re
    m = re.fullmatch(r"chronica(?:@([0-9.eE+-]+))?(?:~([0-9.eE+-]+))?", spec)
    if m is None or spec == "chronica":
        if spec.startswith("chronica") and spec != "chronica":
            raise SystemExit(f"bench_sim: policy {spec!r}: expected chronica, chronica@F, "
                             f"chronica~H or chronica@F~H")
        return spec
    from hetlb.policies import Chronica
    forget, hold = m.groups()
    return Chronica(forget=float(forget) if forget else 1.0, hold=float(hold) if hold else 0.0)


def part_exchange(everies: List[str], policies: List[str], first_policy: bool = False) -> List[str]:
    from hetlb.sim import builtin_scenarios, simulate
    against = f"{policies[0]}, k = {everies[0]}" if first_policy else f"k = {everies[0]}"
    lines = [f"### Telemetry every k steps in the simulator (exchange_every=k against {against})", "",
             f"| scenario | policy | k | total (virtual s) | / {against} | mean step, last half (ms) "
             f"| exchanges (last half) | decide (wall ms) |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name in ("abs-sgd-1234", "abs-sgd-dynamic", "lbb-disturbance", "lbbsp-cluster-a", "mixed"):
        sc = builtin_scenarios()[name]()
        base = None
        for pol in policies:
            if not first_policy:
                base = None
            for k in everies:
                r = simulate(sc, exchange_policy(pol), **exchange_spec(k))
                base = r.total_time if base is None else base
                cut = len(r.step_time) // 2
                half = r.step_time[cut:]
                late = sum(e >= cut for e in r.exchanges)
                lines.append(f"| {name} | {pol} | {k} | {r.total_time:.3f} | {r.total_time / base:.4f} | "
                             f"{1e3 * float(np.mean(half)):.2f} | {len(r.exchanges)} ({late}) | "
                             f"{1e3 * r.decide_seconds:.1f} |")
    return lines


def part_quadratic(batches: List[int], seeds: int, steps: int) -> List[str]:
    import hetlb
    from hetlb.sim import simulate
    from hetlb.sim.scenario import Scenario
    lines = ["### Chronica on attention-bound work in the simulator (c = 0.01)", "",
             "| global batch | seed | linear Chronica (paper), mean step ms | quadratic=0.01 (x linear) "
             "| quadratic='fit' (x linear) | lbb (x linear) |", "|---:|---:|---:|---:|---:|---:|"]
    for gb in batches:
        for seed in range(seeds):
            sc = Scenario.from_dict({
                "name": "attention", "global_batch": gb, "steps": steps, "steps_per_epoch": 100,
                "work": "data", "quadratic": 0.01, "seed": seed,
                "samples": {"kind": "lognormal", "mean": 4.5, "sigma": 1.0, "min": 16, "max": 1024},
                "workers": [{"model": [0.002, 2e-6], "speed": v} for v in (1, 2, 3, 4)]})
            t = [float(simulate(sc, p).step_time[100:].mean()) for p in
                 (hetlb.Chronica(), hetlb.Chronica(quadratic=0.01), hetlb.Chronica(quadratic="fit"), "lbb")]
            lines.append(f"| {gb} | {seed} | {1e3 * t[0]:.2f} | {t[1] / t[0]:.3f} | {t[2] / t[0]:.3f} | "
                         f"{t[3] / t[0]:.3f} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", nargs="+", choices=["scale", "agree", "exchange", "quadratic"],
                   default=["scale", "agree"])
    p.add_argument("--exchange-every", nargs="+", default=["1", "4", "16", "16a"],
                   help="the k values of part exchange (the first is the baseline); Ka: adaptive")
    p.add_argument("--policies", nargs="+", default=["lbb", "lbbsp", "wlbs", "dbs"],
                   help="the policies of part exchange (chronica@F: Chronica(forget=F); "
                        "chronica~H: Chronica(hold=H))")
    p.add_argument("--against-first-policy", action="store_true",
                   help="part exchange: ratios to the first policy's first k (else each policy's own)")
    p.add_argument("--workers", type=int, default=4096)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import torch
    torch.set_num_threads(1)
    lines: List[str] = []
    if "scale" in args.part:
        lines += part_scale(args.workers, args.steps, args.repeats) + [""]
    if "agree" in args.part:
        lines += part_agree("lbb-disturbance", 80, 30) + [""]
    if "exchange" in args.part:
        lines += part_exchange(args.exchange_every, args.policies, args.against_first_policy) + [""]
    if "quadratic" in args.part:
        lines += part_quadratic([32, 256], 3, 400)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
