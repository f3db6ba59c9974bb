"""Tell a stalled worker from a dead one, name it, and hand the job back to torchrun.

A synchronous job waits for its slowest worker at every all-reduce. When a worker stops making
progress (a hung data read, a wedged device, a frozen or vanished process, a lost node), the others
block inside the collective until the process group's timeout (30 minutes for Gloo by default) and
then fail with an error that does not say which worker it was.

:class:`Watchdog`, given to a :class:`hetlb.Balancer`, :class:`hetlb.DelayedSync` or
:class:`hetlb.sync.Federated` (``watchdog=``; for the last two a "step" is an iteration or a
round), runs one daemon thread per worker that publishes a heartbeat to the process group's store
every ``interval`` seconds: the worker's step, how far into it (``data``: waiting for its batch;
``compute``: forward/backward; ``sent``: its gradient handed to the all-reduce, i.e. waiting for
the others; ``flush``: in ``Balancer.flush()``, a collective between steps), when it last made
progress, its host and pid. When this worker has waited inside a step for ``stall`` seconds (a
collective timeout much shorter than torch's) and no other worker has made progress in that time
either, the thread reads every heartbeat and names the worker(s) holding the job up:

- a worker whose heartbeat stopped (its process is gone or frozen, or its node is lost);
- else the workers furthest behind (a lower step, or the same step at an earlier stage: a worker
  still computing or loading while the others have sent their gradients).

It logs that diagnosis (``logging`` and stderr) and, with ``action="exit"`` (the default), ends
this worker with exit code :data:`EXIT_CODE`. Under torchrun with ``--max-restarts`` every worker
of the job does the same or fails in its collective, the agent restarts the group, and the script
resumes from its last checkpoint (``hetlb.Checkpointer``) on the workers that come back; a node
whose agent is gone is dropped by the rendezvous (``--nnodes MIN:MAX``). ``action="log"`` only
reports.

A worker counts as waiting for the others only where it may be inside a collective: in a
Balancer's step from its first forward (a DDP forward may broadcast buffers, an FSDP forward
gathers parameters) until its gradient's reduction has finished on this rank, in DelayedSync's
and Federated's all-reduces, and in ``Balancer.flush()``. Its own work never counts as a stall:
loading a batch, a plain model's compute, evaluation, saving, the script's work after a loop
over the loader left with ``break``, the end of training. (A loop left between a step's forward
and its backward, say by an exception caught outside it, counts as inside the step until the
next step opens.) A worker doing long work between steps while the others wait in the next one
calls :meth:`Watchdog.touch` now and then. The heartbeat keys live under ``hetlb/watchdog/`` in the default group's store. The thread never
touches a process group, so it cannot itself hang in a collective.
"""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple


__all__ = ["Watchdog", "EXIT_CODE", "Stage", "COMPUTING", "WAITING", "FLUSHING"]

log = logging.getLogger("hetlb")

#: The exit code of a worker its watchdog stopped (EX_TEMPFAIL: try again, i.e. restart).
EXIT_CODE = 75

_STAGES = ("data", "compute", "sent", "flush")
# Which of two ranks at the same step is behind: waiting for its batch, then flushing (a
# collective between steps, before the step's compute), computing, and sent.
_ORDER = (0, 2, 3, 1)
_PREFIX = "hetlb/watchdog/"


class Stage:
    """Where a worker is inside a step, for :meth:`Watchdog.beat` from loops that have no
    :class:`hetlb.comm.hook.StepTelemetry` (DelayedSync, Federated): ``hooked`` is whether it
    waits for the others (its part handed to a collective); ``code`` indexes the stage names
    (compute, sent; or another stage's, such as :data:`FLUSHING`'s)."""

    __slots__ = ("hooked", "code")

    def __init__(self, hooked: bool, code: Optional[int] = None) -> None:
        self.hooked = hooked
        self.code = (2 if hooked else 1) if code is None else code


#: Computing its part of the step, with no collective (a plain model's forward and backward).
COMPUTING = Stage(False)
#: Waiting for the others in a collective (an all-reduce, a barrier).
WAITING = Stage(True)
#: In ``Balancer.flush()`` between steps: a collective that every rank must call at the same
#: point (one rank calling it alone waits there until the collective's timeout).
FLUSHING = Stage(True, code=3)


