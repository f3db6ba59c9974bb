"""hetlb's state in a ``torch.distributed.checkpoint`` (DCP) checkpoint.

DCP loads a checkpoint into a template: the state dict of the freshly made objects, flattened to
its keys. The Balancer's state is variable-length Python data (the telemetry history, the
decision, the policy's state, which grows as the policy learns), so a fresh Balancer's template
does not have the keys of one that trained: passed to DCP as it is, entries would be dropped or
refused. DCP also keeps one rank's copy of a key every rank saves, without comparing them.

:class:`DCPState` stores the state as one opaque entry that every rank saves alike: the state
every rank shares (data position, history, decision: identical on every rank, checked when it is
saved) once, and the policy's state of each rank (a policy with per-rank predictors keeps its own)
by rank. Loading picks this rank's policy state on the same world; on another world the policy
restarts, as :meth:`hetlb.Balancer.load_state_dict` does::

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from hetlb.train.dcp import DCPState

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "hetlb": DCPState(loader)}, checkpoint_id=path)
    ...
    state = {"model": model_sd, "optim": optim_sd, "hetlb": DCPState(loader)}
    dcp.load(state, checkpoint_id=path)          # loads the loader (and its Balancer) too
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
"""
from __future__ import annotations

import hashlib
import io
import pickle
from typing import Any, Dict, List

import torch
import torch.distributed as dist

__all__ = ["DCPState"]


def _encode(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _decode(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=True)


def _digest(value: Any) -> str:
    return hashlib.sha1(pickle.dumps(value, protocol=4)).hexdigest()


class DCPState:
    """A ``torch.distributed.checkpoint`` ``Stateful`` for a :class:`hetlb.DataLoader` bound to
    a Balancer (its state carries the Balancer's), or for a :class:`hetlb.Balancer` itself.

    Its :meth:`state_dict` is a collective of the default process group, as DCP's save is: every
    rank calls it (DCP does, once per save).

    Args:
        stateful: the loader or the Balancer (anything with ``state_dict``/``load_state_dict``
            whose state is :meth:`hetlb.Balancer.state_dict`'s).
    """

    def __init__(self, stateful: Any) -> None:
        self.stateful = stateful

    @staticmethod
    def _world() -> "tuple[int, int, bool]":
        on = dist.is_available() and dist.is_initialized()
        return (dist.get_rank() if on else 0), (dist.get_world_size() if on else 1), on

    def state_dict(self) -> Dict[str, Any]:
        """``{"state": bytes}``: the shared state once and each rank's policy state (an opaque
        value DCP saves whole and loads into any template). Raises ``RuntimeError`` if the
        shared part differs between ranks (it cannot: a bug to report)."""
        state = dict(self.stateful.state_dict())
        policy = state.pop("policy", None)
        rank, world, on = self._world()
        mine = {"shared": _digest(state), "policy": policy}
        everyone: List[Any] = [None] * world
        if on:
            dist.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        differ = [r for r, e in enumerate(everyone) if e["shared"] != everyone[0]["shared"]]
        if differ:
            raise RuntimeError(f"hetlb: the Balancer's state differs between rank 0 and ranks "
                               f"{differ} (data position, history or decision), which every rank "
                               f"derives alike; please report this with the script")
        policies = [e["policy"] for e in everyone]
        same = all(_digest(p) == _digest(policies[0]) for p in policies[1:])
        return {"state": _encode({"shared": state, "world": world,
                                  "policies": policies[:1] if same else policies})}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load what :meth:`state_dict` saved (on this world or another)."""
        blob = state_dict.get("state") if isinstance(state_dict, dict) else None
        if not isinstance(blob, (bytes, bytearray)):
            raise ValueError("DCPState.load_state_dict: not a state saved through DCPState "
                             "(expected {'state': bytes})")
        saved = _decode(bytes(blob))
        rank, world, _ = self._world()
        policies = saved["policies"]
        policy = policies[rank] if len(policies) == world == saved["world"] else policies[0]
        self.stateful.load_state_dict({**saved["shared"], "policy": policy})
