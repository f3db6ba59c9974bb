"""PyTorch Lightning with hetlb: per-rank batch sizes on an emulated heterogeneous cluster.

Rank r of the DDP job behaves like a worker of speed ``r + 1`` (an emulated time model: on one
machine every rank is as fast as the others). LBB measures each rank and moves samples to the
fast ones; every step still trains ``--global-batch`` samples, weighted to their mean, and every
epoch each sample once. Rank 0 prints each rank's mean batch size per epoch.

    torchrun --standalone --nproc-per-node 2 examples/lightning_fit.py [--epochs 3] [--accumulate 2]

Needs ``pip install hetlb[lightning]``; see docs/lightning.md.
"""
import argparse
import os

import pytorch_lightning as pl
import torch

import hetlb
from hetlb.integrations.lightning import Balance
from hetlb.sim.emulate import Emulator


class Regression(pl.LightningModule):
    def __init__(self, balance: Balance, dataset: torch.utils.data.Dataset) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        self.balance, self.dataset = balance, dataset

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)  # the mean over this rank's batch
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return self.balance.loader(self.dataset, seed=0)  # made after the Balancer (on_fit_start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--accumulate", type=int, default=1, help="Lightning's accumulate_grad_batches")
    args = p.parse_args()
    rank = int(os.environ.get("RANK", 0))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    dataset = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * torch.randn(512, 1, generator=g))

    # Rank r: speed r + 1. Tens of milliseconds a step, well above Lightning's own overhead per
    # batch, which a busy machine stretches on both ranks alike.
    emulator = Emulator(hetlb.LinearModel(2e-2, 2e-3), speed=1.0 + rank)
    balance = Balance(args.global_batch, hetlb.LBB(), emulator=emulator)
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                         strategy="ddp", max_epochs=args.epochs,
                         accumulate_grad_batches=args.accumulate, callbacks=[balance],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Regression(balance, dataset))

    bal = balance.balancer
    if trainer.is_global_zero:
        sizes = torch.tensor([r.batch.tolist() for r in bal.history], dtype=torch.float64)
        print(f"{bal.steps} steps; mean batch per rank (speeds 1:2:...), first and last 4 steps: "
              f"{sizes[:4].mean(0).tolist()} -> {sizes[-4:].mean(0).tolist()}; "
              f"final loss {float(trainer.callback_metrics['loss']):.4f}")


if __name__ == "__main__":
    main()
