"""Federated averaging with LB-BSP's load tuning for cross-silo FL (LB-BSP sections 3.5 and 5.5).

Each process of the group is one client holding its own data (which never leaves it). A *round*
is ``local_steps`` (the paper's ``tau``) local optimizer steps, each on a batch of this client's
current size ``B_i`` drawn from its own data, followed by one all-reduce that averages the model
(parameters and buffers) over the clients. That is FedAvg (McMahan et al.) with the server
replaced by an all-reduce: every client ends the round with the same averaged model.

Model averaging, LB-BSP 3.5: "for FL scenarios, it is more important to ensure that each local
dataset instead of each individual sample is equally treated", so the average is **not** weighted
by batch: ``average="equal"`` gives every client the weight 1; ``average="data"`` weights it by
its local dataset size ``n_i`` (FedAvg's ``n_k / n``), when asked. The learning rate is never
touched (the paper preserves ``eta`` on every client whatever its batch: "the expected gradient
from each sample batch stays the same even with a different batch size").

Load tuning (``tune=True``, LB-BSP's FL mode): the paper tunes ``B``, not ``tau`` (tuning ``tau``
would let faster clients pull the average toward their local optimum). Each client measures its
speed over the round, ``v_i = tau * B_i / compute_i`` samples per second; an EMA per client
(``alpha = 0.2``, :class:`hetlb.policies.EMA`; the paper replaces its CPU-cluster NARX by "a
simple EMA method" because cross-silo clients are stable) predicts the next round's speed, and
the next round's batches are LB-BSP's CPU rule (section 3.2)
``B_i = v_i / sum(v) * clients * batch`` (:func:`hetlb.allocate_proportional`, largest-remainder
rounding inside ``[min_batch, max_batch]``), so every client's ``tau`` steps take the same time
and nobody waits at the average. The total ``sum(B_i) = clients * batch`` is kept. The first
round runs equal batches (nothing is measured yet). ``tune=False`` is standard FedAvg: ``B_i =
batch`` for every client, every round.

Communication: one all-reduce per round, nothing per local step. Each client's telemetry row
(weight, batch, samples, compute seconds, round) rides in slots appended to the same flat buffer
as the parameters (a zeroed region where each rank writes its own row, so the SUM delivers the
whole table), so every client computes the same next batches from the same numbers (replicated,
deterministic; no coordinator). Clients that are not at the same round (resumed from checkpoints
of different rounds) all raise at that average, before the average is applied. The settings and
the model's layout are compared across the clients once, at construction: a client that differs
makes every client raise the same ``ValueError`` naming the setting. Then rank 0's parameters and
buffers are broadcast to the other clients (as DDP and :class:`hetlb.DelayedSync` do), so the
first round is FedAvg from one model even when the clients built theirs with different seeds.

Clock: a round's compute is the time from the round's first batch being drawn from
:meth:`Federated.loader` (or the end of the previous round's average, or
:meth:`Federated.restart_clock`) to the end of its last local step; anything the caller does
between rounds (evaluation) before drawing the next batch is left out. ``wait`` in the history is
the idle time at the average the table implies, ``max_j compute_j - compute_i``.

Optimizer state (momentum, Adam moments) stays local to each client across rounds, as in FedAvg
implementations that keep one optimizer per client; plain SGD (the paper's) has none.

::

    fl = Federated(model, torch.optim.SGD(model.parameters(), lr=0.01), local_steps=500, batch=100)
    for x, y in fl.loader(train, parts[rank], seed=0):      # endless; batches of fl.batch_size
        F.cross_entropy(model(x), y).backward()
        if fl.step():                                       # optimizer step; True: round averaged
            evaluate(model)
            if fl.round == rounds:
                break
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from hetlb.comm.hook import shapes_digest
from hetlb.core.checks import choice, flag, instance, integer, number, optional_integer
from hetlb.core.solve import allocate_proportional
from hetlb.core.telemetry import StepRecord
from hetlb.policies.predictors import EMA
from hetlb.ranks.agreement import (agree_at_start, broadcast_module_state, make_side_group,
                                   refuse_everywhere)
from hetlb.ranks.watchdog import COMPUTING, WAITING, Watchdog


__all__ = ["Federated", "RoundRecord", "ClientLoader", "classes_split", "dirichlet_split"]

log = logging.getLogger("hetlb")

#: The telemetry row each client writes into its slots of the flat buffer.
ROW = ("weight", "batch", "samples", "compute", "round")
_R = {name: i for i, name in enumerate(ROW)}
_FORMAT = "hetlb.Federated/1"
#: The round is sent modulo this, so it stays exact in a float32 slot.
_ROUND_MOD = 2 ** 24
AVERAGES = ("equal", "data")
#: How a client's refusal reads on every client (``agree_at_start``'s wording).
_REFUSAL = "{who} on rank {rank}: {why}"


@dataclass(frozen=True)
class RoundRecord:
    """One round as every client saw it (arrays ``[clients]``).

    Attributes:
        round: the round (counted from 0).
        batch: int64 batch size ``B_i`` each client used for its local steps in this round.
        samples: int64 samples each client trained in the round (``local_steps * B_i``).
        compute: seconds each client spent on its local steps.
        wait: seconds each client idled at the average, ``max(compute) - compute_i``.
        weight: each client's weight in the average (1, or its dataset size).
        sync: seconds *this* client spent in the round's all-reduce (local: includes its wait and
            the transfer).
    """

    round: int
    batch: np.ndarray
    samples: np.ndarray
    compute: np.ndarray
    wait: np.ndarray
    weight: np.ndarray
    sync: float

    def to_dict(self) -> Dict[str, Any]:
        return {"round": self.round, "batch": self.batch.tolist(), "samples": self.samples.tolist(),
                "compute": self.compute.tolist(), "wait": self.wait.tolist(),
                "weight": self.weight.tolist(), "sync": self.sync}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "RoundRecord":
        return cls(int(d["round"]), np.asarray(d["batch"], np.int64), np.asarray(d["samples"], np.int64),
                   np.asarray(d["compute"], np.float64), np.asarray(d["wait"], np.float64),
                   np.asarray(d["weight"], np.float64), float(d["sync"]))


class Federated:
    """FedAvg rounds on ``torch.distributed``, one process per client, with LB-BSP's batch tuning.

    See the module docstring for the algorithm and the paper's reasons.

    Args:
        model: a plain ``torch.nn.Module`` (not DDP-wrapped), of the same tensors on every
            client; rank 0's parameters and buffers are broadcast to the others when it is made.
            A client resumed mid-round holds a local model of its own: load the saved model
            after making the Federated.
        optimizer: the client's local optimizer over the model's parameters; :meth:`step` steps
            and zeroes it. Its learning rate is never changed.
        local_steps: ``tau``, local steps per round (the same on every client; never tuned).
        batch: ``B``, the batch size of every client in standard FedAvg and the mean batch with
            ``tune=True`` (the total ``clients * batch`` is kept).
        tune: LB-BSP's FL mode (True): next round's ``B_i`` proportional to each client's EMA
            speed; False: standard FedAvg (``B_i = batch``).
        average: ``"equal"`` (every client counts the same, the paper's) or ``"data"`` (weighted
            by the client's local dataset size: ``data_size``, else the size of the subset given
            to :meth:`loader`).
        alpha: the EMA's weight of the latest round's speed (paper: 0.2).
        min_batch, max_batch: bounds of a tuned ``B_i`` (``max_batch=None``: no upper bound
            beyond the total).
        group: process group of the clients (default: the world). Without an initialised
            process group the single process is the only client.
        data_size: this client's dataset size, for ``average="data"`` when the data does not
            come through :meth:`loader`.
        emulator: an :class:`hetlb.sim.emulate.Emulator` stretching each local step to an emulated
            client's time (benchmarks, tests); one with a ``fail=True`` disturbance is refused
            (on every client): a round needs every client.
        watchdog: a :class:`hetlb.Watchdog`: a client blocked in the round's average while no
            client makes progress for ``stall`` seconds names the client behind (an earlier
            round, or still training the same one) instead of waiting for the collective's
            timeout, and by default exits for torchrun to restart the job. Every local step
            counts as progress. Call :meth:`close` when training ends.

    Attributes:
        round: rounds completed (averages done).
        history: :class:`RoundRecord` per round (the last 4096).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, local_steps: int,
                 batch: int, *, tune: bool = True, average: str = "equal", alpha: float = 0.2,
                 min_batch: int = 1, max_batch: Optional[int] = None, group: Any = None,
                 data_size: Optional[int] = None, emulator: Any = None,
                 watchdog: Optional[Watchdog] = None) -> None:
        # A client refusing its arguments joins the start-up exchange with its refusal, so every
        # client raises rather than waiting in the collective until its timeout.
        try:
            if isinstance(model, torch.nn.parallel.DistributedDataParallel):
                raise ValueError("Federated takes the plain module, not DDP: clients train locally and "
                                 "average the model once per round (pass ddp.module)")
            instance(model, "model", torch.nn.Module, "a torch.nn.Module (not DDP-wrapped)")
            instance(optimizer, "optimizer", torch.optim.Optimizer,
                     "a torch.optim.Optimizer over the model's parameters")
            self.local_steps = integer(local_steps, "local_steps", 1)
            self.batch = integer(batch, "batch", 1)
            self.tune = flag(tune, "tune")
            self.average = choice(average, "average", AVERAGES)
            self.alpha = number(alpha, "alpha", above=0.0, maximum=1.0)
            self.min_batch = integer(min_batch, "min_batch", 1)
            self.max_batch = optional_integer(max_batch, "max_batch", 1)
            if self.min_batch > self.batch:
                raise ValueError(f"min_batch must be <= batch={self.batch}, got {min_batch!r}")
            if self.max_batch is not None and self.max_batch < self.batch:
                raise ValueError(f"max_batch must be >= batch={self.batch} (or None), got {max_batch!r}")
            self.data_size = optional_integer(data_size, "data_size", 1)
            if emulator is not None:
                from hetlb.sim.emulate import Emulator
                instance(emulator, "emulator", Emulator, "a hetlb.sim.emulate.Emulator or None")
            self.emulator = emulator
            refused: Optional[str] = None
            if emulator is not None and emulator.failures:
                # A round averages every client: there is no protocol for one that makes no progress.
                # Refused on every client (at the exchange below), so none waits in it for the timeout.
                refused = (f"fail=True is emulated by the Balancer only; Federated cannot go on without "
                           f"a client (every round averages all of them), got an emulator with "
                           f"{list(emulator.failures)}: drop fail=True, or emulate a slow client with "
                           f"Disturbance(start, stop, extra=seconds)")
            if watchdog is not None:
                instance(watchdog, "watchdog", Watchdog, "a hetlb.Watchdog or None")
            self.model, self.optimizer, self.group = model, optimizer, group
            on = dist.is_available() and dist.is_initialized()
            self.world = dist.get_world_size(group) if on else 1
            self.rank = dist.get_rank(group) if on else 0
            self._distributed = on
            self.tensors = [p for p in model.parameters()] + [b for b in model.buffers()]
            if not self.tensors:
                raise ValueError("Federated: the model has no parameter or buffer to average")
            floats = [t for t in self.tensors if t.is_floating_point()]
            self.dtype = torch.float64 if any(t.dtype == torch.float64 for t in floats) else torch.float32
            self.device = self.tensors[0].device
            self._numel = sum(t.numel() for t in self.tensors)
            self.predictor = EMA(alpha=self.alpha)
            self.predictor.reset(self.world)
            self.batches = np.full(self.world, self.batch, np.int64)
            self.round = 0
            self.steps = 0  # local steps taken in all (the emulator's step index)
            self._in_round = 0  # local steps taken in the current round
            self._compute = 0.0  # seconds of local steps in the current round (restored mid-round)
            self.history: Deque[RoundRecord] = deque(maxlen=4096)
            self._loader: Optional[ClientLoader] = None
            self._pending_loader: Optional[Dict[str, Any]] = None
            self.restart_clock()
            self.watchdog = watchdog
        except (ValueError, TypeError) as e:
            refuse_everywhere(e, group)
            raise
        # Clients that differ here average out of step: another local_steps or batch table mixes
        # rounds of different lengths, another model makes the all-reduce pair unrelated elements
        # (or Gloo abort on the sizes). One exchange at start-up compares them, on a Gloo group
        # (an NCCL one would need each rank's CUDA device set for objects).
        side = make_side_group(group) if on and self.world > 1 else None
        agree_at_start({"Federated": {"local_steps": self.local_steps, "batch": self.batch,
                                      "tune": self.tune, "average": self.average, "alpha": self.alpha,
                                      "min_batch": self.min_batch, "max_batch": self.max_batch,
                                      "dtype": str(self.dtype), "tensors": len(self.tensors),
                                      "elements": self._numel, "shapes": shapes_digest(self.tensors)}},
                       side, self.world, on, "Federated", [("Federated", "Federated")],
                       refused=refused, wording=_REFUSAL)
        # (after the comparison, which raises on every client or none: a broadcast that one
        # client skipped would leave the others waiting in it)
        if on and self.world > 1:  # FedAvg's rounds start every client from the global model
            broadcast_module_state(model, group)
        if watchdog is not None and on:
            watchdog.attach_to(group)

    # ------------------------------------------------------------------ the loop

    @property
    def batch_size(self) -> int:
        """This client's batch size ``B_i`` for the current round."""
        return int(self.batches[self.rank])

    @property
    def batch_sizes(self) -> np.ndarray:
        """Every client's batch size for the current round (a copy)."""
        return self.batches.copy()

    def restart_clock(self) -> None:
        """Start the round's clock now (done by :meth:`loader` when it hands out a round's first
        batch, and at the end of each average)."""
        self._round_start = self._step_start = time.perf_counter()

    def step(self) -> bool:
        """After the local step's backward: emulate its time (with an emulator), step and zero
        the optimizer; after the round's ``local_steps``-th step average the model over the
        clients and set the next round's batch sizes. Returns True when the round ended."""
        if self.emulator is not None:
            self.emulator.stretch(self.steps, self.batch_size, self._step_start)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self._in_round += 1
        now = time.perf_counter()
        self._step_start = now
        if self.watchdog is not None:
            self.watchdog.beat(self.round, None)  # between local steps
            self.watchdog.touch()  # a local step done: progress within the round
        if self._in_round < self.local_steps:
            return False
        compute = self._compute + (now - self._round_start)
        self._average(compute)
        return True

    def _weight(self) -> float:
        if self.average == "equal":
            return 1.0
        size = self.data_size if self.data_size is not None else (
            len(self._loader.indices) if self._loader is not None else None)
        if size is None:
            raise ValueError('average="data" needs this client\'s dataset size: pass data_size=... '
                             "or draw batches through Federated.loader(dataset, indices)")
        return float(size)

    def _average(self, compute: float) -> None:
        """The round's all-reduce: weighted parameters and buffers plus the telemetry rows."""
        weight = self._weight()
        n, k = self._numel, len(ROW)
        buf = torch.zeros(n + self.world * k, dtype=self.dtype, device=self.device)
        off = 0
        with torch.no_grad():
            for t in self.tensors:
                buf[off:off + t.numel()].copy_(t.detach().reshape(-1))
                off += t.numel()
            buf[:n].mul_(weight)
            row = buf[n + self.rank * k:n + (self.rank + 1) * k]
            row.copy_(torch.tensor([weight, self.batch_size, self.batch_size * self.local_steps, compute,
                                    self.round % _ROUND_MOD], dtype=self.dtype))
        t0 = time.perf_counter()
        if self._distributed:
            if self.watchdog is not None:
                self.watchdog.beat(self.round, WAITING)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
        sync = time.perf_counter() - t0
        table = buf[n:].double().cpu().numpy().reshape(self.world, k)
        rounds = np.rint(table[:, _R["round"]]).astype(np.int64)
        if np.any(rounds != rounds[0]):
            # Every client sees the same table, so every one raises here (none is left waiting in
            # a later all-reduce), and before the model takes the mixed average.
            raise ValueError(f"Federated: the clients are at rounds {rounds.tolist()} at this average; "
                             f"every client must be at the same round: resume all of them from "
                             f"checkpoints saved at the same round")
        total = float(table[:, _R["weight"]].sum())
        with torch.no_grad():
            buf[:n].div_(total)
            off = 0
            for t in self.tensors:
                part = buf[off:off + t.numel()].view(t.shape)
                off += t.numel()
                if not t.is_floating_point():
                    part = part.round()
                t.copy_(part.to(t.dtype))
        batch = np.rint(table[:, _R["batch"]]).astype(np.int64)
        samples = np.rint(table[:, _R["samples"]]).astype(np.int64)
        times = table[:, _R["compute"]].astype(np.float64)
        rec = RoundRecord(self.round, batch, samples, times, times.max() - times,
                          table[:, _R["weight"]].copy(), sync)
        self.history.append(rec)
        if self.tune:
            self.predictor.update(StepRecord(step=self.round, epoch=0, batch=samples, compute=times,
                                             data=samples.astype(np.float64),
                                             memory=np.zeros(self.world), cpu=np.zeros(self.world)))
            lower = np.full(self.world, self.min_batch, np.int64)
            upper = None if self.max_batch is None else np.full(self.world, self.max_batch, np.int64)
            self.batches = allocate_proportional(self.predictor.predict(), self.world * self.batch,
                                                 lower=lower, upper=upper)
        log.debug("Federated round %d: batch %s, compute %s s, next %s", self.round, batch.tolist(),
                  np.round(times, 4).tolist(), self.batches.tolist())
        self.round += 1
        self._in_round = 0
        self._compute = 0.0
        self.restart_clock()
        if self.watchdog is not None:
            self.watchdog.beat(self.round, None)

    def batch_drawn(self) -> int:
        """The loader draws this client's next batch: a round's first batch starts the round's
        clock, and the watchdog sees the client computing. The batch's size, ``B_i``."""
        if self._in_round == 0:
            self.restart_clock()
        if self.watchdog is not None:
            self.watchdog.beat(self.round, COMPUTING)
        return self.batch_size

    def close(self) -> None:
        """Stop the watchdog's heartbeat (training ended); nothing to do without one."""
        if self.watchdog is not None:
            self.watchdog.close()

    # ------------------------------------------------------------------ data

    def loader(self, dataset: Any, indices: Optional[Sequence[int]] = None, *, seed: int = 0,
               collate_fn: Any = None) -> "ClientLoader":
        """An endless iterator over this client's data in batches of its current ``B_i``.

        Args:
            dataset: a map-style dataset (``len`` and ``__getitem__``); a plain
                ``TensorDataset`` without ``collate_fn`` is indexed with a whole index tensor at
                once (a subclass goes sample by sample, through its ``__getitem__``).
            indices: this client's samples in ``dataset`` (e.g. ``classes_split(...)[rank]``);
                default: all of ``dataset``.
            seed: shuffling seed; the order of local epoch ``e`` is a permutation drawn from
                ``(seed, rank, e)``, so it is reproducible and resumable.
            collate_fn: how a list of samples becomes a batch (default:
                ``torch.utils.data.default_collate``).

        A batch may run across a local epoch boundary (the next epoch's permutation continues
        it), so every batch has exactly ``B_i`` samples even when ``B_i`` exceeds the local data.
        Drawing a round's first batch starts the round's clock. One loader per client: the
        stream is endless, so an epoch loop draws ``len(loader) // fl.batch_size`` batches of
        the same loader each epoch (a second loader would start the local order again: refused).
        """
        if self._loader is not None:
            raise RuntimeError(
                "Federated.loader was already called: its stream is endless and carries the local "
                "epoch and position, so a second loader would start the order again (samples "
                "repeated, others never read). Make the loader once, before the epoch loop, and "
                "keep drawing from it (`it = iter(loader)` once, then `next(it)`)")
        self._loader = ClientLoader(self, dataset, indices, seed=seed, collate_fn=collate_fn)
        if self._pending_loader is not None:
            self._loader.load_state_dict(self._pending_loader)
            self._pending_loader = None
        return self._loader

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> Dict[str, Any]:
        """Round, batch sizes, EMA, loader position, history: plain values (default
        ``torch.load`` reads them). Save the model and optimizer beside it."""
        return {
            "format": _FORMAT, "world": self.world, "round": self.round, "steps": self.steps,
            "in_round": self._in_round,
            "compute": self._compute + (time.perf_counter() - self._round_start if self._in_round else 0.0),
            "batches": self.batches.tolist(), "predictor": self.predictor.state_dict(),
            "config": {"local_steps": self.local_steps, "batch": self.batch, "tune": self.tune,
                       "average": self.average, "alpha": self.alpha},
            "loader": self._loader.state_dict() if self._loader is not None else self._pending_loader,
            "history": [r.to_dict() for r in self.history],
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (same number of clients; load the model and optimizer
        saved with it). A loader made before or after this call continues where it was."""
        instance(state, "state", dict, "a dict from Federated.state_dict()")
        if state.get("format") != _FORMAT:
            raise ValueError(f"state is not a Federated state (format {state.get('format')!r}, "
                             f"expected {_FORMAT!r})")
        if int(state["world"]) != self.world:
            raise ValueError(f"state was saved with {state['world']} clients, this group has {self.world}")
        for key in ("local_steps", "batch", "average"):
            if state["config"][key] != getattr(self, key):
                log.warning("Federated.load_state_dict: %s was %r, now %r", key, state["config"][key],
                            getattr(self, key))
        batches = np.asarray(state["batches"], np.int64)
        if batches.shape != (self.world,) or np.any(batches < 1):
            raise ValueError(f"state has bad batch sizes {state['batches']!r}")
        self.round, self.steps = int(state["round"]), int(state["steps"])
        self._in_round, self._compute = int(state["in_round"]), float(state["compute"])
        self.batches = batches
        self.predictor.load_state_dict(state["predictor"])
        self.history = deque((RoundRecord.from_dict(d) for d in state["history"]), maxlen=4096)
        if state.get("loader") is not None:
            if self._loader is not None:
                self._loader.load_state_dict(state["loader"])
            else:
                self._pending_loader = dict(state["loader"])
        self.restart_clock()


class ClientLoader:
    """Endless batches of one client's local data, of the :class:`Federated`'s current ``B_i``
    (made by :meth:`Federated.loader`).

    Iterate it with ``for``, or take one batch at a time with ``next(loader)``: a ``for`` loop
    left with ``break`` puts the client between steps for the watchdog, and so would every
    ``next(iter(loader))`` (a loop of one batch, left at once), hiding that step from it."""

    def __init__(self, fl: Federated, dataset: Any, indices: Optional[Sequence[int]], *, seed: int,
                 collate_fn: Any) -> None:
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise TypeError(f"dataset must be a map-style dataset (len and indexing), got "
                            f"{type(dataset).__name__}")
        n = len(dataset)
        if indices is None:
            idx = np.arange(n, dtype=np.int64)
        else:
            if isinstance(indices, (str, bytes)):
                raise TypeError(f"indices must be a sequence of sample indices, got {indices!r}")
            idx = np.asarray(indices)
            if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
                raise ValueError(f"indices must be a 1-d sequence of integers, got {np.asarray(indices).dtype} "
                                 f"of shape {idx.shape}")
            idx = idx.astype(np.int64)
            if idx.size and (idx.min() < 0 or idx.max() >= n):
                raise ValueError(f"indices must lie in [0, {n}) for a dataset of {n} samples, got "
                                 f"values from {idx.min()} to {idx.max()}")
        if idx.size == 0:
            raise ValueError("indices: this client holds no sample; every client needs data")
        self.fl, self.dataset, self.indices = fl, dataset, idx
        self.seed = integer(seed, "seed", 0)
        self.collate_fn = collate_fn if collate_fn is not None else torch.utils.data.default_collate
        self.epoch, self.offset = 0, 0
        self._order = self._permutation(0)
        # A plain TensorDataset with the default collate is indexed whole (what the collate of
        # its samples would give); a subclass may transform samples in __getitem__, and a
        # collate_fn of the user's must see them, so both go sample by sample.
        self._tensors = dataset.tensors if type(dataset) is torch.utils.data.TensorDataset \
            and collate_fn is None else None

    def _permutation(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.fl.rank, epoch])
        return self.indices[rng.permutation(len(self.indices))]

    def take(self, count: int) -> np.ndarray:
        """The next ``count`` sample indices of the endless local stream."""
        out: List[np.ndarray] = []
        while count > 0:
            chunk = self._order[self.offset:self.offset + count]
            out.append(chunk)
            count -= len(chunk)
            self.offset += len(chunk)
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._permutation(self.epoch)
        return np.concatenate(out)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        idx = self.take(self.fl.batch_drawn())
        if self._tensors is not None:
            t = torch.from_numpy(idx)
            return [x[t] for x in self._tensors]
        return self.collate_fn([self.dataset[int(i)] for i in idx])

    def __len__(self) -> int:
        """Local samples (the iterator itself is endless)."""
        return len(self.indices)

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "size": len(self.indices)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        instance(state, "loader state", dict, "a dict from ClientLoader.state_dict()")
        if int(state["size"]) != len(self.indices):
            raise ValueError(f"loader state is of a client with {state['size']} samples, this one holds "
                             f"{len(self.indices)}")
        self.seed = integer(state["seed"], "seed", 0)
        self.epoch = integer(state["epoch"], "epoch", 0)
        self._order = self._permutation(self.epoch)
        self.offset = integer(state["offset"], "offset", 0)
        if self.offset >= len(self._order):
            raise ValueError(f"loader state offset {self.offset} is beyond the {len(self._order)} local samples")


# ---------------------------------------------------------------------- non-i.i.d. splits

def _labels(labels: Any) -> np.ndarray:
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    if isinstance(labels, (str, bytes)):
        raise TypeError(f"labels must be a 1-d array of class labels, got {labels!r}")
    try:
        y = np.asarray(labels)
    except Exception:  # noqa: BLE001
        raise TypeError(f"labels must be a 1-d array of class labels, got {type(labels).__name__}") from None
    if y.ndim != 1 or y.size == 0:
        raise ValueError(f"labels must be a non-empty 1-d array, got shape {y.shape}")
    if y.dtype == object:
        raise TypeError(f"labels must be numbers or strings of one type, got {y[:5].tolist()!r}...")
    return y


def classes_split(labels: Any, clients: int, classes_per_client: int = 2, seed: int = 0) -> List[np.ndarray]:
    """Split a dataset so each client holds exactly ``classes_per_client`` classes (LB-BSP 5.5's
    worst case: "have each client host exactly two sample classes").

    Classes are shuffled (by ``seed``) and dealt out in a cycle, ``classes_per_client`` per client;
    when ``clients * classes_per_client`` exceeds the number of classes, a class dealt to several
    clients has its (shuffled) samples cut into near-equal parts among them.

    Args:
        labels: the class label of every sample (array, list or tensor).
        clients: number of clients.
        classes_per_client: classes each client holds.
        seed: seed of the class order and of the sample shuffle within a shared class.

    Returns:
        ``clients`` sorted int64 index arrays that partition ``range(len(labels))``.

    Raises:
        ValueError: ``clients * classes_per_client`` below the number of classes (some class
            would belong to nobody), more classes per client than there are classes, or a shared
            class with fewer samples than clients sharing it.
    """
    y = _labels(labels)
    clients = integer(clients, "clients", 1)
    k = integer(classes_per_client, "classes_per_client", 1)
    seed = integer(seed, "seed", 0)
    classes, inverse = np.unique(y, return_inverse=True)
    c = len(classes)
    if k > c:
        raise ValueError(f"classes_per_client must be <= the {c} classes in labels, got {classes_per_client!r}")
    if clients * k < c:
        raise ValueError(f"clients * classes_per_client = {clients} * {k} < {c} classes: some class "
                         f"would belong to no client (more clients or classes_per_client needed)")
    rng = np.random.default_rng(seed)
    order = rng.permutation(c)
    slots = [order[(i * k + j) % c] for i in range(clients) for j in range(k)]  # client i: k in a row
    holders: Dict[int, List[int]] = {}
    for s, cls in enumerate(slots):
        holders.setdefault(int(cls), []).append(s // k)
    parts: List[List[np.ndarray]] = [[] for _ in range(clients)]
    for cls in range(c):
        members = np.flatnonzero(inverse == cls)
        who = holders[cls]
        if len(members) < len(who):
            raise ValueError(f"class {classes[cls]!r} has {len(members)} samples, fewer than the "
                             f"{len(who)} clients that would share it")
        members = members[rng.permutation(len(members))]
        for client, piece in zip(who, np.array_split(members, len(who))):
            parts[client].append(piece)
    return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]


def dirichlet_split(labels: Any, clients: int, alpha: float = 0.5, seed: int = 0, *,
                    min_size: int = 1, max_tries: int = 1000) -> List[np.ndarray]:
    """Split a dataset with Dirichlet label skew (Hsu et al. 2019): for every class, client
    shares ``p ~ Dir(alpha * 1)``; the class's shuffled samples are cut at ``cumsum(p)``. Small
    ``alpha`` (0.1) is nearly one class per client, large (100) nearly i.i.d.

    Args:
        labels: the class label of every sample.
        clients: number of clients.
        alpha: Dirichlet concentration (> 0).
        seed: seed of the draw.
        min_size: every client gets at least this many samples; draws are repeated (up to
            ``max_tries``) until it holds.

    Returns:
        ``clients`` sorted int64 index arrays that partition ``range(len(labels))``.
    """
    y = _labels(labels)
    clients = integer(clients, "clients", 1)
    alpha = number(alpha, "alpha", above=0.0)
    seed = integer(seed, "seed", 0)
    min_size = integer(min_size, "min_size", 0)
    max_tries = integer(max_tries, "max_tries", 1)
    if clients * min_size > len(y):
        raise ValueError(f"min_size={min_size} for {clients} clients needs {clients * min_size} samples, "
                         f"labels has {len(y)}")
    _, inverse = np.unique(y, return_inverse=True)
    rng = np.random.default_rng(seed)
    for _ in range(max_tries):
        parts: List[List[np.ndarray]] = [[] for _ in range(clients)]
        for cls in range(int(inverse.max()) + 1):
            members = np.flatnonzero(inverse == cls)
            members = members[rng.permutation(len(members))]
            p = rng.dirichlet(np.full(clients, alpha))
            cuts = (np.cumsum(p)[:-1] * len(members)).astype(np.int64)
            for client, piece in enumerate(np.split(members, cuts)):
                parts[client].append(piece)
        out = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        if min(len(p) for p in out) >= min_size:
            return out
    raise ValueError(f"dirichlet_split: no draw in {max_tries} gave every one of {clients} clients "
                     f"{min_size} samples at alpha={alpha}; raise alpha or lower min_size")