class Watchdog:
    """Heartbeat and stall detector for one worker (see the module docstring).

    Args:
        stall: seconds without progress (no step finished, no stage advanced) after which this
            worker diagnoses the job and acts. Make it longer than the slowest legitimate step
            (including the first step's warm-up and a checkpoint write).
        interval: seconds between heartbeats; a worker whose heartbeat is older than
            ``max(3 * interval, stall / 2)`` counts as gone.
        action: ``"exit"`` (log, then end this process with :data:`EXIT_CODE` so torchrun
            restarts the job) or ``"log"`` (log only, once per stall).
    """

    def __init__(self, stall: float = 120.0, interval: float = 1.0, action: str = "exit") -> None:
        for name, value in (("stall", stall), ("interval", interval)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"Watchdog: {name} must be a positive finite number of seconds, got {value!r}")
        if interval * 2 > stall:
            raise ValueError(f"Watchdog: interval ({interval!r} s) must be at most half of stall "
                             f"({stall!r} s), or a live worker could look gone")
        if action not in ("exit", "log"):
            raise ValueError(f"Watchdog: action must be 'exit' or 'log', got {action!r}")
        self.stall, self.interval, self.action = float(stall), float(interval), action
        self.rank: Optional[int] = None
        self.ranks: List[int] = []
        self._store: Any = None
        self._step = 0
        self._tele: Any = None  # the open step's StepTelemetry (its `hooked` tells "sent")
        self._progress = time.time()
        self._last: tuple = (0, 0, False)
        self._reported = False
        self._touched = False
        self._seen: Optional[tuple] = None  # (time, heartbeats) of the last read
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        #: The last diagnosis (a string), or None.
        self.diagnosis: Optional[str] = None

    # ------------------------------------------------------------------ owner's side

    def attach(self, rank: int, ranks: Sequence[int], store: Any) -> None:
        """Bind to this worker (global ``rank``) among the global ``ranks`` of its job, with the
        store the heartbeats go through; starts the heartbeat thread. Called by the Balancer."""
        if self._thread is not None:
            raise RuntimeError("this Watchdog already watches a worker; give each Balancer its own")
        self.rank, self.ranks, self._store = int(rank), [int(r) for r in ranks], store
        self._progress = time.time()
        self._thread = threading.Thread(target=self._run, name="hetlb-watchdog", daemon=True)
        self._thread.start()

    def attach_to(self, group: Any = None) -> None:
        """:meth:`attach` to this process among the ranks of ``group`` (None: the default group)
        of the initialised torch.distributed job, through the job's default store. Called by the
        Balancer, DelayedSync and Federated."""
        import torch.distributed as dist
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self.attach(dist.get_rank(), ranks, dist.distributed_c10d._get_default_store())

    def beat(self, step: int, telemetry: Any = None) -> None:
        """Progress: step ``step`` is open with ``telemetry`` (its compute is running), or with
        None, waiting for its batch."""
        self._step, self._tele = int(step), telemetry

    def touch(self) -> None:
        """Progress outside a step: call it now and then in long work that only some ranks do
        between steps (rank 0 evaluating or saving while the others wait in the next step), so the
        waiting ranks do not take the job for stalled."""
        self._touched = True

    def close(self) -> None:
        """Stop the heartbeat thread (training ended)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.interval + 1)

    # ------------------------------------------------------------------ the thread

    def _stage(self) -> Tuple[int, bool]:
        """The stage's index in the stage names, and whether this worker may be waiting for the
        others in it: handed to a collective (:class:`Stage`'s ``hooked``), or, in a step of a
        :class:`hetlb.comm.hook.StepTelemetry`, from the step's first forward (a DDP or FSDP
        forward may hold collectives) until its gradient's reduction finished."""
        tele = self._tele
        if tele is None:
            return 0, False
        if isinstance(tele, Stage):
            return tele.code, tele.hooked
        try:
            core = tele.core
            return (2 if tele.hooked else 1), bool(core.restarted and not core.reduced)
        except Exception:  # noqa: BLE001 (a step closing under us: count it as computing)
            return 1, True

    def _run(self) -> None:
        host, pid = socket.gethostname(), os.getpid()
        while not self._stop.wait(self.interval):
            now = time.time()
            where = (self._step, *self._stage())
            if where != self._last or self._touched:
                self._last, self._progress, self._reported, self._touched = where, now, False, False
                self._seen = None
            beat = {"step": where[0], "stage": where[1], "progress": self._progress, "beat": now,
                    "host": host, "pid": pid}
            store_error: Optional[BaseException] = None
            beats: Dict[int, Dict[str, Any]] = {}
            try:
                self._store.set(f"{_PREFIX}{self.rank}", json.dumps(beat))
            except Exception as e:  # noqa: BLE001 (the store's server is gone: reported below)
                store_error = e
            # Only a rank that may be inside a collective waits for the others; its own work
            # (loading, a plain model's compute, evaluation, saving, a loop left with `break`,
            # the end of training) is never a stall.
            if not where[2] or now - self._progress < self.stall / 2 or self._reported:
                continue
            if store_error is None:
                try:
                    beats = self._read()
                    self._seen = (now, beats)  # kept: the store may die with the first to act
                except Exception as e:  # noqa: BLE001
                    store_error = e
            if now - self._progress < self.stall:
                continue
            gone_after = max(3 * self.interval, self.stall / 2)
            if store_error is None and any(now - b["progress"] < self.stall and now - b["beat"] <= gone_after
                                           for b in beats.values()):
                continue  # some rank is still making progress (e.g. rank 0 evaluating, touch())
            self.diagnosis = self._diagnose(now, beats, store_error, gone_after)
            self._reported = True
            log.error("%s", self.diagnosis)
            print(f"hetlb watchdog: {self.diagnosis}", file=sys.stderr, flush=True)
            if self.action == "exit":
                if self.rank == 0:
                    # Rank 0's process usually serves the group's store: leave last, so the
                    # others (stalled at the same moment) can still read the heartbeats.
                    time.sleep(2 * self.interval)
                for h in logging.getLogger().handlers + log.handlers:
                    try:
                        h.flush()
                    except Exception:  # noqa: BLE001
                        pass
                os._exit(EXIT_CODE)

    def _read(self) -> Dict[int, Dict[str, Any]]:
        out: Dict[int, Dict[str, Any]] = {}
        for r in self.ranks:
            key = f"{_PREFIX}{r}"
            if self._store.check([key]):
                out[r] = json.loads(self._store.get(key))
        return out

    def _diagnose(self, now: float, beats: Dict[int, Dict[str, Any]], store_error: Optional[BaseException],
                  gone_after: float) -> str:
        me = f"rank {self.rank} made no progress for {now - self._progress:.1f} s (stall={self.stall:g} s) at " \
             f"step {self._last[0]} ({_STAGES[self._last[1]]})"
        if store_error is not None:
            gone = (f"the store of the process group is unreachable ({type(store_error).__name__}: "
                    f"{store_error}): the worker serving it (global rank 0 or its agent) is gone")
            if self._seen is None:
                return f"{me}; {gone}"
            at, seen = self._seen
            return f"{me}; {gone}; {now - at:.1f} s before: {describe(seen, self.ranks, at, gone_after)}"
        return f"{me}; {describe(beats, self.ranks, now, gone_after)}"


