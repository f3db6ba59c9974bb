"""hetlb.sync.train: one entry point, every mode on real processes."""
from __future__ import annotations

import pytest
import torch

from distributed import run, unwrap

N, DIM = 64, 4


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, DIM, generator=g)
    return torch.utils.data.TensorDataset(x, (x.sum(1, keepdim=True) > 0).float())


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(DIM, 1)


def _loss(out, y):
    return torch.nn.functional.binary_cross_entropy_with_logits(out, y)


def _pg(rank, world, mode):
    import hetlb
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    # (local SGD: 8 steps and an average every 3, so the last two steps are local)
    kw = {"period": 3} if mode == "localsgd" else {}
    out = hetlb.sync.train(mode, model, _data(), _loss, global_batch=16, epochs=2, **kw)
    moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return {"updates": out["updates"], "moved": moved,
            "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("mode", ["bsp", "delayed", "localsgd", "fl"])
def test_process_group_modes(mode):
    a, b = unwrap(run(_pg, 2, mode))
    assert a["moved"] and a["updates"] >= 2 * N // 16 - (mode == "delayed") * 4
    for x, y in zip(a["params"], b["params"]):  # every rank returns the same model
        torch.testing.assert_close(x, y)


def _rpc(rank, world, init, mode):
    import hetlb
    model = _model()
    out = hetlb.sync.train(mode, model, _data(), _loss, global_batch=12, epochs=2,
                           rank=rank, world_size=world, init_method=init)
    return out["updates"]


@pytest.mark.parametrize("mode", ["lsp", "ssp"])
def test_parameter_server_modes(mode):
    updates = unwrap(run(_rpc, 3, mode, backend="rpc"))
    assert updates[0] >= 2 * N // 12  # server: updates applied
    assert all(u > 0 for u in updates[1:])  # workers: iterations


def test_bad_mode_and_no_group():
    import hetlb
    with pytest.raises(ValueError, match="mode"):
        hetlb.sync.train("bulk", _model(), _data(), _loss, global_batch=8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        hetlb.sync.train("bsp", _model(), _data(), _loss, global_batch=8)
    with pytest.raises(ValueError, match="optimizer"):
        hetlb.sync.train("bsp", _model(), _data(), _loss, global_batch=8, optimizer=3)


def _fl_uneven(rank, world):
    import hetlb
    model = _model()
    indices = list(range(8)) if rank == 0 else list(range(8, 40))  # 8 and 32 samples
    out = hetlb.sync.train("fl", model, _data(), _loss, global_batch=8, epochs=1, local_steps=2,
                           tune=False, indices=indices)
    fed = out["federated"]
    return {"rounds": fed.round, "steps": fed.steps, "passes": fed._loader.epoch}


def test_fl_rounds_are_sized_by_the_largest_client():
    """What train's docstring states: every client runs the rounds of `epochs` passes over the
    largest client's data at the mean batch (32 samples / (4 * 2) = 4 rounds), so the client of
    8 samples makes 4 passes over its own data."""
    small, large = unwrap(run(_fl_uneven, 2))
    assert small["rounds"] == large["rounds"] == 4 and small["steps"] == large["steps"] == 8
    assert small["passes"] == 4 and large["passes"] == 1


class _Dicts(torch.utils.data.Dataset):
    """Samples as dicts: torch's default collate makes a dict of them, which the loss cannot
    take, so a mode that drops the user's collate_fn fails."""

    def __init__(self):
        self.x, self.y = _data().tensors

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def _pairs(samples):
    return (torch.stack([s["x"] for s in samples]), torch.stack([s["y"] for s in samples]))


def _collate(rank, world, mode, init=None):
    import hetlb
    kw = {} if init is None else {"rank": rank, "world_size": world, "init_method": init}
    out = hetlb.sync.train(mode, _model(), _Dicts(), _loss, global_batch=16, epochs=1,
                           collate_fn=_pairs, **kw)
    return out["updates"]


def _collate_rpc(rank, world, init, mode):
    return _collate(rank, world, mode, init)


@pytest.mark.parametrize("mode", ["bsp", "delayed", "localsgd", "fl", "ssp"])
def test_collate_fn_reaches_every_mode(mode):
    if mode == "ssp":
        updates = unwrap(run(_collate_rpc, 3, mode, backend="rpc"))
    else:
        updates = unwrap(run(_collate, 2, mode))
    assert all(u > 0 for u in updates)
