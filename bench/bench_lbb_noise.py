"""How noisy the per-rank compute times are on this machine, and what LBB's thresholds do with it.

Part ``real``: a 2-rank Gloo job (``bench_overhead.py``'s ``mlp`` model, one thread per rank,
pinned to a core with ``--pin``, global batch 128) trains ``--steps`` steps under each policy of
``--policies``. For each it reports how many fine- and rapid-tunes the policy made, the share of
steps whose sizes were not the even split (from the first such step on the Balancer weighs every
gradient), the first uneven step, and the percentiles of the per-step log ratio of rank 0's
compute time per sample to rank 1's: the noise a policy reads on two identical ranks. A policy
that never moves (``LBB(fine=100, rapid=100)``) shows the raw noise at the even split.

Part ``emulated``: LBB and its thresholds on the in-process clusters of ``bench_policies.py``
(2 workers, ``T = 10 ms + 0.15 ms x b``, identical or one 10 % slower per sample, Gaussian jitter
per rank and step of 5, 12 and 25 %; 5 seeds of 300 steps), beside the 1:2:3:4 cluster with a
+50 ms disturbance at step 30: mean makespan over the best split and the share of uneven steps.

    python bench/bench_lbb_noise.py [--part real emulated] [--steps 300] [--pin]
        [--policies "LBB()" "LBB(confirm=3)" "LBB(fine=100, rapid=100)"] [--out FILE]
"""
from __future__ import annotations

import argparse
import math
import os
from typing import List

import numpy as np

from report import emit, on_gloo_ranks


def make_policy(spec: str):
    """A policy from its constructor text, e.g. ``"LBB(confirm=3)"`` (hetlb's public names and
    ``math``)."""
    import hetlb
    names = {k: getattr(hetlb, k) for k in hetlb.__all__}
    return eval(spec, {**names, "math": math})  # (a benchmark's own argument)


def _job(rank: int, world: int, spec: str, steps: int, pin: bool) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hetlb
    from bench_overhead import make_model
    if pin:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    ddp = DDP(make_model("mlp"))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    n = 128 * (steps + 2)
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 512, generator=g),
                                        torch.randint(0, 10, (n,), generator=g))
    bal = hetlb.Balancer(ddp, 128, policy=make_policy(spec))
    for k, (x, y) in enumerate(bal.loader(ds, seed=1)):
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        if k + 1 >= steps:
            break
    bal.flush()
    b = np.stack([r.batch for r in bal.history])
    c = np.stack([r.compute for r in bal.history])
    uneven = b.min(axis=1) != b.max(axis=1)
    ratio = np.log((c[:, 0] / b[:, 0]) / (c[:, 1] / b[:, 1]))
    actions = getattr(bal.policy, "actions", [])
    return {"fine": actions.count("fine"), "rapid": actions.count("rapid"),
            "uneven": float(uneven.mean()), "first": int(np.argmax(uneven)) if uneven.any() else -1,
            "pct": np.percentile(ratio, [5, 25, 50, 75, 95]).tolist(),
            "cv": float(np.mean(c.std(axis=0) / c.mean(axis=0)))}


def part_real(policies: List[str], steps: int, pin: bool) -> List[str]:
    lines = [f"### The real job: 2 Gloo ranks, mlp, global batch 128, {steps} steps"
             f"{', pinned' if pin else ''}", "",
             "| policy | fine-tunes | rapid-tunes | uneven steps | first uneven | log ratio of time "
             "per sample, rank 0 / rank 1: 5 / 25 / 50 / 75 / 95 % | compute CV |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for spec in policies:
        r = on_gloo_ranks(_job, 2, spec, steps, pin)
        lines.append(f"| `{spec}` | {r['fine']} | {r['rapid']} | {100 * r['uneven']:.0f} % | "
                     f"{r['first']} | {' / '.join(f'{v:.2f}' for v in r['pct'])} | {r['cv']:.2f} |")
    return lines


def part_emulated(policies: List[str]) -> List[str]:
    from bench_policies import best_time, even_times, lbb_times, run_cluster, settled

    def slow_times(k, r, b):
        return 0.010 + 0.00015 * b * (1.1 if r == 1 else 1.0)  # even_times, rank 1 10 % slower
    best = np.array([best_time(lbb_times, 4, 500, k) for k in (0, 30)])
    best_k = np.where(np.arange(200) < 30, best[0], best[1])
    clusters = [(f"identical, {int(100 * z)} % jitter", even_times, even_times(0, 0, 64), z)
                for z in (0.05, 0.12, 0.25)]
    clusters.append(("one 10 % slower, 12 % jitter", slow_times, best_time(slow_times, 2, 128, 0), 0.12))
    lines = ["### Emulated: mean makespan over the best split / share of uneven steps (5 seeds x "
             "300 steps); 1:2:3:4 with +50 ms at step 30: mean / steps to settle", "",
             "| policy | 1:2:3:4 disturbance | " + " | ".join(c[0] for c in clusters) + " |",
             "|---|---|" + "---|" * len(clusters)]
    for spec in policies:
        ms = run_cluster(make_policy(spec), 4, 500, lbb_times, 200)
        settle = settled(ms, best_k, 30)
        row = [f"{np.mean(ms / best_k):.3f} / {settle if settle >= 0 else 'never'}"]
        for _, times, b, noise in clusters:
            means, uneven = [], []
            for seed in range(5):
                sizes: list = []
                ms = run_cluster(make_policy(spec), 2, 128, times, 300, seed=seed, noise=noise, sizes=sizes)
                means.append(np.mean(ms) / b)
                uneven.append(np.mean([s.min() != s.max() for s in sizes]))
            row.append(f"{np.mean(means):.3f} / {100 * np.mean(uneven):.0f} %")
        lines.append(f"| `{spec}` | " + " | ".join(row) + " |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", nargs="+", choices=["real", "emulated"], default=["real", "emulated"])
    p.add_argument("--policies", nargs="+",
                   default=["LBB(fine=100, rapid=100)", "LBB()", "LBB(confirm=3)",
                            "LBB(confirm=3, fine=0.15)"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--pin", action="store_true", help="pin rank r to core r")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    lines: List[str] = []
    if "real" in args.part:
        lines += part_real(args.policies, args.steps, args.pin) + [""]
    if "emulated" in args.part:
        lines += part_emulated(args.policies)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
