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

A run's state has three owners: the :class:`~hetlb.sim.cluster.Cluster` (the workers, who is
active, the conditions the events set, what a step costs), the policy's side (the decision loop,
the decisions in flight, the block of records not yet exchanged) and the trace (the per-step
arrays of the :class:`SimResult`).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from hetlb.core.decisions import ScheduleRule, decision_checksum
from hetlb.core.exchange import exchange_settings, next_block_length, ships
from hetlb.core.models import LinearModel, PolyModel
from hetlb.core.solve import schedule
from hetlb.core.telemetry import StepRecord, straggler_effect
from hetlb.policies import DBS, LBB, LBBSP, WLBS, Chronica, Uniform
from hetlb.policies.base import Context, Policy
from hetlb.policies.loop import DecisionLoop
from hetlb.sim.cluster import Cluster
from hetlb.sim.scenario import Scenario, load_scenario


__all__ = ["simulate", "SimResult", "make_policy", "policy_key", "unknown_policies", "POLICY_NAMES"]

log = logging.getLogger(__name__)

#: Names :func:`make_policy` (and ``hetlb simulate --policy``) accept.
POLICY_NAMES = ("uniform", "lbb", "lbbsp", "lbbsp-cpu", "wlbs", "dbs", "chronica")


#: Other spellings :func:`make_policy` accepts.
POLICY_ALIASES = ("lbbsp-gpu", "lbb-sp")


def policy_key(name: str) -> str:
    """A policy's short name as :func:`make_policy` looks it up (case and ``_``/``-`` folded)."""
    return name.strip().lower().replace("_", "-")


def unknown_policies(names: List[str]) -> List[str]:
    """The names among ``names`` that :func:`make_policy` does not know."""
    return [n for n in names if policy_key(n) not in POLICY_NAMES + POLICY_ALIASES]


def make_policy(name: str, **kw: Any) -> Policy:
    """A fresh policy with the papers' defaults from its short name (:data:`POLICY_NAMES`)."""
    key = policy_key(name)
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
    every, adaptive, hist = exchange_settings(pol.reads_telemetry, exchange_every,
                                              adaptive_exchange, history)
    seed = sc.seed if seed is None else seed
    rng = np.random.default_rng(seed)
    # The samples' sizes come from a stream of their own: the same steps whatever the policy.
    size_rng = np.random.default_rng([seed, 1])
    t_wall = time.perf_counter()
    # A name given is the label (LBBSP's two modes share the policy's name).
    name = policy_key(policy) if isinstance(policy, str) else pol.name
    cluster = Cluster(sc)
    run = _PolicyRun(sc, pol, profile=profile, every=every, adaptive=adaptive,
                     history=max(64, every) if hist is None else hist)
    trace = _Trace(steps, cluster.models.n)
    bar = None
    if progress:
        from hetlb.core.progress import progress_bar
        bar = progress_bar(total=steps, desc=f"simulate {sc.name or 'scenario'} / {name}", unit="step",
                           leave=False, disable=None)
    error = run.start(0, cluster.active)
    for k in range(steps if error is None else 0):
        if cluster.advance(k):
            trace.restarts.append(k)
            log.info("step %d: %d workers active, %s restarts", k, int(cluster.active.sum()), name)
            error = run.start(k, cluster.active)
            if error is not None:
                break
        error = _step(k, sc, cluster, run, trace, seed, rng, size_rng, name)
        if error is not None:
            break
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return trace.result(sc.name, name, error, run, time.perf_counter() - t_wall)


