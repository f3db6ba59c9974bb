"""The SSGD baseline (equal split) and the small base class the LBB/DBS/WLBS policies share."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..solve import allocate_proportional
from ..telemetry import StepRecord, validate_record
from .base import Context, Policy, check_sizes

__all__ = ["Uniform"]


class _SizedPolicy(Policy):
    """Shared plumbing: the bounds a policy needs after :meth:`start`, kept as public state.

    ``world``, ``global_batch``, ``lower`` and ``upper`` are stored as plain attributes (not only
    inside the :class:`Context`) so that :meth:`state_dict` carries them and a fresh instance
    restored with :meth:`load_state_dict` decides without ``start`` being called again.
    ``last`` is the policy's latest decision, the base of every incremental move (lag rule).
    """

    def _setup(self, ctx: Context) -> None:
        if not isinstance(ctx, Context):
            raise ValueError(f"{self.name}.start expects a hetlb Context, got {type(ctx).__name__}")
        self._ctx: Optional[Context] = ctx
        self.world = int(ctx.world)
        self.global_batch = int(ctx.global_batch)
        self.lower = ctx.lower.copy()
        self.upper = ctx.upper.copy()
        self.last = np.zeros(self.world, np.int64)

    def _context(self) -> Context:
        """The context for :func:`check_sizes`; rebuilt from state after a restore."""
        ctx = getattr(self, "_ctx", None)
        if ctx is None:
            if not hasattr(self, "world"):
                raise RuntimeError(f"{self.name}: call start(ctx) (or load_state_dict) "
                                   f"before decide")
            ctx = Context(self.world, self.global_batch, self.lower, self.upper)
            self._ctx = ctx
        return ctx

    def load_state_dict(self, state: Any) -> None:
        """Restore the state; the cached context is rebuilt from the restored bounds."""
        super().load_state_dict(state)
        self._ctx = None

    def _latest(self, history: Any) -> StepRecord:
        """The latest record, checked: right world size and usable telemetry (else ValueError)."""
        self._context()
        if len(history) == 0:
            raise ValueError(f"{self.name}.decide: empty history (decide is called after a step)")
        rec = history[-1]
        if rec.world != self.world:
            raise ValueError(f"{self.name}.decide: record has {rec.world} ranks, policy was "
                             f"started with world={self.world}")
        self._validate(rec)
        return rec

    def _validate(self, rec: StepRecord) -> None:
        validate_record(rec)

    def _emit(self, sizes: Any) -> np.ndarray:
        """Check a decision against the bounds, remember it as ``last`` and return a copy."""
        s = check_sizes(np.asarray(sizes, dtype=np.int64), self._context(), self.name)
        self.last = s.copy()
        return s.copy()

    def _uniform(self) -> np.ndarray:
        """Equal split within the bounds, remainder to the lowest ranks."""
        return allocate_proportional(np.ones(self.world), self.global_batch, self.lower, self.upper)

    def _proportional(self, speeds: np.ndarray) -> np.ndarray:
        """Sizes proportional to ``speeds`` (samples/s) within the bounds."""
        return allocate_proportional(np.asarray(speeds, np.float64), self.global_batch,
                                     self.lower, self.upper)


class Uniform(_SizedPolicy):
    """Synchronous SGD's split: ``B // n`` samples per rank, the remainder to the lowest ranks.

    Where bounds make the equal split infeasible, ranks are water-filled to equal shares within
    their bounds (:func:`hetlb.allocate_proportional` with equal speeds). The decision never
    changes during training.
    """

    name = "uniform"

    def start(self, ctx: Context) -> np.ndarray:
        """Remember ``ctx`` and return the equal split."""
        self._setup(ctx)
        return self._emit(self._uniform())

    def decide(self, history: Any) -> np.ndarray:
        """The same equal split (the latest record is still validated)."""
        self._latest(history)
        return self._emit(self.last)
