"""Emulated speeds for any training loop over a DDP model: :func:`slow_down`.

The :class:`hetlb.Balancer` applies an :class:`~hetlb.sim.emulate.Emulator` inside its own step
core. A loop that has no Balancer (a baseline with its own sampler, a trainer's loop) gets the
same slow-down from :func:`slow_down`: a forward pre-hook marks the first forward of a step, and a
DDP communication hook holds the step's last gradient bucket (the moment the rank joins the final
all-reduce) until the emulated time after that forward, then all-reduces it as DDP does by
default (the mean over the world; equal to DDP's built-in reduction up to rounding, which scales
each gradient before the sum rather than the bucket). So the other ranks wait for the emulated
compute exactly as they would for a slower device.

A step here is an accumulation window: the forwards before the all-reduce (micro-steps under
``ddp.no_sync()`` included) and their backwards, from the first forward to the last bucket. A
forward without autograd (evaluation) starts nothing; a synchronising forward whose backward
never came (a loss discarded, a step skipped) is dropped by the next forward, which starts the
step again. DDP's buffer broadcast at the forward's start falls inside the step.
On a GPU the hooks synchronise the current stream, so the times are the device's.

    emu = Emulator.for_rank(rank, speeds=[0.25, 0.5, 0.75, 1.0])
    steps = slow_down(ddp, emu)
    for x, y in loader:
        loss_fn(ddp(x), y).backward()      # held here, at the last bucket, to the emulated time
        opt.step(); opt.zero_grad()
    steps.records                          # (measured, emulated) seconds of each step
"""
import numbers
import time
from typing import Any, Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from hetlb.sim.emulate import Emulator, sleep_until

__all__ = ["SlowedSteps", "slow_down"]

#: ``amount(args, kwargs)``: what the emulator's time model is evaluated at for one forward:
#: samples (or tokens with ``Emulator(by="data")``), or ``(data, squares)`` (the summed squared
#: sample sizes, for ``Emulator(quadratic=c)``: evaluated at ``data + c * squares``, as the
#: Balancer does). A window's forwards are summed.
Amount = Callable[[tuple, dict], Union[float, Tuple[float, float]]]


class SlowedSteps:
    """The steps a :func:`slow_down` hook held: the state of the hooks on one model.

    Attributes:
        steps: steps completed (each emulated step's index is this count at its start, plus
            the ``first_step`` given to :func:`slow_down`).
        records: ``(measured, emulated)`` seconds of each completed step, from its first
            forward to its last gradient bucket; ``emulated`` is what the step was held to
            (the measured time where the real compute took longer).
    """

    def __init__(self, emulator: Emulator, amount: Optional[Amount], first_step: int,
                 group: Optional[dist.ProcessGroup], cuda: bool) -> None:
        self.emulator, self.amount, self.first_step = emulator, amount, first_step
        self.group, self.cuda = group, cuda
        self.steps = 0
        self.records: List[Tuple[float, float]] = []
        self._start: Optional[float] = None
        self._batch = 0.0
        self._synced = False  # the window holds a forward that synchronises (its backward reduces)

    def _now(self) -> float:
        if self.cuda:  # the device's time, not the host's launch time
            torch.cuda.current_stream().synchronize()
        return time.perf_counter()

    def forward_starts(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook (on the DDP model): a forward with autograd on opens a step, or joins
        the open one if that has only no-sync forwards."""
        if not torch.is_grad_enabled():
            return
        got = 0.0 if self.amount is None else self._evaluated(self.amount(args, kwargs))
        if self._start is None or self._synced:
            self._start, self._batch = self._now(), 0.0
        self._synced = bool(module.require_backward_grad_sync)
        self._batch += got

    def _evaluated(self, got: Union[float, Tuple[float, float]]) -> float:
        if isinstance(got, tuple):
            data, squares = got
            return float(data) + self.emulator.quadratic * float(squares)
        if self.emulator.quadratic:
            raise ValueError("the emulator has quadratic=c: amount= must return (data, squared "
                             "sizes) of a forward's samples, evaluated at data + c * squares")
        return float(got)

    # (annotations DDP checks at registration: no postponed evaluation in this module)
    def bucket_ready(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP communication hook: the last bucket waits for the emulated time, every bucket is
        all-reduced as DDP does by default."""
        if bucket.is_last():
            self._hold()
        return allreduce_hook(self.group, bucket)

    def _hold(self) -> None:
        start = self._start
        self._start, self._synced = None, False
        if start is None:  # a backward without a forward seen by the hook: nothing to time
            return
        measured = self._now() - start
        step = self.first_step + self.steps
        goal = self.emulator.target(step, self._batch, measured=measured)
        if goal > measured:
            sleep_until(start + goal, self.emulator.spin)
        self.records.append((measured, max(goal, measured)))
        self.steps += 1


def slow_down(model: DistributedDataParallel, emulator: Emulator, *,
              amount: Optional[Amount] = None, first_step: int = 0) -> SlowedSteps:
    """Make ``model``'s training steps take ``emulator``'s time, in any loop (see the module
    docstring); returns the :class:`SlowedSteps` that record them.

    Args:
        model: a ``DistributedDataParallel`` model without a communication hook of its own
            (DDP takes one hook; a Balancer's model is emulated through ``Balancer(emulator=)``).
        emulator: this rank's emulator (e.g. ``Emulator.for_rank(rank, speeds)``). Without a
            time model it stretches the measured compute by ``1 / speed``. Its ``fail=True``
            disturbances and bandwidth cap need the Balancer and are refused here.
        amount: ``amount(args, kwargs)`` of one forward's arguments (see :data:`Amount`): what
            the emulator's time model is evaluated at; required when it has one.
        first_step: the index of the next step (a resumed run passes its step count, so noise and
            disturbances fall on the same steps as in an uninterrupted run).
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"slow_down needs a DistributedDataParallel model (it holds DDP's last "
                        f"gradient bucket), got {type(model).__name__}; without DDP call "
                        f"emulator.stretch(step, batch, start) after each backward")
    if not isinstance(emulator, Emulator):
        raise TypeError(f"emulator must be a hetlb Emulator, got {type(emulator).__name__}")
    if emulator.failures:
        raise ValueError("slow_down cannot emulate fail=True disturbances (a rank that makes no "
                         "progress is reported through the Balancer's telemetry); remove them or "
                         "use hetlb.Balancer(emulator=)")
    if emulator.bandwidth is not None:
        raise ValueError("slow_down does not emulate a bandwidth cap (it needs the Balancer's "
                         "gradient transport); use hetlb.Balancer(emulator=) or bandwidth=None")
    if emulator.model is not None and amount is None:
        raise ValueError("the emulator has a time model: pass amount=, a function of a forward's "
                         "(args, kwargs) giving the samples (or tokens) it trains")
    if isinstance(first_step, bool) or not isinstance(first_step, numbers.Integral) or first_step < 0:
        raise ValueError(f"first_step must be an int >= 0, got {first_step!r}")
    cuda = any(p.is_cuda for p in model.parameters())
    steps = SlowedSteps(emulator, amount, int(first_step), model.process_group, cuda)
    try:
        model.register_comm_hook(None, steps.bucket_ready)
    except RuntimeError as e:
        raise RuntimeError(f"slow_down registers a DDP communication hook and this model has one "
                           f"already ({e}); a hetlb.Balancer's model is emulated through "
                           f"Balancer(emulator=)") from None
    model.register_forward_pre_hook(steps.forward_starts, with_kwargs=True)
    return steps