def _step(k: int, sc: Scenario, cluster: Cluster, run: "_PolicyRun", trace: "_Trace", seed: int,
          rng: np.random.Generator, size_rng: np.random.Generator, name: str) -> Optional[str]:
    """Simulate step ``k``: split the step's samples by the policy's decision, time every
    worker's computation and the all-reduce, record the step, and let the policy decide. The
    error that stops the run (a worker out of memory), or None."""
    idx = run.workers
    amounts = sc.samples.draw(size_rng, sc.global_batch) if sc.samples is not None else None
    b, data, sq = run.split(k, amounts, seed)
    # a rank's work: its data, plus the quadratic term of its samples (sc.work_of, summed)
    x = (data + sc.quadratic * sq if sc.quadratic else data) if sc.work == "data" else b
    over = cluster.out_of_memory(idx, b)
    if over is not None:
        w = int(idx[over])
        return (f"step {k}: worker {w} ran out of memory (batch {int(b[over])} > limit "
                f"{int(cluster.models.limit[w])}) under {name}")
    t, failed = cluster.compute(k, idx, x, b, rng)
    reported = np.where(failed, np.inf, t)
    trace.add(k, idx, b, data, t, reported, cluster.exposed_comm(idx))
    memory, cpu = cluster.usage(idx, b)
    rec = StepRecord(step=k, epoch=k // sc.steps_per_epoch,
                     epoch_end=(k + 1) % sc.steps_per_epoch == 0, batch=b.copy(),
                     compute=reported, data=data, memory=memory, cpu=cpu,
                     predicted=run.predicted(memory), sq=sq)
    run.record(k, rec)
    return None


