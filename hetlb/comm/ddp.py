"""A ``DistributedDataParallel`` model: the weighted communication hook, its checks, the
process's DDP models (for the search for models trained unattached)."""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import TYPE_CHECKING, Any, ContextManager, Dict, List, Optional, Set, Type

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hetlb.comm.gradients import WrapperSettings, weighted_gradient
from hetlb.comm.hook import StepTelemetry
from hetlb.comm.route import carry_blocker, carry_penalty, defer_blocker, keep_groups

if TYPE_CHECKING:
    from hetlb.data.board import StepPlan


log = logging.getLogger("hetlb.balancer")


class DDPTransport:
    """A ``DistributedDataParallel`` model and its attached ones: the weighted communication hook.

    The hook is registered at once, or, where every rank can do without it and the first
    decision splits evenly (``deferred``), a :class:`hetlb.comm.hook.BackwardWatch` stands in
    until the first step whose weights differ (DDP's own mean is the weighted one until then).

    Args:
        model: the balanced DDP model.
        telemetry: the step telemetry whose core the hook writes.
        settings: the Balancer's (the native hook or the Python reference, micro-steps per
            window: a window's weight is applied once, by the hook).
        deferred: wait for the first step whose weights differ.
    """

    name = "DistributedDataParallel"
    #: DDP cannot remove a communication hook: a model keeps its first Balancer.
    takes_over = False
    #: The gradients stay in the parameters through a forward (see GradientTransport).
    clears_after_forward = True

    @staticmethod
    def admit(model: torch.nn.Module, settings: WrapperSettings, balanced: bool) -> None:
        """Refuse a DDP model that already has a Balancer or a hook of its own, sparse
        gradients, or DDP's static graph with accumulation; keep the model's process group
        after its reducer (:func:`hetlb.comm.route.keep_groups`) from the start, so a
        start-up that raises leaves no reducer as its group's last owner."""
        if balanced:
            raise ValueError(
                "this model already has a Balancer (its hooks stay on the model for the model's "
                "life; DDP cannot remove a communication hook): make one Balancer per DDP model. To "
                "change the policy or the settings, wrap the module in a new DistributedDataParallel "
                "and make the new Balancer for that")
        if getattr(model, "_comm_hooks", None):
            raise ValueError(
                "a communication hook is already registered on this DDP model; DDP takes one hook, "
                "and the Balancer needs its own (it weighs each rank's gradient by its batch once "
                "the batches differ). Make the Balancer for a DDP model without a hook of your own")
        sparse = [name or type(m).__name__ for name, m in model.module.named_modules()
                  if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
                  and m.weight.requires_grad]  # (a frozen one gives DDP no gradient)
        if sparse:
            raise ValueError(
                f"the model has sparse gradients ({', '.join(sparse[:3])}"
                f"{', ...' if len(sparse) > 3 else ''}: sparse=True): the Balancer weighs and "
                f"all-reduces dense gradient buckets only. Build the embeddings with sparse=False")
        if settings.accumulate > 1 and getattr(model, "static_graph", False):
            raise ValueError(
                f"accumulate={settings.accumulate} enters ddp.no_sync() on all but a window's last "
                f"micro-step, which DDP(static_graph=True) does not support (torch fails with an "
                f"internal assertion): build the DDP model with static_graph=False")
        if dist.is_available() and dist.is_initialized():
            keep_groups(model, (model.process_group,))

    @staticmethod
    def capabilities(model: torch.nn.Module, settings: WrapperSettings) -> Dict[str, Optional[str]]:
        return {"carry": carry_blocker(model, settings.group),
                "carry_penalty": carry_penalty(model),
                "defer": defer_blocker(model, settings.group, native=settings.native,
                                       emulator=settings.emulator, accumulate=settings.accumulate,
                                       route=settings.route, micro_steps=settings.micro_steps)}

    @staticmethod
    def trial(model: torch.nn.Module, device: torch.device) -> None:
        raise ValueError("hetlb.profile: profile a DistributedDataParallel model's module "
                         "(step_fn on ddp.module, model=None): its forward and backward alone "
                         "communicate nothing, and each rank's profile is its own")

    @staticmethod
    def inner(model: torch.nn.Module) -> torch.nn.Module:
        return model.module

    def __init__(self, model: DistributedDataParallel, telemetry: StepTelemetry,
                 settings: WrapperSettings, *, deferred: bool = False) -> None:
        self.model, self.telemetry, self.settings = model, telemetry, settings
        self.native, self.accumulate = settings.native, settings.accumulate
        DDPModels.watch()
        self._attached: List[DistributedDataParallel] = []
        self._watch: Any = None  # the deferred hook's BackwardWatch handle (None: hooked)
        self._fast_backward_noted = False
        if deferred:
            self._watch = telemetry.defer(model)
        else:
            telemetry.register(model, native=self.native)

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

    def local_grads(self) -> List[Optional[torch.Tensor]]:
        return [p.grad for p in self.model.parameters()]

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

    def micro_window(self) -> ContextManager[Any]:
        """Nothing to set: a micro-step under :meth:`local` communicates nothing."""
        return contextlib.nullcontext()

    def window_done(self, weight: float) -> None:
        """Nothing: the hook weighed the window's bucket."""

    def backward(self, loss: torch.Tensor, gradient: Optional[torch.Tensor], weight: float,
                 window: bool = False, **kwargs: Any) -> None:
        """The weight on the loss where the hook may then only sum (see
        :meth:`hetlb.Balancer.backward` for when it falls back to a plain backward)."""
        core = self.telemetry.core
        low = loss.dtype not in (torch.float32, torch.float64) or \
            (gradient is not None and gradient.dtype not in (torch.float32, torch.float64))
        if self._watch is not None:  # no hook yet: DDP's own mean is the weighted one
            torch.autograd.backward(loss, gradient, **kwargs)
            return
        if weight == 1.0 or window or low or not core.grads_clear():
            if weight != 1.0 and not window and not low and not self._fast_backward_noted:
                self._fast_backward_noted = True
                log.warning("bal.backward: parameters already hold gradients, so the hook weighs "
                            "the gradient (as with loss.backward()); zero them with "
                            "optimizer.zero_grad() (set_to_none=True, the default) to skip its pass")
            torch.autograd.backward(loss, gradient, **kwargs)
            return
        gradient = weighted_gradient(loss, gradient, weight)
        core.prescaled = True
        try:
            torch.autograd.backward(loss, gradient, **kwargs)
        finally:
            core.prescaled = False

    @property
    def registry(self) -> Type["DDPModels"]:
        """The process's DDP models (:class:`DDPModels`)."""
        return DDPModels

    @staticmethod
    def no_sync_on(model: torch.nn.Module) -> Optional[str]:
        if model.require_backward_grad_sync:
            return None
        return ("ddp.no_sync(), or model.require_backward_grad_sync = False, which nanoGPT sets on "
                "all but a window's last micro-step")

    def check_attach(self, model: torch.nn.Module, balanced: bool = False) -> bool:
        """Refuse what cannot be weighed as the balanced model: not DDP, the balanced or an
        attached model, a model DDP reduces over another process group, and what
        :meth:`admit` refuses (``balanced``: the model has a Balancer of its own)."""
        world = dist.get_world_size(self.settings.group)
        if not isinstance(model, DistributedDataParallel):
            if world == 1:
                return False  # (one process: no all-reduce to weigh)
            raise TypeError(f"bal.attach: with {world} ranks the model must be "
                            f"DistributedDataParallel, got {type(model).__name__}")
        if any(model is m for m in self.models):
            raise ValueError("bal.attach: this model is already weighted by this Balancer "
                             "(the balanced model, or attached before)")
        pg = self.settings.group if self.settings.group is not None else \
            dist.distributed_c10d._get_default_group()
        if model.process_group is not pg:
            raise ValueError("bal.attach: the model's DDP reduces over another process group than "
                             "the Balancer's; wrap it in DistributedDataParallel over the same group")
        self.admit(model, self.settings, balanced)
        return True

    def attach(self, model: torch.nn.Module) -> None:
        """Weigh the DDP ``model`` as the balanced one (checked by :meth:`check_attach`)."""
        blocker = defer_blocker(model, self.settings.group, native=True,
                                emulator=self.settings.emulator, accumulate=self.accumulate,
                                route=self.telemetry.route, micro_steps=self.settings.micro_steps)
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


