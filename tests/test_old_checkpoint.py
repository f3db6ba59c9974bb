"""A checkpoint written before the subpackages (hetlb at commit c984ae6, by
``tests/data/make_old_checkpoint.py``) loads with ``torch.load``'s defaults and resumes its epoch
with every sample exactly once."""
import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import hetlb
from distributed import run, unwrap

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "checkpoint_c984ae6.pt")


def _resume(rank, world, saved):
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(1, 1))
    bal = hetlb.Balancer(ddp, saved["global_batch"], policy=hetlb.LBB())
    n = saved["n"]
    data = torch.utils.data.TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1),
                                          torch.zeros(n, 1))
    loader = bal.loader(data, seed=saved["seed"])
    loader.load_state_dict(saved["state"])
    out = {"sizes": bal.batch_sizes.tolist(), "steps": bal.steps, "epoch": loader.epoch,
           "records": len(bal.history), "left": len(loader), "seen": []}
    for x, y in loader:
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        out["seen"].append([int(v) for v in x[:, 0].tolist()])
    out["after"] = bal.steps
    return out


def test_a_checkpoint_of_the_old_layout_resumes_exactly_once():
    saved = torch.load(PATH)  # the default weights_only=True: tensors and plain values only
    assert saved["commit"] == "c984ae6" and saved["state"]["position"]["step"] == 5
    out = unwrap(run(_resume, 2, saved, timeout=120))
    for r in out:
        # The decision, step count and history are the checkpoint's, not a fresh start's.
        assert r["sizes"] == saved["sizes"] == saved["state"]["decision"] != [4, 4], r
        assert r["steps"] == 5 and r["epoch"] == 0 and r["records"] == 5, r
        assert r["left"] == 3 and r["after"] == 8, r
        assert len(r["seen"]) == 3, r
    samples = [i for rank in saved["seen"] for step in rank for i in step] + \
        [i for r in out for step in r["seen"] for i in step]
    assert sorted(samples) == list(range(saved["n"]))
