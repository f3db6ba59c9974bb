"""One worker of a Lightning Trainer run (DDP, Gloo, CPU) balanced by hetlb.integrations.lightning,
launched by torchrun (tests/test_lightning.py). Writes, on rank 0, what every rank trained: per
epoch the samples of each batch, the Balancer's steps and position, and for the steps named by
--check, the largest difference between the step's gradient and one process's gradient over the
step's samples.

    lightning_worker.py --out FILE --epochs E [--stop-at STEP --ckpt FILE] [--resume FILE]
                        [--samples N] [--accumulate K] [--check S,S] [--then --out FILE ...]

Each ``--then`` starts another run in the same processes, with a new Trainer, model and callbacks.
"""
import argparse
import gc
import json
import sys

import pytorch_lightning as pl
import torch
import torch.distributed as dist

import hetlb
from distributed import each_run, union_gradient_errors
from hetlb.integrations.lightning import Balance

N, GLOBAL_BATCH = 64, 12  # 6 steps an epoch, the last of 4 samples


class Seen(pl.Callback):
    """Every batch this rank trained (with its optimizer step), the parameters and gradients of
    the steps in ``check``, and a checkpoint at ``stop_at`` (mid-epoch)."""

    def __init__(self, stop_at, ckpt, check=()):
        self.stop_at, self.ckpt, self.check = stop_at, ckpt, set(check)
        self.batches, self.steps, self.kept = [], [], {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.steps.append((trainer.global_step, batch[2].tolist()))

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if trainer.global_step in self.check:
            self.kept[trainer.global_step] = [(p.detach().clone(), p.grad.detach().clone())
                                              for p in module.parameters()]

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.batches.append((trainer.current_epoch, batch[2].tolist()))
        if trainer.global_step == self.stop_at and not trainer.should_stop:
            trainer.save_checkpoint(self.ckpt)
            trainer.should_stop = True


class Model(pl.LightningModule):
    def __init__(self, balance, dataset):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.balance, self.dataset = balance, dataset

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return self.balance.loader(self.dataset, seed=1)


def run(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--stop-at", type=int, default=-1)
    p.add_argument("--ckpt")
    p.add_argument("--resume")
    p.add_argument("--samples", type=int, default=N)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--check", default="")
    args = p.parse_args(argv)
    n = args.samples
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)
    dataset = torch.utils.data.TensorDataset(x, y, torch.arange(n))
    # rank 1 emulated twice as fast: LBB moves samples to it, so the sizes change between steps
    from hetlb.core.models import LinearModel
    from hetlb.sim.emulate import Emulator
    rank = int(__import__("os").environ["RANK"])
    balance = Balance(GLOBAL_BATCH, hetlb.LBB(), lower=1,
                      emulator=Emulator(LinearModel(2e-3, 1e-3), speed=1.0 + rank))
    seen = Seen(args.stop_at, args.ckpt, [int(s) for s in args.check.split(",") if s])
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs,
                         accumulate_grad_batches=args.accumulate,
                         callbacks=[balance, seen], enable_progress_bar=False, logger=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0)
    trainer.fit(Model(balance, dataset), ckpt_path=args.resume)
    everyone, steps = [None] * dist.get_world_size(), [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen.batches)
    dist.all_gather_object(steps, seen.steps)
    if dist.get_rank() == 0:
        bal = balance.balancer
        torch.manual_seed(0)
        errors = union_gradient_errors(
            lambda: torch.nn.Linear(4, 1), seen.kept, steps,
            lambda m, i: torch.nn.functional.mse_loss(m(x[i]), y[i]))
        with open(args.out, "w") as f:
            json.dump({"batches": everyone, "steps": bal.steps, "errors": errors,
                       "global_step": trainer.global_step,
                       "position": bal.state_dict()["position"],
                       "sizes": [r.batch.tolist() for r in bal.history]}, f)
    del trainer, balance, seen
    gc.collect()  # (the next run's hetlb finds no DDP model of this one)


def main():
    for argv in each_run(sys.argv[1:]):
        run(argv)
    # (the DDP models' reducers before the group they hold: torn down after it at exit, a worker
    # may abort, "terminate called without an active exception")
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
