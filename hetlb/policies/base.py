"""The policy kit shared by every policy, the trainer (``hetlb.Balancer``) and the simulator.

A policy is a pure function of the telemetry history plus its own state: ``start(ctx)`` gives the
sizes of the first step, ``decide(history)`` the sizes of the next one. It never touches the
network, so every rank computes the same decision from the same table. Records reach a policy
through a :class:`hetlb.core.telemetry.History`, which refuses structurally unusable ones (one place
for that check); a policy checks only what values *mean* to it (``+inf`` compute: a rank that made
no progress, which only WLBS acts on).

The kit: :class:`Context` (what a policy knows up front), :class:`Policy` (the protocol),
:class:`SizedPolicy` (bounds, the latest decision, "did this record run it", equal and
proportional splits), :class:`EpochMeter` (per-epoch speeds, for DBS and WLBS), and the checks and
state conversions the Balancer applies to every policy.
"""
from __future__ import annotations

import copy
import math
import inspect
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch

from hetlb.core.checks import integer, optional_integer
from hetlb.core.decisions import ScheduleRule
from hetlb.core.models import PiecewiseModel, TimeModel, lesser_model, micro_step_model
from hetlb.core.solve import allocate_proportional
from hetlb.core.telemetry import History, StepRecord, require_progress


__all__ = ["Context", "Policy", "SizedPolicy", "EpochMeter", "EpochPolicy", "check_sizes",
           "check_decision", "check_state", "to_state", "from_state", "plain_value",
           "policy_settings", "check_same_policy"]


#: Most ranks a :class:`Context` describes (far beyond any data-parallel job; a larger world is
#: a wrong value, and would allocate per-rank arrays of that length).
MAX_WORLD = 1 << 20


