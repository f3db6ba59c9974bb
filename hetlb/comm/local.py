"""One process with a plain module: nothing to reduce, nothing to weigh across ranks."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ContextManager, Dict, List, Optional, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from hetlb.comm.gradients import WrapperSettings

if TYPE_CHECKING:
    from hetlb.comm.hook import StepTelemetry
    from hetlb.data.board import StepPlan


class LocalTransport:
    """One process, a plain module: nothing to reduce; a gradient hook on the parameters ends
    the step's compute when the backward reaches them all."""

    name = "a plain module (one process)"
    #: A new Balancer of the same module takes it over (its hooks all come off).
    takes_over = True
    #: The gradients stay in the parameters through a forward (see GradientTransport).
    clears_after_forward = True

    @staticmethod
    def admit(model: torch.nn.Module, settings: WrapperSettings, balanced: bool) -> None:
        if not settings.native:
            raise ValueError("native_hook=False selects the hook of a DistributedDataParallel model")

    @staticmethod
    def capabilities(model: torch.nn.Module, settings: WrapperSettings) -> Dict[str, Optional[str]]:
        none = "no DDP model"
        return {"carry": none, "carry_penalty": None, "defer": none}

    @staticmethod
    def trial(model: torch.nn.Module, device: torch.device) -> None:
        return None  # (one process: nothing to agree on)

    @staticmethod
    def inner(model: torch.nn.Module) -> torch.nn.Module:
        return model

    def __init__(self, model: torch.nn.Module, telemetry: "StepTelemetry", settings: WrapperSettings,
                 *, deferred: bool = False) -> None:
        self._models = [model]
        params = [p for p in model.parameters() if p.requires_grad]
        #: The gradient hook's handle (None: no parameter needs a gradient), removed with the
        #: forward check when a new Balancer takes the module over.
        self.ends: Any = None
        if params:
            self.ends = torch.autograd.graph.register_multi_grad_hook(
                params, BackwardEnd(telemetry), mode="all")

    @property
    def models(self) -> List[torch.nn.Module]:
        return list(self._models)

    @property
    def delivers_table(self) -> bool:
        return False

    @property
    def registry(self) -> None:
        return None

    @staticmethod
    def no_sync_on(model: torch.nn.Module) -> Optional[str]:
        return None

    def local_grads(self) -> List[Optional[torch.Tensor]]:
        return [p.grad for p in self._models[0].parameters()]

    def before_step(self, plan: "StepPlan", weight: float, equal: bool) -> None:
        return None

    def local(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def micro_window(self) -> ContextManager[Any]:
        """Nothing to set: a micro-step under :meth:`local` communicates nothing."""
        return contextlib.nullcontext()

    def window_done(self, weight: float) -> None:
        """One rank's weight is 1 but for a short accumulation window (an epoch's end), whose
        micro-steps' losses were divided by ``accumulate``: its gradient is scaled here, as a DDP
        hook scales the window's bucket."""
        if weight != 1.0:
            with torch.no_grad():
                for p in self._models[0].parameters():
                    if p.grad is not None:
                        p.grad.mul_(weight)

    def backward(self, loss: torch.Tensor, gradient: Optional[torch.Tensor], weight: float,
                 window: bool = False, **kwargs: Any) -> None:
        torch.autograd.backward(loss, gradient, **kwargs)

    def check_attach(self, model: torch.nn.Module, balanced: bool = False) -> bool:
        """Nothing to weigh for a plain module; a wrapped one has no ranks to reduce over here."""
        if isinstance(model, DistributedDataParallel):
            raise TypeError("one process without DDP has no gradient to weigh across ranks")
        return False

    def attach(self, model: torch.nn.Module) -> None:
        raise TypeError("one process without DDP has no gradient to weigh across ranks")

    def remove(self) -> None:
        if self.ends is not None:
            self.ends.remove()


class BackwardEnd:
    """Gradient hook of a model without DDP (one process): its backward ran, the compute ends."""

    def __init__(self, telemetry: "StepTelemetry") -> None:
        self.telemetry = telemetry

    def __call__(self, grads: Sequence[Optional[torch.Tensor]]) -> None:
        core = self.telemetry.core
        if core.open and not core.quiet:
            core.last_ready()
            core.mark_reduced()  # (one process: nothing to wait for)
