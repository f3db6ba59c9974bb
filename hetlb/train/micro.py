"""Per-rank micro-steps: one step's batch run as several forward and backward passes.

A rank whose memory holds at most ``m`` samples (``Balancer(micro_batch=m)``, e.g. a profile's
limit) still takes its share ``B`` of a step: :meth:`hetlb.Balancer.micro_steps` runs it as
``k = ceil(B / m)`` micro-steps of near-equal sizes ``b_j``, each micro-step's loss (a mean over
its ``b_j`` samples) weighted by ``b_j / B``, so their gradients sum to the gradient of the mean
over ``B``, and the transport's weight of the step applies once to the sum. The wrapper's no-sync
holds the gradient on the rank but for the last micro-step, whose backward reduces the step.

The numbers differ between ranks: the transport's micro window makes the step communicate as
one pass does (DDP: nothing under ``no_sync()``; FSDP2: the parameters gathered once, before the
first forward, and kept until the last backward reduces).

With ``reduce="after"`` every micro-step with samples runs under no-sync and one empty micro-step
after them reduces: no backward with samples waits in a collective. Where collectives block the
host (FSDP2 on Gloo) a rank whose one pass holds its whole backward otherwise waits, layer by
layer, for a rank in micro-steps to reach each layer's reduce-scatter in its last micro-step,
and then holds the rest of its backward while that rank waits for it at the next layer. The
empty micro-step's mean loss is NaN and weighted 0, as an idle rank's: a model whose empty
forward leaves a NaN in an intermediate that a parameter's gradient reads (a mean over the batch
feeding a layer) would spread it.

A rank with a :class:`hetlb.Recompute` runs a share recomputing, in micro-batches of its
recomputing limit, where its profiles say that is faster (:class:`MicroWays`).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch


def micro_bounds(b: int, limit: Optional[int]) -> List[Tuple[int, int]]:
    """``(start, stop)`` of each micro-step within a batch of ``b`` samples whose micro-batches
    hold at most ``limit`` (None: no limit): ``ceil(b / limit)`` near-equal chunks, at least
    one (an empty batch runs one empty micro-step)."""
    k = max(1, math.ceil(b / limit)) if limit else 1
    edges = [b * j // k for j in range(k + 1)]
    return [(edges[j], edges[j + 1]) for j in range(k)]


@dataclass(frozen=True)
class MicroWays:
    """How this rank runs its share of a step: in micro-batches of at most ``limit`` (None: one
    pass), or, with ``recompute``, recomputing in micro-batches of its recomputing limit where
    the start-up ``context`` says that is faster (:meth:`hetlb.policies.Context.recomputes`,
    the rule the policies allocate by)."""

    limit: Optional[int] = None
    recompute: Any = None
    context: Any = None
    rank: int = 0

    def way(self, b: int) -> Tuple[Optional[int], bool]:
        """``(largest micro-batch, recompute?)`` for a share of ``b`` samples."""
        if self.recompute is None or not self.context.recomputes(self.rank, b):
            return self.limit, False
        return self.context.micro_limit(self.rank, b), True


REDUCE = ("last", "after")

#: Added to the error of fn on the empty micro-step of ``reduce="after"``.
AFTER_REFUSED = (
    "hetlb: bal.micro_steps(..., reduce='after') reduces in an empty micro-step after this "
    "rank's own, and fn failed on its empty chunks; a model that cannot take an empty batch "
    "needs reduce='last' (the default)")


def run_micro_steps(fn: Callable[..., torch.Tensor], batch: Sequence[Any], plan: Any,
                    ways: MicroWays, rank: int, *, telemetry: Any, transport: Any,
                    expect: Callable[[Optional[int]], None], reduce: str = "last") -> torch.Tensor:
    """Run ``fn`` on each micro-step's slice of ``batch`` (this rank's of the open step's
    ``plan``) in micro-steps of at most the limit ``ways`` gives its size, and their weighted
    backwards, reducing in the last one's or (``reduce="after"``) in an empty one after them
    (see the module docstring); returns this rank's mean loss over its batch (detached; NaN when
    it has no samples)."""
    if reduce not in REDUCE:
        raise ValueError(f"bal.micro_steps: reduce must be 'last' (the last micro-step's backward "
                         f"reduces) or 'after' (an empty micro-step after them does), got "
                         f"{reduce!r}")
    if plan is None:
        raise RuntimeError("hetlb: bal.micro_steps(...) outside a balanced step; call it for a "
                           "batch of the Balancer's loader, or inside `with bal.step():`")
    limit, again = ways.way(int(plan.sizes[rank]))
    bounds = micro_bounds(int(plan.sizes[rank]), limit)
    core = telemetry.core
    weight = core.weight
    if reduce == "after" and bounds[-1][1] > bounds[-1][0]:
        bounds.append((bounds[-1][1], bounds[-1][1]))
    total = sum(hi - lo for lo, hi in bounds)
    for t in batch:
        if isinstance(t, torch.Tensor) and (t.dim() == 0 or t.shape[0] != total):
            raise ValueError(f"bal.micro_steps: each tensor of the batch needs this rank's "
                             f"{total} samples along its first dimension, got shape "
                             f"{tuple(t.shape)}")
    try:
        with transport.micro_window(), (ways.recompute.on(again) if ways.recompute is not None
                                        else contextlib.nullcontext()):
            mean = _run(fn, batch, bounds, total, telemetry, transport, weight, expect)
    finally:
        core.quiet = False
        telemetry.done = 0.0
        expect(None)
    return mean if mean is not None else torch.tensor(float("nan"))


def _run(fn: Callable[..., torch.Tensor], batch: Sequence[Any], bounds: List[Tuple[int, int]],
         total: int, telemetry: Any, transport: Any, weight: float,
         expect: Callable[[Optional[int]], None]) -> Optional[torch.Tensor]:
    """The micro-steps of :func:`run_micro_steps`; the weighted sum of their mean losses."""
    mean: Optional[torch.Tensor] = None
    for j, (lo, hi) in enumerate(bounds):
        last = j == len(bounds) - 1
        share = (hi - lo) / total if total else 0.0
        telemetry.core.quiet = not last  # (the step ends with the last micro-step's backward)
        telemetry.done = lo / total if total else 0.0
        expect(hi - lo)
        with contextlib.nullcontext() if last else transport.local():
            try:
                loss = fn(*[t[lo:hi] if isinstance(t, torch.Tensor) else t for t in batch])
            except Exception as e:
                if last and lo == hi and total:  # (the empty micro-step of reduce="after")
                    e.add_note(AFTER_REFUSED)
                raise
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"bal.micro_steps: fn must return the mean loss over its "
                                f"samples (a one-element tensor), got {loss!r}")
            transport.backward(loss, torch.full_like(loss, share), weight, window=True)
        if share:
            part = loss.detach() * share
            mean = part if mean is None else mean + part
    return mean
