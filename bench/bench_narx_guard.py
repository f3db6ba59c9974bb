"""LB-BSP's CPU mode after its NARX warm-up: how soon the sizes follow a slowdown, with the NARX
guard (default), without it (``guard=0``: the fit-time rule alone) and with the EMA predictor.

The simulator drives the policy objects training uses: 3 workers 1:2:3 at ``4 ms + 0.4 ms x b``,
2 % noise, global batch 60, worker 2 three times slower from step 600 (after the first fit at
500). Prints the sizes at the steps around the change (bench/RESULTS.md, "NARX between fits").

    python bench/bench_narx_guard.py [--out F]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import emit  # noqa: E402

STEPS = (599, 601, 605, 610, 620, 650, 699, 701)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import hetlb
    from hetlb.sim import simulate
    from hetlb.sim.scenario import Scenario
    sc = Scenario.from_dict({"global_batch": 60, "steps": 710, "workers": [
        {"model": [0.004, 0.0004], "speed": s, "noise": 0.02} for s in (1, 2, 3)],
        "events": [{"kind": "disturb", "worker": 2, "start": 600, "factor": 3.0}]})
    lines = ["| predictor | " + " | ".join(str(k) for k in STEPS) + " |",
             "|---|" + "---|" * len(STEPS)]
    for name, pred in (("EMA()", hetlb.EMA()), ("NARX(guard=0)", hetlb.NARX(background=False, guard=0)),
                       ("NARX() (guard 5)", hetlb.NARX(background=False))):
        sizes = np.asarray(simulate(sc, hetlb.LBBSP("cpu", predictor=pred), 710).sizes)
        lines.append(f"| `{name}` | " + " | ".join(" ".join(map(str, sizes[k])) for k in STEPS) + " |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
