"""A restart-safe ``init_process_group`` for torchrun.

Under torchrun (c10d rendezvous, torch >= 2.4) the elastic agent shares one TCPStore with its
workers (``TORCHELASTIC_USE_AGENT_STORE=True``) and, since the fix for pytorch/pytorch#135712,
keeps that store for the whole job: a restarted worker group bootstraps from a store still
holding the previous attempt's keys, and torch's ``env://`` handler adds no per-attempt prefix
("we create a new TCPStore for every retry"). A rank of the new attempt that reads a dead rank's
address before that rank has written its new one makes Gloo's constructor fail with
"connectFullMesh failed ... Connection refused" where it connects to that address, or wait until
the group's timeout where the pair's two ranks, comparing different addresses, both take the
listening side (or NCCL reads an old unique id), so ``--max-restarts`` brings a job back only by
chance once its group had been initialised.

:func:`init_process_group` takes torch's arguments. When it runs under the agent's shared store it
bootstraps a fresh store for this attempt: global rank 0 starts a TCPStore server on a free port
(its process is new at every restart, so nothing of an earlier attempt is in it) and publishes its
address with a random token through the agent's store; every other rank reads that address,
connects, and checks the token there, so a stale address from an earlier attempt (whose server died
with its process) is retried rather than trusted. The process group is then created on that store.
Elsewhere it is torch's ``init_process_group`` unchanged. :func:`rpc_init_method` gives
``torch.distributed.rpc`` the same fresh store (the parameter-server modes use it).
"""
from __future__ import annotations

import datetime
import importlib
import logging
import os
import socket
import time
import uuid
from typing import Any, Optional
from urllib.parse import parse_qsl, urlparse

import torch.distributed as dist


__all__ = ["init_process_group"]

log = logging.getLogger("hetlb")

_KEY = "hetlb/bootstrap"  # in the agent's store: "host:port:token" of this attempt's store
#: How long one connection attempt to a published address may take before it counts as stale.
_PROBE_S = 2.0


def _under_agent_store(init_method: Optional[str], store: Any) -> bool:
    return (store is None and init_method in (None, "env://")
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ)


def init_process_group(backend: Optional[str] = None, init_method: Optional[str] = None,
                       timeout: Optional[datetime.timedelta] = None, world_size: int = -1, rank: int = -1,
                       store: Any = None, group_name: str = "", pg_options: Any = None,
                       device_id: Any = None) -> None:
    """``torch.distributed.init_process_group`` (same arguments), restart-safe under torchrun.

    Under torchrun's shared agent store, the group is created on a store made fresh for this
    attempt (see the module docstring), so a job restarted by ``--max-restarts`` (or after a
    membership change) connects; otherwise the call is passed to torch unchanged.
    """
    kwargs = {"group_name": group_name, "pg_options": pg_options}
    if device_id is not None:
        kwargs["device_id"] = device_id
    if not _under_agent_store(init_method, store):
        dist.init_process_group(backend, init_method=init_method, timeout=timeout, world_size=world_size,
                                rank=rank, store=store, **kwargs)
        return
    rank = int(os.environ["RANK"]) if rank < 0 else int(rank)
    world_size = int(os.environ["WORLD_SIZE"]) if world_size < 0 else int(world_size)
    wait = timeout if timeout is not None else datetime.timedelta(minutes=10)
    fresh = _fresh_store(rank, world_size, wait)
    dist.init_process_group(backend, timeout=timeout, world_size=world_size, rank=rank, store=fresh, **kwargs)


#: The rendezvous scheme of :func:`rpc_init_method` (a store fresh for this attempt).
_SCHEME = "hetlb-fresh"


def rpc_init_method(init_method: Optional[str]) -> str:
    """``init_method`` for ``torch.distributed.rpc``, restart-safe under torchrun: under the
    agent's shared store, ``hetlb-fresh://``, a rendezvous that bootstraps from a store made
    fresh for this attempt as :func:`init_process_group` does (``init_rpc`` takes no store, so
    the store comes through a rendezvous handler, registered once per process); elsewhere
    ``init_method`` unchanged."""
    if not _under_agent_store(init_method, None):
        return init_method or "env://"
    # (torch.distributed.rendezvous is also a function re-exported by torch.distributed: take
    # the module's own name)
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    try:
        rdzv.register_rendezvous_handler(_SCHEME, _fresh_rendezvous)
    except RuntimeError as e:  # registered by an earlier call in this process
        if "already registered" not in str(e):
            raise
    return f"{_SCHEME}://"


def _fresh_rendezvous(url: str, **kwargs: Any) -> Any:
    """Rendezvous handler of ``hetlb-fresh://?rank=R&world_size=W`` (see :func:`rpc_init_method`)."""
    query = dict(parse_qsl(urlparse(url).query))
    rank, world_size = int(query["rank"]), int(query["world_size"])
    timeout = kwargs.get("timeout") or datetime.timedelta(minutes=10)
    yield _fresh_store(rank, world_size, timeout), rank, world_size


def _fresh_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if rank == 0:
        token = uuid.uuid4().hex
        # MASTER_ADDR is the host of global rank 0 (the agent of rendezvous rank 0 serves it).
        server = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        server.set("hetlb/token", token)
        agent.set(_KEY, f"{host}:{server.port}:{token}")
        log.info("hetlb.init_process_group: this attempt's store at %s:%d", host, server.port)
        return server
    deadline = time.monotonic() + timeout.total_seconds()
    tried = None
    while True:
        value = agent.get(_KEY).decode()  # blocks until rank 0 of some attempt has published
        if value != tried:
            tried = value
            addr, port_s, token = value.rsplit(":", 2)
            client = _connect(addr, int(port_s), world_size, token)
            if client is not None:
                return client
            log.info("hetlb.init_process_group: %s is an earlier attempt's store; waiting for this one's", value)
        if time.monotonic() > deadline:
            raise TimeoutError(f"hetlb.init_process_group: rank 0 published no reachable store within "
                               f"{timeout} (last seen: {value!r})")
        time.sleep(0.05)


def _connect(addr: str, port: int, world_size: int, token: str) -> Optional[dist.TCPStore]:
    """A client of the store at ``addr:port`` if it is live and holds ``token``, else None."""
    try:
        # A plain connection first: where nothing listens (a dead attempt's store) it fails at
        # once and quietly, where a TCPStore client retries until its timeout and logs each try
        # with a C++ stack trace.
        socket.create_connection((addr, port), timeout=_PROBE_S).close()
    except OSError:
        return None
    try:
        client = dist.TCPStore(addr, port, world_size, is_master=False,
                               timeout=datetime.timedelta(seconds=_PROBE_S))
        if client.get("hetlb/token").decode() != token:
            return None
    except (RuntimeError, OSError):  # refused, or not ours (DistStoreError is a RuntimeError)
        return None
    return client
