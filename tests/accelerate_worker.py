"""One worker of an Accelerate loop (DDP, Gloo, CPU) balanced by hetlb.integrations.accelerate,
launched by torchrun (tests/test_accelerate.py). Writes, on rank 0: the samples each rank trained
at each step, the Balancer's sizes and steps, and the largest difference between the checked
steps' gradients and one process's over the step's samples.

    accelerate_worker.py --out FILE --dir DIR [--epochs E] [--stop-at STEP] [--resume]
                         [--accumulate K] [--check STEP,STEP]
"""
import argparse
import contextlib
import json

import torch
import torch.distributed as dist
from accelerate import Accelerator

import hetlb
from hetlb.core.models import LinearModel
from hetlb.integrations.accelerate import prepare
from hetlb.sim.emulate import Emulator
from distributed import union_gradient_errors

N, GLOBAL_BATCH = 50, 12  # 5 steps an epoch, the last of 2 samples


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--stop-at", type=int, default=-1)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--check", default="")
    a = p.parse_args()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=a.accumulate)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g)
    data = [{"x": x[i], "y": y[i], "idx": torch.tensor(i)} for i in range(N)]
    # rank 1 emulated twice as fast: LBB moves samples to it, so the sizes change between steps
    emulator = Emulator(LinearModel(2e-3, 1e-3), speed=1.0 + accelerator.process_index)
    model = net()
    model, opt, loader = prepare(accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 data, global_batch=GLOBAL_BATCH, policy=hetlb.LBB(), seed=2,
                                 balancer_kwargs=dict(lower=1, emulator=emulator))
    bal = loader.balancer
    if a.resume:
        accelerator.load_state(a.dir)
    trained, kept = [], {}
    check = {int(c) for c in a.check.split(",") if c}
    for epoch in range(loader.epoch, a.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            step = bal.steps
            trained.append((step, batch["idx"].tolist()))
            with bal.step() if a.accumulate > 1 else contextlib.nullcontext():
                loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
                accelerator.backward(loss)
            if not bal.synced:
                continue
            if step in check:
                kept[step] = [(q.detach().clone(), q.grad.detach().clone())
                              for q in model.parameters()]
            opt.step()
            opt.zero_grad()
            if step + 1 == a.stop_at:
                accelerator.save_state(a.dir)
                break
        else:
            continue
        break
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, trained)
    steps = bal.steps
    if accelerator.is_main_process:
        errors = union_gradient_errors(
            net, kept, everyone, lambda m, i: torch.nn.functional.mse_loss(m(x[i]), y[i]))
        with open(a.out, "w") as f:
            json.dump({"trained": everyone, "steps": steps, "errors": errors,
                       "sizes": [r.batch.tolist() for r in bal.history]}, f)
    import gc
    del model, opt, loader, bal
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
