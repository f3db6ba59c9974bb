"""hetlb.integrations.lightning under a real PyTorch Lightning Trainer (DDP, 2 Gloo ranks on CPU,
launched by torchrun): every epoch's samples exactly once with sizes that change between steps,
and a Lightning checkpoint taken mid-epoch resumes the rest of that epoch and then whole epochs
(with the loader's own length, the steps left, Lightning cut every epoch after a resume short);
with accumulate_grad_batches, every checked window's gradient is one process's over its samples."""
import os
import sys

import pytest
from distributed import torchrun_each
from extras import extra

extra("pytorch_lightning", "lightning")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_worker.py")


def per_epoch(result):
    epochs = {}
    for rank in result["batches"]:
        for epoch, samples in rank:
            epochs.setdefault(epoch, []).extend(samples)
    return epochs


#: Two stopped runs (their checkpoints mid-epoch) and their resumes, in two launches (a launch
#: costs Lightning's imports, about 6 s a process): "plain" stopped after step 9 (3 of epoch 1's
#: 6) and resumed to the end of epoch 2; "windows", 52 samples in steps of 12 and windows of 2,
#: [0, 1] [2, 3] [4: 4 samples] (3 optimizer steps an epoch), stopped after the first window of
#: epoch 1 and resumed to the end of epoch 2, the short windows 2 and 5 (after the resume) checked.
WINDOWS = ("--epochs", 3, "--samples", 52, "--accumulate", 2)
FIRST = {"plain": ("--epochs", 3, "--stop-at", 9),
         "windows": (*WINDOWS, "--stop-at", 4, "--check", "0,1,2,3")}
REST = {"plain": ("--epochs", 3), "windows": (*WINDOWS, "--check", "4,5,8")}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """``{name: (first, rest)}``: what each run of :data:`FIRST` and its resume wrote."""
    tmp = tmp_path_factory.mktemp("lightning")
    ckpt = {name: tmp / f"{name}.ckpt" for name in FIRST}
    first = torchrun_each(WORKER, [(tmp / f"{name}-first.json", (*args, "--ckpt", ckpt[name]))
                                   for name, args in FIRST.items()])
    rest = torchrun_each(WORKER, [(tmp / f"{name}-rest.json", (*args, "--resume", ckpt[name]))
                                  for name, args in REST.items()])
    return {name: (first[i], rest[i]) for i, name in enumerate(FIRST)}


def test_every_epoch_once_and_a_mid_epoch_resume(resumed):
    first, rest = resumed["plain"]
    assert len({tuple(s) for s in first["sizes"]}) > 1  # LBB moved samples between the ranks
    assert rest["steps"] == 18
    first, rest = per_epoch(first), per_epoch(rest)
    assert sorted(first[0]) == list(range(64)) and len(first[1]) == 3 * 12
    assert sorted(first[1] + rest[1]) == list(range(64))  # the rest of epoch 1, nothing twice
    assert sorted(rest[2]) == list(range(64))  # and then a whole epoch


def test_accumulated_windows_exact_and_a_resume_inside_an_epoch(resumed):
    first, rest = resumed["windows"]
    assert first["global_step"] == first["steps"] == 4 and rest["global_step"] == rest["steps"] == 9
    assert len({tuple(s) for s in first["sizes"] + rest["sizes"]}) > 1
    for r, checked in ((first, ["0", "1", "2", "3"]), (rest, ["4", "5", "8"])):
        assert sorted(r["errors"]) == checked
        assert max(r["errors"].values()) < 1e-6, r["errors"]
    a, b = per_epoch(first), per_epoch(rest)
    assert sorted(a[0]) == list(range(52)) and 0 not in b
    assert sorted(a[1] + b[1]) == list(range(52))  # the rest of epoch 1, nothing twice
    assert sorted(b[2]) == list(range(52))


def test_windows_that_lightning_would_cut_otherwise_are_refused():
    import pytorch_lightning as pl
    import torch
    from hetlb.integrations.lightning import Balance

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            # 3 whole steps and a short one: Lightning's windows [0, 1] [2, 3] mix sizes
            return balance.loader(torch.utils.data.TensorDataset(torch.ones(14, 1)))

    with pytest.raises(ValueError, match="accumulate"):
        Balance(4, accumulate=2)
    balance = Balance(4)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=2,
                         callbacks=[balance], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="drop_last=True in balance.loader"):
        trainer.fit(Model())


def test_without_lightning_the_import_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "hetlb.integrations.lightning", raising=False)
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"pip install hetlb\[lightning\]"):
        import hetlb.integrations.lightning  # noqa: F401
