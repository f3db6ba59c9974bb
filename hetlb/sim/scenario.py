"""Scenarios: a cluster, its network and what happens to it, as a small JSON document.

A scenario describes workers (each a time model plus the effects the papers name: relative
speed, GPU saturation below a batch threshold, launch overhead, memory limit, per-step noise),
the all-reduce network, and events in step time (disturbances, speed or CPU-load changes, a
worker leaving or joining, bandwidth changes). The same description drives the simulator
(:func:`hetlb.sim.simulate`) and real emulated runs (:meth:`Scenario.emulator` gives each rank an
:class:`hetlb.sim.emulate.Emulator` with the same time model and disturbances).

Schema (JSON object; unknown keys are errors, which name the field)::

    {
      "name": "abs-sgd-1234",                 # optional
      "description": "...",                   # optional
      "global_batch": 512,                    # required, samples per step over all workers
      "steps": 200,                           # optional default for simulate(steps=None)
      "steps_per_epoch": 50,                  # optional; epoch ends for DBS / WLBS (default 50)
      "lower": 1,                             # optional minimum batch per worker (default 1)
      "seed": 0,                              # optional, randomness of noise and jitter
      "lag": 0,                               # optional, steps a decision takes to reach the ranks
      "samples": {"kind": "normal", "mean": 45, "std": 16, "min": 1},   # optional sample sizes
      "work": "batch",                        # "batch" or "data": what the time models take
      "workers": [                            # required, non-empty
        {"model": {"kind": "linear", "a0": 0.01, "a1": 0.001},   # seconds at batch b (required)
         "speed": 1.0,                        # time is divided by it (default 1)
         "saturation": 0,                     # T(b) = T(max(b, saturation)) for b > 0 (GPU, LB-BSP)
         "overhead": 0.0,                     # seconds added to every step with b > 0 (launch)
         "limit": null,                       # largest batch that fits in memory (OOM above)
         "noise": 0.0,                        # time * (1 + noise * U(-1, 1)) per step
         "jitter": 0.0,                       # + jitter * U(0, 1) seconds per step (ABS-SGD)
         "memory": 0.3,                       # memory fraction in use at batch 0 (telemetry)
         "cpu": 0.5,                          # CPU load reading (telemetry)
         "bandwidth": null,                   # bytes/s of this worker's link (default: network's)
         "count": 1,                          # repeat this worker
         "active": true,                      # false: joins later through a "join" event
         "name": "V100"}
      ],
      "network": {"latency": 0.0, "bandwidth": null, "model_bytes": 0, "overlap": 0.0},
      "events": [
        {"kind": "disturb", "worker": 1, "start": 30, "stop": null, "extra": 0.05, "factor": 1.0,
         "fail": false},
        {"kind": "speed", "worker": [0, 2], "start": 100, "speed": 0.5},
        {"kind": "load", "worker": 3, "start": 50, "stop": 80, "load": 0.5},
        {"kind": "bandwidth", "worker": 2, "start": 150, "bandwidth": 3.1e8},
        {"kind": "leave", "worker": 3, "start": 200},
        {"kind": "join", "worker": 3, "start": 300}
      ]
    }

``samples`` gives every sample a data amount (tokens, frames), drawn per step: ``normal``
(``mean``, ``std``), ``lognormal`` (``mean`` and ``sigma`` of the log) or ``constant``
(``mean``), clipped to ``[min, max]`` (default ``[0, inf)``) and rounded when ``round`` is true
(default). With ``"work": "data"`` a worker's time model is a function of the data amount it
gets (CHRONICA's ``T = a * size + b``), else of its sample count. ``"quadratic": c`` (with
``"work": "data"``, default 0) makes a sample's work ``s + c * s^2`` (attention-bound models: what
``Chronica(quadratic=...)`` models), and each step's records carry the summed squared sizes. A size-aware policy
(:class:`hetlb.Chronica`) then assigns each step's samples with :func:`hetlb.schedule`; other
policies take contiguous slices of the step's samples, as the loader does.

Worker indices count the expanded list (after ``count``). ``model`` is a
:meth:`hetlb.TimeModel.to_dict` (``linear``: ``a0``, ``a1``; ``poly``: ``coeffs``, highest degree
first; ``piecewise``: ``batch_sizes``, ``times``) or the shorthands ``[a0, a1]`` (linear) and
``{"linear": [a0, a1]}`` / ``{"cubic": [c3, c2, c1, c0]}``. A ``speed`` event multiplies the
worker's own ``speed`` by its value while it runs (``0.5``: half as fast as declared). A ``load`` event is a co-located job
taking a fraction of the worker: its time is divided by ``1 - load`` and its CPU reading rises by
``load`` (LB-BSP's CPU clusters). An event runs for steps ``start <= k < stop`` (``stop``
null: to the end); where ``speed``, ``load`` or ``bandwidth`` events of a worker overlap, the one
started last holds, and when it ends the one still running takes over again. The all-reduce is a
ring: ``2 (n - 1) latency + 2 (n - 1) / n * model_bytes / bandwidth`` with the slowest link's
bandwidth (a worker without a ``bandwidth`` of its own has the network's); ``overlap`` is the
fraction of it hidden behind computation.
"""
from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np

