"""LBB: Load Balance Batching (profiled start, fine-tune and rapid-tune on the straggler effect).

Follows Algorithm 2 and section 3.2 of the LBB paper:

* **start**: sizes that solve the min-max problem (Eq. 3) on the profiled cubic models
  (:func:`hetlb.allocate`), or the equal split when there are no profiles.
* **every step**: the straggler effect ``SE = (max T - min T) / mean T`` (Eq. 4) of the latest step,
  over ranks that had samples.

  - ``SE < fine`` (FT, 0.05): keep the sizes.
  - ``fine <= SE < rapid`` (RT, 0.3), or inside the observation window: **fine-tune**, move
    ``step`` samples (paper: "usually 1") from the slowest rank to the fastest.
  - ``SE >= rapid`` outside the window: **rapid-tune**, rebuild rough linear models
    ``T_i(b) = a0_i + (CT_i - a0_i) / CB_i * b`` from the step's measured (batch, time) pairs and
    re-solve Eq. 3; then open the observation window, in which only fine-tuning is allowed.

Interpretations of what the paper leaves open:

* Algorithm 2 moves ``floor(step/2)`` out of the slowest rank and ``ceil(step/2)`` into the
  fastest, which changes the global batch for odd ``step`` (and moves nothing out for step 1);
  here exactly ``step`` samples move, so the global batch stays fixed as Eq. 3 requires.
* The observation window (size not given) counts **records that ran the rapid-tune's sizes** (or
  a later decision), default 10: a decision reaches the ranks a few steps late when the loader
  prefetches, and records from before it says nothing about the rapid-tune; counting decisions
  instead would let stale records trigger a second rapid-tune.
* Incremental moves (fine-tune) start from the policy's own last decision and act only on a
  record that ran that decision; rapid-tunes use the record's own (batch, time) pairs, which are
  always consistent.
* Ranks given 0 samples take no part in SE, and fine-tuning neither takes from nor gives to them;
  a rapid-tune re-solves over all ranks, using the last known slope of a rank without samples.

**Priority** (opt-in, ``priority=0.1``; off by default): the paper says LBB "prioritizes
fine-tuning for workers that are significantly slower than other nodes" without saying how.
With ``priority`` set, when the slowest rank's time exceeds the mean by that fraction or more, a
fine-tune moves enough samples out of it to halve its excess under a linear model (when that is
more than ``step``), shared among the ranks below the new level in proportion to their room, so
no receiver becomes the new straggler. Its per-sample time is a secant through an earlier step of
the same rank at a clearly different batch size, trusted within a factor 4 of the rough model's
slope. ``bench/bench_policies.py`` compares it with the paper's plain fine-tune.

**Confirm** (opt-in, e.g. ``confirm=3``; off by default: 1, the paper's rule): a rapid-tune only
once SE has stayed at or above ``rapid`` for that many records in a row outside the observation
window; until then such a record fine-tunes. The paper's rule acts on the SE of one step, so on a
machine whose step times jitter by more than ``rapid`` between ranks now and then, a single noisy
step re-solves the split from its noisy times (on two identical CPU ranks: 17 rapid-tunes in 300
steps, splits such as 50/78 of 128; ``bench/RESULTS.md``). ``bench/bench_policies.py`` compares
it with the paper's rule.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from hetlb.core.checks import integer, number
from hetlb.core.models import LinearModel, micro_step_model
from hetlb.core.solve import allocate, allocate_linear, allocate_proportional
from hetlb.core.telemetry import History, StepRecord, straggler_effect
from hetlb.policies.base import Context, SizedPolicy, records_after


__all__ = ["LBB"]


class LBB(SizedPolicy):
    """Load Balance Batching.

    Args:
        fine: fine-tuning threshold FT on SE (paper default 0.05, finite, >= 0); below it nothing
            changes.
        rapid: rapid-tuning threshold RT on SE (paper default 0.3, >= ``fine``; ``math.inf``
            turns rapid-tuning off).
        step: samples a fine-tune moves from the slowest rank to the fastest (paper: 1).
        window: records that ran a rapid-tune's sizes (or later ones) during which only
            fine-tuning is allowed. The paper gives no value; 10 covers the few fine-tunes it
            reports a rapid-tune needs to settle (its Fig. 7).
        priority: opt-in improvement (default off, ``math.inf``): the relative excess
            ``(T_slowest - mean T) / mean T`` from which the slowest rank counts as much slower
            and a fine-tune halves its excess instead of moving ``step`` samples (see the module
            docstring), e.g. 0.1.
        confirm: opt-in improvement (default 1: the paper's rule): records in a row, outside
            the observation window, with SE >= ``rapid`` before a rapid-tune (see the module
            docstring), e.g. 3.

    Attributes:
        actions: one of ``"none"``, ``"fine"``, ``"rapid"`` per :meth:`decide` call, the latest
            :attr:`ACTIONS_KEPT` of them (it is checkpointed with the policy, so it is bounded).
        last_se: SE of the latest record seen by :meth:`decide`.
        window_left: records still to count in the observation window.
        high: records in a row (outside the window) with SE >= ``rapid`` so far.
        waiting: the rapid-tune sizes the window waits for before counting (None: counting).
        last_step: step of the latest record :meth:`decide` consumed (None: none yet). With
            ``exchange_every > 1`` a decision follows a block of records; every record after
            this one is counted in the window, not only the newest.
    """

    name = "lbb"
    _optional_kinds = {"waiting": (), "last_step": 0}  # (a list of sizes; a step)
    _list_items = {"waiting": int, "actions": str}
    #: Length of the :attr:`actions` log.
    ACTIONS_KEPT = 1024

    def __init__(self, fine: float = 0.05, rapid: float = 0.3, step: int = 1, window: int = 10,
                 priority: float = math.inf, confirm: int = 1) -> None:
        fine = number(fine, "LBB: fine", minimum=0.0)
        rapid = number(rapid, "LBB: rapid", minimum=0.0, finite=False)  # inf disables rapid-tuning
        if rapid < fine:
            raise ValueError(f"LBB: rapid={rapid!r} must be >= fine={fine!r} (rapid-tuning starts "
                             f"where fine-tuning ends)")
        priority = number(priority, "LBB: priority", above=0.0, finite=False)
        self.fine, self.rapid, self.priority = fine, rapid, priority
        self.step = integer(step, "LBB: step", 1)
        self.window = integer(window, "LBB: window", 0)
        self.confirm = integer(confirm, "LBB: confirm", 1)
        self.high = 0
        self.window_left = 0
        self.waiting: Optional[List[int]] = None
        self.last_step: Optional[int] = None  # step of the latest record a decision consumed
        self.actions: List[str] = []
        self.last_se = 0.0

    # -- protocol ---------------------------------------------------------------------------

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (errors: :meth:`SizedPolicy.load_state_dict`); the
        sizes a rapid-tune waits for must be one per rank (else no record would ever match them
        and the observation window would never close)."""
        if isinstance(state, Mapping) and isinstance(state.get("waiting"), (list, tuple)):
            world = state.get("world", getattr(self, "world", None))
            if isinstance(world, int) and len(state["waiting"]) != world:
                raise ValueError(f"lbb.load_state_dict: waiting must hold one size per rank "
                                 f"({world}), got {list(state['waiting'])!r:.80}")
        # A state saved before last_step was kept: count from the restored history's next record.
        super().load_state_dict({"last_step": None, **state} if isinstance(state, Mapping) else state)

    def start(self, ctx: Context) -> np.ndarray:
        """Sizes from the profiled models (Eq. 3), else the equal split; remembers each rank's
        profiled start-up overhead ``a0`` (0 without a linear profile) for rapid-tuning."""
        self._setup(ctx)
        lin = [p.get("linear") if p is not None else None for p in ctx.profiles]
        self.a0 = np.array([float(m.a0) if m is not None else 0.0 for m in lin])
        # Last known per-sample time of each rank: only used for a rank that had no samples.
        self.slope = np.array([float(m.a1) if m is not None else np.nan for m in lin])
        self.window_left = 0
        self.high = 0
        self.waiting = None
        self.last_step = None
        self.actions = []
        self.last_se = 0.0
        # The cubic profile models first; linear ones are the next best thing.
        models = ctx.models("model") or ctx.models("linear")
        if models is not None:
            sizes = allocate(models, self.global_batch, self.lower, self.upper)
        else:
            sizes = self.uniform()
        return self.emit(sizes)

    def decide(self, history: History) -> np.ndarray:
        """Keep, fine-tune or rapid-tune from the latest record (see the module docstring)."""
        rec = self.latest(history)
        # With exchange_every=k a decision follows a block of up to k records: the window counts
        # every one of them, not one per decision (which would stretch it k-fold).
        new = records_after(history, self.last_step)
        for old in new[:-1]:
            if self.usable(old):  # (a record refused as the newest does not count later either)
                inside = self._count(old)
                self._high(straggler_effect(old.compute, old.batch), inside)
        in_window = self._count(rec) if new else self.waiting is not None or self.window_left > 0
        self.last_step = int(rec.step)
        se = straggler_effect(rec.compute, rec.batch)
        self.last_se = se
        if new:
            self._high(se, in_window)
        action, sizes = "none", self.last
        if se < self.fine:
            pass
        elif se >= self.rapid and not in_window and self.high >= self.confirm:
            action, sizes = "rapid", self._rapid_tune(rec)
            self.high = 0
            if self.window > 0:
                self.window_left = self.window
                self.waiting = [int(v) for v in sizes]
        elif self.ran_latest(rec):
            # Incremental: only once the last decision is what the ranks actually ran.
            moved = self._fine_tune(history, rec)
            if moved is not None:
                action, sizes = "fine", moved
        self.actions.append(action)
        if len(self.actions) > self.ACTIONS_KEPT:
            del self.actions[:-self.ACTIONS_KEPT]
        return self.emit(sizes)

    def _high(self, se: float, inside: bool) -> None:
        """Count a record towards ``confirm``: a run of SE >= ``rapid`` outside the window."""
        self.high = self.high + 1 if (se >= self.rapid and not inside) else 0

    def _count(self, rec: StepRecord) -> bool:
        """Count ``rec`` in the observation window; whether ``rec`` lies inside it."""
        if self.waiting is not None and rec.batch.tolist() == self.waiting:
            self.waiting = None  # the rapid-tune's sizes have reached the ranks: start counting
        inside = self.waiting is not None or self.window_left > 0
        if self.waiting is None and self.window_left > 0:
            self.window_left -= 1
        return inside

    # -- tuning -----------------------------------------------------------------------------

    def _steps(self, b: np.ndarray) -> np.ndarray:
        """Micro-steps each rank runs for batches ``b`` (1 without a micro-batch)."""
        micro = self.micro_limits(b)
        return np.where(micro > 0, -(-b // np.maximum(micro, 1)), 1).astype(np.float64)

    def _rough(self, rec: StepRecord) -> tuple:
        """Rough linear models of Algorithm 2 (``a0_i``, ``a1_i = (CT_i - a0_i) / CB_i``); a rank
        in ``k`` micro-steps paid ``k`` overheads: ``a1_i = (CT_i - k * a0_i) / CB_i``."""
        b = rec.batch.astype(np.float64)
        t = rec.compute
        has = rec.batch > 0
        # If the step took no longer than the profiled overhead, that overhead is wrong for now:
        # drop it so the slope stays positive.
        k = self._steps(rec.batch)
        a0 = np.where(has & (t > k * self.a0), self.a0, 0.0)
        slope = self.slope.copy()
        slope[has] = (t[has] - k[has] * a0[has]) / b[has]
        missing = ~has & ~np.isfinite(slope)
        if missing.any():
            slope[missing] = float(np.median(slope[has])) if has.any() else 1.0
        return a0, slope

    def _rapid_tune(self, rec: StepRecord) -> np.ndarray:
        a0, slope = self._rough(rec)
        self.slope = slope
        micro = self.micro_limits(rec.batch)  # (the way each rank ran the measured step)
        if not micro.any():
            return allocate_linear(a0, slope, self.global_batch, self.lower, self.upper)
        models = [LinearModel(a0[i], slope[i]) if not micro[i] else
                  micro_step_model(LinearModel(a0[i], slope[i]), int(micro[i]), self.global_batch)
                  for i in range(self.world)]
        for i, model in self.recomputing_models(rec).items():  # (either way, by its share)
            models[i] = model
        return allocate(models, self.global_batch, self.lower, self.upper)

    def _fine_tune(self, history: History, rec: StepRecord) -> Optional[np.ndarray]:
        """Move samples from the slowest rank; None when no move is possible."""
        t, last = rec.compute, self.last
        active = last > 0
        givers = active & (last > self.lower)
        if not givers.any():
            return None
        s = int(np.argmax(np.where(givers, t, -np.inf)))
        mean = float(t[active].mean())
        excess = float(t[s]) - mean
        if math.isfinite(self.priority) and excess >= self.priority * mean:
            moved = self._priority_move(history, rec, s, excess)
            if moved is not None:
                return moved
        receivers = active & (last < self.upper) & (t < t[s])
        receivers[s] = False
        if not receivers.any():
            return None
        f = int(np.argmin(np.where(receivers, t, np.inf)))
        m = min(self.step, int(last[s] - self.lower[s]), int(self.upper[f] - last[f]))
        new = last.copy()
        new[s] -= m
        new[f] += m
        return new

    def _per_sample(self, history: History, rec: StepRecord, r: int) -> float:
        """Marginal seconds per sample of rank ``r``.

        The rough model's ``(CT - a0) / CB`` counts any extra fixed cost (a co-located job, a
        disturbance) as per-sample cost, so it can be several times too large. A secant through
        an earlier step of the same rank at a clearly different batch size (as after a
        rapid-tune) measures the marginal cost; it is trusted within a factor 4 of the rough
        slope, so noise on a short secant cannot produce a wild move.
        """
        b1, t1 = int(rec.batch[r]), float(rec.compute[r])
        a0 = self.a0[r] if t1 > self.a0[r] else 0.0
        rough = (t1 - a0) / b1
        for old in reversed(history.last(2 * self.window + 2)[:-1]):
            b0, t0 = int(old.batch[r]), float(old.compute[r])
            if b0 > 0 and abs(b1 - b0) >= max(2, 0.05 * b1):
                secant = (t1 - t0) / (b1 - b0)
                if math.isfinite(secant) and secant > 0:
                    return float(min(max(secant, rough / 4), rough * 4))
                break  # the rank's speed changed in between: the secant says nothing
        return rough

    def _priority_move(self, history: History, rec: StepRecord, s: int,
                       excess: float) -> Optional[np.ndarray]:
        """Halve the excess of a much slower rank ``s``; None if that is no more than ``step``."""
        t, last = rec.compute, self.last
        per_sample = self._per_sample(history, rec, s)
        level = t[s] - 0.5 * excess  # where the slowest rank should land
        k = min(int(0.5 * excess / per_sample), int(last[s] - self.lower[s]))
        # Room of every other rank under that level, at its measured speed (time / batch is at
        # least the marginal time per sample, so the room is not over-estimated).
        room = np.zeros(self.world, np.int64)
        ok = (last > 0) & (t < level) & (last < self.upper)
        ok[s] = False
        room[ok] = np.minimum(np.floor((level - t[ok]) * last[ok] / t[ok]).astype(np.int64),
                              self.upper[ok] - last[ok])
        k = min(k, int(room.sum()))
        if k <= self.step:
            return None
        extra = allocate_proportional(room.astype(np.float64), k,
                                      np.zeros(self.world, np.int64), room)
        new = last + extra
        new[s] -= k
        return new
