"""Time models: predicted compute time of one worker as a function of its local batch size.

``T(b)`` is what one forward+backward at batch size ``b`` costs (LBB Eq. 1). The solvers use the
*effective* time: 0 at ``b = 0`` (a worker given nothing does not take part) and otherwise the
running maximum of ``T`` over ``1..b`` clamped at 0, so a fitted curve that dips is still treated as
non-decreasing. Models are immutable; each carries a packed native form for ``hetlb._C``.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Sequence, Tuple

import numpy as np


__all__ = ["TimeModel", "LinearModel", "PolyModel", "PiecewiseModel", "model_from_dict",
           "micro_step_model", "lesser_model"]

_KIND_LINEAR, _KIND_POLY, _KIND_PIECEWISE = 0, 1, 2
_BIG = 1 << 62  # candidate points beyond any batch size anyone will ask for


def _finite(values: np.ndarray, what: str) -> None:
    if not np.all(np.isfinite(values)):
        raise ValueError(f"{what} must be finite, got {values.tolist()}")


def _points(b: Any, t: Any) -> Tuple[np.ndarray, np.ndarray]:
    b = np.asarray(b, dtype=np.float64).ravel()
    t = np.asarray(t, dtype=np.float64).ravel()
    if b.shape != t.shape:
        raise ValueError(f"batch sizes and times differ in length: {b.size} vs {t.size}")
    if b.size == 0:
        raise ValueError("no points to fit")
    _finite(b, "batch sizes")
    _finite(t, "times")
    if np.any(b <= 0):
        raise ValueError(f"batch sizes must be positive, got {b.tolist()}")
    return b, t


def _around(points: np.ndarray) -> np.ndarray:
    """Integer points next to each real point >= 1 (where a running maximum can be attained)."""
    pts = points[np.isfinite(points) & (points >= 0) & (points <= _BIG)]
    base = np.floor(pts).astype(np.int64)
    out = np.concatenate([base - 1, base, base + 1, base + 2]) if pts.size else np.zeros(0, np.int64)
    return np.unique(out[out >= 1])


def _critical_points(coeffs: np.ndarray) -> np.ndarray:
    """Real (and near-real) roots of the derivative of a polynomial."""
    d = np.polyder(coeffs) if coeffs.size > 1 else np.zeros(1)
    scale = np.max(np.abs(d))
    if scale == 0:
        return np.zeros(0)
    d = d / scale
    # A leading term this small only has roots far beyond any batch size (> 1e25).
    d = d[np.argmax(np.abs(d) > 1e-25):]
    if d.size < 2:
        return np.zeros(0)
    r = np.roots(d)
    # Near-real roots too: an extra candidate point is harmless, a missing one is not.
    return r[np.abs(r.imag) <= 1e-6 * (1 + np.abs(r.real))].real


class TimeModel:
    """Base class: ``time(b)`` is the raw model, ``effective_time(b)`` what the solvers use."""

    _kind: int
    _params: np.ndarray
    _cands: np.ndarray

    def time(self, b: Any) -> np.ndarray:
        """Raw predicted time at batch size(s) ``b`` (float array of ``b``'s shape)."""
        raise NotImplementedError

    def effective_time(self, b: Any) -> np.ndarray:
        """Time as the solvers see it: 0 at 0, else the running max over ``1..b`` clamped at 0.

        ``b``: integer array-like, any shape, values >= 0. Computed by the native core.
        """
        from hetlb import _C

        arr = np.asarray(b)
        if arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0):
            raise ValueError(f"batch sizes must be non-negative integers, got {arr!r}")
        flat = arr.astype(np.int64).ravel()
        return _C.effective_time(self._kind, self._params, self._cands, flat).reshape(arr.shape)

    @property
    def _native(self) -> Tuple[int, np.ndarray, np.ndarray]:
        return self._kind, self._params, self._cands

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready description; :func:`model_from_dict` inverts it."""
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return (type(other) is type(self) and np.array_equal(self._params, other._params))  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._params.tobytes()))


class LinearModel(TimeModel):
    """``T(b) = a0 + a1 * b``: start-up overhead ``a0`` and per-sample time ``a1`` (both >= 0).

    Seconds where the model meets measured times (profiles, the emulator, the simulator, the
    Balancer's telemetry); the solvers take any unit, since only ratios of times matter to them."""

    def __init__(self, a0: float, a1: float) -> None:
        a0, a1 = float(a0), float(a1)
        if not (math.isfinite(a0) and math.isfinite(a1)):
            raise ValueError(f"LinearModel coefficients must be finite, got a0={a0}, a1={a1}")
        if a0 < 0 or a1 < 0:
            raise ValueError(f"LinearModel coefficients must be >= 0, got a0={a0}, a1={a1}")
        self.a0, self.a1 = a0, a1
        self._kind = _KIND_LINEAR
        self._params = np.array([a0, a1], dtype=np.float64)
        self._cands = np.zeros(0, dtype=np.int64)

    def time(self, b: Any) -> np.ndarray:
        return self.a0 + self.a1 * np.asarray(b, dtype=np.float64)

    @classmethod
    def fit(cls, b: Sequence[float], t: Sequence[float]) -> "LinearModel":
        """Least squares with ``a0, a1 >= 0`` (non-negative least squares)."""
        from scipy.optimize import nnls

        b, t = _points(b, t)
        coef, _ = nnls(np.stack([np.ones_like(b), b], axis=1), t)
        return cls(coef[0], coef[1])

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": "linear", "a0": self.a0, "a1": self.a1}

    def __repr__(self) -> str:
        return f"LinearModel(a0={self.a0!r}, a1={self.a1!r})"


class PolyModel(TimeModel):
    """Polynomial ``T(b)``, coefficients highest degree first (as :func:`numpy.polyval`).

    LBB fits a cubic during profiling; a cubic can dip, which the effective time hides.
    """

    def __init__(self, coeffs: Sequence[float]) -> None:
        c = np.atleast_1d(np.asarray(coeffs, dtype=np.float64)).ravel()
        if c.size == 0:
            raise ValueError("PolyModel needs at least one coefficient")
        _finite(c, "PolyModel coefficients")
        self.coeffs = c
        self._kind = _KIND_POLY
        self._params = c.copy()
        self._cands = _around(_critical_points(c))

    def time(self, b: Any) -> np.ndarray:
        return np.polyval(self.coeffs, np.asarray(b, dtype=np.float64))

    @classmethod
    def fit(cls, b: Sequence[float], t: Sequence[float], degree: int = 3) -> "PolyModel":
        """Least-squares polynomial of ``degree`` (needs ``degree + 1`` distinct batch sizes)."""
        b, t = _points(b, t)
        if degree < 0:
            raise ValueError(f"degree must be >= 0, got {degree}")
        if np.unique(b).size < degree + 1:
            raise ValueError(f"a degree-{degree} fit needs {degree + 1} distinct batch sizes, "
                             f"got {np.unique(b).size}")
        return cls(np.polyfit(b, t, degree))

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": "poly", "coeffs": self.coeffs.tolist()}

    def __repr__(self) -> str:
        return f"PolyModel({self.coeffs.tolist()!r})"


class PiecewiseModel(TimeModel):
    """Linear between profiled points ``(batch_sizes[k], times[k])``; the end segments extend.

    With one point the model is proportional: ``T(b) = t0 * b / b0``.
    """

    def __init__(self, batch_sizes: Sequence[float], times: Sequence[float]) -> None:
        x, t = _points(batch_sizes, times)
        if np.any(np.diff(x) <= 0):
            raise ValueError(f"batch sizes must increase strictly, got {x.tolist()}")
        if np.any(t < 0):
            raise ValueError(f"times must be >= 0, got {t.tolist()}")
        self.batch_sizes, self.times = x, t
        self._kind = _KIND_PIECEWISE
        self._params = np.concatenate([x, t])
        self._cands = _around(x)

    def time(self, b: Any) -> np.ndarray:
        x = np.asarray(b, dtype=np.float64)
        xs, ts = self.batch_sizes, self.times
        if xs.size == 1:
            return ts[0] * (x / xs[0])
        j = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, xs.size - 2)
        return ts[j] + (ts[j + 1] - ts[j]) * ((x - xs[j]) / (xs[j + 1] - xs[j]))

    @classmethod
    def fit(cls, b: Sequence[float], t: Sequence[float]) -> "PiecewiseModel":
        """Mean time per distinct batch size, as profile points."""
        b, t = _points(b, t)
        xs, inv = np.unique(b, return_inverse=True)
        return cls(xs, np.bincount(inv, weights=t) / np.bincount(inv))

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": "piecewise", "batch_sizes": self.batch_sizes.tolist(), "times": self.times.tolist()}

    def __repr__(self) -> str:
        return f"PiecewiseModel({self.batch_sizes.tolist()!r}, {self.times.tolist()!r})"


