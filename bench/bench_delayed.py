"""DelayedSync (ABS-SGD): the wait for the all-reduce, how much of it is hidden, how batches follow speed.

4 real Gloo ranks train an MLP (784-256-10, 0.2 M parameters) with :class:`hetlb.DelayedSync`;
an :class:`hetlb.emulate.Emulator` holds each reference batch of 16 samples to
``(4 ms + 1 ms * 16) / speed``, and its link delivers each all-reduce ``--link`` seconds after the
collective completed (0: only the real Gloo all-reduce). Clusters: speeds 1:1:1:1 and 1:2:3:4
(static), and 1:2:3:4 with each batch's time also multiplied by a random factor in [0.5, 1.5]
(dynamic, like ABS-SGD's second setting). Reported after a warm-up of 10 iterations, per rank:
the reference batch time, the median wait for the all-reduce per iteration (idle time after its
last reference batch; the issue's bound: no more than the tail of one reference batch), the
median all-reduce time (from this rank's send until the result was there) and the share of it
hidden behind computation (``1 - wait / all-reduce``, median over iterations), the share of the
samples against the share of the speed; and the samples per second.

    python bench/bench_delayed.py [--iterations 120] [--link 0.03] [--out F]
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Dict

import numpy as np

from report import emit, on_gloo_ranks

REF = 16
A0, A1 = 0.004, 0.001


def _worker(rank: int, world: int, iterations: int, speeds: list, noise: float, link: float) -> Dict[str, Any]:
    import torch
    import hetlb
    from hetlb.emulate import Emulator
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    nbytes = (sum(p.numel() for p in net.parameters()) + world * len(hetlb.sync.delayed.ROW)) * 4
    emu = Emulator.for_rank(rank, speeds, model=hetlb.LinearModel(A0, A1), noise=noise, seed=1, spin=0.0005,
                            bandwidth=nbytes / link if link > 0 else None)
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
            "link": [r.link.tolist() for r in recs], "compute": [r.compute.tolist() for r in recs],
            "wall": wall, "speeds": list(speeds)}


def table(res: Dict[str, Any], title: str) -> list:
    speeds = res["speeds"]
    batch = np.array(res["batch"], float)
    wait = np.array(res["wait"], float)[1:]  # a wait rides in the next iteration's buffer
    link = np.array(res["link"], float)[1:]
    comp = np.array(res["compute"], float)
    per_ref = comp.sum(0) / (batch.sum(0) / REF)
    share = batch.sum(0) / batch.sum()
    speed = np.array(speeds) / sum(speeds)
    hidden = 1.0 - wait / np.maximum(link, 1e-12)
    lines = [title, "", "| rank (speed) | reference batch ms | median wait ms | wait / batch | all-reduce ms | "
             "hidden | share of samples | share of speed |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in range(len(speeds)):
        w = float(np.median(wait[:, r])) * 1e3
        lines.append(f"| {r} ({speeds[r]:g}x) | {per_ref[r] * 1e3:.1f} | {w:.2f} | {w / (per_ref[r] * 1e3):.2f} | "
                     f"{np.median(link[:, r]) * 1e3:.1f} | {np.median(hidden[:, r]):.3f} | "
                     f"{share[r]:.3f} | {speed[r]:.3f} |")
    lines.append(f"\n{batch.sum() / res['wall']:.0f} samples/s over {len(batch)} iterations "
                 f"({batch.sum(1).mean():.0f} samples per iteration)")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=120)
    p.add_argument("--link", type=float, default=0.03, help="seconds of the emulated link per all-reduce")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    lines = []
    for name, speeds, noise in (("1:1:1:1", [1.0] * 4, 0.0), ("static 1:2:3:4", [1.0, 2.0, 3.0, 4.0], 0.0),
                                ("1:2:3:4, each batch x U(0.5, 1.5)", [1.0, 2.0, 3.0, 4.0], 0.5)):
        res = on_gloo_ranks(_worker, 4, args.iterations, speeds, noise, args.link)
        lines += table(res, f"### DelayedSync, {name}, reference batch {REF}, lam 0.5, link "
                            f"{args.link * 1e3:g} ms") + [""]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
