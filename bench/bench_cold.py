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
side by side with one plain-Python scalar division as the floor of any Python line, and the
loop's whole ``next(it)`` (the step boundary) for hetlb's loader against a DataLoader with a
``DistributedSampler`` on the same model and data. ``--parts`` also times each part of the
bookkeeping (wrappers around the Balancer's, the telemetry's and the plan board's methods).

``--exchange-every K`` adds the same rows for ``Balancer(exchange_every=K)`` (the telemetry of K
steps in one exchange; the per-step figures are the median over every step, exchanges included).

    python bench/bench_cold.py [--steps 400] [--evict-mb 64] [--parts] [--exchange-every K] [--out FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import tempfile
import time
from typing import Callable, Dict, Iterator, List, Tuple

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


def _loop(evict: Callable[[], object], steps: int, balanced: bool,
          every: int = 1) -> Tuple[List[float], List[float]]:
    """``steps`` training steps (after 10 not counted) of a tiny DDP model on one rank, with
    ``evict()`` before each step's ``next(it)`` (where hetlb's bookkeeping of the step before runs,
    as after a real step's compute): the seconds of each ``next(it)`` and, with ``balanced``
    (hetlb's loader instead of a DataLoader with a ``DistributedSampler``), each
    ``Balancer.last_overhead`` (``every``: its ``exchange_every``)."""
    import hetlb
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    n = 16 * (steps + 10)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 8), torch.randint(0, 2, (n,)))
    bal = hetlb.Balancer(ddp, 16, policy=hetlb.Uniform(), exchange_every=every) if balanced else None
    it = iter(bal.loader(ds, seed=0) if balanced else
              DataLoader(ds, batch_size=16, sampler=DistributedSampler(ds, seed=0)))
    took: List[float] = []
    spent: List[float] = []
    for i in range(steps + 10):
        evict()
        t = time.perf_counter()
        x, y = next(it)
        if i >= 10:
            took.append(time.perf_counter() - t)
            if bal is not None:
                spent.append(bal.last_overhead)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return took, spent


def balancer_overhead(evict: Callable[[], object], steps: int, every: int = 1) -> float:
    """Median ``Balancer.last_overhead`` (see :func:`_loop`)."""
    return statistics.median(_loop(evict, steps, True, every)[1])


def next_batch(evict: Callable[[], object], steps: int, balanced: bool, every: int = 1) -> float:
    """Median seconds of the loop's ``next(it)`` (the step boundary: for hetlb the previous step's
    bookkeeping, the plan's draw and the batch; for plain DDP the DataLoader's batch from a
    ``DistributedSampler``; see :func:`_loop`)."""
    return statistics.median(_loop(evict, steps, balanced, every)[0])


def _part_targets() -> List[tuple]:
    """(owner, method, label) of the step's bookkeeping timed by ``--parts``, in the order a step
    runs them (labels indented under the part they run in)."""
    import hetlb
    from hetlb.comm.hook import StepTelemetry
    from hetlb.core.telemetry import History, StepRecord
    from hetlb.data import board, handout
    from hetlb.policies.loop import DecisionLoop
    from hetlb.train import steps
    return [
        (steps.StepDriver, "_finish", "StepDriver._finish (the step's end)"),
        (StepTelemetry, "end_kept", "  StepTelemetry.end_kept (a step inside a block)"),
        (StepTelemetry, "table", "  StepTelemetry.table (take the table)"),
        (StepTelemetry, "close", "  StepTelemetry.close"),
        (steps, "verify_table", "  verify_table"),
        (board.PlanBoard, "complete", "  PlanBoard.complete"),
        (steps.StepDriver, "_record", "  StepDriver._record"),
        (StepRecord, "__init__", "    StepRecord(...)"),
        (History, "append", "    History.append"),
        (DecisionLoop, "advance", "    DecisionLoop.advance"),
        (hetlb.Uniform, "decide", "    Uniform.decide"),
        (board.PlanBoard, "post", "    PlanBoard.post"),
        (board.PlanBoard, "draw", "PlanBoard.draw (the loader draws the next step)"),
        (handout.Board, "hand", "Board.hand"),
        (steps.StepDriver, "_begin", "StepDriver._begin (the next step's start)"),
        (StepTelemetry, "start", "  StepTelemetry.start"),
    ]


