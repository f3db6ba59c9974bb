"""What the Balancer's search for models trained unattached costs: the steps that search
(step 0, the step after a DDP model is made, steps 1, 2, 4, 8, ...) against the others.
``--wrapper fsdp2`` shards every model with ``fully_shard`` instead (searches in steps 0, 1, 2,
4, 8, ... only, each finding the process's ``fully_shard`` models by the collector's traversal).

Two Gloo ranks (one thread each) train bench_overhead.py's ``mlp`` model with
``Balancer(Uniform)`` through its loader for ``--steps`` steps; rank 0 times every step (from
the loader's batch to the optimizer's step) and notes whether it searched. Reported: the median
step of each kind, what a search adds, how many steps searched, and their share of the run's
time. ``--models K`` builds K more DDP models beside the balanced one (trained on batches of
their own, as an evaluation or second model would be), which the search hooks; ``--made S``
builds one more DDP model at step S (the step after searches for it). The process's number of
objects tracked by the garbage collector (what a search traverses) is reported too.

    python bench/bench_checks.py [--steps 600] [--models 0] [--made 300] [--wrapper ddp|fsdp2] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import tempfile
import time
from typing import List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench_overhead import make_model
from report import emit


def worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    import hetlb
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    if args.wrapper == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))

        def wrap(m: torch.nn.Module) -> torch.nn.Module:
            return fully_shard(m, mesh=mesh)
    else:
        wrap = DDP
    ddp = wrap(make_model("mlp"))
    others = [wrap(torch.nn.Linear(16, 16)) for _ in range(args.models)]
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    n = args.global_batch * (args.steps + 1)
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 512, generator=g), torch.randint(0, 10, (n,), generator=g))
    bal = hetlb.Balancer(ddp, args.global_batch, policy=hetlb.Uniform())
    it = iter(bal.loader(ds, seed=1))
    times: List[tuple] = []
    extra = []
    for step in range(args.steps):
        if step == args.made:
            extra.append(wrap(torch.nn.Linear(16, 16)))  # made here: DDP's next step searches
        t = time.perf_counter()
        x, y = next(it)
        searched = bal.hooks.checking
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        bal.backward(loss) if args.wrapper == "fsdp2" else loss.backward()  # (FSDP2's weight: on the loss)
        for m in others:  # trained on batches of their own
            m(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        times.append((time.perf_counter() - t, searched))
    bal.steps  # (the last step's end: its search, if any, is gathered there)
    if rank == 0:
        torch.save({"times": times, "objects": len(gc.get_objects())}, out)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--models", type=int, default=0, help="other DDP models alive (not balanced)")
    p.add_argument("--made", type=int, default=300, help="step at which one more DDP model is made")
    p.add_argument("--wrapper", choices=["ddp", "fsdp2"], default="ddp")
    p.add_argument("--out")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.pt")
        mp.spawn(worker, args=(2, os.path.join(tmp, "store"), args, out), nprocs=2, join=True)
        res = torch.load(out)
    # A search starts when the batch of its step is handed out (inside that step's `next`: the
    # collector's traversal) and ends at the next batch (the next row's `next`: the gather of
    # what the ranks found). Its cost: those two rows over two ordinary steps.
    times = [t for t, _ in res["times"]]
    flagged = [i for i, (_, searched) in enumerate(res["times"]) if searched and i + 1 < len(times)]
    near = set(flagged) | {i + 1 for i in flagged}
    ordinary = statistics.median(t for i, t in enumerate(times) if i not in near and i > 0)
    added = [times[i] + times[i + 1] - 2 * ordinary for i in flagged]
    total = sum(times)
    name = "DDP" if args.wrapper == "ddp" else "FSDP2"
    lines = [f"### Searches for unattached {name} models ({datetime.date.today()}): 2 Gloo ranks, mlp, "
             f"global batch {args.global_batch}, {args.steps} steps, {args.models} other {name} models, "
             f"one made at step {args.made}; {res['objects']:,} objects tracked by the collector",
             "", "| searching step | added to its two steps (ms) |", "|---:|---:|",
             *[f"| {i} | {1e3 * a:.2f} |" for i, a in zip(flagged, added)], "",
             f"An ordinary step: {1e3 * ordinary:.2f} ms (median). A search adds "
             f"{1e3 * statistics.median(added):.2f} ms (median; step 0's includes the first "
             f"step's own start-up); the {len(flagged)} searches add "
             f"{100 * sum(added) / total:.2f} % to the run's {total:.1f} s."]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
