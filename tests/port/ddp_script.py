"""A DDP training script in the shape of pytorch/examples' ddp-tutorial-series
(multigpu_torchrun.py), written here for CPU and Gloo: the "before" of tests/port/ddp_script_hetlb.py.

    torchrun --standalone --nproc-per-node 2 ddp_script.py TOTAL_EPOCHS SAVE_EVERY [--batch_size 32]
"""
import os

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import init_process_group, destroy_process_group


class RandomRegression(Dataset):
    def __init__(self, size, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, model, train_data, test_data, optimizer, save_every, snapshot_path):
        self.rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.test_data = test_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[rank {self.rank}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _evaluate(self, epoch):
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for source, targets in self.test_data:
                loss = F.mse_loss(self.model(source), targets, reduction="sum")
                total += torch.tensor([loss.item(), len(source)], dtype=torch.float64)
        torch.distributed.all_reduce(total)
        self.model.train()
        print(f"Epoch {epoch} | Evaluated {int(total[1])} samples | Test loss {total[0] / total[1]:.6f}")

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            self._evaluate(epoch)
            if self.rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs(size):
    train_set = RandomRegression(size)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=True,
        shuffle=False,
        sampler=DistributedSampler(dataset)
    )


def main(save_every, total_epochs, batch_size, size, snapshot_path):
    init_process_group(backend="gloo")
    dataset, model, optimizer = load_train_objs(size)
    train_data = prepare_dataloader(dataset, batch_size)
    test_data = prepare_dataloader(RandomRegression(101, seed=1), batch_size)
    trainer = Trainer(model, train_data, test_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each rank")
    parser.add_argument("--size", default=2048, type=int, help="Samples in the dataset")
    parser.add_argument("--snapshot", default="snapshot.pt", help="Snapshot path")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.size, args.snapshot)
