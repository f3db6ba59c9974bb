"""LB-BSP: load-balanced BSP by per-worker batch sizes (LB-BSP paper, sections 3.2 and 3.3).

**CPU mode** (Algorithm 1). After every step each rank's speed ``v = batch / compute`` feeds a
per-rank predictor (:mod:`hetlb.policies.predictors`; default :class:`NARX` with the paper's
look-back 2 and 500-step warm-up, predicting with an EMA of alpha 0.2 until then) and the next
sizes are ``x_i = v_i / sum(v) * B`` (:func:`hetlb.allocate_proportional`: largest-remainder
rounding inside the bounds). The latest record's CPU and memory usage are the "current" readings
``c^k, m^k`` of Eq. 4. Speeds are measured per record, so this mode acts on every record,
whatever sizes the ranks actually ran (lag-free).

**GPU mode** (Algorithm 2). From the policy's own last decision: the *leader* is the rank with
the shortest compute time among those with memory in use ``<= memory_guard`` (paper: at least 5 %
free) that are below their upper bound; the *straggler* is the rank with the longest. Then, in
this order:

1. the straggler's batch ``<= Δ``: keep the sizes, log a warning on logger ``hetlb.policies``
   that the straggler should be removed from the job (once per rank), and set
   ``remove_warning`` to its rank;
2. the leader preceded the straggler in each of the last ``D`` records: move ``Δ`` samples
   from the straggler to the leader (fewer if a bound is in the way);
3. fast phase only: a former leader (a rank that gained samples in this fast phase) is now the
   straggler, or a former straggler is now the leader: oscillation, switch to the fine phase.

Phases: ``"fast"`` (``Δ = step = 5``, ``D = window = 5``) until oscillation, then ``"fine"``
(``Δ = fine_step = 1``, ``D = fine_window = 20``).

Interpretations of what the paper leaves open:

* Lag rule: a decision may reach the ranks a few steps after it is made (loader prefetch).
  GPU mode acts only on a record whose ``batch`` equals its latest decision and otherwise
  returns that decision unchanged; the ``D``-record observation window itself slides over the
  history as in Algorithm 2 (records before the last move count), so once a move has taken
  effect the next one can follow at once if the imbalance persists.
* The warning test uses the true straggler (longest time among ranks with samples). A move
  takes from the slowest rank that can still give (batch above its lower bound), so a straggler
  pinned at its lower bound does not freeze the rest of the cluster.
* Algorithm 2's oscillation test ("∃h: t_leader^h > t_straggler^h") is read as the prose
  describes it: a rank that gained samples in this fast phase is now the straggler, or one that
  gave samples is now the leader.
* Re-equilibration (the paper has none; its fine phase never ends): in the fine phase, when the
  straggler effect ``SE = (max T - min T) / mean T`` exceeded ``rapid`` (0.3) in each of the last
  ``window`` records and the current leader preceded the current straggler in all of them, the
  policy returns to the fast phase and moves ``step`` samples at once. A change of one rank's
  speed that leaves SE above 0.3 is thus re-approached at fast-phase pace; a smaller one is
  corrected by fine-phase moves (1 sample per ``fine_window``-consistent record).
* Settling (the paper's fine phase moves one sample whenever the leader preceded the straggler
  for ``D`` records, which at integer granularity never stops: the best integer split still has
  a straggler, so samples cycle between ranks and the mean step time sits above the best split).
  With ``settle=True`` (default) the fine-phase leader is the rank whose time scaled by
  ``(b + Δ) / b`` is least, and the move is skipped when that estimate reaches the straggler's
  time: the move could only swap who straggles. The
  proportional estimate over-states the leader's new time by at most its start-up cost times
  ``Δ / b``, so a skipped move could have shortened the step by at most that much.
* CPU mode rounds predicted speeds to 20 significant bits of the fastest before allocating, so
  a last-bit difference between ranks' floating point (different CPU generations) cannot change
  the integer decision, except at a rounding boundary.
"""
from __future__ import annotations

import copy
import logging
import math
from typing import Any, Dict, List, Optional

import numpy as np

from ..telemetry import StepRecord, straggler_effect, validate_record
from .base import Context
from .predictors import NARX, SpeedPredictor, predictor_from_state
from .uniform import _SizedPolicy

__all__ = ["LBBSP"]

log = logging.getLogger("hetlb.policies")

#: Predicted speeds are rounded to this many parts of the fastest before allocation.
_SPEED_GRID = float(1 << 20)


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"LBBSP: {what} must be an integer >= 1, got {value!r}")
    return int(value)


