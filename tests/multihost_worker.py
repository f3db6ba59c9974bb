"""An ordinary balanced training script, run by tests/test_multihost.py on several "hosts" (network
namespaces, tests/multihost.py) under a multi-node torchrun.

Float64 MLP (``--hidden`` wide: the default has 300k parameters, 2.4 MB of gradient per step, so
the all-reduce matters once a link is capped), DDP on Gloo, ``hetlb.Balancer`` with ``--policy``,
``bal.loader`` over a synthetic ``TensorDataset`` of exactly ``--steps`` global batches (one epoch),
plain SGD. Every rank writes ``rank<r>.json`` to ``--out``: per step the indices it trained, the
world's batch sizes and compute times as hetlb's telemetry recorded them (``bal.history``), and its
own times (``wall``: the step from the batch handed out to the optimizer's step; ``backward_end``:
to the end of ``backward()``, which returns when DDP's all-reduces are done; ``comm``: the part of
that after the rank's compute had ended, i.e. the exposed communication, waiting included). Rank 0
also writes the final parameters (``final.pt``) and hetlb's run log (``runlog/run.jsonl``).

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \
        tests/multihost_worker.py --out DIR
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import hetlb  # before init_process_group (see docs/restarts.md)
import torch.distributed as dist

IN, OUT = 64, 8


def make_model(hidden: int) -> torch.nn.Module:
    """The model every run and the single-process reference start from (seeded)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, OUT)).double()


