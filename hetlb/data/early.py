"""A checkpoint loaded before its loader is bound: what of it waits, in one place.

A script may load a checkpoint before the loader and its owner (a :class:`hetlb.Balancer`) are
bound to each other: into the Balancer before ``bal.loader()`` makes the loader, or into a
``hetlb.DataLoader`` made before the model. The data position then goes onto the loader's plan
board at once (``len(loader)``, ``loader.epoch`` and ``state_dict()`` read it), and the rest waits
in the board's :class:`EarlyState` until the loader binds, where
:meth:`hetlb.data.handout.Board.bind` applies it, once (as torchdata's ``StatefulDataLoader``
keeps ``next_iter_state`` for its next iterator):

* the owner's part (policy, history, steps) of a state loaded into the loader first, which the
  owner loads when it binds;
* the loader order of a state loaded into the owner first, checked against the loader's order
  (:func:`check_loader_config`);
* the partition of a sharded position loaded before the loader (and its partition) existed.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple


__all__ = ["EarlyState", "check_loader_config"]


class EarlyState:
    """What a checkpoint loaded before binding still has to apply; owned by a plan board, which
    alone reads and writes it.

    Attributes:
        owner: the owner's whole state, loaded into the loader before the owner existed (the
            owner loads it when it binds), or None.
        order: ``{"loader": config, "position": position}`` of a checkpoint loaded into the
            owner before any loader was bound (checked against the loader's order when it
            binds), or None.
        partition: ``(partition state, epoch, step)`` of a sharded position loaded before a
            loader attached (applied to the loader's partition), or None.
        sharded: whether the position loaded before a loader attached was sharded (None: none
            was loaded then).
        restored: a position was loaded and no iteration has started from it yet (``set_epoch``
            then checks the script resumes where the checkpoint stopped).
    """

    def __init__(self) -> None:
        self.owner: Optional[Dict[str, Any]] = None
        self.order: Optional[Dict[str, Any]] = None
        self.partition: Optional[Tuple[Any, int, int]] = None
        self.sharded: Optional[bool] = None
        self.restored = False


def check_loader_config(state: Dict[str, Any], mine: Dict[str, Any]) -> None:
    """A checkpoint taken in the middle of an epoch resumes only with the same global order
    (``mine``: the resuming loader's :meth:`GlobalOrderSampler.config`).

    At an epoch boundary (a checkpoint before the epoch's first step, or one that closed its
    epoch: ``epoch_end`` in the position) any order continues correctly: the resumed loader
    starts the next epoch over its own dataset. That is the way to move a job onto a changed
    dataset (more samples, other sizes, another seed)."""
    saved = state.get("loader")
    pos = state.get("position") or {}
    if saved is None or not pos.get("step") or pos.get("epoch_end"):
        return  # at an epoch boundary any order continues correctly
    # (a key the checkpoint does not have is one an older hetlb did not record)
    diff = {k: (saved.get(k), mine[k]) for k in mine if k in saved and saved[k] != mine[k]}
    if diff:
        raise ValueError(
            f"the checkpoint was taken in the middle of epoch {pos.get('epoch')} (after step "
            f"{pos.get('step')}) with a different global order, so its remaining samples are not "
            f"the ones left in this order: " + ", ".join(
                f"{k}={a!r} then, {b!r} now" for k, (a, b) in diff.items()) +
            ". Resume with the same dataset (length and sample sizes), shuffle, seed and "
            "drop_last; or from a checkpoint taken at the end of an epoch, which resumes over any "
            "dataset")
