"""Per-rank recomputation (``hetlb.Recompute``) side by side with plain micro-steps, real compute.

One process (this machine's CPU) trains a small transformer (4 encoder layers, d=256, ``--seq``
tokens a sample) under a memory budget: ``hetlb.profile(memory_limit=budget)`` measures the
largest plain micro-batch and, inside ``rc.on()``, the largest recomputing one (the layers'
activations recomputed in the backward). For each share ``b`` the step runs three ways, rounds
rotating, medians: plain micro-steps (``micro_batch=`` the plain limit), recomputation forced
(micro-steps of the recomputing limit), and hetlb's choice (``recompute=rc``: the way the two
profiles predict is faster). Reported: each median, recomputing / plain, the two ways' predicted
times (what the rule compares), the way chosen and whether it was the faster one measured.

    python bench/bench_recompute.py [--seq 64] [--budget-mb 48] [--shares 8,16,32,64] [--rounds 7]
        [--device cpu|cuda]

On CUDA the budget is of ``torch.cuda.memory_allocated`` (tools/gpu_check.sh runs it there).
Under torchrun with ``--fsdp`` every rank shards the model with FSDP2 (each layer and the root),
the profiles run on all ranks together (``hetlb.profile(model=)``), and every rank takes the
share (Uniform); rank 0 reports:

    torchrun --nproc-per-node 2 bench/bench_recompute.py --fsdp --width 64 --seq 16 --limits 4,16
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import statistics
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from bench_fsdp2 import Net  # (the same small transformer)
from report import emit

import hetlb
from hetlb.core.models import micro_step_model


DEVICE = torch.device("cpu")


def _data(b: int, seq: int):
    g = torch.Generator().manual_seed(b)
    return (torch.randint(0, 1000, (b, seq), generator=g).to(DEVICE),
            torch.randint(0, 10, (b,), generator=g).to(DEVICE))


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def _build(d: int, fsdp: bool) -> Net:
    torch.manual_seed(0)  # (the same weights in every build)
    model = Net(d=d).to(DEVICE)
    if fsdp:
        from torch.distributed.fsdp import fully_shard
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model


def _profile(model: Net, seq: int, budget: Optional[float], sizes: List[int],
             fsdp: bool) -> hetlb.Profile:
    def step(b: int) -> None:
        x, y = _data(b, seq)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        model.zero_grad(set_to_none=True)
    return hetlb.profile(step, batch_sizes=sizes, memory_limit=budget, repeats=5, trim=1,
                         device=DEVICE, model=model if fsdp else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--budget-mb", type=float, default=48.0)
    ap.add_argument("--shares", default="8,16,32,64")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--width", type=int, default=256, help="the model's d")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 on torchrun's ranks")
    ap.add_argument("--limits", default=None,
                    help="'m,mr': the plain and recomputing micro-batches instead of the budget's "
                         "(the profiles then run up to each)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cpu":
        torch.set_num_threads(1)
    rank, world = 0, 1
    if args.fsdp:
        hetlb.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        rank, world = dist.get_rank(), dist.get_world_size()
    shares = [int(s) for s in args.shares.split(",")]
    sizes = sorted({int(1.5 ** i) for i in range(18)})  # 1 ... 985: each profile stops at its budget
    budget: Optional[float] = args.budget_mb * 2**20
    up = [max(sizes)] * 2
    if args.limits:
        up, budget = [int(v) for v in args.limits.split(",")], None

    probe = _build(args.width, args.fsdp)
    rc_probe = hetlb.Recompute(list(probe.layers))
    plain = _profile(probe, args.seq, budget, sorted({s for s in sizes if s < up[0]} | {up[0]}),
                     args.fsdp)
    with rc_probe.on():
        again = _profile(probe, args.seq, budget, sorted({s for s in sizes if s < up[1]} | {up[1]}),
                         args.fsdp)
    m, mr = plain.limit, again.limit

    times: Dict[tuple, List[float]] = {}
    chosen: Dict[int, bool] = {}
    for b in shares:
        bals = {}
        for name in ("plain", "recompute", "choice"):
            model = _build(args.width, args.fsdp)  # (the same weights each; one Balancer a model)
            rc = hetlb.Recompute(list(model.layers), profile=again)
            kw = {"plain": {"micro_batch": m}, "recompute": {"micro_batch": mr},
                  "choice": {"micro_batch": m, "profile": plain, "recompute": rc}}[name]
            bals[name] = (model, rc, hetlb.Balancer(model, b * world, policy=hetlb.Uniform(), **kw))
        chosen[b] = bals["choice"][2].context.recomputes(rank, b)
        x, y = _data(b, args.seq)
        names = list(bals)
        for r in range(args.rounds + 1):
            for name in names[r % 3:] + names[:r % 3]:  # (each way first in a third of the rounds)
                model, rc, bal = bals[name]
                _sync()
                t = time.perf_counter()
                with bal.step(), (rc.on() if name == "recompute" else contextlib.nullcontext()):
                    bal.micro_steps(lambda xb, yb: torch.nn.functional.cross_entropy(model(xb), yb),
                                    x, y)
                _sync()
                dt = time.perf_counter() - t
                model.zero_grad(set_to_none=True)
                if r:  # (the first round warms up)
                    times.setdefault((name, b), []).append(dt)
    if args.fsdp:
        dist.destroy_process_group()
        if rank:
            return
    where = f"budget {args.budget_mb:g} MiB" if budget is not None else "limits given"
    lines = [f"plain limit {m} samples, recomputing limit {mr} ({where}, d {args.width}, seq "
             f"{args.seq}, {DEVICE}{f', FSDP2 on {world} ranks' if args.fsdp else ''}); medians "
             f"of {args.rounds} rounds, ms", "",
             "| share | plain (k) | recomputing (k) | recomputing / plain | predicted plain, "
             "recomputing | hetlb's choice | choice ms | faster way chosen |",
             "|---:|---:|---:|---:|---:|---|---:|---|"]
    for b in shares:
        tp, tr, tc = (statistics.median(times[(n, b)]) * 1e3 for n in ("plain", "recompute", "choice"))
        kp, kr = -(-b // m), -(-b // mr)
        # (the time models the rule compares: k passes of each profile's fitted model)
        pp, pr = (float(micro_step_model(p.fit("cubic"), lim, b * world).time(b)) * 1e3
                  for p, lim in ((plain, m), (again, mr)))
        way = "recompute" if chosen[b] else "plain"
        right = (tr < tp) == chosen[b]
        lines.append(f"| {b} | {tp:.1f} ({kp}) | {tr:.1f} ({kr}) | {tr / tp:.2f} | {pp:.1f}, "
                     f"{pr:.1f} | {way} | {tc:.1f} | {'yes' if right else 'no'} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
