"""hetlb: load-balanced synchronous data-parallel training for heterogeneous and shared clusters.

Public names only; see DESIGN.md for the architecture.
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers torch.ops.hetlb.*)
from . import ops  # noqa: F401
from .models import LinearModel, PiecewiseModel, PolyModel, TimeModel
from .solve import allocate, allocate_proportional, rebalance, schedule
from . import emulate, policies, telemetry  # noqa: F401
from .balancer import Balancer, DecisionMismatchError
from .policies import DBS, EMA, LBB, LBBSP, NARX, WLBS, Memoryless, Uniform
from .profile import Profile, profile

__version__ = "0.1.0"

__all__ = [
    "LinearModel", "PolyModel", "PiecewiseModel", "TimeModel",
    "allocate", "allocate_proportional", "schedule", "rebalance", "ops",
    "Balancer", "DecisionMismatchError", "Profile", "profile",
    "policies", "Uniform", "LBB", "LBBSP", "WLBS", "DBS", "Memoryless", "EMA", "NARX",
    "emulate", "telemetry",
]