@dataclass
class Context:
    """What a policy knows before the first step.

    Every field is checked on construction (``ValueError`` naming it): ``world`` an integer in
    ``[1, MAX_WORLD]``, ``global_batch`` an integer >= 1, the bounds integers >= 0 (one, or one
    per rank) with ``lower <= upper`` and ``sum(lower) <= global_batch <= sum(upper)``.

    Attributes:
        world: number of ranks.
        global_batch: samples per step over all ranks (``sum(sizes) == global_batch``).
        lower, upper: int64 ``[world]`` bounds on each rank's batch (``upper`` from memory
            limits, e.g. ``Profile.limit`` when profiling ran out of memory).
        hardware: per rank, the dict of :func:`hetlb.comm.probes.hardware_info` (may be empty).
        profiles: per rank, ``None`` or a dict with ``"model"`` (fitted cubic
            :class:`~hetlb.TimeModel`), ``"linear"`` (fitted :class:`~hetlb.LinearModel`) and
            ``"limit"`` (largest batch that was tried and fit).
        micro_batch: per rank, ``None`` or its largest micro-batch (``Balancer(micro_batch=)``):
            a larger batch runs as several micro-steps, and :meth:`models` gives that rank the
            time of them (:func:`hetlb.core.models.micro_step_model`).
        recompute: per rank, ``None`` or what recomputing costs it (``Balancer(recompute=)``):
            a dict with ``"model"`` and ``"linear"`` (fitted on a profile taken recomputing)
            and ``"micro_batch"`` (its largest micro-batch recomputing). Such a rank also has a
            ``micro_batch`` and a profile; it runs each share the faster way
            (:meth:`recomputes`), and :meth:`models` gives it the lesser of the two times.
    """

    world: int
    global_batch: int
    lower: np.ndarray
    upper: np.ndarray
    hardware: List[Dict[str, float]] = field(default_factory=list)
    profiles: List[Optional[Dict[str, Any]]] = field(default_factory=list)
    micro_batch: List[Optional[int]] = field(default_factory=list)
    recompute: List[Optional[Dict[str, Any]]] = field(default_factory=list)
    #: Per (rank, profile kind), a recomputing rank's plain and recomputing micro-step models.
    _ways: Dict[Tuple[int, str], Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.world = integer(self.world, "Context: world", 1)
        if self.world > MAX_WORLD:
            raise ValueError(f"Context: world must be <= {MAX_WORLD} ranks, got {self.world}")
        self.global_batch = integer(self.global_batch, "Context: global_batch", 1)
        self.lower = _bounds(self.lower, "lower", self.world)
        self.upper = _bounds(self.upper, "upper", self.world)
        # Sums in float64 (exact to 2^53) and upper capped at the global batch: no int64 overflow.
        lo = float(self.lower.sum(dtype=np.float64))
        hi = float(np.minimum(self.upper, self.global_batch).sum(dtype=np.float64))
        if self.global_batch < lo:
            raise ValueError(f"global_batch={self.global_batch} is smaller than the sum of the lower "
                             f"bounds {lo:.0f} over {self.world} ranks (lower={_short(self.lower)}); "
                             f"every rank needs at least its lower bound of samples per step")
        if hi < self.global_batch:
            raise ValueError(f"global_batch={self.global_batch} exceeds the sum of upper bounds "
                             f"{hi:.0f} (upper={_short(self.upper)}: the upper= given, or a "
                             f"profile's limit where it ran out of memory); the ranks cannot "
                             f"hold the global batch")
        if np.any(self.lower > self.upper):
            raise ValueError(f"Context: lower {_short(self.lower)} exceeds upper {_short(self.upper)} "
                             f"(each rank's lower bound must be <= its upper bound)")
        if not self.profiles:
            self.profiles = [None] * self.world
        if not self.hardware:
            self.hardware = [{} for _ in range(self.world)]
        if not self.micro_batch:
            self.micro_batch = [None] * self.world
        if not self.recompute:
            self.recompute = [None] * self.world
        for name in ("profiles", "hardware", "micro_batch", "recompute"):
            v = getattr(self, name)
            if not isinstance(v, (list, tuple)) or len(v) != self.world:
                raise ValueError(f"Context: {name} must be a list of one entry per rank "
                                 f"({self.world}), got {v!r}")
        self.micro_batch = [optional_integer(m, "Context: micro_batch", 1)
                            for m in self.micro_batch]
        for r, rc in enumerate(self.recompute):
            if rc is None:
                continue
            if not isinstance(rc, dict) or any(k not in rc for k in ("model", "linear", "micro_batch")):
                raise ValueError(f"Context: recompute[{r}] must be None or a dict with 'model', "
                                 f"'linear' and 'micro_batch', got {rc!r}")
            if self.micro_batch[r] is None or self.profiles[r] is None:
                raise ValueError(f"Context: rank {r} recomputes but has no "
                                 f"{'micro_batch' if self.micro_batch[r] is None else 'profile'}: "
                                 f"it chooses between its two ways from both")
            integer(rc["micro_batch"], f"Context: recompute[{r}]['micro_batch']", 1)
            if not all(isinstance(rc[k], TimeModel) for k in ("model", "linear")):
                raise ValueError(f"Context: recompute[{r}]'s 'model' and 'linear' must be hetlb "
                                 f"time models, got {rc!r}")

    @classmethod
    def simple(cls, world: int, global_batch: int, lower: int = 1,
               upper: Optional[int] = None, **kw: Any) -> "Context":
        """A context with the same bounds on every rank (``upper`` defaults to ``global_batch``)."""
        world = integer(world, "Context: world", 1)
        return cls(world, global_batch, np.full(world, integer(lower, "Context: lower", 0)),
                   np.full(world, integer(global_batch if upper is None else upper,
                                          "Context: upper", 0)), **kw)

    def models(self, kind: str = "model") -> Optional[List[TimeModel]]:
        """The profiled models of every rank, or None unless every rank has one; a rank with a
        ``micro_batch`` gets the time of its micro-steps, a recomputing rank the lesser of its
        plain and its recomputing micro-steps' times."""
        if any(p is None or kind not in p for p in self.profiles):
            return None
        out: List[TimeModel] = []
        for r, (p, m, rc) in enumerate(zip(self.profiles, self.micro_batch, self.recompute)):
            if m is None:
                out.append(p[kind])
            elif rc is None:
                out.append(micro_step_model(p[kind], m, self.global_batch))
            else:
                plain, again = self.two_ways(r, kind)
                out.append(lesser_model(plain, again, self._ways[(r, kind)][2]))
        return out

    def two_ways(self, rank: int, kind: str = "model") -> Tuple[PiecewiseModel, PiecewiseModel]:
        """A recomputing rank's plain and recomputing micro-step models (of profile ``kind``)."""
        key = (rank, kind)
        if key not in self._ways:
            rc = self.recompute[rank]
            plain = micro_step_model(self.profiles[rank][kind], self.micro_batch[rank],
                                     self.global_batch)
            again = micro_step_model(rc[kind], int(rc["micro_batch"]), self.global_batch)
            self._ways[key] = (plain, again, np.concatenate([plain.batch_sizes, again.batch_sizes]))
        return self._ways[key][:2]

    def recomputes(self, rank: int, b: int) -> bool:
        """Whether ``rank`` runs a share of ``b`` samples recomputing: where its recomputing
        micro-steps' time (profile kind "model") is less than its plain ones'. Ties run plain."""
        if self.recompute[rank] is None:
            return False
        plain, again = self.two_ways(rank)
        return bool(again.time(b) < plain.time(b))

    def micro_limit(self, rank: int, b: int) -> Optional[int]:
        """The largest micro-batch ``rank`` runs a share of ``b`` samples in (None: one pass)."""
        if self.recomputes(rank, b):
            return int(self.recompute[rank]["micro_batch"])
        return self.micro_batch[rank]


def _short(a: np.ndarray) -> str:
    """A per-rank array for a message, cut after 16 ranks."""
    v = a.tolist()
    return str(v) if len(v) <= 16 else f"{str(v[:16])[:-1]}, ... ({len(v)} ranks)]"


def _bounds(value: Any, name: str, world: int) -> np.ndarray:
    """Per-rank int64 bounds from one integer or one per rank; each >= 0."""
    a = np.asarray(value)
    if a.dtype.kind == "f" and np.all(np.abs(a) < 2.0 ** 63) and np.all(a == np.round(a)):
        a = a.astype(np.int64)  # (a float of 2**63 or more would wrap around to a negative)
    if a.dtype.kind not in "iu" or a.ndim > 1 or (a.ndim == 1 and a.shape[0] != world):
        raise ValueError(f"Context: {name} must be an integer >= 0 or {world} of them (one per "
                         f"rank), got {value!r}")
    if a.dtype.kind == "u" and (a > np.iinfo(np.int64).max).any():
        raise ValueError(f"Context: {name} must be below 2**63, got {value!r}")
    a = np.broadcast_to(a.astype(np.int64), (world,)).copy()
    if (a < 0).any():
        raise ValueError(f"Context: {name} must be >= 0 on every rank, got {_short(a)}")
    return a


def records_after(history: History, last_step: Optional[int]) -> List[StepRecord]:
    """Records after step ``last_step`` (the latest one already consumed), oldest first; the
    latest alone when ``last_step`` is None (nothing consumed yet, or a state saved before it was
    kept: earlier records may be another world's or counted already) or when the history was
    replaced (its steps restart below ``last_step``). With ``exchange_every=k`` a decision follows
    up to ``k`` new records, and a policy that counts records must count every one."""
    if len(history) == 0:
        return []
    if last_step is None or history[-1].step < last_step:
        return [history[-1]]
    out = []
    for i in range(len(history) - 1, -1, -1):
        r = history[i]
        if r.step <= last_step:
            break
        out.append(r)
    return out[::-1]


def check_state(state: Any, who: str, required: Any = ()) -> Dict[str, Any]:
    """A policy state to load: a mapping holding ``required`` keys, else ``TypeError`` /
    ``ValueError`` naming what is missing."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{who}.load_state_dict: state must be a dict (from state_dict()), got "
                        f"{type(state).__name__}")
    missing = [k for k in required if k not in state]
    if missing:
        raise ValueError(f"{who}.load_state_dict: the state lacks {missing}; expected the output "
                         f"of {who}.state_dict()")
    return dict(state)


def state_kind_error(current: Any, value: Any) -> Optional[str]:
    """What a state value must be to replace ``current`` (the attribute it restores), or None when
    ``value`` fits: numbers for numbers, a bool for a bool, a string for a string, numbers in an
    array for an array, a list for a list, a dict for a dict. ``None`` on either side fits (an
    optional value, or one not set yet); other kinds are the policy's own to check."""
    if current is None or value is None:
        return None
    boolean = (bool, np.bool_)
    if isinstance(current, boolean):
        return None if isinstance(value, boolean) else "True or False"
    if isinstance(current, numbers.Real):  # an int attribute may hold a float later, and back
        return None if isinstance(value, numbers.Real) and not isinstance(value, boolean) else "a number"
    if isinstance(current, str):
        return None if isinstance(value, str) else "a string"
    if isinstance(current, np.ndarray):
        if isinstance(value, (np.ndarray, list, tuple, torch.Tensor)):
            try:
                kind = np.asarray(value).dtype.kind
            except (ValueError, TypeError, RuntimeError):
                kind = "O"
            if kind in "biuf":
                return None
        return "an array of numbers"
    if isinstance(current, (list, tuple)):
        return None if isinstance(value, (list, tuple)) else "a list"
    if isinstance(current, Mapping):
        return None if isinstance(value, Mapping) else "a dict"
    return None


def list_items_error(kind: type, value: Any) -> Optional[str]:
    """What a list state value must be when its items must be of ``kind`` (``int``: integers, not
    bools; ``str``: strings), or None when every item is."""
    if kind is int:
        ok = all(isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_)) for x in value)
        return None if ok else "a list of integers"
    return None if all(isinstance(x, kind) for x in value) else f"a list of {kind.__name__}"


