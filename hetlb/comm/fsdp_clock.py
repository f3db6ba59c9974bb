"""A rank's own compute under FSDP2, and an emulator that slows it layer by layer.

FSDP2 couples the ranks at every layer: each FSDP module all-gathers its parameters before its
forward and its backward and reduce-scatters its gradient after its backward, so a fast rank
waits for the slow one inside those collectives, and the time from the step's first forward to
the end of its backward comes out nearly equal on every rank. A policy that balances by measured
times would learn nothing from it. :class:`LayerClock` times FSDP's own hook work around each
collective with hooks of its own on either side of FSDP's (torch's ``prepend`` hooks, and identity
autograd nodes on either side of FSDP's post-backward node, and autograd callbacks on either side
of FSDP's end of backward, which reduce-scatters the root's gradient and waits for every
reduction) and leaves that time out of the step's compute time (:meth:`StepCore.add_wait`); what
remains is the rank's own compute.

It also carries an :class:`hetlb.sim.emulate.Emulator` where FSDP2 would see a slow rank: the
step's hold is spread over its compute segments (the stretches between waits), each held until
the rank's own compute so far reaches ``factor * measured + extra * share`` (``share``: the
segments done over the previous step's count, and at least the samples that the step's earlier
micro-steps ran; the first step holds the rest at its end), so the other ranks wait for it in
every layer's collectives, as they would for a slower device.

Where a step is timed by device events (CUDA: :class:`hetlb.comm.hook.StepTelemetry`'s device
clock), each wait is also bracketed by two events on the device's current stream
(``device_wait_begins`` and ``device_wait_ends``), and the time between them is left out of the
device's step time: under NCCL the host does not wait in FSDP's hooks, the compute stream does
(for an all-gather, for the reduce-scatters at the end of the backward), and a stall of the host
in a collective (Gloo with CUDA tensors) is an idle gap of the stream between the same events.
"""
from __future__ import annotations

import time
from typing import Any, List, Optional, Protocol, Tuple

import torch

from hetlb.comm.hook import tensors_in
from hetlb.sim.emulate import sleep_until


class WaitCore(Protocol):
    """Where the clock reports: whether a step is being timed, and the waits to leave out."""

    #: A step is open, its first forward ran, and whether it is a micro-step before the last.
    open: bool
    restarted: bool
    quiet: bool

    def add_wait(self, seconds: float) -> None:
        """Leave ``seconds`` of waiting out of the step's compute time (the host's clock)."""

    def device_wait_begins(self) -> None:
        """A wait begins on the device's current stream (a no-op where the host's clock times)."""

    def device_wait_ends(self) -> None:
        """The wait begun by :meth:`device_wait_begins` ends on the device's current stream."""


class ClockHost(Protocol):
    """What a :class:`LayerClock` reads: a step's timing (``core``) and the emulator's hold
    (:class:`hetlb.comm.hook.StepTelemetry` in training; the profile's wait sum, without an
    emulator, in :mod:`hetlb.comm.fsdp_profile`)."""

    core: WaitCore
    emulator: Any
    #: Whether the emulator holds the step at its end (set False: the clock spreads the hold).
    hold_at_end: bool
    #: The fraction of the step's samples run by micro-steps before the current one.
    done: float

    @property
    def hold(self) -> Tuple[float, float]:
        """The emulator's ``(factor, extra)`` for the step."""


