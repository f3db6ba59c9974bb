"""Small built-in workloads for ``hetlb profile`` (and for trying hetlb without a model at hand).

Each factory returns ``(model, loss_fn, make_batch)``: ``make_batch(b)`` gives the inputs and
targets of a batch of ``b`` random samples on the model's device, and ``loss_fn(model(x), y)`` is
the scalar to differentiate. A user's factory for ``hetlb profile MODULE:FACTORY`` has the same
shape and takes a ``device`` keyword.
"""
from __future__ import annotations

from typing import Callable, Tuple

import torch


__all__ = ["mlp", "cnn", "transformer", "ZOO"]

Workload = Tuple[torch.nn.Module, Callable[..., torch.Tensor], Callable[[int], tuple]]


def _classify(model: torch.nn.Module, shape: Tuple[int, ...], classes: int, device: str) -> Workload:
    model = model.to(device)

    def make_batch(b: int) -> tuple:
        return (torch.randn(b, *shape, device=device), torch.randint(0, classes, (b,), device=device))
    return model, torch.nn.functional.cross_entropy, make_batch


def mlp(device: str = "cpu") -> Workload:
    """A 3-layer MLP on 784 features (MNIST-sized), 10 classes: ~0.6 M parameters."""
    net = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                              torch.nn.ReLU(), torch.nn.Linear(256, 10))
    return _classify(net, (784,), 10, device)


def cnn(device: str = "cpu") -> Workload:
    """A small CNN on 3x32x32 images (CIFAR-sized), 10 classes."""
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(64 * 8 * 8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    return _classify(net, (3, 32, 32), 10, device)


def transformer(device: str = "cpu") -> Workload:
    """A 2-layer transformer encoder on sequences of 64 tokens of width 128, 10 classes."""
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = torch.nn.TransformerEncoderLayer(128, 4, 256, batch_first=True)
            self.enc = torch.nn.TransformerEncoder(layer, 2)
            self.head = torch.nn.Linear(128, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.enc(x).mean(1))
    return _classify(Net(), (64, 128), 10, device)


#: Built-in workloads by name.
ZOO = {"mlp": mlp, "cnn": cnn, "transformer": transformer}
