"""Run logs: the world's telemetry of every step, as JSON lines and TensorBoard scalars.

One writer per training job, on rank 0 (every rank holds the same table, so one copy is the
whole record). Each line of ``<log_dir>/run.jsonl`` is one step::

    {"step": 12, "epoch": 0, "batch": [...], "compute": [...], "data": [...], "memory": [...],
     "cpu": [...], "se": 0.031, "step_time": 0.142, "policy": "lbb", "action": "fine",
     "decision": [...]}

``step_time`` is the slowest rank's compute (what the step waited for); ``action`` is the
policy's latest action where it keeps a list of them (LBB, WLBS), else null; ``decision`` the sizes
it chose for the next step (null for a size-aware schedule). With ``tensorboard=True`` the same
step also becomes scalars under ``<log_dir>`` (``step/time``, ``step/se``, ``batch/rank<r>``,
``compute/rank<r>`` for the first 64 ranks) through ``torch.utils.tensorboard``.
:func:`read_run` reads a log back; ``hetlb report`` prints and plots one.
"""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Dict, List, Optional, Union

import numpy as np

from hetlb.core.telemetry import StepRecord, straggler_effect


__all__ = ["RunLog", "read_run", "open_runlog", "LOG_NAME", "ENV_LOG_DIR"]

log = logging.getLogger(__name__)

#: File name of the JSON-lines log inside ``log_dir``.
LOG_NAME = "run.jsonl"
#: Environment variable that turns logging on when ``Balancer(log_dir=None)``.
ENV_LOG_DIR = "HETLB_LOG_DIR"
_TB_RANKS = 64


def _finite(values: np.ndarray) -> List[Optional[float]]:
    """JSON has no inf/NaN: ``None`` stands for a rank with no progress or no value."""
    return [float(v) if math.isfinite(v) else None for v in values.tolist()]


class RunLog:
    """Appends one JSON line (and TensorBoard scalars) per step to ``log_dir``.

    Args:
        log_dir: directory (created); the log is ``log_dir/run.jsonl``, appended to on resume.
        tensorboard: also write TensorBoard event files into ``log_dir`` (needs the
            ``tensorboard`` package).
        flush_every: steps between flushes of the TensorBoard writer (the JSON file is flushed
            every line).
    """

    def __init__(self, log_dir: Union[str, os.PathLike], tensorboard: bool = True,
                 flush_every: int = 20) -> None:
        self.log_dir = os.fspath(log_dir)
        os.makedirs(self.log_dir, exist_ok=True)
        self.path = os.path.join(self.log_dir, LOG_NAME)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                self._file.close()
                raise ImportError(f"RunLog(tensorboard=True) needs the tensorboard package "
                                  f"(pip install tensorboard), or pass tensorboard=False: {e}") from None
            self._tb = SummaryWriter(self.log_dir)
        self.flush_every = max(1, int(flush_every))
        self._n = 0

    def write(self, record: StepRecord, policy: str = "", action: Optional[str] = None,
              decision: Any = None) -> None:
        """Log one step's record with the policy's name, latest action and next decision."""
        finite = np.isfinite(record.compute)
        busy = record.batch > 0
        step_time = float(record.compute[finite & busy].max()) if (finite & busy).any() else 0.0
        se = straggler_effect(np.where(finite, record.compute, 0.0), record.batch)
        line = {"step": int(record.step), "epoch": int(record.epoch), "batch": record.batch.tolist(),
                "compute": _finite(record.compute), "data": _finite(record.data),
                "memory": _finite(record.memory), "cpu": _finite(record.cpu), "se": se,
                "step_time": step_time, "policy": policy, "action": action,
                "decision": np.asarray(decision).tolist() if isinstance(decision, np.ndarray) else None}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
        if self._tb is not None:
            s = int(record.step)
            self._tb.add_scalar("step/time", step_time, s)
            self._tb.add_scalar("step/se", se, s)
            for r in range(min(record.world, _TB_RANKS)):
                self._tb.add_scalar(f"batch/rank{r}", int(record.batch[r]), s)
                if math.isfinite(record.compute[r]):
                    self._tb.add_scalar(f"compute/rank{r}", float(record.compute[r]), s)
            self._n += 1
            if self._n % self.flush_every == 0:
                self._tb.flush()

    def close(self) -> None:
        """Flush and close both files (idempotent)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if not self._file.closed:
            self._file.close()


def read_run(path: Union[str, os.PathLike]) -> List[Dict[str, Any]]:
    """The steps of a run log (a ``run.jsonl`` file or the directory holding one), in order.
    Raises ``ValueError`` naming the line that is not a step record. A last line cut off
    without its newline (a run that crashed while writing it) is skipped with a warning."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, LOG_NAME)
        if not os.path.exists(p):
            raise ValueError(f"{os.fspath(path)}: no {LOG_NAME} in this directory (a run log is "
                             f"written by Balancer(log_dir=...))")
    steps = []
    try:
        with open(p, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError:
        raise ValueError(f"{p}: not a text file (a run log is {LOG_NAME}, one JSON step record "
                         f"per line)") from None
    for i, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            if i == len(lines) and not text.endswith("\n") and steps:
                log.warning("%s:%d: the last line is cut off (the run stopped while writing it); "
                            "reading the %d steps before it", p, i, len(steps))
                break
            raise ValueError(f"{p}:{i}: not JSON ({e})") from None
        missing = [k for k in ("step", "batch", "compute", "se", "step_time") if k not in d] \
            if isinstance(d, dict) else ["a JSON object"]
        if missing:
            raise ValueError(f"{p}:{i}: not a hetlb step record (missing {missing})")
        steps.append(d)
    if not steps:
        raise ValueError(f"{p}: no step records")
    return steps


def open_runlog(log_dir: Optional[str], tensorboard: Optional[bool], rank: int) -> Optional["RunLog"]:
    """The Balancer's run log: on rank 0 where ``log_dir`` (or ``$HETLB_LOG_DIR``) names a folder,
    with TensorBoard scalars where ``tensorboard`` says so (None: where it is installed)."""
    log_dir = log_dir if log_dir is not None else os.environ.get(ENV_LOG_DIR) or None
    if log_dir is None or rank != 0:
        return None
    if tensorboard is None:
        import importlib.util
        tensorboard = importlib.util.find_spec("tensorboard") is not None
    return RunLog(log_dir, tensorboard=tensorboard)
