"""Each rank's weight: its share of the global batch ("samples"), of the data amount ("sizes"), an
equal share of the ranks with samples ("none"), or ``1 / world`` whatever the sizes ("world")."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


WEIGHTINGS = ("samples", "sizes", "none", "world")


def weights_for(weighting: str, batch: Sequence[int], data: Optional[Sequence[float]] = None) -> np.ndarray:
    """Per-rank aggregation weights, summing to 1.

    Args:
        weighting: "samples" (``B_r / sum B``), "sizes" (``data_r / sum data``), "none" (the
            plain mean over ranks with samples: ``1/m`` for each of the ``m`` ranks with
            ``B_r > 0``, 0 for idle ranks, whose gradient is of an empty batch) or "world"
            (``1 / world`` for every rank, idle ones included: DDP's own mean, for a loss that
            is already normalised over the whole step, such as a sum divided by the step's
            global count).
        batch: int ``[world]`` samples per rank this step.
        data: ``[world]`` data amount per rank (required for "sizes").

    A step whose samples all have data amount 0 (empty sequences, say) has no amount to weigh
    by under "sizes" (0/0): it is weighed by samples instead, so a legal dataset never stops
    training and every sample of the step still counts once.
    """
    if weighting == "samples" and isinstance(batch, np.ndarray) and batch.dtype.kind in "iu" \
            and batch.ndim == 1:
        total = int(batch.sum())  # integers: finite, so the checks below reduce to these two
        if total > 0 and int(batch.min()) >= 0:
            return batch / total
    b = np.asarray(batch, dtype=np.float64)
    if weighting == "samples":
        amount = b
    elif weighting == "sizes":
        if data is None:
            raise ValueError('weighting="sizes" needs the data amount of every rank')
        amount = np.asarray(data, dtype=np.float64)
        if np.all(amount == 0):  # no data anywhere (0/0): weigh the step's samples instead
            amount = b
    elif weighting == "none":
        amount = (b > 0).astype(np.float64)
    elif weighting == "world":
        amount = np.ones_like(b)
    else:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    if not np.all(np.isfinite(amount)) or np.any(amount < 0) or np.any(b < 0):
        raise ValueError(f"weights need finite non-negative amounts, got {amount.tolist()}")
    total = float(amount.sum())
    if total <= 0:
        raise ValueError(f"weighting={weighting!r}: the step has no samples/data on any rank "
                         f"(amounts {amount.tolist()})")
    return amount / total
