"""CHRONICA: size-aware scheduling of variable-size samples across uneven workers.

Two pieces (CHRONICA Sec. V-A, V-B):

* :class:`RuntimeProphet`, the per-rank time model ``T_r = a_r * W_r + b_r`` of a step's compute
  against the data amount ``W_r`` the rank trained (tokens, frames), fitted by least squares on
  the ranks' feedback (the telemetry's ``data`` and ``compute`` columns), with a non-negative
  slope. The paper regresses on all feedback (``forget=1``, the default); ``forget < 1``
  (opt-in) weighs step ``t - k`` by ``forget**k`` so the model follows a rank whose speed changes.
  ``quadratic`` (opt-in, for attention-bound models) makes a sample's work ``s + c*s^2`` with ``c``
  given or fitted; the squared sizes come from the step's plan, which every rank knows.
* :class:`Chronica`, the policy: every step's samples are the next global batch of the global
  order (so coverage, checkpoints and resume are those of every policy); it returns a
  :class:`hetlb.core.decisions.ScheduleRule` with the prophet's models, and the loader assigns the step's
  samples with :func:`hetlb.schedule` (largest first, each to the rank that would finish first)
  so the ranks' estimated training times (ETT) are equal. Per-rank sample counts differ freely,
  so a rank (a slow one, or any in a step of few large samples) may get no sample; its gradient
  is then weighed 0 (see the Balancer's idle ranks). The Balancer's ``lower`` and ``upper``
  cannot bound such counts and are refused with this policy (above 0, below the global batch);
  ``cap=`` bounds a rank's summed sample sizes instead.

Aggregation then weighs ranks by data amount (``Balancer(..., weighting="sizes")``, CHRONICA's
learning-rate compensation, Eq. 7) with the loss as a mean per data unit (per token).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

from hetlb.core.checks import flag, integer, number, optional_integer
from hetlb.core.decisions import ScheduleRule
from hetlb.core.telemetry import History, require_progress
from hetlb.policies.base import Context, Policy, check_state, records_after


__all__ = ["RuntimeProphet", "Chronica"]

#: Slopes at or above this (seconds per unit of work) are not a model but an overflow.
_MAX_SLOPE = 1e100


class RuntimeProphet:
    """Per-rank online least squares of compute seconds on the work of a step.

    A sample of size ``s`` costs work ``w(s) = s + c * s**2``: ``c = 0`` is CHRONICA's linear
    ``T = a * size + b`` (the default); ``c > 0`` models attention-bound work, given or fitted.
    Keeps, per rank, the (forgetting-)weighted sums of the products of ``1, S, Q, T`` (``S`` the
    rank's summed size, ``Q`` its summed squared size) over the steps the rank had data, so one
    update and one solve cost O(world). A rank whose feedback cannot separate slope from
    intercept (one distinct amount so far) or whose fit has a negative slope or intercept is
    modelled as proportional, ``T = (sum T / sum W) * W``: the non-negative fit closest to what
    it has seen.

    Args:
        world: number of ranks.
        forget: weight of the previous steps' statistics at each update, in ``(0, 1]``
            (1: ordinary least squares over all feedback, the paper's).
        quadratic: ``c`` (>= 0, fixed), or ``"fit"``: ``T = a*S + a*c*Q + b`` fitted per rank
            by least squares and ``c`` taken as the median over ranks of their ``(a*c) / a``
            (c is the workload's, a rank's speed scales ``a``); 0 until some rank's fit
            separates it.
    """

    #: Rows of ``stats``: the weighted sums of these products per rank.
    TERMS = ("n", "s", "q", "ss", "sq", "qq", "t", "st", "qt")

    def __init__(self, world: int, forget: float = 1.0, quadratic: Any = 0.0) -> None:
        self.world = integer(world, "RuntimeProphet: world", 1)
        self.forget = number(forget, "RuntimeProphet: forget", above=0.0, maximum=1.0)
        self.quadratic = check_quadratic(quadratic, "RuntimeProphet")
        self.stats = np.zeros((len(self.TERMS), self.world))

    def update(self, work: np.ndarray, time: np.ndarray, sq: Optional[np.ndarray] = None) -> None:
        """Add one step's feedback: summed sizes ``work``, seconds ``time`` and summed squared
        sizes ``sq`` (``[world]``; needed unless ``quadratic == 0``); ranks with no work, a time
        that is not finite and positive, or values whose products overflow are skipped (their
        statistics are kept, not decayed)."""
        w = np.asarray(work, np.float64)
        t = np.asarray(time, np.float64)
        if sq is None:
            if self.quadratic != 0.0:
                raise ValueError("RuntimeProphet: a quadratic work term needs the summed squared "
                                 "sizes (sq=)")
            q = np.zeros_like(w)
        else:
            q = np.asarray(sq, np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            x = np.stack([np.ones_like(w), w, q, w * w, w * q, q * q, t, w * t, q * t])
            new = self.stats * self.forget + x
        ok = (w > 0) & np.isfinite(t) & (t > 0) & np.all(np.isfinite(new), axis=0)
        self.stats[:, ok] = new[:, ok]

    def coefficient(self) -> float:
        """The quadratic coefficient ``c`` in use (the given one, or the current fit)."""
        if self.quadratic != "fit":
            return float(self.quadratic)
        n, s, q, ss, sq, qq, t, st, qt = self.stats
        A = np.stack([np.stack([n, s, q], -1), np.stack([s, ss, sq], -1), np.stack([q, sq, qq], -1)], 1)
        y = np.stack([t, st, qt], -1)
        # Scale the columns so the conditioning test does not depend on the units of size.
        d = np.sqrt(np.maximum(np.diagonal(A, axis1=1, axis2=2), 0.0))
        usable = (n >= 4) & np.all(d > 0, axis=1)
        if not usable.any():
            return 0.0
        d, A, y = d[usable], A[usable], y[usable]
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            As = A / (d[:, :, None] * d[:, None, :])
            finite = np.all(np.isfinite(As), axis=(1, 2)) & np.all(np.isfinite(y / d), axis=1)
            if not finite.any():
                return 0.0
            d, As, y = d[finite], As[finite], y[finite]
            try:
                sound = np.linalg.cond(As) < 1e8
                if not sound.any():
                    return 0.0
                coef = np.linalg.solve(As[sound], (y[sound] / d[sound])[..., None])[..., 0] / d[sound]
            except np.linalg.LinAlgError:  # degenerate feedback: no quadratic term yet
                return 0.0
        # Only the ratio matters here; a small intercept's sign is noise (the models refit it).
        _, alpha, beta = coef.T
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            ok = (alpha > 0) & (beta >= 0)
            ratios = beta[ok] / alpha[ok]
        ratios = ratios[np.isfinite(ratios)]
        return float(np.median(ratios)) if ratios.size else 0.0

    def models(self) -> "tuple[np.ndarray, np.ndarray]":
        """``(slope, intercept)`` float64 ``[world]`` per unit of work ``s + c*s^2`` (``c``:
        :meth:`coefficient`); NaN for a rank with no feedback yet."""
        c = self.coefficient()
        n, s, q, ss, sq, qq, t, st, qt = self.stats
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            sw, sww, swt = s + c * q, ss + 2 * c * sq + c * c * qq, st + c * qt
            det = n * sww - sw * sw
            a = (n * swt - sw * t) / det
            b = (t - a * sw) / n
            prop = t / sw
        # Separable only with spread in W (relative to its scale), and sound only non-negative.
        spread = det > 1e-9 * n * sww
        good = spread & np.isfinite(a) & np.isfinite(b) & (a > 0) & (b >= 0)
        slope = np.where(good, a, prop)
        intercept = np.where(good, b, 0.0)
        none = n == 0
        slope[none] = np.nan
        intercept[none] = np.nan
        return slope, intercept

    def predict(self, work: Any) -> np.ndarray:
        """Estimated seconds of each rank for ``work`` ``[world]`` (CHRONICA's ETT)."""
        a, b = self.models()
        return a * np.asarray(work, np.float64) + b

    def state_dict(self) -> Dict[str, Any]:
        return {"world": self.world, "forget": self.forget, "quadratic": self.quadratic,
                "stats": self.stats.tolist()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        world = integer(state["world"], "RuntimeProphet state: world", 1)
        forget = number(state["forget"], "RuntimeProphet state: forget", above=0.0, maximum=1.0)
        quadratic = check_quadratic(state.get("quadratic", 0.0), "RuntimeProphet")
        stats = np.asarray(state["stats"], np.float64)
        if stats.shape == (5, world):  # a linear prophet's checkpoint: n, sw, sww, st, swt
            old = stats
            stats = np.zeros((len(self.TERMS), world))
            stats[[0, 1, 3, 6, 7]] = old
        if stats.shape != (len(self.TERMS), world):
            raise ValueError(f"RuntimeProphet state: stats must be {len(self.TERMS)} x {world}, "
                             f"got shape {stats.shape}")
        self.world, self.forget, self.quadratic, self.stats = world, forget, quadratic, stats


def check_quadratic(value: Any, who: str) -> Any:
    """``"fit"`` or a finite number >= 0 (as float)."""
    if isinstance(value, str):
        if value != "fit":
            raise ValueError(f"{who}: quadratic must be a number >= 0 or 'fit', got {value!r}")
        return value
    return number(value, f"{who}: quadratic", minimum=0.0)


def _check_cap(cap: Any, quadratic: float, who: str) -> Any:
    """Chronica's ``cap``: None, or positive finite numbers (one, or one per rank) as a float or a
    list; ``ValueError`` naming ``who`` otherwise, and with a quadratic work term."""
    if cap is None:
        return None
    try:
        c = np.asarray(cap, np.float64)
    except (TypeError, ValueError, OverflowError):
        c = None
    if isinstance(cap, (str, bytes, bool)) or c is None or c.ndim > 1 or c.size == 0 \
            or np.any(~np.isfinite(c)) or np.any(c <= 0):
        raise ValueError(f"{who}: cap must be None, a positive number or one per rank, got {cap!r:.80}")
    if quadratic != 0.0:
        raise ValueError(f"{who}: cap= with a quadratic work term is not supported yet (the cap "
                         f"bounds summed size; the scheduler then places by work)")
    return c.tolist()


def _squares(rec: Any) -> np.ndarray:
    """A record's summed squared sample sizes per rank (without sample sizes every sample counts
    1, so they are the data amounts)."""
    return rec.data if rec.sq is None else rec.sq


def _close(held: ScheduleRule, rule: ScheduleRule, data: np.ndarray, sq: np.ndarray,
           hold: float) -> bool:
    """Whether ``rule`` predicts every rank's time for the work it ran (sizes summing to
    ``data``, squares to ``sq``) within ``hold`` times ``held``'s predicted step of ``held``'s
    prediction, each rule with its own quadratic term; and the rules share cap and pivot."""
    if rule.pivot != held.pivot or (rule.cap is None) != (held.cap is None) or \
            (rule.cap is not None and not np.array_equal(rule.cap, held.cap)):
        return False
    before, after = held.predict(data, sq), rule.predict(data, sq)
    step = float(np.max(before))
    if not (np.all(np.isfinite(before)) and np.all(np.isfinite(after)) and step > 0):
        return False
    return bool(np.max(np.abs(after - before)) <= hold * step)


class Chronica(Policy):
    """Size-aware scheduling (CHRONICA): each step's samples go to ranks by estimated time.

    Args:
        forget: the :class:`RuntimeProphet`'s forgetting factor (1: the paper's regression over
            all feedback; e.g. 0.9 to follow speed changes within tens of steps).
        pivot: place one sample of each step first, drawn from the loader's seed, the epoch and
            the step (CHRONICA Algorithm 2's random first pivot; the paper's default). False: the
            pure decreasing order (the step's samples are already a random draw of the global
            order either way).
        cap: largest summed sample size per rank and step (a number, or one per rank), e.g. the
            tokens that fit in a rank's memory; None: no cap.
        quadratic: the work of a sample of size ``s`` is ``s + c*s^2``: 0 (the paper's linear
            model, the default), a given ``c``, or ``"fit"`` (estimated from the feedback; for
            attention-bound models, where a sequence's cost grows with its length squared).
        hold: keep the previous rule while the refitted one predicts nearly the same times
            (opt-in, not in the paper; 0, the default, refits at every decision as the paper
            does). A refitted rule replaces the held one only when, for some rank, its
            predicted time for the work that rank ran in the newest step differs from the held
            rule's by more than ``hold`` times the held rule's predicted step (its largest such
            time); after a block of records (``exchange_every > 1``) also for the block's mean
            work. E.g. 0.02: changes under 2 % of a step are not acted on. Its use is
            ``Balancer(exchange_every=k, adaptive_exchange=True)``: an unchanged decision lets
            the blocks grow, where a rule refitted at every decision keeps them at one step.
            Not taken from a checkpoint: a state loaded keeps this policy's ``hold`` (and its
            held rule only if saved under the same ``hold``).

    Until a rank has fed back, it is modelled as the others' mean (equal speeds at the start:
    the first steps are balanced by data amount, as token balancing does). Needs the loader's
    ``sample_sizes`` (or a dataset that declares them); without them every sample counts 1 and
    this is count balancing by speed.
    """

    name = "chronica"

    resume_free = ("hold",)  # load_state_dict keeps the instance's hold (see there)

    def __init__(self, forget: float = 1.0, pivot: bool = True, cap: Any = None,
                 quadratic: Any = 0.0, hold: float = 0.0) -> None:
        self.forget = number(forget, "Chronica: forget", above=0.0, maximum=1.0)
        self.hold = number(hold, "Chronica: hold", minimum=0.0, below=1.0)
        self._held: Optional[ScheduleRule] = None  # the rule in force (hold > 0)
        self.quadratic = check_quadratic(quadratic, "Chronica")
        self.pivot = flag(pivot, "Chronica: pivot")
        self.cap = _check_cap(cap, self.quadratic, "Chronica")
        self.world = 0
        self.last_step: Optional[int] = None  # step of the latest record the prophet learnt from
        self._prophet: Optional[RuntimeProphet] = None

    def start(self, ctx: Context) -> ScheduleRule:
        if not isinstance(ctx, Context):
            raise ValueError(f"Chronica.start expects a hetlb Context, got {type(ctx).__name__}")
        self.world = int(ctx.world)
        self.global_batch = int(ctx.global_batch)
        if self.cap is not None and np.ndim(self.cap) == 1 and len(self.cap) != self.world:
            raise ValueError(f"Chronica: cap has {len(self.cap)} entries for {self.world} ranks")
        self._prophet = RuntimeProphet(self.world, self.forget, self.quadratic)
        self.last_step = None
        rule = self._rule()
        self._held = rule if self.hold > 0 else None
        return rule

    def _rule(self) -> ScheduleRule:
        """The rule from the prophet's models. A rank whose model is unknown (no feedback yet) or
        unusable (a slope that is not finite and positive, e.g. from absurd data amounts that
        under- or overflow) is modelled as the mean of the usable ones, so it gets a fair share
        to measure; with none usable, every rank is modelled alike (balancing by data amount)."""
        assert self._prophet is not None
        a, b = self._prophet.models()
        c = self._prophet.coefficient()
        with np.errstate(invalid="ignore"):
            known = np.isfinite(a) & (a > 0) & (a < _MAX_SLOPE)
        if not known.any():
            return ScheduleRule(np.ones(self.world), np.zeros(self.world), cap=self._caps(),
                                pivot=self.pivot, quadratic=c)
        b = np.where(np.isfinite(b) & (b >= 0), b, 0.0)
        a = np.where(known, a, float(np.mean(a[known])))
        b = np.where(known, b, float(np.mean(b[known])))
        return ScheduleRule(a, b, cap=self._caps(), pivot=self.pivot, quadratic=c)

    def _caps(self) -> Optional[np.ndarray]:
        return None if self.cap is None else np.broadcast_to(np.asarray(self.cap, np.float64), (self.world,))

    def decide(self, history: History) -> ScheduleRule:
        """Feed the records since the previous decision (one, or a block's with
        ``exchange_every > 1``) to the prophet and return the next step's rule."""
        if self._prophet is None:
            raise RuntimeError("Chronica: call start(ctx) (or load_state_dict) before decide")
        if len(history) == 0:
            raise ValueError("Chronica.decide: empty history (decide is called after a step)")
        rec = history[-1]
        if rec.world != self.world:
            raise ValueError(f"Chronica.decide: record has {rec.world} ranks, policy was started "
                             f"with world={self.world}")
        require_progress(rec, self.name)
        # With exchange_every=k the prophet learns from every record of the block (its least
        # squares and its forgetting are per step), not from the newest alone.
        new = records_after(history, self.last_step)
        for r in new:
            if self.usable(r):
                # Without sample sizes every sample counts 1, so the squares sum to the count.
                self._prophet.update(r.data, r.compute, _squares(r))
        self.last_step = int(rec.step)
        rule = self._rule()
        if self.hold > 0:
            # Compared at the newest step's work and, after a block, at the block's mean work
            # too: two rules that trade slope for intercept agree at one total only.
            points = [(rec.data, _squares(rec))]
            if len(new) > 1:
                points.append((np.mean([r.data for r in new], axis=0),
                               np.mean([_squares(r) for r in new], axis=0)))
            if self._held is not None and \
                    all(_close(self._held, rule, d, q, self.hold) for d, q in points):
                return self._held
            self._held = rule
        return rule

    def state_dict(self) -> Dict[str, Any]:
        if self._prophet is None:
            raise RuntimeError("Chronica.state_dict(): the policy has not started (its state is "
                               "made by start(ctx), which the Balancer calls at its first step)")
        return {"forget": self.forget, "pivot": self.pivot, "cap": self.cap,
                "quadratic": self.quadratic, "world": self.world,
                "global_batch": self.global_batch, "last_step": self.last_step,
                "hold": self.hold,
                "held": None if self._held is None else self._held.to_dict(),
                "prophet": self._prophet.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output. A policy already started refuses the state of
        another global batch (``ValueError`` naming ``global_batch``): its decisions are for
        that batch. (Another world size is the Balancer's to handle: it restarts the policy.)"""
        state = check_state(state, self.name, ("forget", "world", "global_batch", "prophet"))
        started = self._prophet is not None and hasattr(self, "global_batch")
        gb = integer(state["global_batch"], "Chronica state: global_batch", 1)
        if started and gb != self.global_batch:
            raise ValueError(f"Chronica.load_state_dict: the state's global_batch={gb} differs from "
                             f"this policy's global_batch={self.global_batch}; a checkpoint "
                             f"resumes only with the global batch it was saved with")
        try:
            forget = number(state["forget"], "Chronica state: forget", above=0.0, maximum=1.0)
            world = integer(state["world"], "Chronica state: world", 1)
            prophet = RuntimeProphet(world, forget, check_quadratic(state.get("quadratic", 0.0),
                                                                    "Chronica state"))
            prophet.load_state_dict(state["prophet"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"Chronica.load_state_dict: malformed prophet state ({e!r})") from None
        last_step = optional_integer(state.get("last_step"), "Chronica state: last_step", 0)
        pivot = flag(state.get("pivot", True), "Chronica state: pivot")
        cap = _check_cap(state.get("cap"), prophet.quadratic, "Chronica state")
        # `hold` is this policy's (as constructed), not the checkpoint's: resuming with another
        # hold is how a user turns it on or off. The held rule is kept only under the same hold.
        saved_hold = number(state.get("hold", 0.0), "Chronica state: hold", minimum=0.0, below=1.0)
        held = state.get("held")
        if held is not None:
            try:
                held = ScheduleRule.from_dict(held)
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"Chronica.load_state_dict: malformed held rule ({e!r})") from None
            if len(held.slope) != world:
                raise ValueError(f"Chronica.load_state_dict: the held rule has {len(held.slope)} "
                                 f"ranks, the state's world is {world}")
        self.forget, self.world, self.global_batch = forget, world, gb
        # Otherwise (another hold, or a state saved before `hold` existed) the next refit is held.
        self._held = held if self.hold > 0 and saved_hold == self.hold else None
        self.pivot = pivot
        self.cap = cap
        self.last_step = last_step
        self.quadratic = prophet.quadratic
        self._prophet = prophet