class DDPModels:
    """The DDP models of the process, known without searching the heap each time: the ones alive
    when the first Balancer of a DDP model is made (found once through the garbage collector's
    traversal, tens of milliseconds in a process with torch loaded), and every one made since,
    seen by a global module-registration hook (torch calls it when a module is assigned to
    another's attribute, as DDP's ``self.module = module``; never in a forward), which also
    counts them, so the step driver can tell by one comparison whether a search for unattached
    models may find a new one. The models are the user's: they are held weakly, so none is kept
    alive by hetlb (a DDP model's reducer must not outlive its process group)."""

    count = 0
    _known: "weakref.WeakSet[DistributedDataParallel]" = weakref.WeakSet()
    _hook: Any = None

    @classmethod
    def watch(cls) -> None:
        """Start watching (once per process)."""
        if cls._hook is None:
            cls._known.update(_ddp_models_alive())
            cls._hook = torch.nn.modules.module.register_module_module_registration_hook(cls._seen)

    @classmethod
    def _seen(cls, module: torch.nn.Module, name: str, submodule: torch.nn.Module) -> None:
        if name == "module" and isinstance(module, DistributedDataParallel):
            cls.count += 1
            cls._known.add(module)

    @classmethod
    def alive(cls) -> List[DistributedDataParallel]:
        return list(cls._known)

    counts_made = True

    @staticmethod
    def entries(model: torch.nn.Module) -> List[torch.nn.Module]:
        return [model]  # (a module inside runs without DDP: its gradient is not reduced at all)

    @staticmethod
    def keys(model: torch.nn.Module) -> Set[int]:
        # By storage: the graph's AccumulateGrad nodes may hand back another Python object for
        # the same parameter, so ids would not match.
        return {p.untyped_storage().data_ptr() for p in model.parameters() if p.numel()}

    @staticmethod
    def key(variable: torch.Tensor) -> int:
        return variable.untyped_storage().data_ptr()


def _ddp_models_alive() -> List[DistributedDataParallel]:
    """The DDP models alive now, found by the collector's traversal (the objects that refer to the
    class, or a subclass, as their type)."""
    import gc
    classes, todo = [], [DistributedDataParallel]
    while todo:
        c = todo.pop()
        classes.append(c)
        todo.extend(c.__subclasses__())
    # (by type: isinstance would ask a dead weak proxy among the referrers, which raises)
    return [o for o in gc.get_referrers(*classes) if type(o) in classes]
