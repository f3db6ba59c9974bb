"""hetlb.integrations.accelerate in a real Accelerate loop (DDP, 2 Gloo ranks on CPU, launched by
torchrun): batches on the accelerator's device, sizes that change every step, each checked
window's gradient (a short one included) equal to one process's over its samples under
gradient accumulation, and accelerate's own save_state / load_state resuming mid-way through the
second epoch with every sample of each epoch once. In one process: what it refuses."""
import os
import sys

import pytest

from distributed import torchrun
from extras import extra

extra("accelerate", "hf")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "accelerate_worker.py")
N = 50  # samples; steps of 12: windows of 2 micro-steps [0, 1] [2, 3] [4: short] an epoch


def run(tmp_path, name, *args):
    return torchrun(WORKER, tmp_path / f"{name}.json", "--dir", tmp_path / "state", *args)


def test_accumulated_windows_and_a_resume_through_save_state(tmp_path):
    common = ("--epochs", 3, "--accumulate", 2)
    first = run(tmp_path, "first", *common, "--check", "1,2,3", "--stop-at", 5)
    assert first["steps"] == 5 and len({tuple(s) for s in first["sizes"]}) > 2
    assert sorted(first["errors"]) == ["1", "2", "3"]  # (2: the short window)
    assert max(first["errors"].values()) < 1e-6, first["errors"]
    rest = run(tmp_path, "rest", *common, "--resume")
    assert rest["steps"] == 9
    epochs = {}
    for result in (first, rest):
        for rank in result["trained"]:
            for window, samples in rank:
                epochs.setdefault(window // 3, []).extend(samples)
    assert [sorted(e) for e in epochs.values()] == [list(range(N))] * 3  # each sample once


def test_the_loader_on_the_device_and_what_it_refuses(tmp_path):
    import accelerate
    import torch
    from hetlb.integrations.accelerate import DeviceLoader, prepare
    accelerator = accelerate.Accelerator(cpu=True)
    net = torch.nn.Linear(2, 1)
    data = [(torch.ones(2) * i, torch.tensor([float(i)])) for i in range(10)]
    with pytest.raises(ValueError, match="gradient_accumulation_steps=K"):
        prepare(accelerator, net, torch.optim.SGD(net.parameters(), lr=0.1), data,
                global_batch=4, balancer_kwargs={"accumulate": 2})
    net = torch.nn.Linear(2, 1)
    model, opt, loader = prepare(accelerator, net, torch.optim.SGD(net.parameters(), lr=0.1),
                                 data, global_batch=4)
    assert isinstance(loader, DeviceLoader) and len(loader) == 3 and loader.epoch == 0
    seen = []
    for x, y in loader:
        assert x.device == accelerator.device
        seen.extend(y.flatten().tolist())
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert sorted(seen) == [float(i) for i in range(10)] and loader.balancer.steps == 3
    accelerator.save_state(str(tmp_path))  # the loader's state is in it
    state = torch.load(tmp_path / "custom_checkpoint_0.pkl", weights_only=True)
    assert state["position"] == loader.state_dict()["position"]
    assert len(state["history"]["records"]) == 3
    with pytest.raises(AttributeError, match="resumes at its own position"):
        accelerate.skip_first_batches(loader, 1)


def test_without_accelerate_the_import_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "hetlb.integrations.accelerate", raising=False)
    monkeypatch.setitem(sys.modules, "accelerate", None)
    with pytest.raises(ImportError, match=r"pip install hetlb\[hf\]"):
        import hetlb.integrations.accelerate  # noqa: F401
