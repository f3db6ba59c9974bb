"""Disturbance recovery, LBB's case study: +50 ms on one worker of a balanced 1:2:3:4 cluster.

What is modelled: the ``lbb-disturbance`` scenario (T = 10 ms + 1 ms/sample at full speed, global
batch 500, +50 ms per step on worker 1 from step 30), simulated for each policy. Printed: the steps
after the disturbance until the straggler effect stays below 0.1 (LBB's paper shows recovery
within a few iterations by rapid-tuning), and the mean step time after recovery against the best
integer split of the disturbed cluster.

    python bench/papers/recovery.py
"""
from __future__ import annotations

import numpy as np

import hetlb
from hetlb.sim import load_scenario, simulate


def settle(se: np.ndarray, start: int, level: float = 0.1) -> int:
    for k in range(start, len(se)):
        if (se[k:] < level).all():
            return k - start
    return -1


def main() -> None:
    sc = load_scenario("lbb-disturbance")
    models = [w.time_model.as_piecewise(sc.global_batch) for w in sc.workers]
    b = np.arange(1, sc.global_batch + 1)
    models[1] = hetlb.PiecewiseModel(b, models[1].time(b) + 0.05)
    best = hetlb.allocate(models, sc.global_batch, lower=np.ones(4, np.int64))
    best_t = max(float(m.time(x)) for m, x in zip(models, best))
    print("Recovery from LBB's +50 ms disturbance (worker 1, step 30), simulated\n")
    print("| policy | SE at step 30 | steps until SE stays < 0.1 | mean step, last 50 / best |")
    print("|---|---:|---:|---:|")
    for name, pol in (("LBB (paper)", hetlb.LBB()), ("LBB(priority=0.1)", hetlb.LBB(priority=0.1)),
                      ("LB-BSP GPU mode", hetlb.LBBSP("gpu")), ("LB-BSP CPU mode, EMA", hetlb.LBBSP("cpu")),
                      ("WLBS", hetlb.WLBS()), ("DBS", hetlb.DBS()), ("uniform", hetlb.Uniform())):
        r = simulate(sc, pol, steps=300)
        s = settle(r.se, 30)
        print(f"| {name} | {r.se[30]:.2f} | {'never' if s < 0 else s} | {np.mean(r.step_time[-50:]) / best_t:.3f} |")
    print(f"\nbest split after the disturbance {best.tolist()}, step {best_t * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
