"""One worker of a Lightning Trainer run (DDP, Gloo, CPU) balanced by hetlb.integrations.lightning,
launched by torchrun (tests/test_lightning.py). Writes, on rank 0, what every rank trained: per
epoch the samples of each batch, and the Balancer's steps and position.

    lightning_worker.py --out FILE --epochs E [--stop-at STEP --ckpt FILE] [--resume FILE]
"""
import argparse
import json

import pytorch_lightning as pl
import torch
import torch.distributed as dist

import hetlb
from hetlb.integrations.lightning import Balance

N, GLOBAL_BATCH = 64, 12  # 6 steps an epoch, the last of 4 samples


class Seen(pl.Callback):
    """Every batch this rank trained, and a checkpoint at ``stop_at`` (mid-epoch)."""

    def __init__(self, stop_at, ckpt):
        self.stop_at, self.ckpt, self.batches = stop_at, ckpt, []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.batches.append((trainer.current_epoch, batch[2].tolist()))
        if trainer.global_step == self.stop_at:
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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--stop-at", type=int, default=-1)
    p.add_argument("--ckpt")
    p.add_argument("--resume")
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    dataset = torch.utils.data.TensorDataset(torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g),
                                             torch.arange(N))
    # rank 1 emulated twice as fast: LBB moves samples to it, so the sizes change between steps
    from hetlb.core.models import LinearModel
    from hetlb.sim.emulate import Emulator
    rank = int(__import__("os").environ["RANK"])
    balance = Balance(GLOBAL_BATCH, hetlb.LBB(), lower=1,
                      emulator=Emulator(LinearModel(2e-3, 1e-3), speed=1.0 + rank))
    seen = Seen(args.stop_at, args.ckpt)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs,
                         callbacks=[balance, seen], enable_progress_bar=False, logger=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0)
    trainer.fit(Model(balance, dataset), ckpt_path=args.resume)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen.batches)
    if dist.get_rank() == 0:
        bal = balance.balancer
        with open(args.out, "w") as f:
            json.dump({"batches": everyone, "steps": bal.steps,
                       "position": bal.state_dict()["position"],
                       "sizes": [r.batch.tolist() for r in bal.history]}, f)
    # (the DDP model's reducer before the group it holds: torn down after it at exit, a worker
    # may abort, "terminate called without an active exception")
    import gc
    del trainer, balance, seen
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