class _PolicyRun:
    """The policy's side of a simulated run: the workers it runs on, its decision loop, the
    decisions in flight (``scenario.lag`` steps), the block of records not exchanged yet and its
    length, the exchanges, and the wall seconds spent deciding and assigning samples."""

    def __init__(self, sc: Scenario, policy: Policy, *, profile: bool, every: int, adaptive: bool,
                 history: int) -> None:
        self.sc, self.policy, self.profile = sc, policy, profile
        self.every, self.adaptive, self.history = every, adaptive, history
        #: The declared workers the policy runs on (rank r is worker ``workers[r]``).
        self.workers = np.zeros(0, np.int64)
        self.loop: Optional[DecisionLoop] = None
        self.pending: List[Any] = []  # the decisions of this step and the next lag ones
        self.block: List[StepRecord] = []  # records not exchanged yet (exchange_every > 1)
        self.started = 0  # the step the policy (re)started at: an exchange of its own
        self.length = every  # steps of the current block
        #: The steps whose end exchanged the telemetry.
        self.exchanges: List[int] = []
        self.decide_seconds = 0.0
        self.assign_seconds = 0.0

    def start(self, k: int, active: np.ndarray) -> Optional[str]:
        """(Re)start the policy on the ``active`` workers at step ``k``; the error that stops the
        run, or None."""
        sc = self.sc
        self.started = k
        self.length = 1 if self.adaptive else self.every
        self.workers = idx = np.flatnonzero(active)
        n = idx.size
        # As in the Balancer, only a profile that ran out of memory bounds a rank's batch, at the
        # largest size it measured (a power of two: below the worker's true limit).
        profs = _profiles(sc, idx) if self.profile else []
        upper = np.array([min(p["limit"], sc.global_batch) if p["oom_at"] is not None
                          else sc.global_batch for p in profs] or [sc.global_batch] * n, np.int64)
        if upper.sum() < sc.global_batch:  # Balancer(profile=...) refuses this at construction
            return (f"step {k}: the profiled limits of the {n} active workers (the largest power "
                    f"of two that fit: {upper.tolist()}) hold {int(upper.sum())} samples, fewer "
                    f"than global_batch={sc.global_batch}; Balancer(profile=...) would refuse it")
        ctx = Context(world=n, global_batch=sc.global_batch, lower=np.full(n, sc.lower),
                      upper=upper, hardware=[{} for _ in range(n)], profiles=profs)
        t0 = time.perf_counter()
        self.loop = DecisionLoop(self.policy, n, history=self.history, ranks=range(n),
                                 background=False, refusal_level=logging.DEBUG)
        first = self.loop.start(ctx)
        self.decide_seconds += time.perf_counter() - t0
        self.block = []
        self.pending = [first] * (sc.lag + 1)
        return None

    def split(self, k: int, amounts: Optional[np.ndarray],
              seed: int) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
        """Step ``k``'s batch, data amount and summed squared sizes of every rank under the
        decision in force, its samples' sizes ``amounts`` (None: no sizes)."""
        sc, n, dec = self.sc, self.workers.size, self.pending[0]
        if isinstance(dec, ScheduleRule):  # size-aware: the step's samples by estimated time
            t0 = time.perf_counter()
            owner = schedule(np.ones(sc.global_batch) if amounts is None else dec.work(amounts),
                             dec.slope, dec.intercept, cap=dec.cap,
                             first=dec.first(seed, k // sc.steps_per_epoch, k, sc.global_batch))
            self.assign_seconds += time.perf_counter() - t0
            b = np.bincount(owner, minlength=n).astype(np.int64)
            data = b.astype(np.float64) if amounts is None else np.bincount(owner, amounts, minlength=n)
            sq = None if amounts is None else np.bincount(owner, amounts * amounts, minlength=n)
            return b, data, sq
        b = np.asarray(dec, np.int64)  # contiguous slices of the step's samples, as the loader cuts them
        if amounts is None:
            return b, b.astype(np.float64), None
        ends = np.cumsum(b)
        csum = np.concatenate([[0.0], np.cumsum(amounts)])
        csq = np.concatenate([[0.0], np.cumsum(amounts * amounts)])
        return b, csum[ends] - csum[ends - b], csq[ends] - csq[ends - b]

    def predicted(self, memory: np.ndarray) -> np.ndarray:
        """Each rank's local predictor's prediction (LB-BSP's NARX; NaN without one)."""
        pred = np.full(self.workers.size, np.nan)
        for r in self.loop.predictors:
            pred[r] = self.loop.predict(r, float(memory[r]))
        return pred

    def record(self, k: int, rec: StepRecord) -> None:
        """Keep step ``k``'s record; at the block's end exchange it: the policy decides, and the
        decision takes effect ``lag`` steps later."""
        t0 = time.perf_counter()
        self.block.append(rec)
        nxt = self.pending[-1]  # inside a block the sizes are kept
        if ships(len(self.block) - 1, self.length, restarted=k == self.started,
                 epoch_last=rec.epoch_end, epoch_first=k % self.sc.steps_per_epoch == 0):
            self.exchanges.append(k)
            decided = self.loop.advance(self.block)  # None: the previous sizes are kept, as in the Balancer
            self.block = []
            nxt = self.pending[-1] if decided is None else decided
            steady = decided is not None and decision_checksum(decided) == decision_checksum(self.pending[-1])
            if self.adaptive:
                self.length = next_block_length(self.length, steady, self.every)
        self.decide_seconds += time.perf_counter() - t0
        self.pending = self.pending[1:] + [nxt]


class _Trace:
    """The per-step arrays of a simulated run (over the declared workers) and its restarts."""

    def __init__(self, steps: int, workers: int) -> None:
        self.sizes = np.zeros((steps, workers), np.int64)
        self.compute = np.full((steps, workers), np.nan)
        self.data = np.zeros((steps, workers))
        self.step_time = np.zeros(steps)
        self.comm = np.zeros(steps)
        self.se = np.zeros(steps)
        self.restarts: List[int] = []
        self.done = 0  # steps that ran

    def add(self, k: int, idx: np.ndarray, b: np.ndarray, data: np.ndarray, t: np.ndarray,
            reported: np.ndarray, comm: float) -> None:
        """Step ``k`` of workers ``idx``: batches, data amounts, compute seconds (``reported``:
        as the telemetry says, ``inf`` for a failed worker) and the exposed all-reduce."""
        self.step_time[k] = float(t.max()) + comm
        self.comm[k] = comm
        self.sizes[k, idx] = b
        self.data[k, idx] = data
        self.compute[k, idx] = reported
        self.se[k] = straggler_effect(t, b)
        self.done = k + 1

    def result(self, scenario: str, policy: str, error: Optional[str], run: _PolicyRun,
               wall: float) -> SimResult:
        """The :class:`SimResult` of the steps that ran."""
        d = self.done
        return SimResult(scenario=scenario, policy=policy, sizes=self.sizes[:d], compute=self.compute[:d],
                         step_time=self.step_time[:d], comm=self.comm[:d], se=self.se[:d],
                         restarts=self.restarts, error=error, decide_seconds=run.decide_seconds,
                         assign_seconds=run.assign_seconds, data=self.data[:d], wall_seconds=wall,
                         exchanges=run.exchanges)
