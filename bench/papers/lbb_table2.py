"""LBB Table 2 reproduced: four GPUs (Tesla M40, 2x GTX 1070, GTX 750), ResNet-18 on CIFAR-10,
global batch 512.

What is modelled: each worker is the straight line through the two (batch, ms) points the table
gives (SSGD's 128 and the balanced size); nothing is run on GPUs. ``hetlb plan`` (LBB's exact
solver on those lines) is printed next to the paper's balanced sizes and times, and the LBB
policy is then run in the simulator from a uniform start (no profiling) to show where online
tuning lands.

    python bench/papers/lbb_table2.py
"""
from __future__ import annotations

import numpy as np

from hetlb.sim import compare_splits, load_scenario, simulate

PAPER_SSGD = [81.81, 81.49, 85.39, 392.92]
PAPER_SIZES = [167, 167, 158, 20]
PAPER_TIMES = [104.94, 104.14, 103.46, 104.41]


def main() -> None:
    sc = load_scenario("lbb-table2")
    models = [w.time_model.as_piecewise(sc.global_batch) for w in sc.workers]
    uni, lbb, prop = compare_splits(models, sc.global_batch)
    sim = simulate(sc, "lbb", steps=200)
    print("LBB Table 2 (global batch 512): paper vs hetlb (linear models through the table's points)\n")
    print("| worker | paper SSGD ms | hetlb uniform ms | paper balanced B | hetlb plan B | paper ms | "
          "hetlb plan ms | simulated LBB B (step 200) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for i, w in enumerate(sc.workers):
        print(f"| {w.name} | {PAPER_SSGD[i]:.2f} | {uni.times[i] * 1e3:.2f} | {PAPER_SIZES[i]} | "
              f"{lbb.sizes[i]} | {PAPER_TIMES[i]:.2f} | {lbb.times[i] * 1e3:.2f} | {sim.sizes[-1][i]} |")
    print(f"| cluster | {max(PAPER_SSGD):.2f} | {uni.step * 1e3:.2f} | 512 | {lbb.sizes.sum()} | "
          f"{max(PAPER_TIMES):.2f} | {lbb.step * 1e3:.2f} | {sim.sizes[-1].sum()} |")
    print(f"\nspeed-up over SSGD: paper {max(PAPER_SSGD) / max(PAPER_TIMES):.2f}x, hetlb plan "
          f"{lbb.speedup:.2f}x, simulated LBB (mean of the last 50 steps) "
          f"{uni.step / float(np.mean(sim.step_time[-50:])):.2f}x; LB-BSP's proportional rule "
          f"{prop.speedup:.2f}x (sizes {prop.sizes.tolist()})")


if __name__ == "__main__":
    main()
