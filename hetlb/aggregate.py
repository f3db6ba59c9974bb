"""Weighted gradient aggregation as a DDP communication hook, with telemetry riding along.

Each rank multiplies its bucket by its weight ``w_r`` and the buckets are summed, so the result
is ``sum_r w_r * g_r``. With ``g_r`` the gradient of a mean loss over the rank's ``B_r`` samples
and ``w_r = B_r / sum(B)`` ("samples"), that is exactly the gradient of the mean loss over the
union of all ranks' samples, whatever the sizes (LBB section 3.2.4, LB-BSP Eq. 7). "sizes" weighs
by data amount (CHRONICA's learning-rate compensation), "none" is the plain mean (FL mode).

Two implementations of the same hook, picked by :func:`register_hook`:

* the native hook (``hetlb._C``, C++): CPU float32/float64 buckets on a non-NCCL group. DDP then
  runs no Python per bucket and none in the all-reduce's continuation, which keeps the
  interpreter (and its lock) off the critical path between a rank's last gradient and its next
  step; Python only sets the weight and row before backward and reads the table after it.
* :func:`weighted_allreduce_hook` (Python): everything else (NCCL's PREMUL_SUM, fp16/bf16
  buckets, CUDA timing, the emulated bandwidth cap). Tests check that the two agree exactly.

How telemetry travels (no blocking collective of its own):

* Gloo with float32/float64 buckets: the rank writes its row into a zeroed ``[world, F]`` slot
  region appended to the *last* bucket (the fused ``flatten_scaled`` packs the scaled gradient and
  the slots in one pass); the SUM all-reduce then delivers the whole table to every rank, exactly
  (each slot is one rank's value plus zeros), in the same collective as the gradient.
* fp16/bf16 buckets (which cannot carry integers exactly) and NCCL: the float64 table is
  all-reduced on a Gloo group by an asynchronous collective issued from the last bucket's hook,
  alongside the gradient; nothing waits for it until the step ends (CUDA: until the next step
  ends, so the host never synchronises with the device).
* If no hook ran in a step (no gradients, ``no_sync``), the Balancer all-reduces the row itself.
"""
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from . import _C, ops
from .telemetry import COL, NUM_FIELDS

log = logging.getLogger("hetlb.aggregate")

WEIGHTINGS = ("samples", "sizes", "none")

#: Bucket dtypes that carry the telemetry slots exactly (batch < 2^24, 24-bit checksums).
_CARRY_DTYPES = (torch.float32, torch.float64)


def weights_for(weighting: str, batch: np.ndarray, data: Optional[np.ndarray] = None) -> np.ndarray:
    """Per-rank aggregation weights, summing to 1.

    Args:
        weighting: "samples" (``B_r / sum B``), "sizes" (``data_r / sum data``) or "none" (``1/n``).
        batch: int ``[world]`` samples per rank this step.
        data: ``[world]`` data amount per rank (required for "sizes").
    """
    batch = np.asarray(batch, dtype=np.float64)
    n = batch.shape[0]
    if weighting == "none":
        return np.full(n, 1.0 / n)
    if weighting == "samples":
        amount = batch
    elif weighting == "sizes":
        if data is None:
            raise ValueError('weighting="sizes" needs the data amount of every rank')
        amount = np.asarray(data, dtype=np.float64)
    else:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    if not np.all(np.isfinite(amount)) or np.any(amount < 0):
        raise ValueError(f"weights need finite non-negative amounts, got {amount.tolist()}")
    total = float(amount.sum())
    if total <= 0:
        raise ValueError(f"weighting={weighting!r}: the step has no samples/data on any rank "
                         f"(amounts {amount.tolist()})")
    return amount / total


