"""Gradient transports: how one rank's weighted gradient reaches the other ranks.

The step driver (:class:`hetlb.train.steps.StepDriver`) runs every step through one
:class:`GradientTransport`. It tells the transport each step's weight before the step runs,
asks it for the context of a micro-step whose gradient stays local, hands it the loss of
:meth:`hetlb.Balancer.backward`, and asks whether the step's gradient reduction delivered the
telemetry table (else the driver all-reduces the row at the step's end, by the side transport).
The transport owns whatever it attaches to the model for that, and nothing of the step.

* :class:`DDPTransport`: a ``DistributedDataParallel`` model. Its communication hook multiplies
  each bucket by the rank's weight and sums (or, deferred, DDP's own mean while the weights are
  equal), and delivers the table with the gradient.
* :class:`LocalTransport`: one process with a plain module. Nothing is reduced; the end of the
  backward ends the step's compute.

A model wrapper without a communication hook (FSDP2's ``fully_shard``) weighs on the loss side
instead: its transport scales the loss by the weight in :meth:`GradientTransport.backward`,
reduces with a plain sum, and leaves the table to the side transport (``delivers_table``
False). Such a wrapper's transport is listed in :data:`WRAPPERS`, which the Balancer consults for
a model that is not DDP; ``tests/fsdp2_prototype.py`` is one, run against the same driver.
"""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Dict, List, Optional, Protocol, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from hetlb.comm.hook import StepTelemetry

if TYPE_CHECKING:
    from hetlb.data.board import StepPlan


log = logging.getLogger("hetlb.balancer")


class GradientTransport(Protocol):
    """What the step driver needs of the model wrapper that reduces the gradient."""

    @property
    def models(self) -> List[torch.nn.Module]:
        """The models whose gradients it reduces: the balanced one first, then attached ones."""

    @property
    def delivers_table(self) -> bool:
        """Whether a step's gradient reduction delivers the telemetry table (False: the driver
        all-reduces the row itself when the step ends)."""

    def before_step(self, plan: "StepPlan", weight: float, equal: bool) -> None:
        """The step of ``plan`` is about to run with this rank's aggregation ``weight``;
        ``equal``: every rank's weight is the same."""

    def local(self) -> ContextManager[Any]:
        """The context of a micro-step whose gradient stays on this rank (accumulation)."""

    def window_done(self, weight: float) -> None:
        """The backward of a window's last micro-step ran: apply ``weight`` to the window's
        gradient where the reduction did not (one process: a short window's share)."""

    def backward(self, loss: torch.Tensor, gradient: Optional[torch.Tensor], weight: float,
                 **kwargs: Any) -> None:
        """:meth:`hetlb.Balancer.backward`: the backward of ``loss`` with ``weight`` applied
        where this transport applies it."""

    def attach(self, model: torch.nn.Module, blocker: Optional[str]) -> None:
        """Reduce another model trained on the same batches with the same weight."""

    def remove(self) -> None:
        """Take off what can be taken off (a Balancer refused after registering)."""


class LocalTransport:
    """One process, a plain module: nothing to reduce; a gradient hook on the parameters ends
    the step's compute when the backward reaches them all."""

    def __init__(self, model: torch.nn.Module, telemetry: StepTelemetry) -> None:
        self._models = [model]
        params = [p for p in model.parameters() if p.requires_grad]
        #: The gradient hook's handle (None: no parameter needs a gradient).
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

    def before_step(self, plan: "StepPlan", weight: float, equal: bool) -> None:
        return None

    def local(self) -> ContextManager[Any]:
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
                 **kwargs: Any) -> None:
        torch.autograd.backward(loss, gradient, **kwargs)

    def attach(self, model: torch.nn.Module, blocker: Optional[str]) -> None:
        raise TypeError("one process without DDP has no gradient to weigh across ranks")

    def remove(self) -> None:
        if self.ends is not None:
            self.ends.remove()


class BackwardEnd:
    """Gradient hook of a model without DDP (one process): its backward ran, the compute ends."""

    def __init__(self, telemetry: StepTelemetry) -> None:
        self.telemetry = telemetry

    def __call__(self, grads: Sequence[Optional[torch.Tensor]]) -> None:
        core = self.telemetry.core
        if core.open:
            core.last_ready()
            core.mark_reduced()  # (one process: nothing to wait for)


