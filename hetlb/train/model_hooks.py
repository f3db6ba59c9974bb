"""Everything the Balancer attaches to the user's model: the forward check of each batch against
the plan (:class:`StepGate`, which also starts the step's compute clock), the search for DDP
models trained unattached (:class:`UnattachedCheck`), and the refusals of models the Balancer
cannot train. The hooks that reduce the gradient belong to the gradient transport
(:mod:`hetlb.comm.gradients`)."""
from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from hetlb.comm.eager import never_compiled
from hetlb.comm.hook import StepTelemetry, first_tensor, tensors_in
from hetlb.data.board import PlanBoard, StepPlan
from hetlb.train.errors import BatchSizeError


log = logging.getLogger("hetlb.balancer")

BatchDim = Union[None, int, Callable[[tuple, dict], Optional[int]]]

#: The error for a forward or step that DDP will not synchronise without ``accumulate``.
NOT_SYNCING = ("hetlb: this DDP model does not synchronise its gradient in this step "
               "(ddp.no_sync(), or model.require_backward_grad_sync = False, which nanoGPT sets "
               "on all but a window's last micro-step). Gradient accumulation needs "
               "Balancer(..., accumulate=K) with each micro-step in `with bal.step():`, which "
               "enters no_sync itself on all but the window's last and weights the whole window "
               "exactly: remove the no_sync() or the require_backward_grad_sync lines")


def check_model(model: torch.nn.Module, is_ddp: bool, accumulate: int) -> None:
    """Refuse, before anything touches it, a model this Balancer could not train correctly: a
    DDP model that already has a Balancer or a communication hook of its own, sparse gradients
    on a DDP model, DDP's static graph with accumulation. (A plain module, one process, may get
    a new Balancer: :func:`take_over` then removes the earlier one's forward check.)"""
    if not is_ddp:
        return
    if any(isinstance(h, StepGate) for h in model._forward_pre_hooks.values()):
        raise ValueError(
            "this model already has a Balancer (its hooks stay on the model for the model's life; "
            "DDP cannot remove a communication hook): make one Balancer per DDP model. To change "
            "the policy or the settings, wrap the module in a new DistributedDataParallel and "
            "make the new Balancer for that")
    if getattr(model, "_comm_hooks", None):
        raise ValueError(
            "a communication hook is already registered on this DDP model; DDP takes one hook, and "
            "the Balancer needs its own (it weighs each rank's gradient by its batch once the "
            "batches differ). Make the Balancer for a DDP model without a hook of your own")
    sparse = [name or type(m).__name__ for name, m in model.module.named_modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
              and m.weight.requires_grad]  # (a frozen one gives DDP no gradient)
    if sparse:
        raise ValueError(
            f"the model has sparse gradients ({', '.join(sparse[:3])}"
            f"{', ...' if len(sparse) > 3 else ''}: sparse=True): the Balancer weighs and "
            f"all-reduces dense gradient buckets only. Build the embeddings with sparse=False")
    if accumulate > 1 and getattr(model, "static_graph", False):
        raise ValueError(
            f"accumulate={accumulate} enters ddp.no_sync() on all but a window's last micro-step, "
            f"which DDP(static_graph=True) does not support (torch fails with an internal "
            f"assertion): build the DDP model with static_graph=False")


def single_sample_layers(model: torch.nn.Module) -> List[str]:
    """Names of the layers of ``model`` that refuse a batch of one sample in training: batch
    normalisation over inputs ``(N, C)`` sees one value per channel there (torch raises
    "Expected more than 1 value per channel when training"). Found by type: every
    ``BatchNorm1d`` (its input may be ``(N, C)``; on ``(N, C, L)`` with ``L > 1`` one sample
    would do, which the type cannot tell); not ``BatchNorm2d``/``3d``, whose inputs have spatial
    dimensions, nor ``SyncBatchNorm``, whose statistics span the ranks."""
    bn1d = (torch.nn.BatchNorm1d, torch.nn.LazyBatchNorm1d)
    return [name or type(m).__name__ for name, m in model.named_modules() if isinstance(m, bn1d)]


