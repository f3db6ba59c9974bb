"""Instructions and last-level cache misses of one training step's phases, counted by callgrind:
hetlb's loader and hooks against a DataLoader with a ``DistributedSampler``, with the caches
cold before every step (a pass over a buffer larger than the simulated last-level cache, as a
step's compute leaves them).

The wall-clock harnesses (``bench_overhead.py``, ``bench_cold.py``) swing by more than what a
change to the step boundary saves (tens of microseconds against +-0.1 ms). Callgrind simulates
the caches, so the same run gives the same counts (+-0.5 % between runs here): a change is
read as misses and instructions it adds or removes per step, side by side with plain DDP.

Each variant runs on one Gloo rank (a tiny DDP model, so the counts are the step's bookkeeping
and the framework around it, not the model's compute) under ``valgrind --tool=callgrind`` with
instrumentation switched on only after the imports and ``--warm`` steps (``callgrind_control``),
and events collected only inside three marker calls of the measured steps: ``next(it)`` inside
``operator.call``, the forward inside ``functools.reduce``, the backward inside
``operator.methodcaller``; the variant ``hetlb+loss`` also logs the loss (``bal.log_loss`` before
the backward) and reads ``bal.finished`` after the optimizer's step, both inside ``map``'s
``map_next`` (the phase "the loss"; reading ``finished`` ends the step, which the other variants
end in the next batch). hetlb runs with a fixed block (``exchange_every``, 64 by default) and
``--warm`` chosen so that no exchange falls among the measured steps (a block's exchange is
counted by the mean, not the median, of the wall-clock harnesses), and with its time-based
probes (CPU load, memory) slowed to never fire (under callgrind a step takes ~100x its time, so
they would fire every step instead of every few).

    python bench/bench_callgrind.py [--steps 60] [--warm 66] [--every 64] [--out FILE]

Needs valgrind (``callgrind_control``, ``callgrind_annotate``); about 90 s a variant.
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

from report import emit

#: The marker functions (CPython's C functions) and the phase each one wraps.
MARKERS = {"_operator_call": "next batch", "functools_reduce": "forward", "methodcaller_call": "backward",
           "map_next": "the loss"}
#: Phases only some variants run (``hetlb+loss``'s logged loss); 0 for the others.
OPTIONAL = {"the loss"}
#: callgrind_annotate's event columns, in order.
EVENTS = ("Ir", "Dr", "Dw", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")


def probe(variant: str, steps: int, warm: int, every: int, evict_mb: int, ready: str,
          no_gc: bool = False) -> None:
    """The measured loop (run under callgrind by :func:`measure`)."""
    import functools
    import operator

    import numpy as np
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    store = tempfile.mktemp(prefix="hetlb-cg-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    import hetlb
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    n = 16 * (steps + warm + 100)  # one epoch covers every step (no epoch-end exchange)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 8), torch.randint(0, 2, (n,)))
    logs = variant == "hetlb+loss"
    finished = operator.attrgetter("finished")
    if variant == "plain":
        it = iter(DataLoader(ds, batch_size=16, sampler=DistributedSampler(ds, seed=0)))
    else:
        bal = hetlb.Balancer(ddp, 16, policy=hetlb.Uniform(), exchange_every=every)
        it = iter(bal.loader(ds, seed=0))
        bal.telemetry.core.cpu_interval = 1e9
        bal.telemetry.probe.interval = 1e9
    buf = np.ones(evict_mb << 17)
    backward = operator.methodcaller("backward")
    open(ready, "w").close()
    while not os.path.exists(ready + ".go"):  # callgrind's instrumentation is being switched on
        time.sleep(0.1)
    for i in range(steps + warm):
        if i == warm and no_gc:
            import gc
            gc.disable()
        buf += 1.0
        if i < warm:
            x, y = next(it)
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            if logs:
                bal.log_loss(loss)
            loss.backward()
        else:
            x, y = operator.call(next, it)
            out = functools.reduce(lambda a, b: ddp(x), [0, 0])
            loss = torch.nn.functional.cross_entropy(out, y)
            if logs:
                list(map(bal.log_loss, [loss]))
            backward(loss)
        opt.step()
        opt.zero_grad()
        if logs:
            list(map(finished, [bal])) if i >= warm else bal.finished
    dist.destroy_process_group()


def measure(variant: str, args: argparse.Namespace, tmp: str) -> Dict[str, Dict[str, float]]:
    """Per-step events of each phase of ``variant`` (``{phase: {event: count per step}}``)."""
    out, ready = os.path.join(tmp, f"{variant}.out"), os.path.join(tmp, f"{variant}.ready")
    cmd = ["valgrind", "--tool=callgrind", "--cache-sim=yes", f"--LL={args.ll_bytes},16,64",
           "--instr-atstart=no", "--collect-atstart=no", f"--callgrind-out-file={out}"]
    cmd += [f"--toggle-collect={m}" for m in MARKERS]
    cmd += [sys.executable, os.path.abspath(__file__), "--probe", variant, "--steps", str(args.steps),
            "--warm", str(args.warm), "--every", str(args.every), "--evict-mb", str(args.evict_mb),
            *(["--no-gc"] if args.no_gc else []),
            "--ready", ready]
    with open(os.path.join(tmp, f"{variant}.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + args.timeout
        while not os.path.exists(ready):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{variant}: the probe did not start; see {log.name}")
            time.sleep(0.5)
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
        open(ready + ".go", "w").close()
        if proc.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
            raise RuntimeError(f"{variant}: the probe failed; see {log.name}")
    text = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--show-percs=no", out],
                          check=True, capture_output=True, text=True).stdout
    return parse(text, args.steps)


def parse(text: str, steps: int) -> Dict[str, Dict[str, float]]:
    """The markers' inclusive events per step from ``callgrind_annotate --inclusive=yes
    --show-percs=no`` output."""
    got: Dict[str, Dict[str, float]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < len(EVENTS) + 1:
            continue
        name = parts[len(EVENTS)].rsplit(":", 1)[-1]
        if name not in MARKERS or MARKERS[name] in got:
            continue
        try:
            values = [0 if v == "." else int(v.replace(",", "")) for v in parts[:len(EVENTS)]]
        except ValueError:
            continue
        got[MARKERS[name]] = {e: v / steps for e, v in zip(EVENTS, values)}
    for phase in OPTIONAL - set(got):
        got[phase] = {e: 0.0 for e in EVENTS}
    missing = set(MARKERS.values()) - set(got)
    if missing:
        raise RuntimeError(f"callgrind_annotate's output has no {sorted(missing)}: did the probe run?")
    return got


def table(results: Dict[str, Dict[str, Dict[str, float]]]) -> List[str]:
    """The markdown table: per phase and variant, instructions and last-level misses per step,
    and hetlb's difference from plain DDP."""
    lines = ["| phase | variant | instructions | LL misses: instruction | data read | data write | "
             "all | all, added to plain |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    plain = results["plain"]
    phases = [p for p in MARKERS.values()
              if p not in OPTIONAL or any(r[p]["Ir"] for r in results.values())] + ["the step"]
    for phase in phases:
        base = step_total(plain) if phase == "the step" else plain[phase]
        base_ll = base["ILmr"] + base["DLmr"] + base["DLmw"]
        for variant, r in results.items():
            e = step_total(r) if phase == "the step" else r[phase]
            ll = e["ILmr"] + e["DLmr"] + e["DLmw"]
            added = "" if variant == "plain" else f"{ll - base_ll:+.0f} ({e['Ir'] - base['Ir']:+,.0f} instr.)"
            lines.append(f"| {phase} | {variant} | {e['Ir']:,.0f} | {e['ILmr']:.0f} | {e['DLmr']:.0f} | "
                         f"{e['DLmw']:.0f} | {ll:.0f} | {added} |")
    return lines


def step_total(result: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    """A variant's events per step summed over its phases."""
    return {e: sum(phase[e] for phase in result.values()) for e in EVENTS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warm", type=int, default=66,
                   help="steps before the measured ones (with --every 64 the exchange at step 64 "
                        "is among them, the next at 128 is not)")
    p.add_argument("--every", type=int, default=64, help="hetlb's exchange_every")
    p.add_argument("--evict-mb", type=int, default=32, help="buffer passed over before every step")
    p.add_argument("--ll-bytes", type=int, default=8 << 20, help="simulated last-level cache")
    p.add_argument("--variants", nargs="+", default=["plain", "hetlb"], choices=["plain", "hetlb", "hetlb+loss"])
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per variant")
    p.add_argument("--no-gc", action="store_true",
                   help="disable Python's collector during the measured steps: its collections "
                        "fall inside or outside the measured phases by allocation counts (one "
                        "generation-1 collection is ~2 M instructions, ~35 k a step of 60), so two "
                        "trees that allocate a few objects more or less a step compare without it")
    p.add_argument("--out")
    p.add_argument("--probe", help=argparse.SUPPRESS)
    p.add_argument("--ready", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.probe:
        probe(args.probe, args.steps, args.warm, args.every, args.evict_mb, args.ready, args.no_gc)
        return
    if "plain" not in args.variants:
        p.error("--variants must include plain (the baseline)")
    with tempfile.TemporaryDirectory(prefix="hetlb-cg-") as tmp:
        results = {v: measure(v, args, tmp) for v in args.variants}
    lines = [f"### Per step, counted by callgrind ({datetime.date.today()}): {args.steps} steps after "
             f"{args.warm}, caches cold ({args.evict_mb} MB pass, {args.ll_bytes >> 20} MB LL simulated), "
             f"hetlb exchange_every={args.every}" + (", collector off" if args.no_gc else ""), "",
             *table(results)]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
