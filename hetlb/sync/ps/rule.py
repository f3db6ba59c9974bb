"""When the parameter server updates and whom it lets go on: the pushes waiting for their
synchronisation, grouped by the mode's rule (LSP's limited and global synchronisations, one push
at a time for SSP and ASP), and SSP's staleness bound."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import numpy as np


__all__ = ["MODES", "SyncRule"]

MODES = ("lsp", "ssp", "asp")


class SyncRule:
    """The pending pushes and the mode's rule over them.

    Args:
        mode: ``"lsp"``, ``"ssp"`` or ``"asp"``.
        l: LSP's limited threshold (workers per limited synchronisation).
        m: limited synchronisations between two global ones (LSP).
        staleness: SSP's bound on a worker's clock over the slowest working one.
    """

    def __init__(self, mode: str, l: int, m: int, staleness: int) -> None:
        self.mode, self.l, self.m, self.staleness = mode, l, m, staleness
        #: Limited synchronisations since the last global one (LSP).
        self.limited = 0
        self._pending: "OrderedDict[int, Dict[str, Any]]" = OrderedDict()  # in order of arrival

    def __contains__(self, worker: int) -> bool:
        return worker in self._pending

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, worker: int, push: Dict[str, Any]) -> None:
        """File ``worker``'s push until its synchronisation."""
        self._pending[worker] = push

    def discard(self, worker: int) -> None:
        """Forget ``worker``'s push, if any (it was dropped)."""
        self._pending.pop(worker, None)

    def due(self, busy: int) -> Optional[Tuple[List[int], str]]:
        """The members (in order of arrival) and type of the update due now, or None; ``busy``
        workers hold a batch. LSP: the first ``l`` pushes (all of them when fewer than ``l``
        workers still have work: a ``flush``) while fewer than ``m`` limited synchronisations
        passed, else every push once no worker holds a batch (``global``). SSP, ASP: the first
        push alone (``async``)."""
        if not self._pending:
            return None
        if self.mode != "lsp":
            return [next(iter(self._pending))], "async"
        if self.limited < self.m:
            need = min(self.l, len(self._pending) + busy)
            if len(self._pending) < need:
                return None
            return list(self._pending)[:need], "limited" if need == self.l else "flush"
        if busy:
            return None  # global: wait for every worker that still has work
        return list(self._pending), "global"

    def take(self, members: List[int]) -> List[Dict[str, Any]]:
        """Remove and return the pushes of ``members``."""
        return [self._pending.pop(w) for w in members]

    def count(self, kind: str) -> None:
        """Count an applied update of type ``kind`` (:meth:`due`'s)."""
        if kind in ("limited", "flush"):
            self.limited += 1
        elif kind == "global":
            self.limited = 0

    def may_go_on(self, worker: int, clock: np.ndarray, min_clock: Optional[int]) -> bool:
        """Whether ``worker`` may get its next batch: its push is applied, and under SSP its
        ``clock`` is at most ``staleness`` ahead of ``min_clock`` (the slowest working one's)."""
        if worker in self._pending:
            return False  # waits for its synchronisation
        return self.mode != "ssp" or min_clock is None or \
            int(clock[worker]) - min_clock <= self.staleness