class _Mark(torch.autograd.Function):
    """Identity on a module's inputs whose backward tells the clock it ran: placed on either side
    of FSDP's post-backward node, the two marks bracket its reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, clock: "LayerClock", begins: bool, *xs: torch.Tensor) -> Any:
        ctx.clock, ctx.begins = clock, begins
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        if ctx.begins:
            ctx.clock.wait_begins()
        else:
            ctx.clock.wait_ends()
        return (None, None) + grads


class LayerClock:
    """The hooks on every FSDP module of a model that time FSDP's waits, and the per-layer
    emulator (see the module docstring). One per FSDP2 transport; :meth:`new_step` at each step.

    Args:
        telemetry: the step telemetry (its core receives the waits; its emulator's hold), or
            another :class:`ClockHost`.
        modules: the FSDP modules, the root first.
    """

    def __init__(self, telemetry: ClockHost, modules: List[torch.nn.Module]) -> None:
        self.telemetry, self.core = telemetry, telemetry.core
        self.emulated = telemetry.emulator is not None
        if self.emulated:
            telemetry.hold_at_end = False  # (spread over the segments here instead)
        self._handles: List[Any] = []
        self._t_wait: Optional[float] = None  # a wait in progress since then
        self._start: Optional[float] = None  # the step's first segment
        self._waits = self._held = 0.0
        self._segments, self._last_segments = 0, 0
        self._final_queued = self._final_end_queued = False
        for i, m in enumerate(modules):
            root = i == 0
            self._handles += [
                m.register_forward_pre_hook(self._fwd_before, prepend=True, with_kwargs=True),
                m.register_forward_pre_hook(self._fwd_after, with_kwargs=True),
                m.register_forward_hook(self._out_before_root if root else self._out_before,
                                        prepend=True),
                m.register_forward_hook(self._out_after_root if root else self._out_after)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def new_step(self) -> None:
        """Forget the previous step's segments and waits (a step is about to run)."""
        if self._segments:
            self._last_segments = self._segments
        self._start, self._t_wait = None, None
        self._waits = self._held = 0.0
        self._segments = 0
        self._final_queued = self._final_end_queued = False

    # ------------------------------------------------------------------ the waits

    def _counting(self) -> bool:
        """Inside a step whose first forward ran (the compute clock runs)."""
        return self.core.open and self.core.restarted

    def wait_begins(self) -> None:
        """FSDP is about to wait in a collective: a compute segment ends here."""
        if not self._counting():
            return
        now = time.perf_counter()
        if self._start is None:
            self._start = now
        if self.emulated:
            now = self._hold(now, final=False)
        self._t_wait = now
        self.core.device_wait_begins()

    def wait_ends(self) -> None:
        """FSDP's wait is over: its time is left out of the compute."""
        t = self._t_wait
        if t is None or not self._counting():
            return
        self.core.device_wait_ends()
        self._t_wait = None
        waited = time.perf_counter() - t
        self._waits += waited
        self.core.add_wait(waited)

    def _hold(self, now: float, final: bool) -> float:
        """The emulator's hold at the end of a compute segment; returns the time after it."""
        self._segments += 1
        factor, extra = self.telemetry.hold
        own = now - self._start - self._waits  # this step's compute so far, holds included
        measured = own - self._held
        # The segments' share of the previous step's; at least the samples the micro-steps
        # before this one ran (a micro-step whose backward reduces is, to the emulated device,
        # only its own samples' work: an empty one after them, none).
        share = 1.0 if final else max(min(self._segments / self._last_segments, 1.0)
                                      if self._last_segments else 0.0, self.telemetry.done)
        hold = factor * measured + extra * share - own
        if hold > 0.0:
            sleep_until(now + hold, 0.0)
            self._held += hold
            return time.perf_counter()
        return now

    def _final(self) -> None:
        """An autograd callback at the end of the backward, queued before FSDP's own end of
        backward: the step's last segment is held, and a wait begins (FSDP's end of backward
        reduce-scatters the root's gradient and waits for every reduction, for the slower
        ranks too)."""
        self._final_queued = False
        if self._counting() and self._start is not None:
            now = time.perf_counter()
            if self.emulated:
                now = self._hold(now, final=True)
            self._t_wait = now
            self.core.device_wait_begins()

    def _final_end(self) -> None:
        """An autograd callback after FSDP's end of backward and before the compute's stamp (the
        native watch's hook runs after every Python hook of the output): that wait is over."""
        self.wait_ends()

    # ------------------------------------------------------------------ the hooks

    def _fwd_before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[Tuple]:
        self.wait_begins()
        return self._marked(args, kwargs, begins=False)

    def _fwd_after(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[Tuple]:
        self.wait_ends()
        return self._marked(args, kwargs, begins=True)

    def _marked(self, args: tuple, kwargs: dict, begins: bool) -> Optional[Tuple]:
        """``args`` with their tensors that need a gradient passed through a :class:`_Mark`."""
        if not torch.is_grad_enabled():
            return None
        at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not at:
            return None
        marked = _Mark.apply(self, begins, *[args[i] for i in at])
        out = list(args)
        for i, t in zip(at, marked):
            out[i] = t
        return tuple(out), kwargs

    def _out_before(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(self._grad_before)

    def _out_before_root(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(self._root_grad_before)

    def _out_after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(self._grad_after)

    def _out_after_root(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(self._root_grad_after)

    def _grad_before(self, grad: torch.Tensor) -> None:
        self.wait_begins()

    def _root_grad_before(self, grad: torch.Tensor) -> None:
        # (Python hooks of a tensor run in the order registered: this one before FSDP's
        # pre-backward, which queues FSDP's end of backward, and _root_grad_after after it.)
        if not self._final_queued and self._counting() and not self.core.quiet:
            self._final_queued = True
            self._final_end_queued = False
            torch.autograd.Variable._execution_engine.queue_callback(self._final)
        self.wait_begins()

    def _grad_after(self, grad: torch.Tensor) -> None:
        self.wait_ends()

    def _root_grad_after(self, grad: torch.Tensor) -> None:
        if self._final_queued and not self._final_end_queued:
            self._final_end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._final_end)
        self.wait_ends()
