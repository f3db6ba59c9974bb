"""Which gradient transport a model gets, by the type of its wrapper."""
from __future__ import annotations

import importlib
import sys
from typing import Dict, Tuple, Type

import torch
from torch.nn.parallel import DistributedDataParallel

from hetlb.comm.ddp import DDPTransport
from hetlb.comm.local import LocalTransport

#: The transport class of each model wrapper, by class (``isinstance``; the first match). A
#: class here has :class:`hetlb.comm.gradients.Wrapper`'s static methods and is made as
#: ``cls(model, telemetry, settings, deferred=...)`` into a
#: :class:`hetlb.comm.gradients.GradientTransport`.
WRAPPERS: Dict[type, Type] = {DistributedDataParallel: DDPTransport}

#: Wrappers whose module is imported only by a script that uses them (FSDP2's costs 0.6 s of
#: start-up to every process otherwise): ``(module, class) -> (module, transport class)``,
#: looked up once the wrapper's module is loaded, as it is before any model of it exists.
LAZY: Dict[Tuple[str, str], Tuple[str, str]] = {
    ("torch.distributed.fsdp", "FSDPModule"): ("hetlb.comm.fsdp", "FSDP2Transport"),
}


def _loaded() -> None:
    """Move the :data:`LAZY` entries whose wrapper module is loaded into :data:`WRAPPERS`."""
    for key in [k for k in LAZY if k[0] in sys.modules]:
        (mod, cls), (tmod, tcls) = key, LAZY.pop(key)
        WRAPPERS[getattr(sys.modules[mod], cls)] = getattr(importlib.import_module(tmod), tcls)


def wrapper_of(model: torch.nn.Module, world: int) -> Type:
    """The transport class of ``model``: its wrapper's in :data:`WRAPPERS`, or
    :class:`LocalTransport` for one process's plain module. Raises ``TypeError`` for a plain
    module with more than one rank."""
    if LAZY:
        _loaded()
    for cls, transport in WRAPPERS.items():
        if isinstance(model, cls):
            return transport
    if world > 1:
        raise TypeError(f"with {world} ranks the model must be DistributedDataParallel or "
                        f"sharded with FSDP2's fully_shard, got {type(model).__name__}")
    return LocalTransport


def ends_of(transport: object) -> object:
    """The handle a :class:`LocalTransport` keeps on the parameters (removed with the forward
    check when a new Balancer takes the module over), else None."""
    return transport.ends if isinstance(transport, LocalTransport) else None
