"""DelayedSync (ABS-SGD): the wait for the all-reduce per iteration, and how batches follow speed.

4 real Gloo ranks train an MLP (784-256-10, 0.2 M parameters) with :class:`hetlb.DelayedSync`;
an :class:`hetlb.emulate.Emulator` holds each reference batch of 16 samples to
``(4 ms + 1 ms * 16) / speed`` on ranks of speeds 1:2:3:4 (static), and with each batch's time
also multiplied by a random factor in [0.5, 1.5] (dynamic, like ABS-SGD's second setting). Reported after a warm-up of 10
iterations: each rank's median wait for the all-reduce per iteration (idle time after its last
reference batch) against its reference batch time (the issue's bound: no more than the tail of
one reference batch), each rank's share of the samples against its share of the speed, and the
samples per second.

    python bench/bench_delayed.py [--iterations 120] [--out F]
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Dict

import numpy as np

from report import emit, on_gloo_ranks

SPEEDS = (1.0, 2.0, 3.0, 4.0)
REF = 16
A0, A1 = 0.004, 0.001


def _worker(rank: int, world: int, iterations: int, noise: float) -> Dict[str, Any]:
    import torch
    import hetlb
    from hetlb.emulate import Emulator
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    emu = Emulator.for_rank(rank, list(SPEEDS), model=hetlb.LinearModel(A0, A1), noise=noise,
                            seed=1, spin=0.0005)
    ds = hetlb.DelayedSync(net, opt, reference_batch=REF, lam=0.5, emulator=emu)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(REF, 784, generator=g), torch.randint(0, 10, (REF,), generator=g)
    start = None
    while ds.updates < iterations:
        torch.nn.functional.cross_entropy(net(x), y).backward()
        if ds.step() and ds.updates == 10:
            start = time.perf_counter()
            first = len(ds.history)
    wall = time.perf_counter() - start
    recs = list(ds.history)[first:]
    ds.flush()  # no all-reduce may be left in flight when the group is destroyed
    return {"batch": [r.batch.tolist() for r in recs], "wait": [r.wait.tolist() for r in recs],
            "compute": [r.compute.tolist() for r in recs], "wall": wall}


def table(res: Dict[str, Any], title: str) -> list:
    batch = np.array(res["batch"], float)
    wait = np.array(res["wait"], float)[1:]  # a wait rides in the next iteration's buffer
    comp = np.array(res["compute"], float)
    per_ref = comp.sum(0) / (batch.sum(0) / REF)
    share = batch.sum(0) / batch.sum()
    speed = np.array(SPEEDS) / sum(SPEEDS)
    lines = [title, "", "| rank (speed) | reference batch ms | median wait ms | wait / batch | share of samples | share of speed |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in range(len(SPEEDS)):
        w = float(np.median(wait[:, r])) * 1e3
        lines.append(f"| {r} ({SPEEDS[r]:g}x) | {per_ref[r] * 1e3:.1f} | {w:.2f} | {w / (per_ref[r] * 1e3):.2f} | "
                     f"{share[r]:.3f} | {speed[r]:.3f} |")
    lines.append(f"\n{batch.sum() / res['wall']:.0f} samples/s over {len(batch)} iterations "
                 f"({batch.sum(1).mean():.0f} samples per iteration)")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=120)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    lines = []
    for name, noise in (("static 1:2:3:4", 0.0), ("1:2:3:4, each batch x U(0.5, 1.5)", 0.5)):
        res = on_gloo_ranks(_worker, 4, args.iterations, noise)
        lines += table(res, f"### DelayedSync, {name}, reference batch {REF}, lam 0.5") + [""]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
