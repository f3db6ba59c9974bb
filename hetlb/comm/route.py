"""The telemetry table's route: how the table travels between the ranks, the same on every rank.

(The argument that asks for one is ``Balancer(transport=)``; the route is not the gradient
transport of :mod:`hetlb.comm.gradients`, which reduces the gradient.) Every rank uses the same
route, agreed at start-up: by default "carry" where every rank can, else "side", and "side"
also where some rank's DDP has ``gradient_as_bucket_view=True`` (see :func:`carry_penalty`).

* ``"carry"``: Gloo with CPU float32/float64 buckets only: the rank's row is written into a zeroed
  slot region appended to the last bucket in a persistent buffer (the scaled gradient is written
  into it in the pass that would otherwise scale the bucket in place), so the gradient's own
  all-reduce delivers the table and no collective is added.
* ``"side"``: a separate float64 all-reduce of the ``[world, F]`` slots, issued from the last
  bucket's hook just before that bucket's all-reduce, on a Gloo group of its own (under Gloo too:
  on the gradient group it queued behind the gradient's transfers and cost 15-22 % of a step on
  CPU, ``bench/RESULTS.md``); the end of the step waits for it, normally long complete. It is
  the route to pair with :meth:`hetlb.Balancer.backward` on Gloo: the hook then makes no
  pass over the gradient at all (carry still copies the last bucket next to the table).
* A step in which no hook ran (no backward) all-reduces the row on its own (:meth:`exchange`).
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist


log = logging.getLogger("hetlb.aggregate")

ROUTES = ("side", "carry")

#: Bucket dtypes that carry the telemetry slots exactly (batch < 2^24, 24-bit checksums).
CARRY_DTYPES = (torch.float32, torch.float64)


def is_nccl(group: Any) -> bool:
    """Whether collectives on ``group`` go through NCCL."""
    try:
        return dist.get_backend(group) == "nccl"
    except Exception:  # noqa: BLE001 (older torch builds raise different errors for unknown groups)
        return False


def carry_blocker(model: Any, group: Any) -> Optional[str]:
    """Why the last bucket of ``model`` cannot carry the table on this rank (None if it can)."""
    if is_nccl(group):
        return "the group uses NCCL"
    if getattr(model, "mixed_precision", None) is not None:
        return "DDP mixed precision changes the bucket dtype"
    for p in model.parameters():
        if p.requires_grad and (p.device.type != "cpu" or p.dtype not in CARRY_DTYPES):
            return f"a parameter is {p.dtype} on {p.device}"
    return None


def defer_blocker(model: Any, group: Any, *, native: bool, emulator: Any, accumulate: int,
                  route: Optional[str], micro_steps: bool = False) -> Optional[str]:
    """Why this rank cannot defer its communication hook (None if it can; see
    :class:`BackwardWatch`): DDP's own averaging must be the weighted mean while weights are
    equal, and the end of backward must be seen without a hook."""
    if not native:
        return "native_hook=False (the reference hook is registered at once)"
    if route == "carry":
        return "transport='carry' rides in the hook"
    if emulator is not None:
        return "an emulator holds the last bucket in the hook"
    if accumulate != 1:
        return "accumulate > 1 weighs whole windows in the hook"
    if micro_steps:
        return "micro_batch= weighs a step's micro-steps together in the hook"
    if is_nccl(group):
        return "the group uses NCCL (its hook weighs in PREMUL_SUM at no extra pass)"
    try:
        registered = getattr(model, "_comm_hooks", None) or model._get_ddp_logging_data().get("comm_hook")
    except Exception:  # noqa: BLE001 (an older DDP: the hook's registration will say)
        registered = None
    if registered:
        return f"a communication hook is already registered on the DDP model ({registered})"
    if getattr(model, "static_graph", False):
        return "DDP(static_graph=True)"
    if getattr(model, "mixed_precision", None) is not None:
        return "DDP mixed precision"
    for p in model.parameters():
        if p.requires_grad and p.device.type != "cpu":
            return f"a parameter is on {p.device}"
    pg = getattr(model, "process_group", None)
    try:
        mine = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        ddps = dist.get_process_group_ranks(pg) if pg is not None else mine
    except Exception:  # noqa: BLE001 (a group torch cannot describe: do not guess)
        return "the DDP model's process group could not be compared with the Balancer's"
    if list(ddps) != list(mine):
        return "the DDP model averages over another process group than the Balancer's"
    return None


def carry_penalty(model: Any) -> Optional[str]:
    """Why carrying the table would cost this rank more than the side route (None if it
    would not): with ``gradient_as_bucket_view=True`` DDP's gradients are views of its buckets,
    so the carried bucket (the last bucket in a buffer of its own, beside the table) is copied
    back into them, a pass the side route does not make (``bench/RESULTS.md``, "The default
    transport under gradient_as_bucket_view=True")."""
    if getattr(model, "gradient_as_bucket_view", False):
        return "DDP(gradient_as_bucket_view=True) would copy the carried bucket back"
    return None


def choose_route(requested: Sequence[Optional[str]], blockers: Sequence[Optional[str]],
                     penalties: Optional[Sequence[Optional[str]]] = None, *,
                     deferred: bool = False) -> str:
    """The route every rank uses, from each rank's request (None: no preference), carry
    blocker (:func:`carry_blocker`) and carry penalty (:func:`carry_penalty`). With no request,
    "side" when the hook is ``deferred`` (no hook to carry the table, see :class:`BackwardWatch`),
    else "carry" when every rank can carry and none would pay for it (it costs less: no
    collective of its own, see ``bench/RESULTS.md``), else "side". An explicit "carry" is
    honoured despite a penalty. Raises ``ValueError`` naming the ranks when the requests cannot
    be met together."""
    asked = {r: t for r, t in enumerate(requested) if t is not None}
    kinds = set(asked.values())
    if len(kinds) > 1:
        raise ValueError("ranks asked for different telemetry routes (transport=): " + ", ".join(
            f"rank {r}: {t!r}" for r, t in sorted(asked.items())))
    if not kinds:
        costly = deferred or any(p is not None for p in penalties or ())
        return "carry" if all(b is None for b in blockers) and not costly else "side"
    want = kinds.pop()
    if want == "carry":
        blocked = {r: b for r, b in enumerate(blockers) if b is not None}
        if blocked:
            raise ValueError("transport='carry' needs CPU float32/float64 buckets on Gloo on every "
                             "rank; " + "; ".join(f"rank {r}: {b}" for r, b in sorted(blocked.items())))
    return want


class _GroupsKept:
    """Python references to the process groups the hook holds, kept on the DDP model.

    Set after DDP's own attributes, so dropped after its reducer: the reducer is then never a
    group's last owner. Its destructor runs holding the GIL and joins Gloo's threads, which hangs
    when one of them waits for the GIL to free a tensor of the script's own collectives; the
    last reference dropped from here goes through torch's Python holder, which releases the GIL.
    Pickles as an empty holder, since groups do not pickle."""

    __slots__ = ("groups",)

    def __init__(self, groups: Sequence[Any] = ()) -> None:
        self.groups = tuple(groups)

    def __reduce__(self) -> Any:
        return (_GroupsKept, ())


def keep_groups(model: Any, groups: Sequence[Any]) -> None:
    """Keep Python references to ``groups`` on the DDP ``model``, after its reducer (see
    :class:`_GroupsKept`)."""
    # Popped and set again, so it always comes after the reducer in the model's __dict__.
    kept = model.__dict__.pop("_hetlb_groups_kept", None)
    held = list(kept.groups if kept else ())
    for g in groups:  # each group once (carry's side group is the gradient group)
        if all(g is not k for k in held):
            held.append(g)
    model._hetlb_groups_kept = _GroupsKept(held)


__all__ = ["ROUTES", "is_nccl", "carry_blocker", "carry_penalty", "choose_route"]