def plain_value(value: Any) -> Any:
    """``value`` as plain Python values that compare by value across processes."""
    if isinstance(value, (np.generic, np.ndarray)):  # first: np.float64 is a float
        return value.tolist()
    if value is None or isinstance(value, (bool, str, int, float)):
        return value
    if isinstance(value, Mapping):
        return {str(k): plain_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    for method in ("settings", "config", "_config"):
        f = getattr(value, method, None)
        if callable(f):
            return {"type": type(value).__name__, **plain_value(f())}
    return {"type": type(value).__name__}


def policy_settings(policy: Any) -> Dict[str, Any]:
    """``policy.settings()`` in plain values (none for a duck-typed policy without it): what
    ranks compare at start-up and checkpoints record."""
    f = getattr(policy, "settings", None)
    return plain_value(dict(f())) if callable(f) else {}


def check_same_policy(policy: Any, state: Mapping[str, Any], who: str, hint: str = "") -> None:
    """Raise ``ValueError`` unless the checkpoint ``state`` (its ``policy_type`` and
    ``policy_settings``) comes from a policy of ``policy``'s class and settings, less those the
    policy's :attr:`Policy.resume_free` names: its state would replace the settings given now.
    A checkpoint written before these were recorded is not checked."""
    mine, theirs = type(policy).__name__, state.get("policy_type")
    if theirs is not None and theirs != mine:
        raise ValueError(f"the checkpoint holds the state of a {theirs} policy, {who} runs "
                         f"{mine}: resume with {theirs}(...){hint}")
    saved = state.get("policy_settings")
    if not isinstance(saved, Mapping):
        return
    free = tuple(getattr(policy, "resume_free", ()))
    saved = {k: v for k, v in saved.items() if k not in free}
    now = {k: v for k, v in policy_settings(policy).items() if k not in free}
    # A setting newer than the checkpoint matches when it holds its default (the behaviour the
    # checkpoint's run had).
    try:
        params = inspect.signature(type(policy).__init__).parameters
    except (TypeError, ValueError):
        params = {}
    for k in [k for k in now if k not in saved and k in params]:
        default = params[k].default
        if default is not inspect.Parameter.empty and now[k] == plain_value(default):
            del now[k]
    if saved != now:
        diff = [k for k in list(now) + [k for k in saved if k not in now]
                if saved.get(k) != now.get(k)]
        raise ValueError(f"the checkpoint's {mine} policy has "
                         + ", ".join(f"{k}={saved.get(k)!r}" for k in diff)
                         + ", this one " + ", ".join(f"{k}={now.get(k)!r}" for k in diff)
                         + f": its state would replace these settings{hint}")


class Policy:
    """Base class. Subclasses implement :meth:`start` and :meth:`decide`.

    State lives on the instance (never at module level) and round-trips through
    :meth:`state_dict` / :meth:`load_state_dict`, so a resumed run decides exactly as before.
    """

    #: Short name for logs and benchmark tables.
    name: str = "policy"

    #: Fields that may hold None (optional, or not set until used), each with a value of the kind
    #: it holds otherwise: :meth:`load_state_dict` checks a state's value against it when the
    #: policy itself holds None there.
    _optional_kinds: Dict[str, Any] = {}

    #: Fields holding lists, each with the kind of its items (``int`` or ``str``):
    #: :meth:`load_state_dict` checks every item, so a corrupt list is refused at the load rather
    #: than silently never matching later (e.g. LBB's ``waiting`` sizes).
    _list_items: Dict[str, type] = {}

    #: Whether the policy acts on ``+inf`` compute (a rank that made no progress); others refuse
    #: such a record (the Balancer then keeps the previous sizes and counts the step as bad).
    accepts_no_progress = False

    #: Whether :meth:`decide` depends on the telemetry it is given. A policy whose decision never
    #: does (:class:`~hetlb.Uniform`, the SSGD split) sets False: the Balancer then exchanges the
    #: telemetry in adaptive blocks by default (``Balancer(exchange_every=None)``), which changes
    #: none of its decisions and saves the per-step exchange. (A subclass of ``Uniform`` with a
    #: ``decide`` of its own reads it again unless it sets this False itself.)
    reads_telemetry = True

    def usable(self, rec: StepRecord) -> bool:
        """Whether the policy acts on ``rec`` (it refuses the others as the newest record): of
        its world size, with progress on every rank unless :attr:`accepts_no_progress`, and then
        on one rank at least. Earlier records of a block are filtered with it, so a record
        refused as the newest is not counted later."""
        if rec.world != getattr(self, "world", rec.world):
            return False
        stuck = np.isinf(rec.compute)
        return not stuck.all() if self.accepts_no_progress else not stuck.any()

    def start(self, ctx: Context) -> np.ndarray:
        """Remember ``ctx`` and return the int64 sizes of the first step."""
        raise NotImplementedError

    def decide(self, history: History) -> Any:
        """The decision for the next step from the history (latest record last): int64 sizes,
        or a :class:`hetlb.core.decisions.ScheduleRule` for size-aware scheduling."""
        raise NotImplementedError

    def local_predictor(self, rank: int) -> Any:
        """A per-rank component the trainer runs on ``rank`` (it observes that rank's records and
        publishes a value in the rank's telemetry row, e.g. LB-BSP's NARX speed prediction), or
        None. The policy reads only the published values, so it stays a function of the table."""
        return None

    #: Settings that :meth:`load_state_dict` does not restore (the instance's own stay), so a
    #: resume may change them; the Balancer's checkpoint check leaves them out.
    resume_free: Tuple[str, ...] = ()

    def settings(self) -> Dict[str, Any]:
        """The constructor's arguments as this policy holds them, in plain values (a predictor
        or other object as its type name and configuration). The Balancer compares them across
        ranks at start-up (ranks with different settings would decide differently and fail only
        later, with a :class:`hetlb.DecisionMismatchError`) and with a checkpoint's at a resume.
        The attributes named after the arguments must therefore hold the settings, unchanged by
        training; a subclass that stores them otherwise overrides this."""
        out: Dict[str, Any] = {}
        for name, p in inspect.signature(type(self).__init__).parameters.items():
            if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            if name in vars(self):
                out[name] = plain_value(getattr(self, name))
        return out

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to continue deciding identically (public attributes)."""
        return {k: copy.deepcopy(v) for k, v in vars(self).items() if not k.startswith("_")}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output. Raises ``ValueError`` naming the field when a value
        is not of the kind the policy holds there (:func:`state_kind_error`), before anything is
        changed: a corrupt or foreign state must not surface later as an obscure error mid-step."""
        state = check_state(state, self.name)
        reference = self._kinds_of(state)
        for k, v in state.items():
            current = getattr(reference, k, None)
            want = state_kind_error(self._optional_kinds.get(k) if current is None else current, v)
            if want is None and k in self._list_items and isinstance(v, (list, tuple)):
                want = list_items_error(self._list_items[k], v)
            if want is not None:
                raise ValueError(f"{self.name}.load_state_dict: {k} must be {want} (as this "
                                 f"policy holds it), got {type(v).__name__} {v!r:.80}")
        for k, v in state.items():
            setattr(self, k, copy.deepcopy(v))

    def _kinds_of(self, state: Dict[str, Any]) -> Any:
        """The object whose attributes show the kind of each state value (see
        :meth:`load_state_dict`): this policy itself."""
        return self


class SizedPolicy(Policy):
    """Base of the policies that decide per-rank sizes: the bounds and the latest decision, kept as
    public state so :meth:`state_dict` carries them and a restored instance decides without
    :meth:`start`; helpers for the latest record, the lag rule and the common splits.

    ``last`` is the policy's latest decision, the base of every incremental move (read-only
    once emitted: moves work on a copy).
    """

    #: Each rank's largest micro-batch, 0 for none (set by :meth:`_setup`; none before).
    _micro: Optional[np.ndarray] = None

    #: The start-up context where a rank may recompute (its limit then depends on its share);
    #: configuration, like ``_micro``.
    _choices: Optional[Context] = None

    def micro_batches(self) -> np.ndarray:
        """Each rank's largest micro-batch (``Context.micro_batch``; 0: none), int64 ``[world]``."""
        return self._micro if self._micro is not None else np.zeros(self.world, np.int64)

    def micro_limits(self, b: np.ndarray) -> np.ndarray:
        """Each rank's largest micro-batch for shares ``b`` (0: none): a rank that may recompute
        runs a share in micro-batches of the way it takes for it (:meth:`Context.micro_limit`)."""
        if self._choices is None:
            return self.micro_batches()
        return np.array([self._choices.micro_limit(r, int(b[r])) or 0 for r in range(self.world)],
                        np.int64)

    def recomputing_models(self, measured: StepRecord) -> Dict[int, TimeModel]:
        """For each rank that may recompute and ran ``measured``'s step, the lesser of its two
        ways' micro-step models, both scaled by the measured time over the predicted time of the
        way it ran (so a rough model keeps the choice the rank makes at every share)."""
        ctx, out = self._choices, {}
        if ctx is None:
            return out
        for r in range(self.world):
            b, t = int(measured.batch[r]), float(measured.compute[r])
            if ctx.recompute[r] is None or b <= 0 or not math.isfinite(t) or t <= 0:
                continue
            plain, again = ctx.two_ways(r)
            ran = float((again if ctx.recomputes(r, b) else plain).time(b))
            f = t / ran if ran > 0 else 1.0
            out[r] = lesser_model(PiecewiseModel(plain.batch_sizes, f * plain.times),
                                  PiecewiseModel(again.batch_sizes, f * again.times),
                                  np.concatenate([plain.batch_sizes, again.batch_sizes]))
        return out

    def _setup(self, ctx: Context) -> None:
        if not isinstance(ctx, Context):
            raise ValueError(f"{self.name}.start expects a hetlb Context, got {type(ctx).__name__}")
        self._ctx: Optional[Context] = ctx
        self.world = int(ctx.world)
        self.global_batch = int(ctx.global_batch)
        self.lower = ctx.lower.copy()
        self.upper = ctx.upper.copy()
        self.last = np.zeros(self.world, np.int64)
        #: Each rank's largest micro-batch (0: none); configuration, not state (the start-up's).
        self._micro = np.array([m or 0 for m in ctx.micro_batch], np.int64)
        self._choices = ctx if any(rc is not None for rc in ctx.recompute) else None

    def _context(self) -> Context:
        """The context for :func:`check_sizes`; rebuilt from state after a restore."""
        ctx = getattr(self, "_ctx", None)
        if ctx is None:
            if not hasattr(self, "world"):
                raise RuntimeError(f"{self.name}: call start(ctx) (or load_state_dict) before decide")
            ctx = Context(self.world, self.global_batch, self.lower, self.upper)
            self._ctx = ctx
        return ctx

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore the state; the cached context is rebuilt from the restored bounds.

        Raises ``ValueError`` naming the field when the state's ``world``, ``global_batch`` and
        bounds do not make a valid :class:`Context`, and, for a policy already started, when its
        ``global_batch`` differs from the policy's (a checkpoint of another global batch; another
        world size is handled by the Balancer, which restarts the policy instead of loading)."""
        state = check_state(state, self.name)
        if "world" in state:
            missing = [k for k in ("global_batch", "lower", "upper", "last") if k not in state]
            if missing:
                raise ValueError(f"{self.name}.load_state_dict: the state lacks {missing}")
            ctx = Context(state["world"], state["global_batch"], state["lower"], state["upper"])
            if hasattr(self, "global_batch") and ctx.global_batch != self.global_batch:
                raise ValueError(f"{self.name}.load_state_dict: the state's global_batch="
                                 f"{ctx.global_batch} differs from this policy's global_batch="
                                 f"{self.global_batch}; a checkpoint resumes only with the global "
                                 f"batch it was saved with")
            try:
                check_sizes(np.asarray(state["last"]), ctx, "the state's last decision")
            except ValueError as e:
                raise ValueError(f"{self.name}.load_state_dict: {e}") from None
        super().load_state_dict(state)
        self._ctx = None

    def _kinds_of(self, state: Dict[str, Any]) -> Any:
        """A policy not started yet holds few of the state's values: a copy of it started with the
        state's context shows their kinds (start is pure: it only reads the context)."""
        if hasattr(self, "world") or "world" not in state:
            return self
        scratch = copy.deepcopy(self)
        try:
            scratch.start(Context(state["world"], state["global_batch"], state["lower"], state["upper"]))
        except Exception:  # noqa: BLE001 (a start that needs more context: check what is known)
            return self
        return scratch

    def latest(self, history: History) -> StepRecord:
        """The latest record, of the right world size and (unless :attr:`accepts_no_progress`)
        with progress on every rank."""
        self._context()
        if len(history) == 0:
            raise ValueError(f"{self.name}.decide: empty history (decide is called after a step)")
        rec = history[-1]
        if rec.world != self.world:
            raise ValueError(f"{self.name}.decide: record has {rec.world} ranks, policy was "
                             f"started with world={self.world}")
        if not self.accepts_no_progress:
            require_progress(rec, self.name)
        return rec

    def ran_latest(self, rec: StepRecord) -> bool:
        """Whether ``rec`` ran this policy's latest decision. A decision can reach the ranks a few
        steps late (the loader's prefetch); incremental moves act only on records that ran it."""
        return bool(np.array_equal(rec.batch, self.last))

    def emit(self, sizes: Any) -> np.ndarray:
        """Check a decision against the bounds, remember it as ``last`` and return a copy."""
        if sizes is self.last and getattr(self, "_checked", None) is sizes:
            return sizes.copy()  # unchanged, and checked when it was emitted (the common case)
        s = check_sizes(np.asarray(sizes, dtype=np.int64), self._context(), self.name)
        self.last = s.copy()
        self.last.flags.writeable = False  # so the check above stays true of it: copy to change
        self._checked = self.last
        return s.copy()

    def uniform(self) -> np.ndarray:
        """Equal split within the bounds, remainder to the lowest ranks."""
        return allocate_proportional(np.ones(self.world), self.global_batch, self.lower, self.upper)

    def proportional(self, speeds: np.ndarray) -> np.ndarray:
        """Sizes proportional to ``speeds`` (samples/s) within the bounds."""
        return allocate_proportional(np.asarray(speeds, np.float64), self.global_batch,
                                     self.lower, self.upper)


