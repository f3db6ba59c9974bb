"""Per-step telemetry: the world table every rank sees, its history, and the probes that fill a row.

A row is ``FIELDS`` as float64 on the host. Each rank fills its own row; the rows of all ranks
reach every rank with the gradient all-reduce (see :mod:`hetlb.comm.hook`), so the table a policy
reads is bit-identical on every rank and decisions can be replicated.

What the columns mean (one row per rank and step):

* ``compute``: seconds from the step's first forward to its last gradient bucket being ready, the
  rank's *computation* (with whatever communication of earlier buckets it could not overlap);
  ``+inf`` reports a rank that made no progress. On CUDA: device time from events, reported one
  step late so the host never waits for the device.
* ``cpu``: machine CPU utilisation over the latest window (at least 0.2 s) ending when this step's
  compute ended: the load the step ran under, the "current" reading of the next decision.
* ``memory``: fraction of the device's memory in use by anyone when the step started (CUDA:
  ``1 - free / total`` from ``torch.cuda.mem_get_info``, which sees co-located processes; CPU:
  ``1 - available / total`` RAM).
* ``predicted``: the rank's own prediction of its speed for the step after next, from a rank-local
  predictor when the policy uses one (LB-BSP's per-worker NARX), else NaN.
* ``loss``: the mean loss over the rank's samples that the training loop logged
  (:meth:`hetlb.Balancer.log_loss`), else NaN; it is not part of a :class:`StepRecord` (policies
  do not read it) and lags like ``compute`` (see :mod:`hetlb.train.losses`).

Bad values (one place for all policies: :meth:`History.append`). A record that cannot describe a
step is refused with :class:`UnusableTelemetry` naming the ranks and their values: negative sizes;
a compute time that is NaN, negative or ``-inf``, zero or below :data:`MIN_COMPUTE` (1 ns) for a
rank with samples, or above :data:`MAX_COMPUTE` (10^6 s, far beyond any collective's timeout: a
broken clock, not a step); non-finite or negative data amounts; non-finite memory or CPU readings.
The Balancer (and the simulator) then keep the previous sizes and count the step; more than
``max_bad_steps`` such steps in a row raise. ``+inf`` compute is how a rank reports that it made no
progress: it passes, and each policy says what it means. Memory and CPU readings outside their
range ``[0, 1]`` are clamped into it, with a warning (logger ``hetlb.telemetry``) the first time
per rank and column.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence

import numpy as np

from hetlb.core.checks import integer


log = logging.getLogger("hetlb.telemetry")

#: Columns of the world table, in order.
FIELDS = ("batch", "compute", "data", "memory", "cpu", "predicted", "checksum", "plan", "step", "epoch",
          "loss")
NUM_FIELDS = len(FIELDS)
COL = {name: i for i, name in enumerate(FIELDS)}
#: The columns a rank fills in when its step starts, in the order ``StepCore.begin`` takes them;
#: compute and CPU are stamped when its compute ends.
ROW_VALUES = ("batch", "data", "predicted", "checksum", "plan", "step", "epoch", "memory", "loss")

#: The per-rank arrays of a :class:`StepRecord`, in table order.
RECORD_ARRAYS = ("batch", "compute", "data", "memory", "cpu", "predicted")

#: Plausible compute seconds of a step for a rank with samples: shorter is a clock artefact
#: (and would make its speed overflow), longer a broken clock (no collective waits 11 days).
#: Records outside are refused as unusable (see the module docstring).
MIN_COMPUTE = 1e-9
MAX_COMPUTE = 1e6


class UnusableTelemetry(ValueError):
    """A step's telemetry cannot be used (NaN times, negative sizes, ...): the Balancer keeps the
    previous sizes and counts it; policies raise it for values they cannot interpret."""


@dataclass(frozen=True)
class StepRecord:
    """What every rank reported for one step; arrays have one entry per rank.

    Attributes:
        step: global step index (counted from the start of training, across epochs).
        epoch: epoch the step belongs to.
        batch: samples each rank processed, int64 ``[world]``.
        compute: seconds of computation (see the module docstring), ``[world]``; ``+inf`` for a
            rank that made no progress.
        data: data amount each rank processed (sum of sample sizes; equals ``batch`` when samples
            have no size), ``[world]``.
        memory: fraction of device memory in use in ``[0, 1]``, ``[world]``.
        cpu: machine CPU utilisation in ``[0, 1]`` over the step, ``[world]``.
        predicted: each rank's own predicted speed (samples/s) or NaN, ``[world]``.
        epoch_end: whether this was the last step of its epoch (known from the loader's plan;
            False when there is no loader).
        sq: sum of squared sample sizes of each rank's samples ``[world]`` (from the step's plan,
            known to every rank; the quadratic work term ``s + c*s^2``), or None when samples
            have no size.
    """

    step: int
    epoch: int
    batch: np.ndarray
    compute: np.ndarray
    data: np.ndarray
    memory: np.ndarray
    cpu: np.ndarray
    predicted: np.ndarray = field(default=None)  # type: ignore[assignment]
    epoch_end: bool = False
    sq: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        if self.predicted is None:
            object.__setattr__(self, "predicted", np.full(self.batch.shape[0], np.nan))

    @property
    def world(self) -> int:
        return int(self.batch.shape[0])

    @property
    def speed(self) -> np.ndarray:
        """Samples per second of each rank (0 where the rank had no samples or made no
        progress)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            v = np.where(self.batch > 0, self.batch / self.compute, 0.0)
        return np.where(np.isfinite(v), v, 0.0)

    @classmethod
    def from_table(cls, table: np.ndarray, step: Optional[int] = None,
                   epoch: Optional[int] = None) -> "StepRecord":
        """A record from a ``[world, NUM_FIELDS]`` table; ``step``/``epoch`` override the table's
        (which wrap at 2^24 to stay exact in float32)."""
        t = np.asarray(table, dtype=np.float64)
        if t.ndim != 2 or t.shape[1] != NUM_FIELDS:
            raise ValueError(f"telemetry table must be [world, {NUM_FIELDS}], got shape {t.shape}")
        return cls(step=int(t[0, COL["step"]]) if step is None else int(step),
                   epoch=int(t[0, COL["epoch"]]) if epoch is None else int(epoch),
                   batch=np.rint(t[:, COL["batch"]]).astype(np.int64),
                   compute=t[:, COL["compute"]].copy(), data=t[:, COL["data"]].copy(),
                   memory=t[:, COL["memory"]].copy(), cpu=t[:, COL["cpu"]].copy(),
                   predicted=t[:, COL["predicted"]].copy())

    def to_dict(self) -> Dict[str, Any]:
        """Plain Python values (lists of floats/ints): loads with ``torch.load(weights_only=True)``."""
        out: Dict[str, Any] = {"step": int(self.step), "epoch": int(self.epoch),
                               "epoch_end": bool(self.epoch_end)}
        for name in RECORD_ARRAYS:
            out[name] = getattr(self, name).tolist()
        if self.sq is not None:
            out["sq"] = self.sq.tolist()
        return out

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "StepRecord":
        world = len(d["batch"])
        return cls(step=int(d["step"]), epoch=int(d["epoch"]),
                   batch=np.asarray(d["batch"], dtype=np.int64),
                   compute=np.asarray(d["compute"], dtype=np.float64),
                   data=np.asarray(d["data"], dtype=np.float64),
                   memory=np.asarray(d["memory"], dtype=np.float64),
                   cpu=np.asarray(d["cpu"], dtype=np.float64),
                   predicted=np.asarray(d.get("predicted", [math.nan] * world), dtype=np.float64),
                   epoch_end=bool(d.get("epoch_end", False)),
                   sq=None if d.get("sq") is None else np.asarray(d["sq"], dtype=np.float64))


