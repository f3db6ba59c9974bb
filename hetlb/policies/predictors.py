"""Per-rank speed predictors for LB-BSP's CPU mode (LB-BSP section 3.2.2, Table 3).

A predictor observes one step at a time (:meth:`SpeedPredictor.update` with a
:class:`~hetlb.telemetry.StepRecord`) and predicts every rank's sample processing speed
``v = batch / compute`` (samples/s) for the next step (:meth:`SpeedPredictor.predict`).
All three work on the whole world at once, one independent series per rank:

* :class:`Memoryless`: the last observed speed.
* :class:`EMA`: exponential moving average, ``alpha`` = weight of the latest observation
  (paper: 0.2).
* :class:`NARX`: Eq. 4, ``v^k = F(v^{k-1..k-d}, c^{k..k-d}, m^{k..k-d})``, one small
  one-hidden-layer network per rank, trained online after a warm-up (paper: 500 iterations,
  look-back 2, early stopping) and falling back to an EMA before it.

Telemetry alignment: record ``j`` carries the speed of step ``j`` and the CPU / memory usage
measured over that step, which is the freshest reading available when step ``j + 1`` is
decided. That reading is the paper's "current" usage ``c^k`` for step ``k = j + 1`` (its workers
push ``<t^{k-1}, c^k, m^k>`` at the start of iteration ``k``), so NARX pairs target ``v_j`` with
``c_{j-1}, c_{j-2}, ...``. ``predict(cpu=..., memory=...)`` may pass a fresher reading in the
"current" slot; the default is the latest record's.

A rank that had no samples in a step (speed 0) contributes no observation for that step; its
prediction stays what it was. A rank never observed is predicted at the mean of the observed
ones (all zeros when nothing was observed: :func:`hetlb.allocate_proportional` then splits
equally).

Determinism: predictions are a pure function of the observed records. NARX initialises from a
private ``torch.Generator`` seeded by ``seed`` (never the global RNG) and trains full-batch
on one intra-op thread (set for the duration of a fit and restored), so two instances
fed the same records predict bit-identical values.
"""
from __future__ import annotations

import contextlib
import copy
import math
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from ..telemetry import StepRecord, validate_record

__all__ = ["SpeedPredictor", "Memoryless", "EMA", "NARX", "predictor_from_state"]

#: NARX network precision. float32 halves the cost of a fit (the tanh and its gradient dominate)
#: and a 1e-7 relative error is far below the noise of a measured speed.
_DTYPE = torch.float32