class EpochMeter:
    """Per-rank samples and compute seconds summed over the records of one epoch.

    :meth:`add` returns the finished epoch's totals when a record closes it: a record marked
    ``epoch_end`` (the trainer knows the epoch's last step), the first record of a later epoch,
    or, with ``steps_per_epoch``, a record whose step completes a multiple of it.
    """

    def __init__(self, world: int, steps_per_epoch: Optional[int] = None) -> None:
        self.world = int(world)
        self.steps_per_epoch = steps_per_epoch
        self.last_step: Optional[int] = None  # step of the latest record add_new has seen
        self.reset(-1)

    def reset(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.steps = 0
        self.samples = np.zeros(self.world)
        self.time = np.zeros(self.world)

    def add_new(self, history: History, usable: Callable[[StepRecord], bool]) -> Optional[Dict[str, Any]]:
        """:meth:`add` every record of ``history`` after the latest one seen (a block of them
        with ``exchange_every > 1``) that ``usable`` accepts (the policy's own test: a record it
        refused when it was the newest must not count later); the totals of the latest epoch
        they closed, if any."""
        closed = None
        for rec in records_after(history, self.last_step):
            if usable(rec):
                closed = self.add(rec) or closed
            self.last_step = int(rec.step)
        return closed

    def add(self, rec: StepRecord) -> Optional[Dict[str, Any]]:
        """Count ``rec``; the totals of the epoch it closed, if any (then the meter restarts)."""
        closed = None
        if self.steps and rec.epoch != self.epoch:
            closed = self._close()  # the previous epoch ended without its last step being known
        if not self.steps:
            self.epoch = int(rec.epoch)
        self.steps += 1
        self.samples = self.samples + rec.batch
        self.time = self.time + rec.compute
        spe = self.steps_per_epoch
        if rec.epoch_end or (spe is not None and (rec.step + 1) % spe == 0):
            closed = self._close()  # (an epoch of one step closes right after the previous one)
            self.epoch = int(rec.epoch) + 1
        return closed

    def _close(self) -> Dict[str, Any]:
        out = {"epoch": self.epoch, "steps": self.steps, "samples": self.samples, "time": self.time}
        self.reset(self.epoch)
        return out

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "steps": self.steps, "samples": self.samples.tolist(),
                "time": self.time.tolist(), "steps_per_epoch": self.steps_per_epoch,
                "last_step": self.last_step}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; ``ValueError`` naming the field for a value that
        cannot be this meter's (nothing is changed then)."""
        epoch = integer(state["epoch"], "EpochMeter state: epoch", -1)
        steps = integer(state["steps"], "EpochMeter state: steps", 0)
        spe = optional_integer(state.get("steps_per_epoch"), "EpochMeter state: steps_per_epoch", 1)
        last_step = optional_integer(state.get("last_step"), "EpochMeter state: last_step", 0)
        totals = []
        for k in ("samples", "time"):
            try:
                a = np.asarray(state[k], np.float64)
            except (TypeError, ValueError):
                a = None
            # (+inf is a sum over a rank that made no progress, which WLBS acts on)
            if a is None or a.shape != (self.world,) or np.any(np.isnan(a)):
                raise ValueError(f"EpochMeter state: {k} must be {self.world} numbers (one per rank), "
                                 f"got {state[k]!r:.80}")
            totals.append(a)
        self.epoch, self.steps, self.steps_per_epoch = epoch, steps, spe
        self.last_step = last_step
        self.samples, self.time = totals


