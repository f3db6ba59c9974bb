"""A worker of the parameter server (ranks ``1..K``): asks for a batch, computes its summed
gradient on the parameters it was handed, and pushes it back (see :mod:`hetlb.sync.ps`)."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed.rpc as rpc
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.utils.data import default_collate

from hetlb.comm.hook import shapes_digest
from hetlb.comm.probes import hardware_info
from hetlb.core.checks import instance, integer, number
from hetlb.sim.emulate import Emulator, sleep_until
from hetlb.sync.ps.wire import SERVER, ps_bye, ps_call


__all__ = ["Worker", "pushed"]

log = logging.getLogger("hetlb")


class Worker:
    """A worker of :mod:`hetlb.sync.ps` (ranks ``1..K``; after ``rpc.init_rpc``).

    Args:
        model: this worker's copy of the model (its parameters are overwritten by the server's).
        dataset: the full dataset (map-style); the server hands out indices into it.
        loss_fn: ``loss_fn(output, target)``, mean over the batch (the summed gradient is the
            mean's gradient times the batch).
        rank: this worker's rank (``1..K``).
        emulator: stretches each iteration's compute to an emulated worker's time (one with a
            ``fail=True`` disturbance is refused: a delay past the server's ``timeout`` emulates
            a dead worker).
        link: emulated seconds added to every exchange with the server.
        collate_fn: builds a batch from ``[dataset[i] for i in indices]``.
        timeout: seconds one call may wait for the server (synchronisations, staleness bound and
            epoch ends included).
    """

    def __init__(self, model: torch.nn.Module, dataset: Any, loss_fn: Callable, rank: int, *,
                 emulator: Optional[Emulator] = None, link: float = 0.0,
                 collate_fn: Callable = default_collate, timeout: float = 600.0,
                 server: str = SERVER) -> None:
        instance(model, "Worker: model", torch.nn.Module, "a torch.nn.Module")
        if not callable(loss_fn):
            raise ValueError(f"Worker: loss_fn must be callable, got {loss_fn!r}")
        self.rank = integer(rank, "Worker: rank", 1)
        if emulator is not None:
            instance(emulator, "Worker: emulator", Emulator, "a hetlb.sim.emulate.Emulator")
            if emulator.failures:
                # A push carries a finite compute time (the server refuses others): a worker
                # cannot report a step without progress. The server's own failure path is the
                # timeout, so a long enough delay is how a dead worker is emulated here.
                raise ValueError(f"fail=True is emulated by the Balancer only; a parameter-server "
                                 f"worker cannot report a step without progress, got an emulator "
                                 f"with {list(emulator.failures)}: drop fail=True, or emulate a "
                                 f"dead worker with Disturbance(start, extra=seconds) longer than "
                                 f"the server's timeout (the server drops it and moves its share)")
        if not callable(collate_fn):
            raise ValueError(f"Worker: collate_fn must be callable, got {collate_fn!r}")
        self.model, self.dataset, self.loss_fn = model, dataset, loss_fn
        self.emulator, self.collate_fn, self.server = emulator, collate_fn, server
        self.link = number(link, "Worker: link", minimum=0.0)
        self.timeout = number(timeout, "Worker: timeout", above=0.0)
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._buffers = list(model.buffers())
        #: Per iteration: samples, compute seconds, seconds waiting for the server.
        self.iterations: List[Dict[str, float]] = []
        self.dropped = False

    def _call(self, push: Optional[Dict[str, Any]], held: float = 0.0,
              drop_after: Optional[float] = None) -> Optional[Dict[str, Any]]:
        """One call to the server: its reply. The server's error is raised here, after a
        goodbye (the server waits for it before it stops). None: the server could not be
        reached after this worker held its batch ``held`` seconds, past the server's timeout
        ``drop_after`` (it was dropped, and the server may have finished and left since)."""
        t0 = time.perf_counter()
        try:
            reply = rpc.rpc_sync(self.server, ps_call, args=(self.server, self.rank, push),
                                 timeout=self.timeout)
        except RuntimeError as e:
            if drop_after is None or held <= drop_after:
                raise
            log.warning("worker %d: the server could not be reached after this worker held "
                        "its batch %.1f s, longer than the server's timeout (%.1f s): it was "
                        "dropped, and the server has finished or stopped (%s); stopping",
                        self.rank, held, drop_after, str(e).splitlines()[0][:200])
            return None
        error = reply.get("error")
        if error is not None:
            self._goodbye()
            raise error
        if self.link:
            sleep_until(time.perf_counter() + self.link)
        reply["_wait"] = time.perf_counter() - t0
        return reply

    def _goodbye(self) -> None:
        try:
            rpc.rpc_sync(self.server, ps_bye, args=(self.server, self.rank), timeout=10)
        except RuntimeError:
            pass  # the server is gone already

    def run(self) -> int:
        """Train until the server says done; the number of iterations this worker ran."""
        hello = {"hello": True, "hardware": hardware_info(),
                 "numel": sum(p.numel() for p in self._params), "shapes": shapes_digest(self._params),
                 "buffer_shapes": shapes_digest(self._buffers)}
        reply = self._call(hello)
        deadline = time.monotonic() + self.timeout
        while reply.get("reason") == "no server running" and time.monotonic() < deadline:
            time.sleep(0.05)  # rank 0 has not reached serve() yet
            reply = self._call(hello)
        version = -1
        while not reply["done"]:
            if reply["params"] is not None:
                with torch.no_grad():
                    vector_to_parameters(reply["params"], self._params)
                    for b, v in zip(self._buffers, reply.get("buffers") or []):
                        b.copy_(v)
                version = int(reply["version"])
            idx = reply["indices"]
            handed = time.monotonic()
            x, y = self.collate_fn([self.dataset[i] for i in idx])
            t0 = time.perf_counter()
            for p in self._params:
                p.grad = None
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            grad = parameters_to_vector([p.grad if p.grad is not None else torch.zeros_like(p)
                                         for p in self._params]) * len(idx)
            compute = time.perf_counter() - t0
            if self.emulator is not None:
                compute = self.emulator.stretch(int(reply["iteration"]), len(idx), t0)
            self.iterations.append({"n": len(idx), "compute": compute, "wait": reply["_wait"]})
            held = time.monotonic() - handed
            answer = self._call({"grad": grad.detach(), "n": len(idx), "compute": compute,
                                 "version": version, "indices": idx,
                                 "buffers": [pushed(b) for b in self._buffers]},
                                held, reply.get("drop_after"))
            if answer is None:
                self.dropped = True
                return len(self.iterations)
            reply = answer
        self.dropped = bool(reply.get("dropped"))
        if self.dropped:
            log.warning("worker %d: the server dropped this worker (it did not answer within the "
                        "server's timeout); stopping", self.rank)
        self._goodbye()
        return len(self.iterations)


def pushed(buffer: torch.Tensor) -> Optional[torch.Tensor]:
    """A buffer as a worker pushes it (None: one that is neither floating nor integer, e.g. a
    bool mask, which the server keeps as it is)."""
    if buffer.is_floating_point() or (not buffer.is_complex() and buffer.dtype != torch.bool):
        return buffer.detach().cpu().clone()
    return None
