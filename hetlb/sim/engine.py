"""The simulator: a scenario's cluster stepped in virtual time under a real policy object.

Each simulated step is one synchronous (BSP) iteration: every active worker computes its batch,
taking the time its model, speed, load, noise and events say, then the ring all-reduce runs;
the step ends when the slowest worker's gradient has been reduced. The policy sees exactly what
it sees in training: a :class:`hetlb.policies.Context` at start, then one
:class:`hetlb.core.telemetry.StepRecord` per step appended to a :class:`hetlb.core.telemetry.History`,
and its decision takes effect ``scenario.lag`` steps later (0: the next step, as on CPU).
Per-rank predictors (LB-BSP's NARX) run as each rank runs its own and publish their prediction
in the record, as :class:`hetlb.Balancer` does. A worker leaving or joining restarts the policy
on the new world, as a resumed elastic job does.

Noise follows :class:`hetlb.sim.emulate.Emulator`'s form (``time * (1 + noise * u) + jitter * v``,
``u ~ U(-1, 1)``, ``v ~ U(0, 1)``) drawn from one generator per run, so a simulated run is
reproducible from ``scenario.seed`` but does not replay an emulated run's draws one by one.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

import numpy as np

from hetlb.core.decisions import ScheduleRule, decision_checksum
from hetlb.core.exchange import exchange_settings, next_block_length, ships
from hetlb.core.models import LinearModel, PolyModel
from hetlb.core.solve import schedule
from hetlb.core.telemetry import StepRecord, straggler_effect
from hetlb.policies import DBS, LBB, LBBSP, WLBS, Chronica, Uniform
from hetlb.policies.base import Context, Policy
from hetlb.policies.loop import DecisionLoop
from hetlb.sim.scenario import Scenario, load_scenario


__all__ = ["simulate", "SimResult", "make_policy", "unknown_policies", "POLICY_NAMES"]

log = logging.getLogger(__name__)

#: Names :func:`make_policy` (and ``hetlb simulate --policy``) accept.
POLICY_NAMES = ("uniform", "lbb", "lbbsp", "lbbsp-cpu", "wlbs", "dbs", "chronica")


#: Other spellings :func:`make_policy` accepts.
POLICY_ALIASES = ("lbbsp-gpu", "lbb-sp")


def _policy_key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def unknown_policies(names: List[str]) -> List[str]:
    """The names among ``names`` that :func:`make_policy` does not know."""
    return [n for n in names if _policy_key(n) not in POLICY_NAMES + POLICY_ALIASES]


def make_policy(name: str, **kw: Any) -> Policy:
    """A fresh policy with the papers' defaults from its short name (:data:`POLICY_NAMES`)."""
    key = _policy_key(name)
    table = {"uniform": lambda: Uniform(), "lbb": lambda: LBB(**kw),
             "lbbsp": lambda: LBBSP("gpu", **kw), "lbbsp-gpu": lambda: LBBSP("gpu", **kw),
             "lbb-sp": lambda: LBBSP("gpu", **kw), "lbbsp-cpu": lambda: LBBSP("cpu", **kw),
             "wlbs": lambda: WLBS(**kw), "dbs": lambda: DBS(**kw), "chronica": lambda: Chronica(**kw)}
    if key not in table:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
    return table[key]()


