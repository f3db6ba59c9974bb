"""Per-step telemetry: the world table every rank sees, its history, and the probes that fill a row.

A row is ``FIELDS`` as float64 on the host. Each rank fills its own row; the rows of all ranks
reach every rank inside the gradient all-reduce (see :mod:`hetlb.aggregate`), so the table a
policy reads is bit-identical on every rank and decisions can be replicated.
"""
from __future__ import annotations

import math
import os
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch

#: Columns of the world table, in order.
FIELDS = ("batch", "compute", "data", "memory", "cpu", "checksum", "plan", "step", "epoch")
NUM_FIELDS = len(FIELDS)
COL = {name: i for i, name in enumerate(FIELDS)}

#: Integers that ride in a float32 slot must stay exact: checksums and step counters wrap here.
EXACT_INT = 1 << 24


def decision_checksum(sizes: Any) -> int:
    """CRC32 of an int64 size vector, folded to 24 bits so it survives a float32 slot exactly."""
    arr = np.ascontiguousarray(np.asarray(sizes, dtype=np.int64))
    return zlib.crc32(arr.tobytes()) % EXACT_INT


@dataclass(frozen=True)
class StepRecord:
    """What every rank reported for one step; arrays have one entry per rank.

    Attributes:
        step: global step index (counted from the start of training, across epochs).
        epoch: epoch the step belongs to.
        batch: samples each rank processed, int64 ``[world]``.
        compute: seconds of forward+backward up to the last gradient bucket, ``[world]``.
        data: data amount each rank processed (sum of sample sizes; equals ``batch`` when samples
            have no size), ``[world]``.
        memory: fraction of device memory in use in ``[0, 1]`` (CUDA memory, or process RSS over
            total RAM on CPU), ``[world]``.
        cpu: machine CPU utilisation in ``[0, 1]`` seen by each rank, ``[world]``.
    """

    step: int
    epoch: int
    batch: np.ndarray
    compute: np.ndarray
    data: np.ndarray
    memory: np.ndarray
    cpu: np.ndarray

    @property
    def world(self) -> int:
        return int(self.batch.shape[0])

    @property
    def speed(self) -> np.ndarray:
        """Samples per second of each rank (0 where the rank had no samples)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            v = np.where(self.batch > 0, self.batch / self.compute, 0.0)
        return v

    @classmethod
    def from_table(cls, table: np.ndarray) -> "StepRecord":
        """Build a record from a ``[world, NUM_FIELDS]`` table (checksum column dropped)."""
        t = np.asarray(table, dtype=np.float64)
        if t.ndim != 2 or t.shape[1] != NUM_FIELDS:
            raise ValueError(f"telemetry table must be [world, {NUM_FIELDS}], got shape {t.shape}")
        return cls(step=int(t[0, COL["step"]]), epoch=int(t[0, COL["epoch"]]),
                   batch=np.rint(t[:, COL["batch"]]).astype(np.int64),
                   compute=t[:, COL["compute"]].copy(), data=t[:, COL["data"]].copy(),
                   memory=t[:, COL["memory"]].copy(), cpu=t[:, COL["cpu"]].copy())

    def to_dict(self) -> Dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "batch": self.batch.tolist(),
                "compute": self.compute.tolist(), "data": self.data.tolist(),
                "memory": self.memory.tolist(), "cpu": self.cpu.tolist()}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "StepRecord":
        return cls(step=int(d["step"]), epoch=int(d["epoch"]),
                   batch=np.asarray(d["batch"], dtype=np.int64),
                   compute=np.asarray(d["compute"], dtype=np.float64),
                   data=np.asarray(d["data"], dtype=np.float64),
                   memory=np.asarray(d["memory"], dtype=np.float64),
                   cpu=np.asarray(d["cpu"], dtype=np.float64))


class History:
    """The most recent ``maxlen`` step records, oldest first. Policies read it, never write it.

    Indexing and iteration are over records; ``history[-1]`` is the latest step.
    """

    def __init__(self, world: int, maxlen: int = 1024) -> None:
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        self.world = int(world)
        self._records: Deque[StepRecord] = deque(maxlen=int(maxlen))

    def append(self, record: StepRecord) -> None:
        if record.world != self.world:
            raise ValueError(f"record has {record.world} ranks, history has {self.world}")
        if self._records and record.step <= self._records[-1].step:
            raise ValueError(f"steps must increase: got {record.step} after {self._records[-1].step}")
        self._records.append(record)

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
        return list(self._records)[-k:]

    def column(self, name: str, k: Optional[int] = None) -> np.ndarray:
        """``[steps, world]`` array of one field over the latest ``k`` records (all if None)."""
        recs = list(self._records) if k is None else self.last(k)
        if not recs:
            return np.zeros((0, self.world))
        return np.stack([getattr(r, name) for r in recs])

    def state_dict(self) -> Dict[str, Any]:
        return {"world": self.world, "maxlen": self._records.maxlen,
                "records": [r.to_dict() for r in self._records]}

    @classmethod
    def from_state_dict(cls, d: Dict[str, Any]) -> "History":
        h = cls(d["world"], d.get("maxlen") or 1024)
        for r in d["records"]:
            h.append(StepRecord.from_dict(r))
        return h


def validate_record(record: StepRecord) -> None:
    """Raise ``ValueError`` naming the ranks whose telemetry cannot be used (NaN, inf, <= 0 time
    with samples, negative sizes)."""
    b, t, d = record.batch, record.compute, record.data
    bad = (b < 0) | ~np.isfinite(t) | (t < 0) | ((b > 0) & (t == 0)) | ~np.isfinite(d)
    if bad.any():
        raise ValueError(f"step {record.step}: unusable telemetry from " + ", ".join(
            f"rank {r} (batch={int(b[r])}, compute={float(t[r])!r}, data={float(d[r])!r})" for r in np.flatnonzero(bad)))


# ---------------------------------------------------------------------------------------------
# Probes: memory and CPU of this process / machine.
# ---------------------------------------------------------------------------------------------

@dataclass
class Probe:
    """Reads memory and CPU load for this rank's telemetry row.

    On CUDA the memory fraction is ``torch.cuda.memory_reserved / total`` (no synchronisation);
    on CPU it is process RSS over total RAM via psutil. CPU is machine utilisation since the
    previous reading (psutil's non-blocking ``cpu_percent(None)``).

    Readings are refreshed at most every ``interval`` seconds and reused in between: psutil costs
    ~50 µs, and a CPU percentage over a window of a few milliseconds is noise anyway. Steps
    longer than ``interval`` always get fresh readings.
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    interval: float = 0.2

    def __post_init__(self) -> None:
        import psutil
        if not (math.isfinite(self.interval) and self.interval >= 0):
            raise ValueError(f"Probe: interval must be a finite number >= 0, got {self.interval!r}")
        self._psutil = psutil
        self._proc = psutil.Process(os.getpid())
        self._total_ram = float(psutil.virtual_memory().total)
        psutil.cpu_percent(None)  # prime the non-blocking counter
        self._cuda_total: Optional[float] = None
        if self.device.type == "cuda":
            self._cuda_total = float(torch.cuda.get_device_properties(self.device).total_memory)
        self._at = {"memory": -math.inf, "cpu": -math.inf}
        self._last = {"memory": 0.0, "cpu": 0.0}

    def _fresh(self, what: str) -> bool:
        now = time.monotonic()
        if now - self._at[what] < self.interval:
            return False
        self._at[what] = now
        return True

    def memory(self) -> float:
        """Fraction of device memory (CUDA) or RAM (CPU) this rank holds, in [0, 1]."""
        if self._fresh("memory"):
            if self._cuda_total is not None:
                self._last["memory"] = float(torch.cuda.memory_reserved(self.device)) / self._cuda_total
            else:
                self._last["memory"] = float(self._proc.memory_info().rss) / self._total_ram
        return self._last["memory"]

    def cpu(self) -> float:
        """Machine CPU utilisation in [0, 1] since the previous fresh reading."""
        if self._fresh("cpu"):
            self._last["cpu"] = float(self._psutil.cpu_percent(None)) / 100.0
        return self._last["cpu"]


def hardware_info(device: Optional[torch.device] = None) -> Dict[str, float]:
    """Static indicators of this rank's hardware, for policies that start from them (WLBS).

    Keys: ``cpus`` (usable CPU count), ``memory`` (bytes of RAM), and on CUDA ``gpu_sms``
    (multiprocessors), ``gpu_clock`` (kHz, 0 if unknown), ``gpu_memory`` (bytes).
    """
    import psutil
    try:
        cpus = float(len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cpus = float(os.cpu_count() or 1)
    info: Dict[str, float] = {"cpus": cpus, "memory": float(psutil.virtual_memory().total)}
    if device is not None and device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info["gpu_sms"] = float(p.multi_processor_count)
        info["gpu_clock"] = float(getattr(p, "clock_rate", 0) or 0)
        info["gpu_memory"] = float(p.total_memory)
    return info


def straggler_effect(compute: Sequence[float], batch: Optional[Sequence[int]] = None) -> float:
    """LBB's straggler effect (Eq. 4): ``(max T - min T) / mean T``.

    With ``batch`` given, only ranks that had samples count (an idle rank is not a leader).
    """
    t = np.asarray(compute, dtype=np.float64)
    if batch is not None:
        t = t[np.asarray(batch) > 0]
    mean = float(t.mean()) if t.size else 0.0
    if t.size == 0 or mean <= 0:
        return 0.0
    return float((t.max() - t.min()) / mean)
