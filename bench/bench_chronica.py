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

Part ``real``: 4 real Gloo ranks, each an :class:`hetlb.sim.emulate.Emulator` on its data amount
(``by="data"``), one process group for every setting; part ``sim``: the same settings in the
simulator; part ``overhead``: the decision plus the assignment per step at 64 ranks and 4096
samples per step (simulated ranks), against a 100 ms step; part ``collate``: the input bytes
per rank under padding to the step's longest sample, to the rank's own, and packing; part
``sharded``: the epoch-level straggler: 4 real Gloo ranks 1:2:3:4 reading only their own shards
(``partition="even"``, DIF 32), with the paper's per-epoch rebalancing against fixed shards
(``rebalance=False``), per epoch: wall time, the spread of the ranks' summed compute, moves; part
``quadratic``: 4 real Gloo ranks 1:2:3:4 whose time is quadratic in a sample's length (work
``s + 0.01 s^2``, lognormal lengths 16-1024), count balancing against Chronica with the paper's
linear model, the quadratic term fitted, and the true term given; part ``padded``: the random
column's growth when each rank's batch is padded to its longest sample (computed, no ranks).

    python bench/bench_chronica.py [--part real sim overhead collate sharded quadratic padded] [--steps 12] [--global-batch 256] [--out F]
