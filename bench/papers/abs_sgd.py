"""ABS-SGD's three clusters with the synchronous policies, simulated.

What is modelled: four workers whose iteration times are 1:2:3:4 (ABS-SGD Sec. 7.2: the real
iteration prolonged by 0/100/200/300 %), with dynamic heterogeneity as a random 0-50 % of the
iteration added every iteration (Sec. 7.3, 7.4). The per-step work is an emulated line
``10 ms + 2 ms/sample`` at full speed, global batch 128. The paper reports time to 80 % accuracy
for ABS-SGD (delayed synchronisation, not in hetlb yet), BSP-SGD and DBS-SGD; hetlb's
synchronous policies keep BSP's statistical efficiency (the same global batch and gradient), so
their time-to-accuracy ratio over BSP is their step-time ratio, which is what is printed here,
next to the paper's BSP/DBS and ABS/BSP ratios.

    python bench/papers/abs_sgd.py [--steps 300]
"""
from __future__ import annotations

import argparse
import copy

import numpy as np

from hetlb.sim import load_scenario, simulate

PAPER = {"static": (636, 577, 450), "dynamic": (123, 120, 105), "both": (798, 795, 535)}  # BSP, DBS, ABS seconds


def clusters():
    static = load_scenario("abs-sgd-1234")
    both = load_scenario("abs-sgd-dynamic")
    dynamic = copy.deepcopy(both)
    for w in dynamic.workers:
        w.speed = 1.0
    dynamic.name = "abs-sgd-dynamic-only"
    return {"static": static, "dynamic": dynamic, "both": both}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    print("ABS-SGD Table 1's clusters: speed-up over BSP (paper: time to 80 % accuracy; hetlb: "
          "simulated step time, same statistical efficiency as BSP)\n")
    print("| cluster | paper DBS-SGD | paper ABS-SGD | hetlb DBS | hetlb LBB | hetlb LB-BSP | hetlb WLBS |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for key, sc in clusters().items():
        bsp, dbs, abs_ = PAPER[key]
        t = {}
        for pol in ("uniform", "dbs", "lbb", "lbbsp", "wlbs"):
            res = simulate(sc, pol, steps=args.steps)
            t[pol] = float(np.mean(res.step_time))
        print(f"| {key} | {bsp / dbs:.2f}x | {bsp / abs_:.2f}x | {t['uniform'] / t['dbs']:.2f}x | "
              f"{t['uniform'] / t['lbb']:.2f}x | {t['uniform'] / t['lbbsp']:.2f}x | {t['uniform'] / t['wlbs']:.2f}x |")
    print(f"\n(mean over {args.steps} simulated steps including each policy's start from the equal split)")


if __name__ == "__main__":
    main()
