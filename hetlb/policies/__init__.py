"""Batch-size policies: pure functions of telemetry history plus their own state.

Every policy is shared by :class:`hetlb.Balancer` and offline simulation: it sees only the
:class:`Context` given at start and the :class:`hetlb.telemetry.StepRecord` history, never the
network, and checkpoints its state with ``state_dict`` / ``load_state_dict``. The kit every
policy builds on is in :mod:`hetlb.policies.base`.
"""
from ..plan import ScheduleRule
from .base import Context, EpochMeter, Policy, SizedPolicy, check_decision, check_sizes
from .chronica import Chronica, RuntimeProphet
from .dbs import DBS
from .lbb import LBB
from .lbbsp import LBBSP
from .narx import NARX
from .predictors import EMA, Memoryless, SpeedPredictor
from .uniform import Uniform
from .wlbs import WLBS

__all__ = [
    "Context", "Policy", "SizedPolicy", "EpochMeter", "check_sizes", "check_decision",
    "ScheduleRule", "Uniform", "LBB", "LBBSP", "WLBS", "DBS", "Chronica", "RuntimeProphet",
    "SpeedPredictor", "Memoryless", "EMA", "NARX",
]