class EpochPolicy(SizedPolicy):
    """A :class:`SizedPolicy` that also adjusts per epoch (DBS, WLBS): it owns an
    :class:`EpochMeter` (made by :meth:`_start_meter` in ``start``) and checkpoints it with its
    own state. Subclasses set ``steps_per_epoch`` (None: epoch ends come from the records)."""

    steps_per_epoch: Optional[int] = None
    _optional_kinds = {"steps_per_epoch": 0}

    def _start_meter(self) -> None:
        self._meter = EpochMeter(self.world, self.steps_per_epoch)

    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()
        state["meter"] = self._meter.state_dict()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        state = check_state(state, self.name, ("meter",))
        meter = state.pop("meter")
        if not isinstance(meter, Mapping) or any(k not in meter for k in ("epoch", "steps", "samples",
                                                                         "time")):
            raise ValueError(f"{self.name}.load_state_dict: the state's meter must be the dict of "
                             f"EpochMeter.state_dict(), got {meter!r}")
        super().load_state_dict(state)
        self._start_meter()
        self._meter.load_state_dict(meter)


def check_sizes(sizes: Any, ctx: Context, who: str) -> np.ndarray:
    """Validate a policy's sizes against the context; raise ``ValueError`` naming the policy."""
    s = np.asarray(sizes)
    if s.shape != (ctx.world,) or s.dtype.kind not in "iu":
        raise ValueError(f"{who} returned sizes {s!r}; expected {ctx.world} integers")
    s = s.astype(np.int64)
    if int(s.sum()) != ctx.global_batch:
        raise ValueError(f"{who} returned sizes {s.tolist()} summing to {int(s.sum())}, "
                         f"not global_batch={ctx.global_batch}")
    if (s < ctx.lower).any() or (s > ctx.upper).any():
        raise ValueError(f"{who} returned sizes {s.tolist()} outside bounds "
                         f"lower={ctx.lower.tolist()} upper={ctx.upper.tolist()}")
    return s


def check_decision(decision: Any, ctx: Context, who: str) -> Any:
    """:func:`check_sizes` for sizes; a :class:`ScheduleRule` must have one model per rank."""
    if isinstance(decision, ScheduleRule):
        if decision.slope.shape != (ctx.world,):
            raise ValueError(f"{who} returned a ScheduleRule for {decision.slope.shape[0]} ranks; "
                             f"expected {ctx.world}")
        return decision
    return check_sizes(decision, ctx, who)


def to_state(obj: Any) -> Any:
    """``obj`` with NumPy arrays as tensors and NumPy scalars as Python numbers, recursively: what
    ``torch.load(weights_only=True)`` accepts."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj).copy())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: to_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_state(v) for v in obj)
    return obj


def from_state(obj: Any) -> Any:
    """Inverse of :func:`to_state` (tensors back to NumPy arrays)."""
    if isinstance(obj, torch.Tensor):
        return obj.numpy().copy()
    if isinstance(obj, dict):
        return {k: from_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_state(v) for v in obj)
    return obj