from hetlb.core.decisions import sample_work
from hetlb.core.models import LinearModel, PolyModel, TimeModel, WorkerModel, model_from_dict
from hetlb.sim.emulate import Disturbance, Emulator


__all__ = ["ScenarioError", "WorkerSpec", "Event", "Network", "Samples", "Scenario", "load_scenario",
           "builtin_scenarios", "generate_cluster", "WorkerModel", "EVENT_KINDS", "shared_cpu_trace"]

EVENT_KINDS = ("disturb", "speed", "load", "bandwidth", "leave", "join")


class ScenarioError(ValueError):
    """A scenario that cannot be used; the message names the field (``workers[2].speed``)."""


# ---------------------------------------------------------------------------------------------
# field readers: each names the field it reads in its error


def _num(d: Mapping[str, Any], key: str, where: str, default: Any = None, *, minimum: float = -math.inf,
         strict: bool = False, allow_none: bool = False, maximum: float = math.inf) -> Any:
    v = d.get(key, default)
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ScenarioError(f"{where}.{key}: expected a number, got {v!r}")
    x = float(v)
    if not math.isfinite(x) or x < minimum or (strict and x <= minimum) or x > maximum:
        lo = f"> {minimum:g}" if strict else f">= {minimum:g}"
        hi = f" and <= {maximum:g}" if math.isfinite(maximum) else ""
        raise ScenarioError(f"{where}.{key}: expected a finite number {lo}{hi}, got {v!r}")
    return x


def _int(d: Mapping[str, Any], key: str, where: str, default: Any = None, *, minimum: int = 0,
         allow_none: bool = False) -> Any:
    v = d.get(key, default)
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) and not (
            isinstance(v, float) and v.is_integer()):
        raise ScenarioError(f"{where}.{key}: expected an integer, got {v!r}")
    i = int(v)
    if i < minimum:
        raise ScenarioError(f"{where}.{key}: expected an integer >= {minimum}, got {v!r}")
    return i


def _known(d: Any, keys: Sequence[str], where: str) -> Dict[str, Any]:
    if not isinstance(d, Mapping):
        raise ScenarioError(f"{where}: expected an object, got {type(d).__name__} {d!r}")
    extra = sorted(set(d) - set(keys))
    if extra:
        raise ScenarioError(f"{where}: unknown field(s) {extra}; known: {sorted(keys)}")
    return dict(d)


