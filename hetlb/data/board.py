"""The plan board of balanced steps: what every step of training runs, shared by the Balancer and
the sampler.

The :class:`hetlb.Balancer` posts decisions here (per-rank batch sizes, or a :class:`ScheduleRule`
for size-aware scheduling); the sampler draws steps from the board as the DataLoader asks for
indices, each fixed at draw time as a :class:`StepPlan`; the loader hands the drawn plans to the
training loop in order; the Balancer marks a step complete once it has trained. No callbacks run
between them: each side reads and writes values on the board.

The board also owns the **data position**: the epoch and the number of its steps that have been
*trained* (not drawn, not handed out). That is what a checkpoint records, so it is exact whatever
the DataLoader prefetched, a batch handed to the loop but not yet trained is handed out again on
resume, and a state loaded before the loader exists is not lost (:mod:`hetlb.data.early`). Every
rank holds an identical board: the same decisions, the same draws, the same position.

Gradient accumulation (``accumulate=K``): the full steps of an epoch are grouped into windows of
``K`` consecutive steps (the last window of an epoch may be shorter; a short last step is a window
of its own), and every step of a window runs the sizes decided when its first step was drawn, so
the window's gradient can be weighted exactly (see :mod:`hetlb.comm.hook`).

Sharded mode (the loader's ``partition=``): every rank's samples of a step come from its own
shard, held by the board's :class:`hetlb.data.shards.Partition`, which is part of the position.

Delayed synchronous training plans no steps: its board is :class:`hetlb.data.stream.StreamBoard`.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Union

import numpy as np

from hetlb.core.checks import integer
from hetlb.core.decisions import (EXACT_INT, ScheduleRule, SingleSampleError, avoid_single,
                                  decision_checksum, move_to_sizes, rank_span, split_last)
from hetlb.core.solve import schedule
from hetlb.data.handout import Board
from hetlb.data.shards import Partition


__all__ = ["StepPlan", "PlanBoard"]


@dataclass(frozen=True, slots=True)  # (slots: one is made every step, caches cold)
class StepPlan:
    """One step as drawn: identical on every rank.

    Attributes:
        epoch, step: the epoch and the step's index in it.
        sizes: int64 ``[world]`` samples of every rank.
        data: float64 ``[world]`` data amount of every rank (sum of its samples' sizes; equals
            ``sizes`` when samples have no size).
        checksum: :func:`decision_checksum` of ``sizes``.
        window_pos, window_len: this step's place in its accumulation window.
        assignment: int64 ``[count]`` rank of each of the step's samples (in the global order)
            for a size-aware step, or None (rank ``r`` takes the ``r``-th contiguous slice).
        sq: float64 ``[world]`` sum of squared sample sizes of every rank, or None when samples
            have no size.
    """

    epoch: int
    step: int
    sizes: np.ndarray
    data: np.ndarray
    checksum: int
    window_pos: int = 0
    window_len: int = 1
    assignment: Optional[np.ndarray] = field(default=None, compare=False)
    sq: Optional[np.ndarray] = field(default=None, compare=False)

    @property
    def count(self) -> int:
        """Samples in the step over all ranks."""
        return int(self.sizes.sum())

    @property
    def window_end(self) -> bool:
        """Whether this step ends its accumulation window (the step that synchronises)."""
        return self.window_pos == self.window_len - 1

    def positions(self, rank: int) -> Union[np.ndarray, slice]:
        """Positions, within the step, of ``rank``'s samples: an index array for a size-aware
        step, else the contiguous slice of the rank (either indexes an array of the step's
        samples)."""
        if self.assignment is not None:
            return np.flatnonzero(self.assignment == rank)
        return slice(*rank_span(self.sizes.tolist(), rank))


Decision = Union[np.ndarray, ScheduleRule]


class PlanBoard(Board):
    """Decisions, drawn steps and the data position of one training job (one rank's copy).

    Args:
        world, rank: the ranks.
        global_batch: samples per step over all ranks.
        accumulate: steps per gradient-accumulation window.
    """

    def __init__(self, world: int, rank: int, global_batch: int, accumulate: int = 1) -> None:
        super().__init__(world, rank, global_batch)
        self.accumulate = integer(accumulate, "accumulate", 1)
        self.decision: Decision = np.zeros(self.world, np.int64)
        self.checksum = 0
        self._total = -1  # samples of a posted sizes decision (-1: none posted)
        self._amounts = np.zeros(self.world)  # its data amounts when samples have no size
        #: This rank's positions ``(begin, end)`` in a step of the posted sizes.
        self.span = (0, 0)
        #: Steps of the epoch trained (the data position, with the epoch).
        self.done = 0
        #: A restored position that closed its epoch: the epoch counts as finished whatever the
        #: loader's steps per epoch (a loader over a changed dataset resumes at the next epoch).
        self._closed = False
        #: Per-rank lower bounds on a batch, kept by the short last step where it can
        #: (:func:`split_last`); see :meth:`configure`.
        self.lower = np.zeros(self.world, np.int64)
        #: False: no split this board makes (an epoch's short last step, a size-aware step)
        #: hands a rank exactly one sample (:func:`avoid_single`), for a model whose layers refuse
        #: one sample in training; see :meth:`configure`.
        self.single_ok = True
        #: The sizes of the step (window) trained last, or None before any.
        self.last_sizes: Optional[np.ndarray] = None
        self._window: Optional[tuple] = None  # (epoch, window key, sizes) of the open window
        self.partition: Optional[Partition] = None

    # ------------------------------------------------------------------ decisions

    def configure(self, accumulate: int, lower: np.ndarray, single_ok: bool) -> None:
        """The Balancer's settings for the steps it draws: micro-steps per window, per-rank lower
        bounds (kept by the short last step where it can), and whether a split may hand a rank
        exactly one sample."""
        self.accumulate = integer(accumulate, "accumulate", 1)
        self.lower = np.asarray(lower, dtype=np.int64).copy()
        self.single_ok = bool(single_ok)

    def post(self, decision: Decision) -> None:
        """Publish the decision that steps drawn from now on run."""
        if isinstance(decision, ScheduleRule):
            if decision.slope.shape != (self.world,):
                raise ValueError(f"ScheduleRule has {decision.slope.shape[0]} ranks, the job {self.world}")
            if self.accumulate > 1:
                raise ValueError("size-aware scheduling assigns every step its own sizes, so it "
                                 "cannot run with gradient accumulation (accumulate > 1)")
        else:
            decision = np.asarray(decision, dtype=np.int64)
            d = self.decision
            if isinstance(d, np.ndarray) and d.tolist() == decision.tolist():
                return  # unchanged (the common case): keep the checksum
            if decision.shape != (self.world,) or (decision < 0).any():
                raise ValueError(f"a decision must be {self.world} non-negative sizes, got "
                                 f"{decision.tolist()}")
            # Read-only: whole steps share it as their sizes (draw's fast path).
            decision = decision.copy()
            decision.flags.writeable = False
            self._amounts = decision.astype(np.float64)
            self._amounts.flags.writeable = False
            self._total = int(decision.sum())
            self.span = rank_span(decision.tolist(), self.rank)
        self.decision = decision
        self.checksum = decision_checksum(decision)

    # ------------------------------------------------------------------ drawing

    def _window_of(self, step: int, full_steps: int) -> tuple:
        """``(key, position, length)`` of a step's accumulation window."""
        k = self.accumulate
        if step >= full_steps:  # the short last step: a window of its own
            return ("short",), 0, 1
        start = (step // k) * k
        return (start,), step - start, min(k, full_steps - start)

    def draw(self, epoch: int, step: int, count: int, full_steps: int,
             sample_sizes: Optional[np.ndarray] = None, seed: int = 0) -> StepPlan:
        """Plan step ``step`` of ``epoch`` (``count`` samples) and queue it for handing out.

        Args:
            full_steps: steps of the epoch that hold a whole ``global_batch``.
            sample_sizes: float64 ``[count]`` sizes of the step's samples in the global order, or
                None when samples have no size.
            seed: the loader's seed (a size-aware rule's random first pivot derives from it).
        """
        # Without accumulation every step is a window of its own (no window to remember).
        key, pos, length = (None, 0, 1) if self.accumulate == 1 else self._window_of(step, full_steps)
        assignment = sq = None
        if pos == 0 and sample_sizes is None and count == self._total and \
                isinstance(self.decision, np.ndarray):
            # A whole step of the posted sizes (the common case): checked and hashed when posted.
            sizes, data, checksum = self.decision, self._amounts, self.checksum
        else:
            if isinstance(self.decision, ScheduleRule):
                amounts = np.ones(count) if sample_sizes is None else np.asarray(sample_sizes, np.float64)
                rule = self.decision
                work, first = rule.work(amounts), rule.first(seed, epoch, step, count)
                try:
                    assignment = np.asarray(schedule(work, rule.slope, rule.intercept, first=first,
                                                     cap=rule.cap), dtype=np.int64)
                except ValueError as e:
                    if rule.cap is None:
                        raise
                    why = ("more than" if amounts.sum() > rule.cap.sum() else
                           "within, but the scheduler (by estimated time, largest first) could not "
                           "pack them under")
                    raise ValueError(
                        f"step {step} of epoch {epoch} cannot keep to the caps: its {count} samples "
                        f"total {amounts.sum():g} (largest {amounts.max():g}), {why} the ranks' caps "
                        f"{rule.cap.tolist()} ({rule.cap.sum():g} together; {e}, a sample's number "
                        f"there being its position in the step). Raise the policy's cap= (leave "
                        f"headroom) or lower the global batch") from None
                sizes = np.bincount(assignment, minlength=self.world).astype(np.int64)
                if not self.single_ok and np.any(sizes == 1):
                    target = self._two_or_none(sizes, np.full(self.world, count), epoch, step)
                    assignment = move_to_sizes(assignment, target)
                    sizes = target
                    if rule.cap is not None:
                        held = np.bincount(assignment, weights=amounts, minlength=self.world)
                        if np.any(held > rule.cap):
                            raise SingleSampleError(
                                f"step {step} of epoch {epoch}: no rank may train exactly one "
                                f"sample (the model's layers refuse it), and moving that sample "
                                f"breaks the policy's cap {rule.cap.tolist()} (the ranks would "
                                f"hold {held.tolist()}). Raise cap=, or give the model layers "
                                f"that take one sample (e.g. BatchNorm on inputs with more "
                                f"than one value per channel)")
            elif pos > 0 and self._window is not None and self._window[:2] == (epoch, key):
                sizes = self._window[2]
            else:
                sizes = split_last(self.decision, count, self.lower)
                if not self.single_ok:
                    sizes = self._two_or_none(sizes, self.decision, epoch, step)
            if sizes.shape != (self.world,) or int(sizes.sum()) != count or np.any(sizes < 0):
                raise RuntimeError(f"step plan {sizes.tolist()} does not split {count} samples over "
                                   f"{self.world} ranks")
            sq = None
            if sample_sizes is None:
                data = sizes.astype(np.float64)
            else:
                s = np.asarray(sample_sizes, np.float64)
                owner = assignment if assignment is not None else np.repeat(np.arange(self.world), sizes)
                data = np.bincount(owner, weights=s, minlength=self.world).astype(np.float64)
                sq = np.bincount(owner, weights=s * s, minlength=self.world).astype(np.float64)
                sq.flags.writeable = False
            sizes.flags.writeable = data.flags.writeable = False  # a plan is a value: shared, not changed
            # A size-aware plan is its assignment: two ranks with the same counts but different
            # samples must not pass the check.
            checksum = decision_checksum(sizes if assignment is None else assignment)
        if pos == 0 and key is not None:
            self._window = (epoch, key, sizes)
        plan = StepPlan(epoch=int(epoch), step=int(step), sizes=sizes, data=data, checksum=checksum,
                        window_pos=pos, window_len=length, assignment=assignment, sq=sq)
        self.drawn.append(plan)
        return plan

    def _two_or_none(self, sizes: np.ndarray, room: np.ndarray, epoch: int, step: int) -> np.ndarray:
        """:func:`avoid_single` for step ``step`` of ``epoch``, its error naming the step."""
        try:
            return avoid_single(sizes, room)
        except SingleSampleError as e:
            raise SingleSampleError(
                f"step {step} of epoch {epoch}: no rank may train exactly one sample (the model's "
                f"layers refuse it in training), but {e}. Pass drop_last=True to the loader (an "
                f"epoch's short last step), or a global batch that leaves every rank two or more "
                f"(lower=2); Balancer(..., lower=1) allows one sample where the layers' inputs "
                f"have more than one value per channel") from None

    def draw_sharded(self, epoch: int, step: int) -> StepPlan:
        """Plan step ``step`` of ``epoch`` in sharded mode: every rank's samples come from its own
        shard (:meth:`hetlb.data.shards.Partition.layout`); the checksum covers the partition."""
        _, counts, data, crc = self.partition.layout(epoch)
        sizes = counts[:, step].copy()
        amounts = data[:, step].copy()
        sizes.flags.writeable = amounts.flags.writeable = False
        checksum = zlib.crc32(sizes.tobytes(), crc) % EXACT_INT
        plan = StepPlan(epoch=int(epoch), step=int(step), sizes=sizes, data=amounts, checksum=checksum,
                        sq=self.partition.step_sq(epoch, step))
        self.drawn.append(plan)
        return plan

    def epoch_finished(self) -> bool:
        """Whether every step of the current epoch has trained (or a restored position says its
        epoch was complete)."""
        spe = self.steps_per_epoch
        if self._closed:
            return True
        if spe is None:
            return False
        if spe > 0:
            return self.done >= spe
        # No steps: an empty dataset never finishes an epoch, but the rest of a sharded epoch
        # whose every sample trained before a world-size change is finished.
        part = self.partition
        return part is not None and part.trained is not None and bool(part.trained.all())

    def _all_handed(self) -> bool:
        """Whether every step of the current epoch has been handed out (the last may be open)."""
        if self.epoch_finished():
            return True
        spe, cur = self.steps_per_epoch, self.handed[-1] if self.handed else None
        return spe is not None and cur is not None and cur.epoch == self.epoch and cur.step + 1 >= spe

    def set_partition(self, partition: Partition) -> None:
        """Sharded mode (the loader's ``partition=``); a position restored before the loader
        existed continues on it when the loader binds (:meth:`bind`)."""
        self.partition = partition

    def bind(self, config: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """The loader is bound (see :meth:`Board.bind`); first a sharded position restored before
        the loader existed continues on the loader's partition, or is refused when the loader
        differs in being sharded."""
        early = self._early
        if early.sharded is False and self.partition is not None:
            self.partition = None  # (the board stays global-order: a loader without one may bind)
            raise ValueError("the checkpoint was taken with a global-order loader and this loader "
                             "is sharded (partition=); resume with the same partition= setting")
        early.sharded = None
        if early.partition is not None:
            saved, epoch, done = early.partition
            early.partition = None
            if self.partition is None:
                raise ValueError("the checkpoint was taken with a sharded loader (partition=) and "
                                 "this loader is global-order; resume with the same partition= "
                                 "setting")
            self.done = self.partition.load(saved, epoch, done, self.world)
            self.steps_per_epoch = self.partition.steps
        return super().bind(config)

    def _forget(self) -> None:
        super()._forget()
        self._window = None

    def _new_epoch(self, epoch: int) -> None:
        super()._new_epoch(epoch)
        self.done = 0
        self._closed = False
        if self.partition is not None:
            self.partition.new_epoch()
            self.steps_per_epoch = self.partition.steps

    def restart(self) -> int:
        """A new iteration over the loader begins: forget plans drawn or handed out but not
        trained (they are drawn again) and return the step to draw from. A finished epoch moves
        on to the next one (a DataLoader iterated again starts a new epoch)."""
        self._new_iteration()
        if self.epoch_finished():
            self._new_epoch(self.epoch + 1)
        elif self.partition is not None:
            self.partition.apply_pending()  # re-placed after a world-size change
        return self.done

    def _check_untrained(self) -> None:
        if not (self.ran_out and self.handed):
            return
        left = list(self.handed)
        self._forget()  # (drawn again by the next iteration, as after a break)
        raise RuntimeError(
            f"hetlb: the last loop over the loader ran to its end and left {len(left)} of the "
            f"batches it received untrained (step(s) {[p.step for p in left]} of epoch "
            f"{left[0].epoch}). A step opens at its batch's first training forward and takes the "
            f"batches in the order they were handed out (so a loop may fetch batches ahead): a "
            f"batch never forwarded (`continue` at the top of the loop body, a ported script's "
            f"own 'skip the first k batches' on resume, a forward under torch.no_grad()) moves "
            f"every later batch onto the plan of the one before it. Skip a batch after its "
            f"forward (compute the loss, skip the backward on every rank), drop a resume skip "
            f"(the loader resumes at its position itself), and evaluate with a loader bound to "
            f"no Balancer")

    def complete(self, plan: StepPlan) -> None:
        """``plan`` has trained (for accumulation: its window has): the position moves past it."""
        if plan.epoch == self.epoch:
            self.done = max(self.done, plan.step + 1)
        self.last_sizes = plan.sizes
        if self.current is plan:
            self.handed.popleft()

    # ------------------------------------------------------------------ epochs and checkpoints

    def _check_skip(self, epoch: int, finished: bool) -> None:
        spe = self.steps_per_epoch
        if self.restored and not finished:
            raise ValueError(
                f"set_epoch({epoch}): the loaded checkpoint was taken at step {self.done} of "
                f"{spe if spe is not None else '?'} of epoch {self.epoch}; finish that epoch first "
                f"(set_epoch({self.epoch})), or its remaining samples would be skipped")
        if self.restored and epoch > self.epoch + 1:
            raise ValueError(f"set_epoch({epoch}): the loaded checkpoint completed epoch {self.epoch}; "
                             f"the next epoch is {self.epoch + 1}")

    def position(self) -> Dict[str, Any]:
        """The data position (plain values): epoch and steps of it trained; ``epoch_end`` when the
        epoch is complete (so a loader with another number of steps per epoch resumes at the next
        epoch), and the partition in sharded mode."""
        out = {"epoch": int(self.epoch), "step": int(self.done), "global_batch": self.global_batch}
        if self.epoch_finished():
            # Marks the epoch complete on its own, so a loader with another number of steps per
            # epoch (a dataset changed between runs) resumes at the next epoch, not inside this one.
            out["epoch_end"] = True
        if self._early.partition is not None:  # (restored before the loader: not applied yet)
            out["partition"] = self._early.partition[0]
        elif self.partition is not None:
            out["partition"] = self.partition.state()
        return out

    def load_position(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`position` output; iterators started earlier refuse to go on.

        Before a loader draws from the board (``Balancer.load_state_dict`` before
        ``bal.loader()``), a sharded position waits for the loader's partition (:meth:`bind`)."""
        epoch = self._checked_position(state)
        if "step" not in state:
            raise ValueError(f"not a hetlb data position of balanced steps: it has no 'step' "
                             f"(keys {sorted(state)}); expected the dict of Balancer.state_dict() "
                             f"or loader.state_dict()")
        done = integer(state["step"], "checkpoint step", 0)
        spe = self.steps_per_epoch
        if spe is not None and self.partition is None and done > spe and \
                not state.get("epoch_end", False):  # (a finished epoch resumes at the next)
            raise ValueError(f"checkpoint step={done} is past the end of this loader's epoch "
                             f"of {spe} steps; the checkpoint is of another dataset or loader")
        saved = state.get("partition")
        defer = saved is not None and self.partition is None and not self.attached
        if (saved is None) != (self.partition is None) and not defer:
            raise ValueError("the checkpoint was taken with a " + ("sharded" if saved is not None else "global-order") +
                             " loader and this loader is " + ("sharded" if self.partition is not None else
                             "global-order") + "; resume with the same partition= setting")
        if saved is not None and not defer:
            done = self.partition.load(saved, epoch, done, self.world)
            self.steps_per_epoch = self.partition.steps
        self.epoch, self.done = epoch, done
        # No loader yet: its partition takes this position when it binds (bind).
        self._early.partition = (saved, epoch, done) if defer else None
        self._early.sharded = None if self.attached else saved is not None
        self._closed = bool(state.get("epoch_end", False))
        self._position_loaded(restored=True)

