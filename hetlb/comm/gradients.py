"""Gradient transports: how one rank's weighted gradient reaches the other ranks.

A gradient transport owns everything about its model wrapper: the checks of the model
(:meth:`Wrapper.admit`), what it can do for the telemetry table, agreed between the ranks at
start-up (:meth:`Wrapper.capabilities`), the hooks that weigh and reduce the gradient and mark
the end of a step's backward, the attached models, its local (no-sync) context, the context of
a step run as micro-steps (:meth:`GradientTransport.micro_window`), the detection of the
wrapper's own no-sync switched on around it (:meth:`Wrapper.no_sync_on`), and what profiling a
model whose step binds the ranks needs (:meth:`Wrapper.trial`).
The step driver (:class:`hetlb.train.steps.StepDriver`) runs every step through one, and nothing
in ``train/`` or ``data/`` asks which wrapper a model has.

The step driver tells the transport each step's weight before the step runs, asks it for the
context of a micro-step whose gradient stays local, hands it the loss of
:meth:`hetlb.Balancer.backward`, and asks whether the step's gradient reduction delivered the
telemetry table (else the driver all-reduces the row at the step's end, by the side route).

The transports (chosen by the model's type, :mod:`hetlb.comm.wrappers`):

* :class:`hetlb.comm.ddp.DDPTransport`: a ``DistributedDataParallel`` model. Its communication
  hook multiplies each bucket by the rank's weight and sums (or, deferred, DDP's own mean while
  the weights are equal), and delivers the table with the gradient.
* :class:`hetlb.comm.local.LocalTransport`: one process with a plain module. Nothing is reduced;
  the end of the backward ends the step's compute.

A wrapper without a communication hook (FSDP2's ``fully_shard``) weighs on the loss side instead:
its transport scales the loss by the weight in :meth:`GradientTransport.backward`, reduces with a
plain sum, and leaves the table to the side route (``delivers_table`` False).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager, Dict, List, Optional, Protocol, Set

import torch

if TYPE_CHECKING:
    from hetlb.data.board import StepPlan


@dataclass(frozen=True)
class WrapperSettings:
    """What a transport is told of the Balancer's settings (the same on every rank, but for
    ``group``'s handle): ``group`` the process group (None: the world), ``native`` the native
    hook (False: the Python reference), ``accumulate`` micro-steps per window, ``emulator`` a
    :class:`hetlb.sim.emulate.Emulator` or None, ``route`` the route asked for the telemetry
    table ("carry", "side" or None), ``micro_steps`` whether steps may run as several
    micro-steps (:meth:`hetlb.Balancer.micro_steps`)."""

    group: Any = None
    native: bool = True
    accumulate: int = 1
    emulator: Any = None
    route: Optional[str] = None
    micro_steps: bool = False


class Wrapper(Protocol):
    """What a transport's class says of a model before the transport is made (the start-up)."""

    #: The wrapper's name in messages and in the start-up agreement (ranks must agree on it).
    name: str
    #: Whether a model that already has a Balancer may get a new one (which then takes the
    #: model over); False where the earlier one's hooks cannot come off.
    takes_over: bool

    @staticmethod
    def admit(model: torch.nn.Module, settings: WrapperSettings, balanced: bool) -> None:
        """Refuse (``ValueError``) a model this transport could not train correctly, before
        anything touches it; ``balanced``: the model already has a Balancer's hooks. May keep
        what the model needs to be released safely (process groups)."""

    @staticmethod
    def capabilities(model: torch.nn.Module, settings: WrapperSettings) -> Dict[str, Optional[str]]:
        """This rank's entry of the start-up agreement, each a reason or None: ``carry`` why
        the table cannot ride in the gradient's reduction, ``carry_penalty`` why carrying it
        would cost more than the side route, ``defer`` why the hook cannot wait for the first
        step whose weights differ."""

    @staticmethod
    def inner(model: torch.nn.Module) -> torch.nn.Module:
        """The user's module inside the wrapper (its layers are the ones trained)."""

    @staticmethod
    def trial(model: torch.nn.Module, device: torch.device) -> Optional["ProfileTrial"]:
        """What :func:`hetlb.profile` (``model=``) needs to time a step of ``model`` whose
        collectives bind the ranks, or None where a step of it communicates nothing (one
        process). ``device`` is the one the profile times (a CUDA device by events on its
        stream: the waits are timed there too). Raises ``ValueError`` where profiling the
        wrapped model is the wrong thing (DDP: profile its ``module``)."""

    @staticmethod
    def no_sync_on(model: torch.nn.Module) -> Optional[str]:
        """Whether the wrapper's no-sync is switched on for ``model`` (by the user, or by the
        transport's :meth:`GradientTransport.local` inside a window): how a user switches it
        on, for the step driver's messages, or None while the wrapper synchronises. A function
        of the model alone: the forward check on the model holds it, and holds no transport
        (which holds the model)."""


class ProfileTrial(Protocol):
    """The ranks of a model whose every step communicates (FSDP2), profiled together: they try
    the same sizes, agree after each whether it fit everywhere, and each times its own compute
    without its waits for the others. Made by :meth:`Wrapper.trial`; the collectives run on the
    model's group, with its timeout."""

    #: What the profile's limit depends on besides the host (for its cache): the wrapper, the
    #: number of ranks, the sharding settings.
    key: str

    def same_sizes(self, sizes: List[int]) -> None:
        """Raise ``ValueError`` on every rank unless every rank is about to try ``sizes``."""

    def agree(self, go: bool) -> bool:
        """Whether every rank says ``go`` (a collective every rank calls)."""

    def start(self) -> None:
        """A timed step is about to run: forget the waits so far."""

    def waited(self) -> float:
        """Seconds this rank waited for the others in the model's collectives since
        :meth:`start`, on the profile's clock (the device's stream where it times a CUDA device;
        read after the step's end was waited for)."""

    def close(self) -> None:
        """Remove what the trial put on the model."""