class WorkerModel(TimeModel):
    """A worker's seconds at batch ``b``: ``overhead + max(base(max(b, saturation)), 0)`` for
    ``b > 0`` and 0 for ``b = 0``, divided by ``speed``: the papers' launch overhead and GPU
    saturation (LB-BSP Sec. 3.3) around any :class:`hetlb.TimeModel`."""

    def __init__(self, base: TimeModel, speed: float = 1.0, saturation: float = 0.0,
                 overhead: float = 0.0) -> None:
        self.base, self.speed, self.saturation, self.overhead = base, float(speed), float(saturation), float(overhead)

    def time(self, b: Any) -> np.ndarray:
        b = np.asarray(b, dtype=np.float64)
        t = np.maximum(np.asarray(self.base.time(np.maximum(b, self.saturation)), np.float64), 0.0)
        return np.where(b > 0, (t + self.overhead) / self.speed, 0.0)

    @property
    def _native(self):  # type: ignore[override]
        raise TypeError("a WorkerModel has no native form; pass as_piecewise(upper) to the solvers")

    def effective_time(self, b: Any) -> np.ndarray:
        """0 at 0, else the running maximum of :meth:`time` over ``1..b`` (as the solvers see a model)."""
        arr = np.asarray(b)
        if arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0):
            raise ValueError(f"batch sizes must be non-negative integers, got {arr!r}")
        top = int(arr.max()) if arr.size else 0
        run = np.maximum.accumulate(self.time(np.arange(top + 1)))
        return run[arr.astype(np.int64)]

    def as_piecewise(self, upper: int) -> PiecewiseModel:
        """The model sampled at every batch size ``1..upper`` (what :func:`hetlb.allocate` takes)."""
        b = np.arange(1, max(int(upper), 2) + 1)
        return PiecewiseModel(b, self.time(b))

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": "worker", "model": self.base.to_dict(), "speed": self.speed,
                "saturation": self.saturation, "overhead": self.overhead}

    def __repr__(self) -> str:
        return (f"WorkerModel({self.base!r}, speed={self.speed}, saturation={self.saturation}, "
                f"overhead={self.overhead})")


