"""A model sharded with FSDP2's ``fully_shard`` (1-D mesh or HSDP): the weight on the loss side.

FSDP2 has no communication hook. Every FSDP module of the model reduces with a plain sum
(``set_gradient_divide_factor(1.0)``, ``set_force_sum_reduction_for_comms(True)``: a SUM
reduce-scatter, and for HSDP a SUM all-reduce across replicas, with no PREMUL_SUM and no rounded
``1/N``), and :meth:`FSDP2Transport.backward` (``bal.backward(loss)``) scales the loss by the
rank's weight, so the reduced gradient is the one-large-batch gradient. A backward of a loss that
does not go through ``bal.backward`` would be unweighted: a hook on the model's outputs refuses
it in the backward, before FSDP reduces anything. The end of each backward is seen by the same
native watch as a DDP model's deferred hook (:class:`hetlb.comm.hook.BackwardWatch`), which stamps
the compute time and sends the telemetry row by the side route; the time FSDP waits for the other
ranks in its collectives is left out of that compute time, and an emulator slows the rank layer by
layer (:class:`hetlb.comm.fsdp_clock.LayerClock`). A rank given no samples runs its forward and
backward on an empty batch (FSDP needs every rank in its collectives), with weight 0.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from typing import TYPE_CHECKING, Any, ContextManager, Dict, Iterator, List, Optional, Tuple, Type

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hetlb.comm.fsdp_clock import LayerClock
from hetlb.comm.fsdp_profile import FSDP2Trial
from hetlb.comm.fsdp_state import (FSDPModels, all_param_groups, data_parallel_ranks, fsdp_modules,
                                   param_groups)
from hetlb.comm.gradients import WrapperSettings, weighted_gradient
from hetlb.comm.hook import StepTelemetry, tensors_in

if TYPE_CHECKING:
    from hetlb.data.board import StepPlan


log = logging.getLogger("hetlb.balancer")

_NO_HOOK = "FSDP2 reduce-scatters without a communication hook"

#: Added to the error of a forward that fails on this rank's empty batch.
EMPTY_BATCH = (
    "hetlb: this rank's batch was empty (the Balancer gave it no samples in this step, as lower=0 "
    "allows) and the model refused it; under FSDP2 every rank runs every step's forward and "
    "backward, so a model that cannot take an empty batch needs Balancer(..., lower=1) or more")

#: The error for a backward that does not go through ``bal.backward``.
PLAIN_BACKWARD = (
    "hetlb: an FSDP2 model's loss goes through bal.backward(loss) (in place of loss.backward()): "
    "FSDP2 has no communication hook, so the Balancer weighs each rank's gradient by its share on "
    "the loss side; a plain backward would sum the ranks' unweighted gradients")


class _Loss:
    """What the hooks on a model's outputs need of its transport, shared with it (the hooks hold
    this, not the transport, which holds the model)."""

    def __init__(self, telemetry: StepTelemetry) -> None:
        self.telemetry = telemetry
        self.weighted = False  # inside FSDP2Transport.backward: the loss carries the weight
        self.empty = False  # this rank's batch in the step about to run is empty

    def outputs(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Forward hook (always called, also when the forward raised): a note on the error of a
        forward that refused an empty batch; a check on each output's gradient."""
        if output is None and self.empty:
            failed = sys.exc_info()[1]
            if failed is not None and hasattr(failed, "add_note"):
                failed.add_note(EMPTY_BATCH)
            elif failed is not None:  # (Python 3.10: no notes)
                log.error(EMPTY_BATCH)
            return
        if module.training and torch.is_grad_enabled():
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(self.check)

    def check(self, grad: torch.Tensor) -> None:
        if not self.weighted and self.telemetry.core.open:
            raise RuntimeError(PLAIN_BACKWARD)


