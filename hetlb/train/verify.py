"""The check of a delivered telemetry table against the step's plan: every rank at the same step
and epoch, with the same decision and the plan's batch sizes."""
from __future__ import annotations

import math

import numpy as np

from hetlb.core.decisions import EXACT_INT
from hetlb.core.telemetry import COL, FIELDS, RECORD_ARRAYS
from hetlb.data.board import StepPlan
from hetlb.train.errors import DecisionMismatchError


# checksum, plan, step and epoch are adjacent columns: one view of the table checks all four.
assert (COL["plan"], COL["step"], COL["epoch"]) == tuple(COL["checksum"] + i for i in (1, 2, 3))
_IDS = slice(COL["checksum"], COL["epoch"] + 1)
# A StepRecord's arrays are the table's first columns, in order (one slice copies them all).
assert tuple(FIELDS[:len(RECORD_ARRAYS)]) == RECORD_ARRAYS
RECORD_COLS = len(RECORD_ARRAYS)


def number_text(v: float) -> str:
    """A table entry as an error message shows it: an integer, or the float itself."""
    return str(int(v)) if math.isfinite(v) and v == int(v) else repr(v)


def groups_text(values: np.ndarray) -> str:
    """Which ranks hold which value (a corrupt table's NaN and infinities too)."""
    labels = [number_text(v) for v in values.tolist()]
    out = []
    for lab in sorted(set(labels), key=lambda x: (len(x), x)):
        out.append(f"ranks {[r for r, x in enumerate(labels) if x == lab]}: {lab}")
        if len(out) > 8:
            out.append("...")
            break
    return "; ".join(out)


def verify_table(table: np.ndarray, plan: StepPlan, g: int, sharded: bool) -> None:
    """Raise :class:`DecisionMismatchError` unless step ``g``'s ``table`` shows every rank at that
    step and epoch, with the same decision and plan checksums, and the plan's batch sizes;
    ``sharded``: the loader reads shards (the message then names ``partition=``)."""
    ids = table[:, _IDS].tolist()  # tiny rows: plain lists beat NumPy's per-call cost
    first = ids[0]
    if any(row != first for row in ids) or first[2] != g % EXACT_INT:
        steps = table[:, COL["step"]]
        if (steps != g % EXACT_INT).any():
            raise DecisionMismatchError(f"step {g}: ranks are at different steps ({groups_text(steps)})")
        epochs = table[:, COL["epoch"]]
        if (epochs != epochs[0]).any():
            raise DecisionMismatchError(
                f"step {g}: ranks are training different epochs ({groups_text(epochs)}): each "
                f"would draw its slice of another epoch's order, so samples would be lost and "
                f"repeated. Call loader.set_epoch(e) with the same e on every rank (or not at "
                f"all: epochs then follow one another by themselves)")
        for col, what in (("checksum", "batch-size decision"), ("plan", "step plan (sizes used)")):
            c = table[:, COL[col]]
            if (c != c[0]).any():
                sharded = sharded and col == "plan"
                raise DecisionMismatchError(
                    f"step {g}: ranks disagree on the {what}; checksums by rank: {groups_text(c)}. "
                    f"The policy must be a deterministic function of the shared telemetry and "
                    f"all ranks must draw their batches at the same point of the loop"
                    + ("; with a sharded loader every rank must also pass the same "
                       "partition= (the same home of every sample)" if sharded else ""))
    if table[:, COL["batch"]].tolist() != plan.sizes.tolist():  # exact: sizes < 2^24 ride in floats
        batch = table[:, COL["batch"]]
        bad = np.flatnonzero(~(batch == plan.sizes)).tolist()
        raise DecisionMismatchError(f"step {g}: ranks {bad} ran batch sizes "
                                    f"[{', '.join(number_text(v) for v in batch[bad].tolist())}], "
                                    f"the plan says {plan.sizes[bad].tolist()}")