#: The fields of each ``to_dict`` kind (``worker``: :class:`WorkerModel`).
_MODEL_FIELDS = {"linear": ("a0", "a1"), "poly": ("coeffs",), "piecewise": ("batch_sizes", "times"),
                 "worker": ("model", "speed", "saturation", "overhead")}


#: Most micro-step counts a :func:`micro_step_model` places points for; beyond, every few
#: counts (the staircase of intercepts is then a line to well under a micro-step's time).
MICRO_POINTS = 4096


def micro_step_model(base: TimeModel, limit: int, total: int) -> PiecewiseModel:
    """The time of a batch of ``b`` samples run as ``k = ceil(b / limit)`` near-equal micro-steps
    (:meth:`hetlb.Balancer.micro_steps`), each costing ``base``'s effective time of its size:
    ``k`` intercepts, so ``T(b) = k * a0 + a1 * b`` for a linear ``base``.

    Exact at the first and last batch of every count ``k`` up to ``ceil(total / limit)`` (and at
    the middle, for a ``base`` that is not linear), linear in between: exact at every integer for
    a linear ``base``. Past :data:`MICRO_POINTS` counts only some counts get points.
    """
    if not isinstance(base, TimeModel):
        raise ValueError(f"micro_step_model: base must be a hetlb time model, got {base!r}")
    if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 1:
        raise ValueError(f"micro_step_model: limit must be an integer >= 1, got {limit!r}")
    if isinstance(total, bool) or not isinstance(total, (int, np.integer)) or total < 1:
        raise ValueError(f"micro_step_model: total must be an integer >= 1, got {total!r}")
    limit, total = int(limit), int(total)
    last = -(-total // limit)
    ks = np.arange(1, last + 1, dtype=np.int64) if last <= MICRO_POINTS else \
        np.unique(np.linspace(1, last, MICRO_POINTS).astype(np.int64))
    ends = [(ks - 1) * limit + 1, np.minimum(ks * limit, total)]
    if not isinstance(base, LinearModel):
        ends.append((ends[0] + ends[1]) // 2)
    b = np.unique(np.concatenate(ends))
    k = -(-b // limit)
    q, r = b // k, b % k  # r chunks of q + 1 samples, k - r of q
    t = r * base.effective_time(q + 1) + (k - r) * base.effective_time(q)
    return PiecewiseModel(b, t)


def lesser_model(a: TimeModel, b: TimeModel, points: Sequence[float]) -> PiecewiseModel:
    """``min(a(x), b(x))`` as a :class:`PiecewiseModel`, exact at every integer ``x`` from the
    least to the greatest of ``points`` (numbers >= 1) where ``a`` and ``b`` are both linear
    between consecutive points (e.g. the union of two :func:`micro_step_model` models' batch
    sizes): between two points the lesser of two lines changes line once, so its integers on
    either side of the crossing are added. Beyond the points it extends the last segment.

    The time of a rank that may run its batch in either of two ways (plainly or recomputing,
    :class:`hetlb.train.recompute.Recompute`) and takes the faster one."""
    x = np.unique(np.asarray(points, dtype=np.float64))
    if x.size == 0 or not np.all(np.isfinite(x)) or x[0] < 1:
        raise ValueError(f"lesser_model: points must be finite numbers >= 1, got {points!r}")
    d = a.time(x) - b.time(x)  # (linear on each segment: one root where the sign changes)
    sign = np.sign(d)
    flip = np.nonzero(sign[:-1] * sign[1:] < 0)[0]
    root = x[flip] + (x[flip + 1] - x[flip]) * (d[flip] / (d[flip] - d[flip + 1]))
    x = np.unique(np.concatenate([x, np.floor(root), np.ceil(root)]))
    return PiecewiseModel(x, np.minimum(a.time(x), b.time(x)))


def model_from_dict(d: Dict[str, Any]) -> TimeModel:
    """Inverse of ``TimeModel.to_dict``. Raises ``ValueError`` for an unknown kind, a missing
    field or one the kind does not have (a misspelt or misplaced setting must not be ignored)."""
    if not isinstance(d, Mapping):
        raise ValueError(f"a time model is a dict from TimeModel.to_dict(), got {type(d).__name__}")
    kind = d.get("kind")
    if not isinstance(kind, str) or kind not in _MODEL_FIELDS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {', '.join(_MODEL_FIELDS)}")
    extra = sorted(str(k) for k in set(d) - {"kind", *_MODEL_FIELDS[kind]})
    if extra:
        raise ValueError(f"a {kind} model has no field(s) {extra}; its fields: "
                         f"{', '.join(_MODEL_FIELDS[kind])}")
    needed = ("model",) if kind == "worker" else _MODEL_FIELDS[kind]
    missing = [k for k in needed if k not in d]
    if missing:
        raise ValueError(f"a {kind} model needs {missing}")
    if kind == "worker":
        return WorkerModel(model_from_dict(d["model"]), d.get("speed", 1.0),
                           d.get("saturation", 0.0), d.get("overhead", 0.0))
    if kind == "linear":
        return LinearModel(d["a0"], d["a1"])
    if kind == "poly":
        return PolyModel(d["coeffs"])
    return PiecewiseModel(d["batch_sizes"], d["times"])