class FSDP2Transport:
    """:class:`hetlb.comm.gradients.GradientTransport` of a ``fully_shard`` model.

    Args:
        model: the balanced model, ``fully_shard`` applied to it (its root) and usually to its
            blocks.
        telemetry: the step telemetry (the side route).
        settings: the Balancer's.
        deferred: ignored (there is no hook to defer).
    """

    name = "FSDP2 (fully_shard)"
    #: Its reductions stay set for a sum: a model keeps its first Balancer.
    takes_over = False
    #: FSDP2's forward of a micro-step that does not synchronise takes the root module's sharded
    #: gradients out of its parameters (they read None until the backward): a window's gradient
    #: is checked before that forward.
    clears_after_forward = False

    @staticmethod
    def admit(model: torch.nn.Module, settings: WrapperSettings, balanced: bool) -> None:
        """Refuse what the loss-side weight cannot make exact: a model that already has a
        Balancer, the reference hook or an emulated link (both belong to DDP's hook), a mesh
        other than the Balancer's group; warn of a reduction in a low precision."""
        if balanced:
            raise ValueError("this model already has a Balancer: make one Balancer per model")
        if not settings.native:
            raise ValueError("native_hook=False selects the hook of a DistributedDataParallel model")
        if settings.emulator is not None and getattr(settings.emulator, "bandwidth", None):
            raise ValueError("an emulator's bandwidth= delays a DDP model's gradient buckets; it "
                             "does not apply to an FSDP2 model (its compute is emulated layer by "
                             "layer: leave bandwidth out)")
        mesh = data_parallel_ranks(model)
        group = dist.get_process_group_ranks(settings.group) if settings.group is not None else \
            list(range(dist.get_world_size()))
        if mesh is not None and mesh != sorted(group):
            raise ValueError(f"the model is sharded over ranks {mesh}, the Balancer's group has "
                             f"ranks {sorted(group)}: the data-parallel ranks (FSDP's shard x "
                             f"replicate mesh) must be the Balancer's group; a mesh with other "
                             f"dimensions (tensor parallel) is not supported")
        low = sorted({str(g.mp_policy.reduce_dtype or g.mp_policy.param_dtype)
                      for m in fsdp_modules(model) for g in param_groups(m._get_fsdp_state())
                      if (g.mp_policy.reduce_dtype or g.mp_policy.param_dtype) not in
                      (None, torch.float32, torch.float64)})
        if low:
            log.warning("the FSDP2 model reduces its gradients in %s (MixedPrecisionPolicy: "
                        "reduce_dtype, else param_dtype): each rank's weighted gradient is rounded "
                        "to that precision before the sum (bfloat16: a relative error up to about "
                        "2^-8 per element and rank). Pass MixedPrecisionPolicy(reduce_dtype="
                        "torch.float32) for the one-large-batch gradient to float32 precision",
                        ", ".join(low))

    @staticmethod
    def capabilities(model: torch.nn.Module, settings: WrapperSettings) -> Dict[str, Optional[str]]:
        return {"carry": _NO_HOOK, "carry_penalty": None, "defer": _NO_HOOK}

    @staticmethod
    def inner(model: torch.nn.Module) -> torch.nn.Module:
        return model  # (fully_shard changes the module's class in place)

    @staticmethod
    def trial(model: torch.nn.Module, device: torch.device) -> Any:
        return FSDP2Trial(model, device)

    def __init__(self, model: torch.nn.Module, telemetry: StepTelemetry, settings: WrapperSettings,
                 *, deferred: bool = False) -> None:
        self.model, self.telemetry, self.settings = model, telemetry, settings
        self._attached: List[torch.nn.Module] = []
        self._loss = _Loss(telemetry)
        #: Inside :meth:`micro_window`: each parameter group's ``reshard_after_backward``.
        self._resident: Optional[List[Tuple[Any, bool]]] = None
        self._handles: List[Any] = []
        self._sum(model)
        # The end of each backward: stamps the compute, sends the row (the side route).
        self._handles.append(telemetry.defer(model, prepend=True))
        #: FSDP's waits left out of the compute time; the emulator's hold, layer by layer.
        self.clock = LayerClock(telemetry, fsdp_modules(model))

    def _sum(self, model: torch.nn.Module) -> None:
        """Reduce ``model``'s gradients with a plain sum; refuse a backward outside
        :meth:`backward` through its outputs."""
        for m in fsdp_modules(model):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
        self._handles.append(model.register_forward_hook(self._loss.outputs, always_call=True))

    @property
    def models(self) -> List[torch.nn.Module]:
        return [self.model] + self._attached

    @property
    def delivers_table(self) -> bool:
        return False  # (the watch sends the row by the side route at the end of the backward)

    @property
    def registry(self) -> Type[FSDPModels]:
        """The process's ``fully_shard`` models (:class:`hetlb.comm.fsdp_state.FSDPModels`)."""
        return FSDPModels

    @staticmethod
    def no_sync_on(model: torch.nn.Module) -> Optional[str]:
        for g in all_param_groups(model):
            if not g.reduce_grads:
                return "model.set_requires_gradient_sync(False)"
            if not g.all_reduce_grads:
                return "model.set_requires_all_reduce(False), with HSDP"
        return None

    def local_grads(self) -> List[Optional[torch.Tensor]]:
        """Each sharded gradient's local shard (no collective; None before the window's
        reduction: FSDP keeps a window's unreduced gradient to itself)."""
        with torch.no_grad():
            return [g.to_local() if isinstance(g, DTensor) else g
                    for g in (p.grad for p in self.model.parameters())]

    def before_step(self, plan: "StepPlan", weight: float, equal: bool) -> None:
        self._loss.empty = int(plan.sizes[self.telemetry.rank]) == 0
        self.clock.new_step()

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        resident = self._resident or []
        for m in self.models:
            m.set_requires_gradient_sync(False)
        for g, _ in resident:
            g.reshard_after_backward = False  # (the next micro-step's forward gathers nothing)
        try:
            yield
        finally:
            for m in self.models:
                m.set_requires_gradient_sync(True)
            for g, after in resident:
                g.reshard_after_backward = after

    @contextlib.contextmanager
    def micro_window(self) -> Iterator[None]:
        """The parameters stay unsharded from the step's start to its last backward: one
        all-gather of each FSDP module a step, all issued before the first forward (so a rank's
        micro-steps do not wait layer by layer for the slower ranks' forwards), and one
        reduction (in the last micro-step's backward), whatever the number of micro-steps, so
        that number may differ between ranks. The cost: the full parameters, and the gradients
        accumulated between micro-steps (in the reduce dtype), are resident through the step, as
        under ``reshard_after_forward=False``. The attributes written are those torch's
        ``set_reshard_after_forward`` and ``set_reshard_after_backward`` write; the model's own
        settings come back at the end."""
        groups = [g for m in self.models for g in all_param_groups(m)]
        saved = [(g, g.post_forward_mesh_info) for g in groups]
        for g in groups:
            g.post_forward_mesh_info = None
        self._resident = [(g, g.reshard_after_backward) for g in groups]
        try:
            # Every module's all-gather now, together: a rank's micro-steps then run without
            # waiting for the slower ranks' forwards layer by layer.
            for h in [m.unshard(async_op=True) for model in self.models
                      for m in fsdp_modules(model)]:
                h.wait()
            yield
        finally:
            self._resident = None
            for g, info in saved:
                g.post_forward_mesh_info = info
            for m in self.models:
                # A root initialised in the window (its first forward) keeps FSDP's own rule:
                # a root left to FSDP does not reshard after its forward.
                state = m._get_fsdp_state()
                if state._is_root and state._auto_reshard_after_forward:
                    for g in param_groups(state):
                        g.post_forward_mesh_info = None

    def local(self) -> ContextManager[Any]:
        return self._no_sync()

    def window_done(self, weight: float) -> None:
        """Nothing: each micro-step's loss carried the window's weight."""

    def backward(self, loss: torch.Tensor, gradient: Optional[torch.Tensor], weight: float,
                 window: bool = False, **kwargs: Any) -> None:
        """The backward of ``loss`` times ``weight`` (an idle rank's weight 0: its empty batch's
        loss is NaN, a mean over nothing, and its gradient zero)."""
        gradient = weighted_gradient(loss, gradient, weight)
        self._loss.weighted = True
        try:
            torch.autograd.backward(loss, gradient, **kwargs)
        finally:
            self._loss.weighted = False

    def check_attach(self, model: torch.nn.Module, balanced: bool) -> bool:
        """Another ``fully_shard`` model over the same ranks, trained on the same batches."""
        if not isinstance(model, FSDPModule):
            raise TypeError(f"bal.attach: the balanced model is sharded with fully_shard, so an "
                            f"attached one must be too, got {type(model).__name__}")
        if any(model is m for m in self.models):
            raise ValueError("bal.attach: this model is already weighted by this Balancer "
                             "(the balanced model, or attached before)")
        self.admit(model, self.settings, balanced)
        return True

    def attach(self, model: torch.nn.Module) -> None:
        """Sum ``model``'s gradients too: the weight on the loss covers every model it reaches."""
        self._attached.append(model)
        self._sum(model)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.clock.remove()
