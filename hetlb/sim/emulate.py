"""Emulated heterogeneity: make the ranks of one machine behave like a heterogeneous cluster.

The papers emulate heterogeneity on homogeneous hardware by prolonging every iteration: a fixed
extra time for static heterogeneity (slower hardware), a random one for dynamic heterogeneity
(shared nodes), and LBB's case study adds about 50 ms to one GPU for a while. An :class:`Emulator`
does the same for real runs: each step's compute is *stretched* to a target time

    target = T(batch) / speed * (1 + noise * u) + jitter * v        u ~ U(-1, 1), v ~ U(0, 1)

(``T`` is the emulated worker's time model; without one the real measured time is used, so
``speed < 1`` slows the real step down), and then every :class:`Disturbance` active at that step
maps ``target -> target * factor + extra`` in the order given. ``u`` and ``v`` are a pure function
of ``(seed, rank, step)`` so a rerun, or a run resumed at step ``s``, reproduces every target.

How it is used: the :class:`hetlb.Balancer` asks :meth:`Emulator.affine` for the step's
``(factor, extra)``, with ``target = measured * factor + extra`` exactly (a time model gives
``factor = 0``), before the step runs; the native step core then holds the step's *last gradient
bucket* (the moment the rank would join the final all-reduce) until ``measured * factor + extra``
seconds after the step's first forward, without entering Python. So the emulated time is exactly
the compute time the other ranks wait for, and telemetry records it as this rank's compute time.
A ``Disturbance(..., fail=True)`` makes the rank report ``+inf`` (no progress) for its steps, as a
device that stopped working while its process still takes part would: in the Balancer (and the
simulator's scenarios) only. :class:`hetlb.sync.Federated` and the parameter-server
:class:`hetlb.sync.ps.Worker` refuse an emulator with one (they have no way to report it);
:class:`hetlb.DelayedSync` and :func:`hetlb.sync.train`'s ``localsgd`` only stretch steps and leave
``fail`` out. A bandwidth cap delays
every bucket's result by ``nbytes / bandwidth``. Standalone::

    emu = Emulator.for_rank(rank, speeds=[1.0, 0.5, 0.25], noise=0.1,
                            disturbances={2: [Disturbance(100, 200, extra=0.05)]})
    t0 = time.perf_counter()
    loss_fn(model(x), y).backward()
    emu.stretch(step, len(x), t0)          # sleeps until t0 + target

On a GPU the caller must synchronize (or pass a ``start`` such that host time covers the device
work) before :meth:`stretch`; the emulator only measures host wall time.
"""
from __future__ import annotations

import math
import operator
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Union

import numpy as np

from hetlb.core.models import TimeModel, model_from_dict


__all__ = ["Disturbance", "Emulator", "sleep_until"]

#: The last stretch of a wait is spun rather than slept: ``time.sleep`` can overshoot by
#: scheduler granularity, a short spin lands within microseconds at the cost of ~1 ms of CPU.
DEFAULT_SPIN = 0.001


def _finite_float(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_, str, bytes)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    return x


def _int(name: str, value: Any, low: int = 0) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        i = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if i < low:
        raise ValueError(f"{name} must be >= {low}, got {i}")
    return i


def sleep_until(deadline: float, spin: float = DEFAULT_SPIN) -> None:
    """Return once ``time.perf_counter() >= deadline``: sleep the bulk, spin the last ``spin`` s."""
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return
        if remaining > spin:
            time.sleep(remaining - spin)


