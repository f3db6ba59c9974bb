"""Everything the Balancer attaches to the user's model: the forward check of each batch against
the plan (:class:`StepGate`, which also starts the step's compute clock) and the search for
models of the same wrapper trained unattached (:class:`UnattachedCheck`). The hooks that reduce
the gradient, and the checks of the wrapper, belong to the gradient transport
(:mod:`hetlb.comm.gradients`)."""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import numpy as np
import torch

from hetlb.comm.eager import never_compiled
from hetlb.comm.gradients import GradientTransport, ModelRegistry
from hetlb.comm.hook import StepTelemetry, first_tensor, tensors_in
from hetlb.data.board import PlanBoard, StepPlan
from hetlb.train.errors import BatchSizeError


log = logging.getLogger("hetlb.balancer")

BatchDim = Union[None, int, Callable[[tuple, dict], Optional[int]]]

def not_syncing(how: str) -> str:
    """The error for a forward or step that the wrapper will not synchronise without
    ``accumulate`` (``how``: how its no-sync was switched on, the transport's words)."""
    return (f"hetlb: this model does not synchronise its gradient in this step ({how}). Gradient "
            f"accumulation needs Balancer(..., accumulate=K) with each micro-step in `with "
            f"bal.step():`, which enters no_sync itself on all but the window's last and weights "
            f"the whole window exactly: remove what switches synchronisation off")


