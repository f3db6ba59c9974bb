"""Batch-size policies: pure functions of telemetry history plus their own state.

Every policy is shared by :class:`hetlb.Balancer` and offline simulation: it sees only the
:class:`Context` given at start and the :class:`hetlb.telemetry.StepRecord` history, never the
network, and checkpoints its state with ``state_dict`` / ``load_state_dict``.
"""
from .base import Context, Policy, check_sizes
from .dbs import DBS
from .lbb import LBB
from .lbbsp import LBBSP
from .predictors import EMA, NARX, Memoryless, SpeedPredictor
from .uniform import Uniform
from .wlbs import WLBS

__all__ = [
    "Context", "Policy", "check_sizes",
    "Uniform", "LBB", "LBBSP", "WLBS", "DBS",
    "SpeedPredictor", "Memoryless", "EMA", "NARX",
]
