"""What a :class:`hetlb.DataLoader` needs of the objects it is bound to.

A loader bound for training hands its batches to an owner of steps (:class:`StepOwner`: the
Balancer's step driver, or :class:`hetlb.DelayedSync`), which it tells where the loop is, and
saves its checkpoint through an owner of state (:class:`Stateful`: the Balancer or DelayedSync),
whose state carries the data position the loader's board keeps. It calls nothing else of them.

A loop left early (``break``, an exception) tells the owner of steps nothing: the open step
stays open, and the next call that reads or moves the position (the next iteration,
``len(loader)``, ``loader.epoch``, ``set_epoch``, a ``state_dict``, ``bal.steps``) settles it:
trained if its backward ran, else handed out again (with the batches fetched after it). The
watchdog needs no word of it either: it counts a worker as waiting for the others only inside a
collective of a step (see :mod:`hetlb.ranks.watchdog`), which a step left before its forward or
after its backward is not.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Protocol


class StepOwner(Protocol):
    """Runs the steps of the batches a loader hands out."""

    def settle(self) -> None:
        """Finish a step whose backward ran, before a count or the position is read."""

    def iteration_starts(self) -> None:
        """A new iteration over the loader: a trained step is finished, an untrained one
        forgotten (its batch is handed out again)."""

    def before_next(self) -> None:
        """The loop asks for the next batch: the open step ends here if its batch was trained
        (a loop fetching ahead asks before training it)."""

    def handed(self, plan: Any) -> None:
        """The loop received the batch of ``plan`` (a :class:`~hetlb.data.board.StepPlan` or
        :class:`~hetlb.data.stream.StreamPlan`)."""

    def exhausted(self) -> Optional[str]:
        """The DataLoader ran out: ``"empty"`` to hand out an empty batch, ``"round"`` to start
        the epoch's next round, None to end the iteration."""


class Stateful(Protocol):
    """Owns a checkpoint's state (torchdata's ``Stateful``)."""

    def state_dict(self) -> Dict[str, Any]:
        """The state: tensors and plain values."""

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