def layer_list(names: List[str]) -> str:
    """``names`` as a message lists them (the first three)."""
    return "BatchNorm1d: " + ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def take_over(model: torch.nn.Module, keep: int) -> None:
    """Remove an earlier Balancer's forward check from a plain module (one process, no
    communication hook): the new Balancer's board (its gate's handle id ``keep``) is the one its
    batches follow from now on. Called once the new Balancer is accepted: a refused one leaves
    the earlier one working."""
    for key in [k for k, h in model._forward_pre_hooks.items()
                if isinstance(h, StepGate) and k != keep]:
        ends = model._forward_pre_hooks[key].ends
        if ends is not None:  # (else the old telemetry stays held by the parameters' hooks)
            ends.remove()
        del model._forward_pre_hooks[key]
        model._forward_pre_hooks_with_kwargs.pop(key, None)


class CopiedGate:
    """The forward pre-hook of a copy of a balanced model (``copy.deepcopy``, ``torch.save``):
    it checks nothing, since no Balancer drives the copy (an EMA model, say)."""

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        return None


class StepGate:
    """Forward pre-hook on the model: the batch must be the one planned for this rank, and the
    step's compute clock starts at its first forward. Holds the board and the telemetry only.
    A copy of the model gets a :class:`CopiedGate` instead (the telemetry holds native state
    that does not copy, and the copy is not the Balancer's)."""

    def __reduce__(self) -> Any:
        return (CopiedGate, ())

    def __init__(self, board: PlanBoard, telemetry: StepTelemetry, batch_dim: BatchDim,
                 ends: Any = None) -> None:
        self.board, self.telemetry, self.batch_dim = board, telemetry, batch_dim
        self._sizes: Optional[np.ndarray] = None  # the latest plan's sizes and this rank's entry
        self._want = 0
        #: One process: the handle of the same Balancer's :class:`hetlb.comm.gradients.BackwardEnd` hooks, removed
        #: with this gate when a new Balancer takes the module over.
        self.ends = ends

    @never_compiled
    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        plan = self.board.current
        if plan is None or not module.training or not torch.is_grad_enabled():
            return
        syncing = getattr(module, "require_backward_grad_sync", True)
        if self.board.accumulate > 1:
            if not self.telemetry.core.open:
                raise RuntimeError(
                    f"hetlb: with accumulate={self.board.accumulate} every micro-step runs inside "
                    f"`with bal.step():` (it enters ddp.no_sync() on all but a window's last "
                    f"micro-step and weights the whole window)")
            if plan.window_end and not syncing:
                raise RuntimeError("hetlb: the last micro-step of an accumulation window must "
                                   "synchronise; do not wrap `with bal.step():` in ddp.no_sync() "
                                   "(bal.step() manages it)")
        elif not syncing:
            raise RuntimeError(NOT_SYNCING)
        if self.batch_dim is not None:
            n = self._size(args, kwargs)
            if n is not None and n != self._planned(plan.sizes):
                raise BatchSizeError(self._wrong_size(plan, n))
        self.telemetry.restart_clock()

    def _wrong_size(self, plan: StepPlan, n: int) -> str:
        """What a batch of ``n`` samples against ``plan`` most likely means, and what to do."""
        rank, want = self.board.rank, self._planned(plan.sizes)
        head = (f"hetlb: rank {rank} gave the model a batch of {n} samples, but the Balancer "
                f"planned {want} for it in step {plan.step} of epoch {plan.epoch} (sizes "
                f"{plan.sizes.tolist()}). ")
        last = self.board.last_sizes
        if last is not None and n == int(last[rank]):
            return head + (
                f"{n} is the size planned for this rank in the previous step: the batch was drawn "
                f"before this step's decision (a prefetch, such as a loop that samples its next "
                f"batch inside the step, as nanoGPT's get_batch after the forward). The sizes of a "
                f"step are decided when the previous step ends: draw each batch after it, sized "
                f"by bal.batch_sizes[bal.rank] read between steps (or use the Balancer's loader, "
                f"which prefetches safely). If the batches come from a sampler of their own (e.g. "
                f"DistributedSampler), use the Balancer's loader instead: the gradient weights "
                f"follow the plan")
        return head + (
            "Feed the model the batches of the Balancer's loader, or, in a loop that samples its "
            "own batches, batches of bal.batch_sizes[bal.rank] samples read at the start of each "
            "step: with another sampler (e.g. DistributedSampler) the gradient weights would be "
            "wrong. If the batch dimension is not the first dimension of the first tensor "
            "argument, pass Balancer(..., batch_dim=1) or a callable (args, kwargs) -> size; "
            "batch_dim=None turns this check off")

    def _planned(self, sizes: np.ndarray) -> int:
        """This rank's entry of a plan's ``sizes`` (read-only, shared by the steps of a decision:
        looked up once per array, as a NumPy index is dear with cold caches)."""
        if sizes is not self._sizes:
            self._sizes, self._want = sizes, int(sizes[self.board.rank])
        return self._want

    def _size(self, args: tuple, kwargs: dict) -> Optional[int]:
        if callable(self.batch_dim):
            n = self.batch_dim(args, kwargs)
            return None if n is None else int(n)
        t = args[0] if args and isinstance(args[0], torch.Tensor) else first_tensor(args)
        if t is None:
            t = first_tensor(kwargs)
        if t is None or t.dim() <= self.batch_dim:
            return None
        return int(t.shape[self.batch_dim])


