"""The step driver: the step in progress, the telemetry block and the accumulation window.

The batches the loader hands out queue on the board (:attr:`hetlb.data.handout.Board.handed`),
and steps take them in order, so a loop may fetch batches ahead of its training. The oldest
batch's step is open (its weights set) from when it heads the queue (or at ``with
bal.step():``); its compute is timed from the model's first forward to the end of its backward
(the hook's last bucket), and it ends when the loop asks for the next batch after its forward
ran (or when the ``with`` block closes, or a count or the position is read after its backward):
the table of the step, or of the block it closes, is checked against the plans, recorded in the
decision loop, and the next decision is posted to the board. A batch not forwarded yet when the
loop asks for the next one stays the open step (the loop fetched ahead). The driver is the
loader's owner of steps (:class:`hetlb.data.protocol.StepOwner`).
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from hetlb.comm.gradients import GradientTransport, ModelRegistry
from hetlb.comm.hook import StepTelemetry
from hetlb.comm.weights import weights_for
from hetlb.core.decisions import ScheduleRule, decision_checksum
from hetlb.core.exchange import next_block_length, ships
from hetlb.core.telemetry import COL, StepRecord
from hetlb.data.board import PlanBoard, StepPlan
from hetlb.data.shards import Partition, epoch_rates
from hetlb.policies.loop import DecisionLoop
from hetlb.ranks.agreement import Peers
from hetlb.ranks.watchdog import FLUSHING, WAITING
from hetlb.train.losses import FinishedStep, LossLog, global_loss
from hetlb.train.micro import MicroWays, run_micro_steps
from hetlb.train.model_hooks import ModelHooks, not_syncing, unattached_message
from hetlb.train.runlog import RunLog
from hetlb.train.verify import RECORD_COLS, verify_table
from hetlb.train.window import Window


log = logging.getLogger("hetlb.balancer")


def same_weights(weights: np.ndarray) -> bool:
    """Whether every rank's weight is the same (each ``1 / world``: DDP's own mean)."""
    return bool((weights == weights[0]).all())


def equal_weights(weighting: str, decision: Any) -> bool:
    """Whether a whole step of ``decision`` weighs every rank ``1 / world`` (a size-aware rule's
    plans, or "sizes" weighting, depend on the samples drawn: not known in advance)."""
    if not isinstance(decision, np.ndarray) or weighting == "sizes":
        return False
    return same_weights(weights_for(weighting, decision, decision))


def broken_window(broken: StepPlan) -> str:
    """The error for a micro-step after one of its window raised."""
    return (f"hetlb: micro-step {broken.window_pos + 1} of the accumulation window that started "
            f"at step {broken.step - broken.window_pos} of epoch {broken.epoch} raised, so the "
            f"window cannot end exactly (its weights count every micro-step's samples). Leave the "
            f"loop, drop the window's gradients (optimizer.zero_grad()) on every rank and start a "
            f"new loop over the loader: it trains the window from its first micro-step")


def backward_before_forward(plan: StepPlan, eval_mode: bool = False) -> str:
    """The error for a step whose backward ran before its forward (the previous batch's), or,
    with ``eval_mode`` (the balanced model is in eval() mode), after a forward that opened no
    step."""
    if eval_mode:
        return (f"hetlb: the backward of step {plan.step} of epoch {plan.epoch} ran without a "
                f"training forward: the model is in eval() mode, and a forward opens a step only "
                f"in train() mode (a forward in eval mode is taken for an evaluation). Train in "
                f"train() mode (to switch dropout off, set its p to 0), or mark each step with "
                f"`with bal.step():` around its forward and backward")
    return (f"hetlb: the backward of step {plan.step} of epoch {plan.epoch} ran before its "
            f"forward: it was the previous batch's backward. The loop asked for the next batch "
            f"between a forward and its backward (as nanoGPT's get_batch after the forward), which "
            f"ended that batch's step before its gradient existed. Call the backward before asking "
            f"the loader for the next batch, or mark each step with `with bal.step():` around its "
            f"forward and backward")


def left_in_window(c: StepPlan) -> str:
    """The error for a new loop while the last one's window left its gradients behind."""
    return (f"hetlb: the previous loop over the loader was left inside an accumulation window "
            f"(after micro-step {c.window_pos + 1} of {c.window_len}, step {c.step} of epoch "
            f"{c.epoch}) and the parameters still hold that window's gradients; a new loop trains "
            f"the window from its first micro-step, so those samples would count twice. Leave a "
            f"loop only when bal.synced is True, or drop the window's gradients "
            f"(optimizer.zero_grad()) on every rank before the new loop")


def rebalance(part: Partition, loop: DecisionLoop, epoch: int, world: int) -> None:
    """``epoch`` ended (sharded mode): decide the moves for the next one, from the size-aware
    policy's time models when it has them, else from each rank's measured time per unit of data
    over the epoch. Every rank computes the same from the same values."""
    d = loop.decision
    if isinstance(d, ScheduleRule) and np.all(d.slope > 0):
        slope, intercept = d.slope, d.intercept
    else:
        rates = epoch_rates(loop.history, epoch, world)
        if rates is None:
            log.warning("epoch %d: no usable timing of every rank; the partition is kept", epoch)
            return
        slope, intercept = rates, np.zeros(world)
    moves = part.plan(slope, intercept)
    log.info("epoch %d: rebalancing moves %d of %d samples", epoch, len(moves), part.home.size)


def epoch_last(plan: StepPlan, steps_per_epoch: Optional[int]) -> bool:
    """Whether ``plan`` is the last step of its epoch (``steps_per_epoch``: the bound loader's;
    None without one, where epochs have no end)."""
    return steps_per_epoch is not None and plan.step + 1 >= steps_per_epoch


def plan_without_loader(d: Any, k: int, steps: int, micro: int) -> StepPlan:
    """The plan of a step without a loader (``bal.step()`` on batches of the script's own):
    the decision's sizes, micro-step ``micro`` of window ``steps`` of ``k``."""
    if not isinstance(d, np.ndarray):
        raise RuntimeError("a size-aware decision (ScheduleRule) needs the Balancer's loader")
    sizes, data = d.copy(), d.astype(np.float64)
    sizes.flags.writeable = data.flags.writeable = False  # a plan is a value (records share it)
    return StepPlan(epoch=0, step=steps * k + micro, sizes=sizes, data=data,
                    checksum=decision_checksum(d), window_pos=micro, window_len=k)


class UnattachedSearches:
    """The searches for models trained unattached (see :class:`ModelHooks`) of finished steps,
    compared with the other ranks'. Every rank searches the same steps and compares each once:
    at the step's end, or for a step one rank settled alone (``len``, ``bal.steps``, a checkpoint)
    at the next batch, loop or flush, where the others end it: a comparison at the settling
    would be a collective the other ranks never join."""

    def __init__(self, peers: Peers, wrapper: str, registry: Optional[ModelRegistry]) -> None:
        self.peers, self.wrapper = peers, wrapper
        self.counts_made = registry is None or registry.counts_made
        self.pending: List[Tuple[Optional[str], int]] = []  # (what was found, the step)

    def ended(self, found: Optional[str], step: int) -> None:
        self.pending.append((found, step))

    def compare(self) -> None:
        while self.pending:
            found, step = self.pending.pop(0)
            everyone = self.peers.gather({"found": found})
            seen = [r for r, e in enumerate(everyone) if e["found"] is not None]
            if seen:
                raise RuntimeError(unattached_message(self.wrapper, everyone[seen[0]]["found"],
                                                     seen, step, self.counts_made))


@dataclass(slots=True)  # (one a step)
class _Open:
    """The step (or accumulation micro-step) in progress."""

    plan: StepPlan
    explicit: bool
    ship: bool = True  # this step sends the telemetry table (the last of its block)


class StepDriver:
    """Runs the steps of one Balancer (see the module docstring).

    Args:
        model: the balanced model.
        telemetry, board, loop, hooks: the Balancer's parts the steps use.
        gradients: the gradient transport (how this rank's weighted gradient reaches the others).
        rank, world: this rank and the number of ranks.
        weighting, accumulate, exchange_every, adaptive_exchange: the settings; route: the table's
            route (:mod:`hetlb.comm.route`).
        watchdog: the Balancer's watchdog, or None.
        runlog: the run log (rank 0 with ``log_dir``), or None.
        peers: gathers small values from every rank (the first step's check for unattached models).
    """

    def __init__(self, model: torch.nn.Module, telemetry: StepTelemetry, board: PlanBoard,
                 loop: DecisionLoop, hooks: ModelHooks, gradients: GradientTransport, *, rank: int, world: int, weighting: str,
                 accumulate: int, exchange_every: int, adaptive_exchange: bool, route: str,
                 watchdog: Any, runlog: Optional[RunLog], peers: Peers) -> None:
        self.model, self.telemetry, self.board, self.loop, self.hooks = model, telemetry, board, loop, hooks
        self.gradients = gradients
        self.rank, self.world, self.weighting = rank, world, weighting
        self.accumulate, self.exchange_every = accumulate, exchange_every
        self.adaptive_exchange, self.route = adaptive_exchange, route
        self.watchdog, self.runlog, self.peers = watchdog, runlog, peers
        #: How this rank runs a share in micro-steps (:meth:`micro_steps`), set at start-up.
        self.micro = MicroWays()
        #: Whether a loader is bound (it hands out the steps' batches).
        self.bound = False
        #: Seconds the driver itself spent in the latest step (row, table check, record,
        #: decision), excluding the user's forward and backward.
        self.last_overhead = 0.0
        self._spent = 0.0
        # (sizes, data, window_len, (weight, batch, data, equal)) of _weight's latest plan
        self._weight_of: tuple = (None, None, 0, (0.0, 0.0, 0.0, True))
        self._open: Optional[_Open] = None
        #: This rank's logged losses of the open window (:meth:`log_loss`).
        self.losses = LossLog(telemetry)
        self.window = Window(gradients, accumulate)
        self.reset(0)

    def reset(self, steps: int) -> None:
        """Start over at ``steps`` completed steps (construction, a loaded checkpoint): no step
        open, no block, no window."""
        if self._open is not None:
            self._discard()
        self._step = steps  # completed steps (accumulation windows)
        self._in_with = False
        self._consumed: Optional[StepPlan] = None  # the handed plan a bal.step() already used
        self._broken: Optional[StepPlan] = None  # a micro-step whose `with bal.step():` raised
        self._ended: Optional[np.ndarray] = None  # its sizes, until the loop asks for a batch
        self._micro = 0  # micro-steps without a loader (window position)
        self.unattached = UnattachedSearches(self.peers, self.gradients.name, self.gradients.registry)
        self.window.leave(failed=True)  # (an open window check's hooks come off)
        self.window = Window(self.gradients, self.accumulate)
        self._partials: Dict[int, tuple] = {}
        # The block's steps run since the last exchange (exchange_every > 1): (step, plan).
        self._block: List[Tuple[int, StepPlan]] = []
        # The first step after the Balancer is made or a checkpoint is loaded is an exchange of its
        # own (with exchange_every > 1): ranks that start from different positions meet in one
        # table of one shape there and get DecisionMismatchError, not a collective of different
        # shapes.
        self._ship_next = True
        # Steps of the current block: exchange_every, or with adaptive_exchange from 1 up to it.
        self._block_len = 1 if self.adaptive_exchange else self.exchange_every
        self.losses.reset()
        # The newest step whose telemetry arrived: (step, plan, record columns, table), or its
        # FinishedStep once read (see `finished`).
        self._last: Any = None

    @property
    def in_step(self) -> bool:
        """Whether ``with bal.step():`` is running or a step is open."""
        return self._in_with or self._open is not None

    @property
    def in_with(self) -> bool:
        """Whether ``with bal.step():`` is running."""
        return self._in_with

    @property
    def last_plan(self) -> Optional[StepPlan]:
        """The plan the latest ``with bal.step():`` trained (None after the loop asks for the
        next batch)."""
        return self._consumed

    def batch_sizes(self) -> np.ndarray:
        """:attr:`hetlb.Balancer.batch_sizes`."""
        if self._open is not None:
            return self._open.plan.sizes.copy()
        if self.board.current is not None:
            return self.board.current.sizes.copy()
        if self._ended is not None:  # a step (window) ended in `with bal.step():`, no next batch yet
            return self._ended.copy()
        d = self.loop.decision
        if isinstance(d, np.ndarray):
            return d.copy()
        last = self.board.last_sizes
        return last.copy() if last is not None else np.zeros(self.world, np.int64)

    def span(self) -> Tuple[int, int]:
        """:attr:`hetlb.Balancer.span`."""
        if isinstance(self.loop.decision, ScheduleRule):
            raise RuntimeError(f"bal.span: {self.loop.name} assigns each step's samples to ranks one "
                               f"by one (not in contiguous spans); it needs the Balancer's loader")
        sizes = self.batch_sizes().tolist()
        return sum(sizes[:self.rank]), sum(sizes[:self.rank + 1])

    @property
    def finished(self) -> Optional[FinishedStep]:
        """:attr:`hetlb.Balancer.finished`."""
        self.settle()
        last = self._last
        if isinstance(last, tuple):
            step, plan, cols, table = last
            losses = table[:, COL["loss"]].copy()  # (from the table that completed the record)
            weights = weights_for(self.weighting, plan.sizes, cols[COL["data"]])
            last = self._last = FinishedStep(step=step, epoch=plan.epoch, sizes=plan.sizes.copy(),
                                             losses=losses, loss=global_loss(weights, losses))
        return last

    @property
    def steps(self) -> int:
        """Completed steps (accumulation windows); a handed step whose backward ran counts."""
        self.settle()
        return self._step

    @property
    def synced(self) -> bool:
        """Whether the latest ``bal.step()`` ended an accumulation window (its gradient is
        complete: step the optimizer). Always True without accumulation."""
        return self._consumed is None or self._consumed.window_end

    def _weight(self, plan: StepPlan) -> Tuple[float, float, float, bool]:
        """This rank's aggregation weight, batch and data amount in ``plan``, and whether every
        rank's weight is the same (``1 / world``: DDP's own mean); the weight of a window shorter
        than ``accumulate`` (the end of an epoch) scaled by ``accumulate / length``, since each
        micro-step's loss is divided by ``accumulate``."""
        key = self._weight_of
        # Plans are values and whole steps share the posted decision's arrays: the same arrays
        # give the same values (the common case costs no NumPy call).
        if key[0] is plan.sizes and key[1] is plan.data and key[2] == plan.window_len:
            return key[3]
        weights = weights_for(self.weighting, plan.sizes, plan.data)
        w = float(weights[self.rank])
        equal = same_weights(weights)
        if self.accumulate > 1 and plan.window_len < self.accumulate:
            w *= self.accumulate / plan.window_len
            equal = False
        got = (w, float(plan.sizes[self.rank]), float(plan.data[self.rank]), equal)
        self._weight_of = (plan.sizes, plan.data, plan.window_len, got)
        return got

    def _begin(self, plan: StepPlan, explicit: bool) -> None:
        t = time.perf_counter()
        w, batch, data, equal = self._weight(plan)
        self.gradients.before_step(plan, w, equal)
        hooks = self.hooks
        if hooks.wants_check or (hooks.searches and hooks.made != hooks.registry.count):  # see ModelHooks
            hooks.start_check()
        first = plan.window_pos == 0
        if first:
            self.window.data = 0.0
        if plan.window_end and plan.window_len > 1:
            data = (self.window.data + data) / plan.window_len
        offset = 0.0 if first else max(float(self.telemetry.core.compute), 0.0)
        pos = len(self._block)
        spe = self.board.steps_per_epoch if self.bound else None
        ship = ships(pos, self._block_len, restarted=self._ship_next, epoch_last=epoch_last(plan, spe),
                     epoch_first=plan.step == 0 and self.bound)
        tele = self.telemetry
        predicted = self.loop.predict(self.rank, tele.probe.memory()) if self.loop.predictors \
            else math.nan
        tele.start(self._step, w, batch, data, predicted, self.board.checksum, plan.checksum,
                   plan.epoch, offset=offset, new_window=first,
                   sq=0.0 if plan.sq is None else float(plan.sq[self.rank]), pos=pos, ship=ship,
                   loss=self.losses.value() if self.losses.used else math.nan)
        self._open = _Open(plan, explicit, ship)
        if self.watchdog is not None:
            self.watchdog.beat(self._step, self.telemetry)
        self._spent += time.perf_counter() - t

    @contextlib.contextmanager
    def step(self, owner: Any) -> Iterator[Any]:
        """:meth:`hetlb.Balancer.step` (``owner`` is what the ``with`` yields)."""
        if self._in_with:
            raise RuntimeError("Balancer.step() is already running; steps cannot nest")
        if self.bound:
            plan = self.board.current
            if plan is None or plan is self._consumed:
                raise RuntimeError("Balancer.step() without a new batch from the Balancer's loader: "
                                   "every step consumes exactly one batch it hands out")
        else:
            plan = plan_without_loader(self.loop.decision, self.accumulate, self._step,
                                       self._micro)
        broken = self._broken
        if broken is not None and plan.window_pos > 0:  # (until the next window or loop)
            raise RuntimeError(broken_window(broken))
        self._broken = None
        if self.accumulate == 1:
            off = self.gradients.no_sync_on(self.model)
            if off is not None:
                raise RuntimeError(not_syncing(off))
        if not self.bound:
            self.board.hand_own(plan)
        self._begin(plan, explicit=True)
        self._in_with = True
        self.hooks.mark(True)
        try:
            self.window.check(plan, self.model)
            with contextlib.nullcontext() if plan.window_end else self.gradients.local():
                yield owner
            self.window.leave()
        except BaseException:
            self.window.leave(failed=True)
            self._in_with = False
            self.hooks.mark(False)
            self._discard()
            # The batch is given up, as a loop that skips it after an error does; the next step
            # takes the next batch (a window missing a micro-step cannot end exactly: refused).
            self.board.drop_current()
            if self.accumulate > 1:
                self._broken = plan
            raise
        self._in_with = False
        self.hooks.mark(False)
        self._consumed = plan
        if self.bound:  # (without one, batch_sizes says the next step's)
            self._ended = plan.sizes
        if plan.window_end:
            if self.accumulate > 1:  # (a window's weight, applied once: see window_done)
                self.gradients.window_done(self._weight(plan)[0])
            self._finish()
            self.window.synced(plan)
        else:
            t = time.perf_counter()
            self.telemetry.stamp(end_window=False)
            self.window.micro_step(float(plan.data[self.rank]))
            self.losses.micro_step_done()
            self.telemetry.close()
            self._open = None
            self.board.drop_current()  # (the window's position moves at its last micro-step)
            if not self.bound:
                self._micro += 1
            self._spent += time.perf_counter() - t

    def backward(self, loss: torch.Tensor, gradient: Optional[torch.Tensor] = None,
                 **kwargs: Any) -> None:
        """:meth:`hetlb.Balancer.backward`."""
        if self._open is None:
            raise RuntimeError("hetlb: bal.backward(loss) outside a balanced step; call it for a "
                               "batch of the Balancer's loader, or inside `with bal.step():`")
        self.gradients.backward(loss, gradient, self.telemetry.core.weight,
                                window=self.accumulate > 1, **kwargs)

    def micro_steps(self, fn: Any, batch: Tuple[Any, ...], reduce: str) -> torch.Tensor:
        """:meth:`hetlb.Balancer.micro_steps`."""
        return run_micro_steps(fn, batch, self._open and self._open.plan, self.micro,
                               self.rank, telemetry=self.telemetry, transport=self.gradients,
                               expect=self.hooks.expect, reduce=reduce)

    def log_loss(self, loss: Any) -> None:
        """:meth:`hetlb.Balancer.log_loss`."""
        if self._open is None:
            raise RuntimeError("hetlb: bal.log_loss(loss) outside a balanced step; call it for a "
                               "batch of the Balancer's loader (or inside `with bal.step():`), "
                               "between the forward and the backward")
        if self.telemetry.hooked:
            raise RuntimeError("hetlb: bal.log_loss(loss) after this step's backward: its "
                               "telemetry row, which carries the loss to the other ranks, has "
                               "been sent. Call bal.log_loss(loss) before loss.backward()")
        self.losses.log(loss)

    def _discard(self) -> None:
        """Drop the open step without finishing it (a peek, or an exception in its body)."""
        self.telemetry.close()
        self.losses.discard()
        self._open = None
        self.hooks.stop_check()

    def _finish(self, alone: bool = False) -> None:
        """End the open step: its table, checks, record, the next decision, the position.
        ``alone``: this rank may be the only one ending it here (see :meth:`settle`)."""
        t = time.perf_counter()
        plan, ship = self._open.plan, self._open.ship
        tele = self.telemetry
        if self.losses.used:
            self.losses.window_done()
        if not ship:  # inside a block: the row stays in the core until the block's exchange
            tele.end_kept()
            self._open = None
            self._block.append((self._step, plan))
            self._advance(plan, alone)
            self._spent += time.perf_counter() - t
            self.last_overhead, self._spent = self._spent, 0.0
            return
        table = tele.table() if tele.hooked else None
        if table is None:
            if tele.hooked and self.gradients.delivers_table:
                # The communication hook ran to its last bucket but delivered nothing: a bug in
                # hetlb. An exchange here would be a collective the other ranks (whose tables
                # arrived) never join, so it would hang until the timeout instead.
                raise RuntimeError(f"hetlb: step {self._step}: the gradient's communication hook "
                                   f"ran but delivered no telemetry table (route "
                                   f"{self.route!r}); please report this with the script")
            if not tele.hooked:
                tele.stamp()
            # No hook carried the row (a step without gradients, or one process without DDP):
            # all-reduce it on its own, waiting for the others there.
            if self.watchdog is not None:
                self.watchdog.beat(self._step, WAITING)
                try:
                    table = tele.exchange()
                finally:
                    self.watchdog.beat(self._step)
            else:
                table = tele.exchange()
        tele.close()
        self._open = None
        steps = self._block + [(self._step, plan)]  # the block's steps, each with its own table
        self._block = []
        self._ship_next = False
        done = self._split(steps, table)
        self._advance(plan, alone)
        self._next_block(self._record([(g, tab) for (g, _), tab in done]))
        part = self.board.partition
        if part is not None and part.rebalance and part.pending is None and \
                plan.epoch == self.board.epoch and self.board.epoch_finished():
            rebalance(part, self.loop, plan.epoch, self.world)
        self._spent += time.perf_counter() - t
        self.last_overhead, self._spent = self._spent, 0.0

    def _split(self, steps: List[Tuple[int, StepPlan]], table: np.ndarray) -> list:
        """``table`` (step-major) cut into one table per step of ``steps``, each checked against
        its plan and kept for its record: ``[((step, plan), [world, F] table), ...]``."""
        if table.shape[0] != len(steps) * self.world:
            raise RuntimeError(f"hetlb: step {steps[-1][0]}: the telemetry table has "
                               f"{table.shape[0]} rows for a block of {len(steps)} step(s) of "
                               f"{self.world} ranks; please report this with the script")
        done = list(zip(steps, table.reshape(len(steps), self.world, table.shape[1])))
        for (g, p), tab in done:
            verify_table(tab, p, g, sharded=self.board.partition is not None)
        for (g, p), tab in done:
            self._partials[g] = (p, tab)
        return done

    def flush(self) -> None:
        """:meth:`hetlb.Balancer.flush`."""
        if self._in_with:
            raise RuntimeError("bal.flush() inside `with bal.step():`; call it between steps")
        self.settle()  # a step whose backward ran is trained (and may itself exchange)
        self.unattached.compare()
        o = self._open
        if not self._block:
            return
        steps, self._block = self._block, []
        if self.watchdog is not None:  # (a rank flushing alone is named as such)
            self.watchdog.beat(self._step, FLUSHING)
        try:
            table = self.telemetry.exchange(kept=len(steps))
        finally:
            if self.watchdog is not None:
                self.watchdog.beat(self._step)
        self._ship_next = False
        if o is not None:  # untrained: reopened below as the first step of the next block
            self._discard()
        try:
            done = self._split(steps, table)
            self._next_block(self._record([(g, tab) for (g, _), tab in done]))
        finally:
            if o is not None:  # (after the decision: the block's length is the new one)
                self._begin(o.plan, o.explicit)

    def _next_block(self, steady: bool) -> None:
        """After an exchange: the next block's length (see ``adaptive_exchange``)."""
        if self.adaptive_exchange:
            self._block_len = next_block_length(self._block_len, steady, self.exchange_every)

    def _advance(self, plan: StepPlan, alone: bool = False) -> None:
        """``plan``'s step is done: the position, the step count and the watchdog move on.
        ``alone``: the other ranks may not be here (:meth:`settle`); a search for unattached
        models is then compared with theirs at the next point every rank reaches."""
        if self.hooks.checking:  # the step ran with its models checked (see ModelHooks)
            self.unattached.ended(self.hooks.end_check(), self._step)
        self.board.complete(plan)
        if not self.bound:
            self._micro = 0
        self._step += 1
        if not self._step & (self._step - 1) and self.hooks.searches:  # (steps 1, 2, 4, ...)
            self.hooks.wants_check = True
        if self.watchdog is not None:
            self.watchdog.beat(self._step)
        if not alone:  # (after the count: the step trained; the error is about another model)
            self.unattached.compare()

    def _record(self, steps: List[Tuple[int, np.ndarray]]) -> bool:
        """The records the tables of ``steps`` (in order; one step, or an exchanged block's)
        complete, then one decision. Returns whether the newest step was recorded and the
        decision kept the sizes."""
        records: List[StepRecord] = []
        for g, table in steps:
            done = g - self.telemetry.lag
            if done < 0 or done not in self._partials:
                continue
            plan, old = self._partials.pop(done)
            # One copy holds the record's float columns (the table's first columns, in record
            # order); the batch is the plan's, which _verify matched to the table exactly.
            cols = old[:, :RECORD_COLS].T.copy()
            cols[COL["compute"]] = table[:, COL["compute"]]
            if plan.window_len != 1:
                cols[COL["compute"]] /= plan.window_len
            self._last = (done, plan, cols, table)  # (made a FinishedStep when it is read)
            spe = self.board.steps_per_epoch if self.bound else None
            records.append(StepRecord(step=done, epoch=plan.epoch, epoch_end=epoch_last(plan, spe),
                                      batch=plan.sizes, compute=cols[COL["compute"]],
                                      data=cols[COL["data"]], memory=cols[COL["memory"]],
                                      cpu=cols[COL["cpu"]], predicted=cols[COL["predicted"]],
                                      sq=plan.sq))
        decision = self.loop.advance(records)
        if decision is None:  # the newest step's telemetry (or the history) was refused
            return False
        before = self.board.checksum
        self.board.post(decision)
        steady = self.board.checksum == before
        if self.runlog is not None:
            policy = self.loop.policy
            actions = getattr(policy, "actions", None)
            for record in self.loop.accepted:
                self.runlog.write(record, getattr(policy, "name", type(policy).__name__),
                                  actions[-1] if actions else None, decision)
        return steady

    def settle(self) -> None:
        """Finish a handed step whose backward ran now rather than at the next batch (a loop
        left after it: ``len(loader)``, ``bal.steps`` and a checkpoint count it). No collective
        here that the other ranks would not join: its hook (or with a deferred hook, the end of
        its backward) sent the table; one process exchanges with itself; the step's search for
        unattached models is compared with the other ranks' at the next batch, loop or flush."""
        o = self._open
        if o is not None and not o.explicit and not self._in_with and self.telemetry.hooked:
            self._finish(alone=True)
            self._arm()

    def iteration_starts(self) -> None:
        """A new iteration over the loader: a step that trained is finished; a batch handed out
        and never trained (a peek) is forgotten, and will be handed out again."""
        self.unattached.compare()
        o = self._open
        if o is not None and not self._in_with:
            if self.telemetry.hooked:
                self._finish()
            else:
                self._discard()
        c = self._consumed
        if c is not None and not c.window_end and self.bound:
            # The previous loop was left inside an accumulation window. The new one starts at the
            # window's first micro-step (the position counts whole windows, as a checkpoint
            # must), which is right only if the micro-steps' gradients are gone.
            # Asked of every rank (all reach this point together, windows being aligned): an
            # idle rank's gradients may be zero while the others' are not.
            everyone = self.peers.gather({"dropped": self.window.dropped()})
            if not all(e["dropped"] for e in everyone):
                raise RuntimeError(left_in_window(c))
        self._consumed = None
        self._broken = None
        self._ended = None

    def before_next(self) -> None:
        """The loop asks for the next batch: the open step ends here if its forward ran
        (trained, or stepped without gradients); else the loop fetched ahead and it stays open."""
        self._ended = None
        self.unattached.compare()
        o = self._open
        tele = self.telemetry
        if o is not None and not self._in_with and (tele.hooked or tele.core.restarted):
            if not tele.core.restarted:  # (every rank alike: the loop is the same on all)
                raise RuntimeError(backward_before_forward(o.plan, not self.model.training))
            self._finish()  # trained (its hook ran), or stepped without gradients: exchanged
            self._arm()

    def handed(self, plan: StepPlan) -> None:
        """The loop received ``plan``'s batch (queued on the board): without accumulation the
        oldest queued batch's step is open."""
        self._arm()

    def _arm(self) -> None:
        """Without accumulation, open the step of the oldest batch handed out (it heads the
        board's queue) if no step is open: its weights must be set before its backward, and a
        plain loop's body holds no other point of hetlb's before the forward."""
        if self.accumulate == 1 and self._open is None and not self._in_with and self.bound:
            plan = self.board.current
            if plan is not None:
                self._begin(plan, explicit=False)

    def exhausted(self) -> Optional[str]:
        """The DataLoader ran out: the iteration ends (balanced steps have no rounds)."""
        return None

    def close(self) -> None:
        """Record the steps since the last exchange where one process can (see
        :meth:`hetlb.Balancer.close`), and close the run log."""
        if self._block and not self._in_with:
            if self.world == 1:
                self.flush()
            elif self.runlog is not None:
                log.warning("bal.close(): the %d step(s) since the last telemetry exchange "
                            "(exchange_every=%d) are not in the run log; call bal.flush() on "
                            "every rank before close() to record them", len(self._block),
                            self.exchange_every)
        if self.runlog is not None:
            self.runlog.close()
            self.runlog = None
