"""Balanced data-parallel training on an emulated heterogeneous cluster.

Each rank of a real DDP job (Gloo, CPU) behaves like a worker of speed ``s_r`` (default 1:2:3:4)
with a linear time model ``T(b) = (a0 + a1 * b) / s_r`` (:class:`hetlb.sim.emulate.Emulator`). The
same model is trained twice from the same initial weights: first with equal batches
(:class:`hetlb.Uniform`, i.e. plain synchronous SGD), then with a balancing policy (default
:class:`hetlb.LBB`). Rank 0 prints the median step times and writes a plot of step time and
batch sizes per step.

    torchrun --standalone --nproc-per-node 4 examples/train_balanced.py [--steps 60] [--policy LBB]
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hetlb
from hetlb.sim.emulate import Emulator

log = logging.getLogger("train_balanced")

POLICIES = {"LBB": hetlb.LBB, "LBBSP": lambda: hetlb.LBBSP("gpu"), "LBBSP-cpu": lambda: hetlb.LBBSP("cpu"),
            "WLBS": hetlb.WLBS, "DBS": hetlb.DBS, "Uniform": hetlb.Uniform}


def dataset(n: int, seed: int = 0) -> torch.utils.data.Dataset:
    """A synthetic 10-class problem: labels from a fixed random linear teacher."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    y = (x @ torch.randn(32, 10, generator=g)).argmax(1)
    return torch.utils.data.TensorDataset(x, y)


def train(policy_name: str, args: argparse.Namespace, rank: int, world: int) -> Dict[str, List[Any]]:
    torch.manual_seed(0)  # the same initial weights for every run and every rank
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    ddp = DDP(model)
    speeds = args.speeds[:world] + [1.0] * max(0, world - len(args.speeds))
    emu = Emulator.for_rank(rank, speeds, model=hetlb.LinearModel(args.a0, args.a1))
    bal = hetlb.Balancer(ddp, args.global_batch, policy=POLICIES[policy_name](), emulator=emu)
    loader = bal.loader(dataset(args.global_batch * args.steps), seed=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    out: Dict[str, List[Any]] = {"time": [], "sizes": [], "loss": []}  # loss: (step, global loss)
    bar = None
    if rank == 0:
        try:
            from tqdm import tqdm
            bar = tqdm(total=args.steps, desc=policy_name, leave=False)
        except ImportError:
            pass
    t_prev = time.perf_counter()
    for x, y in loader:  # each batch handed out is one step of the Balancer
        loss = torch.nn.functional.cross_entropy(ddp(x), y)  # mean over this rank's samples
        bal.log_loss(loss)  # rides in the step's telemetry
        loss.backward()
        opt.step()
        opt.zero_grad()
        now = time.perf_counter()
        out["time"].append(now - t_prev)
        t_prev = now
        out["sizes"].append(bal.batch_sizes.tolist())
        # The global batch's mean loss (the mean of the ranks' means is not: their batches
        # differ), for the newest step that arrived: this one, or with Uniform's blocks of steps
        # the last step of the latest block.
        done = bal.finished
        if done is not None and (not out["loss"] or out["loss"][-1][0] != done.step):
            out["loss"].append((done.step, done.loss))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return out


def plot(runs: Dict[str, Dict[str, List[Any]]], ideal: float, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in runs.items():
        ax1.plot([1e3 * t for t in r["time"]], label=name)
    ax1.axhline(1e3 * ideal, color="k", ls="--", lw=1, label="ideal (compute only)")
    ax1.set_xlabel("step")
    ax1.set_ylabel("step time (ms)")
    ax1.legend()
    balanced = [n for n in runs if n != "Uniform"][-1]
    sizes = list(zip(*runs[balanced]["sizes"]))
    for r, s in enumerate(sizes):
        ax2.plot(s, label=f"rank {r}")
    ax2.set_xlabel("step")
    ax2.set_ylabel(f"batch size ({balanced})")
    ax2.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--policy", choices=sorted(POLICIES), default="LBB")
    p.add_argument("--speeds", type=float, nargs="+", default=[1.0, 2.0, 3.0, 4.0])
    p.add_argument("--a0", type=float, default=0.010, help="emulated start-up seconds per step")
    p.add_argument("--a1", type=float, default=0.002, help="emulated seconds per sample")
    p.add_argument("--plot", default="out/train_balanced.png", help="plot path ('' for none)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        runs = {name: train(name, args, rank, world) for name in ("Uniform", args.policy)}
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return
    speeds = args.speeds[:world] + [1.0] * max(0, world - len(args.speeds))
    ideal = (args.a1 * args.global_batch + world * args.a0) / sum(speeds)
    half = args.steps // 2  # the second half: after the policy's warm-up
    med = {n: statistics.median(r["time"][half:]) for n, r in runs.items()}
    log.info("%d ranks, speeds %s, global batch %d, T(b) = %g ms + %g ms/sample", world, speeds,
             args.global_batch, 1e3 * args.a0, 1e3 * args.a1)
    for n, r in runs.items():
        (first, a), (last, b) = r["loss"][0], r["loss"][-1]
        log.info("%-8s median step %7.2f ms (compute-only ideal %.2f ms), final sizes %s, global "
                 "loss %.3f (step %d) -> %.3f (step %d)", n, 1e3 * med[n], 1e3 * ideal,
                 r["sizes"][-1], a, first, b, last)
    log.info("speed-up of %s over Uniform: %.2fx", args.policy, med["Uniform"] / med[args.policy])
    if args.plot:
        plot(runs, ideal, args.plot)
        log.info("plot written to %s", args.plot)


if __name__ == "__main__":
    main()
