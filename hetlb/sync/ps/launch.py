"""Starting and stopping a parameter-server job on this process: :func:`run_ps`."""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed.rpc as rpc
from torch.utils.data import default_collate

from hetlb.core.checks import choice, integer
from hetlb.ranks.elastic import rpc_init_method
from hetlb.sim.emulate import Emulator
from hetlb.sync.ps.server import MODES, ParameterServer
from hetlb.sync.ps.wire import SERVER, worker_name
from hetlb.sync.ps.worker import Worker


__all__ = ["run_ps"]


def run_ps(mode: str, model: torch.nn.Module, dataset: Any, loss_fn: Callable, *,
           optimizer: Optional[Callable[[Any], torch.optim.Optimizer]] = None,
           global_batch: int, epochs: int = 1, rank: Optional[int] = None,
           world_size: Optional[int] = None, init_method: str = "env://",
           emulator: Optional[Emulator] = None, link: float = 0.0,
           worker_timeout: float = 600.0, collate_fn: Callable = default_collate,
           **server_kw: Any) -> Dict[str, Any]:
    """Run parameter-server training on this process: rank 0 serves, the others work.

    Initialises RPC (``init_method``, ``rank`` and ``world_size`` default to torchrun's
    environment), runs, and shuts RPC down without the graceful barrier (a dead worker cannot
    hang it). ``optimizer`` builds the server's optimizer from the model's parameters (default
    SGD, lr 0.1); ``collate_fn`` builds a worker's batch from ``[dataset[i] for i in indices]``
    and must return ``(input, target)``. Returns on rank 0 ``{"server": ParameterServer}`` (its ``log``, ``model``), on
    workers ``{"worker": Worker}``.
    """
    rank = int(os.environ["RANK"]) if rank is None else integer(rank, "run_ps: rank", 0)
    world = int(os.environ["WORLD_SIZE"]) if world_size is None else integer(world_size,
                                                                            "run_ps: world_size", 2)
    if world < 2:
        raise ValueError(f"run_ps: a parameter server needs a server and at least one worker "
                         f"(world_size >= 2), got {world}")
    choice(mode, "run_ps: mode", MODES)
    # (under torchrun, a store fresh for this attempt: a restarted job would otherwise read the
    # failed attempt's addresses from the agent's shared store)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=rpc_init_method(init_method),
                                           rpc_timeout=worker_timeout,
                                           num_worker_threads=max(16, 2 * world))
    rpc.init_rpc(SERVER if rank == 0 else worker_name(rank), rank=rank, world_size=world,
                 rpc_backend_options=opts)
    try:
        if rank == 0:
            make = optimizer or (lambda params: torch.optim.SGD(params, lr=0.1))
            server = ParameterServer(model, make(model.parameters()), len(dataset), global_batch,
                                     world - 1, mode, epochs=epochs, **server_kw)
            server.serve()
            return {"server": server}
        worker = Worker(model, dataset, loss_fn, rank, emulator=emulator, link=link,
                        timeout=worker_timeout, collate_fn=collate_fn)
        worker.run()
        return {"worker": worker}
    finally:
        rpc.shutdown(graceful=False)
