"""CHRONICA Table IV's shape: per-epoch time against the spread of sample sizes (DIF).

Sample sizes are drawn from a normal of mean 45 and standard deviation DIF in {0, 4, 8, 16, 32,
64}, clipped at 1 and rounded (the realised mean is printed: clipping raises it). A worker's
compute time is proportional to the summed size of its samples, divided by its speed
(``T = 2 ms + 20 us * size / speed``); global batch 256 on 4 workers. Three ways to split each
step, as in the paper's columns:

* ``uniform``: a fixed count per rank, samples in random order (the paper's TensorFlow column);
* ``lbb``: counts balanced by per-rank speed (LBB, BOA-like), samples in random order;
* ``chronica``: :class:`hetlb.Chronica`, samples assigned by estimated time.

on a homogeneous cluster (the paper's setting) and a 1:2:3:4 one (not in the paper). Reported per
epoch: time normalised by the epoch's total work (seconds per 1000 size units), its growth from
DIF 0, and the median step-level straggler (max - min compute over ranks).

Part ``real``: 4 real Gloo ranks, each an :class:`hetlb.emulate.Emulator` on its data amount
(``by="data"``), one process group for every setting; part ``sim``: the same settings in the
simulator; part ``overhead``: the decision plus the assignment per step at 64 ranks and 4096
samples per step (simulated ranks), against a 100 ms step; part ``collate``: the input bytes
per rank under padding to the step's longest sample, to the rank's own, and packing.

    python bench/bench_chronica.py [--part real sim overhead collate] [--steps 12] [--global-batch 256] [--out F]
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
from typing import Dict, List

import numpy as np

from report import emit

DIFS = (0, 4, 8, 16, 32, 64)
POLICIES = ("uniform", "lbb", "chronica")
CLUSTERS = {"homogeneous": (1.0, 1.0, 1.0, 1.0), "1:2:3:4": (1.0, 2.0, 3.0, 4.0)}
A0, A1 = 0.002, 2e-5
GB = 256  # set by --global-batch


def sizes_for(dif: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(1000 + dif)
    return np.round(np.clip(rng.normal(45, dif, n), 1, None))


def _real_worker(rank: int, world: int, store: str, steps: int, out: str, gb: int) -> None:
    global GB
    GB = gb  # (spawned: the module's value is not inherited)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import hetlb
    from hetlb.emulate import Emulator
    from hetlb.sim import make_policy
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    results: Dict[str, Dict[str, float]] = {}
    try:
        for cname, speeds in CLUSTERS.items():
            for dif in DIFS:
                sz = sizes_for(dif, GB * steps)
                ds = torch.utils.data.TensorDataset(torch.tensor(sz, dtype=torch.float32)[:, None])
                for pname in POLICIES:
                    ddp = DDP(torch.nn.Linear(1, 1))
                    emu = Emulator.for_rank(rank, list(speeds), model=hetlb.LinearModel(A0, A1),
                                            by="data", spin=0.0005)
                    bal = hetlb.Balancer(ddp, GB, policy=make_policy(pname), emulator=emu, lower=0,
                                         weighting="sizes")
                    loader = bal.loader(ds, sample_sizes=sz, seed=7)
                    # epoch 0 warms the policies up; epoch 1 is timed
                    for epoch in range(2):
                        loader.set_epoch(epoch)
                        dist.barrier()
                        t0 = torch.tensor(0.0)
                        import time
                        start = time.perf_counter()
                        for (x,) in loader:
                            ddp(x).sum().backward()
                        t0 += time.perf_counter() - start
                    recs = [r for r in bal.history if r.epoch == 1]
                    gap = statistics.median(float(r.compute.max() - r.compute.min()) for r in recs)
                    results[f"{cname}|{dif}|{pname}"] = {"epoch": float(t0), "work": float(sz.sum()),
                                                        "mean": float(sz.mean()), "gap": gap}
                    del bal, loader, ddp
        if rank == 0:
            import json
            with open(out, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _table(results: Dict[str, Dict[str, float]], title: str) -> List[str]:
    lines = [title, "", "| cluster | DIF | realised mean size | " +
             " | ".join(f"{p} us/unit (x DIF 0)" for p in POLICIES) + " | " +
             " | ".join(f"{p} straggler ms" for p in POLICIES) + " |",
             "|---|---:|---:|" + "---:|" * (2 * len(POLICIES))]
    for cname in CLUSTERS:
        base = {p: results[f"{cname}|0|{p}"]["epoch"] / results[f"{cname}|0|{p}"]["work"] for p in POLICIES}
        for dif in DIFS:
            row = [cname, str(dif), f"{results[f'{cname}|{dif}|uniform']['mean']:.1f}"]
            for p in POLICIES:
                r = results[f"{cname}|{dif}|{p}"]
                norm = r["epoch"] / r["work"]
                row.append(f"{norm * 1e6:.2f} ({norm / base[p]:.2f}x)")
            for p in POLICIES:
                row.append(f"{results[f'{cname}|{dif}|{p}']['gap'] * 1e3:.1f}")
            lines.append("| " + " | ".join(row) + " |")
    return lines


def part_real(steps: int) -> List[str]:
    import json
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.json")
        mp.spawn(_real_worker, args=(4, os.path.join(tmp, "store"), steps, out, GB), nprocs=4)
        with open(out) as f:
            results = json.load(f)
    return _table(results, f"### Real emulated ranks (4 Gloo processes), global batch {GB}, {steps} steps per epoch, the second epoch timed")


def part_sim(steps: int) -> List[str]:
    from hetlb.sim import Scenario, simulate
    results: Dict[str, Dict[str, float]] = {}
    for cname, speeds in CLUSTERS.items():
        for dif in DIFS:
            sc = Scenario.from_dict({
                "global_batch": GB, "work": "data", "lower": 0, "seed": 7,
                "samples": {"kind": "normal", "mean": 45, "std": dif, "min": 1},
                "workers": [{"model": [A0, A1], "speed": s} for s in speeds]})
            for p in POLICIES:
                r = simulate(sc, p, 2 * steps)
                t = r.step_time[steps:]
                work = float(r.data[steps:].sum())
                results[f"{cname}|{dif}|{p}"] = {
                    "epoch": float(t.sum()), "work": work,
                    "mean": work / (GB * steps),
                    "gap": float(np.median(np.nanmax(r.compute[steps:], 1) - np.nanmin(r.compute[steps:], 1)))}
    return _table(results, f"### Simulated, global batch {GB}, {steps} steps per epoch, the second epoch")


def part_overhead() -> List[str]:
    from hetlb.sim import Scenario, simulate
    sc = Scenario.from_dict({
        "global_batch": 4096, "work": "data", "lower": 0,
        "samples": {"kind": "lognormal", "mean": 4.0, "sigma": 1.0, "min": 1},
        "workers": [{"model": [0.01, 1e-5], "speed": 1.0 + (i % 4)} for i in range(64)]})
    r = simulate(sc, "chronica", 200)
    per = (r.decide_seconds + r.assign_seconds) / r.steps
    return ["### Chronica's per-step overhead at 64 ranks and 4096 samples per step (simulated ranks)", "",
            "| decide ms/step | assignment ms/step | total ms/step | share of a 100 ms step |",
            "|---:|---:|---:|---:|",
            f"| {r.decide_seconds / r.steps * 1e3:.3f} | {r.assign_seconds / r.steps * 1e3:.3f} | "
            f"{per * 1e3:.3f} | {per / 0.1 * 100:.2f} % |"]


def part_collate(steps: int = 50) -> List[str]:
    """Bytes of the input batch per rank: padded to the step's longest sample (one shape for every
    rank), to the rank's own longest (:func:`hetlb.collate.pad_collate`), or packed
    (:func:`hetlb.collate.packed_collate`), for Chronica's assignment of long-tailed token lengths
    (lognormal, 16 to 2048) on 1:2:3:4 ranks, width 64 float32."""
    import torch
    import hetlb
    from hetlb.collate import pad_collate, packed_collate
    rng = np.random.default_rng(0)
    slope = A1 / np.array([1.0, 2.0, 3.0, 4.0])
    tot = {"global max": np.zeros(4), "own max": np.zeros(4), "packed": np.zeros(4)}
    for _ in range(steps):
        lens = np.clip(np.round(rng.lognormal(5.0, 1.0, 64)), 16, 2048).astype(int)
        owner = hetlb.schedule(lens.astype(float), slope, np.full(4, A0))
        top = int(lens.max())
        for r in range(4):
            mine = [torch.zeros(int(n), 64) for n in lens[owner == r]]
            if not mine:
                continue
            tot["global max"][r] += len(mine) * top * 64 * 4
            tot["own max"][r] += pad_collate(mine).data.nbytes
            tot["packed"][r] += packed_collate(mine).data.nbytes
    lines = [f"### Input bytes per rank and step: Chronica's assignment of 64 lognormal token lengths "
             f"(16-2048) on 1:2:3:4 ranks, width 64 float32, mean of {steps} steps", "",
             "| layout | rank 0 (1x) MiB | rank 1 (2x) | rank 2 (3x) | rank 3 (4x) | largest rank vs packed |",
             "|---|---:|---:|---:|---:|---:|"]
    packed_peak = float(tot["packed"].max())
    for name, v in tot.items():
        mib = v / steps / 2 ** 20
        lines.append(f"| {name} | " + " | ".join(f"{x:.2f}" for x in mib) + f" | {v.max() / packed_peak:.2f}x |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", nargs="+", choices=["real", "sim", "overhead", "collate"],
                   default=["real", "sim", "overhead", "collate"])
    p.add_argument("--steps", type=int, default=12, help="steps per epoch")
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    global GB
    GB = args.global_batch
    import torch
    torch.set_num_threads(1)
    lines: List[str] = []
    if "overhead" in args.part:
        lines += part_overhead() + [""]
    if "collate" in args.part:
        lines += part_collate() + [""]
    if "sim" in args.part:
        lines += part_sim(args.steps) + [""]
    if "real" in args.part:
        lines += part_real(args.steps)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
