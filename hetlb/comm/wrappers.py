"""Which gradient transport a model gets, by the type of its wrapper."""
from __future__ import annotations

from typing import Dict, Type

import torch
from torch.nn.parallel import DistributedDataParallel

from hetlb.comm.ddp import DDPTransport
from hetlb.comm.local import LocalTransport

#: The transport class of each model wrapper, by class (``isinstance``; the first match). A
#: class here has :class:`hetlb.comm.gradients.Wrapper`'s static methods and is made as
#: ``cls(model, telemetry, settings, deferred=...)`` into a
#: :class:`hetlb.comm.gradients.GradientTransport`.
WRAPPERS: Dict[type, Type] = {DistributedDataParallel: DDPTransport}


def wrapper_of(model: torch.nn.Module, world: int) -> Type:
    """The transport class of ``model``: its wrapper's in :data:`WRAPPERS`, or
    :class:`LocalTransport` for one process's plain module. Raises ``TypeError`` for a plain
    module with more than one rank."""
    for cls, transport in WRAPPERS.items():
        if isinstance(model, cls):
            return transport
    if world > 1:
        raise TypeError(f"with {world} ranks the model must be DistributedDataParallel, "
                        f"got {type(model).__name__}")
    return LocalTransport


def ends_of(transport: object) -> object:
    """The handle a :class:`LocalTransport` keeps on the parameters (removed with the forward
    check when a new Balancer takes the module over), else None."""
    return transport.ends if isinstance(transport, LocalTransport) else None