class UnattachedCheck:
    """Forward pre-hook, during one step, on the balanced model and on every other DDP model
    alive then without a Balancer of its own (:func:`ddp_models`): refuses an other model that
    trains on the step's samples unattached, whose gradient DDP would average over the ranks'
    uneven batches, unweighted. The steps it runs in are :class:`ModelHooks`' to choose.

    "On the step's samples" is read off its forward's inputs against the balanced model's: a
    tensor of the same storage (two branches on one batch: whichever runs first), or a gradient
    path from one model's parameters into the other's inputs (an encoder and a head, a GAN's
    generator and discriminator, either way round). Another DDP model trained on batches of its
    own (a separate loop interleaved with this one) is left alone. What it finds is kept
    (:attr:`found`) and agreed between the ranks when the step ends, so every rank raises there
    if any rank found one. Per model and for one step: a hook every step, or a global one, would
    cost forwards (a global forward hook sends every module through torch's slow path, and
    ``torch.compile(module)`` warns of one)."""

    def __init__(self, balanced: torch.nn.Module, others: List[torch.nn.Module]) -> None:
        self.balanced = balanced
        # Parameters by their storage: the graph's AccumulateGrad nodes may hand back another
        # Python object for the same parameter, so ids would not match.
        self.owner = {storage_address(p): m for m in others for p in m.parameters() if p.numel()}
        self.mine = {storage_address(p) for p in balanced.parameters() if p.numel()}
        # The inputs' storages, each with a tensor on it: held for the step, so no later tensor
        # can be allocated at the same address and pass for the same samples.
        self.storages: Dict[int, torch.Tensor] = {}  # the balanced model's inputs
        self.seen: Dict[int, Tuple[torch.Tensor, torch.nn.Module]] = {}  # the other models'
        #: The class of the first unattached model found training on the step's samples.
        self.found: Optional[str] = None
        self.handles: List[Any] = []

    @classmethod
    def watch(cls, balanced: torch.nn.Module, known: List[torch.nn.Module]) -> "UnattachedCheck":
        """The hook, registered on the balanced model and the other DDP models (:meth:`remove`
        when the step ends)."""
        others = [o for o in ddp_models() if not any(o is m for m in known)
                  and not any(isinstance(h, StepGate) for h in o._forward_pre_hooks.values())]
        hook = cls(balanced, others)
        hook.handles = [m.register_forward_pre_hook(hook, with_kwargs=True)
                        for m in [balanced] + others]
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    @never_compiled
    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not module.training or not torch.is_grad_enabled():
            return
        tensors = {storage_address(t): t for t in tensors_in((args, kwargs)) if t.numel()}
        upstream = parameters_upstream(list(tensors.values()))
        if module is self.balanced:
            self.storages.update(tensors)
            hit = [self.owner[p] for p in upstream if p in self.owner] + \
                [self.seen[s][1] for s in tensors if s in self.seen]
            if hit and self.found is None:
                self.found = type(hit[0].module).__name__
            return
        if not any(p.requires_grad for p in module.parameters()):
            return
        if (any(s in self.storages for s in tensors) or upstream & self.mine) and self.found is None:
            self.found = type(module.module).__name__
        for ptr, t in tensors.items():
            self.seen[ptr] = (t, module)


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


def ddp_models() -> List[DistributedDataParallel]:
    """Every DDP model alive in the process (:class:`DDPModels`)."""
    DDPModels.watch()
    return DDPModels.alive()


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


