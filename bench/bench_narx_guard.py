"""LB-BSP's CPU mode after its NARX warm-up: how soon the sizes follow a slowdown with the paper's
predictor (``NARX()``: EMA for the first 500 steps, the network after) and with the two opt-in
safeguards that hand a rank back to the EMA where the network does worse: the guard between fits
(``guard=5``), the fit-time held-out check (``fit_check=True``), and both; the EMA predictor for
reference.

The simulator drives the policy objects training uses: 3 workers 1:2:3 at ``4 ms + 0.4 ms x b``,
2 % noise, global batch 60, worker 2 three times slower from step 600 (after the first fit at
500; refits every 100 steps). Prints the sizes at the steps around the change, then the mean
simulated step time and straggler effect over the steady steps after the first fit (500-599),
after the slowdown until the refit (600-699) and after it (700-799), with the step time's ratio
to the paper's (bench/RESULTS.md, "NARX between fits" and "the paper's NARX by default").

Then the same predictors where the network has something to learn: rank 0 of a shared CPU
cluster (the trace of ``tests/test_policies_lbbsp.py``: competing load changing as a step function
every 30-80 steps, visible in the CPU and memory columns, and single-step slowdowns that are not,
1000 steps), warm-up 200, a fit every 100 steps: the RMSE of the speed each predicts for the next
step (the EMA's where a NARX predicts none, as LB-BSP does) over the steps after the warm-up, and
the share of them on which the network's own prediction was used.

    python bench/bench_narx_guard.py [--trace-steps 1000] [--out F]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import emit  # noqa: E402

STEPS = (599, 601, 605, 610, 620, 650, 699, 701, 750, 799)
SPANS = ((500, 600), (600, 700), (700, 800))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace-steps", type=int, default=1000, help="steps of the shared-cluster trace")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import hetlb
    from hetlb.sim import simulate
    from hetlb.sim.scenario import Scenario
    sc = Scenario.from_dict({"global_batch": 60, "steps": 800, "workers": [
        {"model": [0.004, 0.0004], "speed": s, "noise": 0.02} for s in (1, 2, 3)],
        "events": [{"kind": "disturb", "worker": 2, "start": 600, "factor": 3.0}]})
    runs = [("EMA()", hetlb.EMA()),
            ("NARX()` (paper", hetlb.NARX(background=False)),
            ("NARX(guard=5)", hetlb.NARX(background=False, guard=5)),
            ("NARX(fit_check=True)", hetlb.NARX(background=False, fit_check=True)),
            ("NARX(guard=5, fit_check=True)", hetlb.NARX(background=False, guard=5, fit_check=True))]
    sizes_lines = ["| predictor | " + " | ".join(str(k) for k in STEPS) + " |",
                   "|---|" + "---|" * len(STEPS)]
    time_lines = ["| predictor | " + " | ".join(f"step ms {a}-{b - 1}" for a, b in SPANS) + " | "
                  + " | ".join(f"SE {a}-{b - 1}" for a, b in SPANS) + " | "
                  + " | ".join(f"step {a}-{b - 1} / paper's" for a, b in SPANS[1:]) + " |",
                  "|---|" + "---:|" * (3 * len(SPANS) - 1)]
    results = []
    for name, pred in runs:
        res = simulate(sc, hetlb.LBBSP("cpu", predictor=pred), 800)
        label = f"`{name})" if name.endswith("(paper") else f"`{name}`"
        results.append((label, np.asarray(res.sizes), [float(res.step_time[a:b].mean()) for a, b in SPANS],
                        [float(res.se[a:b].mean()) for a, b in SPANS]))
    paper = results[1][2]
    for label, sizes, step, se in results:
        sizes_lines.append(f"| {label} | " + " | ".join(" ".join(map(str, sizes[k])) for k in STEPS) + " |")
        time_lines.append(f"| {label} | " + " | ".join(f"{t * 1e3:.1f}" for t in step) + " | "
                          + " | ".join(f"{v:.3f}" for v in se) + " | "
                          + " | ".join(f"{t / p:.2f}" for t, p in zip(step[1:], paper[1:])) + " |")
    rmse_lines = ["| predictor | RMSE, samples/s | / paper's | network's own prediction used |",
                  "|---|---:|---:|---:|"]
    from hetlb.sim.scenario import shared_cpu_trace
    trace = shared_cpu_trace(args.trace_steps)
    errs = [(label, *_trace_rmse(pred, trace)) for (label, *_), (_, pred) in zip(results, runs)]
    for label, rmse, used in errs:
        rmse_lines.append(f"| {label} | {rmse:.2f} | {rmse / errs[1][1]:.3f} | "
                          + ("-" if used is None else f"{used:.0%}") + " |")
    emit(sizes_lines + [""] + time_lines + [""] + rmse_lines, args.out)


def _trace_rmse(template, trace: tuple, skip: int = 200) -> tuple:
    """RMSE of rank 0's predicted next-step speed after ``skip`` steps, and the share of those
    steps on which a NARX's own prediction was used (None for the EMA)."""
    import hetlb
    recs, v = trace
    narx = None
    if isinstance(template, hetlb.NARX):
        cfg = {**template.config(), "warmup": skip, "retrain_every": 100}
        narx = hetlb.NARX.from_config(cfg).for_rank(0)
    ema = hetlb.EMA(0.2)
    err, own = [], []
    for t, rec in enumerate(recs):
        if skip <= t < len(recs) - 1:
            n = narx.predict(float(rec.memory[0])) if narx is not None else float("nan")
            own.append(bool(np.isfinite(n)))
            err.append((n if np.isfinite(n) else ema.predict()[0]) - v[t + 1, 0])
        if narx is not None:
            narx.observe(rec, 0)
        ema.update(rec)
    return float(np.sqrt(np.mean(np.square(err)))), (float(np.mean(own)) if narx is not None else None)


if __name__ == "__main__":
    main()
