"""Per-rank recomputation (``hetlb.Recompute``) side by side with plain micro-steps, real compute.

One process (this machine's CPU) trains a small transformer (4 encoder layers, d=256, ``--seq``
tokens a sample) under a memory budget: ``hetlb.profile(memory_limit=budget)`` measures the
largest plain micro-batch and, inside ``rc.on()``, the largest recomputing one (the layers'
activations recomputed in the backward). For each share ``b`` the step runs three ways, rounds
alternating, medians: plain micro-steps (``micro_batch=`` the plain limit), recomputation forced
(micro-steps of the recomputing limit), and hetlb's choice (``recompute=rc``: the way the two
profiles predict is faster). Reported: each median, recomputing / plain, the way chosen and
whether it was the faster one measured.

    python bench/bench_recompute.py [--seq 64] [--budget-mb 48] [--shares 8,16,32,64] [--rounds 7]
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time
from typing import Any, Dict, List

import torch

from report import emit

import hetlb


class Net(torch.nn.Module):
    def __init__(self, vocab: int = 1000, d: int = 256, layers: int = 4, classes: int = 10) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
            for _ in range(layers))
        self.head = torch.nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(dim=1))


def _data(b: int, seq: int):
    g = torch.Generator().manual_seed(b)
    return torch.randint(0, 1000, (b, seq), generator=g), torch.randint(0, 10, (b,), generator=g)


def _profile(model: Net, seq: int, budget: float, sizes: List[int]) -> hetlb.Profile:
    def step(b: int) -> None:
        x, y = _data(b, seq)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        model.zero_grad(set_to_none=True)
    return hetlb.profile(step, batch_sizes=sizes, memory_limit=budget, repeats=5, trim=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--budget-mb", type=float, default=48.0)
    ap.add_argument("--shares", default="8,16,32,64")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    shares = [int(s) for s in args.shares.split(",")]
    budget = args.budget_mb * 2**20
    sizes = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]

    probe = Net()
    rc_probe = hetlb.Recompute(list(probe.layers))
    plain = _profile(probe, args.seq, budget, sizes)
    with rc_probe.on():
        again = _profile(probe, args.seq, budget, sizes)
    m, mr = plain.limit, again.limit

    times: Dict[tuple, List[float]] = {}
    chosen: Dict[int, bool] = {}
    for b in shares:
        bals = {}
        for name in ("plain", "recompute", "choice"):
            model = Net()  # (the same weights each; one Balancer a model)
            rc = hetlb.Recompute(list(model.layers), profile=again)
            kw = {"plain": {"micro_batch": m}, "recompute": {"micro_batch": mr},
                  "choice": {"micro_batch": m, "profile": plain, "recompute": rc}}[name]
            bals[name] = (model, rc, hetlb.Balancer(model, b, **kw))
        chosen[b] = bals["choice"][2].context.recomputes(0, b)
        x, y = _data(b, args.seq)
        for r in range(args.rounds + 1):
            for name, (model, rc, bal) in bals.items():
                t = time.perf_counter()
                with bal.step(), (rc.on() if name == "recompute" else contextlib.nullcontext()):
                    bal.micro_steps(lambda xb, yb: torch.nn.functional.cross_entropy(model(xb), yb),
                                    x, y)
                dt = time.perf_counter() - t
                model.zero_grad(set_to_none=True)
                if r:  # (the first round warms up)
                    times.setdefault((name, b), []).append(dt)
    lines = [f"plain limit {m} samples, recomputing limit {mr} (budget {args.budget_mb:g} MiB, "
             f"seq {args.seq}); medians of {args.rounds} rounds, ms", "",
             "| share | plain (k) | recomputing (k) | recomputing / plain | hetlb's choice | "
             "choice ms | faster way chosen |", "|---:|---:|---:|---:|---|---:|---|"]
    for b in shares:
        tp, tr, tc = (statistics.median(times[(n, b)]) * 1e3 for n in ("plain", "recompute", "choice"))
        kp, kr = -(-b // m), -(-b // mr)
        way = "recompute" if chosen[b] else "plain"
        right = (tr < tp) == chosen[b]
        lines.append(f"| {b} | {tp:.1f} ({kp}) | {tr:.1f} ({kr}) | {tr / tp:.2f} | {way} | "
                     f"{tc:.1f} | {'yes' if right else 'no'} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