@dataclass(frozen=True)
class Disturbance:
    """From step ``start`` (inclusive) to ``stop`` (exclusive; ``None`` = forever) the target
    becomes ``target * factor + extra`` seconds. LBB's disturbance is ``extra=0.05``; a
    ``Disturbance(0, extra=x)`` is the papers' static heterogeneity (a fixed prolongation).
    ``fail=True``: the rank makes no progress in those steps: under the :class:`hetlb.Balancer`
    (and in the simulator) it reports ``+inf`` compute time and WLBS redistributes its share.
    Only there: :class:`hetlb.sync.Federated` and the parameter-server worker refuse an emulator
    with a failure, and :class:`hetlb.DelayedSync` and local SGD ignore ``fail``."""

    start: int
    stop: Optional[int] = None
    extra: float = 0.0
    factor: float = 1.0
    fail: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", _int("Disturbance.start", self.start))
        if self.stop is not None:
            stop = _int("Disturbance.stop", self.stop)
            if stop <= self.start:
                raise ValueError(f"Disturbance.stop must be > start={self.start}, got {stop}")
            object.__setattr__(self, "stop", stop)
        extra = _finite_float("Disturbance.extra", self.extra)
        factor = _finite_float("Disturbance.factor", self.factor)
        if extra < 0:
            raise ValueError(f"Disturbance.extra must be >= 0 seconds, got {extra}")
        if factor <= 0:
            raise ValueError(f"Disturbance.factor must be > 0, got {factor}")
        object.__setattr__(self, "extra", extra)
        object.__setattr__(self, "factor", factor)
        if not isinstance(self.fail, (bool, np.bool_)):
            raise ValueError(f"Disturbance.fail must be True or False, got {self.fail!r}")
        object.__setattr__(self, "fail", bool(self.fail))

    def active(self, step: int) -> bool:
        """Whether the disturbance applies at ``step``."""
        return self.start <= step and (self.stop is None or step < self.stop)

    def apply(self, target: float) -> float:
        """``target * factor + extra`` (unconditionally; see :meth:`active`)."""
        return target * self.factor + self.extra

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready dict (``Disturbance(**d)`` inverts it)."""
        return asdict(self)


class Emulator:
    """Stretches one rank's steps to an emulated worker's time (see the module docstring).

    Args:
        model: time model of the emulated worker (seconds at batch size ``b``); ``None`` uses the
            measured compute time.
        speed: relative speed (> 0); the model's (or measured) time is divided by it.
        noise: dynamic heterogeneity, ``0 <= noise < 1``: the time is multiplied by
            ``1 + noise * u``, ``u ~ U(-1, 1)`` per step (mean-preserving, bounded, never <= 0).
        disturbances: :class:`Disturbance` objects (or their dicts), applied in order.
        bandwidth: bytes per second of the emulated link (``None``: no cap).
        seed: seed (>= 0) of the per-step randomness.
        jitter: seconds; ABS-SGD's "prolong a random time": adds ``jitter * v``, ``v ~ U(0, 1)``.
        rank: mixed into the randomness so ranks sharing a seed are perturbed independently.
        spin: seconds at the end of a wait that are spun instead of slept.
        by: what the time model is a function of: ``"batch"`` (the rank's samples per step) or
            ``"data"`` (its data amount: the sum of its samples' sizes, e.g. tokens; CHRONICA's
            ``T = a * size + b``). The Balancer passes the one asked for.
        quadratic: with ``by="data"``, ``c`` of an attention-bound worker whose work per sample
            is ``s + c * s**2``: the model is evaluated at ``sum(s) + c * sum(s**2)`` (the
            Balancer passes both sums).

    Every argument is checked: a bad one raises ``ValueError`` naming it, with the value received
    and what is accepted (numbers are never taken from strings or bools).
    """

    def __init__(self, model: Optional[TimeModel] = None, speed: float = 1.0, noise: float = 0.0,
                 disturbances: Sequence[Union[Disturbance, Mapping[str, Any]]] = (),
                 bandwidth: Optional[float] = None, seed: int = 0, *, jitter: float = 0.0,
                 rank: int = 0, spin: float = DEFAULT_SPIN, by: str = "batch",
                 quadratic: float = 0.0) -> None:
        if model is not None and not isinstance(model, TimeModel):
            raise ValueError(f"model must be a hetlb TimeModel or None, got {type(model).__name__}")
        speed = _finite_float("speed", speed)
        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        noise = _finite_float("noise", noise)
        if not 0 <= noise < 1:
            raise ValueError(f"noise must satisfy 0 <= noise < 1 (a factor 1 + noise*U(-1,1)), got {noise}")
        jitter = _finite_float("jitter", jitter)
        if jitter < 0:
            raise ValueError(f"jitter must be >= 0 seconds, got {jitter}")
        if bandwidth is not None:
            bandwidth = _finite_float("bandwidth", bandwidth)
            if bandwidth <= 0:
                raise ValueError(f"bandwidth must be > 0 bytes/s (or None for no cap), got {bandwidth}")
        if by not in ("batch", "data"):
            raise ValueError(f"by must be 'batch' or 'data', got {by!r}")
        if by == "data" and model is None:
            raise ValueError("by='data' needs a time model of the data amount (model=...)")
        self.by = by
        quadratic = _finite_float("quadratic", quadratic)
        if quadratic < 0 or (quadratic and by != "data"):
            raise ValueError(f"quadratic must be >= 0 and needs by='data', got {quadratic} with by={by!r}")
        self.quadratic = quadratic
        spin = _finite_float("spin", spin)
        if spin < 0:
            raise ValueError(f"spin must be >= 0 seconds, got {spin}")
        if isinstance(disturbances, (Disturbance, Mapping, str, bytes)) or \
                not isinstance(disturbances, Iterable):
            raise ValueError(f"disturbances must be a list of Disturbance objects (or their dicts), "
                             f"got {disturbances!r}")
        dist = []
        for d in disturbances:
            if isinstance(d, Mapping):
                try:
                    d = Disturbance(**d)
                except TypeError as e:  # unknown or missing keys
                    raise ValueError(f"disturbances: {dict(d)!r} is not a Disturbance ({e})") from None
            if not isinstance(d, Disturbance):
                raise ValueError(f"disturbances must be Disturbance objects, got {d!r}")
            dist.append(d)
        self.model = model
        self.speed = speed
        self.noise = noise
        self.jitter = jitter
        self.disturbances = tuple(dist)
        self.bandwidth = bandwidth
        self.seed = _int("seed", seed)
        self.rank = _int("rank", rank)
        self.spin = spin

    @classmethod
    def for_rank(cls, rank: int, speeds: Sequence[float], **kw: Any) -> "Emulator":
        """Emulator of ``rank`` with ``speed=speeds[rank]``. ``disturbances`` may also be a
        mapping ``rank -> [Disturbance, ...]``, so one description serves every rank."""
        rank = _int("rank", rank)
        if isinstance(speeds, (str, bytes)) or not isinstance(speeds, (Sequence, np.ndarray)):
            raise ValueError(f"speeds must be a sequence of relative speeds, one per rank, got {speeds!r}")
        if rank >= len(speeds):
            raise ValueError(f"rank {rank} out of range for {len(speeds)} speeds")
        dist = kw.pop("disturbances", ())
        if isinstance(dist, Mapping):
            bad = [k for k in dist if isinstance(k, bool) or not isinstance(k, (int, np.integer))
                   or not 0 <= k < len(speeds)]
            if bad:  # e.g. "1" from JSON: no rank would ever match it
                raise ValueError(f"disturbances: keys must be ranks (integers in [0, {len(speeds)})), "
                                 f"got {bad!r}")
            dist = dist.get(rank, ())
        return cls(speed=speeds[rank], disturbances=dist, rank=rank, **kw)

    def _randoms(self, step: int) -> "tuple[float, float]":
        """``(u, v)``: ``u ~ U(-1, 1)`` for noise, ``v ~ U(0, 1)`` for jitter, fixed per step."""
        if self.noise == 0 and self.jitter == 0:
            return 0.0, 0.0
        # Both are always drawn so that turning jitter on does not change the noise sequence.
        r = np.random.default_rng([self.seed, self.rank, step]).random(2)
        return 2.0 * float(r[0]) - 1.0, float(r[1])

    def target(self, step: int, batch: float, measured: float = 0.0) -> float:
        """Emulated compute seconds of ``step`` at ``batch`` (``measured``: the real seconds)."""
        step = _int("step", step)
        batch = _finite_float("batch", batch)
        measured = _finite_float("measured", measured)
        if batch < 0 or measured < 0:
            raise ValueError(f"batch and measured must be >= 0, got {batch}, {measured}")
        # A fitted cubic can dip below 0 at small sizes; no step takes negative time.
        base = max(float(self.model.time(batch)), 0.0) if self.model is not None else measured
        u, v = self._randoms(step)
        t = base / self.speed * (1.0 + self.noise * u) + self.jitter * v
        for d in self.disturbances:
            if d.active(step):
                t = d.apply(t)
        return t

    def affine(self, step: int, batch: float) -> "tuple[float, float]":
        """``(factor, extra)`` with ``target(step, batch, measured) == measured * factor + extra``
        for every measured time (up to rounding): what the native step core holds a step to. With
        a time model the target does not depend on the measured time (``factor == 0``)."""
        step = _int("step", step)
        batch = _finite_float("batch", batch)
        if batch < 0:
            raise ValueError(f"batch must be >= 0, got {batch}")
        u, v = self._randoms(step)
        scale = (1.0 + self.noise * u) / self.speed
        if self.model is not None:
            factor, extra = 0.0, max(float(self.model.time(batch)), 0.0) * scale + self.jitter * v
        else:
            factor, extra = scale, self.jitter * v
        for d in self.disturbances:
            if d.active(step):
                factor, extra = factor * d.factor, extra * d.factor + d.extra
        return factor, extra

    @property
    def failures(self) -> "tuple[Disturbance, ...]":
        """The ``fail=True`` disturbances (emulated by the :class:`hetlb.Balancer` only; the modes
        that cannot report a rank without progress refuse an emulator that has one)."""
        return tuple(d for d in self.disturbances if d.fail)

    def failed(self, step: int) -> bool:
        """Whether the rank makes no progress at ``step`` (a ``fail=True`` disturbance is active)."""
        return any(d.fail and d.active(step) for d in self.disturbances)

    def stretch(self, step: int, batch: float, start: float) -> float:
        """Wait until ``perf_counter() >= start + target`` and return the target; when the real
        compute already took longer, return at once with the measured seconds."""
        measured = time.perf_counter() - start
        goal = self.target(step, batch, measured=max(measured, 0.0))
        if measured >= goal:
            return measured
        sleep_until(start + goal, self.spin)
        return goal

    def comm_delay(self, nbytes: float) -> float:
        """Seconds ``nbytes`` take on the emulated link (0 without a bandwidth cap)."""
        nbytes = _finite_float("nbytes", nbytes)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        return 0.0 if self.bandwidth is None else nbytes / self.bandwidth

    def sleep_comm(self, nbytes: float) -> float:
        """Sleep :meth:`comm_delay` seconds (precisely) and return them."""
        delay = self.comm_delay(nbytes)
        if delay > 0:
            sleep_until(time.perf_counter() + delay, self.spin)
        return delay

    def state_dict(self) -> Dict[str, Any]:
        """The configuration (randomness is a function of ``(seed, rank, step)``, so this is all
        the state there is); JSON-ready."""
        return {
            "model": None if self.model is None else self.model.to_dict(),
            "speed": self.speed, "noise": self.noise, "jitter": self.jitter,
            "disturbances": [d.to_dict() for d in self.disturbances],
            "bandwidth": self.bandwidth, "seed": self.seed, "rank": self.rank, "spin": self.spin,
            "by": self.by, "quadratic": self.quadratic,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (validated like the constructor's arguments)."""
        state = dict(state)
        model = state.pop("model", None)
        other = Emulator(model=None if model is None else model_from_dict(model), **state)
        self.__dict__.update(other.__dict__)

    def __repr__(self) -> str:
        return (f"Emulator(model={self.model!r}, speed={self.speed}, noise={self.noise}, "
                f"jitter={self.jitter}, disturbances={list(self.disturbances)}, "
                f"bandwidth={self.bandwidth}, seed={self.seed}, rank={self.rank}, by={self.by!r})")
