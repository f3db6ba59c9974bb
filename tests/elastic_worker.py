"""A balanced training script as a user would write it, run by tests/test_elastic.py under torchrun.

Float64 linear regression, DDP on Gloo, ``hetlb.Balancer`` with the equal split; a checkpoint
(model, optimizer, the loader's state with the Balancer's) written by ``hetlb.Checkpointer`` (rank
0, atomically) every ``--every`` steps; on start it resumes from the latest one if there is one.

Failures it can stage:
- ``--crashes N``: each of the first N attempts loses one rank (rank ``a % world`` of attempt ``a``)
  one or two steps after its first checkpoint, so every attempt makes progress and the job restarts
  N times in a row;
- ``--hang-rank R --hang-step S``: rank R stops (alive) before the forward of step S of the
  first attempt; with ``--watchdog STALL`` the others' :class:`hetlb.Watchdog` names it and ends
  the attempt, and torchrun restarts the group;
- environment ``HETLB_TEST_LOSE_NODE=S``: the rank launched by this agent kills its agent and exits
  at step S (a node lost: the job comes back on fewer nodes);
- environment ``HETLB_TEST_HOLD=S``: on the first world size it ran on, the job stops at step S
  (after that step's checkpoint) until torchrun restarts it (a node joining: the test starts another
  agent once ``held`` exists in ``--out``).

Every rank logs ``attempt step epoch index`` for each sample it trains (``attempt``: an id rank 0
draws at start, increasing from attempt to attempt); rank 0 logs ``attempt world`` in ``worlds`` and
writes the final parameters.

    torchrun --standalone --nproc-per-node 4 --max-restarts 1 tests/elastic_worker.py --out DIR
"""
import argparse
import datetime
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hetlb


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--init", choices=["hetlb", "torch"], default="hetlb")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--crashes", type=int, default=0)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-step", type=int, default=-1)
    p.add_argument("--watchdog", type=float, default=0.0, help="stall seconds (0: no watchdog)")
    args = p.parse_args()
    init = hetlb.init_process_group if args.init == "hetlb" else dist.init_process_group
    init("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # A membership change restarts the group without counting a restart: rank 0 names the attempt.
    box = [time.time_ns()]
    dist.broadcast_object_list(box, src=0)
    attempt = box[0]
    lose_node = int(os.environ.get("HETLB_TEST_LOSE_NODE", "-1"))
    hold = int(os.environ.get("HETLB_TEST_HOLD", "-1"))
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1).double()
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    dog = hetlb.Watchdog(stall=args.watchdog, interval=args.watchdog / 8) if args.watchdog > 0 else None
    bal = hetlb.Balancer(ddp, 16, policy=hetlb.Uniform(), watchdog=dog)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 4, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64) + 0.1
    data = torch.utils.data.TensorDataset(x, y, torch.arange(96))
    loader = bal.loader(data, seed=3)
    ckpt = hetlb.Checkpointer(os.path.join(args.out, "ckpts"), keep=2)
    step = 0
    state = ckpt.latest()
    if state is not None:
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        step = state["step"]
    first = step
    if rank == 0:
        with open(os.path.join(args.out, "worlds"), "a") as f:
            f.write(f"{attempt} {world}\n")
    held = os.path.join(args.out, "held")
    start_epoch = loader.epoch
    with open(os.path.join(args.out, f"seen.{attempt}.{rank}"), "a") as log:
        for epoch in range(start_epoch, args.epochs):
            loader.set_epoch(epoch)
            for xb, yb, idx in loader:
                if restart == 0 and rank == args.hang_rank and step + 1 == args.hang_step:
                    time.sleep(600)  # alive but stuck in its step (a wedged device, a hung read)
                torch.nn.functional.mse_loss(ddp(xb), yb).backward()
                opt.step()
                opt.zero_grad()
                step += 1
                log.write("".join(f"{attempt} {step} {epoch} {int(i)}\n" for i in idx))
                log.flush()
                if restart < args.crashes and rank == restart % world and step == first + args.every + 1 + restart % 2:
                    with open(os.path.join(args.out, f"crash.{attempt}"), "w") as f:
                        f.write(f"{time.time_ns()}\n")  # for bench/bench_restarts.py's restart latency
                    os._exit(3)
                if step == lose_node:
                    os.kill(os.getppid(), signal.SIGKILL)  # the agent: this node is gone
                    os._exit(3)
                if step % args.every == 0:
                    ckpt.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                               "loader": loader.state_dict(), "step": step}, step=step)
                if step == hold and not os.path.exists(held):
                    dist.barrier()  # the checkpoint is on disk before anyone says so
                    if rank == 0:
                        open(held, "w").close()
                    time.sleep(300)  # until the agent stops this group for the joining node
    bal.close()
    if rank == 0:
        torch.save([p.detach() for p in net.parameters()], os.path.join(args.out, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
