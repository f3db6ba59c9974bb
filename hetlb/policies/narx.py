"""LB-BSP's NARX speed predictor (Eq. 4), one per worker, trained on that worker's own history.

``v^k = F(v^{k-1..k-d}, c^{k..k-d}, m^{k..k-d})``: a one-hidden-layer network over the worker's
past sample-processing speeds ``v`` and its current and past CPU (``c``) and memory (``m``) usage,
look-back ``d = 2``, trained online once 500 iterations are seen, with early stopping and reuse of
the previous weights (LB-BSP 3.2.2 and 4). The paper keeps "a NARX model for each worker"; here
each rank fits its own, in a background thread, and publishes its prediction in its telemetry row
(``predicted``); :class:`hetlb.policies.LBBSP` splits the global batch by those shared numbers, so
the policy stays a pure function of the table and no rank waits for a fit.

Alignment with hetlb's step: the row of step ``t`` is built when step ``t`` starts and the decision
it informs sizes step ``t + 1``. At that moment the rank has observed its records up to ``t - 1``
(its speeds and the CPU load over those steps) and reads its memory now. So the network learns
``v_{t+1}`` from ``v_{t-1..t-d}``, ``c_{t-1..t-1-d}`` and ``m_{t..t-d}`` (``m_t``: memory at the
start of step ``t``, as its record carries it).

By default the predictor is the paper's: until the first fit (``warmup`` observations, 500) the
prediction is NaN and LB-BSP uses its own EMA of the shared speeds ("within the first 500
iterations, we can use EMA"); from the first fit on, the network's prediction, always (NaN only
where a speed it needs is missing). Two opt-in safeguards, not in the paper, hand a rank back to
the EMA (prediction NaN) where the network does worse than it (``bench/bench_narx_guard.py``
compares the four combinations after a speed change):

* ``fit_check=True``: at each fit, the network is kept only if it beat the EMA on the held-out
  steps (mean squared error without the largest tenth of each one's errors: a speed change
  among them must not excuse a biased fit);
* ``guard=k`` (e.g. 5): between fits, while the network's predictions of the latest ``k`` steps
  erred more than twice as much, in sum, as the EMA's did (twice: on steady speeds the two err
  alike, and the network should not flap to the EMA on noise). A network fitted on steady speeds
  learns to ignore its inputs and keeps a rank's old speed until the next fit (up to
  ``retrain_every`` steps: a rank slowed 3x kept 2.5x its batch for about 100 steps); the guard
  hands that rank to the EMA within about 8 steps.

The fitted weights are not checkpointed: they are rebuilt from the telemetry history the
Balancer saves (:meth:`NARX.rebuild`), which holds every rank's series.
"""
from __future__ import annotations

import logging
import math
import os
import threading
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from hetlb.core.checks import flag, integer, number
from hetlb.core.telemetry import History, StepRecord


__all__ = ["NARX"]

log = logging.getLogger("hetlb.policies")

#: What a checkpoint's NARX configuration without the key means: those written before the
#: setting was recorded ran the guard over 5 steps and the fit-time check (the defaults then).
_LEGACY = {"guard": 5, "fit_check": True}

#: float32 halves a fit's cost; 1e-7 relative error is far below the noise of a measured speed.
_DTYPE = torch.float32


def _trimmed_mse(err: np.ndarray, trim: float = 0.1) -> float:
    """Mean squared error without the largest ``trim`` share of the errors."""
    sq = np.sort(np.square(np.asarray(err, np.float64)))
    keep = max(1, int(math.ceil(sq.size * (1.0 - trim))))
    return float(sq[:keep].mean())