class ModelRegistry(Protocol):
    """The models of one wrapper in the process, and how a backward graph names their
    parameters."""

    #: How many the process has made so far (a search for unattached ones is due when it changes;
    #: an attribute, as the step driver compares it every step).
    count: int
    #: Whether :attr:`count` follows the models as they are made (else it stays, and the searches
    #: run only in their fixed steps).
    counts_made: bool

    def alive(self) -> List[torch.nn.Module]:
        """Every one alive now (roots: no model inside another)."""

    def entries(self, model: torch.nn.Module) -> List[torch.nn.Module]:
        """The modules of ``model`` (one of :meth:`alive`) that reduce their gradients when run on
        their own: ``model`` first, then any inner one (a sharded model's inner FSDP modules:
        ``teacher.encoder(x)`` reduces the encoder's gradients without ``teacher``'s forward)."""

    def keys(self, model: torch.nn.Module) -> Set[int]:
        """``model``'s parameters as :meth:`key` names them in a backward graph (those it has
        now: a sharded model's unsharded parameters exist once it ran a forward)."""

    def key(self, variable: torch.Tensor) -> int:
        """The key of the parameter an AccumulateGrad node of a backward graph holds."""


class GradientTransport(Protocol):
    """What the step driver needs of the model wrapper that reduces the gradient. A transport
    also ends each step's compute when the step's backward is done (on the telemetry core:
    ``last_ready``/``mark_reduced``), so a loop left after a backward keeps the step trained."""

    #: The wrapper's name in messages.
    name: str
    #: Whether a loop may clear a window's gradients between the next window's first forward and
    #: its backward (the wrapper leaves them in the parameters through a forward), so the step
    #: driver checks that they were cleared when that backward starts; else before the forward.
    clears_after_forward: bool

    @property
    def models(self) -> List[torch.nn.Module]:
        """The models whose gradients it reduces: the balanced one first, then attached ones."""

    @property
    def delivers_table(self) -> bool:
        """Whether a step's gradient reduction delivers the telemetry table (False: the driver
        all-reduces the row itself when the step ends)."""

    @property
    def registry(self) -> Optional["ModelRegistry"]:
        """The process's models of this wrapper, for the step driver's search for models
        trained on the step's samples but not attached (None: no such model can exist)."""

    @staticmethod
    def no_sync_on(model: torch.nn.Module) -> Optional[str]:
        """:meth:`Wrapper.no_sync_on` (the transport is its wrapper's class)."""

    def local_grads(self) -> List[Optional[torch.Tensor]]:
        """This rank's own part of each of the balanced model's parameters' gradients (None
        where it has none), the tensors themselves: the step driver's checks read them, and must
        run no collective (a sharded gradient's shard, not the whole)."""

    def before_step(self, plan: "StepPlan", weight: float, equal: bool) -> None:
        """The step of ``plan`` is about to run with this rank's aggregation ``weight``;
        ``equal``: every rank's weight is the same."""

    def local(self) -> ContextManager[Any]:
        """The context of a micro-step whose gradient stays on this rank (accumulation)."""

    def micro_window(self) -> ContextManager[Any]:
        """The context of one step run as micro-steps (:meth:`hetlb.Balancer.micro_steps`),
        entered around them all, in which the ranks' numbers of micro-steps may differ: the
        wrapper communicates nothing in a micro-step under :meth:`local`, nor in a forward after
        the step's first."""

    def window_done(self, weight: float) -> None:
        """The backward of a window's last micro-step ran: apply ``weight`` to the window's
        gradient where the reduction did not (one process: a short window's share)."""

    def backward(self, loss: torch.Tensor, gradient: Optional[torch.Tensor], weight: float,
                 window: bool = False, **kwargs: Any) -> None:
        """:meth:`hetlb.Balancer.backward`: the backward of ``loss`` with ``weight`` applied
        where this transport applies it; ``window``: one of several backward passes whose
        gradients one reduction sums (accumulation, micro-steps)."""

    def check_attach(self, model: torch.nn.Module, balanced: bool) -> bool:
        """Refuse (``TypeError``/``ValueError``) a model :meth:`attach` cannot weigh as the
        balanced one (``balanced``: it has a Balancer of its own); False where there is nothing
        to weigh (one process)."""

    def attach(self, model: torch.nn.Module) -> None:
        """Reduce another model trained on the same batches with the same weight."""

    def remove(self) -> None:
        """Take off what can be taken off (a Balancer refused after registering)."""


def weighted_gradient(loss: torch.Tensor, gradient: Optional[torch.Tensor],
                      weight: float) -> torch.Tensor:
    """The gradient to start ``loss``'s backward from with ``weight`` on the loss side
    (:meth:`GradientTransport.backward`): ``weight`` for a scalar loss, else ``gradient * weight``."""
    if gradient is None:
        if loss.numel() != 1:
            raise RuntimeError(f"bal.backward: a loss of shape {tuple(loss.shape)} needs "
                               f"gradient= (as Tensor.backward: implicit only for scalars)")
        return torch.full_like(loss, weight, memory_format=torch.preserve_format)
    return gradient * weight