def make_data(n: int) -> torch.utils.data.TensorDataset:
    """``n`` samples of a fixed regression task (seeded), with each sample's index."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, IN, generator=g, dtype=torch.float64)
    w = torch.randn(IN, OUT, generator=g, dtype=torch.float64) / IN ** 0.5
    y = torch.sin(x @ w) + 0.1 * torch.randn(n, OUT, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, y, torch.arange(n))


def make_policy(name: str):
    """The policy of ``--policy``: LB-BSP (GPU mode, the paper's Algorithm 2; or CPU mode with
    an EMA predictor), LBB, or the equal split."""
    return {"lbbsp": lambda: hetlb.LBBSP("gpu"),
            "lbbsp-cpu": lambda: hetlb.LBBSP("cpu", predictor=hetlb.EMA()),
            "lbb": lambda: hetlb.LBB(), "uniform": lambda: hetlb.Uniform()}[name]()


LR = 0.05


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--policy", default="lbbsp", choices=["lbbsp", "lbbsp-cpu", "lbb", "uniform"])
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    args = p.parse_args()
    torch.set_num_threads(1)
    hetlb.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    net = make_model(args.hidden)
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    bal = hetlb.Balancer(ddp, args.global_batch, policy=make_policy(args.policy),
                         log_dir=os.path.join(args.out, "runlog"), tensorboard=False)
    loader = bal.loader(make_data(args.steps * args.global_batch), seed=7)
    own = []
    loader.set_epoch(0)
    t_prev = None
    for xb, yb, idx in loader:
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(ddp(xb), yb)
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        own.append({"idx": idx.tolist(), "backward_end": t1 - t0, "wall": t2 - t0,
                    "since_prev": None if t_prev is None else t0 - t_prev})
        t_prev = t0
    hist = {rec.step: rec for rec in bal.history}
    steps = []
    for s, o in enumerate(own):
        rec = hist.get(s)
        compute = rec.compute.tolist() if rec is not None else None
        mine = compute[rank] if compute is not None else float("nan")
        steps.append({"step": s, "batch": rec.batch.tolist() if rec is not None else None,
                      "compute": compute, "comm": max(0.0, o["backward_end"] - mine), **o})
    info = {"rank": rank, "world": world, "group_rank": int(os.environ.get("GROUP_RANK", -1)),
            "local_rank": int(os.environ.get("LOCAL_RANK", -1)), "host": os.environ.get("MH_HOST"),
            "hostname": socket.gethostname(), "policy": args.policy, "global_batch": args.global_batch,
            "hidden": args.hidden, "params": sum(q.numel() for q in net.parameters()),
            "transport": bal.transport, "steps": steps}
    with open(os.path.join(args.out, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(info, f)
    os.replace(os.path.join(args.out, f"rank{rank}.json.tmp"), os.path.join(args.out, f"rank{rank}.json"))
    if rank == 0:
        torch.save([q.detach() for q in net.parameters()], os.path.join(args.out, "final.pt"))
    bal.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()


# ---------------------------------------------------------------------------------------------
# Reading a run back (tests/test_multihost.py, bench/bench_multihost.py)
# ---------------------------------------------------------------------------------------------

def load_run(out: str) -> dict:
    """The ``rank<r>.json`` files of a run as arrays: ``batch``, ``compute`` ([steps, world], the
    telemetry every rank holds, read from rank 0's copy), ``wall``, ``comm`` ([steps, world], each
    rank's own), ``idx`` (per step, per rank, the indices trained), ``host`` (each rank's host)."""
    import numpy as np
    ranks = []
    r = 0
    while os.path.exists(os.path.join(out, f"rank{r}.json")):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
        r += 1
    if not ranks:
        raise FileNotFoundError(f"no rank0.json in {out}")
    world = ranks[0]["world"]
    if len(ranks) != world:
        raise ValueError(f"{out}: {len(ranks)} of {world} ranks wrote their results")
    steps = ranks[0]["steps"]
    for d in ranks[1:]:  # the table is the same on every rank (the all-reduce delivers it)
        assert [s["batch"] for s in d["steps"]] == [s["batch"] for s in steps]
        assert [s["compute"] for s in d["steps"]] == [s["compute"] for s in steps]
    return {"world": world, "host": [int(d["host"]) for d in ranks], "info": ranks[0],
            "batch": np.array([s["batch"] for s in steps], dtype=np.int64),
            "compute": np.array([s["compute"] for s in steps], dtype=np.float64),
            "wall": np.array([[s["wall"] for s in d["steps"]] for d in ranks], dtype=np.float64).T,
            "comm": np.array([[s["comm"] for s in d["steps"]] for d in ranks], dtype=np.float64).T,
            "idx": [[d["steps"][t]["idx"] for d in ranks] for t in range(len(steps))]}


def summarize(run: dict, warmup: int = 5) -> dict:
    """Per-step figures after ``warmup`` steps, and their medians.

    * ``step``: the step's time, the slowest rank's wall time (a synchronous step ends for all
      ranks together, give or take the optimizer);
    * ``compute``: the slowest rank's compute as hetlb's telemetry recorded it (what a balanced
      split could shorten);
    * ``comm``: ``step - compute``, the part of the step in which no rank was still computing:
      the all-reduce's exposed time;
    * ``share``: ``comm / step``;
    * ``host_batch``: samples per host per step, ``[steps, hosts]``;
    * ``moved``: samples that changed rank from one step to the next, ``sum |b_t - b_(t-1)| / 2``
      (per step, from step ``warmup`` on: the first compared pair is (warmup - 1, warmup));
    * ``host_moved``: the same between hosts;
    * ``host_cost``: per host, the mean over its ranks of compute time per sample, ``[steps,
      hosts]`` (what a policy reads as the host's speed; equal hosts unless the link leaks in).
    """
    import numpy as np
    b, c, w = run["batch"], run["compute"], run["wall"]
    hosts = sorted(set(run["host"]))
    hb = np.stack([b[:, [r for r in range(run["world"]) if run["host"][r] == h]].sum(1) for h in hosts], 1)
    step = w.max(1)
    compute = c.max(1)
    comm = np.maximum(step - compute, 0.0)
    moved = np.abs(np.diff(b, axis=0)).sum(1) / 2
    host_moved = np.abs(np.diff(hb, axis=0)).sum(1) / 2
    per_sample = c / np.maximum(b, 1)
    cost = np.stack([per_sample[:, [r for r in range(run["world"]) if run["host"][r] == h]].mean(1)
                     for h in hosts], 1)
    s = slice(warmup, None)
    out = {"step": step[s], "compute": compute[s], "comm": comm[s], "share": (comm / step)[s],
           "host_batch": hb[s], "moved": moved[warmup - 1:], "host_moved": host_moved[warmup - 1:],
           "host_cost": cost[s], "hosts": hosts}
    out["median"] = {k: float(np.median(out[k])) for k in ("step", "compute", "comm", "share", "moved",
                                                           "host_moved")}
    out["median"]["host_batch"] = np.median(hb[s], axis=0).tolist()
    out["median"]["host_cost"] = np.median(cost[s], axis=0).tolist()
    return out