class NARX:
    """One rank's NARX predictor (see the module docstring); the instance given to
    ``LBBSP("cpu", predictor=NARX(...))`` is a template, copied per rank by :meth:`for_rank`.

    Args:
        lookback: look-back window ``d`` for all three series (paper: 2).
        hidden: hidden units (one hidden layer, paper).
        warmup: observations before the first fit (paper: 500).
        retrain_every: observations between fits after the warm-up (weights are reused).
        max_samples: most recent steps kept for training.
        epochs, patience, lr: full-batch Adam epochs, early-stopping patience (on the newest
            ``val_fraction`` of the steps), learning rate.
        val_fraction: share of the (time-ordered) samples held out for early stopping.
        alpha: weight of the latest observation in the EMA baseline that ``fit_check`` and
            ``guard`` compare the network with.
        seed: seed of the private generator that initialises the weights.
        background: fit in a background thread (default) rather than inside :meth:`observe`.
        fit_check: opt-in, not in the paper (default False: the paper's): at each fit, use the
            network only if it beat the EMA baseline on the held-out steps.
        guard: opt-in, not in the paper (default 0: the paper's): steps over which the network's
            recent errors are compared with the EMA baseline's between fits (e.g. 5); while they
            are more than twice the EMA's, the prediction is NaN (LB-BSP's EMA decides).

    Attributes:
        fits: completed fits; ``use``: whether the latest fit is used (always, unless
            ``fit_check`` refused it).
    """

    name = "narx"

    def __init__(self, lookback: int = 2, hidden: int = 16, warmup: int = 500,
                 retrain_every: int = 100, max_samples: int = 500, epochs: int = 300,
                 patience: int = 20, lr: float = 0.01, val_fraction: float = 0.2,
                 alpha: float = 0.2, seed: int = 0, background: bool = True, guard: int = 0,
                 fit_check: bool = False) -> None:
        self.lookback = integer(lookback, "NARX: lookback", 1)
        self.hidden = integer(hidden, "NARX: hidden", 1)
        self.warmup = integer(warmup, "NARX: warmup", 0)
        self.retrain_every = integer(retrain_every, "NARX: retrain_every", 1)
        self.max_samples = integer(max_samples, "NARX: max_samples", 8)
        self.epochs = integer(epochs, "NARX: epochs", 1)
        self.patience = integer(patience, "NARX: patience", 1)
        self.seed = integer(seed, "NARX: seed", 0)
        self.lr = number(lr, "NARX: lr", above=0.0)
        self.val_fraction = number(val_fraction, "NARX: val_fraction", above=0.0, below=1.0)
        self.alpha = number(alpha, "NARX: alpha", above=0.0, maximum=1.0)
        self.background = flag(background, "NARX: background")
        self.guard = integer(guard, "NARX: guard", 0)
        self.fit_check = flag(fit_check, "NARX: fit_check")
        self._clear()

    def _arguments(self) -> Dict[str, Any]:
        """Every constructor argument, as this instance holds it."""
        return {k: getattr(self, k) for k in ("lookback", "hidden", "warmup", "retrain_every",
                                              "max_samples", "epochs", "patience", "lr",
                                              "val_fraction", "alpha", "seed", "background",
                                              "guard", "fit_check")}

    def config(self) -> Dict[str, Any]:
        """The constructor arguments (plain values), as checkpoints and the ranks' start-up
        comparison hold them: ``guard`` and ``fit_check`` only where they differ from what a
        configuration without them meant (guard 5 and the fit check, the defaults until they
        became opt-in), so an older checkpoint still reads as what it ran. Rebuild with
        :meth:`from_config`."""
        return {k: v for k, v in self._arguments().items() if k not in _LEGACY or v != _LEGACY[k]}

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "NARX":
        """The predictor of a :meth:`config` (also one written before ``guard`` and
        ``fit_check`` were recorded)."""
        return cls(**{**_LEGACY, **config})

    def for_rank(self, rank: int) -> "NARX":
        """A fresh predictor with this configuration, for one rank."""
        p = NARX(**self._arguments())
        p.rank = int(rank)
        return p

    def _clear(self) -> None:
        self.rank: Optional[int] = None
        self.count = 0
        self.fits = 0
        self.use = False
        keep = self.max_samples + 2 * self.lookback + 3
        self._v: list = []  # speed (samples/s) or NaN when the rank had no samples
        self._c: list = []
        self._m: list = []
        self._keep = keep
        self._net: Optional[Tuple[np.ndarray, ...]] = None  # W1, b1, W2, b2 (float64)
        self._norm: Optional[Dict[str, float]] = None
        self._params: Optional[list] = None  # torch weights, reused by the next fit
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        # The guard: predictions awaiting their step ({observation index: (network, EMA)}), the
        # EMA of the speeds observed, and the latest steps' (network, EMA) relative errors.
        self._pending: Dict[int, Tuple[float, float]] = {}
        self._ema = math.nan
        self._recent: list = []
        self._fits_seen = 0

    def __getstate__(self) -> Dict[str, Any]:
        # A copy (copy.deepcopy, pickle) takes the data, not the lock or a running fit's thread.
        with self._lock:
            state = dict(vars(self))
        state["_lock"] = state["_thread"] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        vars(self).update(state)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ observe / predict

    def observe(self, record: StepRecord, rank: int) -> None:
        """This rank's column of a completed step (called by the Balancer after each record)."""
        b, t = int(record.batch[rank]), float(record.compute[rank])
        v = b / t if b > 0 and math.isfinite(t) and t > 0 else math.nan
        guess = self._pending.pop(self.count, None)
        if guess is not None and math.isfinite(v) and v > 0 and self.guard:
            self._recent.append((abs(guess[0] - v) / v, abs(guess[1] - v) / v))
            del self._recent[:-self.guard]
        if math.isfinite(v):
            self._ema = v if math.isnan(self._ema) else self.alpha * v + (1 - self.alpha) * self._ema
        self._v.append(v)
        self._c.append(float(record.cpu[rank]))
        self._m.append(float(record.memory[rank]))
        if len(self._v) > self._keep:
            del self._v[0], self._c[0], self._m[0]
        self.count += 1
        n = self.count
        if n >= self.warmup and (n - self.warmup) % self.retrain_every == 0:
            self._start_fit()

    def rebuild(self, history: History, rank: int) -> None:
        """Reset and re-observe ``rank``'s series from a history (after a checkpoint load); the
        next fit happens at the usual counts."""
        self.wait()
        self.__init__(**self._arguments())  # type: ignore[misc]
        self.rank = int(rank)
        warmup, self.warmup = self.warmup, math.inf  # no fit per replayed record
        try:
            for rec in history:
                self.observe(rec, rank)
        finally:
            self.warmup = warmup
        if self.count >= self.warmup:
            self._start_fit()

    def predict(self, memory: float) -> float:
        """This rank's predicted speed (samples/s) for the step after the one starting now, given
        its memory usage now; NaN before the first fit (or without enough history), and where
        an opted-in ``fit_check`` or ``guard`` hands the rank to the EMA."""
        with self._lock:
            net, norm, use, fits = self._net, self._norm, self.use, self.fits
        if fits != self._fits_seen:  # a new network: its record starts afresh
            self._fits_seen, self._recent = fits, []
        d = self.lookback
        if net is None or not use or len(self._v) < d + 1:
            return math.nan
        x = self._features(np.asarray(self._v[-d:]), np.asarray(self._c[-d - 1:]),
                           np.asarray(self._m[-d:] + [float(memory)]), norm)
        if x is None:
            return math.nan
        W1, b1, W2, b2 = net
        y = float(np.tanh(x @ W1 + b1) @ W2 + b2)
        v = float(min(max((1.0 + y) * norm["v"], 0.5 * norm["vmin"]), 2.0 * norm["vmax"]))
        if self.guard:
            # (for the step after the one starting now: observation count + 1; the EMA as of the
            # records seen, as the fit's baseline is)
            self._pending = {k: g for k, g in self._pending.items() if k > self.count - 2}
            self._pending[self.count + 1] = (v, self._ema)
            recent = self._recent
            if len(recent) == self.guard and sum(e[0] for e in recent) > 2.0 * sum(e[1] for e in recent):
                return math.nan
        return v

    def wait(self) -> None:
        """Wait for a background fit to finish."""
        t = self._thread
        if t is not None:
            t.join()

    # ------------------------------------------------------------------ the network

    def _features(self, v: np.ndarray, c: np.ndarray, m: np.ndarray,
                  norm: Dict[str, float]) -> Optional[np.ndarray]:
        """Normalised inputs from ``v`` (d past speeds), ``c`` (d+1 past CPU loads) and ``m``
        (d past memory readings then the current one), oldest first; None if a speed is
        missing."""
        if not np.all(np.isfinite(v)):
            return None
        return np.concatenate([v / norm["v"] - 1.0, (c - norm["c"]) / norm["sc"],
                               (m - norm["m"]) / norm["sm"]])

    def _dataset(self) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray, Dict[str, float]]]:
        d = self.lookback
        V = np.asarray(self._v[-(self.max_samples + d + 2):], np.float64)
        C = np.asarray(self._c[-(self.max_samples + d + 2):], np.float64)
        M = np.asarray(self._m[-(self.max_samples + d + 2):], np.float64)
        n = V.shape[0]
        ok = np.isfinite(V)
        if ok.sum() < 8:
            return None
        vmean = float(V[ok].mean())
        norm = {"v": vmean if vmean > 0 else 1.0, "c": float(C.mean()), "m": float(M.mean()),
                "sc": max(float(C.std()), 0.05), "sm": max(float(M.std()), 0.05),
                "vmax": float(V[ok].max()), "vmin": float(V[ok].min())}
        xs, ys, base = [], [], []
        ema = math.nan
        emas = np.full(n, math.nan)
        for i in range(n):  # the EMA as of each record (the baseline's 2-step-ahead prediction)
            if ok[i]:
                ema = V[i] if math.isnan(ema) else self.alpha * V[i] + (1 - self.alpha) * ema
            emas[i] = ema
        for t in range(d + 1, n - 1):  # row of step t: records <= t-1 known, memory of t, target t+1
            x = self._features(V[t - d:t], C[t - d - 1:t], M[t - d:t + 1], norm)
            if x is None or not ok[t + 1]:
                continue
            xs.append(x)
            ys.append(V[t + 1] / norm["v"] - 1.0)
            base.append(emas[t - 1] / norm["v"] - 1.0)
        if len(xs) < 8:
            return None
        return np.asarray(xs), np.asarray(ys), np.asarray(base), norm

    def _start_fit(self) -> None:
        data = self._dataset()
        if data is None:
            return
        if not self.background:
            self._fit(*data)
            return
        if self._thread is not None and self._thread.is_alive():
            return  # the previous fit is still running; the next count will try again

        def job() -> None:
            try:
                if hasattr(os, "setpriority"):
                    # Below the training threads: a fit must not slow the step down.
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except OSError:
                pass
            try:
                self._fit(*data)
            except Exception:  # noqa: BLE001 (a failed fit keeps the previous predictor)
                log.exception("NARX: background fit failed; keeping the previous predictor")

        # Not a daemon: the interpreter waits for a running fit at exit (a daemon thread still
        # inside torch when the process finalises aborts it: "terminate called without an
        # active exception", exit code 134, which torchrun takes for a failure).
        self._thread = threading.Thread(target=job, name=f"hetlb-narx-{self.rank}", daemon=False)
        self._thread.start()

    def _fit(self, xs: np.ndarray, ys: np.ndarray, base: np.ndarray, norm: Dict[str, float]) -> None:
        N, I = xs.shape
        n_val = max(2, int(round(N * self.val_fraction)))
        x = torch.from_numpy(xs).to(_DTYPE)
        y = torch.from_numpy(ys).to(_DTYPE)
        tr, va = slice(0, N - n_val), slice(N - n_val, N)
        if self._params is None or self._params[0].shape != (I, self.hidden):
            g = torch.Generator().manual_seed(self.seed)
            k1, k2 = 1.0 / math.sqrt(I), 1.0 / math.sqrt(self.hidden)
            u = lambda shape, k: (torch.rand(shape, generator=g, dtype=_DTYPE) * 2 - 1) * k
            self._params = [u((I, self.hidden), k1), u((self.hidden,), k1), u((self.hidden,), k2), u((), k2)]
        params = [p.detach().clone().requires_grad_(True) for p in self._params]
        mom = [torch.zeros_like(p) for p in params]
        sec = [torch.zeros_like(p) for p in params]
        b1, b2, eps = 0.9, 0.999, 1e-8
        best = [p.detach().clone() for p in params]
        best_val, since = math.inf, 0
        for epoch in range(self.epochs + 1):
            W1, c1, W2, c2 = params
            err = torch.tanh(x @ W1 + c1) @ W2 + c2 - y
            with torch.no_grad():
                val = float((err[va] ** 2).mean())
                if val < best_val:
                    best_val, since = val, 0
                    best = [p.detach().clone() for p in params]
                else:
                    since += 1
            if epoch == self.epochs or since >= self.patience:
                break
            grads = torch.autograd.grad((err[tr] ** 2).mean(), params)
            with torch.no_grad():
                k1_, k2_ = 1.0 - b1 ** (epoch + 1), 1.0 - b2 ** (epoch + 1)
                for p, gr, m1, m2 in zip(params, grads, mom, sec):
                    m1.mul_(b1).add_(gr, alpha=1.0 - b1)
                    m2.mul_(b2).addcmul_(gr, gr, value=1.0 - b2)
                    p.sub_(self.lr * (m1 / k1_) / ((m2 / k2_).sqrt() + eps))
        use = True  # the paper's: the network after the warm-up, whatever its held-out error
        if self.fit_check:
            # The check trims the largest tenth of each predictor's held-out errors: a speed change
            # among the held-out steps gives the EMA a few huge errors, and a plain mean then passed
            # a fit with a bias on every step (bench/bench_soak.py: 18-20 % too fast for 100 steps).
            with torch.no_grad():
                W1, c1, W2, c2 = best
                fit_val = _trimmed_mse((torch.tanh(x[va] @ W1 + c1) @ W2 + c2 - y[va]).double().numpy())
            ema_val = _trimmed_mse(base[va] - ys[va]) if np.all(np.isfinite(base[va])) else math.inf
            use = fit_val < ema_val
        net = tuple(b.double().numpy().copy() for b in best)
        with self._lock:
            self._params = best
            self._net, self._norm = net, norm
            self.use = use
            self.fits += 1
