"""Checkpoints that survive a crash at any moment: atomic writes, the last ``keep`` kept.

::

    ckpt = hetlb.Checkpointer("ckpts", keep=3)
    state = ckpt.latest()                        # None on a fresh start
    if state is not None:
        model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])
        loader.load_state_dict(state["loader"])  # the Balancer's state and the data position
    ...
    if bal.steps % 100 == 0:
        ckpt.save({"model": model.state_dict(), "opt": opt.state_dict(),
                   "loader": loader.state_dict()}, step=bal.steps)

Build the state on every rank (``DelayedSync.state_dict`` is a collective); :meth:`save` writes on
one rank only. A file is written under a temporary name, flushed to disk and renamed, so a crash
leaves either the previous checkpoint or the new one, never a torn file; :meth:`latest` skips a
file that does not load (with a warning) and takes the one before.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any, Dict, List, Optional

import torch

from .checks import integer

__all__ = ["Checkpointer"]

log = logging.getLogger("hetlb")

_NAME = re.compile(r"^ckpt-(\d+)\.pt$")


class Checkpointer:
    """Atomic checkpoints in ``directory`` named by step, the newest ``keep`` kept.

    Args:
        directory: where the files go (created on the writing rank).
        keep: how many checkpoints to keep (>= 1).
        rank: this process's rank (default: the process group's, else 0); only ``writer`` writes.
        writer: the rank that writes.
    """

    def __init__(self, directory: str, keep: int = 3, rank: Optional[int] = None, writer: int = 0) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a path (str or os.PathLike), got "
                            f"{type(directory).__name__} {directory!r}")
        self.directory = os.fspath(directory)
        self.keep = integer(keep, "keep", 1)
        if rank is None:
            import torch.distributed as dist
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = integer(rank, "rank", 0)
        self.writer = integer(writer, "writer", 0)

    def steps(self) -> List[int]:
        """The steps of the checkpoints in the directory, oldest first."""
        if not os.path.isdir(self.directory):
            return []
        found = (_NAME.match(n) for n in os.listdir(self.directory))
        return sorted(int(m.group(1)) for m in found if m)

    def path(self, step: int) -> str:
        """The file of the checkpoint at ``step``."""
        return os.path.join(self.directory, f"ckpt-{integer(step, 'step', 0):09d}.pt")

    def save(self, state: Dict[str, Any], step: int) -> Optional[str]:
        """Write ``state`` as the checkpoint of ``step`` (on the writer rank; elsewhere nothing)
        and delete all but the newest ``keep``. Returns the path written, or None."""
        if not isinstance(state, dict):
            raise ValueError(f"state must be a dict of state_dicts, got {type(state).__name__}")
        path = self.path(step)
        if self.rank != self.writer:
            return None
        os.makedirs(self.directory, exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
        for old in self.steps()[:-self.keep]:
            try:
                os.remove(self.path(old))
            except FileNotFoundError:
                pass
        return path

    def latest(self) -> Optional[Dict[str, Any]]:
        """The newest checkpoint that loads (``torch.load`` with ``weights_only=True``), or None.
        Its step is under the key ``"step"`` unless the state has one of its own."""
        for step in reversed(self.steps()):
            try:
                state = torch.load(self.path(step))
            except Exception as e:  # noqa: BLE001 (a damaged file: fall back to the one before)
                log.warning("checkpoint %s does not load (%s: %s); trying the one before",
                            self.path(step), type(e).__name__, e)
                continue
            state.setdefault("step", step)
            return state
        return None
