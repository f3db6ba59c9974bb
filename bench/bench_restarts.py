"""Restarts in a row under torchrun: no hang, no lost or repeated sample, the uninterrupted model.

``tests/elastic_worker.py`` (float64 linear regression, 4 Gloo workers, ``hetlb.Balancer`` with
the equal split, ``hetlb.Checkpointer`` every 3 steps, ``hetlb.init_process_group``) runs once
uninterrupted and once with ``--crashes N``: each of the first N attempts loses one worker (rank
``a % 4`` of attempt ``a``) one or two steps after its first checkpoint, so torchrun
(``--max-restarts N``) restarts the group N times in a row and every attempt makes progress.
Reported: wall time of both runs, the restart latency (from the crash to rank 0 of the next
attempt having its process group; median and maximum), whether every epoch's committed samples are
each index exactly once, and the largest difference between the two final models.

    python bench/bench_restarts.py [--crashes 20] [--out F]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from report import emit  # noqa: E402
from test_elastic import committed, torchrun  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--crashes", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import torch
    epochs = (3 * args.crashes + 17) // 6 + 1  # 6 steps an epoch, about 3 steps of progress an attempt
    with tempfile.TemporaryDirectory() as tmp:
        ref, crash = os.path.join(tmp, "ref"), os.path.join(tmp, "crash")
        os.makedirs(ref)
        os.makedirs(crash)
        t0 = time.perf_counter()
        r = torchrun(ref, "--epochs", epochs)
        t_ref = time.perf_counter() - t0
        assert r.returncode == 0, r.stderr[-3000:]
        t0 = time.perf_counter()
        r = torchrun(crash, "--epochs", epochs, "--crashes", args.crashes, restarts=args.crashes,
                     timeout=60 * (args.crashes + 2))
        t_crash = time.perf_counter() - t0
        assert r.returncode == 0, r.stderr[-3000:]
        seen, restarts = committed(crash, epochs)
        exact = all(s == list(range(96)) for s in seen)
        ids = sorted(int(n.split(".")[1]) for n in os.listdir(crash) if n.startswith("seen.") and n.endswith(".0"))
        latency = []
        for a, b in zip(ids, ids[1:]):
            path = os.path.join(crash, f"crash.{a}")
            with open(path) as f:
                latency.append((b - int(f.read())) / 1e9)
        want = torch.load(os.path.join(ref, "final.pt"))
        got = torch.load(os.path.join(crash, "final.pt"))
        diff = max(float((a - b).abs().max()) for a, b in zip(got, want))
    emit(["| crashes | restarts | epochs | uninterrupted s | with crashes s | restart latency median s | max s "
          "| exactly once | max model diff |",
          "|---:|---:|---:|---:|---:|---:|---:|:---:|---:|",
          f"| {args.crashes} | {restarts} | {epochs} | {t_ref:.1f} | {t_crash:.1f} | {np.median(latency):.2f} "
          f"| {max(latency):.2f} | {'yes' if exact else 'NO'} | {diff:.1e} |"], args.out)


if __name__ == "__main__":
    main()
