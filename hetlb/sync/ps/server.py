"""The parameter server (rank 0 of :mod:`hetlb.sync.ps`): it answers the workers' calls, applies
the updates its rule makes due, and checkpoints. Its parts each own their state: the model
(:class:`~hetlb.sync.ps.model.ServerModel`), the epoch's samples
(:class:`~hetlb.sync.ps.samples.EpochSamples`), the pending pushes and the mode's rule
(:class:`~hetlb.sync.ps.rule.SyncRule`), the workers (:class:`~hetlb.sync.ps.roster.Roster`) and
the policy with its history (:class:`~hetlb.policies.loop.DecisionLoop`). The server owns the
calls in flight, the event log, the batch sizes and the stop."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from hetlb.core.checks import choice, flag, instance, integer, number
from hetlb.core.telemetry import History
from hetlb.policies.base import (Context, SizedPolicy, check_same_policy, from_state, policy_settings,
                                 to_state)
from hetlb.policies.loop import DecisionLoop, Snapshot
from hetlb.policies.uniform import Uniform
from hetlb.policies.wlbs import WLBS
from hetlb.sync.ps import wire
from hetlb.sync.ps.model import ServerModel
from hetlb.sync.ps.roster import Roster
from hetlb.sync.ps.rule import MODES, SyncRule
from hetlb.sync.ps.samples import EpochSamples
from hetlb.train.checkpoint import Checkpointer


__all__ = ["ParameterServer", "MODES"]

log = logging.getLogger("hetlb")

#: Records the server's history keeps.
_HISTORY = 1024
_FORMAT = "hetlb.ParameterServer/1"
#: The settings a checkpoint must share with the server that resumes it.
_SAME = ("mode", "num_samples", "workers", "global_batch")

#: A future and the reply it gets once the server's lock is released.
Ready = List[tuple]


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
                 resume: bool = True, snapshot_every: int = 0, name: str = wire.SERVER) -> None:
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
        snapshot_every = integer(snapshot_every, "ParameterServer: snapshot_every", 0)
        self.name = name
        if policy is None:
            policy = WLBS() if self.mode == "lsp" else Uniform()
        if not all(callable(getattr(policy, a, None)) for a in ("start", "decide", "state_dict",
                                                                  "load_state_dict")):
            raise ValueError(f"ParameterServer: policy must be a hetlb policy deciding sizes "
                             f"(e.g. hetlb.policies.WLBS()), got {policy!r}")
        #: The policy with its history and decision (record -> decide -> check).
        self.loop = DecisionLoop(policy, K, history=_HISTORY)
        self._model = ServerModel(model, optimizer, snapshot_every)
        self._lock = threading.Lock()
        self._finished = threading.Event()
        #: Events: dicts with ``kind`` ``"handout"``, ``"sync"``, ``"drop"``, ``"epoch"``, ``"wait"``.
        self.log: List[Dict[str, Any]] = []
        self._reset_state()

    def _reset_state(self) -> None:
        self._samples = EpochSamples(self.num_samples, self.seed)
        self._rule = SyncRule(self.mode, self.l, self.m, self.staleness)
        self._roster = Roster(self.workers)
        self.loop = DecisionLoop(self.loop.policy, self.workers, history=_HISTORY)
        #: int64 ``[K]``: the current batch per worker.
        self.sizes = np.zeros(self.workers, np.int64)
        #: Records given to the policy.
        self.records = 0
        self._hello_deadline = time.monotonic() + self.timeout
        self._waiters: Dict[int, torch.futures.Future] = {}
        self._known: Dict[int, int] = {}  # version each waiting worker holds
        self._error: Optional[BaseException] = None
        self._failed_in: Optional[int] = None  # the worker whose call failed on the server

    # -- the parts' state, read-only --------------------------------------------------------

    @property
    def policy(self) -> Any:
        """The policy (owned by :attr:`loop`)."""
        return self.loop.policy

    @property
    def history(self) -> History:
        """The workers' records (owned by :attr:`loop`)."""
        return self.loop.history

    @property
    def model(self) -> torch.nn.Module:
        """The model trained (its parameters are the global ones)."""
        return self._model.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The server's optimizer."""
        return self._model.optimizer

    @property
    def version(self) -> int:
        """Updates applied."""
        return self._model.version

    @property
    def snapshots(self) -> List[Any]:
        """``(version, seconds since the first batch was handed out, flat parameters)``."""
        return self._model.snapshots

    @property
    def epoch(self) -> int:
        """The epoch in progress (``epochs`` once training ended)."""
        return self._samples.epoch

    @property
    def applied(self) -> np.ndarray:
        """bool ``[num_samples]``: the epoch's samples whose gradient was applied."""
        return self._samples.applied

    @property
    def clock(self) -> np.ndarray:
        """int64 ``[K]``: iterations applied per worker."""
        return self._roster.clock

    @property
    def alive(self) -> np.ndarray:
        """bool ``[K]``: False for a dropped worker."""
        return self._roster.alive

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """Model, optimizer, version, epoch, the epoch's applied samples, clocks, policy: what a
        resumed server needs to continue with each sample applied exactly once per epoch."""
        with self._lock:
            return self._state()

    def _state(self) -> Dict[str, Any]:
        parts = {**self._model.state_dict(), **self._samples.state_dict(),
                 **self._roster.state_dict(), "limited": self._rule.limited}
        state: Dict[str, Any] = {"format": _FORMAT, "mode": self.mode, "num_samples": self.num_samples,
                                 "workers": self.workers, "global_batch": self.global_batch}
        state.update((k, parts[k]) for k in ("model", "optimizer", "version", "epoch", "limited",
                                             "clock", "applied"))
        state.update({"sizes": torch.from_numpy(self.sizes.copy()), "records": self.records,
                      "started": self.loop.started, "history": self.history.state_dict(),
                      "policy": to_state(self.policy.state_dict()) if self.loop.started else None,
                      "policy_type": type(self.policy).__name__,
                      "policy_settings": policy_settings(self.policy)})
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (before :meth:`serve`); every worker starts alive."""
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(f"ParameterServer.load_state_dict: not a ParameterServer checkpoint "
                             f"(format {state.get('format') if isinstance(state, dict) else state!r})")
        # The checkpoint's batch sizes and policy sum to its global_batch: resumed with another
        # one they would keep the old total. A checkpoint without a global_batch key is not
        # checked on it.
        mine = {"mode": self.mode, "num_samples": self.num_samples, "workers": self.workers,
                "global_batch": self.global_batch}
        for key in _SAME:
            saved = state.get(key, self.global_batch) if key == "global_batch" else state[key]
            if saved != mine[key]:
                raise ValueError(f"ParameterServer.load_state_dict: the checkpoint has {key}="
                                 f"{saved!r}, this server {mine[key]!r}; resume with "
                                 f"the checkpoint's {key}, or start afresh in another checkpoint "
                                 f"directory")
        check_same_policy(self.policy, state, "this server")  # before anything changes
        self._reset_state()
        self._model.load_state_dict(state)
        self._samples.load_state_dict(state)
        self._rule.limited, self.records = int(state["limited"]), int(state["records"])
        self._roster.load_state_dict(state)
        self.sizes = state["sizes"].numpy().astype(np.int64).copy()
        if state["started"]:
            self.loop.restore(Snapshot(History.from_state_dict(state["history"]), self.sizes.copy(),
                                       from_state(state["policy"])), self._context())

    def _checkpoint(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.save(self._state(), self.version)

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
        wire.register(self.name, self)
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
                    if self._roster.all_left():
                        break
                time.sleep(0.01)
            if self._error is not None:
                raise self._error
        finally:
            wire.unregister(self.name)

    def call(self, rank: int, push: Optional[Dict[str, Any]]) -> torch.futures.Future:
        """Worker ``rank``'s call: a hello (``push`` None or with ``hello``) or a push of a
        gradient. The future's value is the reply (the next batch, or ``done``); it is set when
        the worker may go on, or with the server's error once a call failed on the server."""
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
        return wire.server_error(e, f"parameter server {self.name!r} failed in worker "
                                    f"{self._failed_in}'s call and stopped: {type(e).__name__}: {e}")

    def bye(self, rank: int) -> None:
        """Worker ``rank`` says goodbye (after ``done`` or the server's error): :meth:`serve`
        waits for every live worker's before it returns."""
        with self._lock:
            self._roster.bye(int(rank) - 1)

    def _receive(self, w: int, push: Optional[Dict[str, Any]], fut: torch.futures.Future) -> Ready:
        if not 0 <= w < self.workers:
            raise ValueError(f"parameter server: worker rank {w + 1} outside 1..{self.workers}")
        if not self.alive[w] or self._finished.is_set():
            return [(fut, {"done": True, "dropped": not self.alive[w],
                           "reason": "dropped" if not self.alive[w] else "finished"})]
        if w in self._waiters:
            raise RuntimeError(f"worker {w + 1} called twice without waiting for the answer")
        if push is None or push.get("hello"):
            if push is not None:
                self._model.check_hello(w, push)
                self._roster.hello(w, push.get("hardware"))
        else:
            held = self._samples.take_back(w, push["indices"])
            self._model.check_push(w, push, len(held))
            self._rule.add(w, push)
            self.log.append({"kind": "push", "rank": w + 1, "n": int(push["n"]),
                             "version": int(push["version"]), "time": time.time()})
        self._waiters[w] = fut
        self._known[w] = int(push.get("version", -1)) if push is not None else -1
        return self._advance()

    def _advance(self) -> Ready:
        """Apply every synchronisation that is due and answer every worker that can go on."""
        ready: Ready = []
        # Every live worker says hello first (also after a resume: a worker that never comes
        # back must be dropped, not counted as working with its checkpointed clock).
        if not self._roster.greeted():
            return ready
        if not self.loop.started:
            self._start()
        changed = True
        while changed:
            due = self._rule.due(self._samples.busy)
            changed = due is not None
            if due is not None:
                self._apply(*due)
            changed |= self._answer(ready)
            if self._samples.complete() and not self._rule:
                self._end_epoch()
                changed = True
            if self._finished.is_set():
                for w in list(self._waiters):
                    ready.append((self._waiters.pop(w), {"done": True, "dropped": False,
                                                         "reason": "finished"}))
                return ready
        return ready

    def _context(self) -> Context:
        return self._roster.context(self.global_batch, self.lower)

    def _start(self) -> None:
        sizes = self.loop.start(self._context())
        if not self.sizes.any():
            self.sizes = np.asarray(sizes, np.int64).copy()
        self.log.append({"kind": "start", "sizes": self.sizes.tolist(), "time": time.time()})

    def _apply(self, members: List[int], kind: str) -> None:
        pushes = self._rule.take(members)
        total = self._model.update(pushes)
        indices: List[int] = []
        for w, p in zip(members, pushes):
            self._roster.applied(w, int(p["n"]), float(p["compute"]))
            indices.extend(p["indices"])
        self._samples.mark_applied(indices)
        self.log.append({"kind": "sync", "type": kind, "members": [w + 1 for w in members],
                         "stale": [self.version - 1 - int(p["version"]) for p in pushes],
                         "ns": [int(p["n"]) for p in pushes],
                         "batch": total, "version": self.version, "epoch": self.epoch,
                         "indices": indices, "time": time.time()})
        self._maybe_record()
        if self.checkpoint_every and self.version % self.checkpoint_every == 0:
            self._checkpoint()
        self._rule.count(kind)

    def _maybe_record(self, epoch_end: bool = False, force: bool = False) -> None:
        rec = self._roster.record(self.records, self.epoch, epoch_end, force)
        if rec is None:
            return
        self.records += 1
        decided = self.loop.advance([rec])
        if decided is None:  # refused (logged): the sizes stand
            return
        sizes = self._roster.share_dropped(np.asarray(decided, np.int64), self.lower)
        if not np.array_equal(sizes, self.sizes):
            self.log.append({"kind": "sizes", "sizes": sizes.tolist(), "record": rec.step,
                             "time": time.time()})
        self.sizes = sizes.copy()

    def _answer(self, ready: Ready) -> bool:
        changed = False
        for w in list(self._waiters):
            if not self._rule.may_go_on(w, self.clock, self._roster.min_clock()):
                continue
            if not self._samples.left:
                changed |= self._roster.idle(w)
                continue
            take = self._samples.hand_out(w, max(int(self.sizes[w]), 1))
            self._model.start_clock()
            fut = self._waiters.pop(w)
            known = self._known.pop(w, -1)
            self.log.append({"kind": "handout", "rank": w + 1, "clock": int(self.clock[w]),
                             "min_clock": self._roster.min_clock(), "n": len(take),
                             "epoch": self.epoch, "version": self.version, "time": time.time()})
            params, buffers = self._model.copy() if known != self.version else (None, None)
            ready.append((fut, {"done": False, "indices": take, "params": params, "buffers": buffers,
                                "version": self.version, "epoch": self.epoch,
                                "iteration": int(self.clock[w]), "drop_after": self.timeout}))
            changed = True
        return changed

    def _end_epoch(self) -> None:
        self._maybe_record(epoch_end=True, force=True)
        self.log.append({"kind": "epoch", "epoch": self.epoch, "version": self.version,
                         "time": time.time()})
        self._samples.next_epoch()
        self._roster.new_epoch()
        if self.epoch >= self.epochs:
            self._checkpoint()
            self._finished.set()
            return
        self._samples.new_order()

    def _check_timeouts(self) -> None:
        ready: Ready = []
        with self._lock:
            if self._finished.is_set():
                return  # (a call failed meanwhile: nothing may advance)
            late = self._samples.late(self.timeout)
            if time.monotonic() > self._hello_deadline:
                late += self._roster.silent()
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
        returned = self._samples.give_back(w)
        self._rule.discard(w)
        self._waiters.pop(w, None)
        self._roster.drop(w)
        log.warning("parameter server: worker %d dropped (no answer within %.1f s); its %d samples "
                    "go back to the pool and its share to the others", w + 1, self.timeout, returned)
        self.log.append({"kind": "drop", "rank": w + 1, "returned": returned, "time": time.time()})
        if self.loop.started:
            self._maybe_record(force=True)
            self.sizes = self._roster.share_dropped(self.sizes, self.lower)
