"""What hetlb reads of a ``fully_shard`` model: its FSDP modules, their parameter groups (torch's
``FSDPParamGroup``, whose settings the transport reads and, in a micro window, writes), the
ranks its parameters are sharded over, and the process's ``fully_shard`` models
(:class:`FSDPModels`)."""
from __future__ import annotations

from typing import Any, List, Optional, Set

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


class FSDPModels:
    """The process's ``fully_shard`` models (:class:`hetlb.comm.gradients.ModelRegistry`), for
    the search for a model trained on a Balancer's samples unattached. ``fully_shard`` changes a
    module's class in place and makes no event a hook could count models by, so each search finds
    them by the garbage collector's traversal (tens of milliseconds in a process with torch
    loaded, in the searching steps only: 0, 1, 2, 4, 8, ...) and :attr:`count` stays 0. Nothing is
    kept between searches. In a backward graph a parameter is its unsharded parameter (the
    tensor FSDP2 makes once, at the module's first all-gather, and keeps), named by its id: its
    storage is freed after every reshard."""

    count = 0
    counts_made = False

    @staticmethod
    def alive() -> List[torch.nn.Module]:
        import gc
        classes, todo = [], list(FSDPModule.__subclasses__())
        while todo:  # (the classes fully_shard made, one per module class, and their subclasses)
            c = todo.pop()
            classes.append(c)
            todo.extend(c.__subclasses__())
        if not classes:
            return []
        # (by type: isinstance would ask a dead weak proxy among the referrers, which raises)
        found = [o for o in gc.get_referrers(*classes) if type(o) in classes]
        inner = {id(m) for o in found for m in o.modules() if m is not o}
        return [o for o in found if id(o) not in inner]

    @staticmethod
    def entries(model: torch.nn.Module) -> List[torch.nn.Module]:
        return fsdp_modules(model)

    @staticmethod
    def keys(model: torch.nn.Module) -> Set[int]:
        out = set()
        for m in fsdp_modules(model):
            for g in param_groups(m._get_fsdp_state()):
                for fp in g.fsdp_params:
                    unsharded = getattr(fp, "_unsharded_param", None)  # (made at the first all-gather)
                    if unsharded is not None:
                        out.add(id(unsharded))
        return out

    @staticmethod
    def key(variable: torch.Tensor) -> int:
        return id(variable)
