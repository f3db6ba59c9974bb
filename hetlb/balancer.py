"""The object a training loop talks to: per-rank batch sizes, weighted aggregation, telemetry.

    bal = hetlb.Balancer(ddp_model, global_batch=512, policy=hetlb.policies.LBB())
    loader = bal.loader(dataset, num_workers=2)
    for x, y in loader:
        with bal.step():
            loss_fn(ddp_model(x), y).backward()
        opt.step(); opt.zero_grad()

Every rank runs the same policy on the same telemetry table, so decisions are replicated without a
coordinator; the checksums of each rank's decision and step plan ride in the next table and any
disagreement raises :class:`DecisionMismatchError` naming the ranks.
"""
from __future__ import annotations

import contextlib
import logging
import time
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .aggregate import (WEIGHTINGS, HookState, allreduce_row_blocking, make_state, register_hook,
                        weights_for)
from .data import BalancedLoader, GlobalOrderSampler, split_last
from .policies.base import Context, Policy, check_sizes
from .telemetry import (COL, EXACT_INT, NUM_FIELDS, History, Probe, StepRecord, decision_checksum,
                        hardware_info, validate_record)

log = logging.getLogger("hetlb.balancer")


_ID_COLS = [COL["step"], COL["checksum"], COL["plan"]]


