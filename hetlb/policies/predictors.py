"""Speed predictors for LB-BSP's CPU mode (LB-BSP section 3.2.2, Table 3) that run on the shared
table: every rank computes them from the same records, so they are part of the policy.

A predictor observes one step at a time (:meth:`SpeedPredictor.update` with a
:class:`~hetlb.core.telemetry.StepRecord`) and predicts every rank's sample processing speed
``v = batch / compute`` (samples/s) for the next step (:meth:`SpeedPredictor.predict`), one
independent series per rank:

* :class:`Memoryless`: the last observed speed.
* :class:`EMA`: exponential moving average, ``alpha`` = weight of the latest observation
  (paper: 0.2).

The paper's third, :class:`hetlb.policies.NARX`, is a neural network per worker trained on that
worker's history; it runs on each rank itself and publishes its predictions in the telemetry
table (:mod:`hetlb.policies.narx`).

A rank that had no samples in a step (speed 0) contributes no observation for that step; its
prediction stays what it was. A rank never observed is predicted at the mean of the observed
ones (all zeros when nothing was observed: :func:`hetlb.allocate_proportional` then splits
equally).

Determinism: predictions are elementwise functions of the observed records (no reductions), so
every rank computes bit-identical values from the same table.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Optional

import numpy as np

from hetlb.core.checks import number
from hetlb.core.telemetry import StepRecord


__all__ = ["SpeedPredictor", "Memoryless", "EMA", "predictor_from_state"]


def _check_count(value: Any, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_alpha(alpha: Any) -> float:
    return number(alpha, "EMA: alpha", above=0.0, maximum=1.0)


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

        The record is assumed sound (records reach policies through a
        :class:`hetlb.core.telemetry.History`, which checks them); a rank without samples or progress
        contributes no observation.

        Raises:
            ValueError: a record of another world size.
        """
        if self.world is None:
            self.reset(record.world)
        if record.world != self.world:
            raise ValueError(f"{self.name}: record has {record.world} ranks, predictor tracks "
                             f"{self.world}")
        cpu = np.asarray(record.cpu, np.float64)
        mem = np.asarray(record.memory, np.float64)
        valid = (np.asarray(record.batch) > 0) & np.isfinite(record.compute)
        speed = np.where(valid, record.speed, 0.0).astype(np.float64)
        self._observe(speed, valid, cpu, mem)
        self.seen |= valid
        self.cpu, self.memory = cpu.copy(), mem.copy()
        self.count += 1

    def predict(self, cpu: Optional[np.ndarray] = None,
                memory: Optional[np.ndarray] = None) -> np.ndarray:
        """Predicted speed (samples/s, >= 0) of every rank in the next step.

        Args:
            cpu, memory: current usage readings ``[world]`` (default: the latest observed);
                neither of these predictors uses them.
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
        if not isinstance(state, dict):
            raise TypeError(f"{self.name}.load_state_dict: state must be a dict, got "
                            f"{type(state).__name__}")
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


_PREDICTORS = {"Memoryless": Memoryless, "EMA": EMA}


def predictor_from_state(state: Dict[str, Any]) -> SpeedPredictor:
    """Rebuild a predictor from :meth:`SpeedPredictor.state_dict` output."""
    if not isinstance(state, dict):
        raise TypeError(f"predictor state must be a dict, got {type(state).__name__}")
    kind = state.get("type")
    if kind not in _PREDICTORS:
        raise ValueError(f"unknown predictor type {kind!r}; expected one of {sorted(_PREDICTORS)}")
    cls = _PREDICTORS[kind]
    p = cls(**{k: state[k] for k in cls()._config() if k in state})
    p.load_state_dict(state)
    return p
