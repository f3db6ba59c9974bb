"""An FSDP2 model's ranks profiled together (:func:`hetlb.profile` with ``model=``).

A step of a ``fully_shard`` model all-gathers and reduce-scatters in every layer, so profiling
it binds the ranks: every rank must try the same sizes in the same order, a rank must not run out
of memory inside a collective the others are in (they would wait there until the group's
timeout), and a fast rank's step time would include its waits for the slow one, so every rank
would measure the slowest rank's times. :class:`FSDP2Trial` gives :func:`hetlb.profile` the
collectives for the first two (the ranks compare their sizes, and agree before each size and
after its first call whether it fits everywhere) and a :class:`hetlb.comm.fsdp_clock.LayerClock`
for the third (FSDP's waits left out of each timed step).
"""
from __future__ import annotations

import zlib
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from hetlb.comm.fsdp_clock import LayerClock
from hetlb.comm.fsdp_state import all_param_groups, data_parallel_ranks, fsdp_modules


class _Waits:
    """The clock's host while profiling (:class:`hetlb.comm.fsdp_clock.ClockHost`): always
    counting, no emulator; it sums the waits, on the host or, where the profile times a CUDA
    device by events, between events on its current stream."""

    emulator = None
    hold_at_end = False
    hold = (1.0, 0.0)
    done = 0.0

    def __init__(self, device: torch.device) -> None:
        self.core = self
        self.open = self.restarted = True
        self.quiet = False
        self.on_device = device.type == "cuda"
        self.total = 0.0
        self._pairs: List[Tuple[Any, Any]] = []
        self._begun: Optional[Any] = None

    def clear(self) -> None:
        self.total, self._pairs, self._begun = 0.0, [], None

    def add_wait(self, seconds: float) -> None:
        self.total += seconds

    def device_wait_begins(self) -> None:
        if self.on_device:
            self._begun = torch.cuda.Event(enable_timing=True)
            self._begun.record()

    def device_wait_ends(self) -> None:
        if self._begun is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pairs.append((self._begun, end))
            self._begun = None

    def seconds(self) -> float:
        """The waits since :meth:`clear`: the device's (its events have completed: the profile's
        timer waited for the step's end) or the host's."""
        if self.on_device:
            return sum(a.elapsed_time(b) for a, b in self._pairs) / 1e3
        return self.total


class FSDP2Trial:
    """:class:`hetlb.comm.gradients.ProfileTrial` of a ``fully_shard`` model whose mesh is the
    whole world (a process group of the world's ranks)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        world = dist.get_world_size()
        ranks = data_parallel_ranks(model)
        if ranks is not None and ranks != list(range(world)):
            raise ValueError(f"hetlb.profile: the model is sharded over ranks {ranks} of "
                             f"{world}; profiling together needs its mesh to be every rank")
        shape = next((tuple(p.device_mesh.shape) for p in model.parameters()
                      if hasattr(p, "device_mesh")), (world,))
        forward = sorted({g.post_forward_mesh_info is not None for g in all_param_groups(model)})
        self.key = f"FSDP2 mesh {shape}, reshard after forward {forward}"
        self._waits = _Waits(device)
        self._clock = LayerClock(self._waits, fsdp_modules(model))

    def same_sizes(self, sizes: List[int]) -> None:
        mine = [float(len(sizes)), float(zlib.crc32(repr(list(sizes)).encode()))]
        t = torch.tensor(mine + [-v for v in mine], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if t[:2].tolist() != [-v for v in t[2:].tolist()]:
            raise ValueError(f"hetlb.profile: the ranks of the FSDP2 model try different batch "
                             f"sizes (this rank: {list(sizes)}); every rank must try the same, "
                             f"in the same order: pass the same batch_sizes and max_batch on "
                             f"every rank")

    def agree(self, go: bool) -> bool:
        t = torch.tensor([1 if go else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def start(self) -> None:
        self._waits.clear()
        self._clock.new_step()

    def waited(self) -> float:
        return self._waits.seconds()

    def close(self) -> None:
        self._clock.remove()