"""
from __future__ import annotations

import argparse
import statistics
from typing import Dict, List

import numpy as np

from report import emit, on_gloo_ranks

DIFS = (0, 4, 8, 16, 32, 64)
POLICIES = ("uniform", "lbb", "chronica")
CLUSTERS = {"homogeneous": (1.0, 1.0, 1.0, 1.0), "1:2:3:4": (1.0, 2.0, 3.0, 4.0)}
A0, A1 = 0.002, 2e-5
GB = 256  # set by --global-batch


def sizes_for(dif: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(1000 + dif)
    return np.round(np.clip(rng.normal(45, dif, n), 1, None))


def _timed_epoch(loader, ddp, epoch: int) -> float:
    """Wall seconds of one epoch (forward and backward of the sum), the ranks starting together."""
    import time
    import torch.distributed as dist
    loader.set_epoch(epoch)
    dist.barrier()
    start = time.perf_counter()
    for (x,) in loader:
        ddp(x).sum().backward()
    return time.perf_counter() - start


def _real_worker(rank: int, world: int, steps: int, gb: int) -> Dict[str, Dict[str, float]]:
    global GB
    GB = gb  # (spawned: the module's value is not inherited)
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    import hetlb
    from hetlb.sim.emulate import Emulator
    from hetlb.sim import make_policy
    results: Dict[str, Dict[str, float]] = {}
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
                t0 = [_timed_epoch(loader, ddp, e) for e in range(2)][1]  # epoch 0 warms the policies up
                recs = [r for r in bal.history if r.epoch == 1]
                gap = statistics.median(float(r.compute.max() - r.compute.min()) for r in recs)
                results[f"{cname}|{dif}|{pname}"] = {"epoch": float(t0), "work": float(sz.sum()),
                                                    "mean": float(sz.mean()), "gap": gap}
                del bal, loader, ddp
    return results


def _sharded_worker(rank: int, world: int, steps: int, epochs: int, gb: int) -> Dict[str, List[Dict[str, float]]]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    import hetlb
    from hetlb.sim.emulate import Emulator
    from hetlb.sim import make_policy
    speeds = CLUSTERS["1:2:3:4"]
    results: Dict[str, List[Dict[str, float]]] = {}
    sz = sizes_for(32, gb * steps)
    ds = torch.utils.data.TensorDataset(torch.tensor(sz, dtype=torch.float32)[:, None])
    for pname in ("uniform", "chronica"):
        for rebalance in (False, True):
            ddp = DDP(torch.nn.Linear(1, 1))
            emu = Emulator.for_rank(rank, list(speeds), model=hetlb.LinearModel(A0, A1),
                                    by="data", spin=0.0005)
            bal = hetlb.Balancer(ddp, gb, policy=make_policy(pname), emulator=emu, lower=0,
                                 weighting="sizes")
            loader = bal.loader(ds, sample_sizes=sz, seed=7, partition="even", rebalance=rebalance)
            rows = []
            for epoch in range(epochs):
                wall = _timed_epoch(loader, ddp, epoch)
                m = loader.migration
                rows.append({"wall": wall, "moves": 0 if m is None else len(m)})
            for rec in bal.history:
                rows[rec.epoch].setdefault("compute", np.zeros(world))
                rows[rec.epoch]["compute"] = rows[rec.epoch]["compute"] + np.nan_to_num(rec.compute, posinf=0.0)
            for row in rows:
                c = row.pop("compute", np.zeros(world))
                row["spread"] = float(c.max() - c.min())
            results[f"{pname}|{'rebalance' if rebalance else 'fixed'}"] = rows
            del bal, loader, ddp
    return results


def part_sharded(steps: int, epochs: int = 4) -> List[str]:
    results = on_gloo_ranks(_sharded_worker, 4, steps, epochs, GB)
    lines = [f"### Sharded ranks 1:2:3:4 (4 Gloo processes), DIF 32, global batch {GB}, {steps} steps "
             f"per epoch: epoch wall time s (x fixed shards) / spread of the ranks' summed compute s / "
             f"samples moved after the epoch", "",
             "| policy | shards | " + " | ".join(f"epoch {e}" for e in range(epochs)) + " |",
             "|---|---|" + "---|" * epochs]
    for key, rows in results.items():
        pname, mode = key.split("|")
        fixed = results[f"{pname}|fixed"]
        cells = [f"{r['wall']:.2f} ({r['wall'] / f['wall']:.2f}x) / {r['spread']:.2f} / {r['moves']}"
                 for r, f in zip(rows, fixed)]
        lines.append(f"| {pname} | {mode} | " + " | ".join(cells) + " |")
    return lines


QUAD_C = 0.01
QUAD_POLICIES = {"lbb (counts)": ("lbb", None), "chronica linear (paper)": ("chronica", 0.0),
                 "chronica quadratic='fit'": ("chronica", "fit"),
                 f"chronica quadratic={QUAD_C} (given)": ("chronica", QUAD_C)}


def _quadratic_worker(rank: int, world: int, steps: int, gb: int) -> Dict[str, Dict[str, float]]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    import hetlb
    from hetlb.sim.emulate import Emulator
    from hetlb.sim import make_policy
    results: Dict[str, Dict[str, float]] = {}
    lens = np.clip(np.random.default_rng(5).lognormal(4.5, 1.0, gb * steps), 16, 1024).round()
    ds = torch.utils.data.TensorDataset(torch.tensor(lens, dtype=torch.float32)[:, None])
    for label, (pname, quad) in QUAD_POLICIES.items():
        ddp = DDP(torch.nn.Linear(1, 1))
        emu = Emulator.for_rank(rank, list(CLUSTERS["1:2:3:4"]), model=hetlb.LinearModel(A0, 2e-6),
                                by="data", quadratic=QUAD_C, spin=0.0005)
        pol = hetlb.Chronica(quadratic=quad) if pname == "chronica" else make_policy(pname)
        bal = hetlb.Balancer(ddp, gb, policy=pol, emulator=emu, lower=0, weighting="sizes")
        loader = bal.loader(ds, sample_sizes=lens, seed=7)
        wall = [_timed_epoch(loader, ddp, e) for e in range(2)][1]  # epoch 0 warms the policies up
        recs = [r for r in bal.history if r.epoch == 1]
        gap = statistics.median(float(r.compute.max() - r.compute.min()) for r in recs)
        c = bal.policy._prophet.coefficient() if pname == "chronica" else float("nan")
        results[label] = {"epoch": wall, "gap": gap, "c": c}
        del bal, loader, ddp
    return results


def part_quadratic(steps: int) -> List[str]:
    results = on_gloo_ranks(_quadratic_worker, 4, steps, GB)
    base = results["chronica linear (paper)"]["epoch"]
    lines = [f"### Attention-bound ranks 1:2:3:4 (4 Gloo processes): time `2 ms + 2 us * sum(s + "
             f"{QUAD_C} s^2) / speed`, lengths lognormal(4.5, 1) in 16-1024, global batch {GB}, "
             f"{steps} steps per epoch, the second epoch timed", "",
             "| policy | epoch s (x linear Chronica) | median straggler ms | c in use |",
             "|---|---:|---:|---:|"]
    for label, r in results.items():
        c = "-" if r["c"] != r["c"] else f"{r['c']:.4f}"
        lines.append(f"| {label} | {r['epoch']:.2f} ({r['epoch'] / base:.2f}x) | {r['gap'] * 1e3:.1f} | {c} |")
    return lines


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
    results = on_gloo_ranks(_real_worker, 4, steps, GB)
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


def part_padded(steps: int) -> List[str]:
    """Why the paper's random column grows 2.5x: a framework that pads each batch to its longest
    sample (TensorFlow's fixed-shape batches) pays ``count * longest`` per rank, and the longest of
    64 draws grows with DIF much faster than the mean. Computed from the same sizes (no ranks)."""
    lines = [f"### Random assignment of a fixed count when each rank's batch is padded to its longest sample "
             f"(homogeneous, global batch {GB}, {steps} steps): us per unit of real work", "",
             "| DIF | realised mean | unpadded (x DIF 0) | padded to the rank's longest (x DIF 0) |",
             "|---:|---:|---:|---:|"]
    base = None
    rng = np.random.default_rng(0)
    for dif in DIFS:
        sz = sizes_for(dif, GB * steps)
        per = GB // 4
        plain = padded = 0.0
        for s in range(steps):
            step = rng.permutation(sz[s * GB:(s + 1) * GB]).reshape(4, per)
            plain += float((A0 + A1 * step.sum(1)).max())
            padded += float((A0 + A1 * per * step.max(1)).max())
        work = float(sz.sum())
        if base is None:
            base = (plain / work, padded / work)
        lines.append(f"| {dif} | {sz.mean():.1f} | {plain / work * 1e6:.2f} ({plain / work / base[0]:.2f}x) | "
                     f"{padded / work * 1e6:.2f} ({padded / work / base[1]:.2f}x) |")
    return lines


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
    rank), to the rank's own longest (:func:`hetlb.data.collate.pad_collate`), or packed
    (:func:`hetlb.data.collate.packed_collate`), for Chronica's assignment of long-tailed token lengths
    (lognormal, 16 to 2048) on 1:2:3:4 ranks, width 64 float32."""
    import torch
    import hetlb
    from hetlb.data.collate import pad_collate, packed_collate
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
    parts = ["real", "sim", "overhead", "collate", "sharded", "quadratic", "padded"]
    p.add_argument("--part", nargs="+", choices=parts, default=parts)
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
    if "padded" in args.part:
        lines += part_padded(args.steps) + [""]
    if "sharded" in args.part:
        lines += part_sharded(args.steps) + [""]
    if "quadratic" in args.part:
        lines += part_quadratic(args.steps) + [""]
    if "real" in args.part:
        lines += part_real(args.steps)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