def _weak(method: Any) -> Any:
    """A callable for ``method`` that does not keep its Balancer alive (the loader would
    otherwise form a cycle Balancer -> loader -> Balancer holding the DDP model until a GC)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        m = ref()
        if m is None:
            raise RuntimeError("the Balancer that made this loader no longer exists")
        return m(*args)
    return call


class DecisionMismatchError(RuntimeError):
    """Ranks disagree on a batch-size decision or step plan (a non-deterministic policy, or ranks
    that drew data at different points of the program)."""


def _groups(values: np.ndarray) -> str:
    out = []
    for v in sorted(set(values.tolist())):
        ranks = np.nonzero(values == v)[0].tolist()
        out.append(f"ranks {ranks}: {int(v)}")
        if len(out) > 8:
            out.append("...")
            break
    return "; ".join(out)


class _CpuTimer:
    """Host clock; the compute time of a step is known when its last bucket is ready."""
    lag = 0

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, start: float) -> float:
        return time.perf_counter() - start


class _CudaTimer:
    """CUDA events; a step reports the previous step's time so the host never waits on the
    device for the current one (the previous end event has normally completed long before)."""
    lag = 1

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._prev: Optional[tuple] = None
        self._cur: Optional[tuple] = None

    def start(self) -> float:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        self._cur = (ev, None)
        return time.perf_counter()

    def stop(self, start: float) -> float:
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        prev, self._prev = self._prev, (self._cur[0], end)
        if prev is None:
            return float("nan")
        prev[1].synchronize()
        return prev[0].elapsed_time(prev[1]) / 1e3


class Balancer:
    """Per-rank batch sizes for synchronous data-parallel training on uneven workers.

    Args:
        model: the ``DistributedDataParallel`` model (a plain module is accepted when the world
            has one rank). The Balancer registers its communication hook on it.
        global_batch: samples per step over all ranks; ``sum(batch_sizes) == global_batch``.
        policy: a :class:`hetlb.policies.Policy` (default :class:`~hetlb.policies.LBB`).
        weighting: "samples" (``B_r / sum B``), "sizes" (data amount, needs ``sizes=`` in
            :meth:`loader`) or "none" (plain mean, e.g. cross-silo FL).
        group: process group (default: the world).
        lower, upper: bounds on this rank's batch (``upper`` also from ``profile.limit``).
        profile: this rank's :class:`hetlb.profile.Profile` (LBB starts from the fitted models).
        emulator: an :class:`hetlb.emulate.Emulator` that stretches this rank's compute.
        history: number of steps of telemetry kept.
        max_bad_steps: consecutive steps with unusable telemetry (NaN or zero times) tolerated,
            keeping the previous sizes, before raising ``ValueError``.
        native_hook: None (default) uses the C++ communication hook wherever it can serve the
            model (CPU float32/float64 parameters, a non-NCCL group, no emulated bandwidth cap)
            and the Python hook elsewhere; True requires the native one, False forces Python.

    Attributes:
        history: :class:`hetlb.telemetry.History` of the world's telemetry, one record per step
            (on CUDA a step's record completes one step later: compute times come from events
            read without a host synchronisation).
        context: the :class:`hetlb.policies.Context` the policy was started with (bounds,
            hardware indicators and profiles of every rank, exchanged once at construction).
        last_overhead: seconds the Balancer itself spent in the latest step (probes, table
            check, record, decision), excluding the user's forward and backward.

    The telemetry table reaches every rank inside the gradient all-reduce (see
    :mod:`hetlb.aggregate`); the Balancer adds no blocking collective per step.
    """

    def __init__(self, model: torch.nn.Module, global_batch: int, policy: Optional[Policy] = None,
                 weighting: str = "samples", *, group: Any = None, lower: int = 1,
                 upper: Optional[int] = None, profile: Any = None, emulator: Any = None,
                 history: int = 1024, max_bad_steps: int = 10,
                 native_hook: Optional[bool] = None) -> None:
        if isinstance(global_batch, bool) or not isinstance(global_batch, (int, np.integer)) or global_batch < 1:
            raise ValueError(f"global_batch must be a positive integer, got {global_batch!r}")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        if self.world > 1 and not isinstance(model, DistributedDataParallel):
            raise TypeError(f"with {self.world} ranks the model must be DistributedDataParallel, "
                            f"got {type(model).__name__}")
        if global_batch < self.world * max(lower, 0):
            raise ValueError(f"global_batch={global_batch} is smaller than the world of {self.world} "
                             f"ranks times lower={lower}; every rank needs at least {lower} sample(s) "
                             f"per step (pass lower=0 to let ranks idle)")
        if policy is None:
            from .policies.lbb import LBB
            policy = LBB()
        self.model, self.global_batch, self.policy = model, int(global_batch), policy
        self.weighting, self.emulator, self.max_bad_steps = weighting, emulator, int(max_bad_steps)
        self.device = self._device(model)
        self._probe = Probe(self.device)
        self._timer = _CudaTimer(self.device) if self.device.type == "cuda" else _CpuTimer()

        self._state: Optional[HookState] = None
        if self.distributed:
            self._state = make_state(group)
            if emulator is not None and getattr(emulator, "bandwidth", None):
                self._state.comm_delay = emulator.sleep_comm
        if isinstance(model, DistributedDataParallel):
            register_hook(model, self._state, native_hook)
        elif native_hook:
            raise ValueError("native_hook=True needs a DistributedDataParallel model")

        self.context = self._gather_context(lower, upper, profile)
        self._decision = check_sizes(policy.start(self.context), self.context, type(policy).__name__)
        self._checksum = decision_checksum(self._decision)
        self.history = History(self.world, maxlen=history)
        self._step = 0
        self._bad = 0
        self._loader: Optional[BalancedLoader] = None
        self._current: Optional[tuple] = None
        self._running: Optional[tuple] = None
        self._partials: Dict[int, tuple] = {}
        self._t0 = 0.0
        self._compute: Optional[float] = None
        self.last_overhead: float = 0.0

    # ------------------------------------------------------------------ setup

    @staticmethod
    def _device(model: torch.nn.Module) -> torch.device:
        for p in model.parameters():
            return p.device
        return torch.device("cpu")

    def _gather_context(self, lower: int, upper: Optional[int], profile: Any) -> Context:
        up = self.global_batch if upper is None else int(upper)
        prof: Optional[Dict[str, Any]] = None
        if profile is not None:
            up = min(up, int(profile.limit))
            prof = {"model": profile.fit("cubic"), "linear": profile.fit("linear"),
                    "limit": int(profile.limit)}
        mine = {"lower": int(lower), "upper": up, "hardware": hardware_info(self.device), "profile": prof}
        if self.world > 1:
            # One-time exchange at start-up (not per step), on the Gloo side group.
            everyone: List[Any] = [None] * self.world
            dist.all_gather_object(everyone, mine, group=self._state.side_group)
        else:
            everyone = [mine]
        return Context(self.world, self.global_batch, [e["lower"] for e in everyone],
                       [e["upper"] for e in everyone], hardware=[e["hardware"] for e in everyone],
                       profiles=[e["profile"] for e in everyone])

    def loader(self, dataset: Any, *, sizes: Optional[Sequence[float]] = None, shuffle: bool = True,
               seed: int = 0, drop_last: bool = False, **dataloader_kwargs: Any) -> BalancedLoader:
        """This rank's loader of ``dataset`` in the global order (see :mod:`hetlb.data`).

        Args:
            dataset: a map-style dataset.
            sizes: per-sample data amounts (e.g. frames, tokens); required for weighting="sizes".
            shuffle, seed, drop_last: the permutation per epoch (``seed + epoch``) and whether to
                drop the short last step. ``seed`` must be the same on every rank.
            **dataloader_kwargs: passed to ``torch.utils.data.DataLoader`` (num_workers,
                collate_fn, pin_memory, prefetch_factor, persistent_workers, ...).
        """
        n = len(dataset)
        if sizes is not None:
            sizes = np.asarray(sizes, dtype=np.float64)
            if sizes.shape != (n,) or not np.all(np.isfinite(sizes)) or np.any(sizes < 0):
                raise ValueError(f"sizes must be {n} finite non-negative numbers, got shape {sizes.shape}")
        elif self.weighting == "sizes":
            raise ValueError('weighting="sizes" needs per-sample sizes: bal.loader(dataset, sizes=...)')
        sampler = GlobalOrderSampler(n, self.global_batch, self.rank, self.world, _weak(self._plan),
                                     shuffle=shuffle, seed=seed, drop_last=drop_last)
        self._loader = BalancedLoader(sampler, dataset, sizes, _weak(self._on_batch), **dataloader_kwargs)
        return self._loader

    # ------------------------------------------------------------------ the step

    def _plan(self, count: int) -> np.ndarray:
        return split_last(self._decision, count)

    def _on_batch(self, epoch: int, step: int, sizes: np.ndarray, data: np.ndarray) -> None:
        self._current = (epoch, sizes, data)

    @property
    def batch_sizes(self) -> np.ndarray:
        """Sizes of the running step inside :meth:`step`, else of the next step to be drawn."""
        if self._running is not None:
            return self._running[1].copy()
        if self._current is not None:
            return self._current[1].copy()
        return self._decision.copy()

    @property
    def steps(self) -> int:
        """Completed steps."""
        return self._step

    def _on_last(self) -> None:
        """Runs when this rank's last gradient bucket is ready (inside the hook)."""
        if self._compute is not None:
            return
        if self.emulator is not None:
            self.emulator.stretch(self._step, int(self._running[1][self.rank]), self._t0)
        self._compute = self._timer.stop(self._t0)
        if self._state is not None:
            self._state.set_compute(self._compute)

    @contextlib.contextmanager
    def step(self) -> Iterator["Balancer"]:
        """Wrap one forward+backward. Times the compute, sets this step's weights, and on exit
        verifies the table and decides the sizes of the next step."""
        t_enter = time.perf_counter()
        if self._running is not None:
            raise RuntimeError("Balancer.step() is already running; steps cannot nest")
        if self._loader is not None:
            if self._current is None:
                raise RuntimeError("Balancer.step() without a new batch from bal.loader(): every step "
                                   "must consume exactly one batch of the loader")
            epoch, sizes, data = self._current
            self._current = None
        else:
            epoch, sizes, data = 0, self._decision.copy(), self._decision.astype(np.float64)
        self._running = (epoch, sizes, data)
        weight = self._weight(sizes, data)
        row = np.zeros(NUM_FIELDS)
        row[COL["batch"]] = sizes[self.rank]
        row[COL["data"]] = data[self.rank]
        row[COL["memory"]] = self._probe.memory()
        row[COL["cpu"]] = self._probe.cpu()
        row[COL["checksum"]] = self._checksum
        row[COL["plan"]] = decision_checksum(sizes)
        row[COL["step"]] = self._step % EXACT_INT
        row[COL["epoch"]] = epoch % EXACT_INT
        row[COL["compute"]] = float("nan")
        self._compute = None
        native_hold = False
        if self._state is not None:
            # The native hook stamps the compute time itself, and holds an emulated step to its
            # deadline when the emulator knows it in advance (a time model); Python runs in the
            # last bucket's hook only otherwise, or to read another timer (CUDA events).
            emu = self.emulator
            known = emu is None or (getattr(emu, "model", None) is not None and hasattr(emu, "deadline"))
            py_last = not self._state.native or type(self._timer) is not _CpuTimer or not known
            native_hold = not py_last and emu is not None
            self._state.reset(weight, row, self._on_last if py_last else None)
        self._t0 = self._timer.start()
        if native_hold:
            self._state.hold_until(self.emulator.deadline(self._step, int(sizes[self.rank]), self._t0),
                                   self.emulator.spin)
        entered = self._t0 - t_enter  # both timers start from the host clock
        try:
            yield self
        except BaseException:
            self._release()
            raise
        t_exit = time.perf_counter()
        try:
            self._finish(epoch, sizes, row)
        finally:
            self._release()
        self.last_overhead = entered + time.perf_counter() - t_exit

    def _release(self) -> None:
        self._running = None
        if self._state is not None:
            # The hook state lives in the DDP reducer; without this reference back to the
            # Balancer between steps, Balancer -> DDP -> state is not a cycle and frees promptly
            # (a reducer left to the garbage collector can outlive its process group).
            self._state.release()

    def _weight(self, sizes: np.ndarray, data: np.ndarray) -> float:
        """This rank's aggregation weight (the hot path of :func:`weights_for`)."""
        if self.weighting == "samples":
            total = int(sizes.sum())
            if total > 0:
                return int(sizes[self.rank]) / total
        return float(weights_for(self.weighting, sizes, data)[self.rank])

    def _collect(self, row: np.ndarray) -> np.ndarray:
        table = None if self._state is None else self._state.collect_table()
        if table is not None:
            return table
        # No last bucket carried the row: no gradients this step (or no_sync), or one process.
        if self._compute is None:
            self._on_last()
        row[COL["compute"]] = self._compute
        if self._state is None:
            return row[None, :].copy()
        self._state.row = row
        log.debug("step %d: no gradient bucket carried telemetry; all-reduce it", self._step)
        return allreduce_row_blocking(self._state)

    def _verify(self, table: np.ndarray, sizes: np.ndarray) -> None:
        g = self._step
        ids = table[:, _ID_COLS]
        if (ids != ids[0]).any() or ids[0, 0] != g % EXACT_INT:  # one test on the common path
            steps = table[:, COL["step"]]
            if (steps != g % EXACT_INT).any():
                raise DecisionMismatchError(f"step {g}: ranks are at different steps ({_groups(steps)})")
            for col, what in (("checksum", "batch-size decision"), ("plan", "step plan (sizes used)")):
                c = table[:, COL[col]]
                if (c != c[0]).any():
                    raise DecisionMismatchError(
                        f"step {g}: ranks disagree on the {what}; checksums by rank: {_groups(c)}. "
                        f"The policy must be a deterministic function of the shared telemetry and "
                        f"all ranks must draw their batches at the same point of the loop")
        batch = np.rint(table[:, COL["batch"]]).astype(np.int64)
        if not (batch == sizes).all():
            bad = np.nonzero(batch != sizes)[0].tolist()
            raise DecisionMismatchError(f"step {g}: ranks {bad} ran batch sizes "
                                        f"{batch[bad].tolist()}, the plan says {sizes[bad].tolist()}")

    def _finish(self, epoch: int, sizes: np.ndarray, row: np.ndarray) -> None:
        table = self._collect(row)
        self._verify(table, sizes)
        g = self._step
        self._partials[g] = (epoch, table)
        self._step += 1
        done = g - self._timer.lag
        if done < 0 or done not in self._partials:
            return
        ep, old = self._partials.pop(done)
        record = StepRecord(step=done, epoch=ep,
                            batch=np.rint(old[:, COL["batch"]]).astype(np.int64),
                            compute=table[:, COL["compute"]].copy(),
                            data=old[:, COL["data"]].copy(), memory=old[:, COL["memory"]].copy(),
                            cpu=old[:, COL["cpu"]].copy())
        try:
            validate_record(record)
        except ValueError as e:
            self._bad += 1
            if self._bad > self.max_bad_steps:
                raise ValueError(f"{self._bad} consecutive steps of unusable telemetry; last: {e}") from e
            log.warning("%s; keeping the previous sizes", e)
            return
        self._bad = 0
        self.history.append(record)
        decision = self.policy.decide(self.history)
        self._decision = check_sizes(decision, self.context, type(self.policy).__name__)
        self._checksum = decision_checksum(self._decision)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> Dict[str, Any]:
        """Policy state, decision, telemetry history and loader position (call between steps)."""
        if self._running is not None:
            raise RuntimeError("state_dict() inside a step; call it between steps")
        return {"world": self.world, "global_batch": self.global_batch, "step": self._step,
                "decision": self._decision.tolist(), "policy": self.policy.state_dict(),
                "history": self.history.state_dict(),
                "loader": None if self._loader is None else self._loader.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume. On a different world size only the loader position and step count carry over
        and the policy restarts from :meth:`Policy.start` (its state is per rank)."""
        if int(state["global_batch"]) != self.global_batch:
            raise ValueError(f"checkpoint global_batch={state['global_batch']} differs from "
                             f"{self.global_batch}")
        self._step = int(state["step"])
        self._partials.clear()
        self._current = None
        if self._loader is not None and state.get("loader") is not None:
            self._loader.load_state_dict(state["loader"])
        if int(state["world"]) != self.world:
            log.warning("checkpoint from %d ranks resumed on %d: policy restarts", state["world"], self.world)
            self._decision = check_sizes(self.policy.start(self.context), self.context, type(self.policy).__name__)
        else:
            self.policy.load_state_dict(state["policy"])
            self.history = History.from_state_dict(state["history"])
            self._decision = check_sizes(np.asarray(state["decision"], dtype=np.int64), self.context, "checkpoint")
        self._checksum = decision_checksum(self._decision)


__all__ = ["Balancer", "DecisionMismatchError"]
