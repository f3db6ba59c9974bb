"""The simulated cluster: the declared workers' time models, which of them are active, and the
conditions the scenario's events set at each step (speed, load, links, disturbances); what one
step costs on it."""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from hetlb.core.models import LinearModel, PolyModel
from hetlb.sim.scenario import Scenario


__all__ = ["TimeModels", "Cluster"]


class TimeModels:
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


class Cluster:
    """The declared workers at the current step: which are active, and each one's speed factor,
    load and link as the scenario's events set them (:meth:`advance`). Arrays are over the
    declared workers; the step's methods take ``idx``, the workers the policy runs on."""

    def __init__(self, sc: Scenario) -> None:
        self.models = TimeModels(sc)
        self.network = sc.network
        W = self.models.n
        #: bool ``[W]``: the workers taking part.
        self.active = np.array([w.active for w in sc.workers])
        self.speed = np.ones(W)
        self.load = np.zeros(W)
        self.bandwidth = self.models.bandwidth.copy()
        # Events split by whether they change state at their start or apply per step.
        self._disturb = [e for e in sc.events if e.kind == "disturb"]
        self._events = sorted([e for e in sc.events if e.kind != "disturb"], key=lambda e: e.start)
        self._membership = {e.start for e in self._events if e.kind in ("leave", "join")}
        self._started = 0  # events started so far

    def advance(self, k: int) -> bool:
        """Apply the events of step ``k``; whether the active workers changed (a membership
        change: the policy restarts)."""
        changed = False
        while self._started < len(self._events) and self._events[self._started].start <= k:
            e = self._events[self._started]
            self._started += 1
            if e.kind in ("leave", "join"):
                before = self.active.copy()
                self.active[e.workers] = e.kind == "join"
                changed |= not np.array_equal(before, self.active)
        # A worker's speed, load and link at step k: those of the latest-started event active then
        # (an event ending hands back to one that still runs, not to the default), else the default.
        self.speed[:], self.load[:], self.bandwidth[:] = 1.0, 0.0, self.models.bandwidth
        for e in self._events[:self._started]:
            if e.stop is None or k < e.stop:
                if e.kind == "speed":
                    self.speed[e.workers] = e.speed
                elif e.kind == "load":
                    self.load[e.workers] = e.load
                elif e.kind == "bandwidth":
                    self.bandwidth[e.workers] = e.bandwidth
        return changed and k in self._membership

    def out_of_memory(self, idx: np.ndarray, b: np.ndarray) -> Optional[int]:
        """The position in ``idx`` of the first worker whose batch ``b`` exceeds its limit, or None."""
        over = np.flatnonzero(b > self.models.limit[idx])
        return int(over[0]) if over.size else None

    def compute(self, k: int, idx: np.ndarray, x: np.ndarray, b: np.ndarray,
                rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
        """Seconds of step ``k``'s computation of workers ``idx`` on work ``x`` (batches ``b``;
        none without samples), and which of them failed (a ``fail`` disturbance)."""
        m, n = self.models, idx.size
        t = m.base(idx, x) + m.overhead[idx]
        t /= m.speed[idx] * self.speed[idx] * (1.0 - self.load[idx])
        uv = rng.random((2, n))
        t *= 1.0 + m.noise[idx] * (2.0 * uv[0] - 1.0)
        t += m.jitter[idx] * uv[1]
        failed = np.zeros(n, bool)
        for e in self._disturb:
            if e.active(k):
                sel = np.isin(idx, e.workers)
                t[sel] = t[sel] * e.factor + e.extra
                if e.fail:
                    failed |= sel
        return np.where(b > 0, t, 0.0), failed

    def exposed_comm(self, idx: np.ndarray) -> float:
        """Seconds of the ring all-reduce over workers ``idx`` that computation does not hide."""
        # The ring runs at its slowest link; a worker without a link of its own has the network's.
        net = np.inf if self.network.bandwidth is None else self.network.bandwidth
        bw = self.bandwidth[idx]
        slowest = float(np.where(np.isnan(bw), net, bw).min(initial=np.inf))
        return self.network.exposed(idx.size, slowest if np.isfinite(slowest) else None)

    def usage(self, idx: np.ndarray, b: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """The memory in use (a fraction, growing with the batch towards the limit) and the CPU
        load of workers ``idx`` at batches ``b``, as their telemetry reports them."""
        m = self.models
        lim = m.limit[idx].astype(np.float64)
        mem = m.memory[idx] + np.where(lim < 2 ** 62, (1.0 - m.memory[idx]) * b / lim, 0.0)
        return np.minimum(mem, 1.0), np.minimum(m.cpu[idx] + self.load[idx], 1.0)
