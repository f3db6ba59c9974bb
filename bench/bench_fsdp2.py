"""FSDP2 on an emulated 1:2:3:4 cluster: the balanced step against equal batches, and a fast
rank with little memory run in micro-steps.

``world`` Gloo ranks on this machine shard a small transformer (4 encoder layers, d=256, about
3.4 M parameters, 8 tokens a sample; ``fully_shard`` per layer and at the root) and emulate speeds 1:2:3:4 with
``T_r(b) = a1 * b / s_r``, held layer by layer (:class:`hetlb.comm.fsdp_clock.LayerClock`), so
the fast ranks wait in FSDP's collectives as they would for slower devices. The ideal step is
``a1 * B / sum(s)``; the real work no split removes (FSDP's all-gathers and reduce-scatters and the
real compute of this machine's shared cores) is measured as the median step without emulation of
the run's final split (the speed-proportional one, in one pass or with the fastest rank in
micro-steps; else equal batches), and reported beside it as "ideal + real".

Part (a): equal batches (Uniform) against LBB, both through the Balancer.
Part (b): the fastest rank's memory holds a quarter of its fair share (``cap = B * s_3 / sum(s)
/ 4`` samples): equal batches (that rank in micro-steps of ``cap``), LBB with ``upper=cap`` on
it, and LBB with ``micro_batch=cap`` on it (``bal.micro_steps``), which takes the fair share,
with the step's reduction in the last micro-step (the default) and after them
(``reduce="after"``: an empty micro-step on every rank reduces).

    python bench/bench_fsdp2.py [--steps N] [--warmup N] [--out FILE] [--only NAME]
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import tempfile
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from report import emit

import hetlb  # before init_process_group in the workers (see docs/restarts.md, Shutdown)

log = logging.getLogger("bench_fsdp2")

SPEEDS = [1.0, 2.0, 3.0, 4.0]


class Net(torch.nn.Module):
    def __init__(self, vocab: int = 1000, d: int = 256, layers: int = 4, classes: int = 10) -> None:
        super().__init__()
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


def run(rank: int, args: argparse.Namespace, job: Dict[str, Any]) -> Dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from hetlb.sim.emulate import Emulator
    torch.manual_seed(0)
    model = Net()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    emu = Emulator.for_rank(rank, SPEEDS, model=hetlb.LinearModel(0.0, args.a1)) \
        if job["emulate"] else None
    kw: Dict[str, Any] = {}
    if job.get("split"):  # (the uppers sum to the global batch: these sizes and no others)
        kw["upper"] = args.split[rank]
    if rank == len(SPEEDS) - 1 and job.get("cap") == "upper":
        kw["upper"] = args.cap
    if rank == len(SPEEDS) - 1 and job.get("cap") in ("micro", "micro-equal"):
        kw["micro_batch"] = args.cap
    policy = hetlb.LBB() if job["policy"] == "LBB" else hetlb.Uniform()
    bal = hetlb.Balancer(model, args.global_batch, policy=policy, emulator=emu, lower=1, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 1000, (args.global_batch, args.seq), generator=g)
    labels = torch.randint(0, 10, (args.global_batch,), generator=g)
    times: List[float] = []
    sizes: List[List[int]] = []
    import time
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        b = bal.batch_sizes
        lo = int(b[:rank].sum())
        x, y = tokens[lo:lo + int(b[rank])], labels[lo:lo + int(b[rank])]
        with bal.step():
            if job.get("cap") in ("micro", "micro-equal"):
                bal.micro_steps(lambda xb, yb: torch.nn.functional.cross_entropy(model(xb), yb), x, y,
                                reduce=job.get("reduce", "last"))
            else:
                bal.backward(torch.nn.functional.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        sizes.append(b.tolist())
    last = bal.history.last(1)[0]
    return {"times": times[args.warmup:], "sizes": sizes[-1], "trace": sizes,
            "computes": [[round(1e3 * float(t)) for t in r.compute] for r in bal.history.last(40)],
            "compute": [round(1e3 * float(t), 1) for t in last.compute]}


def worker(rank: int, world: int, store: str, args: argparse.Namespace, jobs: List[Dict[str, Any]],
           out: str) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    results = []
    try:
        for job in jobs:
            dist.barrier()
            r = run(rank, args, job)
            results.append((job["name"], r))
            if rank == 0:
                print(f"{job['name']:<28} median step {1e3 * statistics.median(r['times']):8.1f} ms"
                      f"  sizes {r['sizes']}  last compute ms {r['compute']}", flush=True)
    finally:
        import gc
        gc.collect()
        dist.destroy_process_group()
    if rank == 0:
        torch.save(results, out)


def launch(args: argparse.Namespace, jobs: List[Dict[str, Any]]) -> List[tuple]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pt")
        mp.spawn(worker, args=(len(SPEEDS), os.path.join(tmp, "store"), args, jobs, out),
                 nprocs=len(SPEEDS), join=True)
        return torch.load(out, weights_only=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--global-batch", type=int, default=20)
    p.add_argument("--seq", type=int, default=8, help="tokens per sample")
    p.add_argument("--a1", type=float, default=0.2, help="emulated seconds per sample at speed 1")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--only", default=None, help="run only the jobs whose name contains this")
    args = p.parse_args()
    fair = args.global_batch * SPEEDS[-1] / sum(SPEEDS)
    args.cap = max(1, int(fair / 4))
    args.split = hetlb.allocate_proportional(SPEEDS, args.global_batch).tolist()
    jobs = [
        {"name": "equal, no emulation (real)", "policy": "Uniform", "emulate": False},
        {"name": "split, no emulation (real)", "policy": "Uniform", "emulate": False,
         "split": True},
        {"name": "split, micro-steps, no emulation (real)", "policy": "Uniform", "emulate": False,
         "split": True, "cap": "micro"},
        {"name": "split, micro-steps, reduce after, no emulation (real)", "policy": "Uniform",
         "emulate": False, "split": True, "cap": "micro", "reduce": "after"},
        {"name": "(a) equal", "policy": "Uniform", "emulate": True},
        {"name": "(a) LBB", "policy": "LBB", "emulate": True},
        {"name": "(b) equal, micro-steps", "policy": "Uniform", "emulate": True, "cap": "micro-equal"},
        {"name": "(b) LBB, upper=cap", "policy": "LBB", "emulate": True, "cap": "upper"},
        {"name": "(b) LBB, micro_batch=cap", "policy": "LBB", "emulate": True, "cap": "micro"},
        {"name": "(b) LBB, micro_batch=cap, reduce after", "policy": "LBB", "emulate": True,
         "cap": "micro", "reduce": "after"},
    ]
    if args.only:
        jobs = [j for j in jobs if args.only in j["name"]]
        for j in launch(args, jobs):
            print(j[0], statistics.median(j[1]["times"]), j[1]["sizes"], j[1]["compute"])
            for b, c in zip(j[1]["trace"][-len(j[1]["computes"]):], j[1]["computes"]):
                print("   ", b, c)
        return
    res = dict(launch(args, jobs))
    ideal = args.a1 * args.global_batch / sum(SPEEDS)
    real = {k: statistics.median(res[k]["times"]) for k in res if k.endswith("(real)")}
    lines = [f"FSDP2, 4 Gloo ranks, speeds {SPEEDS}, global batch {args.global_batch} of "
             f"{args.seq} tokens, "
             f"a1={args.a1} s/sample, cap {args.cap} samples on the fastest rank, "
             f"{args.steps} steps after {args.warmup}; ideal {1e3 * ideal:.1f} ms; real work "
             f"(no emulation): " + ", ".join(f"{k[:-len(', no emulation (real)')]} "
                                             f"{1e3 * v:.1f} ms" for k, v in real.items()),
             "", "| run | median step ms | / ideal | / (ideal + real) | / equal | sizes at the end "
                 "| compute ms at the end |",
             "|---|---:|---:|---:|---:|---|---|"]
    for job in jobs:
        if job["name"] in real:
            continue
        r = res[job["name"]]
        t = statistics.median(r["times"])
        # The real work of the run's split (the proportional one, one pass or micro-steps),
        # else of equal batches.
        at = ("split, micro-steps, reduce after" if job.get("reduce") == "after"
              else "split, micro-steps") if job.get("cap") == "micro" else "split" \
            if r["sizes"] == args.split else "equal"
        extra = real[f"{at}, no emulation (real)"]
        base = statistics.median(res["(a) equal" if job["name"].startswith("(a)")
                                     else "(b) equal, micro-steps"]["times"])
        lines.append(f"| {job['name']} | {1e3 * t:.1f} | {t / ideal:.2f} | {t / (ideal + extra):.2f} "
                     f"({at}) | {t / base:.2f} | {r['sizes']} | {r['compute']} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