def has_balancer(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries a Balancer's forward check (:class:`StepGate`)."""
    return any(isinstance(h, StepGate) for h in model._forward_pre_hooks.values())


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
                 no_sync_on: Callable[[torch.nn.Module], Optional[str]], ends: Any = None) -> None:
        self.board, self.telemetry, self.batch_dim = board, telemetry, batch_dim
        self._no_sync_on = no_sync_on  # (the wrapper's function of the model: see Wrapper)
        self._sizes: Optional[np.ndarray] = None  # the latest plan's sizes and this rank's entry
        self._want = 0
        #: A micro-step's size, expected instead of the plan's entry (None: the plan's).
        self.expect: Optional[int] = None
        #: Inside ``with bal.step():`` (set by the step driver): a forward with gradients there
        #: is the step's in eval() mode too (an evaluation inside it runs under no_grad()).
        self.marked = False
        #: One process: the handle of the same Balancer's :class:`hetlb.comm.local.BackwardEnd` hooks, removed
        #: with this gate when a new Balancer takes the module over.
        self.ends = ends

    @never_compiled
    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        plan = self.board.current
        if plan is None or not torch.is_grad_enabled() or \
                not (module.training or self.marked or self.expect is not None):
            return  # (an evaluation: a forward in eval() mode outside a marked step)
        off = self._no_sync_on(module)
        if self.expect is not None:
            pass  # (a micro-step of bal.micro_steps, which switches the no-sync itself)
        elif self.board.accumulate > 1:
            if not self.telemetry.core.open:
                raise RuntimeError(
                    f"hetlb: with accumulate={self.board.accumulate} every micro-step runs inside "
                    f"`with bal.step():` (it enters no_sync on all but a window's last "
                    f"micro-step and weights the whole window)")
            if plan.window_end and off is not None:
                raise RuntimeError(f"hetlb: the last micro-step of an accumulation window must "
                                   f"synchronise; do not switch synchronisation off around `with "
                                   f"bal.step():` ({off}): bal.step() manages it")
        elif off is not None:
            raise RuntimeError(not_syncing(off))
        if self.batch_dim is not None:
            n = self._size(args, kwargs)
            want = self._planned(plan.sizes) if self.expect is None else self.expect
            if n is not None and n != want:
                raise BatchSizeError(self._wrong_size(plan, n, module.training))
        self.telemetry.restart_clock()

    def _wrong_size(self, plan: StepPlan, n: int, training: bool = True) -> str:
        """What a batch of ``n`` samples against ``plan`` most likely means, and what to do."""
        rank, want = self.board.rank, self._planned(plan.sizes)
        if self.expect is not None:
            return (f"hetlb: rank {rank} gave the model a batch of {n} samples inside "
                    f"bal.micro_steps(fn, ...), whose micro-step handed fn {self.expect}: run the "
                    f"model on fn's arguments, not on the whole batch")
        head = (f"hetlb: rank {rank} gave the model a batch of {n} samples, but the Balancer "
                f"planned {want} for it in step {plan.step} of epoch {plan.epoch} (sizes "
                f"{plan.sizes.tolist()}). ")
        if not training:
            head += ("The model is in eval() mode inside `with bal.step():`, where a forward with "
                     "gradients is taken for the step's: run an evaluation there under "
                     "torch.no_grad(), or outside the step. ")
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
    """Forward pre-hook, during one step, on the balanced model and on every other model of its
    wrapper alive then without a Balancer of its own
    (:attr:`hetlb.comm.gradients.GradientTransport.registry`): refuses an other model that trains
    on the step's samples unattached, whose gradient its wrapper would average over the ranks'
    uneven batches, unweighted. The steps it runs in are :class:`ModelHooks`' to choose.

    "On the step's samples" is read off its forward's inputs against the balanced model's: a
    tensor of the same storage (two branches on one batch: whichever runs first), or a gradient
    path from one model's parameters into the other's inputs (an encoder and a head, a GAN's
    generator and discriminator, either way round). Another model trained on batches of its
    own (a separate loop interleaved with this one) is left alone. "Trains" means a forward
    with gradients enabled and parameters that require them, in ``train()`` or ``eval()`` mode
    alike (a model fine-tuned in eval mode is trained all the same; a teacher runs under
    ``torch.no_grad()``). An other model is watched at each of its registry's entries (a sharded
    model's inner FSDP modules, which reduce their gradients when run on their own), the inner
    ones only outside the model's own forward. What it finds is kept
    (:attr:`found`) and agreed between the ranks when the step ends, so every rank raises there
    if any rank found one. Per model and for one step: a hook every step, or a global one, would
    cost forwards (a global forward hook sends every module through torch's slow path, and
    ``torch.compile(module)`` warns of one)."""

    def __init__(self, balanced: torch.nn.Module, others: List[torch.nn.Module],
                 inner: Callable[[torch.nn.Module], torch.nn.Module], registry: ModelRegistry) -> None:
        self.balanced, self.others, self.inner, self.registry = balanced, others, inner, registry
        # The inputs' storages, each with a tensor on it: held for the step, so no later tensor
        # can be allocated at the same address and pass for the same samples.
        self.storages: Dict[int, torch.Tensor] = {}  # the balanced model's inputs
        self.seen: Dict[int, Tuple[torch.Tensor, torch.nn.Module]] = {}  # the other models'
        #: The class of the first unattached model found training on the step's samples.
        self.found: Optional[str] = None
        self.handles: List[Any] = []
        self.inner_entries: Set[int] = set()  # ids of other models' entries inside them
        self.running: Set[int] = set()  # ids of other models whose forward runs (inner entries: skipped)

    @classmethod
    def watch(cls, balanced: torch.nn.Module, transport: GradientTransport,
              inner: Callable[[torch.nn.Module], torch.nn.Module]) -> "UnattachedCheck":
        """The hook, registered on the balanced model and the transport's other models but
        those with a Balancer of their own (:meth:`remove` when the step ends)."""
        known, registry = transport.models, transport.registry
        others = [o for o in registry.alive()
                  if not any(o is m for m in known) and not has_balancer(o)]
        hook = cls(balanced, others, inner, registry)
        inside = [e for o in others for e in registry.entries(o) if e is not o]
        hook.inner_entries = {id(e) for e in inside}
        # First among the models' pre-hooks: the caller's tensors, before a wrapper's own hook
        # casts or moves them (FSDP2's MixedPrecisionPolicy makes a copy of each input).
        hook.handles = [m.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
                        for m in [balanced] + others + inside]
        if inside:
            hook.handles += [h for o in others for h in (
                o.register_forward_pre_hook(hook.enter),
                o.register_forward_hook(hook.leave, always_call=True))]
        return hook

    @never_compiled
    def enter(self, module: torch.nn.Module, args: tuple) -> None:
        self.running.add(id(module))

    @never_compiled
    def leave(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self.running.discard(id(module))  # (also after a forward that raised)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    @never_compiled
    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or (self.running and id(module) in self.inner_entries):
            return
        tensors = {a: t for t in tensors_in((args, kwargs)) if t.numel()
                   for a in [storage_address(t)] if a is not None}
        upstream = parameters_upstream(list(tensors.values()), self.registry.key)
        # (the parameters' keys now: a sharded model's exist once its first forward ran)
        if module is self.balanced:
            self.storages.update(tensors)
            owner = {k: m for m in self.others for k in self.registry.keys(m)}
            hit = [owner[p] for p in upstream if p in owner] + \
                [self.seen[s][1] for s in tensors if s in self.seen]
            if hit and self.found is None:
                self.found = type(self.inner(hit[0])).__name__
            return
        if not any(p.requires_grad for p in module.parameters()):
            return
        if self.found is None and (any(s in self.storages for s in tensors) or
                                   upstream & self.registry.keys(self.balanced)):
            self.found = type(self.inner(module)).__name__
        for ptr, t in tensors.items():
            self.seen[ptr] = (t, module)


def storage_address(t: torch.Tensor) -> Optional[int]:
    """The address of ``t``'s storage; None for a tensor without one of its own (a DTensor,
    a wrapper of other tensors)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def parameters_upstream(tensors: List[torch.Tensor], key: Callable[[torch.Tensor], int]) -> set:
    """The keys (``key``) of the leaf tensors (parameters) whose gradients flow into ``tensors``."""
    out, todo, done = set(), [t.grad_fn for t in tensors if t.grad_fn is not None], set()
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in done:
            continue
        done.add(id(fn))
        var = getattr(fn, "variable", None)  # an AccumulateGrad node: its parameter
        if var is not None and var.numel():
            out.add(key(var))
        todo.extend(f for f, _ in fn.next_functions)
    return out


def unattached_message(wrapper: str, name: str, ranks: List[int], step: int,
                       counts_made: bool = True) -> str:
    made = " and in the step after such a model is made" if counts_made else ""
    return (f"hetlb: a second {wrapper} model ({name}; seen on ranks {ranks}) trains on this "
            f"Balancer's samples without being attached to it: its wrapper reduced its gradient "
            f"without the Balancer's weights over the ranks' uneven batches, which is not the "
            f"mean over the step's samples "
            f"(found in step {step}, refused at its end; the Balancer looks in steps 0, 1, 2, 4, "
            f"8, ...{made}). Attach it to the Balancer on every rank before it trains, "
            f"bal.attach(model): its gradient is then weighted as the balanced model's. A model "
            f"that is not trained (a teacher, in eval() mode or not) runs under torch.no_grad() "
            f"or with its parameters frozen (requires_grad_(False))")


class ModelHooks:
    """The Balancer's hooks on the balanced model, and their lifetimes: the :class:`StepGate`
    (every balanced model), and where its transport has a :attr:`~GradientTransport.registry` of models, the
    :class:`UnattachedCheck` in the steps that look for models trained unattached: the first, the
    step after a model of the wrapper was made (the registry's count changed), and the
    steps numbered by a power of two (1, 2, 4, ...: a model made earlier that starts training
    later is found within as many steps as it trained). Each costs a forward hook on the other
    models for the step and a gather of what the ranks found (a DDP transport's first search in
    the process also a traversal of the heap: :class:`hetlb.comm.ddp.DDPModels`); the other steps
    one comparison. (What reduces the gradient is the gradient transport's:
    :mod:`hetlb.comm.gradients`.)

    Args:
        model: the balanced model.
        telemetry, board: what the gate checks batches against and whose clock it starts.
        transport: the model's gradient transport (its other models).
        wrapper: its class (:class:`hetlb.comm.gradients.Wrapper`: the user's module inside a
            model of the wrapper, for messages; whether the wrapper's no-sync is on).
        batch_dim: see :class:`hetlb.Balancer`.
        ends: a handle removed with the gate when a new Balancer takes a plain module over (the
            :class:`hetlb.comm.local.LocalTransport`'s gradient hook), or None.
    """

    def __init__(self, model: torch.nn.Module, telemetry: StepTelemetry, board: PlanBoard, *,
                 transport: GradientTransport, wrapper: Any, batch_dim: BatchDim,
                 ends: Any = None) -> None:
        self.model, self.transport, self.inner = model, transport, wrapper.inner
        #: The process's models of the wrapper (None: steps look for none trained unattached).
        self.registry = transport.registry
        self.searches = self.registry is not None
        #: The registry's count of models made when the latest search started.
        self.made = self.registry.count if self.searches else 0
        self._unattached: Optional[UnattachedCheck] = None  # its hooks while that step is open
        #: Whether the step about to run searches for models trained unattached (the first
        #: step, a step the driver names, again after a discarded one). An attribute: the driver
        #: reads it every step.
        self.wants_check = self.searches
        self._gate_check = StepGate(board, telemetry, batch_dim, wrapper.no_sync_on, ends)
        self._gate = model.register_forward_pre_hook(self._gate_check, with_kwargs=True)

    def expect(self, n: Optional[int]) -> None:
        """The forward check expects ``n`` samples (a micro-step's) instead of the plan's entry
        for this rank, until called with None."""
        self._gate_check.expect = n

    def mark(self, inside: bool) -> None:
        """Whether a ``with bal.step():`` block runs: the forward check then takes a forward with
        gradients in eval() mode for the step's (checked, and its clock started)."""
        self._gate_check.marked = inside

    def remove(self) -> None:
        """Take the forward check off (a Balancer refused after making it)."""
        self._gate.remove()

    def take_over(self) -> None:
        """One process: this Balancer's gate replaces any earlier Balancer's on the module."""
        take_over(self.model, keep=self._gate.id)

    def start_check(self) -> None:
        """Search the step about to run for models trained unattached, besides the transport's
        own (the balanced model and those attached to it)."""
        self.made = self.registry.count
        self._unattached = UnattachedCheck.watch(self.model, self.transport, self.inner)
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
