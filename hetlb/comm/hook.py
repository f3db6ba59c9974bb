"""Weighted gradient aggregation as a DDP communication hook, with telemetry riding along.

Each rank multiplies its bucket by its weight ``w_r`` and the buckets are summed, so the result is
``sum_r w_r * g_r``. With ``g_r`` the gradient of a mean loss over the rank's ``B_r`` samples and
``w_r = B_r / sum(B)`` ("samples"), that is exactly the gradient of the mean loss over the union of
all ranks' samples, whatever the sizes (LBB section 3.2.4, LB-BSP Eq. 7). "sizes" weighs by data
amount (CHRONICA's learning-rate compensation), "none" is the plain mean over the ranks that had
samples (LB-BSP's FL mode), "world" is ``1 / world`` for every rank (DDP's own mean, for a loss
already normalised over the whole step).

The hook is native (``hetlb._C``): DDP runs no Python per bucket, and no Python runs on a
communication thread (see ``csrc/hook/no_python.h`` for why that matters at exit).
:func:`hetlb.reference.weighted_allreduce_hook` is the same hook in Python, the test oracle.

:class:`StepTelemetry` is the hook's state (torch's ``PowerSGDState`` pattern): one object per
rank that owns the step's row, compute clock and delivered table (stored in the native core, the
one place the hook and Python both read and write) and the strategies it calls (the emulator, the
memory probe). The Balancer owns it; DDP's reducer holds its core; it refers to nothing else.

While every rank's weight is ``1 / world`` the hook can wait (:class:`BackwardWatch`,
``Balancer(defer_hook=True)``, the default where it applies): DDP's own mean is then the weighted
one, and the table goes by the side route from the end of backward.

With ``block=k`` (``Balancer(exchange_every=k)``) the core keeps each step's stamped row and only
a step started with ``ship=True`` sends a table: the rows of the block's positions ``0..pos`` of
every rank, ``[(pos + 1) * world, F]`` step-major, by the same route. The other steps send
nothing but the gradient (no carry copy, no side all-reduce).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from hetlb import _C
from hetlb.comm.eager import never_compiled
from hetlb.comm.probes import Probe
from hetlb.comm.route import ROUTES, keep_groups
from hetlb.core.checks import integer
from hetlb.core.decisions import EXACT_INT
from hetlb.core.telemetry import COL, NUM_FIELDS, ROW_VALUES


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``obj``, nested in tuples, lists, dict values and dataclass fields, in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name))


def first_tensor(obj: Any) -> Optional[torch.Tensor]:
    """The first tensor in ``obj`` (see :func:`tensors_in`), or None."""
    return next(tensors_in(obj), None)


class _InertWatch:
    """The forward hook of a copy of a model with a deferred hook: it watches nothing."""

    def __call__(self, module: Any, args: Any, output: Any) -> None:
        return None


class BackwardWatch:
    """Forward hook of a DDP model whose communication hook is deferred (``Balancer(defer_hook=True)``,
    the default where it applies): the end of its backward without a communication hook.

    While every rank's weight is ``1 / world`` (equal batches: Uniform on a homogeneous cluster),
    DDP's own averaging, fused into its copy into buckets, already is the weighted mean, so no
    hook runs and no extra pass over the gradient is made. The step then ends the way the hook
    would end it: a native hook on the model's output (``_C.step_calls``' watch) queues an
    autograd callback that runs once the backward's compute is done, before DDP waits for its
    all-reduces, and stamps the compute time; that callback queues a second, which runs after
    DDP has reduced the gradient and issues the side all-reduce of the table, so it does not
    compete with the gradient's transfer. Every output tensor that needs a gradient is watched
    (one callback per backward); a pass for given inputs (``torch.autograd.grad``,
    ``backward(inputs=)``) is not the step's backward and is skipped. A backward that reaches the
    parameters through none of the outputs is not seen: its step is stamped and exchanged at
    its end (the same table, later), but until then it counts as a batch handed out and not
    trained, so a loop left right after it (``break``) trains that batch again in the next one.
    A backward outside a step raises here, as the hook would.
    The Balancer registers the hook (and removes this watch) before the first step whose
    weights differ. Holds the telemetry and its watch call (the core, and the side group
    weakly) only; a copy of the model gets an inert watch.
    """

    def __init__(self, telemetry: "StepTelemetry") -> None:
        self.telemetry = telemetry
        side = telemetry.side_group
        if side is None:
            side = dist.distributed_c10d._get_default_group()
        # The native watch (watch_output) with the side group bound, as a plain builtin (it runs
        # every forward; see StepTelemetry's step calls). The model keeps the group alive
        # (StepTelemetry.defer); the watch holds it weakly.
        self._watch = _C.step_calls(telemetry.core, side)[3]

    def __reduce__(self) -> Any:
        return (_InertWatch, ())

    @never_compiled
    def __call__(self, module: Any, args: Any, output: Any) -> None:
        # (In eval mode too: DDP reduces the gradient of a backward whatever the mode.)
        if not torch.is_grad_enabled():
            return
        watch = self._watch
        if isinstance(output, torch.Tensor):  # (the common case, without tensors_in's generator)
            if output.requires_grad:
                watch(output)
            return
        for t in tensors_in(output):  # every output a loss may use; one callback per backward
            if t.requires_grad:  # (native: no Python in backward)
                watch(t)


class StepTelemetry:
    """One rank's step telemetry and the hook's state (see the module docstring).

    Args:
        rank, world: this rank and the number of ranks.
        route: the table's route, "side" or "carry" (the same on every rank; :mod:`hetlb.comm.route`).
        group: the gradient process group (None: the default group; None also for a single
            process without torch.distributed).
        side_group: the group of the side route and of :meth:`exchange` (a Gloo group).
        nccl: whether ``group`` is NCCL (weighting rides in PREMUL_SUM).
        device: the model's device; CUDA compute times come from device events, one step late.
        emulator: an :class:`hetlb.sim.emulate.Emulator` for this rank, or None.
        probe: the memory probe (default: one for ``device``).
        block: steps whose rows one table carries (see the module docstring; 1: every step).
    """

    def __init__(self, rank: int, world: int, *, route: str = "side", group: Any = None,
                 side_group: Any = None, nccl: bool = False, device: Optional[torch.device] = None,
                 emulator: Any = None, probe: Optional[Probe] = None, block: int = 1) -> None:
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
        device = torch.device("cpu") if device is None else torch.device(device)
        self.rank, self.world, self.route = int(rank), int(world), route
        self.group, self.side_group = group, side_group if side_group is not None else group
        self.device, self.emulator = device, emulator
        self.probe = probe if probe is not None else Probe(device)
        self.core = _C.StepCore(self.rank, self.world, NUM_FIELDS, route == "carry", bool(nccl),
                                COL["compute"], COL["cpu"], device if device.type != "cpu" else None)
        self.core.set_columns([COL[c] for c in ROW_VALUES])
        # The calls every step makes, as plain builtins bound to the core: at the step boundary
        # the caches are cold from the step's compute, and pybind11's dispatch costs several
        # hundred cache misses a call there (bench/RESULTS.md, "The step's misses counted by callgrind").
        self._begin, self._end_kept, self._restart_clock, _ = _C.step_calls(self.core)
        if block != 1:
            self.core.set_block(int(block))
        #: Steps by which the compute column lags its row (device events are read one step late;
        #: see :meth:`set_clock_lag`).
        self.lag = int(self.core.clock_depth)
        #: The emulator's ``(factor, extra)`` for the open step (see :meth:`start`).
        self.hold = (1.0, 0.0)
        #: Whether the emulator's hold ends the step's compute (DDP's last bucket); False where
        #: the gradient transport spreads it over the step itself (FSDP2's layers).
        self.hold_at_end = True
        #: The fraction of this rank's samples of the open step that its micro-steps before the
        #: current one ran (``bal.micro_steps`` sets it; 0 in a step of one pass): a hold spread
        #: over the step holds at least this fraction by the current micro-step's first wait.
        self.done = 0.0
        if emulator is not None and getattr(emulator, "bandwidth", None):
            self.core.seconds_per_byte = 1.0 / float(emulator.bandwidth)

    def set_clock_lag(self, steps: int) -> None:
        """Read a device's compute times ``steps`` steps late instead of one (before the first
        step only). Reading a step's end event waits for it, so the host runs at most this many
        steps ahead of the device; every record then completes ``steps`` steps after its step.
        (A diagnostic for now: ``bench/bench_gpu_overhead.py``'s ``@lag2``.) Raises on a CPU
        model, whose compute times come from the host clock and do not lag."""
        steps = integer(steps, "set_clock_lag: steps", 1)
        self.core.clock_depth = steps
        self.lag = steps

    # ------------------------------------------------------------------ registration

    def register(self, model: Any, native: bool = True, attached: bool = False) -> None:
        """Register the weighted all-reduce hook on the DDP ``model`` (the native one, or the
        Python reference with ``native=False``; both issue the same collectives). ``attached``:
        another model trained on the same batches (:meth:`hetlb.Balancer.attach`), whose hook
        applies the same weight but neither ends the step's compute nor sends the table."""
        pg, side = self._keep_groups(model)
        if native:
            _C.register_comm_hook(model.reducer, self.core, pg, side, attached)
        else:
            from hetlb.reference import ReferenceHookState, weighted_allreduce_hook
            model.register_comm_hook(ReferenceHookState(self.core, self.group, self.side_group,
                                                        attached=attached),
                                     weighted_allreduce_hook)

    def _keep_groups(self, model: Any) -> tuple:
        """The gradient and side groups, kept on ``model`` after its reducer (:class:`_GroupsKept`)."""
        pg = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
        side = self.side_group if self.side_group is not None else pg
        keep_groups(model, (pg, side))
        return pg, side

    def defer(self, model: Any, prepend: bool = False) -> Any:
        """Watch the end of the DDP ``model``'s backward without a communication hook (see
        :class:`BackwardWatch`; the side route); returns the forward hook's handle, removed
        when :meth:`register` is called later. ``prepend``: the watch runs before the model's
        other forward hooks. (Its hook on an output is native and runs after all the output's
        Python hooks, so its callback comes after FSDP2's end of backward, which
        :class:`hetlb.comm.fsdp_clock.LayerClock` brackets as a wait.)"""
        if self.route != "side":
            raise ValueError(f"a deferred hook sends the table by the side route, not {self.route!r}")
        # (The reducer holds the gradient group even without a hook: it must not be its last owner.)
        self._keep_groups(model)
        return model.register_forward_hook(BackwardWatch(self), prepend=prepend)

    # ------------------------------------------------------------------ one step

    def start(self, step: int, weight: float, batch: float, data: float, predicted: float,
              checksum: float, plan: float, epoch: int, *, offset: float = 0.0,
              new_window: bool = True, sq: float = 0.0, pos: int = 0, ship: bool = True,
              loss: float = math.nan) -> None:
        """Open step ``step`` (of ``epoch``): this rank's weight and row (the values of
        :data:`ROW_VALUES`; memory read here, step and epoch taken modulo 2^24 to stay exact in
        float32), the emulator's hold for it, and the compute clock (``offset``: seconds of
        earlier micro-steps). ``sq``: the sum of the squared sizes of this rank's samples (an
        emulator's quadratic work term). ``pos``, ``ship``: the step's position in its block and
        whether it sends the table. ``loss``: the row's logged loss so far (NaN: none)."""
        # One native call with plain numbers: at the step boundary (caches cold from the step's
        # compute) filling a row array and converting it cost ~20 us more.
        self._begin(weight, offset, new_window, pos, ship, batch, data, predicted, checksum, plan,
                    step % EXACT_INT, epoch % EXACT_INT, self.probe.memory(), loss)
        self.done = 0.0
        emu = self.emulator
        if emu is not None:
            if getattr(emu, "by", "batch") == "data":
                amount = data + getattr(emu, "quadratic", 0.0) * sq
            else:
                amount = int(batch)
            factor, extra = self.hold = emu.affine(step, amount)
            if (factor != 1.0 or extra != 0.0) and self.hold_at_end:
                self.core.hold(factor, extra, emu.spin)
            if emu.failed(step):
                self.core.report_no_progress()

    def restart_clock(self) -> None:
        """The step's first forward: compute time is counted from here."""
        self._restart_clock()

    @property
    def hooked(self) -> bool:
        """Whether a hook ended this step's compute: its last gradient bucket ran, or with a
        deferred hook the end of a backward through the model's output (:class:`BackwardWatch`)."""
        return self.core.last_buckets > 0

    def end_kept(self) -> None:
        """End a step that does not send the table (inside a block): stamped now unless a hook
        ended its compute, and closed (one native call)."""
        self._end_kept()

    def stamp(self, end_window: bool = True) -> float:
        """End the compute now (no hook ran); returns the host seconds."""
        return float(self.core.last_ready(end_window))

    def table(self) -> Optional[np.ndarray]:
        """The table delivered with the gradient (waiting for the side all-reduce), or None:
        ``[world, F]``, or ``[(pos + 1) * world, F]`` (step-major) for a block."""
        return self.core.take_table()

    def exchange(self, kept: int = 0) -> np.ndarray:
        """All-reduce this step's row now (blocking): the table of a step no hook carried (with
        a block, of its positions ``0..pos``). ``kept >= 1``: the kept rows of the block's
        positions ``0..kept-1`` instead, whatever step is open (a flush)."""
        if self.world == 1 and self.side_group is None and not (dist.is_available() and dist.is_initialized()):
            slots = self.core.kept_slots(kept) if kept else self.core.slots
            return slots.numpy().reshape(-1, self.core.fields)
        group = self.side_group if self.side_group is not None else dist.distributed_c10d._get_default_group()
        return self.core.exchange(group, kept)

    def close(self) -> None:
        """End the step: a backward pass now raises until the next :meth:`start`."""
        self.core.close()


def shapes_digest(tensors: Sequence[torch.Tensor]) -> str:
    """A short digest of the tensors' shapes and dtypes, in order, for comparing models across
    ranks (the list itself can run to thousands of characters in an error)."""
    shapes = repr([(tuple(t.shape), str(t.dtype)) for t in tensors]).encode()
    return hashlib.sha1(shapes).hexdigest()[:12]