class History:
    """The most recent ``maxlen`` step records, oldest first. Policies read it, never write it.

    Indexing and iteration are over records; ``history[-1]`` is the latest step.
    """

    def __init__(self, world: int, maxlen: int = 1024) -> None:
        self.world = integer(world, "History: world", 1)
        self._records: Deque[StepRecord] = deque(maxlen=integer(maxlen, "History: maxlen", 1, sys.maxsize))
        #: Memory / CPU readings clamped into [0, 1] so far (see :meth:`append`).
        self.clamped = 0
        self._warned: set = set()  # (column, rank) already named in a clamping warning

    def append(self, record: StepRecord) -> None:
        """Add the latest step; raises :class:`UnusableTelemetry` (see :func:`validate_record`)
        for a record that cannot describe a step, so every record a policy reads is sound.
        Memory and CPU readings outside ``[0, 1]`` are clamped into it (the stored record is then
        a corrected copy; a warning names the rank the first time per rank and column)."""
        if not isinstance(record, StepRecord):
            raise TypeError(f"History.append: record must be a StepRecord, got {type(record).__name__}")
        if record.world != self.world:
            raise ValueError(f"record has {record.world} ranks, history has {self.world}")
        sound, in_range = _quick_check(record)
        if not sound:
            validate_record(record)  # raises, unless only the cheap check was too strict
        if self._records and record.step <= self._records[-1].step:
            raise ValueError(f"steps must increase: got {record.step} after {self._records[-1].step}")
        if not (sound and in_range) and not _readings_in_range(record):
            record = self._clamp(record)
        self._records.append(record)

    def _clamp(self, record: StepRecord) -> StepRecord:
        fixed = {}
        for col in ("memory", "cpu"):
            a = getattr(record, col)
            out = (a < 0) | (a > 1)
            if not out.any():
                continue
            fixed[col] = np.clip(a, 0.0, 1.0)
            self.clamped += int(out.sum())
            for r in np.flatnonzero(out).tolist():
                level = logging.DEBUG if (col, r) in self._warned else logging.WARNING
                self._warned.add((col, r))
                log.log(level, "step %d: rank %d reported %s=%r, outside [0, 1]; clamped to %r",
                        record.step, r, col, float(a[r]), float(fixed[col][r]))
        return dataclasses.replace(record, **fixed)

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, i: int) -> StepRecord:
        return self._records[i]

    def __iter__(self) -> Iterator[StepRecord]:
        return iter(self._records)

    def last(self, k: int) -> List[StepRecord]:
        """The latest ``k`` records (fewer if the history is shorter), oldest first."""
        if k <= 0:
            return []
        n = len(self._records)
        return [self._records[i] for i in range(max(0, n - k), n)]

    def column(self, name: str, k: Optional[int] = None) -> np.ndarray:
        """``[steps, world]`` array of one field over the latest ``k`` records (all if None)."""
        recs = list(self._records) if k is None else self.last(k)
        if not recs:
            return np.zeros((0, self.world))
        return np.stack([getattr(r, name) for r in recs])

    def state_dict(self) -> Dict[str, Any]:
        return {"world": self.world, "maxlen": self._records.maxlen,
                "records": [r.to_dict() for r in self._records]}

    def extend(self, records: Any) -> None:
        """Append several records (oldest first)."""
        for r in records:
            self.append(r)

    @classmethod
    def from_state_dict(cls, d: Dict[str, Any]) -> "History":
        h = cls(d["world"], d.get("maxlen") or 1024)
        for r in d["records"]:
            h.append(StepRecord.from_dict(r))
        return h


