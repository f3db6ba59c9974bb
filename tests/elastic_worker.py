"""A balanced training script as a user would write it, run by tests/test_elastic.py under torchrun.

Float64 linear regression, DDP on Gloo, ``hetlb.Balancer`` with the equal split; a checkpoint
(model, optimizer, the loader's state with the Balancer's) written by ``hetlb.Checkpointer`` (rank
0, atomically) every ``--every`` steps; on start it resumes from the latest one if there is one. Rank ``--kill-rank``
exits at step ``--kill-step`` of the first attempt (a crash: torchrun restarts the group). Every
rank logs ``attempt step epoch index`` for each sample it trains; rank 0 writes the final
parameters.

    torchrun --standalone --nproc-per-node 4 --max-restarts 1 tests/elastic_worker.py --out DIR
"""
import argparse
import datetime
import os

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
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    args = p.parse_args()
    init = hetlb.init_process_group if args.init == "hetlb" else dist.init_process_group
    init("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1).double()
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    bal = hetlb.Balancer(ddp, 16, policy=hetlb.Uniform())
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
    start_epoch = loader.epoch
    with open(os.path.join(args.out, f"seen.{attempt}.{rank}"), "a") as log:
        for epoch in range(start_epoch, args.epochs):
            loader.set_epoch(epoch)
            for xb, yb, idx in loader:
                torch.nn.functional.mse_loss(ddp(xb), yb).backward()
                opt.step()
                opt.zero_grad()
                step += 1
                log.write("".join(f"{attempt} {step} {epoch} {int(i)}\n" for i in idx))
                log.flush()
                if attempt == 0 and rank == args.kill_rank and step == args.kill_step:
                    os._exit(3)
                if step % args.every == 0:
                    ckpt.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                               "loader": loader.state_dict(), "step": step}, step=step)
    if rank == 0:
        torch.save([p.detach() for p in net.parameters()], os.path.join(args.out, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