class DDPTransport:
    """A ``DistributedDataParallel`` model and its attached ones: the weighted communication hook.

    The hook is registered at once, or, where every rank can do without it and the first
    decision splits evenly (``deferred``), a :class:`hetlb.comm.hook.BackwardWatch` stands in
    until the first step whose weights differ (DDP's own mean is the weighted one until then).

    Args:
        model: the balanced DDP model.
        telemetry: the step telemetry whose core the hook writes.
        native: the native hook (False: the Python reference hook).
        deferred: wait for the first step whose weights differ.
        accumulate: micro-steps per window (a window's weight is applied once, by the hook).
    """

    def __init__(self, model: DistributedDataParallel, telemetry: StepTelemetry, *, native: bool,
                 deferred: bool, accumulate: int) -> None:
        self.model, self.telemetry = model, telemetry
        self.native, self.accumulate = native, accumulate
        self._attached: List[DistributedDataParallel] = []
        self._watch: Any = None  # the deferred hook's BackwardWatch handle (None: hooked)
        self._fast_backward_noted = False
        if deferred:
            self._watch = telemetry.defer(model)
        else:
            telemetry.register(model, native=native)

    @property
    def models(self) -> List[torch.nn.Module]:
        return [self.model] + self._attached

    @property
    def deferred(self) -> bool:
        """Whether the communication hook still waits for the first step whose weights differ."""
        return self._watch is not None

    @property
    def delivers_table(self) -> bool:
        return self._watch is None

    def before_step(self, plan: "StepPlan", weight: float, equal: bool) -> None:
        """Register the deferred hook before the first step whose weights differ."""
        if self._watch is None:
            return
        if getattr(self.model, "_comm_hooks", None):
            raise RuntimeError(
                "hetlb: a communication hook was registered on the DDP model besides the "
                "Balancer's; the Balancer's own hook weighs each rank's gradient by its batch "
                "(it is registered once the batches differ), and DDP takes one hook only. "
                "Register no hook of your own on a balanced model")
        if not equal:
            self.register_now(f"step {plan.step} of epoch {plan.epoch}: the ranks' weights "
                              f"differ (sizes {plan.sizes.tolist()})")

    def register_now(self, why: str) -> None:
        """Register the deferred communication hook now, for good (DDP cannot remove one), and
        the attached models' hooks: the first step whose weights differ is about to run (on
        every rank alike: plans are replicated), so DDP's mean would be wrong from here on."""
        self.telemetry.register(self.model, native=True)  # (first: if DDP refuses, nothing changed)
        for m in self._attached:
            self.telemetry.register(m, native=True, attached=True)
        self._watch.remove()
        self._watch = None
        log.info("%s, so the weighted communication hook is registered from now on", why)

    def local(self) -> ContextManager[Any]:
        """``no_sync()`` of the balanced model and the attached ones (a window's weight is
        applied once, by the hooks of its last micro-step)."""
        if not self._attached:
            return self.model.no_sync()
        stack = contextlib.ExitStack()
        for m in self.models:
            stack.enter_context(m.no_sync())
        return stack

    def window_done(self, weight: float) -> None:
        """Nothing: the hook weighed the window's bucket."""

    def backward(self, loss: torch.Tensor, gradient: Optional[torch.Tensor], weight: float,
                 **kwargs: Any) -> None:
        """The weight on the loss where the hook may then only sum (see
        :meth:`hetlb.Balancer.backward` for when it falls back to a plain backward)."""
        core = self.telemetry.core
        low = loss.dtype not in (torch.float32, torch.float64) or \
            (gradient is not None and gradient.dtype not in (torch.float32, torch.float64))
        if self._watch is not None:  # no hook yet: DDP's own mean is the weighted one
            torch.autograd.backward(loss, gradient, **kwargs)
            return
        if weight == 1.0 or self.accumulate > 1 or low or not core.grads_clear():
            if weight != 1.0 and self.accumulate == 1 and not low and not self._fast_backward_noted:
                self._fast_backward_noted = True
                log.warning("bal.backward: parameters already hold gradients, so the hook weighs "
                            "the gradient (as with loss.backward()); zero them with "
                            "optimizer.zero_grad() (set_to_none=True, the default) to skip its pass")
            torch.autograd.backward(loss, gradient, **kwargs)
            return
        if gradient is None:
            if loss.numel() != 1:
                raise RuntimeError(f"bal.backward: a loss of shape {tuple(loss.shape)} needs "
                                   f"gradient= (as Tensor.backward: implicit only for scalars)")
            gradient = torch.full_like(loss, weight, memory_format=torch.preserve_format)
        else:
            gradient = gradient * weight
        core.prescaled = True
        try:
            torch.autograd.backward(loss, gradient, **kwargs)
        finally:
            core.prescaled = False

    def attach(self, model: torch.nn.Module, blocker: Optional[str]) -> None:
        """Weigh the DDP ``model`` as the balanced one (checked by ``Balancer.attach``);
        ``blocker``: why it cannot wait for a deferred hook (None: it can)."""
        if self._watch is None:  # the balanced model's hook is registered: this one's now too
            self.telemetry.register(model, native=self.native, attached=True)
            self._attached.append(model)
        else:
            self._attached.append(model)
            if blocker is not None:  # it needs its hook now, and so the balanced model its own
                self.register_now(f"the attached model needs its hook at once ({blocker})")
        # bal.backward weighs the loss only where no parameter holds a gradient, of either model
        self.telemetry.core.watch([p for m in self.models for p in m.parameters()])

    def remove(self) -> None:
        """Take the deferred watch off (a registered communication hook cannot go)."""
        if self._watch is not None:
            self._watch.remove()
            self._watch = None


#: Model wrappers besides DDP whose gradient a transport reduces, by class (``isinstance``): each a
#: factory ``(model, telemetry, accumulate) -> GradientTransport``. Empty: only DDP models (and one
#: process's plain module) are balanced.
WRAPPERS: Dict[type, Callable[[torch.nn.Module, StepTelemetry, int], GradientTransport]] = {}


def wrapper_transport(model: torch.nn.Module) -> Optional[Callable[..., GradientTransport]]:
    """The factory of ``model``'s transport in :data:`WRAPPERS`, or None."""
    for cls, factory in WRAPPERS.items():
        if isinstance(model, cls):
            return factory
    return None


def transport_for(model: torch.nn.Module, telemetry: StepTelemetry, *, native: bool,
                  deferred: bool, accumulate: int) -> GradientTransport:
    """The transport of ``model``: :class:`DDPTransport` for a DDP model, a :data:`WRAPPERS`
    entry's, or :class:`LocalTransport` for one process's plain module."""
    if isinstance(model, DistributedDataParallel):
        return DDPTransport(model, telemetry, native=native, deferred=deferred, accumulate=accumulate)
    wrapper = wrapper_transport(model)
    if wrapper is not None:
        return wrapper(model, telemetry, accumulate)
    return LocalTransport(model, telemetry)


def ends_of(transport: GradientTransport) -> Any:
    """The handle a :class:`LocalTransport` keeps on the parameters (removed with the forward
    check when a new Balancer takes the module over), else None."""
    return transport.ends if isinstance(transport, LocalTransport) else None