def validate_record(record: StepRecord) -> None:
    """Structural check of a record: raise :class:`UnusableTelemetry` naming the ranks whose
    values cannot describe a step (negative sizes; compute time NaN, negative or ``-inf``, below
    :data:`MIN_COMPUTE` with samples, or finite above :data:`MAX_COMPUTE`; non-finite or negative
    data; non-finite memory or CPU). ``+inf`` compute passes: it is how a rank reports that it
    made no progress, and each policy decides what that means."""
    if _looks_sound(record):
        return
    arrays = (record.batch, record.compute, record.data, record.memory, record.cpu)
    n = record.batch.shape
    if len(n) != 1 or n[0] == 0 or any(np.shape(a) != n for a in arrays):
        raise UnusableTelemetry(f"step {record.step}: the record's columns must be 1-D of one "
                                f"length >= 1, got shapes {[np.shape(a) for a in arrays]}")
    b, t, d = record.batch, record.compute, record.data
    with np.errstate(invalid="ignore"):
        bad = (b < 0) | np.isnan(t) | (t < 0) | ((b > 0) & (t < MIN_COMPUTE)) | ~np.isfinite(d) | (d < 0)
        bad |= np.isfinite(t) & (t > MAX_COMPUTE)
        bad |= ~np.isfinite(record.memory) | ~np.isfinite(record.cpu)
    if bad.any():
        raise UnusableTelemetry(f"step {record.step}: unusable telemetry from " + ", ".join(
            f"rank {r} (batch={int(b[r])}, compute={float(t[r])!r}, data={float(d[r])!r}, "
            f"memory={float(record.memory[r])!r}, cpu={float(record.cpu[r])!r})"
            for r in np.flatnonzero(bad)) +
            f"; accepted: batch >= 0, compute in [{MIN_COMPUTE:g}, {MAX_COMPUTE:g}] s (0 without "
            f"samples, +inf for no progress), data finite >= 0, memory and cpu finite")


