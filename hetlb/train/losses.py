"""The loss a training loop logs (:meth:`hetlb.Balancer.log_loss`) and what a finished step
reports back to the loop (:class:`FinishedStep`).

Each rank writes the mean loss over its own samples into the ``loss`` column of its telemetry row,
which reaches every rank with the table the step exchanges anyway, so the step's global mean
costs no collective: ``sum_r w_r * loss_r`` over the ranks with samples, ``w_r`` the step's
aggregation weights (``B_r / sum B`` under "samples"). That is the loss whose gradient the step
applied; the mean of the ranks' means, as ``all_reduce(loss, AVG)`` gives it, is not when the
batches differ.

When it arrives: on a host clock (CPU models) the row carries the step's own loss, so a step's
record and its loss complete together when its table arrives (the step's end; with blocks of
steps, ``exchange_every > 1``, at the block's exchange). Device compute times are read ``lag``
steps late so the host never waits for the device, and the loss follows them: a window's mean
stays on the device, is copied to pinned host memory without waiting when the window ends, and
rides in the row ``lag`` windows later, read there once the copy is done (by then the clock has
waited for that step's end anyway).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, List

import numpy as np
import torch

from hetlb.core.telemetry import COL


__all__ = ["FinishedStep", "LossLog", "global_loss"]


@dataclass(frozen=True)
class FinishedStep:
    """A step (an accumulation window) whose telemetry has arrived: what the training loop may log.

    Attributes:
        step: the step's index among the Balancer's steps (``bal.steps`` was ``step + 1`` when it
            ended; the record ``bal.history`` keeps of it has the same ``step``).
        epoch: the epoch it belongs to.
        sizes: int64 ``[world]``, every rank's samples in it (per micro-step, with accumulation).
        losses: float64 ``[world]``, every rank's logged mean loss (NaN where a rank logged none).
        loss: the step's global mean loss: ``sum_r w_r * losses[r]`` over the ranks with a nonzero
            weight ``w_r`` (the step's aggregation weights), the mean over the step's samples
            under "samples" weighting. NaN when such a rank logged no loss.
    """

    step: int
    epoch: int
    sizes: np.ndarray
    losses: np.ndarray
    loss: float


def global_loss(weights: np.ndarray, losses: np.ndarray) -> float:
    """``sum_r w_r * losses[r]`` over the ranks with ``w_r > 0``; NaN if one of them has none
    (an idle rank's NaN, the mean over nothing, carries no weight)."""
    used = weights > 0
    mine = losses[used]
    if mine.size == 0 or np.isnan(mine).any():
        return math.nan
    return float(np.dot(weights[used], mine))


class LossLog:
    """This rank's logged losses of the open accumulation window, for the ``loss`` column of its
    row: their mean (see the module docstring).

    Args:
        telemetry: the step telemetry whose open row receives the value; its ``lag`` is the
            number of steps by which the row's compute time, and so its loss, lags.
    """

    def __init__(self, telemetry: Any) -> None:
        self.telemetry = telemetry
        #: Whether a loss was ever logged: until then the step driver asks nothing of this (its
        #: rows carry NaN), so a loop that logs none pays no call a step.
        self.used = False
        self.reset()

    def reset(self) -> None:
        """Forget everything logged (a loaded checkpoint starts the steps again)."""
        self._window: List[Any] = []  # the window's finished micro-steps' losses
        self._open: List[Any] = []  # the open micro-step's
        self._row = math.nan  # lagged: what every row of the open window carries
        self._due: Any = None  # lagged: its source, read when the window's first row opens
        self._pending: Deque[Any] = deque()  # lagged: finished windows' means, oldest first

    def value(self) -> float:
        """The loss for the row of a (micro-)step about to open."""
        if self.telemetry.lag:
            if self._due is not None:
                self._row, self._due = _read(self._due), None
            return self._row
        return _mean(self._window) if self._window else math.nan

    def log(self, loss: Any) -> None:
        """Add a micro-step's mean loss to the open window (see :meth:`hetlb.Balancer.log_loss`)."""
        lag = self.telemetry.lag
        if isinstance(loss, torch.Tensor):
            if lag and loss.device.type == "cuda":  # (stays there: reading it would wait)
                if loss.numel() != 1:
                    raise ValueError(_NOT_ONE.format(tuple(loss.shape)))
                v: Any = loss.detach().to(torch.float64).reshape(())
            else:
                try:
                    v = loss.item()
                except RuntimeError:  # (more than one element)
                    raise ValueError(_NOT_ONE.format(tuple(loss.shape))) from None
        elif isinstance(loss, (int, float, np.floating, np.integer)) and not isinstance(loss, bool):
            v = float(loss)
        else:
            raise TypeError(f"bal.log_loss(loss): the loss must be a tensor of one element or a "
                            f"number, got {type(loss).__name__}")
        self._open.append(v)
        self.used = True
        if not lag:
            w, o = self._window, self._open
            self.telemetry.core.set(_LOSS, (sum(w) + sum(o)) / (len(w) + len(o)))

    def micro_step_done(self) -> None:
        """A micro-step other than its window's last ended: its losses join the window's."""
        if self._open:
            self._window += self._open
            self._open = []

    def discard(self) -> None:
        """The open micro-step was dropped untrained: its losses go too."""
        if self._open:
            self._open = []

    def window_done(self) -> None:
        """The open window ended (lagged: its mean is kept for the row ``lag`` windows later).
        Allocates nothing when nothing was logged (it runs every step)."""
        lag = self.telemetry.lag
        if not lag:
            if self._window or self._open:
                self._window, self._open = [], []
            return
        values, self._window, self._open = self._window + self._open, [], []
        if not values:
            self._pending.append(math.nan)
        elif any(isinstance(v, torch.Tensor) for v in values):
            host = torch.empty((), dtype=torch.float64, pin_memory=True)
            host.copy_(_mean(values), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            self._pending.append((host, copied))
        else:
            self._pending.append(_mean(values))
        if len(self._pending) >= lag:
            self._due = self._pending.popleft()


_LOSS = COL["loss"]
_NOT_ONE = ("bal.log_loss(loss): the loss must be one number (the mean over this rank's samples), "
            "got a tensor of shape {}")


def _mean(values: List[Any]) -> Any:
    return sum(values) / len(values)


def _read(due: Any) -> float:
    """A lagged window's mean: a number, or a copy to host memory to wait for."""
    if isinstance(due, tuple):
        host, copied = due
        copied.synchronize()
        return float(host)
    return float(due)
