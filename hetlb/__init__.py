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

import sys

from hetlb import _C  # noqa: F401  (registers torch.ops.hetlb.*)
from hetlb import ops  # noqa: F401
from hetlb.core.models import LinearModel, PiecewiseModel, PolyModel, TimeModel
from hetlb.core.solve import allocate, allocate_proportional, rebalance, schedule
from hetlb import policies, sim  # noqa: F401
from hetlb.core import telemetry
from hetlb.data import collate
from hetlb.ranks import elastic
from hetlb.sim import emulate
from hetlb.train.balancer import Balancer
from hetlb.train.errors import BatchSizeError, DecisionMismatchError
from hetlb.data.loader import BalancedLoader
from hetlb.data.loader import BalancedLoader as DataLoader
from hetlb.core.decisions import ScheduleRule
from hetlb.policies import DBS, EMA, LBB, LBBSP, NARX, WLBS, Chronica, Memoryless, Uniform
from hetlb.train.profile import Profile, profile
from hetlb.train.recompute import Recompute
from hetlb.core.telemetry import UnusableTelemetry
from hetlb.sync import DelayedSync
from hetlb.ranks.elastic import init_process_group
from hetlb.train.checkpoint import Checkpointer
from hetlb.ranks.watchdog import Watchdog

__version__ = "0.1.0"

# The module names documented before the subpackages existed: ``import hetlb.emulate`` and
# ``from hetlb.collate import pad_collate`` keep working.
for _name, _module in (("telemetry", telemetry), ("collate", collate), ("emulate", emulate),
                       ("elastic", elastic)):
    sys.modules.setdefault(f"{__name__}.{_name}", _module)
del _name, _module

__all__ = [
    "LinearModel", "PolyModel", "PiecewiseModel", "TimeModel",
    "allocate", "allocate_proportional", "schedule", "rebalance", "ops",
    "init_process_group", "Checkpointer", "Watchdog",
    "Balancer", "DataLoader", "BalancedLoader", "DecisionMismatchError", "BatchSizeError",
    "UnusableTelemetry", "ScheduleRule", "Profile", "profile", "Recompute",
    "policies", "Uniform", "LBB", "LBBSP", "WLBS", "DBS", "Chronica", "Memoryless", "EMA", "NARX",
    "emulate", "telemetry", "sim", "collate", "DelayedSync",
]
