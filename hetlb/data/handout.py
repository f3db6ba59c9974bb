"""What every plan board shares: the ranks, the epoch, the plans drawn and handed out, the
iterations over the loader, and a checkpoint loaded before the loader was bound.

Two boards build on it: :class:`hetlb.data.board.PlanBoard` plans balanced steps (the
:class:`hetlb.Balancer`'s, sharded or not) and :class:`hetlb.data.stream.StreamBoard` the rounds
of per-rank shards of delayed synchronous training (:class:`hetlb.DelayedSync`). The loader and
its sampler draw plans from either; the board's owner posts what the plans run and reads the
position. Every rank holds an identical board.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Deque, Dict, Optional, Tuple

from hetlb.core.checks import integer
from hetlb.data.early import EarlyState, check_loader_config
from hetlb.data.shards import Partition


__all__ = ["Board"]


class Board:
    """The part of a plan board that does not depend on what its plans are (one rank's copy).

    Args:
        world, rank: the ranks.
        global_batch: samples per step over all ranks (the unit of the position).

    Attributes:
        epoch: the epoch of the position.
        steps_per_epoch: steps of the attached loader's epochs (None before a loader attaches).
        attached: whether a loader's sampler draws from this board (:meth:`attach`).
        drawn: plans drawn by the sampler and not handed out yet, in order.
        handed: plans handed out to the loop and not done yet, oldest first (a loop that fetches
            ahead holds several; its steps take them in order).
        ran_out: the latest iteration over the loader ran out of batches (it ended by itself).
        generation: bumped by a restore; an iterator started before it refuses to go on.
        iteration: bumped by every new iteration over the loader (:meth:`restart`); an older
            iterator refuses to go on (it would hand out steps the newer one trains too).
        left: ``(epoch, whole)`` of the epoch the last :meth:`set_epoch` moved off: ``whole``
            when every step of it had been handed out (an iteration over it then has nothing left).
    """

    #: Sharded mode (a steps board's): which rank holds each sample (see :mod:`hetlb.data.shards`),
    #: or None.
    partition: Optional[Partition] = None

    def __init__(self, world: int, rank: int, global_batch: int) -> None:
        self.world = integer(world, "world", 1)
        self.rank = integer(rank, "rank", 0)
        if self.rank >= self.world:
            raise ValueError(f"rank {rank} outside a world of {world}")
        self.global_batch = integer(global_batch, "global_batch", 1)
        self.epoch = 0
        self.steps_per_epoch: Optional[int] = None
        self.attached = False
        self.generation = 0
        self.iteration = 0
        self.left: Optional[Tuple[int, bool]] = None
        self.drawn: Deque[Any] = deque()
        self.handed: Deque[Any] = deque()
        self.ran_out = False
        self._early = EarlyState()

    # ------------------------------------------------------------------ handing out

    @property
    def current(self) -> Any:
        """The oldest plan handed out and not done: the one the open step, or else the next
        step, trains (None: none)."""
        return self.handed[0] if self.handed else None

    def hand(self) -> Any:
        """The next drawn plan, now handed to the training loop."""
        if not self.drawn:
            raise RuntimeError("hetlb: the DataLoader delivered a batch the sampler never drew "
                               "(batches must come back in order: do not set in_order=False)")
        plan = self.drawn.popleft()
        self.handed.append(plan)
        return plan

    def hand_own(self, plan: Any) -> None:
        """Hand out ``plan``, which the owner made itself (a step without a loader)."""
        self.handed.append(plan)

    def drop_current(self) -> None:
        """The owner is done with :attr:`current` (trained, or given up)."""
        if self.handed:
            self.handed.popleft()

    def _forget(self) -> None:
        """Forget the plans drawn or handed out and not trained (they are drawn again)."""
        self.drawn.clear()
        self.handed.clear()
        self.ran_out = False

    # ------------------------------------------------------------------ loaders

    def attach(self, steps_per_epoch: int) -> None:
        """A loader's sampler draws from this board from now on (``steps_per_epoch``: of its
        epochs)."""
        self.steps_per_epoch = steps_per_epoch
        self.attached = True

    def bind(self, config: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """The loader is bound to its owner (``config``: its sampler's order): apply what a
        checkpoint loaded before then still holds (:mod:`hetlb.data.early`), once. Returns the
        owner's part for the owner to load, or None."""
        early = self._early
        if early.order is not None:
            check_loader_config(early.order, config)
            early.order = None
        owner, early.owner = early.owner, None
        return owner

    # ------------------------------------------------------------------ a checkpoint loaded early

    @property
    def restored(self) -> bool:
        """A position was loaded and no iteration has started from it yet."""
        return self._early.restored

    def keep_for_owner(self, state: Optional[Dict[str, Any]]) -> None:
        """Keep the owner's state loaded into the loader before binding (None: there is none),
        for the owner to load when it binds (:meth:`bind`)."""
        self._early.owner = state

    def owner_state(self) -> Optional[Dict[str, Any]]:
        """The owner's state kept by :meth:`keep_for_owner`, until the loader binds."""
        return self._early.owner

    def keep_order(self, order: Optional[Dict[str, Any]]) -> None:
        """Keep a checkpoint's loader order and position (``{"loader": ..., "position": ...}``),
        loaded into the owner before any loader was bound, for the check when one binds (None:
        nothing to check)."""
        self._early.order = order

    def holds_checkpoint(self) -> bool:
        """Whether a loaded checkpoint waits for the loader to be bound or iterated."""
        return self._early.owner is not None or self._early.restored

    # ------------------------------------------------------------------ epochs

    def epoch_finished(self) -> bool:
        """Whether every plan of the current epoch has trained."""
        raise NotImplementedError

    def restart(self) -> int:
        """A new iteration over the loader begins; returns where it draws from."""
        raise NotImplementedError

    def position(self) -> Dict[str, Any]:
        """The data position (plain values)."""
        raise NotImplementedError

    def load_position(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`position` output."""
        raise NotImplementedError

    def _checked_position(self, state: Any) -> int:
        """The epoch of a data position, refused unless it is a position of this global batch."""
        if not isinstance(state, dict) or "global_batch" not in state or "epoch" not in state:
            raise ValueError(f"not a hetlb data position (a dict with epoch, step and global_batch): "
                             f"got {type(state).__name__}"
                             + (f" with keys {sorted(state)}" if isinstance(state, dict) else ""))
        gb = integer(state["global_batch"], "checkpoint global_batch", 1)
        if gb != self.global_batch:
            raise ValueError(f"checkpoint global_batch={gb} differs from this job's global batch "
                             f"{self.global_batch} (batch_size * world): the checkpoint counts its "
                             f"epoch in steps of {gb} samples, so its position would not line up. "
                             f"Resume with global_batch={gb} (with hetlb.DataLoader(batch_size=...): "
                             f"batch_size={gb} / world, or Balancer(ddp, global_batch={gb}) and "
                             f"bal.loader(...) when the world does not divide it)")
        return integer(state["epoch"], "checkpoint epoch", 0)

    def _position_loaded(self, restored: bool) -> None:
        """A position was just loaded (``restored``: ``set_epoch`` checks the script resumes
        there): iterators started earlier refuse to go on, plans drawn before are forgotten."""
        self._early.restored = restored
        self.generation += 1
        self._forget()

    def _check_untrained(self) -> None:
        """Before a new iteration or epoch forgets the plans handed out: refuse those that an
        iteration which ran out left untrained (:class:`hetlb.data.board.PlanBoard`)."""

    def _new_iteration(self) -> None:
        """What every new iteration starts with (see :meth:`restart`)."""
        self._check_untrained()
        self._forget()
        self._early.restored = False
        self.iteration += 1

    def _new_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _all_handed(self) -> bool:
        """Whether every plan of the current epoch has been handed out."""
        raise NotImplementedError

    def _check_skip(self, epoch: int, finished: bool) -> None:
        """Refuse moving to ``epoch`` (after the current one) where the position forbids it."""

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to iterate (see :meth:`hetlb.data.loader.BalancedLoader.set_epoch`)."""
        e = integer(epoch, "epoch", 0)
        finished = self.epoch_finished()
        where = " (as the loaded checkpoint says)" if self.restored else ""
        if e == self.epoch:
            if finished:
                raise ValueError(
                    f"set_epoch({e}): epoch {e} is already complete{where}; each epoch's samples "
                    f"are drawn once. Continue with set_epoch({e + 1}) (a script resuming from a "
                    f"checkpoint taken at the end of epoch {e} starts at epoch {e + 1})")
            return
        if e < self.epoch:
            raise ValueError(f"set_epoch({e}): the loader is already at epoch {self.epoch}{where}; "
                             f"epochs run in order")
        self._check_skip(e, finished)
        self._check_untrained()
        self.left = (self.epoch, self._all_handed())
        self._new_epoch(e)
        self._forget()