def _check_count(value: Any, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_alpha(alpha: Any) -> float:
    a = float(alpha)
    if not (0.0 < a <= 1.0):  # also rejects NaN
        raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
    return a


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch on one intra-op thread for the duration (restored after).

    Why: a multi-threaded reduction may split a sum differently with a different thread count,
    and every rank must train bit-identical weights; the tensors are far too small for threads
    to pay off, and OpenMP workers spinning on a loaded 2-core machine made a fit 10x slower.
    """
    n = torch.get_num_threads()
    if n != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n != 1:
            torch.set_num_threads(n)


class SpeedPredictor:
    """Base class: per-rank speed series of one world, observed one step at a time.

    Subclasses implement :meth:`_observe` and :meth:`_predict`; the base class checks the
    telemetry, tracks the world size, the latest CPU / memory readings and which ranks have been
    observed at all.
    """

    #: Short name for logs and tables.
    name: str = "predictor"

    def __init__(self) -> None:
        self.world: Optional[int] = None
        self.count = 0  # records observed
        self.seen: Optional[np.ndarray] = None  # bool [world]: rank had samples at least once
        self.cpu: Optional[np.ndarray] = None  # latest readings, the default "current" ones
        self.memory: Optional[np.ndarray] = None

    # -- protocol ---------------------------------------------------------------------------

    def reset(self, world: int) -> None:
        """Forget everything and expect records of ``world`` ranks."""
        self.world = _check_count(world, f"{self.name}: world", 1)
        self.count = 0
        self.seen = np.zeros(self.world, bool)
        self.cpu = np.zeros(self.world)
        self.memory = np.zeros(self.world)
        self._reset()

    def update(self, record: StepRecord) -> None:
        """Observe one completed step.

        Raises:
            ValueError: unusable telemetry (NaN / inf / negative compute time, zero time with
                samples, non-finite CPU or memory) or a record of another world size.
        """
        if self.world is None:
            self.reset(record.world)
        if record.world != self.world:
            raise ValueError(f"{self.name}: record has {record.world} ranks, predictor tracks "
                             f"{self.world}")
        validate_record(record)
        cpu = np.asarray(record.cpu, np.float64)
        mem = np.asarray(record.memory, np.float64)
        bad = [r for r in range(self.world) if not (math.isfinite(cpu[r]) and math.isfinite(mem[r]))]
        if bad:
            raise ValueError(f"step {record.step}: non-finite CPU/memory usage from ranks {bad} "
                             f"(cpu={cpu.tolist()}, memory={mem.tolist()})")
        valid = np.asarray(record.batch) > 0
        speed = np.where(valid, record.speed, 0.0).astype(np.float64)
        self._observe(speed, valid, cpu, mem)
        self.seen |= valid
        self.cpu, self.memory = cpu.copy(), mem.copy()
        self.count += 1

    def predict(self, cpu: Optional[np.ndarray] = None,
                memory: Optional[np.ndarray] = None) -> np.ndarray:
        """Predicted speed (samples/s, >= 0) of every rank in the next step.

        Args:
            cpu, memory: current usage readings ``[world]`` (default: the latest observed).
                Only :class:`NARX` uses them.
        """
        if self.world is None:
            raise ValueError(f"{self.name}.predict: no observations yet; call update() or "
                             f"reset(world) first")
        cpu = self.cpu if cpu is None else self._reading(cpu, "cpu")
        memory = self.memory if memory is None else self._reading(memory, "memory")
        v = np.asarray(self._predict(cpu, memory), np.float64).copy()
        if self.seen.any():
            # A rank never observed gets the others' mean: neutral, not zero (which would pin it
            # to its lower bound forever) and not a guess that could unbalance the step.
            v[~self.seen] = float(v[self.seen].mean())
        else:
            v[:] = 0.0
        return np.maximum(v, 0.0)

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to continue predicting identically (plain Python values)."""
        state: Dict[str, Any] = {"type": type(self).__name__}
        for k, v in vars(self).items():
            if k.startswith("_"):
                continue
            state[k] = v.tolist() if isinstance(v, np.ndarray) else copy.deepcopy(v)
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (of the same predictor class)."""
        kind = state.get("type", type(self).__name__)
        if kind != type(self).__name__:
            raise ValueError(f"{self.name}: state is of a {kind} predictor, not {type(self).__name__}")
        world = state.get("world")
        if world is None:
            self.__init__(**self._config())  # type: ignore[misc]
            return
        self.reset(int(world))
        for k, v in state.items():
            if k in ("type",):
                continue
            cur = getattr(self, k, None)
            if isinstance(cur, np.ndarray):
                setattr(self, k, np.asarray(v, dtype=cur.dtype).reshape(cur.shape))
            else:
                setattr(self, k, copy.deepcopy(v))
        self._restored()

    # -- hooks ------------------------------------------------------------------------------

    def _config(self) -> Dict[str, Any]:
        return {}

    def _reset(self) -> None:
        pass

    def _restored(self) -> None:
        pass

    def _observe(self, speed: np.ndarray, valid: np.ndarray, cpu: np.ndarray, memory: np.ndarray) -> None:
        raise NotImplementedError

    def _predict(self, cpu: np.ndarray, memory: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _reading(self, x: Any, what: str) -> np.ndarray:
        a = np.asarray(x, dtype=np.float64)
        if a.shape != (self.world,) or not np.all(np.isfinite(a)):
            raise ValueError(f"{self.name}.predict: {what} must be {self.world} finite numbers, "
                             f"got {np.asarray(x).tolist()}")
        return a


class Memoryless(SpeedPredictor):
    """The last observed speed of each rank (Table 3's "memoryless")."""

    name = "memoryless"

    def _reset(self) -> None:
        self.value = np.zeros(self.world)

    def _observe(self, speed: np.ndarray, valid: np.ndarray, cpu: np.ndarray, memory: np.ndarray) -> None:
        self.value = np.where(valid, speed, self.value)

    def _predict(self, cpu: np.ndarray, memory: np.ndarray) -> np.ndarray:
        return self.value


class EMA(SpeedPredictor):
    """Exponential moving average ``s <- alpha * v + (1 - alpha) * s`` per rank.

    Args:
        alpha: weight of the latest observation (paper, Table 3: 0.2). A rank's first
            observation initialises its average.
    """

    name = "ema"

    def __init__(self, alpha: float = 0.2) -> None:
        super().__init__()
        self.alpha = _check_alpha(alpha)

    def _config(self) -> Dict[str, Any]:
        return {"alpha": self.alpha}

    def _reset(self) -> None:
        self.value = np.zeros(self.world)

    def _observe(self, speed: np.ndarray, valid: np.ndarray, cpu: np.ndarray, memory: np.ndarray) -> None:
        first = valid & ~self.seen
        upd = self.alpha * speed + (1.0 - self.alpha) * self.value
        self.value = np.where(first, speed, np.where(valid, upd, self.value))

    def _predict(self, cpu: np.ndarray, memory: np.ndarray) -> np.ndarray:
        return self.value


class NARX(EMA):
    """Nonlinear autoregressive model with exogenous inputs (LB-BSP Eq. 4), one per rank.

    Each rank has its own network ``y = W2 tanh(W1 x + b1) + b2`` (one hidden layer) with inputs
    the last ``lookback`` speeds and the current plus ``lookback`` past CPU and memory readings.
    Speeds are divided by the rank's mean speed over the training window and CPU/memory are
    centred and scaled by their spread (at least 0.05), frozen at each (re)training, so one
    learning rate suits every rank and world.

    Online training: the first fit happens after ``warmup`` observations, then every
    ``retrain_every`` observations, on the latest ``max_samples`` steps (the newest
    ``val_fraction`` of them held out for early stopping), full-batch Adam for at most ``epochs``
    epochs, stopping after ``patience`` epochs without validation improvement on any rank and
    keeping each rank's best weights. Each retraining starts from the previous weights (the
    paper's "model reusing"). Before the first fit, and for any rank whose network does worse
    than the EMA on its validation steps, that had too few usable windows (a rank that often
    sits steps out) or whose last ``lookback`` steps had no samples, the prediction is the EMA
    of ``alpha`` (the paper's warm-up fallback). Network predictions are clipped to
    ``[0.5 * min, 2 * max]`` of the speeds seen in the training window.

    Cost: a fit runs at most ``epochs`` passes over ``[world, max_samples, inputs]`` (about
    0.3 s at 4 ranks and 3 s at 64 ranks on one core when early stopping never triggers), once
    every ``retrain_every`` steps inside :meth:`update`; a prediction is well under a
    millisecond.

    Args:
        lookback: look-back window ``d`` for all three series (paper: 2).
        hidden: hidden units (one hidden layer, paper).
        warmup: observations before the first fit (paper: 500).
        retrain_every: observations between fits after the warm-up.
        max_samples: most recent steps kept for training.
        epochs, patience, lr: Adam epochs, early-stopping patience, learning rate.
        val_fraction: share of the (time-ordered) samples held out for early stopping.
        alpha: EMA weight of the fallback.
        seed: seed of the private generator that initialises the weights.
    """

    name = "narx"

    def __init__(self, lookback: int = 2, hidden: int = 16, warmup: int = 500,
                 retrain_every: int = 100, max_samples: int = 500, epochs: int = 300,
                 patience: int = 20, lr: float = 0.01, val_fraction: float = 0.2,
                 alpha: float = 0.2, seed: int = 0) -> None:
        super().__init__(alpha)
        self.lookback = _check_count(lookback, "NARX: lookback", 1)
        self.hidden = _check_count(hidden, "NARX: hidden", 1)
        self.warmup = _check_count(warmup, "NARX: warmup", 0)
        self.retrain_every = _check_count(retrain_every, "NARX: retrain_every", 1)
        self.max_samples = _check_count(max_samples, "NARX: max_samples", 8)
        self.epochs = _check_count(epochs, "NARX: epochs", 1)
        self.patience = _check_count(patience, "NARX: patience", 1)
        self.seed = _check_count(seed, "NARX: seed", 0)
        lr, vf = float(lr), float(val_fraction)
        if not (lr > 0 and math.isfinite(lr)):
            raise ValueError(f"NARX: lr must be a finite number > 0, got {lr!r}")
        if not (0.0 < vf < 1.0):
            raise ValueError(f"NARX: val_fraction must be in (0, 1), got {val_fraction!r}")
        self.lr, self.val_fraction = lr, vf

    def _config(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in ("lookback", "hidden", "warmup", "retrain_every",
                                              "max_samples", "epochs", "patience", "lr",
                                              "val_fraction", "alpha", "seed")}

    @property
    def inputs(self) -> int:
        """Network inputs: ``d`` past speeds, ``d + 1`` CPU and ``d + 1`` memory readings."""
        return 3 * self.lookback + 2

    @property
    def trained(self) -> bool:
        """Whether any rank currently predicts with its network (else all use the EMA)."""
        use = getattr(self, "use", None)
        return bool(use is not None and np.any(use))

    # -- state ------------------------------------------------------------------------------

    def _reset(self) -> None:
        super()._reset()
        # Observation buffer, one row per step: speed, had-samples, cpu, memory.
        self.buf_v: List[List[float]] = []
        self.buf_ok: List[List[bool]] = []
        self.buf_c: List[List[float]] = []
        self.buf_m: List[List[float]] = []
        self.use = np.zeros(self.world, bool)  # rank predicts with its network
        self.weights: Optional[Dict[str, Any]] = None  # W1, b1, W2, b2 as nested lists
        self.norm: Optional[Dict[str, Any]] = None  # per-rank input scaling of the last fit
        self.fits = 0
        self._params: Optional[List[torch.Tensor]] = None

    def _restored(self) -> None:
        self._params = None  # rebuilt from self.weights on first use

    def _tensors(self) -> List[torch.Tensor]:
        if self._params is None:
            if self.weights is None:
                self._params = self._init_params()
            else:
                self._params = [torch.tensor(self.weights[k], dtype=_DTYPE)
                                for k in ("W1", "b1", "W2", "b2")]
        return self._params

    def _init_params(self) -> List[torch.Tensor]:
        # PyTorch's default Linear init, drawn from a private generator: nothing global is used.
        g = torch.Generator().manual_seed(self.seed)
        R, I, H = self.world, self.inputs, self.hidden
        k1, k2 = 1.0 / math.sqrt(I), 1.0 / math.sqrt(H)

        def u(shape: Tuple[int, ...], k: float) -> torch.Tensor:
            return (torch.rand(shape, generator=g, dtype=_DTYPE) * 2.0 - 1.0) * k

        return [u((R, I, H), k1), u((R, H), k1), u((R, H), k2), u((R,), k2)]

    # -- observe / predict ------------------------------------------------------------------

    def _observe(self, speed: np.ndarray, valid: np.ndarray, cpu: np.ndarray, memory: np.ndarray) -> None:
        super()._observe(speed, valid, cpu, memory)
        keep = self.max_samples + self.lookback + 1
        for buf, row in ((self.buf_v, speed.tolist()), (self.buf_ok, valid.tolist()),
                         (self.buf_c, cpu.tolist()), (self.buf_m, memory.tolist())):
            buf.append(row)
            if len(buf) > keep:
                del buf[0]
        n = self.count + 1  # this observation included (the base class counts after us)
        if n >= self.warmup and (n - self.warmup) % self.retrain_every == 0:
            self._fit()

    def _predict(self, cpu: np.ndarray, memory: np.ndarray) -> np.ndarray:
        ema = super()._predict(cpu, memory)
        d = self.lookback
        if not self.trained or len(self.buf_v) < d + 1:
            return ema
        v = np.asarray(self.buf_v[-d:], np.float64)  # [d, R], oldest first
        ok = np.asarray(self.buf_ok[-d:], bool).all(axis=0)
        # Current reading in the slot of the latest record's, then the d before it.
        c = np.vstack([np.asarray(self.buf_c[-d - 1:-1], np.float64), cpu[None, :]])
        m = np.vstack([np.asarray(self.buf_m[-d - 1:-1], np.float64), memory[None, :]])
        x = self._features(v, c, m)  # [R, 1, I]
        with torch.no_grad():
            y = self._forward(self._tensors(), torch.from_numpy(x).to(_DTYPE))[:, 0].double().numpy()
        scale = np.asarray(self.norm["v"], np.float64)
        pred = (1.0 + y) * scale
        # A small network extrapolates badly: keep it within the range it was trained on.
        pred = np.clip(pred, 0.5 * np.asarray(self.norm["vmin"]), 2.0 * np.asarray(self.norm["vmax"]))
        return np.where(self.use & ok, pred, ema)

    # -- the network ------------------------------------------------------------------------

    def _features(self, v: np.ndarray, c: np.ndarray, m: np.ndarray) -> np.ndarray:
        """Normalised inputs ``[R, N, I]`` from windows ``v [.., d, R]``, ``c, m [.., d+1, R]``
        (oldest first; leading sample axes allowed)."""
        nv = np.asarray(self.norm["v"]); nc = np.asarray(self.norm["c"]); nm = np.asarray(self.norm["m"])
        sc = np.asarray(self.norm["sc"]); sm = np.asarray(self.norm["sm"])
        fv = v / nv - 1.0
        fc = (c - nc) / sc
        fm = (m - nm) / sm
        x = np.concatenate([fv, fc, fm], axis=-2)  # [..., I, R]
        x = np.moveaxis(x, -1, 0)  # [R, ..., I]
        if x.ndim == 2:
            x = x[:, None, :]
        return np.ascontiguousarray(x, dtype=np.float64)

    @staticmethod
    def _forward(p: List[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``[R, N, I] -> [R, N]``, every rank with its own weights."""
        W1, b1, W2, b2 = p
        h = torch.tanh(torch.bmm(x, W1) + b1[:, None, :])
        return (h * W2[:, None, :]).sum(-1) + b2[:, None]

    def _dataset(self) -> Optional[Tuple[np.ndarray, ...]]:
        """Windows over the buffer: targets ``v_j`` with inputs ``v_{j-1..j-d}`` and current
        plus past readings ``c_{j-1..j-1-d}``, ``m_{j-1..j-1-d}``; and which are usable."""
        d = self.lookback
        V = np.asarray(self.buf_v, np.float64)
        OK = np.asarray(self.buf_ok, bool)
        C = np.asarray(self.buf_c, np.float64)
        M = np.asarray(self.buf_m, np.float64)
        n = V.shape[0]
        N = n - d - 1
        if N < 2:
            return None
        j = np.arange(d + 1, n)
        lag_v = np.stack([V[j - l] for l in range(d, 0, -1)], axis=1)  # [N, d, R]
        lag_c = np.stack([C[j - l] for l in range(d + 1, 0, -1)], axis=1)  # [N, d+1, R]
        lag_m = np.stack([M[j - l] for l in range(d + 1, 0, -1)], axis=1)
        ok = OK[j] & np.stack([OK[j - l] for l in range(1, d + 1)], axis=0).all(axis=0)  # [N, R]
        return lag_v, lag_c, lag_m, V[j], ok

    def _fit(self) -> None:
        with _one_thread():
            self._fit_inner()

    def _fit_inner(self) -> None:
        data = self._dataset()
        if data is None:
            return
        lag_v, lag_c, lag_m, target, ok = data
        R, N = self.world, target.shape[0]
        V = np.asarray(self.buf_v, np.float64)
        OKb = np.asarray(self.buf_ok, bool)
        C = np.asarray(self.buf_c, np.float64)
        M = np.asarray(self.buf_m, np.float64)
        # Input scaling of this fit: mean speed, mean and spread of CPU / memory per rank.
        cnt = np.maximum(OKb.sum(0), 1)
        vmean = np.where(OKb.any(0), (V * OKb).sum(0) / cnt, 1.0)
        vmean = np.where(vmean > 0, vmean, 1.0)
        big = np.where(OKb, V, -np.inf).max(0)
        small = np.where(OKb, V, np.inf).min(0)
        self.norm = {"v": vmean.tolist(), "c": C.mean(0).tolist(), "m": M.mean(0).tolist(),
                     "sc": np.maximum(C.std(0), 0.05).tolist(), "sm": np.maximum(M.std(0), 0.05).tolist(),
                     "vmax": np.where(np.isfinite(big), big, vmean).tolist(),
                     "vmin": np.where(np.isfinite(small), small, vmean).tolist()}
        x = torch.from_numpy(self._features(lag_v, lag_c, lag_m)).to(_DTYPE)  # [R, N, I]
        y = torch.from_numpy(np.ascontiguousarray((target / vmean - 1.0).T)).to(_DTYPE)  # [R, N]
        n_val = max(1, int(round(N * self.val_fraction)))
        is_val = np.zeros(N, bool)
        is_val[N - n_val:] = True
        tr = torch.from_numpy(np.ascontiguousarray((ok & ~is_val[:, None]).T)).to(_DTYPE)
        va = torch.from_numpy(np.ascontiguousarray((ok & is_val[:, None]).T)).to(_DTYPE)
        ntr, nva = tr.sum(1), va.sum(1)
        # Too few samples to learn from (a rank that mostly sat steps out): keep its EMA.
        able = (ntr >= 2 * self.inputs) & (nva >= 4)
        if not bool(able.any()):
            self.use = np.zeros(R, bool)
            return
        params = [p.detach().clone().requires_grad_(True) for p in self._tensors()]
        # Plain Adam written out: no torch.optim import (it pulls in torch._dynamo, seconds
        # on first use) and the update order is fixed here, not by optimizer defaults.
        mom = [torch.zeros_like(p) for p in params]
        sec = [torch.zeros_like(p) for p in params]
        b1, b2, eps = 0.9, 0.999, 1e-8
        best = [p.detach().clone() for p in params]
        best_val = torch.full((R,), math.inf, dtype=_DTYPE)
        since = torch.zeros(R, dtype=torch.int64)
        wtr, wva = tr / ntr.clamp(min=1)[:, None], va / nva.clamp(min=1)[:, None]
        for epoch in range(self.epochs + 1):
            err = self._forward(params, x) - y
            sq = err * err
            with torch.no_grad():
                # One forward serves both: the validation loss of the weights before this step.
                val = (sq.detach() * wva).sum(1)
                better = (val < best_val) & able
                if bool(better.any()):
                    for b, p in zip(best, params):
                        b[better] = p.detach()[better]
                    best_val = torch.where(better, val, best_val)
                since = torch.where(better, torch.zeros_like(since), since + 1)
            if epoch == self.epochs or bool((since[able] >= self.patience).all()):
                break
            # Sum over ranks of each rank's own mean: gradients stay separate per rank.
            grads = torch.autograd.grad((sq * wtr).sum(), params)
            with torch.no_grad():
                c1, c2 = 1.0 - b1 ** (epoch + 1), 1.0 - b2 ** (epoch + 1)
                for p, g, m1, m2 in zip(params, grads, mom, sec):
                    m1.mul_(b1).add_(g, alpha=1.0 - b1)
                    m2.mul_(b2).addcmul_(g, g, value=1.0 - b2)
                    p.sub_(self.lr * (m1 / c1) / ((m2 / c2).sqrt() + eps))
        self._params = [b.detach().clone() for b in best]
        self.weights = {k: t.tolist() for k, t in zip(("W1", "b1", "W2", "b2"), self._params)}
        self.fits += 1
        # Keep the network only where it beats the fallback on the held-out steps.
        ema_val = self._ema_val_error(V, OKb, vmean, ok, is_val, N)
        self.use = (able.numpy() & (best_val.double().numpy() < ema_val)).copy()

    def _ema_val_error(self, V: np.ndarray, OK: np.ndarray, vmean: np.ndarray, ok: np.ndarray,
                       is_val: np.ndarray, N: int) -> np.ndarray:
        """Mean squared error (normalised units) of the EMA's one-step predictions on the
        validation targets, per rank."""
        d = self.lookback
        s = np.zeros(self.world)
        have = np.zeros(self.world, bool)
        preds = np.zeros((V.shape[0], self.world))
        for i in range(V.shape[0]):
            preds[i] = s
            s = np.where(OK[i], np.where(have, self.alpha * V[i] + (1 - self.alpha) * s, V[i]), s)
            have |= OK[i]
        j = np.arange(d + 1, V.shape[0])
        e = (preds[j] - V[j]) / vmean
        w = ok & is_val[:, None]
        return np.where(w.any(0), (e * e * w).sum(0) / np.maximum(w.sum(0), 1), math.inf)


_PREDICTORS = {"Memoryless": Memoryless, "EMA": EMA, "NARX": NARX}


def predictor_from_state(state: Dict[str, Any]) -> SpeedPredictor:
    """Rebuild a predictor from :meth:`SpeedPredictor.state_dict` output."""
    kind = state.get("type")
    if kind not in _PREDICTORS:
        raise ValueError(f"unknown predictor type {kind!r}; expected one of {sorted(_PREDICTORS)}")
    cls = _PREDICTORS[kind]
    p = cls(**{k: state[k] for k in cls()._config() if k in state})
    p.load_state_dict(state)
    return p
