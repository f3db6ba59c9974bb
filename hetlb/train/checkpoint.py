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
import pickle
import re
from typing import Any, Dict, List, Optional

import torch

from hetlb.core.checks import integer


__all__ = ["Checkpointer"]

log = logging.getLogger("hetlb")

_NAME = re.compile(r"^ckpt-(\d+)\.pt$")
_TMP = re.compile(r"^ckpt-(\d+)\.pt\.tmp\.(\d+)$")  # a save in progress, or one killed mid-write


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (its save may still be in progress)."""
    try:
        os.kill(pid, 0)
    except PermissionError:  # another user's process
        return True
    except (ProcessLookupError, OverflowError):
        return False
    return True


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
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise ValueError(f"directory {self.directory!r} is a file, not a directory")
        self.keep = integer(keep, "keep", 1)
        import torch.distributed as dist
        on = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if on else 0
        self.rank = integer(rank, "rank", 0)
        self.writer = integer(writer, "writer", 0)
        if on and self.writer >= dist.get_world_size():
            raise ValueError(f"writer={self.writer} is not a rank of this job of "
                             f"{dist.get_world_size()}: no checkpoint would ever be written")

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
        and delete all but the newest ``keep`` (never the one just written), and the temporary
        files that interrupted saves of steps up to ``step`` left. Returns the path written, or
        None.

        Raises ``ValueError`` (and writes nothing) when :meth:`latest` could not load the state:
        it loads with ``weights_only=True``, which takes tensors and plain Python values only.
        Only the writer rank raises; under torchrun the job then stops."""
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
        try:
            # Unpickles the structure only (the tensors' data is mapped on the CPU, not read): a
            # state that latest() would skip must fail here, not at the restart that needs it.
            torch.load(tmp, weights_only=True, mmap=True, map_location="cpu")
        except BaseException as e:
            os.remove(tmp)
            if not isinstance(e, pickle.UnpicklingError):
                raise
            raise ValueError(
                f"checkpoint of step {step} not written: torch.load(weights_only=True), which "
                f"latest() uses, refuses it ({str(e).splitlines()[0]}). Keep tensors and plain "
                f"Python values in the state (float()/int() for NumPy scalars, torch.from_numpy "
                f"for arrays)") from None
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
        steps = self.steps()
        if steps[-1] != step:
            log.warning("checkpoint of step %d written below newer ones %s in %s: latest() "
                        "returns step %d", step, [s for s in steps if s > step], self.directory,
                        steps[-1])
        for old in steps[:-self.keep]:
            if old == step:
                continue
            try:
                os.remove(self.path(old))
            except FileNotFoundError:
                pass
        self._remove_stale(step)
        return path

    def _remove_stale(self, step: int) -> None:
        """Delete the temporary files a writer killed mid-save left behind (a checkpoint's size
        each): those of steps up to ``step``, which this save superseded, whose writer is no
        longer running on this host."""
        for name in os.listdir(self.directory):
            m = _TMP.match(name)
            if m and int(m.group(1)) <= step and not _alive(int(m.group(2))):
                try:
                    os.remove(os.path.join(self.directory, name))
                    log.info("removed %s, left by an interrupted save", name)
                except FileNotFoundError:
                    pass

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