def storage_address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def parameters_upstream(tensors: List[torch.Tensor]) -> set:
    """Storage addresses of the leaf tensors (parameters) whose gradients flow into ``tensors``."""
    out, todo, done = set(), [t.grad_fn for t in tensors if t.grad_fn is not None], set()
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in done:
            continue
        done.add(id(fn))
        var = getattr(fn, "variable", None)  # an AccumulateGrad node: its parameter
        if var is not None and var.numel():
            out.add(storage_address(var))
        todo.extend(f for f, _ in fn.next_functions)
    return out


def unattached_message(name: str, ranks: List[int], step: int) -> str:
    return (f"hetlb: a second DistributedDataParallel model ({name}; seen on ranks {ranks}) trains "
            f"on this Balancer's samples without being attached to it: DDP averaged its gradient "
            f"over the ranks' uneven batches unweighted, which is not the mean over the step's "
            f"samples (found in step {step}, refused at its end; the Balancer looks in steps 0, "
            f"1, 2, 4, 8, ... and in the step after a DDP model is made). Attach it to the "
            f"Balancer on every rank before it trains, bal.attach(model): its gradient is then "
            f"weighted as the balanced model's")


class ModelHooks:
    """The Balancer's hooks on the balanced model, and their lifetimes: the :class:`StepGate`
    (every balanced model), and for a DDP model the :class:`UnattachedCheck` in the steps that
    look for models trained unattached: the first, the step after a DDP model was made (the
    process's count of them changed: :attr:`DDPModels.count`), and the steps numbered by a power of two
    (1, 2, 4, ...: a model made earlier that starts training later is found within as many steps
    as it trained). Each costs a forward hook on the other DDP models for the step and a gather of
    what the ranks found (the first Balancer's first search also a traversal of the heap:
    :class:`DDPModels`); the other steps one comparison. (What reduces the gradient is the gradient transport's:
    :mod:`hetlb.comm.gradients`.)

    Args:
        model: the balanced model.
        telemetry, board: what the gate checks batches against and whose clock it starts.
        is_ddp: whether the model is DDP (its first step looks for models trained unattached).
        batch_dim: see :class:`hetlb.Balancer`.
        ends: a handle removed with the gate when a new Balancer takes a plain module over (the
            :class:`hetlb.comm.gradients.LocalTransport`'s gradient hook), or None.
    """

    def __init__(self, model: torch.nn.Module, telemetry: StepTelemetry, board: PlanBoard, *,
                 is_ddp: bool, batch_dim: BatchDim, ends: Any = None) -> None:
        self.model = model
        #: Whether steps look for DDP models trained unattached (a DDP model's).
        self.searches = is_ddp
        if is_ddp:
            DDPModels.watch()
        #: The count of DDP models made (:attr:`DDPModels.count`) when the latest search started.
        self.made = DDPModels.count
        self._unattached: Optional[UnattachedCheck] = None  # its hooks while that step is open
        #: Whether the step about to run searches for DDP models trained unattached (the first
        #: step, a step the driver names, again after a discarded one). An attribute: the driver
        #: reads it every step.
        self.wants_check = is_ddp
        self._gate = model.register_forward_pre_hook(StepGate(board, telemetry, batch_dim, ends),
                                                     with_kwargs=True)

    def remove(self) -> None:
        """Take the forward check off (a Balancer refused after making it)."""
        self._gate.remove()

    def take_over(self) -> None:
        """One process: this Balancer's gate replaces any earlier Balancer's on the module."""
        take_over(self.model, keep=self._gate.id)

    def start_check(self, known: List[torch.nn.Module]) -> None:
        """Search the step about to run for DDP models trained unattached, besides the ``known``
        ones (the balanced model and those attached to it)."""
        self.made = DDPModels.count
        self._unattached = UnattachedCheck.watch(self.model, known)
        self.wants_check = False

    @property
    def checking(self) -> bool:
        """Whether the open step searches for unattached models."""
        return self._unattached is not None

    def end_check(self) -> Optional[str]:
        """Stop the open step's search; the class of an unattached model it found, or None."""
        found = self._unattached.found if self._unattached is not None else None
        self._unattached.remove()
        self._unattached = None
        return found

    def stop_check(self) -> None:
        """Take the search's hooks off (its step was discarded; the next step searches instead)."""
        if self._unattached is not None:
            self._unattached.remove()
            self._unattached = None
            self.wants_check = True