def _model(v: Any, where: str) -> TimeModel:
    try:
        if isinstance(v, (list, tuple)):
            if len(v) != 2 or any(isinstance(x, (bool, str)) for x in v):
                raise ScenarioError(f"{where}: the list shorthand is [a0, a1] (linear, two numbers), "
                                    f"got {v!r}")
            return LinearModel(float(v[0]), float(v[1]))
        if not isinstance(v, Mapping):
            raise ScenarioError(f"{where}: expected a time model object, got {v!r}")
        if "kind" not in v and len(v) == 1:
            (k, c), = v.items()
            if k == "linear":
                if not isinstance(c, (list, tuple)) or len(c) != 2 or \
                        any(isinstance(x, (bool, str)) for x in c):
                    raise ScenarioError(f"{where}.linear: expected [a0, a1] (two numbers), got {c!r}")
                return LinearModel(float(c[0]), float(c[1]))
            if k in ("cubic", "poly"):
                if not isinstance(c, (list, tuple)) or not c:
                    raise ScenarioError(f"{where}.{k}: expected coefficients, highest degree first, got {c!r}")
                return PolyModel([float(x) for x in c])
            raise ScenarioError(f"{where}: unknown model {k!r}; expected 'linear', 'cubic' or a "
                                f"TimeModel dict with 'kind'")
        return model_from_dict(dict(v))
    except ScenarioError:
        raise
    except (ValueError, TypeError, KeyError) as e:
        raise ScenarioError(f"{where}: not a usable time model ({type(e).__name__}: {e}); got {v!r}") from None


_WORKER_KEYS = ("model", "speed", "saturation", "overhead", "limit", "noise", "jitter", "memory",
                "cpu", "bandwidth", "count", "active", "name")


@dataclass
class WorkerSpec:
    """One worker of a scenario (see the module docstring for the fields)."""

    model: TimeModel
    speed: float = 1.0
    saturation: float = 0.0
    overhead: float = 0.0
    limit: Optional[int] = None
    noise: float = 0.0
    jitter: float = 0.0
    memory: float = 0.3
    cpu: float = 0.5
    bandwidth: Optional[float] = None
    active: bool = True
    name: str = ""

    @property
    def time_model(self) -> WorkerModel:
        """Seconds at batch ``b`` without noise or events."""
        return WorkerModel(self.model, self.speed, self.saturation, self.overhead)

    def to_dict(self) -> Dict[str, Any]:
        d = {k: getattr(self, k) for k in _WORKER_KEYS if k not in ("model", "count")}
        d["model"] = self.model.to_dict()
        return d


def _worker(d: Any, where: str) -> List[WorkerSpec]:
    d = _known(d, _WORKER_KEYS, where)
    if "model" not in d:
        raise ScenarioError(f"{where}.model: required (seconds at batch b, e.g. [0.01, 0.001])")
    active = d.get("active", True)
    if not isinstance(active, bool):
        raise ScenarioError(f"{where}.active: expected true or false, got {active!r}")
    name = d.get("name", "")
    if not isinstance(name, str):
        raise ScenarioError(f"{where}.name: expected a string, got {name!r}")
    w = WorkerSpec(
        model=_model(d["model"], f"{where}.model"),
        speed=_num(d, "speed", where, 1.0, minimum=0.0, strict=True),
        saturation=_num(d, "saturation", where, 0.0, minimum=0.0),
        overhead=_num(d, "overhead", where, 0.0, minimum=0.0),
        limit=_int(d, "limit", where, None, minimum=1, allow_none=True),
        noise=_num(d, "noise", where, 0.0, minimum=0.0, maximum=0.999),
        jitter=_num(d, "jitter", where, 0.0, minimum=0.0),
        memory=_num(d, "memory", where, 0.3, minimum=0.0, maximum=1.0),
        cpu=_num(d, "cpu", where, 0.5, minimum=0.0, maximum=1.0),
        bandwidth=_num(d, "bandwidth", where, None, minimum=0.0, strict=True, allow_none=True),
        active=active, name=name)
    count = _int(d, "count", where, 1, minimum=1)
    return [copy.deepcopy(w) for _ in range(count)]


@dataclass
class Event:
    """Something that happens to workers from step ``start`` to ``stop`` (exclusive; None =
    for good). ``kind`` is one of :data:`EVENT_KINDS`; the value fields that kind uses are set."""

    kind: str
    workers: List[int]
    start: int
    stop: Optional[int] = None
    extra: float = 0.0
    factor: float = 1.0
    fail: bool = False
    speed: float = 1.0
    load: float = 0.0
    bandwidth: Optional[float] = None

    def active(self, step: int) -> bool:
        return self.start <= step and (self.stop is None or step < self.stop)

    def to_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"kind": self.kind, "worker": list(self.workers), "start": self.start}
        if self.stop is not None:
            d["stop"] = self.stop
        for k in {"disturb": ("extra", "factor", "fail"), "speed": ("speed",), "load": ("load",),
                  "bandwidth": ("bandwidth",)}.get(self.kind, ()):
            d[k] = getattr(self, k)
        return d


