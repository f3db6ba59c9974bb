"""LB-BSP: load-balanced BSP by per-worker batch sizes (LB-BSP paper, sections 3.2 and 3.3).

**GPU mode** (Algorithm 2, exactly, by default). From the policy's own last decision ``x``:

1. the *leader* is the rank with the shortest compute time among those with at most
   ``memory_guard`` (0.95) of their device memory in use; the *straggler* the one with the
   longest;
2. if the straggler's batch is ``<= Δ``: keep the sizes and log a warning (logger
   ``hetlb.policies``, once per rank) that it should be removed from the job
   (``remove_warning`` names it);
3. else if the leader's time was below the straggler's in each of the last ``D`` records: move
   ``Δ`` samples from the straggler to the leader (fewer if a bound is in the way);
4. else if in some earlier record the leader's time was above the straggler's (oscillation): the
   fine-tune phase begins, ``Δ = fine_step`` (1), ``D = fine_window`` (20), for good.

It starts in the fast-approach phase, ``Δ = step`` (5), ``D = window`` (5).

Two opt-in improvements, named, tested and benchmarked against the paper's algorithm
(``bench/bench_policies.py``):

* ``settle=True``: Algorithm 2's fine phase moves one sample whenever the leader preceded the
  straggler for ``D`` records, which at integer granularity never stops: the best integer split
  still has a straggler, so samples cycle between ranks. With ``settle``, the fine-phase leader is
  the rank whose time scaled by ``(b + Δ) / b`` is least, and the move is skipped when that
  estimate reaches the straggler's time (it could only swap who straggles).
* ``reequilibrate=SE`` (e.g. 0.3): the paper's fine phase never ends, so a large change of a
  rank's speed later in training is approached one sample per 20 records. With this option, when
  the straggler effect exceeded ``SE`` in each of the last ``window`` records and the leader
  preceded the straggler in all of them, the policy returns to the fast phase and moves ``step``.

**CPU mode** (Algorithm 1). Sizes proportional to each rank's predicted speed,
``x_i = v_i / sum(v) * X`` (:func:`hetlb.allocate_proportional`: largest remainder inside the
bounds). The predictor (Table 3): :class:`NARX` (the paper's; default) runs on every rank over its
own history and publishes its prediction in the telemetry table, the policy reading the shared
numbers and using its own EMA (``alpha`` 0.2) of the shared speeds for a rank that has none yet
(the paper's: EMA for the first 500 iterations, NARX after; ``NARX(fit_check=True, guard=5)``
opts into handing a rank back to the EMA where its network does worse);
:class:`Memoryless` and :class:`EMA` run here, on the shared table. Speeds are measured per
record, so this mode acts on every record whatever sizes it ran (lag-free).

What the paper's "batch processing time" is here: the paper balances a worker's computation plus
the part of its communication it cannot overlap, measured as iteration time minus barrier wait.
hetlb measures each rank's compute from its first forward to its last gradient bucket being
ready; with DDP's asynchronous bucket all-reduces that includes any wait of the backward pass on
communication it could not overlap, and excludes the final all-reduce, whose transfer every rank
of a collective shares (a slow link slows the whole ring, which no batch split can fix) and whose
barrier wait is exactly what balancing removes.

Other readings of the paper: the lag rule (a decision may reach the ranks a few steps late when
the loader prefetches; GPU mode acts only on a record that ran its latest decision, which at zero
lag is every record, so the paper's algorithm is unchanged); the oscillation test uses the
records in the history (the latest ``history`` steps the Balancer keeps).
"""
from __future__ import annotations

import copy
import logging
from typing import Any, Dict, List, Mapping, Optional, Union

import numpy as np

from hetlb.core.checks import choice, flag, integer, number
from hetlb.core.telemetry import History, StepRecord, straggler_effect
from hetlb.policies.base import Context, SizedPolicy, check_state, records_after
from hetlb.policies.narx import NARX
from hetlb.policies.predictors import EMA, SpeedPredictor, predictor_from_state


__all__ = ["LBBSP"]

log = logging.getLogger("hetlb.policies")

#: Predicted speeds are rounded to this many parts of the fastest before allocation, so a last-bit
#: difference between ranks' floating point cannot change the integer decision.
_SPEED_GRID = float(1 << 20)


