"""hetlb's per-step bookkeeping with warm caches and after the caches were evicted, as they are in
training after every step's compute.

In a training loop the Balancer's per-step work (the table's checks, the record, the policy, the
next step's weight and row) runs right after the forward/backward/optimizer passes, which leave
the caches full of activations and gradients: every line of interpreter, NumPy and hetlb code it
touches is a miss. Instruction counts (``bench_overhead.py --instructions``) cannot see that, and
a micro-benchmark in a loop of its own runs warm. This one runs a one-rank Balancer (Gloo, a tiny
DDP model so the step itself costs next to nothing) and, before every step, either nothing
(warm) or a pass over a buffer larger than the last-level cache (cold); it reports the median of
``Balancer.last_overhead`` (hetlb's own time in the step) and of one ``weights_for`` call,
side by side with one plain-Python scalar division as the floor of any Python line.

    python bench/bench_cold.py [--steps 400] [--evict-mb 64] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from typing import Callable, List

import numpy as np
import torch
import torch.distributed as dist

from report import emit


def timed(fn: Callable[[], object], evict: Callable[[], object], steps: int) -> float:
    """Median seconds of ``fn()``, each call after ``evict()``."""
    out = []
    for _ in range(steps):
        evict()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def balancer_overhead(evict: Callable[[], object], steps: int) -> float:
    """Median ``Balancer.last_overhead`` over ``steps`` steps of a one-rank Balancer on a tiny
    model, ``evict()`` before every step's bookkeeping."""
    import hetlb
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    bal = hetlb.Balancer(ddp, 16, policy=hetlb.Uniform())
    n = 16 * (steps + 10)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 8), torch.randint(0, 2, (n,)))
    it = iter(bal.loader(ds, seed=0))
    spent: List[float] = []
    for i in range(steps + 10):
        x, y = next(it)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        evict()  # what a real step's compute leaves behind; the next next() does the bookkeeping
        if i >= 10:
            spent.append(bal.last_overhead)
    return statistics.median(spent[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--evict-mb", type=float, default=64.0, help="buffer passed over to evict the caches")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=60))
        try:
            from hetlb.aggregate import weights_for
            big = np.ones(int(args.evict_mb * 2 ** 20 / 8))
            cold, warm = (lambda: big.sum()), (lambda: None)
            b, d = np.array([64, 64], dtype=np.int64), np.array([64.0, 64.0])
            rows = []
            for name, fn in (("Balancer.last_overhead (one step's bookkeeping)", None),
                             ("weights_for('samples', ...)", lambda: weights_for("samples", b, d)),
                             ("float(b[0]) / float(b.sum()) (a line of Python)", lambda: float(b[0]) / float(b.sum()))):
                if fn is None:
                    w, c = balancer_overhead(warm, args.steps), balancer_overhead(cold, args.steps)
                else:
                    w, c = timed(fn, warm, args.steps), timed(fn, cold, args.steps)
                rows.append(f"| {name} | {w * 1e6:.1f} | {c * 1e6:.1f} | {c / w:.1f} |")
        finally:
            dist.destroy_process_group()
    emit([f"### Per-step bookkeeping, warm and cold (one rank, {args.steps} steps, caches evicted with a "
          f"{args.evict_mb:g} MB pass)", "",
          "Median microseconds.", "",
          "| what | warm | cold | cold / warm |", "|---|---:|---:|---:|"] + rows, args.out)


if __name__ == "__main__":
    main()