_EVENT_KEYS = {"disturb": ("extra", "factor", "fail"), "speed": ("speed",), "load": ("load",),
               "bandwidth": ("bandwidth",), "leave": (), "join": ()}


def _event(d: Any, where: str, world: int) -> Event:
    if not isinstance(d, Mapping):
        raise ScenarioError(f"{where}: expected an object, got {d!r}")
    kind = d.get("kind")
    if kind not in EVENT_KINDS:
        raise ScenarioError(f"{where}.kind: expected one of {list(EVENT_KINDS)}, got {kind!r}")
    d = _known(d, ("kind", "worker", "start", "stop") + _EVENT_KEYS[kind], where)
    if "worker" not in d:
        raise ScenarioError(f"{where}.worker: required (an index or a list of indices)")
    ws = d["worker"]
    ws = list(ws) if isinstance(ws, (list, tuple)) else [ws]
    if not ws:
        raise ScenarioError(f"{where}.worker: empty list")
    for i, w in enumerate(ws):
        if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < world:
            raise ScenarioError(f"{where}.worker: {w!r} is not a worker index in [0, {world})")
    if "start" not in d:
        raise ScenarioError(f"{where}.start: required (the first step the event applies to)")
    start = _int(d, "start", where, minimum=0)
    stop = _int(d, "stop", where, None, minimum=0, allow_none=True)
    if stop is not None and stop <= start:
        raise ScenarioError(f"{where}.stop: must be > start={start}, got {stop}")
    if kind in ("leave", "join") and stop is not None:
        raise ScenarioError(f"{where}.stop: a {kind} event has no stop (use a {'join' if kind == 'leave' else 'leave'} event)")
    e = Event(kind=kind, workers=ws, start=start, stop=stop)
    if kind == "disturb":
        e.extra = _num(d, "extra", where, 0.0, minimum=0.0)
        e.factor = _num(d, "factor", where, 1.0, minimum=0.0, strict=True)
        fail = d.get("fail", False)
        if not isinstance(fail, bool):
            raise ScenarioError(f"{where}.fail: expected true or false, got {fail!r}")
        e.fail = fail
    elif kind == "speed":
        if "speed" not in d:
            raise ScenarioError(f"{where}.speed: required for a speed event")
        e.speed = _num(d, "speed", where, minimum=0.0, strict=True)
    elif kind == "load":
        if "load" not in d:
            raise ScenarioError(f"{where}.load: required for a load event (fraction in [0, 1))")
        e.load = _num(d, "load", where, minimum=0.0, maximum=0.99)
    elif kind == "bandwidth":
        if "bandwidth" not in d:
            raise ScenarioError(f"{where}.bandwidth: required for a bandwidth event (bytes/s)")
        e.bandwidth = _num(d, "bandwidth", where, minimum=0.0, strict=True)
    return e


@dataclass
class Network:
    """The ring all-reduce's cost model: ``latency`` seconds per hop, ``bandwidth`` bytes/s per
    link (None: infinite), ``model_bytes`` bytes of gradients, ``overlap`` in [0, 1] the fraction
    hidden behind computation."""

    latency: float = 0.0
    bandwidth: Optional[float] = None
    model_bytes: float = 0.0
    overlap: float = 0.0

    def allreduce(self, n: int, bandwidth: Optional[float] = None) -> float:
        """Seconds of one ring all-reduce over ``n`` workers whose slowest link has ``bandwidth``
        (default the network's)."""
        if n <= 1:
            return 0.0
        bw = self.bandwidth if bandwidth is None else bandwidth
        t = 2.0 * (n - 1) * self.latency
        if bw is not None and self.model_bytes > 0:
            t += 2.0 * (n - 1) / n * self.model_bytes / bw
        return t

    def exposed(self, n: int, bandwidth: Optional[float] = None) -> float:
        """The all-reduce seconds that computation does not hide."""
        return self.allreduce(n, bandwidth) * (1.0 - self.overlap)

    def to_dict(self) -> Dict[str, Any]:
        return {"latency": self.latency, "bandwidth": self.bandwidth,
                "model_bytes": self.model_bytes, "overlap": self.overlap}


