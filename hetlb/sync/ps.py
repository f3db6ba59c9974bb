"""Parameter-server training on ``torch.distributed.rpc``: WLBS's limited synchronous parallel
(LSP), stale synchronous parallel (SSP) and asynchronous parallel (ASP).

Rank 0 is the server: it holds the model and the optimizer, hands out batches (sample indices of
the epoch's order) and applies updates. Ranks ``1..K`` are workers: each asks for a batch, pulls
the parameters with it, computes the summed gradient of its batch and pushes it back; the reply
to a push is the next batch (and the parameters, when they changed). Workers never talk to each
other. Every call is one ``rpc_sync`` to a function marked ``@rpc.functions.async_execution``,
so a worker that must wait (for a synchronisation, a staleness bound or the end of an epoch)
holds no server thread.

Modes (WLBS section 3.1; ABS-SGD's and LBB's baselines):

* ``lsp``: the first ``l`` workers to push (of those that still have work this epoch) form a
  *limited synchronisation*: their gradients are aggregated into one update and those ``l`` get
  the new parameters; the others keep computing on what they have. After ``m`` limited
  synchronisations the next one is *global*: every worker with work pushes and waits, and all get
  the same parameters. Each worker's batch comes from a :class:`hetlb.policies.WLBS` (initial
  division by hardware indicators, small per-round and major per-epoch adjustments,
  redistribution of a failed worker's share).
* ``ssp``: every push is applied at once; a worker that has completed ``c`` iterations gets its
  next batch only while ``c - min_k c_k <= s`` over the workers that still have work (ABS-SGD's
  baseline: ``s = 10``).
* ``asp``: every push applied at once, no bound.

Aggregation (the issue leaves WLBS's section 3.4 expression open; this is the choice): an update
is the sum of the pushed *summed* gradients divided by the total batch of the pushes it contains,
``g = sum_k G_k / sum_k B_k``: the mean gradient of one large batch, the weighting hetlb uses
elsewhere (``weighting="samples"``). Section 3.4's ``u_{k,t}`` sums per-worker updates without a
batch weight, which with unequal WLBS batches would let a worker's share of the update grow with
its number of pushes *and* not shrink with its batch; with equal batches the two agree up to the
learning-rate scale ``1/l``. For ``ssp``/``asp`` an update contains one push: its batch mean.

A worker that does not push within ``timeout`` seconds of getting its batch is dropped: its batch
goes back to the epoch's pool (handed out again first), WLBS gets a record with ``+inf`` compute
for it and moves its share to the survivors, and training goes on. A dropped worker that comes
back later is told it was dropped and stops. Each sample's gradient is applied exactly once per
epoch; an epoch ends when every sample has been applied (workers without work wait for it).

The server checkpoints (model, optimizer, the epoch's applied samples, clocks, the policy) every
``checkpoint_every`` updates through a :class:`hetlb.Checkpointer` and resumes from the newest.
Shutdown: when the last epoch ends every worker is answered ``done``, says goodbye and leaves;
the server waits for the goodbyes (at most ``timeout``) and everyone shuts RPC down without the
graceful barrier, so a dead worker cannot hang it.

Errors: a call that fails on the server (a push of samples the worker does not hold, a malformed
push or model, a sample applied twice, the optimizer raising) stops it, as its state may be
half-updated. Every live worker gets the server's error at its waiting or next call (the
message names the server; the type is the original one where it is a built-in exception, else
``RuntimeError``), says goodbye and raises it; the server waits for the goodbyes (at most
``timeout``, so the answers go out before RPC shuts down) and raises the original error.

Model buffers (BatchNorm's running statistics) travel with the parameters: a worker loads the
server's buffers with its parameters and pushes its buffers after its forward pass. An update sets
the server's floating buffers to the members' batch-weighted mean (``sum_k n_k * b_k / sum_k
n_k``: with the pushes of one version, the running statistics of the batch-weighted mean of the
members' batch statistics) and its integer ones (``num_batches_tracked``) to the largest seen (one
large batch is one forward pass). Other buffers (bool) stay the server's. So the server's model is
ready to evaluate, as after DDP training. A stale push (ASP, SSP) sets the statistics its worker
computed from the version it was handed, as DDP's ``broadcast_buffers`` lets one rank's win: adding
its change to newer statistics instead would be a delayed feedback that diverges with many workers
(BatchNorm's momentum 0.1 and 17 ASP workers).
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed.rpc as rpc
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.utils.data import default_collate

from hetlb.comm.hook import shapes_digest
from hetlb.comm.probes import hardware_info
from hetlb.core.checks import choice, flag, instance, integer, number
from hetlb.core.telemetry import History, StepRecord
from hetlb.policies.base import (Context, SizedPolicy, check_same_policy, from_state,
                                 policy_settings, to_state)
from hetlb.policies.loop import DecisionLoop, Snapshot
from hetlb.policies.uniform import Uniform
from hetlb.policies.wlbs import WLBS
from hetlb.ranks.elastic import rpc_init_method
from hetlb.sim.emulate import Emulator, sleep_until
from hetlb.train.checkpoint import Checkpointer


__all__ = ["ParameterServer", "Worker", "MODES", "SERVER", "worker_name", "run_ps"]

log = logging.getLogger("hetlb")

#: Records the server's history keeps.
_HISTORY = 1024

MODES = ("lsp", "ssp", "asp")
#: RPC name of the server (rank 0); workers are ``worker_name(rank)``.
SERVER = "hetlb-ps"
_FORMAT = "hetlb.ParameterServer/1"

# The server a worker's RPC reaches. RPC runs module-level functions on the callee, and an RRef
# cannot be handed to a worker outside an RPC call, so the live server of this process is found
# here; it is set only inside ParameterServer.serve() and cleared when it returns.
_LIVE: Dict[str, "ParameterServer"] = {}


def worker_name(rank: int) -> str:
    """RPC name of worker ``rank`` (``1..K``)."""
    return f"hetlb-w{int(rank)}"


@rpc.functions.async_execution
def _ps_call(server: str, rank: int, push: Optional[Dict[str, Any]]) -> torch.futures.Future:
    ps = _LIVE.get(server)
    if ps is None:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result({"done": True, "dropped": False, "reason": "no server running"})
        return fut
    return ps._call(rank, push).then(_as_reply)


def _as_reply(fut: torch.futures.Future) -> Dict[str, Any]:
    """The answer of a call, its error carried as ``{"error": exception}``: torch's ``rpc_sync``
    returns (does not raise) an exception set on an ``async_execution`` function's future (torch
    2.13), so the worker raises what it finds here, whichever way torch delivers it."""
    try:
        return fut.value()
    except Exception as e:  # noqa: BLE001 (delivered to the worker, which raises it)
        return {"done": True, "error": e}


def _server_error(error: BaseException, message: str) -> Exception:
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


def _ps_bye(server: str, rank: int) -> None:
    ps = _LIVE.get(server)
    if ps is not None:
        ps._bye(rank)


class ParameterServer:
    """The server of :mod:`hetlb.sync.ps` (runs on rank 0; see the module docstring).

    Args:
        model: the model trained (its parameters are the global ones; updated in place).
        optimizer: optimizer over ``model``'s parameters (stepped once per update).
        num_samples: dataset length (the workers hold the data; the server hands out indices).
        global_batch: samples per round over all workers (the policy's total).
        workers: number of workers ``K`` (ranks ``1..K``).
        mode: ``"lsp"``, ``"ssp"`` or ``"asp"``.
        l: LSP's limited threshold (workers per limited synchronisation), ``1 <= l <= K``;
            default ``ceil(K / 2)``.
        m: limited synchronisations between two global ones (LSP), >= 1 (WLBS's example: 3).
        staleness: SSP's bound ``s`` (ABS-SGD's baseline: 10).
        policy: batch policy (default: :class:`~hetlb.policies.WLBS` for ``lsp``, the equal split
            for ``ssp``/``asp``); it sees one record per round (every working worker reported).
        epochs: epochs to train.
        seed: seed of each epoch's sample order.
        timeout: seconds a worker may hold a batch (or take to say hello) before it is dropped.
        lower: smallest batch of a worker (a dropped worker is held there and gets nothing).
        checkpointer: where to checkpoint (None: never); ``checkpoint_every`` updates apart.
        resume: load the checkpointer's newest checkpoint, if any, before serving.
        snapshot_every: keep a copy of the parameters after every ``snapshot_every``-th update
            in :attr:`snapshots` (0: never), e.g. to evaluate a convergence curve afterwards
            without stopping the server.
        name: RPC name the server answers under (the workers' ``server``).

    Attributes:
        log: the server's events (dicts with ``kind``): ``start`` (first sizes), ``push`` (a
            worker's gradient arrived: rank, samples, the version it was computed on),
            ``sync`` (an update: ``type`` limited / flush / global / async, ``members``,
            ``stale`` updates per member, ``ns`` samples per member, ``batch``, ``version``,
            ``epoch``, ``indices`` in member order),
            ``handout`` (rank, its ``clock`` and the working workers' ``min_clock``, samples),
            ``sizes`` (the policy changed the batches), ``drop``, ``epoch`` (an epoch ended).
        snapshots: ``(version, seconds since the first batch was handed out, flat parameters)``.
        sizes: int64 ``[K]`` current batch per worker.
        clock: int64 ``[K]`` iterations applied per worker.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, num_samples: int,
                 global_batch: int, workers: int, mode: str = "lsp", *, l: Optional[int] = None,
                 m: int = 3, staleness: int = 10, policy: Optional[SizedPolicy] = None,
                 epochs: int = 1, seed: int = 0, timeout: float = 60.0, lower: int = 1,
                 checkpointer: Optional[Checkpointer] = None, checkpoint_every: int = 0,
                 resume: bool = True, snapshot_every: int = 0, name: str = SERVER) -> None:
        instance(model, "ParameterServer: model", torch.nn.Module, "a torch.nn.Module")
        instance(optimizer, "ParameterServer: optimizer", torch.optim.Optimizer, "a torch.optim.Optimizer")
        self.mode = choice(mode, "ParameterServer: mode", MODES)
        self.workers = integer(workers, "ParameterServer: workers", 1)
        K = self.workers
        self.num_samples = integer(num_samples, "ParameterServer: num_samples", 1)
        self.global_batch = integer(global_batch, "ParameterServer: global_batch", K)
        self.l = integer((K + 1) // 2 if l is None else l, "ParameterServer: l", 1)
        if self.l > K:
            raise ValueError(f"ParameterServer: l must be <= workers ({K}), got {self.l}")
        self.m = integer(m, "ParameterServer: m", 1)
        self.staleness = integer(staleness, "ParameterServer: staleness", 0)
        self.epochs = integer(epochs, "ParameterServer: epochs", 1)
        self.seed = integer(seed, "ParameterServer: seed", 0)
        self.timeout = number(timeout, "ParameterServer: timeout", above=0.0)
        self.lower = integer(lower, "ParameterServer: lower", 0)
        if checkpointer is not None:
            instance(checkpointer, "ParameterServer: checkpointer", Checkpointer, "a hetlb.Checkpointer")
        self.checkpointer = checkpointer
        self.checkpoint_every = integer(checkpoint_every, "ParameterServer: checkpoint_every", 0)
        self.resume = flag(resume, "ParameterServer: resume")
        self.snapshot_every = integer(snapshot_every, "ParameterServer: snapshot_every", 0)
        self.snapshots: List[Any] = []
        self._t0: Optional[float] = None
        self.name = name
        if policy is None:
            policy = WLBS() if self.mode == "lsp" else Uniform()
        if not all(callable(getattr(policy, a, None)) for a in ("start", "decide", "state_dict",
                                                                  "load_state_dict")):
            raise ValueError(f"ParameterServer: policy must be a hetlb policy deciding sizes "
                             f"(e.g. hetlb.policies.WLBS()), got {policy!r}")
        #: The policy with its history and decision (record -> decide -> check).
        self.loop = DecisionLoop(policy, K, history=_HISTORY)
        self.model, self.optimizer = model, optimizer
        self._params = [p for p in model.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("ParameterServer: the model has no trainable parameters")
        self._numel = sum(p.numel() for p in self._params)
        self._shapes = shapes_digest(self._params)
        # (running statistics: the workers' forward passes change them, the updates carry it)
        self._buffers = list(model.buffers())
        self._buffer_shapes = shapes_digest(self._buffers)
        self._lock = threading.Lock()
        self._finished = threading.Event()
        #: Events: dicts with ``kind`` ``"handout"``, ``"sync"``, ``"drop"``, ``"epoch"``, ``"wait"``.
        self.log: List[Dict[str, Any]] = []
        self._reset_state()

    @property
    def policy(self) -> Any:
        """The policy (owned by :attr:`loop`)."""
        return self.loop.policy

    @property
    def history(self) -> History:
        """The workers' records (owned by :attr:`loop`)."""
        return self.loop.history

    # -- state ------------------------------------------------------------------------------

    def _reset_state(self) -> None:
        K = self.workers
        self.version = 0
        self.epoch = 0
        self.limited = 0  # limited synchronisations since the last global one
        self.clock = np.zeros(K, np.int64)  # iterations applied per worker
        self.alive = np.ones(K, bool)
        self.applied = np.zeros(self.num_samples, bool)  # this epoch's samples already applied
        self.sizes = np.zeros(K, np.int64)
        self.loop = DecisionLoop(self.loop.policy, K, history=_HISTORY)
        self.records = 0
        self._hardware: List[Optional[Dict[str, float]]] = [None] * K
        self._hello_deadline = time.monotonic() + self.timeout
        self._waiters: Dict[int, torch.futures.Future] = {}
        self._known: Dict[int, int] = {}  # version each waiting worker holds
        self._pending: "OrderedDict[int, Dict[str, Any]]" = OrderedDict()
        self._out: Dict[int, List[int]] = {}  # worker -> indices it holds
        self._handed_at: Dict[int, float] = {}
        self._idle = np.zeros(K, bool)  # no work left this epoch
        self._fresh = np.zeros(K, bool)
        self._last_batch = np.zeros(K, np.int64)
        self._last_time = np.full(K, np.nan)
        self._byes: set = set()
        self._error: Optional[BaseException] = None
        self._failed_in: Optional[int] = None  # the worker whose call failed on the server
        self._new_order()

    def _new_order(self) -> None:
        order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(
            self.seed * 1_000_003 + self.epoch)).numpy()
        self._pool: List[int] = [int(i) for i in order if not self.applied[i]]
        self._pool.reverse()  # popped from the end: the order's front first

    def state_dict(self) -> Dict[str, Any]:
        """Model, optimizer, version, epoch, the epoch's applied samples, clocks, policy: what a
        resumed server needs to continue with each sample applied exactly once per epoch."""
        with self._lock:
            return self._state()

    def _state(self) -> Dict[str, Any]:
        return {"format": _FORMAT, "mode": self.mode, "num_samples": self.num_samples,
                "workers": self.workers, "global_batch": self.global_batch,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(), "version": self.version,
                "epoch": self.epoch, "limited": self.limited,
                "clock": torch.from_numpy(self.clock.copy()),
                "applied": torch.from_numpy(self.applied.copy()),
                "sizes": torch.from_numpy(self.sizes.copy()), "records": self.records,
                "started": self.loop.started, "history": self.history.state_dict(),
                "policy": to_state(self.policy.state_dict()) if self.loop.started else None,
                "policy_type": type(self.policy).__name__,
                "policy_settings": policy_settings(self.policy)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (before :meth:`serve`); every worker starts alive."""
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(f"ParameterServer.load_state_dict: not a ParameterServer checkpoint "
                             f"(format {state.get('format') if isinstance(state, dict) else state!r})")
        # The checkpoint's batch sizes and policy sum to its global_batch: resumed with another
        # one they would keep the old total. A checkpoint saved before global_batch was stored
        # has no such key and is not checked on it.
        for key in ("mode", "num_samples", "workers", "global_batch"):
            saved = state.get(key, self.global_batch) if key == "global_batch" else state[key]
            if saved != getattr(self, key):
                raise ValueError(f"ParameterServer.load_state_dict: the checkpoint has {key}="
                                 f"{saved!r}, this server {getattr(self, key)!r}; resume with "
                                 f"the checkpoint's {key}, or start afresh in another checkpoint "
                                 f"directory")
        check_same_policy(self.policy, state, "this server")  # before anything changes
        self._reset_state()
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version, self.epoch = int(state["version"]), int(state["epoch"])
        self.limited, self.records = int(state["limited"]), int(state["records"])
        self.clock = state["clock"].numpy().astype(np.int64).copy()
        self.applied = state["applied"].numpy().astype(bool).copy()
        self.sizes = state["sizes"].numpy().astype(np.int64).copy()
        if state["started"]:
            self.loop.restore(Snapshot(History.from_state_dict(state["history"]), self.sizes.copy(),
                                       from_state(state["policy"])), self._context())
        self._new_order()

    # -- serving ----------------------------------------------------------------------------

    def serve(self) -> None:
        """Answer the workers until the last epoch ends (call on rank 0 after ``rpc.init_rpc``).

        Raises ``RuntimeError`` if every worker was dropped, and the error of a call that failed
        on the server once every live worker was told (said goodbye) or ``timeout`` passed."""
        if self.checkpointer is not None and self.resume:
            state = self.checkpointer.latest()
            if state is not None:
                self.load_state_dict(state)
                log.info("parameter server: resumed at update %d, epoch %d", self.version, self.epoch)
        if self.epoch >= self.epochs:
            self._finished.set()
        if self.name in _LIVE:
            raise RuntimeError(f"a parameter server named {self.name!r} already runs in this process")
        _LIVE[self.name] = self
        self._hello_deadline = time.monotonic() + self.timeout
        try:
            tick = min(1.0, self.timeout / 4)
            while not self._finished.wait(tick):
                self._check_timeouts()
            # Every worker that is alive was answered "done" (or the server's error, or gets it
            # at its next call); wait for their goodbyes: an answer still unsent when RPC shuts
            # down is lost, and the worker would see a closed connection instead.
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline:
                with self._lock:
                    if all(w in self._byes for w in np.flatnonzero(self.alive).tolist()):
                        break
                time.sleep(0.01)
            if self._error is not None:
                raise self._error
        finally:
            _LIVE.pop(self.name, None)

    def _call(self, rank: int, push: Optional[Dict[str, Any]]) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        w = int(rank) - 1
        failed: list = []
        try:
            with self._lock:
                # After a failure a live worker's call (one that was computing) gets the error.
                stopped = self._failed_in is not None and 0 <= w < self.workers and \
                    bool(self.alive[w])
                ready = [] if stopped else self._receive(w, push, fut)
        except BaseException as e:  # noqa: BLE001 (the callers get it as their call's error)
            log.exception("parameter server: call from worker %d failed; stopping", rank)
            with self._lock:
                # The server's state may be half-updated: stop rather than train on it.
                if self._error is None:
                    self._error, self._failed_in = e, int(rank)
                failed = [f for f in self._waiters.values() if f is not fut]
                self._waiters.clear()
                self._finished.set()
            for f in [fut] + failed:
                f.set_exception(self._failure())
            return fut
        if stopped:
            fut.set_exception(self._failure())
            return fut
        for f, reply in ready:
            f.set_result(reply)
        return fut

    def _failure(self) -> Exception:
        """The error a worker's call gets once a call failed on the server (``_error``)."""
        e = self._error
        return _server_error(e, f"parameter server {self.name!r} failed in worker "
                                f"{self._failed_in}'s call and stopped: {type(e).__name__}: {e}")

    def _bye(self, rank: int) -> None:
        with self._lock:
            self._byes.add(int(rank) - 1)

    def _receive(self, w: int, push: Optional[Dict[str, Any]], fut: torch.futures.Future) -> list:
        if not 0 <= w < self.workers:
            raise ValueError(f"parameter server: worker rank {w + 1} outside 1..{self.workers}")
        if not self.alive[w] or self._finished.is_set():
            return [(fut, {"done": True, "dropped": not self.alive[w],
                           "reason": "dropped" if not self.alive[w] else "finished"})]
        if w in self._waiters:
            raise RuntimeError(f"worker {w + 1} called twice without waiting for the answer")
        if push is None or push.get("hello"):
            if push is not None:
                numel = push.get("numel")
                if numel is not None and int(numel) != self._numel:
                    raise ValueError(f"worker {w + 1}'s model has {int(numel)} trainable parameter "
                                     f"elements, the server's {self._numel}: every rank must build "
                                     f"the same model")
                shapes = push.get("shapes")
                if shapes is not None and shapes != self._shapes:
                    # (the same element count in other shapes would train a scrambled model)
                    raise ValueError(f"worker {w + 1}'s model has trainable parameters of other "
                                     f"shapes or dtypes than the server's (both {self._numel} "
                                     f"elements): every rank must build the same model")
                buffer_shapes = push.get("buffer_shapes")
                if buffer_shapes is not None and buffer_shapes != self._buffer_shapes:
                    raise ValueError(f"worker {w + 1}'s model has other buffers (BatchNorm "
                                     f"statistics) than the server's ({len(self._buffers)}): every "
                                     f"rank must build the same model")
                self._hardware[w] = dict(push.get("hardware") or {})
        else:
            held = self._out.pop(w, None)
            self._handed_at.pop(w, None)
            if held is None or list(push["indices"]) != held:
                raise RuntimeError(f"worker {w + 1} pushed a gradient of samples it does not hold "
                                   f"(it holds {None if held is None else len(held)} samples); the "
                                   f"worker and server are out of step")
            grad = push.get("grad")
            if not isinstance(grad, torch.Tensor) or grad.numel() != self._numel or \
                    int(push["n"]) != len(held) or not math.isfinite(float(push["compute"])):
                raise ValueError(f"worker {w + 1} pushed a malformed gradient (a tensor of "
                                 f"{self._numel} elements, n = {len(held)} samples and a finite "
                                 f"compute time expected; got "
                                 f"{grad.numel() if isinstance(grad, torch.Tensor) else grad!r} "
                                 f"elements, n = {push.get('n')!r}, compute = {push.get('compute')!r})")
            pushed = push.get("buffers")
            if self._buffers and (not isinstance(pushed, (list, tuple)) or len(pushed) != len(self._buffers)
                                  or any(d is not None and (not isinstance(d, torch.Tensor) or d.shape != b.shape)
                                         for d, b in zip(pushed, self._buffers))):
                raise ValueError(f"worker {w + 1} pushed malformed buffers (a list of "
                                 f"{len(self._buffers)} tensors shaped as the model's buffers "
                                 f"expected, got {type(pushed).__name__})")
            self._pending[w] = push
            self.log.append({"kind": "push", "rank": w + 1, "n": int(push["n"]),
                             "version": int(push["version"]), "time": time.time()})
        self._waiters[w] = fut
        self._known[w] = int(push.get("version", -1)) if push is not None else -1
        return self._advance()

    def _advance(self) -> list:
        """Apply every synchronisation that is due and answer every worker that can go on."""
        ready: list = []
        # Every live worker says hello first (also after a resume: a worker that never comes
        # back must be dropped, not counted as working with its checkpointed clock).
        if not all(h is not None or not a for h, a in zip(self._hardware, self.alive)):
            return ready
        if not self.loop.started:
            self._start()
        changed = True
        while changed:
            changed = self._sync()
            changed |= self._answer(ready)
            if self._epoch_complete():
                self._end_epoch()
                changed = True
            if self._finished.is_set():
                for w in list(self._waiters):
                    ready.append((self._waiters.pop(w), {"done": True, "dropped": False,
                                                         "reason": "finished"}))
                return ready
        return ready

    def _context(self) -> Context:
        hw = [h if h is not None else {} for h in self._hardware]
        return Context(self.workers, self.global_batch, np.full(self.workers, self.lower),
                       np.full(self.workers, self.global_batch), hardware=hw)

    def _start(self) -> None:
        sizes = self.loop.start(self._context())
        if not self.sizes.any():
            self.sizes = np.asarray(sizes, np.int64).copy()
        self.log.append({"kind": "start", "sizes": self.sizes.tolist(), "time": time.time()})

    def _sync(self) -> bool:
        if not self._pending:
            return False
        if self.mode != "lsp":
            w = next(iter(self._pending))
            self._apply([w], "async")
            return True
        busy = len(self._out)  # workers holding a batch
        could = len(self._pending) + busy
        if self.limited < self.m:
            need = min(self.l, could)
            if len(self._pending) < need:
                return False
            members = list(self._pending)[:need]
            self._apply(members, "limited" if need == self.l else "flush")
            self.limited += 1
            return True
        if busy:
            return False  # global: wait for every worker that still has work
        self._apply(list(self._pending), "global")
        self.limited = 0
        return True

    def _apply(self, members: Sequence[int], kind: str) -> None:
        pushes = [self._pending.pop(w) for w in members]
        total = sum(int(p["n"]) for p in pushes)
        grad = pushes[0]["grad"].clone()
        for p in pushes[1:]:
            grad += p["grad"].to(grad.dtype)
        grad /= total
        off = 0
        for p in self._params:
            n = p.numel()
            p.grad = grad[off:off + n].view_as(p).to(p.dtype).clone()
            off += n
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._apply_buffers(pushes, total)
        self.version += 1
        if self.snapshot_every and self.version % self.snapshot_every == 0:
            self.snapshots.append((self.version, time.perf_counter() - (self._t0 or 0.0),
                                   parameters_to_vector([p.detach() for p in self._params]).clone()))
        indices: List[int] = []
        for w, p in zip(members, pushes):
            self.clock[w] += 1
            self._last_batch[w] = int(p["n"])
            self._last_time[w] = float(p["compute"])
            self._fresh[w] = True
            indices.extend(p["indices"])
        idx = np.asarray(indices, np.int64)
        if idx.size and self.applied[idx].any():
            raise RuntimeError(f"parameter server: samples {idx[self.applied[idx]][:8].tolist()} "
                               f"applied twice in epoch {self.epoch}")
        self.applied[idx] = True
        self.log.append({"kind": "sync", "type": kind, "members": [w + 1 for w in members],
                         "stale": [self.version - 1 - int(p["version"]) for p in pushes],
                         "ns": [int(p["n"]) for p in pushes],
                         "batch": total, "version": self.version, "epoch": self.epoch,
                         "indices": indices, "time": time.time()})
        self._maybe_record()
        if self.checkpointer is not None and self.checkpoint_every and \
                self.version % self.checkpoint_every == 0:
            self.checkpointer.save(self._state(), self.version)

    def _apply_buffers(self, pushes: Sequence[Dict[str, Any]], total: int) -> None:
        """The members' buffers: floating ones by their batch-weighted mean, integer ones by the
        largest (never below the server's; see the module docstring)."""
        with torch.no_grad():
            for i, b in enumerate(self._buffers):
                got = [(int(p["n"]), p["buffers"][i]) for p in pushes if p["buffers"][i] is not None]
                if not got:
                    continue
                if b.is_floating_point():
                    b.copy_(sum(d.to(torch.float64) * (n / total) for n, d in got).to(b.dtype))
                else:
                    b.copy_(torch.stack([b] + [d.to(b.dtype) for _, d in got]).amax(0))

    def _working(self) -> np.ndarray:
        return self.alive & ~self._idle

    def _maybe_record(self, epoch_end: bool = False, force: bool = False) -> None:
        work = self._working() if not epoch_end else self.alive.copy()
        if not force and not (self._fresh | ~work).all():
            return
        if not np.isfinite(self._last_time[self.alive]).all():
            return  # a worker that never pushed: nothing to compare yet
        batch = np.where(self.alive, self._last_batch, 0).astype(np.int64)
        compute = np.where(self.alive, self._last_time, np.inf)
        compute = np.where((batch == 0) & self.alive, 0.0, compute)
        zeros = np.zeros(self.workers)
        rec = StepRecord(step=self.records, epoch=self.epoch, batch=batch, compute=compute,
                         data=batch.astype(np.float64), memory=zeros, cpu=zeros, epoch_end=epoch_end)
        self.records += 1
        self._fresh[:] = False
        decided = self.loop.advance([rec])
        if decided is None:  # refused (logged): the sizes stand
            return
        sizes = self._share_dropped(np.asarray(decided, np.int64))
        if not np.array_equal(sizes, self.sizes):
            self.log.append({"kind": "sizes", "sizes": sizes.tolist(), "record": rec.step,
                             "time": time.time()})
        self.sizes = sizes.copy()

    def _min_clock(self) -> Optional[int]:
        work = self._working()
        return int(self.clock[work].min()) if work.any() else None

    def _answer(self, ready: list) -> bool:
        changed = False
        for w in list(self._waiters):
            if w in self._pending:
                continue  # waits for its synchronisation
            if self.mode == "ssp":
                low = self._min_clock()
                if low is not None and self.clock[w] - low > self.staleness:
                    continue
            if not self._pool:
                if not self._idle[w]:
                    self._idle[w] = True
                    changed = True
                continue
            n = max(int(self.sizes[w]), 1)
            take = [self._pool.pop() for _ in range(min(n, len(self._pool)))]
            self._out[w] = take
            self._handed_at[w] = time.monotonic()
            if self._t0 is None:
                self._t0 = time.perf_counter()
            fut = self._waiters.pop(w)
            known = self._known.pop(w, -1)
            low = self._min_clock()
            self.log.append({"kind": "handout", "rank": w + 1, "clock": int(self.clock[w]),
                             "min_clock": low, "n": len(take), "epoch": self.epoch,
                             "version": self.version, "time": time.time()})
            params = buffers = None
            if known != self.version:
                params = parameters_to_vector([p.detach() for p in self._params]).clone()
                buffers = [b.detach().clone() for b in self._buffers]
            ready.append((fut, {"done": False, "indices": take, "params": params, "buffers": buffers,
                                "version": self.version, "epoch": self.epoch,
                                "iteration": int(self.clock[w]), "drop_after": self.timeout}))
            changed = True
        return changed

    def _epoch_complete(self) -> bool:
        return not self._pool and not self._out and not self._pending and bool(self.applied.all())

    def _end_epoch(self) -> None:
        self._maybe_record(epoch_end=True, force=True)
        self.log.append({"kind": "epoch", "epoch": self.epoch, "version": self.version,
                         "time": time.time()})
        self.epoch += 1
        self.applied[:] = False
        self._idle[:] = False
        if self.epoch >= self.epochs:
            if self.checkpointer is not None:
                self.checkpointer.save(self._state(), self.version)
            self._finished.set()
            return
        self._new_order()

    def _check_timeouts(self) -> None:
        ready: list = []
        with self._lock:
            if self._finished.is_set():
                return  # (a call failed meanwhile: nothing may advance)
            now = time.monotonic()
            late = [w for w, t in self._handed_at.items() if now - t > self.timeout]
            if now > self._hello_deadline:
                late += [w for w in range(self.workers)
                         if self._hardware[w] is None and self.alive[w]]
            for w in late:
                self._drop(w)
            if late:
                if not self.alive.any():
                    self._error = RuntimeError(f"parameter server: every worker was dropped (none "
                                               f"answered within timeout={self.timeout} s)")
                    self._finished.set()
                else:
                    ready = self._advance()
        for f, reply in ready:
            f.set_result(reply)

    def _drop(self, w: int) -> None:
        held = self._out.pop(w, [])
        self._handed_at.pop(w, None)
        self._pending.pop(w, None)
        self._waiters.pop(w, None)
        self.alive[w] = False
        self._pool.extend(reversed(held))  # handed out again first
        log.warning("parameter server: worker %d dropped (no answer within %.1f s); its %d samples "
                    "go back to the pool and its share to the others", w + 1, self.timeout, len(held))
        self.log.append({"kind": "drop", "rank": w + 1, "returned": len(held), "time": time.time()})
        if self.loop.started:
            self._maybe_record(force=True)
            self.sizes = self._share_dropped(self.sizes)

    def _share_dropped(self, sizes: np.ndarray) -> np.ndarray:
        """``sizes`` with every dropped worker held at ``lower`` and the rest of its share spread
        evenly over the live ones (what WLBS's redistribution does by speed; this covers policies
        that know nothing of failures, e.g. the equal split)."""
        sizes = np.asarray(sizes, np.int64).copy()
        alive = np.flatnonzero(self.alive)
        if alive.size == 0:
            return sizes
        for w in np.flatnonzero(~self.alive).tolist():
            give = int(sizes[w]) - self.lower
            if give > 0:
                sizes[w] = self.lower
                sizes[alive] += give // alive.size
                sizes[alive[:give % alive.size]] += 1
        return sizes


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
            reply = rpc.rpc_sync(self.server, _ps_call, args=(self.server, self.rank, push),
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
            rpc.rpc_sync(self.server, _ps_bye, args=(self.server, self.rank), timeout=10)
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
                                 "buffers": [_pushed(b) for b in self._buffers]},
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


def _pushed(buffer: torch.Tensor) -> Optional[torch.Tensor]:
    """A buffer as a worker pushes it (None: one that is neither floating nor integer, e.g. a
    bool mask, which the server keeps as it is)."""
    if buffer.is_floating_point() or (not buffer.is_complex() and buffer.dtype != torch.bool):
        return buffer.detach().cpu().clone()
    return None


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
