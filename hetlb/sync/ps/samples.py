"""The parameter server's samples of one epoch: their order, the pool still to hand out, which
worker holds which batch since when, and which samples' gradients were applied."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Sequence

import numpy as np
import torch


__all__ = ["EpochSamples"]


class EpochSamples:
    """The epoch's samples (see the module docstring).

    Each epoch's order is a permutation seeded by ``seed`` and the epoch; samples already applied
    this epoch (after a resume) are left out of the pool. A batch given back (its worker was
    dropped) is handed out again first.
    """

    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples, self.seed = num_samples, seed
        self.epoch = 0
        #: This epoch's samples whose gradient was applied.
        self.applied = np.zeros(num_samples, bool)
        self._held: Dict[int, List[int]] = {}  # worker -> indices it holds
        self._handed_at: Dict[int, float] = {}  # worker -> time.monotonic() of its hand-out
        self._pool: List[int] = []
        self.new_order()

    def new_order(self) -> None:
        """Fill the pool with this epoch's order, its applied samples left out."""
        order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(
            self.seed * 1_000_003 + self.epoch)).numpy()
        self._pool = [int(i) for i in order if not self.applied[i]]
        self._pool.reverse()  # popped from the end: the order's front first

    @property
    def left(self) -> bool:
        """Whether samples remain to be handed out this epoch."""
        return bool(self._pool)

    @property
    def busy(self) -> int:
        """Workers holding a batch."""
        return len(self._held)

    def hand_out(self, worker: int, n: int) -> List[int]:
        """The next ``n`` samples (fewer at the epoch's end), now held by ``worker``."""
        take = [self._pool.pop() for _ in range(min(n, len(self._pool)))]
        self._held[worker] = take
        self._handed_at[worker] = time.monotonic()
        return take

    def take_back(self, worker: int, indices: Sequence[int]) -> List[int]:
        """The batch ``worker`` held, returned with its push of ``indices``; raises
        ``RuntimeError`` when those are not the samples it held."""
        held = self._held.pop(worker, None)
        self._handed_at.pop(worker, None)
        if held is None or list(indices) != held:
            raise RuntimeError(f"worker {worker + 1} pushed a gradient of samples it does not hold "
                               f"(it holds {None if held is None else len(held)} samples); the "
                               f"worker and server are out of step")
        return held

    def give_back(self, worker: int) -> int:
        """Return the batch ``worker`` holds to the pool's front; the number of its samples."""
        held = self._held.pop(worker, [])
        self._handed_at.pop(worker, None)
        self._pool.extend(reversed(held))  # handed out again first
        return len(held)

    def late(self, timeout: float) -> List[int]:
        """The workers that have held their batch longer than ``timeout`` seconds."""
        now = time.monotonic()
        return [w for w, t in self._handed_at.items() if now - t > timeout]

    def mark_applied(self, indices: Sequence[int]) -> None:
        """Mark ``indices`` applied; raises ``RuntimeError`` on a sample applied twice this epoch."""
        idx = np.asarray(indices, np.int64)
        if idx.size and self.applied[idx].any():
            raise RuntimeError(f"parameter server: samples {idx[self.applied[idx]][:8].tolist()} "
                               f"applied twice in epoch {self.epoch}")
        self.applied[idx] = True

    def complete(self) -> bool:
        """Whether every sample of the epoch was handed out, given back and applied."""
        return not self._pool and not self._held and bool(self.applied.all())

    def next_epoch(self) -> None:
        """Count the epoch and clear its applied samples (:meth:`new_order` fills the pool)."""
        self.epoch += 1
        self.applied[:] = False

    def state_dict(self) -> Dict[str, Any]:
        """The checkpoint's ``epoch`` and ``applied``."""
        return {"epoch": self.epoch, "applied": torch.from_numpy(self.applied.copy())}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s keys and refill the pool."""
        self.epoch = int(state["epoch"])
        self.applied = state["applied"].numpy().astype(bool).copy()
        self.new_order()
