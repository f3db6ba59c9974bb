"""A throwaway FSDP2 gradient transport, to test :mod:`hetlb.comm.gradients`' interface.

FSDP2 (``fully_shard``) has no communication hook, so the weight goes on the loss side: every
FSDP module reduce-scatters with a plain sum (divide factor 1), and :meth:`backward` scales the
loss by the rank's weight, so the reduced gradient is the one-large-batch gradient. The table
travels by the side route (``delivers_table`` False). A backward that does not go through
``bal.backward`` would be unweighted: the watch on the model's outputs refuses it. Not part of
the package: the FSDP2 support proper (HSDP, per-rank micro-steps, checkpoints through
``torch.distributed.checkpoint``) is its own work.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional

import torch
from torch.distributed.fsdp import FSDPModule

from hetlb.comm.hook import tensors_in


class FSDP2Prototype:
    """:class:`hetlb.comm.gradients.GradientTransport` for a ``fully_shard`` model."""

    name = "FSDP2"
    takes_over = False

    @staticmethod
    def admit(model: torch.nn.Module, settings: Any, balanced: bool) -> None:
        if settings.accumulate != 1:
            raise ValueError("the prototype runs without accumulation")

    @staticmethod
    def capabilities(model: torch.nn.Module, settings: Any) -> dict:
        return {"carry": "no communication hook", "carry_penalty": None,
                "defer": "no communication hook"}

    @staticmethod
    def inner(model: torch.nn.Module) -> torch.nn.Module:
        return model

    def __init__(self, model: torch.nn.Module, telemetry: Any, settings: Any, *,
                 deferred: bool = False) -> None:
        self.model = model
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        self._weighted = False  # inside backward(): the loss carries the weight
        self._watch = model.register_forward_hook(self._outputs)

    def _outputs(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(self._check)

    def _check(self, grad: torch.Tensor) -> None:
        if not self._weighted:
            raise RuntimeError("an FSDP2 model's loss goes through bal.backward(loss): FSDP2 has "
                               "no communication hook to weigh the gradient")

    @property
    def models(self) -> List[torch.nn.Module]:
        return [self.model]

    @property
    def delivers_table(self) -> bool:
        return False

    @property
    def registry(self) -> None:
        return None

    @staticmethod
    def no_sync_on(model: torch.nn.Module) -> Optional[str]:
        return None

    def before_step(self, plan: Any, weight: float, equal: bool) -> None:
        return None

    @contextlib.contextmanager
    def local(self) -> Iterator[None]:
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def window_done(self, weight: float) -> None:
        return None

    def backward(self, loss: torch.Tensor, gradient: Optional[torch.Tensor], weight: float,
                 **kwargs: Any) -> None:
        gradient = torch.full_like(loss, weight) if gradient is None else gradient * weight
        self._weighted = True
        try:
            torch.autograd.backward(loss, gradient, **kwargs)
        finally:
            self._weighted = False

    def check_attach(self, model: torch.nn.Module, balanced: bool) -> bool:
        raise TypeError("the prototype reduces one model")

    def attach(self, model: torch.nn.Module) -> None:
        raise TypeError("the prototype reduces one model")

    def remove(self) -> None:
        self._watch.remove()
