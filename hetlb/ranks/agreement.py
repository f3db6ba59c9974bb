"""What the ranks agree on at start-up: rank 0's model state, a side group, and one refusal raised on
every rank when any rank refuses its arguments."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hetlb.comm.route import is_nccl
from hetlb.core.checks import agree


#: Bytes of one broadcast of :func:`broadcast_module_state` (DDP's broadcast bucket size).
BROADCAST_BUCKET = 250 * 1024 * 1024


def broadcast_module_state(model: torch.nn.Module, group: Any = None,
                           bucket: int = BROADCAST_BUCKET) -> None:
    """Rank 0's parameters and buffers (rank 0 of ``group``) on every rank, as DDP does when it
    wraps a model: tensors of one dtype and device flattened into broadcasts of at most
    ``bucket`` bytes (a larger tensor alone). Collective; every rank's model must have the same
    tensors in the same order (compare them first)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    by_kind: Dict[tuple, List[List[torch.Tensor]]] = {}
    filled: Dict[tuple, int] = {}  # bytes in each kind's last bucket
    for t in list(model.parameters()) + list(model.buffers()):
        if not t.numel():
            continue
        kind, size = (t.dtype, t.device), t.numel() * t.element_size()
        buckets = by_kind.setdefault(kind, [[]])
        if buckets[-1] and filled[kind] + size > bucket:
            buckets.append([])
            filled[kind] = 0
        buckets[-1].append(t)
        filled[kind] = filled.get(kind, 0) + size
    with torch.no_grad():
        for buckets in by_kind.values():
            for tensors in buckets:
                flat = torch.cat([t.detach().reshape(-1) for t in tensors])
                sent = flat.to(torch.uint8) if flat.dtype == torch.bool else flat  # (Gloo: no bool)
                dist.broadcast(sent, src=src, group=group)
                flat = sent.to(flat.dtype)
                offset = 0
                for t in tensors:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()


def make_side_group(group: Any, own: bool = False) -> Any:
    """A Gloo group over the ranks of ``group`` for the telemetry: ``group`` itself under Gloo
    unless ``own``, else a new one (collective: every rank calls it)."""
    if not is_nccl(group) and not own:
        return group
    ranks: Optional[List[int]] = None if group is None else dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend="gloo")


#: The key of a rank's start-up exchange entry when it refused its own arguments.
REFUSED = "refused"


def refuse_everywhere(error: BaseException, group: Any, side: Any = None) -> None:
    """Join the start-up exchange the other ranks are in with this rank's refusal of its own
    arguments, so that every rank raises (:func:`raise_refusals`) instead of waiting in the
    collective until its timeout. The caller then re-raises ``error``; ``side``: the exchange's
    group where already made (else made here, as the other ranks make it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        world = dist.get_world_size(group)
        if world > 1:
            side = make_side_group(group) if side is None else side
            dist.all_gather_object([None] * world, {REFUSED: f"{type(error).__name__}: {error}"},
                                   group=side)
    except Exception:  # noqa: BLE001 (an unusable group: the caller's own error stands)
        pass


#: How :func:`raise_refusals` words a refusal unless its caller gives its own wording:
#: ``who`` (the object starting up), ``rank`` (the refusing one) and ``why`` (its reason).
REFUSAL = "{who} on rank {rank} refused its arguments ({why}); every rank stops here"


def raise_refusals(everyone: List[Any], who: str, wording: str = REFUSAL) -> None:
    """Raise ``ValueError`` naming the first rank whose start-up entry is a refusal, worded by
    ``wording`` (see :data:`REFUSAL`)."""
    for r, e in enumerate(everyone):
        if isinstance(e, dict) and e.get(REFUSED) is not None:
            raise ValueError(wording.format(who=who, rank=r, why=e[REFUSED]))


def all_gather(mine: Any, group: Any, world: int, distributed: bool) -> List[Any]:
    """Every rank's ``mine`` (a small picklable value), in rank order, through ``group``; one
    process, or no process group, gathers only its own."""
    if world == 1 or not distributed:
        return [mine]
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def agree_at_start(mine: Dict[str, Any], side: Any, world: int, distributed: bool, who: str,
                   same: Sequence[Tuple[str, str]] = (), *, refused: Optional[str] = None,
                   wording: str = REFUSAL) -> List[Dict[str, Any]]:
    """The start-up exchange of a Balancer, DelayedSync or Federated: every rank's ``mine``, in
    rank order. Raises ``ValueError`` on every rank alike when one refused its arguments
    (:func:`refuse_everywhere`, or ``refused`` below; worded by ``wording``, see
    :data:`REFUSAL`), or differs from rank 0's in one of ``same`` (``(key, what)``:
    ``mine[key]``, named ``what`` in the message).

    ``refused``: why this rank refuses to go on although its arguments were taken (the reason's
    text); it travels in this rank's entry, so every rank, this one included, raises the same
    error. A single process (``world == 1`` or not ``distributed``) raises the reason itself."""
    if refused is not None:
        if world == 1 or not distributed:
            raise ValueError(refused)
        mine = {**mine, REFUSED: refused}
    everyone = all_gather(mine, side, world, distributed)
    raise_refusals(everyone, who, wording)
    for key, what in same:
        agree(everyone, key, what)
    return everyone


class Peers:
    """The ranks of a group, for small values gathered between steps through ``side`` (a group
    of its own, off the gradient's path)."""

    def __init__(self, side: Any, world: int, distributed: bool) -> None:
        self.side, self.world, self.distributed = side, world, distributed

    def gather(self, mine: Any) -> List[Any]:
        """Every rank's ``mine``, in rank order (a collective: every rank calls it)."""
        return all_gather(mine, self.side, self.world, self.distributed)