@contextlib.contextmanager
def method_timers(targets: List[tuple]) -> Iterator[Dict[str, List[float]]]:
    """Wrap each ``(owner, method, label)`` of ``targets`` with a timer (a few hundred
    nanoseconds each) while the block runs; yields ``{label: [seconds of each call]}``."""
    times: Dict[str, List[float]] = {}
    saved = []
    for owner, name, label in targets:
        fn = owner.__dict__.get(name)
        if fn is None:  # (another version of hetlb: a part it does not have)
            continue
        saved.append((owner, name, fn))

        def timed_call(*a, _fn=fn, _label=label, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                times.setdefault(_label, []).append(time.perf_counter() - t)
        setattr(owner, name, timed_call)
    try:
        yield times
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def parts(evict: Callable[[], object], steps: int) -> Dict[str, float]:
    """Median seconds of each part of the step's bookkeeping (``_part_targets``), timed by
    wrappers around the methods (:func:`method_timers`)."""
    with method_timers(_part_targets()) as times:
        balancer_overhead(evict, steps)
    return {label: statistics.median(v[10:]) for label, v in times.items() if len(v) > 10}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--evict-mb", type=float, default=64.0, help="buffer passed over to evict the caches")
    p.add_argument("--parts", action="store_true",
                   help="also time each part of the step's bookkeeping (wrappers around its methods)")
    p.add_argument("--exchange-every", type=int, default=None, metavar="K",
                   help="also the rows of Balancer(exchange_every=K)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=60))
        try:
            from hetlb.comm.weights import weights_for
            big = np.ones(int(args.evict_mb * 2 ** 20 / 8))
            cold, warm = (lambda: big.sum()), (lambda: None)
            b, d = np.array([64, 64], dtype=np.int64), np.array([64.0, 64.0])
            rows = []
            k = args.exchange_every
            blocks = [] if k is None else [
                (f"next(it): hetlb loader, exchange_every={k}", "hetlb", k),
                (f"Balancer.last_overhead, exchange_every={k}", None, k)]
            for name, fn, *every in (("next(it): DataLoader + DistributedSampler (plain DDP)", "plain"),
                                     ("next(it): hetlb loader (previous step's end, this step's start)", "hetlb"),
                                     ("Balancer.last_overhead (one step's bookkeeping)", None),
                                     *blocks,
                             ("weights_for('samples', ...)", lambda: weights_for("samples", b, d)),
                             ("float(b[0]) / float(b.sum()) (a line of Python)", lambda: float(b[0]) / float(b.sum()))):
                if fn is None:
                    w, c = (balancer_overhead(e, args.steps, *every) for e in (warm, cold))
                elif isinstance(fn, str):
                    w, c = (next_batch(e, args.steps, fn == "hetlb", *every) for e in (warm, cold))
                else:
                    w, c = timed(fn, warm, args.steps), timed(fn, cold, args.steps)
                rows.append(f"| {name} | {w * 1e6:.1f} | {c * 1e6:.1f} | {c / w:.1f} |")
            if args.parts:
                w, c = parts(warm, args.steps), parts(cold, args.steps)
                labels = [label for _, _, label in _part_targets() if label in w and label in c]
                part_rows = [f"| {lab.replace('  ', '&nbsp;&nbsp;')} | {w[lab] * 1e6:.1f} | "
                             f"{c[lab] * 1e6:.1f} | {c[lab] / w[lab]:.1f} |" for lab in labels]
        finally:
            dist.destroy_process_group()
    lines = [f"### Per-step bookkeeping, warm and cold (one rank, {args.steps} steps, caches evicted "
             f"with a {args.evict_mb:g} MB pass)", "",
             "Median microseconds.", "",
             "| what | warm | cold | cold / warm |", "|---|---:|---:|---:|"] + rows
    if args.parts:
        lines += ["", f"### The step's bookkeeping by part, warm and cold (one rank, {args.steps} steps)", "",
                  "Median microseconds of each call, timed by wrappers around the methods; indented "
                  "parts run inside the one above.", "",
                  "| part | warm | cold | cold / warm |", "|---|---:|---:|---:|"] + part_rows
    emit(lines, args.out)


if __name__ == "__main__":
    main()
