"""ABS-SGD: delayed synchronous training that never lets a worker idle (ABS-SGD Algorithm 1).

Iteration ``t`` runs two things at once on every rank:

1. the all-reduce of the previous iteration's gradients ``G_{t-1}`` (each rank's sum over its
   samples), started asynchronously at the iteration boundary, with every rank's telemetry row
   (accumulated batch, data amount, compute and wait seconds, samples left in its shard) in the
   same flat buffer, so the total batch arrives with the gradient (no separate exchange);
2. reference batches of ``reference_batch`` samples on the current parameters ``x_t``, their
   gradients accumulated, until the all-reduce has completed (at least one per iteration; a rank
   checks after each reference batch). A rank's batch of the iteration is ``k * reference_batch``
   for the ``k`` batches it managed: its share follows its speed by itself.

When the all-reduce completes the rank divides by the total batch, compensates the one-step
staleness (Eq. 6: ``G~ = G + lam * G * G * (x_t - x_{t-1})``, :func:`hetlb.ops.delay_compensate_`),
steps the optimizer and starts the next iteration's all-reduce. Parameters stay identical on every
rank (every rank applies the same update); no DDP is involved: hetlb owns the gradient buffers.
The model's buffers (BatchNorm's running statistics) ride in the same all-reduce and are identical
on every rank after every update (the rule: :class:`DelayedSync`, ``sync_buffers``).

Delay compensation with momentum or Adam: the compensated gradient ``G~`` is what the optimizer
receives as ``p.grad``; its own state (momentum, moment estimates) then runs on compensated,
one-step-stale gradients. The paper analyses plain SGD only; with momentum the staleness adds one
step to the momentum's own lag, which is usually harmless for small learning rates.

The epoch (with :meth:`DelayedSync.loader`) is trained in rounds: each round's samples (a
stretch of the epoch's global order) are cut into one shard per rank, sized by each rank's
measured speed (samples per second of compute over the recent iterations), and a rank draws
reference batches from its own shard. An epoch is one round, except in a fresh run: there no
speed is known yet, so a short probe round (``probe_batches`` reference batches per rank, equal
shares) goes first and the rest of the epoch is cut by the speeds it measured. A rank whose shard
is used up gets empty batches (call :meth:`DelayedSync.step` after them as after any other: it
takes part in the iteration with nothing to add) until the telemetry shows every shard used up and
every accumulated gradient applied; then every rank starts the next round, or ends the epoch, at
the same iteration, so no collective is left waiting and a loop that stops after ``N`` updates
stops on every rank together. Each sample is trained exactly once per epoch; a shard's tail of
between one and two reference batches is split into two halves, so no reference batch (and no
tail iteration's update) is made of a handful of samples.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from hetlb import ops
from hetlb.comm.hook import shapes_digest
from hetlb.core.checks import choice, instance, integer, number
from hetlb.data.loader import BalancedLoader
from hetlb.data.stream import StreamPlan
from hetlb.ranks.agreement import (agree_at_start, broadcast_module_state, make_side_group,
                                   refuse_everywhere)
from hetlb.ranks.watchdog import COMPUTING, WAITING, Watchdog
from hetlb.sim.emulate import sleep_until
from hetlb.sync.rounds import Rounds, measured_speeds  # noqa: F401 (a name of this module)


__all__ = ["DelayedSync", "IterationRecord", "measured_speeds"]

#: The telemetry row each rank writes into its slots of the flat buffer. ``iteration`` (modulo
#: :data:`_ITERATION_WRAP`, exact in float32) and ``flush`` (1 in a :meth:`DelayedSync.flush`'s
#: own all-reduce) let every rank check that the all-reduce it completed is the one every other
#: rank sent for the same purpose.
ROW = ("batch", "data", "compute", "wait", "link", "left", "iteration", "flush")
_R = {name: i for i, name in enumerate(ROW)}
_FORMAT = "hetlb.DelayedSync/1"
_ITERATION_WRAP = 1 << 24  # float32 holds every integer below 2 ** 24 exactly
WEIGHTINGS = ("samples", "sizes", "none")


@dataclass(frozen=True)
class IterationRecord:
    """One iteration as every rank saw it (arrays ``[world]``).

    Attributes:
        iteration: the iteration whose gradients these are (counted from 0).
        batch: int64 samples each rank accumulated.
        data: data amount each rank accumulated (equals ``batch`` without sample sizes).
        compute: seconds each rank spent on its reference batches.
        wait: seconds each rank waited, idle, for the previous iteration's all-reduce (it rides
            in the next buffer: a wait is known only once its all-reduce has completed).
        link: seconds from each rank's start of the previous iteration's all-reduce until its
            result was there (including an emulated link's delay); ``1 - wait / link`` is the
            fraction of it hidden behind computation. Rides in the next buffer, like ``wait``.
    """

    iteration: int
    batch: np.ndarray
    data: np.ndarray
    compute: np.ndarray
    wait: np.ndarray
    link: np.ndarray

    def to_dict(self) -> Dict[str, Any]:
        return {"iteration": self.iteration, "batch": self.batch.tolist(), "data": self.data.tolist(),
                "compute": self.compute.tolist(), "wait": self.wait.tolist(), "link": self.link.tolist()}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "IterationRecord":
        wait = np.asarray(d["wait"], np.float64)
        link = np.asarray(d["link"], np.float64) if "link" in d else np.full_like(wait, np.nan)
        return cls(int(d["iteration"]), np.asarray(d["batch"], np.int64), np.asarray(d["data"], np.float64),
                   np.asarray(d["compute"], np.float64), wait, link)


class DelayedSync:
    """Delay-compensated delayed-synchronous data parallelism (ABS-SGD).

    ::

        ds = hetlb.DelayedSync(model, opt, reference_batch=32, lam=0.5)
        loader = ds.loader(dataset)
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for x, y in loader:
                loss_fn(model(x), y).backward()     # the mean loss over the reference batch
                ds.step()                           # True when an update was applied

    Args:
        model: a plain ``torch.nn.Module`` (not wrapped in DDP), of the same tensors on every
            rank; rank 0's parameters and buffers are broadcast to the others when it is made.
        optimizer: any torch optimizer over its parameters; stepped once per update (step an LR
            scheduler when :meth:`step` returns True).
        reference_batch: samples per reference batch (the paper's ``M_r``).
        lam: delay-compensation coefficient (the paper's 0.5); 0 is plain one-step-delayed SGD.
        weighting: ``"samples"`` (the sum of gradients over the total batch, the paper's),
            ``"sizes"`` (by data amount: the loss a mean per data unit, needs ``sample_sizes``),
            ``"none"`` (the plain mean of the ranks' mean gradients).
        group: process group (default: the world).
        batches_per_iteration: every rank computes exactly this many reference batches per
            iteration and then waits for the all-reduce, so iterations do not depend on timing
            (tests); the shards of a round are still sized by measured speeds, so a rerun
            repeats exactly only within one round. None: as many as fit while the all-reduce
            runs (the paper's).
        probe_batches: while no rank's speed has been measured (a fresh run), the epoch's first
            round is this many reference batches per rank in equal shares, so the rest of the
            epoch is cut by measured speed (0: the whole first epoch in equal shares).
        scale_lr: opt-in, not in the paper: divide the summed gradient by the nominal batch
            ``world * reference_batch`` instead of the iteration's total batch, i.e. the mean
            gradient with the learning rate scaled by ``total / nominal`` (the linear scaling
            rule of Goyal et al.), so an iteration that trained ``k`` times the nominal batch
            moves ``k`` times as far. The paper's update (False) makes a large adaptive batch
            a less noisy step of the same length. Needs ``weighting="samples"``.
        sync_buffers: keep the model's buffers identical on every rank (the default), carried in
            the iteration's all-reduce (see *Buffers* below); False leaves each rank's buffers to
            its own forward passes (after the start-up broadcast), as before.
        emulator: an :class:`hetlb.sim.emulate.Emulator` that stretches each reference batch; with
            a ``bandwidth`` it also emulates the link: an all-reduce's result is there
            ``nbytes / bandwidth`` seconds after the collective completed (``history[i].link``
            and ``wait`` then show how much of it was hidden behind computation).
        watchdog: a :class:`hetlb.Watchdog` (one per DelayedSync): heartbeats to the group's
            store, so a rank blocked on an iteration's all-reduce (or the epoch's start) for
            ``stall`` seconds while no rank makes progress names the rank behind (the lowest
            iteration: its "step" in the diagnosis) instead of waiting for the collective's
            timeout, and by default exits for torchrun to restart the job. Every reference
            batch counts as progress. Call :meth:`close` when training ends.

    Gradients accumulate and travel in float32 buffers (float64 when a parameter is float64), so
    bf16 parameters are fine and the integer batch counts ride exactly.

    Buffers (``sync_buffers=True``, on more than one rank): every floating-point and integer buffer
    the model holds when DelayedSync is made (BatchNorm's ``running_mean``, ``running_var``,
    ``num_batches_tracked``; a bool buffer is left as broadcast at start-up) rides in the
    iteration's all-reduce, and every rank ends each update with the same values:

    * a floating-point buffer is the mean of the values the ranks had when they sent the
      iteration the update applies (after their reference batches of it), each weighted by its
      gradient's weight in that iteration (its samples with ``weighting="samples"``, its data
      amount with ``"sizes"``, 1 with ``"none"``); a rank that trained no sample in it counts
      for nothing. This is the value synchronous data parallelism would average, and a buffer no
      forward pass changed keeps its value bit for bit. The forward passes a rank runs while that
      all-reduce is in flight (the next iteration's) update its own buffers, which it sends with
      the next iteration before the update overwrites them. So each iteration's forward passes
      start from the average of two iterations before (as its gradient is computed at
      parameters one update old), and running statistics, an exponential average over recent
      batches, average every other iteration's batches: iterations alternate between two such
      chains. Adding a rank's change to the newer average instead would add two iterations'
      moves from the same starting point and overshoot (with many reference batches an
      iteration, ``running_var`` could go negative). An update in which no rank trained a
      sample leaves the buffers at the last average.
    * an integer buffer (a counter: ``num_batches_tracked``) is its last agreed value plus every
      rank's increase over the iteration the update applies (the ranks that trained samples in
      it): the count one process would reach training all the ranks' reference batches one
      after another, each training forward pass counted once, exactly. The ranks run different
      numbers of reference batches per iteration, so the maximum or rank 0's value would count
      one rank's batches only; and since each update overwrites the values the next
      iteration's forward passes started from, any rule on the values themselves (rather than
      their increases) would count every other iteration only.

    Counters count from the model's buffers at construction and at :meth:`load_state_dict`:
    load a checkpoint's model state before ``ds.load_state_dict`` (or ``loader.load_state_dict``).
    Between updates each rank's buffers move with its own forward passes: evaluate right after
    an update (``ds.step()`` returned True) or a :meth:`flush`, where they are equal.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, reference_batch: int,
                 lam: float = 0.5, weighting: str = "samples", group: Any = None, *,
                 batches_per_iteration: Optional[int] = None, emulator: Any = None,
                 probe_batches: int = 4, scale_lr: bool = False, sync_buffers: bool = True,
                 watchdog: Optional[Watchdog] = None) -> None:
        # A rank refusing its arguments joins the start-up exchange with its refusal, so every
        # rank raises rather than waiting in the collective until its timeout.
        try:
            if isinstance(model, torch.nn.parallel.DistributedDataParallel):
                raise ValueError("DelayedSync takes the plain module, not DDP: it all-reduces the "
                                 "gradients itself (pass ddp.module, or do not wrap the model)")
            instance(model, "model", torch.nn.Module, "a torch.nn.Module (not DDP-wrapped)")
            instance(optimizer, "optimizer", torch.optim.Optimizer, "a torch.optim.Optimizer over the model's parameters")
            choice(weighting, "weighting", WEIGHTINGS)
            if emulator is not None:
                from hetlb.sim.emulate import Emulator
                instance(emulator, "emulator", Emulator, "a hetlb.sim.emulate.Emulator or None")
            if watchdog is not None:
                instance(watchdog, "watchdog", Watchdog, "a hetlb.Watchdog or None")
            self.model, self.optimizer = model, optimizer
            self.reference_batch = integer(reference_batch, "reference_batch", 1)
            self.lam = number(lam, "lam", minimum=0.0)
            self.weighting = weighting
            self.group = group
            self.fixed = None if batches_per_iteration is None else integer(batches_per_iteration, "batches_per_iteration", 1)
            self.emulator = emulator
            self.probe_batches = integer(probe_batches, "probe_batches", 0)
            if not isinstance(scale_lr, bool):
                raise ValueError(f"scale_lr must be True or False, got {scale_lr!r}")
            if scale_lr and weighting != "samples":
                raise ValueError(f'scale_lr=True scales by samples; it needs weighting="samples", got {weighting!r}')
            self.scale_lr = scale_lr
            if not isinstance(sync_buffers, bool):
                raise ValueError(f"sync_buffers must be True or False, got {sync_buffers!r}")
            on = dist.is_available() and dist.is_initialized()
            self.world = dist.get_world_size(group) if on else 1
            self.rank = dist.get_rank(group) if on else 0
            self.params = [p for p in model.parameters() if p.requires_grad]
            if not self.params:
                raise ValueError("DelayedSync: the model has no parameter that requires a gradient")
            mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
            if not any(id(p) in mine for p in self.params):
                raise ValueError("DelayedSync: the optimizer holds none of the model's parameters (an "
                                 "optimizer of another model?): the updates would never reach it")
            self.dtype = torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32
            self.device = self.params[0].device
            self._acc = [torch.zeros(p.shape, dtype=self.dtype, device=self.device) for p in self.params]
            self._gbar = [torch.zeros_like(a) for a in self._acc]
            self._prev: Optional[List[torch.Tensor]] = None  # parameters the in-flight gradient was computed at
            self._batch = 0  # samples accumulated this iteration
            self._data = 0.0
            self._compute = 0.0
            self._count = 0  # reference batches this iteration
            self._waited = 0.0  # seconds waited for all-reduces since the last send
            self._link = 0.0  # seconds the all-reduces completed since the last send took
            self._flight: Optional[_Flight] = None
            self._mark = time.perf_counter()  # start of the current reference batch
            self.iteration = 0  # iterations started (all-reduces issued)
            self.updates = 0  # updates applied
            self.references = 0  # reference batches trained
            self.history: Deque[IterationRecord] = deque(maxlen=4096)
            #: The epoch's rounds of shards: the board, the loader, this rank's progress.
            self.rounds = Rounds(self.world, self.rank, self.reference_batch, self.probe_batches)
            self.watchdog = watchdog
        except (ValueError, TypeError) as e:
            refuse_everywhere(e, group)
            raise
        # Ranks that differ here would weigh, scale or cut their shares differently: a silent
        # drift of the replicas, so one exchange at start-up compares them.
        self._agree({"reference_batch": self.reference_batch, "lam": self.lam, "weighting": weighting,
                     "scale_lr": scale_lr, "sync_buffers": sync_buffers, "batches_per_iteration": self.fixed,
                     "probe_batches": self.probe_batches, "dtype": str(self.dtype),
                     "parameters": (len(self.params), sum(p.numel() for p in self.params)),
                     "tensors": shapes_digest(list(model.parameters()) + list(model.buffers()))},
                    "DelayedSync")
        if self.world > 1:  # the update averages gradients: replicas that start apart stay apart
            broadcast_module_state(model, group)
        # (after the broadcast: every rank's buffers are equal, the base of the first update's)
        synced = _Buffers(model, self.dtype, self.device) if sync_buffers and self.world > 1 else None
        self._buffers = synced if synced is not None and synced.numel else None
        if watchdog is not None and on:
            watchdog.attach_to(group)

    def _agree(self, mine: Dict[str, Any], what: str) -> None:
        if self.world == 1:
            return
        # On a Gloo group (an NCCL one would need each rank's CUDA device set for objects).
        agree_at_start({what: mine}, make_side_group(self.group), self.world, True, "DelayedSync",
                       [(what, what)])

    # ------------------------------------------------------------------ the loop

    def step(self, batch_size: Optional[int] = None, data: Optional[float] = None) -> bool:
        """Accumulate the reference batch just back-propagated; poll (or, deterministic, wait
        for) the iteration's all-reduce; when it has completed apply the update and start the
        next iteration. Returns True when an update was applied.

        Args:
            batch_size: samples in the reference batch (default: the loader's plan, else
                ``reference_batch``).
            data: its data amount for ``weighting="sizes"`` (default: the loader's plan).
        """
        plan = self.rounds.plan()
        if plan is not None and plan.count == 0:  # the drain's empty batch: nothing to add
            for p in self.params:
                p.grad = None  # a mean loss over nothing is NaN
            self.rounds.skipped()
            applied = self._advance(wait=True, force=True)
            self._mark = time.perf_counter()
            self._beat(None)
            return applied
        m = integer(batch_size if batch_size is not None else (plan.count if plan else self.reference_batch),
                    "batch_size", 1)
        amount = number(data, "data", minimum=0.0) if data is not None else \
            float(plan.data if plan is not None and plan.data is not None else m)
        if all(p.grad is None for p in self.params):
            # (each step takes the gradients and clears them: a second step finds none either)
            raise RuntimeError(
                f"DelayedSync.step(): no parameter holds a gradient. Call loss.backward() on each "
                f"reference batch, then ds.step() once: a step without a backward would count "
                f"the batch's {m} samples with no gradient and shrink the update")
        if self.emulator is not None:
            by_data = getattr(self.emulator, "by", "batch") == "data"
            self.emulator.stretch(self.references, amount if by_data else m, self._mark)
        self._compute += time.perf_counter() - self._mark
        weight = {"samples": m, "sizes": amount, "none": m}[self.weighting]
        for p, a in zip(self.params, self._acc):
            if p.grad is not None:
                a.add_(p.grad.to(self.dtype), alpha=float(weight))
                p.grad = None
        self._batch += m
        self._data += amount
        self._count += 1
        self.references += 1
        if plan is not None:
            self.rounds.trained(m)
        applied = self._advance(wait=self.fixed is not None and self._count >= self.fixed)
        self._mark = time.perf_counter()
        self._beat(None)
        return applied

    def _beat(self, stage: Any) -> None:
        """Tell the watchdog where this rank is: ``None`` between reference batches, else
        :data:`hetlb.ranks.watchdog.COMPUTING` or :data:`hetlb.ranks.watchdog.WAITING` (at an all-reduce or barrier)."""
        if self.watchdog is not None:
            self.watchdog.beat(self.iteration, stage)
            if stage is None:
                self.watchdog.touch()  # a reference batch trained: progress within the iteration

    def _advance(self, wait: bool, force: bool = False) -> bool:
        """End the iteration if its all-reduce has completed (or ``wait``): update, then send
        (unless the round's last iteration has just been applied: every rank stops there)."""
        if not force and self.fixed is not None and self._count < self.fixed:
            return False
        applied = False
        own = None
        if self._flight is not None:
            if not wait and not self._flight.ready():
                return False
            own = self._own_buffers()  # taken before the update overwrites them
            applied = self._complete()
        if not self.rounds.over:
            self._send(own=own)
        else:
            self._rebase()
        return applied

    def _rebase(self) -> None:
        """Nothing in flight and nothing accumulated (a round's end, a flush): the next gradient
        is computed at the current parameters, so it is not stale and gets no compensation."""
        if self._prev is not None and self._flight is None and self._batch == 0:
            self._prev_from_params()

    def _prev_from_params(self) -> None:
        """The next gradient is computed at the current parameters."""
        with torch.no_grad():
            for p, prev in zip(self.params, self._prev):
                prev.copy_(p.detach())

    def _complete(self) -> bool:
        """Wait for the in-flight all-reduce and apply its update; returns whether one was applied
        (an iteration in which no rank had samples applies none)."""
        flight = self._flight
        buf, it = flight.buf, flight.iteration
        waiting = self.watchdog is not None and not flight.ready()
        if waiting:
            self._beat(WAITING)
        t = time.perf_counter()
        self._link += flight.wait()
        if waiting:  # back outside: flush() and state_dict() return to the script's own work
            self._beat(None)
        self._waited += time.perf_counter() - t
        self._flight = None
        n = buf.numel() - self.world * len(ROW)
        table = buf[n:].view(self.world, len(ROW)).double().cpu().numpy()
        self._check_matched(table, it)
        batch = np.rint(table[:, _R["batch"]]).astype(np.int64)
        rec = IterationRecord(it, batch, table[:, _R["data"]].copy(), table[:, _R["compute"]].copy(),
                              table[:, _R["wait"]].copy(), table[:, _R["link"]].copy())
        self.history.append(rec)
        # Every shard trained and (with this update) applied: the round ends on every rank here.
        self.rounds.applied(table[:, _R["left"]].copy(), flight.round_key)
        if self.weighting == "samples":
            total = float(batch.sum())
        elif self.weighting == "sizes":
            total = float(rec.data.sum())
        else:
            total = float(np.count_nonzero(batch))
        if self._buffers is not None:
            end = buf.numel() - self.world * len(ROW)
            self._buffers.apply(buf[end - self._buffers.numel:end], total, flight.agreed)
        if total <= 0:  # nobody had samples: no update; the next gradient is at these parameters
            self._prev_from_params()
            return False
        # scale_lr: the sum over the nominal batch, i.e. the mean with the rate scaled by total/nominal
        ops.unflatten_(buf, self._gbar, 1.0 / (self.world * self.reference_batch if self.scale_lr else total))
        with torch.no_grad():
            # One call over the model where the parameters are in the accumulation dtype; else one
            # tensor at a time, so a cast copy of the whole model is never alive at once.
            whole = bool(self.lam) and all(p.dtype == self.dtype for p in self.params)
            if whole:
                ops.delay_compensate_(self._gbar, [p.detach() for p in self.params], self._prev, self.lam)
            for p, g, prev in zip(self.params, self._gbar, self._prev):
                cur = p.detach() if p.dtype == self.dtype else p.detach().to(self.dtype)
                if self.lam and not whole:
                    ops.delay_compensate_(g, cur, prev, self.lam)
                prev.copy_(cur)  # the next in-flight gradient is computed at these parameters
                p.grad = g.to(p.dtype) if p.dtype != self.dtype else g.clone()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        return True

    def _check_matched(self, table: np.ndarray, iteration: int) -> None:
        """Raise on every rank, before the result is applied, when the ranks' all-reduces of this
        collective were sent for different iterations or only some ranks were flushing: the sum
        would mix one rank's flushed part of an iteration with the others' regular one, and the
        delay compensation would then differ between ranks (each compensates by its own
        parameters' last move), so the replicas would drift apart with no error."""
        flushing = np.rint(table[:, _R["flush"]]).astype(np.int64)
        its = np.rint(table[:, _R["iteration"]]).astype(np.int64)
        mixed_flush = bool(np.any(flushing != flushing[0]))
        if not mixed_flush and np.all(its == its[0]):
            return
        if mixed_flush:
            alone = np.flatnonzero(flushing == 1).tolist()
            others = np.flatnonzero(flushing == 0).tolist()
            raise RuntimeError(
                f"DelayedSync: rank(s) {alone} flushed (ds.flush(), which ds.state_dict() calls) at "
                f"iteration {iteration} while rank(s) {others} did not, so their all-reduces met "
                f"different iterations' gradients. A flush is a collective: call it on every rank "
                f"at the same update; for a checkpoint saved by one rank, take the state on every "
                f"rank and save it on one: `state = ds.state_dict()` (every rank), then "
                f"`if rank == 0: torch.save(state, path)`")
        raise RuntimeError(
            f"DelayedSync: the ranks' all-reduces met at different iterations ("
            + ", ".join(f"rank {r}: {i}" for r, i in enumerate(its.tolist()))
            + f", modulo 2**24) at this rank's iteration {iteration}: the ranks loaded "
            f"different checkpoints (or some ranks none). Load the same checkpoint on every rank")

    def _own_buffers(self) -> Optional[Tuple[torch.Tensor, List[torch.Tensor]]]:
        """This rank's buffers' part of the iteration it is about to send (see :class:`_Buffers`),
        weighted as its gradient is; None without synced buffers."""
        if self._buffers is None:
            return None
        weight = {"samples": float(self._batch), "sizes": self._data,
                  "none": 1.0 if self._batch > 0 else 0.0}[self.weighting]
        return self._buffers.own(weight, self._batch > 0)

    def _send(self, flushing: bool = False,
              own: Optional[Tuple[torch.Tensor, List[torch.Tensor]]] = None) -> None:
        """Pack this iteration's accumulated gradient, buffers and row, start its all-reduce, and
        begin the next iteration (the parameters it was computed at are kept for the
        compensation). ``flushing``: sent by :meth:`flush` (marked in the row, see
        :meth:`_check_matched`). ``own``: the buffers' part, when taken before an update that
        overwrote them (:meth:`_own_buffers`)."""
        row = torch.zeros(self.world * len(ROW), dtype=self.dtype, device=self.device)
        left = self.rounds.left()
        mine = [float(self._batch), self._data, self._compute, self._waited, self._link, float(left),
                float(self.iteration % _ITERATION_WRAP), float(flushing)]
        self._waited = self._link = 0.0
        row[self.rank * len(ROW):(self.rank + 1) * len(ROW)] = torch.tensor(mine, dtype=self.dtype)
        scale = 1.0
        if self.weighting == "none" and self._batch > 0:
            scale = 1.0 / self._batch
        agreed = None
        if self._buffers is not None:
            part, agreed = own if own is not None else self._own_buffers()
            row = torch.cat([part, row])
        buf = ops.flatten_scaled(self._acc, scale, extra=row)
        if self._prev is None:
            self._prev = [p.detach().to(self.dtype).clone() for p in self.params]
        work = dist.all_reduce(buf, group=self.group, async_op=True) if self.world > 1 else None
        delay = 0.0
        if self.emulator is not None and getattr(self.emulator, "bandwidth", None):
            delay = self.emulator.comm_delay(buf.numel() * buf.element_size())
        self._flight = _Flight(work, buf, self.iteration, delay, self.rounds.key(), agreed)
        if self._buffers is not None:
            self._buffers.began()
        self.iteration += 1
        for a in self._acc:
            a.zero_()
        self._batch, self._data, self._compute, self._count = 0, 0.0, 0.0, 0

    def flush(self) -> None:
        """Apply everything accumulated: wait for the in-flight all-reduce and apply it, then send
        this iteration's gradients and apply them too. Collective: every rank calls it at the
        same update (e.g. ``if ds.step() and ds.updates % 100 == 0: ds.flush(); save(...)``);
        :meth:`state_dict` calls it. A flush on some ranks only raises ``RuntimeError`` on every
        rank once the others' next all-reduce meets it (before any rank applies the mixed sum):
        take a checkpoint's state on every rank and save it on one."""
        own = None
        if self._flight is not None:
            own = self._own_buffers()
            self._complete()
        self._send(flushing=True, own=own)
        self._complete()
        self._rebase()

    # ------------------------------------------------------------------ data

    def loader(self, dataset: Any, shuffle: bool = True, *, seed: int = 0, drop_last: bool = False,
               sample_sizes: Any = None, **dataloader_kwargs: Any) -> BalancedLoader:
        """This rank's reference batches of ``dataset`` (see the module docstring for the epoch).

        Args:
            dataset: a map-style dataset.
            shuffle, seed, drop_last: the epoch's global order (``seed + epoch``), as in
                ``DistributedSampler``; ``drop_last`` drops the tail that does not fill a whole
                ``world * reference_batch``.
            sample_sizes: per-sample data amounts (for ``weighting="sizes"``).
            **dataloader_kwargs: passed to ``torch.utils.data.DataLoader``.
        """
        loader = self.rounds.new_loader(dataset, shuffle, seed, drop_last, sample_sizes, dataloader_kwargs)
        if self.weighting == "sizes" and loader.sample_sizes is None:
            raise ValueError('weighting="sizes" needs per-sample sizes: ds.loader(dataset, sample_sizes=...)')
        # Each rank cuts its shard from the shared order: another order loses and repeats samples.
        self._agree(loader.order.config(), "loader")
        if loader.order.epoch_length == 0:
            raise ValueError(f"DelayedSync.loader: an epoch has no sample to train (dataset of "
                             f"{len(dataset)} samples" + (f", drop_last=True with fewer than world * "
                             f"reference_batch = {self.world * self.reference_batch}" if drop_last else "")
                             + ")")
        loader.bind(self, self)  # (a new loader: no state loaded before binding)
        self.rounds.drive(loader)
        return loader

    # ------------------------------------------------------------------ the loader's steps
    # (hetlb.data.protocol.StepOwner: called by the bound loader only)

    def settle(self) -> None:
        """Nothing to finish: an iteration's reference batches end at :meth:`step`."""

    def iteration_starts(self) -> None:
        """A new iteration over the loader: every rank starts it together, in the same round."""
        if self.world > 1 and self._flight is None:
            self._beat(WAITING)
            dist.barrier(group=self.group)  # start the epoch together: no rank's shard runs ahead
            self._beat(None)
        self.rounds.start(self.history)
        self._mark = time.perf_counter()

    def before_next(self) -> None:
        """The loop asks for the next reference batch: the previous one must have been stepped."""
        if self.rounds.plan() is not None:
            raise RuntimeError("DelayedSync: call ds.step() after every reference batch's backward")

    def handed(self, plan: StreamPlan) -> None:
        """The loop received a reference batch: its compute starts."""
        self._mark = time.perf_counter()
        self._beat(COMPUTING)

    def exhausted(self) -> Optional[str]:
        """This rank's shard is used up. ``"empty"``: hand out an empty batch, whose :meth:`step`
        takes part in the next iteration with nothing to add (so a loop that stops after some
        number of updates stops at the same update on every rank). Once every rank's shard has
        been trained and applied (every rank sees it in the same iteration): ``"round"`` when the
        epoch has more samples (their shards are cut now, by the latest speeds), else None: the
        epoch ends on every rank at the same iteration."""
        what = self.rounds.end_of_shard(self.history, in_flight=self._flight is not None)
        if what == "empty":
            self._mark = time.perf_counter()
            self._beat(COMPUTING)  # an empty reference batch is one too: its step joins an iteration
        return what

    def close(self) -> None:
        """Stop the watchdog's heartbeat (training ended); nothing else to do without one.
        Call :meth:`flush` first to apply what is accumulated."""
        if self.watchdog is not None:
            self.watchdog.close()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> Dict[str, Any]:
        """Flush (collective: see :meth:`flush`), then the counters, history and data position;
        save the model and optimizer next to it. Plain values, loadable with ``torch.load``."""
        self.flush()
        return {"format": _FORMAT, "world": self.world, "iteration": self.iteration, "updates": self.updates,
                "references": self.references, "reference_batch": self.reference_batch,
                "history": [r.to_dict() for r in self.history],
                "position": self.rounds.position(), "loader": self.rounds.config()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (load the model and optimizer as saved with it, the model
        first: its buffers are what the next updates' counters count from)."""
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            got = f"format={state.get('format')!r}" if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a {_FORMAT} checkpoint ({got})")
        if int(state["reference_batch"]) != self.reference_batch:
            raise ValueError(f"checkpoint reference_batch={state['reference_batch']} differs from "
                             f"{self.reference_batch}")
        self.iteration, self.updates = int(state["iteration"]), int(state["updates"])
        self.references = int(state["references"])
        # Records of another world describe other ranks: the next round probes the new ones.
        same_world = int(state["world"]) == self.world
        self.history = deque((IterationRecord.from_dict(d) for d in state["history"] if same_world),
                             maxlen=4096)
        self._flight, self._prev = None, None
        if self._buffers is not None:  # the model's state, loaded first, is every rank's
            self._buffers.capture()
        self._waited = self._link = 0.0
        for a in self._acc:
            a.zero_()
        self._batch, self._data, self._compute, self._count = 0, 0.0, 0.0, 0
        self.rounds.restore(state.get("position"), int(state["world"]))


class _Flight:
    """One iteration's all-reduce in flight. With an emulated link (``delay`` seconds) its result
    is there ``delay`` seconds after the real collective completed (the moment the last rank
    joined), as the Balancer's hook delays a bucket; the completion is stamped by a callback on
    the work's future, so polling costs no collective."""

    def __init__(self, work: Any, buf: torch.Tensor, iteration: int, delay: float,
                 round_key: Any = None, agreed: Optional[List[torch.Tensor]] = None) -> None:
        self.buf, self.iteration, self.delay = buf, iteration, float(delay)
        self.agreed = agreed  # the buffers' values the floating part was sent relative to
        self.round_key = round_key  # (epoch, first sample) of the round it was sent in
        self.sent = time.perf_counter()
        # One rank: nothing to reduce, complete at once.
        self._done = None if work is None else work.get_future().then(_stamp)

    def _completed(self) -> float:
        return self.sent if self._done is None else float(self._done.value())

    def ready(self) -> bool:
        """Whether the result is there (never blocks)."""
        if self._done is not None and not self._done.done():
            return False
        return time.perf_counter() >= self._completed() + self.delay

    def wait(self) -> float:
        """Block until the result is there; the seconds from the send until it was."""
        if self._done is not None:
            self._done.wait()
        ready = self._completed() + self.delay
        sleep_until(ready)
        return ready - self.sent


class _Group:
    """Buffers of one dtype and device, read and written as one flat tensor: by the native
    multi-tensor copy where the dtype has one, else through flat views of the buffers (a few
    calls for a model's BatchNorm statistics and counters, not a few per buffer)."""

    def __init__(self, tensors: List[torch.Tensor]) -> None:
        self.tensors = tensors
        self.sizes = [t.numel() for t in tensors]
        self.numel = sum(self.sizes)
        self.native = tensors[0].dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
        # 1-D views sharing the buffers' storage (valid while the module holds these tensors:
        # load_state_dict copies into them; a DelayedSync.load_state_dict takes them again)
        self.flat = None if self.native or not all(t.is_contiguous() for t in tensors) else \
            [t.detach().view(-1) for t in tensors]

    def read(self) -> torch.Tensor:
        """A flat copy of the values."""
        if self.native:
            return ops.flatten_scaled(self.tensors, 1.0)
        flat = self.flat if self.flat is not None else [t.detach().reshape(-1) for t in self.tensors]
        return torch.cat(flat)

    def write(self, flat: torch.Tensor) -> None:
        """Set the values from a flat tensor (in their dtype)."""
        if self.native:
            ops.unflatten_(flat, self.tensors, 1.0)
        elif self.flat is not None:
            torch._foreach_copy_(self.flat, list(flat.split(self.sizes)))
        else:
            for t, v in zip(self.tensors, flat.split(self.sizes)):
                t.detach().copy_(v.view(t.shape))


def _groups(tensors: List[torch.Tensor]) -> List[_Group]:
    by: Dict[Any, List[torch.Tensor]] = {}
    for t in tensors:
        by.setdefault((t.dtype, t.device), []).append(t)
    return [_Group(ts) for ts in by.values()]


class _Buffers:
    """The model's floating-point and integer buffers, kept identical across ranks through the
    iteration's all-reduce (the rule: :class:`DelayedSync`). A rank's part of an iteration is
    ``weight * (value - agreed)`` of its floating-point buffers, relative to the last agreed
    values (equal on every rank, so the sum over ranks divided by the total weight, added to
    them, is the weighted mean of the values, and a buffer no rank changed stays exact), then
    its counters' increase since its iteration began. The part travels in the gradients' dtype:
    a counter's increase is exact below 2**24 an iteration."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.dtype, self.device = model, dtype, device
        self.capture()

    def capture(self) -> None:
        """Take the model's buffers, as they are now, as the agreed values: equal on every rank
        after the start-up broadcast and after a checkpoint's model state is loaded."""
        buffers = [b for b in self.model.buffers() if b.numel()]
        self.floats = _groups([b for b in buffers if b.is_floating_point()])
        self.counters = _groups([b for b in buffers if not (b.is_floating_point() or b.is_complex()
                                                             or b.dtype == torch.bool)])
        self.numel = sum(g.numel for g in self.floats + self.counters)
        self.agreed = [g.read() for g in self.floats]
        self.counted = [g.read().to(torch.int64) for g in self.counters]  # agreed counts
        self.began()

    def began(self) -> None:
        """The rank starts an iteration (sent one, or its buffers were just set): its counters'
        increases count from here."""
        self.start = [g.read().to(torch.int64) for g in self.counters]

    def own(self, weight: float, trained: bool) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """This rank's part of the iteration it sends, and the agreed values the floating part is
        relative to (kept by the flight: an update may replace them before it completes). A
        rank that trained no sample in it sends zeros, whatever an empty batch's forward pass
        left in its buffers."""
        part = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        off = 0
        with torch.no_grad():
            for g, a in zip(self.floats, self.agreed):
                if weight > 0:  # (in the wider dtype: a bf16 difference, or a float64 value cast
                    # to float32 before the difference, would lose the change itself)
                    wide = torch.promote_types(a.dtype, self.dtype)
                    part[off:off + g.numel].copy_(g.read().to(wide).sub_(a).mul_(weight))
                off += g.numel
            for g, s in zip(self.counters, self.start):
                if trained:
                    part[off:off + g.numel].copy_(g.read().to(torch.int64) - s)
                off += g.numel
        return part, self.agreed

    def apply(self, summed: torch.Tensor, total: float, agreed: List[torch.Tensor]) -> None:
        """Set every rank's buffers from an iteration's sum (``agreed``: the values its floating
        part was sent relative to; ``total``: the sum of the ranks' weights)."""
        off = 0
        with torch.no_grad():
            if total > 0:  # else no rank trained a sample: the last agreed values stay
                new = []
                for g, a in zip(self.floats, agreed):
                    mean = summed[off:off + g.numel].to(a.device)
                    new.append(torch.add(a, mean, alpha=1.0 / total).to(a.dtype))
                    off += g.numel
                self.agreed = new
            off = sum(g.numel for g in self.floats)
            for g, v in zip(self.floats, self.agreed):
                g.write(v)
            counted = []
            for g, c in zip(self.counters, self.counted):
                c = c + torch.round(summed[off:off + g.numel]).to(device=c.device, dtype=torch.int64)
                g.write(c.to(g.tensors[0].dtype))
                counted.append(c)
                off += g.numel
            self.counted = counted
        self.began()


def _stamp(fut: Any) -> float:
    fut.value()  # re-raises a failed collective's error in the chained future
    return time.perf_counter()