class LBBSP(_SizedPolicy):
    """LB-BSP batch-size policy (see the module docstring for the algorithm).

    Args:
        mode: ``"gpu"`` (Algorithm 2, leader/straggler steps) or ``"cpu"`` (Algorithm 1, sizes
            proportional to predicted speed).
        predictor: CPU mode's speed predictor; default ``NARX()`` (look-back 2, warm-up 500
            steps during which it predicts with ``EMA(0.2)``). Not allowed in GPU mode.
        step: fast-phase step size Δ (paper: 5).
        window: fast-phase observation window D (paper: 5); also the window of the
            re-equilibration rule.
        fine_step: fine-phase step size (paper: 1).
        fine_window: fine-phase observation window (paper: 20).
        memory_guard: a rank with a larger fraction of memory in use cannot lead (paper: 0.95).
        rapid: SE above which a fine phase returns to the fast phase (see the module docstring);
            ``math.inf`` disables it.
        settle: skip fine-phase moves that could only swap the straggler (see the module
            docstring); ``False`` is the paper's Algorithm 2 as written.

    Attributes:
        phase: ``"fast"`` or ``"fine"`` (GPU mode).
        remove_warning: rank flagged for removal by the latest GPU decision, else None.
        last_action: ``"start"``, ``"wait"`` (record not at the latest decision yet),
            ``"keep"``, ``"move"``, ``"settled"`` (fine move skipped by ``settle``), ``"fine"``
            (switched to fine phase), ``"fast"`` (switched back and moved), ``"warn"`` or
            ``"predict"`` (CPU mode).
        last_se: straggler effect of the latest record acted on.
    """

    name = "lbbsp"

    def __init__(self, mode: str = "gpu", predictor: Optional[SpeedPredictor] = None,
                 step: int = 5, window: int = 5, fine_step: int = 1, fine_window: int = 20,
                 memory_guard: float = 0.95, rapid: float = 0.3, settle: bool = True) -> None:
        if mode not in ("gpu", "cpu"):
            raise ValueError(f"LBBSP: mode must be 'gpu' or 'cpu', got {mode!r}")
        if predictor is not None and not isinstance(predictor, SpeedPredictor):
            raise ValueError(f"LBBSP: predictor must be a hetlb SpeedPredictor (Memoryless, EMA, "
                             f"NARX), got {type(predictor).__name__}")
        if mode == "gpu" and predictor is not None:
            raise ValueError("LBBSP: a predictor is only used in mode='cpu'")
        guard, rapid = float(memory_guard), float(rapid)
        if not (guard > 0):
            raise ValueError(f"LBBSP: memory_guard must be > 0, got {memory_guard!r}")
        if not (rapid > 0):
            raise ValueError(f"LBBSP: rapid must be > 0 (inf to disable), got {rapid!r}")
        self.mode = mode
        self.predictor: Optional[SpeedPredictor] = (
            predictor if predictor is not None else (NARX() if mode == "cpu" else None))
        self.step = _positive_int(step, "step")
        self.window = _positive_int(window, "window")
        self.fine_step = _positive_int(fine_step, "fine_step")
        self.fine_window = _positive_int(fine_window, "fine_window")
        self.memory_guard, self.rapid = guard, rapid
        self.settle = bool(settle)
        self._reset_state()

    def _reset_state(self) -> None:
        self.phase = "fast"
        self.remove_warning: Optional[int] = None
        self.warned: List[int] = []  # ranks already named in a removal warning
        self.last_action = "start"
        self.last_se = 0.0
        self.last_step: Optional[int] = None  # step of the latest record consumed
        self.gainers: List[int] = []  # ranks that gained / gave samples in this fast phase
        self.givers: List[int] = []

    @property
    def current_step(self) -> int:
        """Δ of the current phase."""
        return self.step if self.phase == "fast" else self.fine_step

    @property
    def current_window(self) -> int:
        """D of the current phase."""
        return self.window if self.phase == "fast" else self.fine_window

    # -- protocol ---------------------------------------------------------------------------

    def start(self, ctx: Context) -> np.ndarray:
        """Remember ``ctx`` and return the equal split within the bounds."""
        self._setup(ctx)
        self._reset_state()
        if self.predictor is not None:
            self.predictor.reset(self.world)
        return self._emit(self._uniform())

    def decide(self, history: Any) -> np.ndarray:
        """Sizes of the next step from the history (latest record last)."""
        rec = self._latest(history)
        if self.mode == "cpu":
            return self._emit(self._decide_cpu(history, rec))
        return self._emit(self._decide_gpu(history, rec))

    def state_dict(self) -> Dict[str, Any]:
        """Public attributes, the predictor as its own (plain-value) state dict."""
        state = {k: copy.deepcopy(v) for k, v in vars(self).items()
                 if not k.startswith("_") and k != "predictor"}
        state["predictor"] = None if self.predictor is None else self.predictor.state_dict()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; a fresh instance then decides identically."""
        state = dict(state)
        pstate = state.pop("predictor", None)
        super().load_state_dict(state)
        if pstate is None:
            self.predictor = None
        elif self.predictor is not None and pstate.get("type") == type(self.predictor).__name__:
            self.predictor.load_state_dict(pstate)
        else:
            self.predictor = predictor_from_state(pstate)

    # -- checks -----------------------------------------------------------------------------

    def _validate(self, rec: StepRecord) -> None:
        validate_record(rec)
        fields = ("memory", "cpu") if self.mode == "cpu" else ("memory",)
        for f in fields:
            a = np.asarray(getattr(rec, f), np.float64)
            if not np.all(np.isfinite(a)):
                bad = np.flatnonzero(~np.isfinite(a)).tolist()
                raise ValueError(f"step {rec.step}: non-finite {f} usage from ranks {bad} "
                                 f"({f}={a.tolist()})")

    # -- CPU mode (Algorithm 1) -------------------------------------------------------------

    def _decide_cpu(self, history: Any, rec: StepRecord) -> np.ndarray:
        new = self._unseen(history)
        if not new:
            return self.last  # the same history again: nothing new to learn from
        for r in new[:-1]:  # all checked before any is learned from: a retry sees the same
            self._validate(r)
        for r in new:
            self.predictor.update(r)
        self.last_step = int(rec.step)
        self.last_se = straggler_effect(rec.compute, rec.batch)
        pred = self.predictor.predict(rec.cpu, rec.memory)
        top = float(pred.max())
        speeds = np.rint(pred / top * _SPEED_GRID) if top > 0 else np.zeros(self.world)
        self.last_action = "predict"
        return self._proportional(speeds)

    def _unseen(self, history: Any) -> List[StepRecord]:
        """Records after the latest one consumed, oldest first (all of them on the first call)."""
        if self.last_step is None:
            return list(history)
        if history[-1].step < self.last_step:  # step counter wrapped or history replaced
            return [history[-1]]
        out = []
        for i in range(len(history) - 1, -1, -1):
            r = history[i]
            if r.step <= self.last_step:
                break
            out.append(r)
        return out[::-1]

    # -- GPU mode (Algorithm 2) -------------------------------------------------------------

    def _decide_gpu(self, history: Any, rec: StepRecord) -> np.ndarray:
        if self.last_step is not None and rec.step == self.last_step:
            return self.last  # already acted on this record
        self.last_step = int(rec.step)
        x = self.last
        if not np.array_equal(rec.batch, x):
            self.last_action = "wait"  # our latest decision has not reached the ranks yet
            return x
        t = np.asarray(rec.compute, np.float64)
        self.last_se = straggler_effect(t, x)
        self.last_action = "keep"
        busy = x > 0
        if not busy.any():
            return x
        worst = int(np.argmax(np.where(busy, t, -np.inf)))
        delta = self.current_step
        if x[worst] <= delta:
            # Algorithm 2, lines 5-6: taking Δ would leave the straggler nothing (or less).
            if worst not in self.warned:  # once per rank: two tied stragglers would alternate
                self.warned.append(worst)
                log.warning("LB-BSP: straggler rank %d has batch %d <= step %d; it is too slow "
                            "to keep up and should be removed from the job (sizes kept)",
                            worst, int(x[worst]), delta)
            self.remove_warning = worst
            self.last_action = "warn"
            return x
        self.remove_warning = None
        lead_ok = (np.asarray(rec.memory) <= self.memory_guard) & (x < self.upper)
        give_ok = busy & (x > self.lower)
        if not lead_ok.any() or not give_ok.any():
            return x
        settling = self.phase == "fine" and self.settle
        # Settling: the leader is the rank fastest *after* taking Δ (proportional estimate), so
        # a tie between a small and a large batch goes to the one the move slows down least.
        est = np.where(x > 0, t * (x + delta) / np.maximum(x, 1), t) if settling else t
        leader = int(np.argmin(np.where(lead_ok, est, np.inf)))
        strag = int(np.argmax(np.where(give_ok, t, -np.inf)))
        if leader == strag or not t[leader] < t[strag]:
            return x
        if self.phase == "fine" and self._reequilibrate(history, leader, strag):
            self.phase = "fast"
            self.gainers, self.givers = [], []
            self.last_action = "fast"
            return self._move(x, leader, strag, self.step)
        if self._preceded(history, leader, strag, self.current_window):
            if settling and est[leader] >= t[strag]:
                self.last_action = "settled"
                return x
            self.last_action = "move"
            return self._move(x, leader, strag, delta)
        if self.phase == "fast" and (strag in self.gainers or leader in self.givers):
            self.phase = "fine"
            self.last_action = "fine"
        return x

    @staticmethod
    def _preceded(history: Any, leader: int, strag: int, d: int) -> bool:
        """The leader's time was below the straggler's in each of the last ``d`` records."""
        recs = history.last(d)
        return len(recs) >= d and all(r.compute[leader] < r.compute[strag] for r in recs)

    def _reequilibrate(self, history: Any, leader: int, strag: int) -> bool:
        """Fine phase: a large, persistent imbalance (SE > rapid over the fast window)."""
        if not math.isfinite(self.rapid):
            return False
        recs = history.last(self.window)
        return (len(recs) >= self.window
                and all(straggler_effect(r.compute, r.batch) > self.rapid for r in recs)
                and self._preceded(history, leader, strag, self.window))

    def _move(self, x: np.ndarray, leader: int, strag: int, delta: int) -> np.ndarray:
        m = min(delta, int(self.upper[leader] - x[leader]), int(x[strag] - self.lower[strag]))
        new = x.copy()
        new[leader] += m
        new[strag] -= m
        if self.phase == "fast":
            if leader not in self.gainers:
                self.gainers.append(leader)
            if strag not in self.givers:
                self.givers.append(strag)
        return new