def _looks_sound(record: StepRecord) -> bool:
    """A cheap sufficient condition for :func:`validate_record` to pass (it runs every step): True
    only if every check there holds. Sums propagate NaN and infinities, so a finite sum means
    finite entries; a NaN minimum compares False, and the sums catch it. Compute below
    :data:`MIN_COMPUTE` (also zero with zero samples, allowed there) or above :data:`MAX_COMPUTE`
    (also ``+inf``) fails here, and then the exact check decides."""
    return _quick_check(record)[0]


def _quick_check(record: StepRecord) -> tuple:
    """``(_looks_sound(record), _readings_in_range(record))`` in one pass over the record (it runs
    every step); the second is only meaningful when the first is True."""
    arrays = (record.batch, record.compute, record.data, record.memory, record.cpu)
    n = record.batch.shape
    if len(n) != 1 or n[0] == 0 or any(np.shape(a) != n for a in arrays):
        return False, False
    if n[0] <= 64:  # tiny rows: Python lists beat NumPy's per-call cost
        b, t, d, m, c = (a.tolist() for a in arrays)
        sound = (min(b) >= 0 and min(t) >= MIN_COMPUTE and max(t) <= MAX_COMPUTE and min(d) >= 0
                 and math.isfinite(sum(t) + sum(d) + sum(m) + sum(c)))
        return sound, sound and min(m) >= 0 and max(m) <= 1 and min(c) >= 0 and max(c) <= 1
    b, t, d, m, c = arrays
    sound = bool(b.min() >= 0 and t.min() >= MIN_COMPUTE and t.max() <= MAX_COMPUTE and d.min() >= 0
                 and math.isfinite(float(t.sum()) + float(d.sum()) + float(m.sum()) + float(c.sum())))
    return sound, sound and _readings_in_range(record)


def _readings_in_range(record: StepRecord) -> bool:
    """Whether every memory and CPU reading is in ``[0, 1]`` (cheap: it runs every step)."""
    m, c = record.memory, record.cpu
    if m.shape[0] <= 64:
        m, c = m.tolist(), c.tolist()
        return min(m) >= 0 and max(m) <= 1 and min(c) >= 0 and max(c) <= 1
    return bool(m.min() >= 0 and m.max() <= 1 and c.min() >= 0 and c.max() <= 1)


def require_progress(record: StepRecord, who: str) -> None:
    """For policies that cannot act on a rank without progress: raise
    :class:`UnusableTelemetry` if any rank reported ``+inf`` compute."""
    stuck = np.flatnonzero(np.isinf(record.compute))
    if stuck.size:
        raise UnusableTelemetry(f"step {record.step}: ranks {stuck.tolist()} made no progress "
                                f"(compute=inf); {who} cannot balance without their speed")


def straggler_effect(compute: Sequence[float], batch: Optional[Sequence[int]] = None) -> float:
    """LBB's straggler effect (Eq. 4): ``(max T - min T) / mean T``.

    With ``batch`` given, only ranks that had samples count (an idle rank is not a leader).
    """
    t = np.asarray(compute, dtype=np.float64)
    if batch is not None:
        t = t[np.asarray(batch) > 0]
    mean = float(t.mean()) if t.size else 0.0
    if t.size == 0 or not (mean > 0) or not math.isfinite(mean):
        return 0.0
    return float((t.max() - t.min()) / mean)


# ---------------------------------------------------------------------------------------------
# Probes: memory in use and static hardware indicators of this rank.
# ---------------------------------------------------------------------------------------------


__all__ = ["FIELDS", "NUM_FIELDS", "COL", "RECORD_ARRAYS", "MIN_COMPUTE", "MAX_COMPUTE", "UnusableTelemetry", "StepRecord", "History", "validate_record", "require_progress", "straggler_effect"]


