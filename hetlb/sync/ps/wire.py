"""What crosses RPC between a worker and the server: the server's name, the two functions a
worker calls, the table that finds the live server of this process, and how a server's error
travels.

RPC runs module-level functions on the callee, and an RRef cannot be handed to a worker outside
an RPC call, so the live server of this process is found in a table here; a server is in it only
while its :meth:`~hetlb.sync.ps.ParameterServer.serve` runs.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Protocol

import torch
import torch.distributed.rpc as rpc


__all__ = ["SERVER", "Served", "worker_name", "register", "unregister", "ps_call", "ps_bye",
           "server_error"]

#: RPC name of the server (rank 0); workers are ``worker_name(rank)``.
SERVER = "hetlb-ps"


class Served(Protocol):
    """What the RPC functions need of a server."""

    def call(self, rank: int, push: Optional[Dict[str, Any]]) -> torch.futures.Future:
        """A future of the reply to worker ``rank``'s call."""

    def bye(self, rank: int) -> None:
        """Worker ``rank`` leaves."""


_LIVE: Dict[str, Served] = {}


def worker_name(rank: int) -> str:
    """RPC name of worker ``rank`` (``1..K``)."""
    return f"hetlb-w{int(rank)}"


def register(name: str, server: Served) -> None:
    """Make ``server`` the one the workers' calls to ``name`` reach in this process."""
    if name in _LIVE:
        raise RuntimeError(f"a parameter server named {name!r} already runs in this process")
    _LIVE[name] = server


def unregister(name: str) -> None:
    """Calls to ``name`` find no server from now on."""
    _LIVE.pop(name, None)


@rpc.functions.async_execution
def ps_call(server: str, rank: int, push: Optional[Dict[str, Any]]) -> torch.futures.Future:
    """A worker's call (a hello or a push), answered by the live server ``server``."""
    ps = _LIVE.get(server)
    if ps is None:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result({"done": True, "dropped": False, "reason": "no server running"})
        return fut
    return ps.call(rank, push).then(_as_reply)


def ps_bye(server: str, rank: int) -> None:
    """A worker's goodbye to the live server ``server`` (none: nothing to do)."""
    ps = _LIVE.get(server)
    if ps is not None:
        ps.bye(rank)


def _as_reply(fut: torch.futures.Future) -> Dict[str, Any]:
    """The answer of a call, its error carried as ``{"error": exception}``: torch's ``rpc_sync``
    returns (does not raise) an exception set on an ``async_execution`` function's future (torch
    2.13), so the worker raises what it finds here, whichever way torch delivers it."""
    try:
        return fut.value()
    except Exception as e:  # noqa: BLE001 (delivered to the worker, which raises it)
        return {"done": True, "error": e}


def server_error(error: BaseException, message: str) -> Exception:
    """``message`` as an exception of ``error``'s type where that is a built-in one that shows
    the message as given (ValueError for a malformed push), else as a ``RuntimeError``: the
    worker raises it, and a class of the user's (an optimizer's) may not rebuild from a message
    or unpickle there."""
    cls = type(error)
    if cls.__module__ == "builtins" and issubclass(cls, Exception):
        try:
            made = cls(message)
            if str(made) == message:  # (KeyError quotes it)
                return made
        except Exception:  # noqa: BLE001 (an exception type with other arguments)
            pass
    return RuntimeError(message)
