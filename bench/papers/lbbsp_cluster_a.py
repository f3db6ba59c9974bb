"""LB-BSP's heterogeneous GPU cluster (Cluster-A), simulated: BSP vs LB-BSP step time.

What is modelled: each GPU type (V100, M60, K80, K520) is a line ``a0 + a1 b`` with GPU
saturation, fitted to what the paper reports of the scaled-down 4-worker cluster training
Inception-V3 (Fig. 8: from 32 each to the equilibrium (89, 21, 12, 6); the K520 saves about 2 s
giving up 26 samples, the V100 pays about 0.5 s for 57 more), plus a ring all-reduce of
Inception-V3's ~95 MB over 10 Gbps. Nothing runs on GPUs and the paper's parameter servers are
replaced by a ring, so step times are not the paper's; the equilibrium and the BSP-vs-LB-BSP
comparison are what this shows. The paper's own iteration speed-up figure on Cluster-A is for
ResNet-32 (+37 %, Fig. 6a), a model this fit does not describe.

    python bench/papers/lbbsp_cluster_a.py
"""
from __future__ import annotations

import copy

import numpy as np

import hetlb
from hetlb.sim import load_scenario, simulate


def main() -> None:
    full = load_scenario("lbbsp-cluster-a")
    four = copy.deepcopy(full)
    four.workers = [full.workers[i] for i in (0, 4, 8, 12)]
    four.global_batch, four.name = 128, "lbbsp-fig8"
    print("LB-BSP Fig. 8: the 4-worker cluster (one GPU of each type), global batch 128, Algorithm 2\n")
    r = simulate(four, hetlb.LBBSP("gpu"), steps=200)
    print(f"| | V100 | M60 | K80 | K520 |\n|---|---:|---:|---:|---:|\n| paper equilibrium | 89 | 21 | 12 | 6 |\n"
          f"| simulated, step 200 | " + " | ".join(str(x) for x in r.sizes[-1]) + " |")
    print("\nCluster-A (16 workers, 4 of each type, global batch 512, 400 steps), simulated\n")
    print("| policy | mean step s | last 100 steps s | iteration speed-up over BSP | mean SE |")
    print("|---|---:|---:|---:|---:|")
    base = None
    for name, pol in (("BSP (uniform)", hetlb.Uniform()), ("LB-BSP GPU mode (Algorithm 2)", hetlb.LBBSP("gpu")),
                      ("LBB", hetlb.LBB())):
        res = simulate(full, pol, steps=400)
        tail = float(np.mean(res.step_time[-100:]))
        base = base or tail
        print(f"| {name} | {res.step_time.mean():.3f} | {tail:.3f} | {base / tail:.2f}x | {res.se.mean():.3f} |")


if __name__ == "__main__":
    main()
