"""The policy protocol shared by the trainer (``hetlb.Balancer``) and the simulator.

A policy is a pure function of the telemetry history plus its own state: ``start(ctx)`` gives
the sizes of the first step, ``decide(history)`` the sizes of the next one. It never touches the
network, so every rank computes the same decision from the same table.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

from ..models import TimeModel


@dataclass
class Context:
    """What a policy knows before the first step.

    Attributes:
        world: number of ranks.
        global_batch: samples per step over all ranks (``sum(sizes) == global_batch``).
        lower, upper: int64 ``[world]`` bounds on each rank's batch (``upper`` from memory
            limits, e.g. ``Profile.limit``).
        hardware: per rank, the dict of :func:`hetlb.telemetry.hardware_info` (may be empty).
        profiles: per rank, ``None`` or a dict with ``"model"`` (fitted cubic
            :class:`~hetlb.TimeModel`), ``"linear"`` (fitted :class:`~hetlb.LinearModel`) and
            ``"limit"`` (largest batch that fit in memory).
    """

    world: int
    global_batch: int
    lower: np.ndarray
    upper: np.ndarray
    hardware: List[Dict[str, float]] = field(default_factory=list)
    profiles: List[Optional[Dict[str, Any]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.lower = np.broadcast_to(np.asarray(self.lower, dtype=np.int64), (self.world,)).copy()
        self.upper = np.broadcast_to(np.asarray(self.upper, dtype=np.int64), (self.world,)).copy()
        if self.world < 1:
            raise ValueError(f"world must be >= 1, got {self.world}")
        if self.global_batch < int(self.lower.sum()):
            raise ValueError(f"global_batch={self.global_batch} is smaller than the sum of the lower "
                             f"bounds {int(self.lower.sum())} over {self.world} ranks "
                             f"(lower={self.lower.tolist()}); every rank needs at least its lower "
                             f"bound of samples per step")
        if int(self.upper.sum()) < self.global_batch:
            raise ValueError(f"global_batch={self.global_batch} exceeds the sum of upper bounds "
                             f"{int(self.upper.sum())} (upper={self.upper.tolist()})")
        if np.any(self.lower > self.upper):
            raise ValueError(f"lower {self.lower.tolist()} exceeds upper {self.upper.tolist()}")
        if not self.profiles:
            self.profiles = [None] * self.world
        if not self.hardware:
            self.hardware = [{} for _ in range(self.world)]

    @classmethod
    def simple(cls, world: int, global_batch: int, lower: int = 1,
               upper: Optional[int] = None, **kw: Any) -> "Context":
        """A context with the same bounds on every rank (``upper`` defaults to ``global_batch``)."""
        return cls(world, global_batch, np.full(world, lower), np.full(world, upper or global_batch), **kw)

    def models(self, kind: str = "model") -> Optional[List[TimeModel]]:
        """The profiled models of every rank, or None unless every rank has one."""
        if any(p is None or kind not in p for p in self.profiles):
            return None
        return [p[kind] for p in self.profiles]


class Policy:
    """Base class. Subclasses implement :meth:`start` and :meth:`decide`.

    State lives on the instance (never at module level) and round-trips through
    :meth:`state_dict` / :meth:`load_state_dict`, so a resumed run decides exactly as before.
    """

    #: Short name for logs and benchmark tables.
    name: str = "policy"

    def start(self, ctx: Context) -> np.ndarray:
        """Remember ``ctx`` and return the int64 sizes of the first step."""
        raise NotImplementedError

    def decide(self, history: "History") -> np.ndarray:  # noqa: F821
        """Return the int64 sizes of the next step from the history (latest record last)."""
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to continue deciding identically (JSON/pickle friendly)."""
        return {k: copy.deepcopy(v) for k, v in vars(self).items() if not k.startswith("_")}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, copy.deepcopy(v))


def check_sizes(sizes: Any, ctx: Context, who: str) -> np.ndarray:
    """Validate a policy's output against the context; raise ``ValueError`` naming the policy."""
    s = np.asarray(sizes)
    if s.shape != (ctx.world,) or s.dtype.kind not in "iu":
        raise ValueError(f"{who} returned sizes {s!r}; expected {ctx.world} integers")
    s = s.astype(np.int64)
    if int(s.sum()) != ctx.global_batch:
        raise ValueError(f"{who} returned sizes {s.tolist()} summing to {int(s.sum())}, "
                         f"not global_batch={ctx.global_batch}")
    if (s < ctx.lower).any() or (s > ctx.upper).any():
        raise ValueError(f"{who} returned sizes {s.tolist()} outside bounds "
                         f"lower={ctx.lower.tolist()} upper={ctx.upper.tolist()}")
    return s
