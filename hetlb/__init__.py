"""hetlb: load-balanced synchronous data-parallel training for heterogeneous and shared clusters.

Public names only; see docs/architecture.md for the architecture.
"""
import torch  # noqa: F401  (loads libtorch before the extension)
import torch.distributed

if torch.distributed.is_available():
    # torch.distributed.nn binds ``group=group.WORLD`` as default arguments when first imported,
    # which DDP does lazily: imported after init_process_group, it pins the default group for
    # the life of the process, so destroy_process_group cannot tear Gloo down and its threads
    # and sockets are still live during interpreter exit (where they can abort the process).
    # Imported here, typically before the group exists, it binds None instead.
    import torch.distributed.nn  # noqa: F401

from . import _C  # noqa: F401  (registers torch.ops.hetlb.*)
from . import ops  # noqa: F401
from .models import LinearModel, PiecewiseModel, PolyModel, TimeModel
from .solve import allocate, allocate_proportional, rebalance, schedule
from . import collate, emulate, policies, sim, telemetry  # noqa: F401
from .balancer import Balancer, BatchSizeError, DecisionMismatchError
from .data import BalancedLoader
from .data import BalancedLoader as DataLoader
from .plan import ScheduleRule
from .policies import DBS, EMA, LBB, LBBSP, NARX, WLBS, Chronica, Memoryless, Uniform
from .profile import Profile, profile
from .telemetry import UnusableTelemetry
from .sync import DelayedSync
from .elastic import init_process_group
from .checkpoint import Checkpointer
from .watchdog import Watchdog

__version__ = "0.1.0"

__all__ = [
    "LinearModel", "PolyModel", "PiecewiseModel", "TimeModel",
    "allocate", "allocate_proportional", "schedule", "rebalance", "ops",
    "init_process_group", "Checkpointer", "Watchdog",
    "Balancer", "DataLoader", "BalancedLoader", "DecisionMismatchError", "BatchSizeError",
    "UnusableTelemetry", "ScheduleRule", "Profile", "profile",
    "policies", "Uniform", "LBB", "LBBSP", "WLBS", "DBS", "Chronica", "Memoryless", "EMA", "NARX",
    "emulate", "telemetry", "sim", "collate", "DelayedSync",
]