@dataclass
class SimResult:
    """What a simulated run did; per-step arrays are over the scenario's declared workers (an
    inactive worker has batch 0 and compute NaN).

    Attributes:
        scenario, policy: names.
        sizes: int64 ``[steps, workers]`` batch of every worker.
        compute: ``[steps, workers]`` seconds of computation (``inf``: a failed worker).
        step_time: ``[steps]`` seconds of each step (slowest compute + exposed all-reduce).
        comm: ``[steps]`` exposed all-reduce seconds.
        se: ``[steps]`` straggler effect (LBB Eq. 4) over the workers with samples.
        restarts: steps at which membership changed and the policy restarted.
        error: why the run stopped early (a worker out of memory), else None; the arrays then
            hold the steps that ran.
        decide_seconds: wall seconds spent in the policy (``start`` and ``decide``).
        wall_seconds: wall seconds of the whole simulation.
        assign_seconds: wall seconds spent assigning samples to ranks for size-aware decisions
            (:func:`hetlb.schedule`, what the loader does on every rank).
        data: ``[steps, workers]`` data amount of every worker (its sample count without sizes).
        exchanges: the steps whose end exchanged the telemetry (every step with
            ``exchange_every=1``).
    """

    scenario: str
    policy: str
    sizes: np.ndarray
    compute: np.ndarray
    step_time: np.ndarray
    comm: np.ndarray
    se: np.ndarray
    restarts: List[int] = field(default_factory=list)
    error: Optional[str] = None
    decide_seconds: float = 0.0
    wall_seconds: float = 0.0
    assign_seconds: float = 0.0
    data: Optional[np.ndarray] = None
    exchanges: List[int] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return int(self.step_time.shape[0])

    @property
    def total_time(self) -> float:
        """Virtual seconds of the whole run."""
        return float(self.step_time.sum())

    def summary(self, tail: float = 0.5) -> Dict[str, Any]:
        """Mean step time and SE over the run and over its last ``tail`` fraction, final sizes,
        and the number of telemetry exchanges."""
        k = max(1, int(round(self.steps * tail))) if self.steps else 0
        return {"scenario": self.scenario, "policy": self.policy, "steps": self.steps,
                "total_time": self.total_time,
                "mean_step": float(self.step_time.mean()) if self.steps else math.nan,
                "tail_step": float(self.step_time[-k:].mean()) if self.steps else math.nan,
                "mean_se": float(self.se.mean()) if self.steps else math.nan,
                "tail_se": float(self.se[-k:].mean()) if self.steps else math.nan,
                "final_sizes": self.sizes[-1].tolist() if self.steps else [],
                "restarts": list(self.restarts), "error": self.error,
                "decide_seconds": self.decide_seconds, "assign_seconds": self.assign_seconds,
                "wall_seconds": self.wall_seconds, "exchanges": len(self.exchanges)}


