"""Batch-size policies: pure functions of telemetry history plus their own state.

Every policy is shared by :class:`hetlb.Balancer` and offline simulation: it sees only the
:class:`Context` given at start and the :class:`hetlb.core.telemetry.StepRecord` history, never the
network, and checkpoints its state with ``state_dict`` / ``load_state_dict``. The kit every
policy builds on is in :mod:`hetlb.policies.base`.
"""
from hetlb.core.decisions import ScheduleRule
from hetlb.policies.base import Context, EpochMeter, Policy, SizedPolicy, check_decision, check_sizes
from hetlb.policies.chronica import Chronica, RuntimeProphet
from hetlb.policies.dbs import DBS
from hetlb.policies.lbb import LBB
from hetlb.policies.lbbsp import LBBSP
from hetlb.policies.narx import NARX
from hetlb.policies.predictors import EMA, Memoryless, SpeedPredictor
from hetlb.policies.uniform import Uniform
from hetlb.policies.wlbs import WLBS


__all__ = [
    "Context", "Policy", "SizedPolicy", "EpochMeter", "check_sizes", "check_decision",
    "ScheduleRule", "Uniform", "LBB", "LBBSP", "WLBS", "DBS", "Chronica", "RuntimeProphet",
    "SpeedPredictor", "Memoryless", "EMA", "NARX",
]