def _network(d: Any, where: str) -> Network:
    d = _known(d, ("latency", "bandwidth", "model_bytes", "overlap"), where)
    return Network(latency=_num(d, "latency", where, 0.0, minimum=0.0),
                   bandwidth=_num(d, "bandwidth", where, None, minimum=0.0, strict=True, allow_none=True),
                   model_bytes=_num(d, "model_bytes", where, 0.0, minimum=0.0),
                   overlap=_num(d, "overlap", where, 0.0, minimum=0.0, maximum=1.0))


_SCENARIO_KEYS = ("name", "description", "global_batch", "steps", "steps_per_epoch", "lower",
                  "seed", "lag", "workers", "network", "events", "samples", "work", "quadratic")

SAMPLE_KINDS = ("normal", "lognormal", "constant")


@dataclass
class Samples:
    """Per-sample data amounts of a scenario (see the module docstring)."""

    kind: str = "constant"
    mean: float = 1.0
    std: float = 0.0
    sigma: float = 0.0
    min: float = 0.0
    max: float = math.inf
    round: bool = True

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` sizes (float64)."""
        if self.kind == "normal":
            x = rng.normal(self.mean, self.std, n)
        elif self.kind == "lognormal":
            x = rng.lognormal(self.mean, self.sigma, n)
        else:
            x = np.full(n, self.mean)
        x = np.clip(x, self.min, self.max)
        return np.round(x) if self.round else x

    def to_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"kind": self.kind, "mean": self.mean, "min": self.min, "round": self.round}
        if self.kind == "normal":
            d["std"] = self.std
        if self.kind == "lognormal":
            d["sigma"] = self.sigma
        if math.isfinite(self.max):
            d["max"] = self.max
        return d


def _samples(d: Any, where: str) -> Optional[Samples]:
    if d is None:
        return None
    d = _known(d, ("kind", "mean", "std", "sigma", "min", "max", "round"), where)
    kind = d.get("kind", "constant")
    if kind not in SAMPLE_KINDS:
        raise ScenarioError(f"{where}.kind: expected one of {list(SAMPLE_KINDS)}, got {kind!r}")
    spread = {"normal": "std", "lognormal": "sigma"}.get(kind)
    for key in ("std", "sigma"):
        if key in d and key != spread:  # a spread the kind does not draw with would be ignored
            raise ScenarioError(f"{where}.{key}: not used by kind {kind!r}"
                                + (f" (its spread is {spread!r})" if spread else
                                   " (every sample is the mean)"))
    rnd = d.get("round", True)
    if not isinstance(rnd, bool):
        raise ScenarioError(f"{where}.round: expected true or false, got {rnd!r}")
    smp = Samples(kind=kind, mean=_num(d, "mean", where, 1.0, minimum=-math.inf if kind == "lognormal" else 0.0),
                  std=_num(d, "std", where, 0.0, minimum=0.0), sigma=_num(d, "sigma", where, 0.0, minimum=0.0),
                  min=_num(d, "min", where, 0.0, minimum=0.0), round=rnd)
    if d.get("max") is not None:
        smp.max = _num(d, "max", where, minimum=smp.min)
    return smp


@dataclass
class Scenario:
    """A cluster, its network and its events (see the module docstring); build one with
    :meth:`from_dict`, :func:`load_scenario` or by name from :func:`builtin_scenarios`."""

    global_batch: int
    workers: List[WorkerSpec]
    network: Network = field(default_factory=Network)
    events: List[Event] = field(default_factory=list)
    steps: int = 200
    steps_per_epoch: int = 50
    lower: int = 1
    seed: int = 0
    lag: int = 0
    name: str = ""
    description: str = ""
    samples: Optional[Samples] = None
    work: str = "batch"
    quadratic: float = 0.0

    def work_of(self, sizes: np.ndarray) -> np.ndarray:
        """Each sample's work: its size, plus ``quadratic`` times its square."""
        return sample_work(sizes, self.quadratic)

    @property
    def world(self) -> int:
        """Workers declared (active or joining later)."""
        return len(self.workers)

    @classmethod
    def from_dict(cls, d: Any, where: str = "scenario") -> "Scenario":
        """Validate and build; :class:`ScenarioError` names the first bad field."""
        d = _known(d, _SCENARIO_KEYS, where)
        if "global_batch" not in d:
            raise ScenarioError(f"{where}.global_batch: required (samples per step over all workers)")
        if "workers" not in d:
            raise ScenarioError(f"{where}.workers: required (a non-empty list)")
        if not isinstance(d["workers"], (list, tuple)) or not d["workers"]:
            raise ScenarioError(f"{where}.workers: expected a non-empty list, got {d['workers']!r}")
        workers: List[WorkerSpec] = []
        for i, w in enumerate(d["workers"]):
            workers += _worker(w, f"{where}.workers[{i}]")
        for key in ("name", "description"):
            if not isinstance(d.get(key, ""), str):
                raise ScenarioError(f"{where}.{key}: expected a string, got {d[key]!r}")
        events_in = d.get("events", [])
        if not isinstance(events_in, (list, tuple)):
            raise ScenarioError(f"{where}.events: expected a list, got {events_in!r}")
        events = [_event(e, f"{where}.events[{i}]", len(workers)) for i, e in enumerate(events_in)]
        s = cls(global_batch=_int(d, "global_batch", where, minimum=1), workers=workers,
                network=_network(d.get("network", {}), f"{where}.network"), events=events,
                steps=_int(d, "steps", where, 200, minimum=1),
                steps_per_epoch=_int(d, "steps_per_epoch", where, 50, minimum=1),
                lower=_int(d, "lower", where, 1, minimum=0), seed=_int(d, "seed", where, 0),
                lag=_int(d, "lag", where, 0), name=d.get("name", ""),
                description=d.get("description", ""),
                samples=_samples(d.get("samples"), f"{where}.samples"), work=d.get("work", "batch"),
                quadratic=_num(d, "quadratic", where, 0.0, minimum=0.0))
        if s.work not in ("batch", "data"):
            raise ScenarioError(f"{where}.work: expected 'batch' or 'data', got {s.work!r}")
        if s.work == "data" and s.samples is None:
            raise ScenarioError(f"{where}.work: 'data' needs a samples distribution ({where}.samples)")
        if s.quadratic and s.work != "data":
            raise ScenarioError(f"{where}.quadratic: a sample's quadratic work needs \"work\": \"data\" "
                                f"(the time models then take each rank's summed work), got work={s.work!r}")
        s.check(where)
        return s

    def check(self, where: str = "scenario") -> None:
        """Cross-field checks: every worker's time is positive, and the active workers can hold
        the global batch within their bounds at every membership the events produce."""
        self._check_times(where)
        active = np.array([w.active for w in self.workers])
        steps = sorted({e.start for e in self.events if e.kind in ("leave", "join")})
        for s in [0] + steps:
            act = active.copy()
            for e in self.events:
                if e.kind in ("leave", "join") and e.start <= s:
                    act[e.workers] = e.kind == "join"
            n = int(act.sum())
            if n == 0:
                raise ScenarioError(f"{where}: no active worker at step {s}")
            if self.lower * n > self.global_batch:
                raise ScenarioError(f"{where}.lower: {n} workers x lower={self.lower} exceed "
                                    f"global_batch={self.global_batch} at step {s}")
            cap = sum(self.workers[i].limit or self.global_batch for i in np.flatnonzero(act))
            if cap < self.global_batch:
                raise ScenarioError(f"{where}.workers: the memory limits of the {n} workers active "
                                    f"at step {s} hold {cap} samples, fewer than global_batch="
                                    f"{self.global_batch}")

    def _check_times(self, where: str) -> None:
        """Every worker takes a positive time for every batch it could get: a model that reaches
        zero (a cubic dipping below 0) would make every step's telemetry unusable, and a policy
        would silently never act."""
        for i, w in enumerate(self.workers):
            first = max(1, self.lower)  # a worker never gets a non-empty batch below lower
            top = min(w.limit or self.global_batch, self.global_batch)
            if self.work == "data" and self.samples is not None:
                top = top * float(self.work_of(self.samples.draw(np.random.default_rng(0), 4096)).max())
                first = 1  # (a data amount: any sample may be small)
            x = np.unique(np.concatenate([np.arange(first, min(top, first + 4095.0) + 1),
                                          np.round(np.linspace(first, max(top, first), 4096))]))
            t = np.asarray(w.time_model.time(x), np.float64)
            bad = np.flatnonzero(~(t > 0) | ~np.isfinite(t))
            if bad.size:
                unit = "data amount" if self.work == "data" else "batch"
                raise ScenarioError(
                    f"{where}.workers[{i}].model: the time at {unit} {x[bad[0]]:g} is "
                    f"{t[bad[0]]:g} s; a worker's time must be positive and finite for every "
                    f"{unit} up to {top:g} (add an overhead, or fix the coefficients)")

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready; :meth:`from_dict` inverts it (workers expanded, ``count`` 1)."""
        return {"name": self.name, "description": self.description, "global_batch": self.global_batch,
                "steps": self.steps, "steps_per_epoch": self.steps_per_epoch, "lower": self.lower,
                "seed": self.seed, "lag": self.lag, "workers": [w.to_dict() for w in self.workers],
                "network": self.network.to_dict(), "events": [e.to_dict() for e in self.events],
                "samples": None if self.samples is None else self.samples.to_dict(), "work": self.work,
                "quadratic": self.quadratic}

    def save(self, path: Union[str, os.PathLike]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)

    def emulator(self, rank: int, **kw: Any) -> Emulator:
        """An :class:`hetlb.sim.emulate.Emulator` that makes real rank ``rank`` behave as worker
        ``rank`` of this scenario: the same time model (speed, saturation, overhead), noise,
        jitter and ``disturb`` events: the compute side only. Other event kinds (speed, load,
        bandwidth, leave, join) and late joiners are simulator-only and refused here. The
        network (``latency``, ``bandwidth``, ``model_bytes``, ``overlap``) and a worker's own
        ``bandwidth`` and ``limit`` are not emulated: the real run communicates over its real
        process group and runs out of its real memory (pass ``bandwidth=`` here to cap the
        rank's emulated link, see :class:`~hetlb.sim.emulate.Emulator`)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside the scenario's {self.world} workers")
        other = sorted({e.kind for e in self.events if e.kind != "disturb"})
        if other or not all(w.active for w in self.workers):
            raise ValueError(f"scenario {self.name!r}: events {other} / late joiners are simulator-only; "
                             f"an emulated run supports 'disturb' events")
        w = self.workers[rank]
        dist = [Disturbance(e.start, e.stop, extra=e.extra, factor=e.factor, fail=e.fail)
                for e in self.events if e.kind == "disturb" and rank in e.workers]
        return Emulator(model=w.time_model, noise=w.noise, jitter=w.jitter, disturbances=dist,
                        seed=self.seed, rank=rank, by=self.work, **kw)


def load_scenario(source: Union[str, os.PathLike, Mapping[str, Any], Scenario]) -> Scenario:
    """A scenario from a built-in name, a JSON (or YAML, with PyYAML installed) file path, or a
    dict."""
    if isinstance(source, Scenario):
        return source
    if isinstance(source, Mapping):
        return Scenario.from_dict(source)
    src = os.fspath(source)
    names = builtin_scenarios()
    if src in names:
        return names[src]()
    if not os.path.exists(src):
        raise ScenarioError(f"scenario {src!r}: no such file and not a built-in "
                            f"(built-ins: {', '.join(sorted(names))})")
    with open(src, encoding="utf-8") as f:
        text = f.read()
    if src.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ScenarioError(f"{src}: reading YAML needs PyYAML (pip install pyyaml); "
                                f"or write the scenario as JSON") from None
        data = yaml.safe_load(text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ScenarioError(f"{src}: not valid JSON ({e})") from None
    return Scenario.from_dict(data, where=os.path.basename(src))


def _packaged(name: str) -> Scenario:
    text = resources.files("hetlb.sim").joinpath("scenarios", f"{name}.json").read_text(encoding="utf-8")
    return Scenario.from_dict(json.loads(text), where=f"{name}.json")


def builtin_scenarios() -> Dict[str, Any]:
    """Built-in scenario names mapped to functions that build them (the papers' clusters)."""
    names = ["abs-sgd-1234", "abs-sgd-dynamic", "lbb-table2", "lbb-disturbance", "lbbsp-cluster-a"]
    out: Dict[str, Any] = {n: (lambda n=n: _packaged(n)) for n in names}
    out["mixed"] = lambda: generate_cluster(16)
    return out


#: Per-sample seconds and launch overheads of the GPU generations :func:`generate_cluster` mixes
#: (relative figures shaped like LB-BSP's Cluster-A: V100, M60, K80, K520).
_GENERATIONS = (("V100", 0.0088, 0.20, 16), ("M60", 0.032, 0.30, 8), ("K80", 0.057, 0.30, 4),
                ("K520", 0.077, 0.52, 1))


def generate_cluster(workers: int, global_batch: Optional[int] = None, seed: int = 0,
                     noise: float = 0.05, steps: int = 200) -> Scenario:
    """A mixed cluster of ``workers`` GPU-like workers drawn from four generations (saturation,
    launch overhead, per-sample cost), with ``noise``; ``global_batch`` defaults to 32 per worker."""
    if workers < 1:
        raise ScenarioError(f"workers must be >= 1, got {workers}")
    rng = np.random.default_rng(seed)
    kinds = rng.integers(0, len(_GENERATIONS), workers)
    ws = []
    for k in kinds:
        name, a1, a0, sat = _GENERATIONS[int(k)]
        ws.append(WorkerSpec(model=LinearModel(a0, a1), saturation=float(sat), noise=noise, name=name))
    return Scenario(global_batch=int(global_batch or 32 * workers), workers=ws, steps=steps,
                    name=f"mixed-{workers}", seed=seed,
                    description=f"{workers} GPU-like workers of four generations (V100/M60/K80/K520-like), "
                                f"noise {noise}")


def shared_cpu_trace(steps: int = 1000, world: int = 4, seed: int = 0,
                     spike_p: float = 0.1) -> tuple:
    """Telemetry of a shared CPU cluster for speed predictors (LB-BSP's CPU mode): each rank's
    competing load changes as a step function (held 30-80 steps, 0-60 %) and shows in the CPU
    column (memory follows it a little), plus transient slowdowns of single steps (probability
    ``spike_p``, 20-50 %) that do not show in it, and 2 % noise. Batches of 32.

    Returns ``(records, speeds)``: a :class:`hetlb.core.telemetry.StepRecord` per step and the true
    speeds, float64 ``[steps, world]`` (samples per second)."""
    from hetlb.core.telemetry import StepRecord
    rng = np.random.default_rng(seed)
    base = np.array([100.0, 80.0, 60.0, 120.0])[:world]
    load = np.zeros((steps, world))
    for r in range(world):
        k = 0
        while k < steps:
            n = int(rng.integers(30, 80))
            load[k:k + n, r] = rng.choice([0.0, 0.2, 0.4, 0.6])
            k += n
    cpu = np.clip(0.25 + 0.7 * load + rng.normal(0, 0.01, load.shape), 0, 1)
    mem = 0.3 + 0.1 * load + rng.normal(0, 0.005, load.shape)
    spikes = np.where(rng.random(load.shape) < spike_p, -rng.uniform(0.2, 0.5, load.shape), 0.0)
    v = base * (1 - load) * (1 + spikes) * (1 + rng.normal(0, 0.02, load.shape))
    b = np.full(world, 32, np.int64)
    return [StepRecord(k, 0, b, b / v[k], b.astype(float), mem[k], cpu[k]) for k in range(steps)], v