class _Cluster:
    """Vectorised time models of the declared workers: polynomial ones (linear, poly) as one
    coefficient matrix evaluated by Horner's rule, piecewise ones one by one."""

    def __init__(self, sc: Scenario) -> None:
        ws = sc.workers
        n = len(ws)
        self.n = n
        self.speed = np.array([w.speed for w in ws])
        self.sat = np.array([w.saturation for w in ws])
        self.overhead = np.array([w.overhead for w in ws])
        self.limit = np.array([w.limit if w.limit is not None else np.iinfo(np.int64).max for w in ws], np.int64)
        self.noise = np.array([w.noise for w in ws])
        self.jitter = np.array([w.jitter for w in ws])
        self.memory = np.array([w.memory for w in ws])
        self.cpu = np.array([w.cpu for w in ws])
        self.bandwidth = np.array([w.bandwidth if w.bandwidth is not None else np.nan for w in ws])
        coeffs: List[np.ndarray] = []
        self.piecewise: List[int] = []
        for i, w in enumerate(ws):
            m = w.model
            if isinstance(m, LinearModel):
                coeffs.append(np.array([m.a1, m.a0]))
            elif isinstance(m, PolyModel):
                coeffs.append(np.asarray(m.coeffs, np.float64))
            else:
                coeffs.append(np.zeros(1))
                self.piecewise.append(i)
        deg = max(c.size for c in coeffs)
        self.coeffs = np.zeros((deg, n))  # row 0 = highest degree
        for i, c in enumerate(coeffs):
            self.coeffs[deg - c.size:, i] = c
        self.models = [w.model for w in ws]

    def base(self, idx: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Model seconds of workers ``idx`` at batches ``b`` (saturation applied, no speed)."""
        x = np.maximum(b.astype(np.float64), self.sat[idx])
        c = self.coeffs[:, idx]
        t = c[0].copy()
        for row in c[1:]:
            t *= x
            t += row
        if self.piecewise:
            pos = {w: j for j, w in enumerate(idx.tolist())}
            for w in self.piecewise:
                j = pos.get(w)
                if j is not None:
                    t[j] = float(self.models[w].time(x[j]))
        return np.maximum(t, 0.0)


def _profiles(sc: Scenario, idx: np.ndarray) -> List[Dict[str, Any]]:
    """What LBB's profiling phase (:func:`hetlb.profile`) would measure on each worker: the model
    at powers of two up to the first one that reaches the global batch (noise-free), stopping at
    the first that runs out of memory (``oom_at``, ``limit`` the largest that fit), fitted as the
    Balancer fits a :class:`hetlb.Profile`. Profiles are in samples; with ``work="data"`` a batch
    of ``b`` samples holds ``b`` times the mean size (estimated from the scenario's size
    distribution)."""
    per_sample = 1.0
    if sc.work == "data" and sc.samples is not None:
        per_sample = float(sc.work_of(sc.samples.draw(np.random.default_rng(0), 100_000)).mean())
    tried = [2 ** k for k in range(1, max(1, (sc.global_batch - 1).bit_length()) + 1)]
    out = []
    for w in idx.tolist():
        spec = sc.workers[w]
        fit = [b for b in tried if spec.limit is None or b <= spec.limit] or [1]
        oom_at = next((b for b in tried if spec.limit is not None and b > spec.limit), None)
        bs = list(fit)
        ts = spec.time_model.time(np.array(bs, np.float64) * per_sample)
        if len(bs) == 1:
            bs, ts = bs + [bs[0] + 1], np.append(ts, spec.time_model.time((bs[0] + 1) * per_sample))
        out.append({"model": PolyModel.fit(bs, ts, degree=min(3, len(bs) - 1)),
                    "linear": LinearModel.fit(bs, ts), "limit": int(fit[-1]), "oom_at": oom_at})
    return out


def simulate(scenario: Union[Scenario, str, Dict[str, Any]], policy: Union[Policy, str],
             steps: Optional[int] = None, *, profile: bool = False, seed: Optional[int] = None,
             progress: bool = False, history: Optional[int] = None,
             exchange_every: Optional[int] = None,
             adaptive_exchange: Optional[bool] = None) -> SimResult:
    """Run ``policy`` on ``scenario`` for ``steps`` steps (default ``scenario.steps``).

    Args:
        scenario: a :class:`Scenario`, a built-in name, a JSON/YAML path or a dict.
        policy: a policy object (started here; pass a fresh one) or a name from
            :data:`POLICY_NAMES`.
        profile: give the policy profiled models of every worker, as ``Balancer(profile=...)``
            does after :func:`hetlb.profile` (LBB starts from them; noise-free, powers of two),
            and with them the profiled limits (the largest power of two within a worker's
            ``limit``) as upper bounds. Without profiles no rank's batch is bounded but by the
            global batch, as in training.
        seed: overrides ``scenario.seed``.
        progress: a progress bar over the steps (tqdm's, where it is installed).
        history: records the policy can look back on (the Balancer's ``history`` argument; at
            least ``exchange_every``); None: 64, or ``exchange_every`` if larger.
        exchange_every: the Balancer's ``exchange_every``, with its default (None: 1, or
            adaptive blocks of up to 16 for a policy that reads no telemetry, Uniform): the
            policy sees the records of ``k``
            steps at once (a block also ends at an epoch's end, an epoch's first step is one of its
            own, a block ends at a restart's, and the
            first step after a (re)start is an exchange of its own, as in the Balancer) and
            decides once per block; the sizes are kept in between.
        adaptive_exchange: the Balancer's ``adaptive_exchange``: a block is 1 step after an
            exchange whose decision changed the sizes (or whose newest step was refused), else
            twice the previous, up to ``exchange_every`` (> 1). The CUDA start (the first
            record one step late) is not modelled.

    Returns:
        a :class:`SimResult`. A worker given more than its ``limit`` (possible only without
        ``profile``) stops the run with ``error`` set, as the out-of-memory error would stop
        training; so do profiled limits that cannot hold the global batch (at the start or
        after a membership change), which ``Balancer(profile=...)`` refuses.
    """
    sc = load_scenario(scenario)
    pol = make_policy(policy) if isinstance(policy, str) else policy
    if not isinstance(pol, Policy):
        raise ValueError(f"policy must be a hetlb policy or a name, got {type(pol).__name__}")
    steps = sc.steps if steps is None else int(steps)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    every, adaptive, hist = exchange_settings(getattr(pol, "reads_telemetry", True), exchange_every,
                                              adaptive_exchange, history)
    history = max(64, every) if hist is None else hist
    rng = np.random.default_rng(sc.seed if seed is None else seed)
    # The samples' sizes come from a stream of their own: the same steps whatever the policy.
    size_rng = np.random.default_rng([sc.seed if seed is None else seed, 1])
    assign = 0.0
    cl = _Cluster(sc)
    W = cl.n
    active = np.array([w.active for w in sc.workers])
    speed_f = np.ones(W)
    load = np.zeros(W)
    bw = cl.bandwidth.copy()
    sizes_out = np.zeros((steps, W), np.int64)
    comp_out = np.full((steps, W), np.nan)
    data_out = np.zeros((steps, W))
    step_time = np.zeros(steps)
    comm = np.zeros(steps)
    se = np.zeros(steps)
    restarts: List[int] = []
    spent = 0.0
    t_wall = time.perf_counter()
    # A name given is the label (LBBSP's two modes share the policy's name).
    name = _policy_key(policy) if isinstance(policy, str) else getattr(pol, "name", type(pol).__name__)
    # Events split by whether they change state at their start or apply per step.
    disturb = [e for e in sc.events if e.kind == "disturb"]
    state_ev = sorted([e for e in sc.events if e.kind != "disturb"], key=lambda e: e.start)
    membership = {e.start for e in state_ev if e.kind in ("leave", "join")}

    def start_policy(k: int) -> Optional[str]:
        """(Re)start the policy on the active workers; the error that stops the run, or None."""
        nonlocal idx, loop, pending, spent, block, started, length
        started = k
        length = 1 if adaptive else every
        idx = np.flatnonzero(active)
        n = idx.size
        # As in the Balancer, only a profile that ran out of memory bounds a rank's batch, at the
        # largest size it measured (a power of two: below the worker's true limit).
        profs = _profiles(sc, idx) if profile else []
        upper = np.array([min(p["limit"], sc.global_batch) if p["oom_at"] is not None
                          else sc.global_batch for p in profs] or [sc.global_batch] * n, np.int64)
        if upper.sum() < sc.global_batch:  # Balancer(profile=...) refuses this at construction
            return (f"step {k}: the profiled limits of the {n} active workers (the largest power "
                    f"of two that fit: {upper.tolist()}) hold {int(upper.sum())} samples, fewer "
                    f"than global_batch={sc.global_batch}; Balancer(profile=...) would refuse it")
        ctx = Context(world=n, global_batch=sc.global_batch, lower=np.full(n, sc.lower),
                      upper=upper, hardware=[{} for _ in range(n)], profiles=profs)
        t0 = time.perf_counter()
        loop = DecisionLoop(pol, n, history=history, ranks=range(n), background=False,
                            refusal_level=logging.DEBUG)
        first = loop.start(ctx)
        spent += time.perf_counter() - t0
        block = []  # records not exchanged yet (exchange_every > 1)
        pending = [first] * (sc.lag + 1)
        return None

    idx = np.flatnonzero(active)
    loop: Optional[DecisionLoop] = None
    pending: List[Any] = []
    block: List[StepRecord] = []
    started = 0  # the step the policy (re)started at: an exchange of its own
    length = every  # steps of the current block
    exchanges: List[int] = []
    ev_i = 0
    error: Optional[str] = None
    bar = None
    if progress:
        from hetlb.core.progress import progress_bar
        bar = progress_bar(total=steps, desc=f"simulate {sc.name or 'scenario'} / {name}", unit="step",
                           leave=False, disable=None)
    error = start_policy(0)
    done = 0
    for k in range(steps if error is None else 0):
        changed = False
        while ev_i < len(state_ev) and state_ev[ev_i].start <= k:
            e = state_ev[ev_i]
            ev_i += 1
            if e.kind in ("leave", "join"):
                before = active.copy()
                active[e.workers] = e.kind == "join"
                changed |= not np.array_equal(before, active)
        # A worker's speed, load and link at step k: those of the latest-started event active then
        # (an event ending hands back to one that still runs, not to the default), else the default.
        speed_f[:], load[:], bw[:] = 1.0, 0.0, cl.bandwidth
        for e in state_ev[:ev_i]:
            if e.stop is None or k < e.stop:
                if e.kind == "speed":
                    speed_f[e.workers] = e.speed
                elif e.kind == "load":
                    load[e.workers] = e.load
                elif e.kind == "bandwidth":
                    bw[e.workers] = e.bandwidth
        if changed and k in membership:
            restarts.append(k)
            log.info("step %d: %d workers active, %s restarts", k, int(active.sum()), name)
            error = start_policy(k)
            if error is not None:
                break
        n = idx.size
        dec = pending[0]
        amounts = sc.samples.draw(size_rng, sc.global_batch) if sc.samples is not None else None
        if isinstance(dec, ScheduleRule):  # size-aware: the step's samples by estimated time
            t0 = time.perf_counter()
            owner = schedule(np.ones(sc.global_batch) if amounts is None else dec.work(amounts),
                             dec.slope, dec.intercept, cap=dec.cap,
                             first=dec.first(sc.seed if seed is None else seed, k // sc.steps_per_epoch,
                                             k, sc.global_batch))
            assign += time.perf_counter() - t0
            b = np.bincount(owner, minlength=n).astype(np.int64)
            data = b.astype(np.float64) if amounts is None else np.bincount(owner, amounts, minlength=n)
            sq = None if amounts is None else np.bincount(owner, amounts * amounts, minlength=n)
        else:  # contiguous slices of the step's samples, as the loader cuts them
            b = np.asarray(dec, np.int64)
            if amounts is None:
                data, sq = b.astype(np.float64), None
            else:
                ends = np.cumsum(b)
                csum = np.concatenate([[0.0], np.cumsum(amounts)])
                data = csum[ends] - csum[ends - b]
                csq = np.concatenate([[0.0], np.cumsum(amounts * amounts)])
                sq = csq[ends] - csq[ends - b]
        # a rank's work: its data, plus the quadratic term of its samples (sc.work_of, summed)
        x = (data + sc.quadratic * sq if sc.quadratic else data) if sc.work == "data" else b
        over = np.flatnonzero(b > cl.limit[idx])
        if over.size:
            w = int(idx[over[0]])
            error = (f"step {k}: worker {w} ran out of memory (batch {int(b[over[0]])} > limit "
                     f"{int(cl.limit[w])}) under {name}")
            break
        t = cl.base(idx, x) + cl.overhead[idx]
        t /= cl.speed[idx] * speed_f[idx] * (1.0 - load[idx])
        uv = rng.random((2, n))
        t *= 1.0 + cl.noise[idx] * (2.0 * uv[0] - 1.0)
        t += cl.jitter[idx] * uv[1]
        failed = np.zeros(n, bool)
        for e in disturb:
            if e.active(k):
                sel = np.isin(idx, e.workers)
                t[sel] = t[sel] * e.factor + e.extra
                if e.fail:
                    failed |= sel
        t = np.where(b > 0, t, 0.0)
        # The ring runs at its slowest link; a worker without a link of its own has the network's.
        net = np.inf if sc.network.bandwidth is None else sc.network.bandwidth
        slowest = float(np.where(np.isnan(bw[idx]), net, bw[idx]).min(initial=np.inf))
        c = sc.network.exposed(n, slowest if np.isfinite(slowest) else None)
        step_time[k] = float(t.max()) + c
        comm[k] = c
        reported = np.where(failed, np.inf, t)
        sizes_out[k, idx] = b
        data_out[k, idx] = data
        comp_out[k, idx] = reported
        se[k] = straggler_effect(t, b)
        lim = cl.limit[idx].astype(np.float64)
        mem = cl.memory[idx] + np.where(lim < 2 ** 62, (1.0 - cl.memory[idx]) * b / lim, 0.0)
        rec_mem = np.minimum(mem, 1.0)
        cpu = np.minimum(cl.cpu[idx] + load[idx], 1.0)
        pred = np.full(n, np.nan)
        for r in loop.predictors:
            pred[r] = loop.predict(r, float(rec_mem[r]))
        rec = StepRecord(step=k, epoch=k // sc.steps_per_epoch,
                         epoch_end=(k + 1) % sc.steps_per_epoch == 0, batch=b.copy(),
                         compute=reported, data=data, memory=rec_mem, cpu=cpu,
                         predicted=pred, sq=sq)
        t0 = time.perf_counter()
        block.append(rec)
        nxt = pending[-1]  # inside a block the sizes are kept
        if ships(len(block) - 1, length, restarted=k == started, epoch_last=rec.epoch_end,
                 epoch_first=k % sc.steps_per_epoch == 0):
            exchanges.append(k)
            decided = loop.advance(block)  # None: the previous sizes are kept, as in the Balancer
            block = []
            nxt = pending[-1] if decided is None else decided
            steady = decided is not None and decision_checksum(decided) == decision_checksum(pending[-1])
            if adaptive:
                length = next_block_length(length, steady, every)
        spent += time.perf_counter() - t0
        pending = pending[1:] + [nxt]
        done = k + 1
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return SimResult(scenario=sc.name, policy=name, sizes=sizes_out[:done], compute=comp_out[:done],
                     step_time=step_time[:done], comm=comm[:done], se=se[:done], restarts=restarts,
                     error=error, decide_seconds=spent, assign_seconds=assign,
                     data=data_out[:done], wall_seconds=time.perf_counter() - t_wall,
                     exchanges=exchanges)
