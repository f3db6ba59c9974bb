"""What hetlb reads of a ``fully_shard`` model: its FSDP modules, their parameter groups (torch's
``FSDPParamGroup``, whose settings the transport reads and, in a micro window, writes) and the
ranks its parameters are sharded over."""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


def fsdp_modules(model: torch.nn.Module) -> List[FSDPModule]:
    """The FSDP modules of ``model`` (itself included), in ``modules()`` order."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def param_groups(state: Any) -> List[Any]:
    """The parameter groups of one FSDP module's state (torch's ``FSDPParamGroup``; a list since
    torch 2.12, one optional group before)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = getattr(state, "_fsdp_param_group", None)
        groups = [] if one is None else [one]
    return list(groups)


def data_parallel_ranks(model: torch.nn.Module) -> Optional[List[int]]:
    """The global ranks of the mesh the model's parameters are sharded (and replicated) over, or
    None for a model without sharded parameters."""
    for p in model.parameters():
        if isinstance(p, DTensor):
            return sorted(int(r) for r in p.device_mesh.mesh.flatten().tolist())
    return None


def all_param_groups(model: FSDPModule) -> List[Any]:
    """The parameter groups of every FSDP module under the root ``model`` (the root's state
    lists the tree's states once its first forward ran; before, the modules are walked)."""
    states = list(model._get_fsdp_state()._state_ctx.all_states) or \
        [m._get_fsdp_state() for m in fsdp_modules(model)]
    return [g for st in states for g in param_groups(st)]