@dataclass
class HookState:
    """Mutable per-step state shared between the Balancer and the hook (one per Balancer).

    The Balancer sets ``weight`` and ``row`` before the backward pass (:meth:`reset`);
    ``on_last`` runs in the last bucket's hook before anything is sent (it stamps the compute time
    and applies emulation); the hook stores the delivered table in ``table`` (or a pending future
    in ``table_future``). With the native hook, ``core`` (a ``hetlb._C.HookCore``) holds the
    weight, row and table instead, and stamps the compute time itself when ``on_last`` is None.
    """

    group: Any
    rank: int
    world: int
    side_group: Any = None
    nccl: bool = False
    weight: float = 1.0
    row: np.ndarray = field(default_factory=lambda: np.zeros(NUM_FIELDS))
    on_last: Optional[Callable[[], None]] = None
    comm_delay: Optional[Callable[[int], None]] = None
    table: Optional[np.ndarray] = None
    table_future: Any = None
    table_buffer: Optional[torch.Tensor] = None
    hooks_run: int = 0
    factors: Dict[Any, torch.Tensor] = field(default_factory=dict)
    core: Any = None

    @property
    def native(self) -> bool:
        """Whether the native (C++) hook serves this state."""
        return self.core is not None

    def reset(self, weight: float, row: np.ndarray, on_last: Optional[Callable[[], None]] = None) -> None:
        """Start a step: this rank's weight and telemetry row, and the last-bucket callback.

        With the native hook and no ``on_last``, the hook stamps the compute time (seconds from
        this call to the last bucket) into the row itself, without entering Python.
        """
        self.weight = float(weight)
        self.row = np.asarray(row, dtype=np.float64)
        self.on_last = on_last
        self.table = None
        self.table_future = None
        self.table_buffer = None
        self.hooks_run = 0
        self.factors = {}
        if self.core is not None:
            self.core.on_last = on_last
            self.core.compute_col = -1 if on_last is not None else COL["compute"]
            self.core.reset(self.weight, self.row)

    def release(self) -> None:
        """Drop the step's callback (it refers back to the Balancer; the native core would hide
        that cycle from the garbage collector)."""
        self.on_last = None
        if self.core is not None:
            self.core.on_last = None

    def set_compute(self, seconds: float) -> None:
        """Record this step's compute time in the row (before the last bucket is sent)."""
        self.row[COL["compute"]] = seconds
        if self.core is not None:
            self.core.set(COL["compute"], seconds)

    def hold_until(self, deadline: float, spin: float) -> None:
        """Native hook only: hold the last bucket until ``deadline`` (``perf_counter`` seconds)
        before stamping the compute time and sending; cleared by :meth:`reset`."""
        if self.core is None:
            raise RuntimeError("hold_until needs the native hook; the Python hook stretches in on_last")
        self.core.hold_until(deadline, spin)

    def buckets_run(self) -> int:
        """Buckets the hook has processed since :meth:`reset`."""
        return int(self.core.hooks_run) if self.core is not None else self.hooks_run

    def slots(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """This rank's row in a zeroed ``[world * F]`` region (what the SUM all-reduce fills)."""
        s = torch.zeros(self.world * NUM_FIELDS, dtype=dtype)
        s[self.rank * NUM_FIELDS:(self.rank + 1) * NUM_FIELDS] = torch.from_numpy(self.row)
        return s

    def launch_side_table(self) -> None:
        """All-reduce the float64 table asynchronously on the (Gloo) side group."""
        buf = self.slots()
        work = dist.all_reduce(buf, group=self.side_group, async_op=True)
        self.table_buffer = buf
        self.table_future = work

    def collect_table(self) -> Optional[np.ndarray]:
        """The delivered ``[world, F]`` table, waiting for the side collective if it is pending."""
        if self.core is not None:
            if self.table is None:
                self.table = self.core.take_table()
            return self.table
        if self.table is None and self.table_future is not None:
            self.table_future.wait()
            self.table = self.table_buffer.view(self.world, NUM_FIELDS).numpy().copy()
            self.table_future = None
        return self.table


def _scale_in_place(buf: torch.Tensor, weight: float) -> None:
    if weight == 0.0:
        # A rank with no samples may hold NaN gradients (mean over an empty batch); 0 * NaN = NaN.
        buf.zero_()
    elif weight != 1.0:
        ops.scale_([buf], weight)


def _delayed(fut: torch.futures.Future, delay: Optional[Callable[[int], None]], nbytes: int):
    if delay is None:
        return fut
    def wait_link(f):  # emulated bandwidth cap: the bucket arrives later
        delay(nbytes)
        return f.value()
    return fut.then(wait_link)


def premul_factor(state: "HookState", buf: torch.Tensor) -> torch.Tensor:
    """This step's weight as a one-element tensor of the bucket's dtype on its device.

    NCCL reads a tensor factor through a pointer of the reduced data's type (c10d's
    ``unpackPreMulSum``), so the dtype must match the bucket's; a device tensor also avoids the
    host-immediate bf16 factor that is known to return zeros. Made once per step and dtype. For
    fp16/bf16 buckets the weight is rounded to that dtype (relative error at most 2^-9 for bf16).
    """
    key = (buf.dtype, buf.device)
    f = state.factors.get(key)
    if f is None:
        f = torch.tensor(state.weight, dtype=buf.dtype, device=buf.device)
        state.factors[key] = f
    return f


def weighted_allreduce_hook(state: "HookState", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: ``sum_r w_r * bucket_r`` with the telemetry table riding along.

    Register with ``ddp.register_comm_hook(state, weighted_allreduce_hook)`` (the Balancer does).
    Works with ``gradient_as_bucket_view`` and ``static_graph`` (the bucket is scaled in place and
    returned), and with fp16/bf16 buckets.
    """
    buf = bucket.buffer()
    last = bucket.is_last()
    state.hooks_run += 1
    if last and state.on_last is not None:
        state.on_last()
    nbytes = buf.numel() * buf.element_size()

    if state.nccl:
        op = dist._make_nccl_premul_sum(premul_factor(state, buf))  # weighting rides in the reduction
        fut = dist.all_reduce(buf, op=op, group=state.group, async_op=True).get_future()
        if last:
            state.launch_side_table()
        return _delayed(fut.then(lambda f: f.value()[0]), state.comm_delay, nbytes)

    if last and buf.dtype in _CARRY_DTYPES and buf.device.type == "cpu":
        weight = state.weight
        if weight == 0.0:
            buf.zero_()
            weight = 1.0
        flat = ops.flatten_scaled([buf], weight, extra=state.slots())
        fut = dist.all_reduce(flat, group=state.group, async_op=True).get_future()
        n = buf.numel()

        def unpack(f: torch.futures.Future) -> torch.Tensor:
            out = f.value()[0]
            state.table = out[n:].view(state.world, NUM_FIELDS).to(torch.float64).numpy().copy()
            ops.unflatten_(out, [buf], 1.0)
            return buf
        return _delayed(fut.then(unpack), state.comm_delay, nbytes)

    _scale_in_place(buf, state.weight)
    fut = dist.all_reduce(buf, group=state.group, async_op=True).get_future()
    if last:
        state.launch_side_table()
    return _delayed(fut.then(lambda f: f.value()[0]), state.comm_delay, nbytes)


def is_nccl(group: Any) -> bool:
    """Whether collectives on ``group`` go through NCCL."""
    try:
        return dist.get_backend(group) == "nccl"
    except Exception:  # noqa: BLE001 (older torch builds raise different errors for unknown groups)
        return False


def _native_blocker(model: Any, state: HookState) -> Optional[str]:
    """Why the native hook cannot serve ``model`` (None if it can)."""
    if state.nccl:
        return "the group uses NCCL"
    if state.comm_delay is not None:
        return "an emulated bandwidth cap delays the buckets"
    if getattr(model, "mixed_precision", None) is not None:
        return "DDP mixed precision changes the bucket dtype"
    for p in model.parameters():
        if p.requires_grad and (p.device.type != "cpu" or p.dtype not in _CARRY_DTYPES):
            return f"a parameter is {p.dtype} on {p.device}"
    return None


def register_hook(model: Any, state: HookState, native: Optional[bool] = None) -> bool:
    """Register the weighted all-reduce hook on the DDP ``model``; returns whether it is native.

    Args:
        model: a ``DistributedDataParallel`` model without a communication hook yet.
        state: its :class:`HookState` (from :func:`make_state`).
        native: True to require the native hook (``ValueError`` saying why if it cannot serve
            this model), False for the Python hook, None (default) to pick the native one
            whenever it can.
    """
    reason = _native_blocker(model, state)
    if native and reason is not None:
        raise ValueError(f"the native comm hook cannot serve this model: {reason}")
    if native is False or reason is not None:
        if native is None:
            log.debug("Python comm hook: %s", reason)
        model.register_comm_hook(state, weighted_allreduce_hook)
        return False
    pg = state.group if state.group is not None else dist.distributed_c10d._get_default_group()
    core = _C.HookCore(state.rank, state.world, NUM_FIELDS)
    _C.register_comm_hook(model.reducer, pg, core)
    state.core = core
    return True


def make_state(group: Any = None) -> HookState:
    """Hook state for ``group`` (default world group); creates a Gloo side group under NCCL."""
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    nccl = is_nccl(group)
    side = group
    if nccl:
        ranks: Optional[List[int]] = None if group is None else dist.get_process_group_ranks(group)
        side = dist.new_group(ranks=ranks, backend="gloo")
    return HookState(group=group, rank=rank, world=world, side_group=side, nccl=nccl)


def allreduce_row_blocking(state: HookState) -> np.ndarray:
    """Fallback when no hook ran this step: all-reduce the table now (a blocking collective)."""
    buf = state.slots()
    dist.all_reduce(buf, group=state.side_group)
    return buf.view(state.world, NUM_FIELDS).numpy().copy()


__all__ = ["WEIGHTINGS", "weights_for", "HookState", "weighted_allreduce_hook", "premul_factor", "make_state",
           "register_hook", "allreduce_row_blocking", "is_nccl"]