#: GPU mode's settings at their defaults (the paper's): CPU mode refuses any other value.
_GPU_DEFAULTS = {"step": 5, "window": 5, "fine_step": 1, "fine_window": 20, "memory_guard": 0.95,
                 "settle": False, "reequilibrate": None}


class LBBSP(SizedPolicy):
    """LB-BSP batch-size policy (see the module docstring for the algorithm).

    Args:
        mode: ``"gpu"`` (Algorithm 2, leader/straggler steps) or ``"cpu"`` (Algorithm 1, sizes
            proportional to predicted speed).
        predictor: CPU mode's speed predictor: ``NARX()`` (default), ``EMA(0.2)`` or
            ``Memoryless()``. Not allowed in GPU mode.
        step: fast-approach step size Δ (paper: 5).
        window: fast-approach observation window D (paper: 5).
        fine_step: fine-tune step size (paper: 1).
        fine_window: fine-tune observation window (paper: 20).
        memory_guard: a rank with a larger fraction of its device memory in use cannot lead
            (paper: 0.95, "at least 5 percent available").
        settle: opt-in (default False): skip fine moves that could only swap the straggler.
        reequilibrate: opt-in (default None): SE above which a persistent imbalance returns the
            fine phase to the fast phase, e.g. 0.3.

    Attributes:
        phase: ``"fast"`` or ``"fine"`` (GPU mode).
        remove_warning: rank flagged for removal by the latest GPU decision, else None.
        last_action: ``"start"``, ``"wait"`` (record not at the latest decision yet),
            ``"keep"``, ``"move"``, ``"settled"``, ``"fine"`` (switched to the fine phase),
            ``"fast"`` (switched back and moved), ``"warn"`` or ``"predict"`` (CPU mode).
        last_se: straggler effect of the latest record acted on.
    """

    name = "lbbsp"
    _optional_kinds = {"reequilibrate": 0.0, "remove_warning": 0, "last_step": 0}
    _list_items = {"warned": int}

    def __init__(self, mode: str = "gpu", predictor: Optional[Union[SpeedPredictor, NARX]] = None,
                 step: int = 5, window: int = 5, fine_step: int = 1, fine_window: int = 20,
                 memory_guard: float = 0.95, settle: bool = False,
                 reequilibrate: Optional[float] = None) -> None:
        choice(mode, "LBBSP: mode", ("gpu", "cpu"))
        if predictor is not None and not isinstance(predictor, (SpeedPredictor, NARX)):
            raise ValueError(f"LBBSP: predictor must be a hetlb predictor (NARX, EMA, Memoryless), "
                             f"got {type(predictor).__name__}")
        if mode == "gpu" and predictor is not None:
            raise ValueError("LBBSP: a predictor is only used in mode='cpu'")
        self.mode = mode
        self.predictor: Optional[Union[SpeedPredictor, NARX]] = (
            predictor if predictor is not None else (NARX() if mode == "cpu" else None))
        self.step = integer(step, "LBBSP: step", 1)
        self.window = integer(window, "LBBSP: window", 1)
        self.fine_step = integer(fine_step, "LBBSP: fine_step", 1)
        self.fine_window = integer(fine_window, "LBBSP: fine_window", 1)
        self.memory_guard = number(memory_guard, "LBBSP: memory_guard", above=0.0, maximum=1.0)
        self.settle = flag(settle, "LBBSP: settle")
        self.reequilibrate = None if reequilibrate is None else \
            number(reequilibrate, "LBBSP: reequilibrate", above=0.0)
        if mode == "cpu":  # Algorithm 1 has none of Algorithm 2's settings: refuse, not ignore
            gpu_only = {k: v for k, v in (("step", self.step), ("window", self.window),
                                          ("fine_step", self.fine_step),
                                          ("fine_window", self.fine_window),
                                          ("memory_guard", self.memory_guard),
                                          ("settle", self.settle),
                                          ("reequilibrate", self.reequilibrate))
                        if v != _GPU_DEFAULTS[k]}
            if gpu_only:
                raise ValueError(f"LBBSP: {', '.join(f'{k}={v!r}' for k, v in gpu_only.items())} "
                                 f"only apply in mode='gpu' (Algorithm 2); mode='cpu' sizes by "
                                 f"predicted speed (choose its predictor with predictor=)")
        self._reset_state()

    def _reset_state(self) -> None:
        self.phase = "fast"
        self.remove_warning: Optional[int] = None
        self.warned: List[int] = []  # ranks already named in a removal warning
        self.last_action = "start"
        self.last_se = 0.0
        self.last_step: Optional[int] = None  # step of the latest record consumed

    @property
    def current_step(self) -> int:
        """Δ of the current phase."""
        return self.step if self.phase == "fast" else self.fine_step

    @property
    def current_window(self) -> int:
        """D of the current phase."""
        return self.window if self.phase == "fast" else self.fine_window

    def local_predictor(self, rank: int) -> Optional[NARX]:
        """The rank's own NARX (CPU mode with NARX), which publishes its predicted speed."""
        return self.predictor.for_rank(rank) if isinstance(self.predictor, NARX) else None

    # -- protocol ---------------------------------------------------------------------------

    def start(self, ctx: Context) -> np.ndarray:
        """Remember ``ctx`` and return the equal split within the bounds."""
        self._setup(ctx)
        self._reset_state()
        if self.mode == "cpu":
            self._central().reset(self.world)
        return self.emit(self.uniform())

    def decide(self, history: History) -> np.ndarray:
        """Sizes of the next step from the history (latest record last)."""
        rec = self.latest(history)
        if self.mode == "cpu":
            return self.emit(self._decide_cpu(history, rec))
        return self.emit(self._decide_gpu(history, rec))

    def state_dict(self) -> Dict[str, Any]:
        """Public attributes, the central predictor as its own (plain-value) state dict."""
        state = {k: copy.deepcopy(v) for k, v in vars(self).items()
                 if not k.startswith("_") and k != "predictor"}
        p = self.predictor
        state["predictor"] = None if p is None else (
            {"type": "NARX", **p.config()} if isinstance(p, NARX) else p.state_dict())
        if getattr(self, "_ema", None) is not None:
            state["ema"] = self._ema.state_dict()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; a fresh instance then decides identically (errors:
        :meth:`SizedPolicy.load_state_dict`). With the default per-rank NARX (``mode="cpu"``)
        this holds up to the NARX warm-up: its weights live on each rank and are not in the
        state, so a resumed Balancer refits each rank's NARX from the restored history
        (:meth:`NARX.rebuild`), and later predictions, hence sizes, may differ from an
        uninterrupted run's. ``predictor=EMA()`` or ``Memoryless()`` resume identically."""
        state = check_state(state, self.name)
        pstate = state.pop("predictor", None)
        ema = state.pop("ema", None)
        if state.get("mode", self.mode) not in ("gpu", "cpu"):
            raise ValueError(f"lbbsp.load_state_dict: mode must be 'gpu' or 'cpu', got {state['mode']!r}")
        for name, value in (("predictor", pstate), ("ema", ema)):
            if value is not None and not isinstance(value, Mapping):
                raise ValueError(f"lbbsp.load_state_dict: {name} must be a predictor's state dict "
                                 f"(from state_dict()), got {type(value).__name__} {value!r:.80}")
        super().load_state_dict(state)
        if pstate is None:
            self.predictor = None
        elif pstate.get("type") == "NARX":
            self.predictor = NARX.from_config({k: v for k, v in pstate.items() if k != "type"})
        elif isinstance(self.predictor, SpeedPredictor) and pstate.get("type") == type(self.predictor).__name__:
            self.predictor.load_state_dict(pstate)
        else:
            self.predictor = predictor_from_state(pstate)
        if ema is not None:
            self._ema = predictor_from_state(ema)

    # -- CPU mode (Algorithm 1) -------------------------------------------------------------

    def _central(self) -> SpeedPredictor:
        """The predictor run on the shared table: the configured one, or NARX's EMA fallback."""
        if isinstance(self.predictor, SpeedPredictor):
            return self.predictor
        if getattr(self, "_ema", None) is None:
            self._ema = EMA(self.predictor.alpha)
        return self._ema

    def _decide_cpu(self, history: History, rec: StepRecord) -> np.ndarray:
        new = list(history) if self.last_step is None else records_after(history, self.last_step)
        if not new:
            return self.last  # the same history again: nothing new to learn from
        central = self._central()
        for r in new:
            central.update(r)
        self.last_step = int(rec.step)
        self.last_se = straggler_effect(rec.compute, rec.batch)
        pred = central.predict(rec.cpu, rec.memory)
        if isinstance(self.predictor, NARX):
            published = np.asarray(rec.predicted, np.float64)
            pred = np.where(np.isfinite(published) & (published > 0), published, pred)
        top = float(pred.max())
        speeds = np.rint(pred / top * _SPEED_GRID) if top > 0 else np.zeros(self.world)
        self.last_action = "predict"
        return self.proportional(speeds)

    # -- GPU mode (Algorithm 2) -------------------------------------------------------------

    def _decide_gpu(self, history: History, rec: StepRecord) -> np.ndarray:
        if self.last_step is not None and rec.step == self.last_step:
            return self.last  # already acted on this record
        self.last_step = int(rec.step)
        x = self.last
        if not self.ran_latest(rec):
            self.last_action = "wait"  # our latest decision has not reached the ranks yet
            return x
        t = np.asarray(rec.compute, np.float64)
        self.last_se = straggler_effect(t, x)
        self.last_action = "keep"
        busy = x > 0
        if not busy.any():
            return x
        delta = self.current_step
        lead_ok = busy & (np.asarray(rec.memory) <= self.memory_guard) & (x < self.upper)
        settling = self.phase == "fine" and self.settle
        # Settling: the leader is the rank fastest *after* taking Δ (proportional estimate).
        est = np.where(x > 0, t * (x + delta) / np.maximum(x, 1), t) if settling else t
        strag = int(np.argmax(np.where(busy, t, -np.inf)))
        if x[strag] <= delta:
            # Algorithm 2, lines 5-6: taking Δ would leave the straggler nothing (or less).
            if strag not in self.warned:  # once per rank: two tied stragglers would alternate
                self.warned.append(strag)
                log.warning("LB-BSP: straggler rank %d has batch %d <= step %d; it is too slow "
                            "to keep up and should be removed from the job (sizes kept)",
                            strag, int(x[strag]), delta)
            self.remove_warning = strag
            self.last_action = "warn"
            return x
        self.remove_warning = None
        if not lead_ok.any():
            return x
        leader = int(np.argmin(np.where(lead_ok, est, np.inf)))
        if leader == strag:
            return x
        if self.phase == "fine" and self._reequilibrate(history, leader, strag):
            self.phase = "fast"
            self.last_action = "fast"
            return self._move(x, leader, strag, self.step)
        if self._preceded(history, leader, strag, self.current_window):
            if settling and est[leader] >= t[strag]:
                self.last_action = "settled"
                return x
            self.last_action = "move"
            return self._move(x, leader, strag, delta)
        if self.phase == "fast" and self._oscillated(history, leader, strag):
            self.phase = "fine"
            self.last_action = "fine"
        return x

    @staticmethod
    def _preceded(history: History, leader: int, strag: int, d: int) -> bool:
        """The leader's time was below the straggler's in each of the last ``d`` records."""
        recs = history.last(d)
        return len(recs) >= d and all(r.compute[leader] < r.compute[strag] for r in recs)

    @staticmethod
    def _oscillated(history: History, leader: int, strag: int) -> bool:
        """Algorithm 2's switch: in some earlier record the leader was slower than the straggler."""
        return any(r.compute[leader] > r.compute[strag] for r in history)

    def _reequilibrate(self, history: History, leader: int, strag: int) -> bool:
        """Opt-in: a large, persistent imbalance in the fine phase (SE above the threshold over
        the fast window, leader ahead throughout)."""
        if self.reequilibrate is None:
            return False
        recs = history.last(self.window)
        return (len(recs) >= self.window
                and all(straggler_effect(r.compute, r.batch) > self.reequilibrate for r in recs)
                and self._preceded(history, leader, strag, self.window))

    def _move(self, x: np.ndarray, leader: int, strag: int, delta: int) -> np.ndarray:
        m = min(delta, int(self.upper[leader] - x[leader]), int(x[strag] - self.lower[strag]))
        new = x.copy()
        new[leader] += m
        new[strag] -= m
        return new
