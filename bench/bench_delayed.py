"""DelayedSync (ABS-SGD): the wait for the all-reduce, how much of it is hidden, how batches follow speed.

4 real Gloo ranks train an MLP (784-256-10, 0.2 M parameters) with :class:`hetlb.DelayedSync`;
an :class:`hetlb.sim.emulate.Emulator` holds each reference batch of 16 samples to
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

``--buffers`` measures instead what keeping the model's buffers equal costs (``sync_buffers``):
the same MLP with a BatchNorm1d(256) after its first layer, the static 1:2:3:4 cluster, runs
with ``sync_buffers=False`` and ``True`` alternated ``--repeats`` times (samples per second,
median wait and all-reduce time, bytes per all-reduce, and how far the ranks' running means are
apart after training); then, in one process, the CPU time per iteration of packing and applying
the buffers of that BatchNorm layer and of a ResNet-50's 53 (median over 200 rounds of 20
iterations).

    python bench/bench_delayed.py --buffers [--iterations 120] [--repeats 3] [--out F]
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Dict

import numpy as np

from report import emit, on_gloo_ranks

REF = 16
A0, A1 = 0.004, 0.001


def _worker(rank: int, world: int, iterations: int, speeds: list, noise: float, link: float,
            bn: bool = False, sync: bool = True) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    import hetlb
    from hetlb.sim.emulate import Emulator
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(784, 256), *([torch.nn.BatchNorm1d(256)] if bn else []),
                              torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    # (the link's time is that of the gradients' buffer, with or without the buffers riding along)
    nbytes = (sum(p.numel() for p in net.parameters()) + world * len(hetlb.sync.delayed.ROW)) * 4
    emu = Emulator.for_rank(rank, speeds, model=hetlb.LinearModel(A0, A1), noise=noise, seed=1, spin=0.0005,
                            bandwidth=nbytes / link if link > 0 else None)
    ds = hetlb.DelayedSync(net, opt, reference_batch=REF, lam=0.5, emulator=emu, sync_buffers=sync)
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
    sent = ds._flight.buf.numel() * ds._flight.buf.element_size()
    ds.flush()  # no all-reduce may be left in flight when the group is destroyed
    spread = 0.0
    if bn:
        means = [torch.zeros(256) for _ in range(world)]
        dist.all_gather(means, net[1].running_mean.detach().clone())
        spread = float(max((m - means[0]).abs().max() for m in means))
    return {"batch": [r.batch.tolist() for r in recs], "wait": [r.wait.tolist() for r in recs],
            "link": [r.link.tolist() for r in recs], "compute": [r.compute.tolist() for r in recs],
            "wall": wall, "speeds": list(speeds), "bytes": sent, "spread": spread}


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


def buffers(iterations: int, link: float, repeats: int) -> list:
    """The ``--buffers`` part (see the module docstring)."""
    runs: Dict[bool, list] = {False: [], True: []}
    for _ in range(repeats):
        for sync in (False, True):
            runs[sync].append(on_gloo_ranks(_worker, 4, iterations, [1.0, 2.0, 3.0, 4.0], 0.0, link,
                                            True, sync))
    lines = [f"### DelayedSync with BatchNorm: sync_buffers off and on, static 1:2:3:4, "
             f"link {link * 1e3:g} ms, {repeats} runs each, alternated", "",
             "| sync_buffers | samples/s, median (min-max) | / off | median wait ms | median all-reduce ms | "
             "bytes per all-reduce | running_mean apart after |", "|---|---:|---:|---:|---:|---:|---:|"]
    rate = {k: [float(np.array(r["batch"]).sum() / r["wall"]) for r in v] for k, v in runs.items()}
    for sync in (False, True):
        rs = runs[sync]
        wait = np.median([np.median(np.array(r["wait"], float)[1:]) for r in rs]) * 1e3
        allr = np.median([np.median(np.array(r["link"], float)[1:]) for r in rs]) * 1e3
        lo, hi = min(rate[sync]), max(rate[sync])
        lines.append(f"| {sync} | {np.median(rate[sync]):.0f} ({lo:.0f}-{hi:.0f}) | "
                     f"{np.median(rate[sync]) / np.median(rate[False]):.3f} | {wait:.2f} | {allr:.1f} | "
                     f"{rs[0]['bytes']} | {max(r['spread'] for r in rs):.3g} |")
    import time as _time

    import torch
    from hetlb.sync.delayed import _Buffers
    torch.set_num_threads(1)
    chans = [64] * 10 + [128] * 13 + [256] * 19 + [512] * 10 + [2048]  # ResNet-50's BatchNorm layers
    lines += ["", "Packing and applying the buffers, CPU time per iteration in one process (median over 200 "
                  "rounds of 20 iterations, min-max):", "",
              "| model's BatchNorm layers | buffer values | of the parameters | us per iteration |",
              "|---|---:|---:|---:|"]
    for name, layers, params in (("this MLP's BatchNorm1d(256)", [torch.nn.BatchNorm1d(256)], 204_042),
                                 ("ResNet-50's 53", [torch.nn.BatchNorm2d(c) for c in chans], 25_557_032)):
        b = _Buffers(torch.nn.Sequential(*layers), torch.float32, torch.device("cpu"))
        per = []
        for _ in range(200):
            t = _time.perf_counter()
            for _ in range(20):
                part, agreed = b.own(32.0, True)
                b.began()
                b.apply(part * 4, 128.0, agreed)
            per.append((_time.perf_counter() - t) / 20)
        lines.append(f"| {name} | {b.numel} | {100 * b.numel / params:.2f} % | "
                     f"{np.median(per) * 1e6:.0f} ({min(per) * 1e6:.0f}-{max(per) * 1e6:.0f}) |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=120)
    p.add_argument("--link", type=float, default=0.03, help="seconds of the emulated link per all-reduce")
    p.add_argument("--buffers", action="store_true", help="the cost of sync_buffers instead")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.buffers:
        emit(buffers(args.iterations, args.link, args.repeats), args.out)
        return
    lines = []
    for name, speeds, noise in (("1:1:1:1", [1.0] * 4, 0.0), ("static 1:2:3:4", [1.0, 2.0, 3.0, 4.0], 0.0),
                                ("1:2:3:4, each batch x U(0.5, 1.5)", [1.0, 2.0, 3.0, 4.0], 0.5)):
        res = on_gloo_ranks(_worker, 4, args.iterations, speeds, noise, args.link)
        lines += table(res, f"### DelayedSync, {name}, reference batch {REF}, lam 0.5, link "
                            f"{args.link * 1e3:g} ms") + [""]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