def describe(beats: Dict[int, Dict[str, Any]], ranks: Sequence[int], now: float, gone_after: float) -> str:
    """Which ranks hold the job up, from their heartbeats (``beats[rank]``: step, stage,
    progress, beat, host, pid; a rank with none never sent one)."""
    def who(r: int) -> str:
        b = beats[r]
        return f"rank {r} ({b['host']}, pid {b['pid']})"

    silent = [r for r in ranks if r not in beats]
    gone = [r for r in ranks if r in beats and now - beats[r]["beat"] > gone_after]
    if silent or gone:
        parts = [f"{who(r)}: no heartbeat for {now - beats[r]['beat']:.1f} s, last at step "
                 f"{beats[r]['step']} ({_STAGES[beats[r]['stage']]})" for r in gone]
        parts += [f"rank {r}: never sent a heartbeat" for r in silent]
        return "gone (process exited or frozen, or its node lost): " + "; ".join(parts)

    def order(w: tuple) -> tuple:
        return w[0], _ORDER[w[1]]

    where = {r: (beats[r]["step"], beats[r]["stage"]) for r in ranks}
    low = min(where.values(), key=order)
    behind = [r for r in ranks if where[r] == low]
    if len(behind) == len(ranks):
        return (f"every rank is at step {low[0]} ({_STAGES[low[1]]}) and none is behind: a stall "
                f"outside hetlb's steps (e.g. the script between steps), or a collective that hangs")
    ahead = sorted(set(where.values()) - {low}, key=order)
    hint = ""
    if _STAGES[low[1]] == "flush":
        hint = (": bal.flush() is a collective, called on every rank at the same point between "
                "steps (not inside `if rank == 0:`)")
    return ("behind (alive, not progressing): " + "; ".join(
        f"{who(r)} at step {low[0]} ({_STAGES[low[1]]}), stalled for {now - beats[r]['progress']:.1f} s"
        for r in behind) + f"; the others are at " + ", ".join(
        f"step {s} ({_STAGES[g]})" for s, g in ahead) + hint)
