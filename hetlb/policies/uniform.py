"""The SSGD baseline: the equal split, every step."""
from __future__ import annotations

import numpy as np

from hetlb.core.telemetry import History
from hetlb.policies.base import Context, SizedPolicy


__all__ = ["Uniform"]


class Uniform(SizedPolicy):
    """Synchronous SGD's split: ``B // n`` samples per rank, the remainder to the lowest ranks.

    Where bounds make the equal split infeasible, ranks are water-filled to equal shares within
    their bounds (:func:`hetlb.allocate_proportional` with equal speeds). The decision never
    changes during training, so a :class:`hetlb.Balancer` running it exchanges the telemetry in
    adaptive blocks of up to 16 steps by default (see its ``exchange_every``; the records are
    the same, they arrive a block at a time).
    """

    name = "uniform"
    accepts_no_progress = True  # the split does not depend on anyone's speed
    reads_telemetry = False  # so the Balancer exchanges telemetry in blocks by default

    def __init_subclass__(cls, **kwargs: object) -> None:
        # A subclass with a decide() of its own may read the telemetry: it decides every step
        # (the Balancer's per-step default) unless it says otherwise itself.
        super().__init_subclass__(**kwargs)
        if "decide" in vars(cls) and "reads_telemetry" not in vars(cls):
            cls.reads_telemetry = True

    def start(self, ctx: Context) -> np.ndarray:
        """Remember ``ctx`` and return the equal split."""
        self._setup(ctx)
        return self.emit(self.uniform())

    def decide(self, history: History) -> np.ndarray:
        """The same equal split (a rank without progress changes nothing)."""
        self.latest(history)
        return self.emit(self.last)
