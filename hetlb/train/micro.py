"""Per-rank micro-steps: one step's batch run as several forward and backward passes.

A rank whose memory holds at most ``m`` samples (``Balancer(micro_batch=m)``, e.g. a profile's
limit) still takes its share ``B`` of a step: :meth:`hetlb.Balancer.micro_steps` runs it as
``k = ceil(B / m)`` micro-steps of near-equal sizes ``b_j``, each micro-step's loss (a mean over
its ``b_j`` samples) weighted by ``b_j / B``, so their gradients sum to the gradient of the mean
over ``B``, and the transport's weight of the step applies once to the sum. The wrapper's no-sync
holds the gradient on the rank but for the last micro-step, whose backward reduces the step.

The numbers may differ between ranks where a micro-step under no-sync communicates nothing (DDP);
where every forward communicates (FSDP2's all-gathers), every rank runs the step's largest
number, a rank with fewer running empty ones (weight 0), so the collectives match.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch


def micro_bounds(sizes: np.ndarray, limits: Sequence[Optional[int]], rank: int,
                 aligned: bool) -> List[Tuple[int, int]]:
    """``(start, stop)`` within this rank's batch of each of its micro-steps, for a step of
    ``sizes`` (every rank's batch) with each rank's largest micro-batch ``limits`` (None: no
    limit). Near-equal chunks of at most the limit, at least one micro-step; with ``aligned``
    as many as the rank with the most, the extra ones empty."""
    counts = [max(1, math.ceil(int(b) / m)) if m else 1 for b, m in zip(sizes, limits)]
    mine, n = counts[rank], (max(counts) if aligned else counts[rank])
    b = int(sizes[rank])
    edges = [b * j // mine for j in range(mine + 1)]
    return [(edges[j], edges[j + 1]) for j in range(mine)] + [(b, b)] * (n - mine)


def run_micro_steps(fn: Callable[..., torch.Tensor], batch: Sequence[Any], plan: Any,
                    limits: Sequence[Optional[int]], rank: int, *, core: Any, transport: Any,
                    expect: Callable[[Optional[int]], None]) -> torch.Tensor:
    """Run ``fn`` on each micro-step's slice of ``batch`` (this rank's of the open step's
    ``plan``) and its weighted backward (see the module docstring); returns this rank's mean
    loss over its batch (detached; NaN when it has no samples)."""
    if plan is None:
        raise RuntimeError("hetlb: bal.micro_steps(...) outside a balanced step; call it for a "
                           "batch of the Balancer's loader, or inside `with bal.step():`")
    bounds = micro_bounds(plan.sizes, limits, rank, transport.aligned_micro_steps)
    weight = core.weight
    total = sum(hi - lo for lo, hi in bounds)
    for t in batch:
        if isinstance(t, torch.Tensor) and (t.dim() == 0 or t.shape[0] != total):
            raise ValueError(f"bal.micro_steps: each tensor of the batch needs this rank's "
                             f"{total} samples along its first dimension, got shape "
                             f"{tuple(t.shape)}")
    mean: Optional[torch.Tensor] = None
    try:
        for j, (lo, hi) in enumerate(bounds):
            last = j == len(bounds) - 1
            share = (hi - lo) / total if total else 0.0
            core.quiet = not last  # (the step ends with the last micro-step's backward)
            expect(hi - lo)
            with contextlib.nullcontext() if last else transport.local():
                loss = fn(*[t[lo:hi] if isinstance(t, torch.Tensor) else t for t in batch])
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise TypeError(f"bal.micro_steps: fn must return the mean loss over its "
                                    f"samples (a one-element tensor), got {loss!r}")
                transport.backward(loss, torch.full_like(loss, share), weight, window=True)
            if share:
                part = loss.detach() * share
                mean = part if mean is None else mean + part
    finally:
        core.quiet = False
        expect(None)
    return mean if mean is not None else torch.tensor(float("nan"))
