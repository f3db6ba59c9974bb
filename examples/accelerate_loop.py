"""Accelerate with hetlb: a training loop whose batches a ``hetlb.Balancer`` sizes per rank, on an
emulated heterogeneous cluster, checkpointed with ``accelerator.save_state`` and resumable.

Rank r behaves like a worker of speed ``r + 1`` (an emulated time model); LBB moves samples to
the fast ranks. Each step trains ``--global-batch`` samples weighted to their mean (with
``--accumulate K``, windows of K such steps). ``--stop-at N`` saves the state after step N and
stops; ``--resume`` loads it and continues where the run stopped. Rank 0 prints each rank's
mean batch size.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_loop.py --dir ckpt [--stop-at 10]
    torchrun --standalone --nproc-per-node 2 examples/accelerate_loop.py --dir ckpt --resume

Needs ``pip install hetlb[hf]``; see docs/accelerate.md.
"""
import argparse

import torch
from accelerate import Accelerator

import hetlb
from hetlb.integrations.accelerate import prepare
from hetlb.sim.emulate import Emulator


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="accelerate's state folder")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--stop-at", type=int, default=-1, help="save the state after this step and stop")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    data = [{"x": x[i], "y": x[i].sum(0, keepdim=True)} for i in range(512)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    emulator = Emulator(hetlb.LinearModel(2e-2, 2e-3), speed=1.0 + accelerator.process_index)
    model, optimizer, loader = prepare(accelerator, model, optimizer, data,
                                       global_batch=args.global_batch, policy=hetlb.LBB(), seed=0,
                                       balancer_kwargs={"emulator": emulator})
    bal = loader.balancer
    if args.resume:
        accelerator.load_state(args.dir)  # the model, the optimizer and the loader's position
    loss = torch.zeros(())
    for epoch in range(loader.epoch, args.epochs):
        loader.set_epoch(epoch)
        for batch in loader:  # on accelerator.device
            with bal.step():  # (a micro-step of a window with --accumulate)
                loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
                accelerator.backward(loss)
            if not bal.synced:
                continue
            optimizer.step()
            optimizer.zero_grad()
            if bal.steps == args.stop_at:
                accelerator.save_state(args.dir)
                break
        else:
            continue
        break
    if accelerator.is_main_process:
        sizes = torch.tensor([r.batch.tolist() for r in bal.history], dtype=torch.float64)
        print(f"at step {bal.steps} (epoch {loader.epoch}); mean batch per rank (speeds 1:2:...), "
              f"first and last 4 steps: {sizes[:4].mean(0).tolist()} -> "
              f"{sizes[-4:].mean(0).tolist()}; last loss {loss.item():.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
