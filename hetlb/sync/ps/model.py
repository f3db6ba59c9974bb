"""The parameter server's model: the global parameters and buffers, the optimizer, the update
count (version), the checks that a worker's model and push fit them, and the update itself."""
from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.nn.utils import parameters_to_vector

from hetlb.comm.hook import shapes_digest


__all__ = ["ServerModel"]


class ServerModel:
    """The model and optimizer a parameter server trains (see :mod:`hetlb.sync.ps`).

    Args:
        model: the model (updated in place).
        optimizer: optimizer over its parameters (stepped once per update).
        snapshot_every: keep a copy of the parameters after every ``snapshot_every``-th update
            in :attr:`snapshots` (0: never).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 snapshot_every: int) -> None:
        self.model, self.optimizer = model, optimizer
        self._params = [p for p in model.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("ParameterServer: the model has no trainable parameters")
        self._numel = sum(p.numel() for p in self._params)
        self._shapes = shapes_digest(self._params)
        # (running statistics: the workers' forward passes change them, the updates carry it)
        self._buffers = list(model.buffers())
        self._buffer_shapes = shapes_digest(self._buffers)
        #: Updates applied.
        self.version = 0
        self.snapshot_every = snapshot_every
        #: ``(version, seconds since the first batch was handed out, flat parameters)``.
        self.snapshots: List[Any] = []
        self._t0: Optional[float] = None

    def check_hello(self, worker: int, hello: Dict[str, Any]) -> None:
        """Raise ``ValueError`` when ``worker``'s model (as its hello describes it) is not this one."""
        numel = hello.get("numel")
        if numel is not None and int(numel) != self._numel:
            raise ValueError(f"worker {worker + 1}'s model has {int(numel)} trainable parameter "
                             f"elements, the server's {self._numel}: every rank must build "
                             f"the same model")
        shapes = hello.get("shapes")
        if shapes is not None and shapes != self._shapes:
            # (the same element count in other shapes would train a scrambled model)
            raise ValueError(f"worker {worker + 1}'s model has trainable parameters of other "
                             f"shapes or dtypes than the server's (both {self._numel} "
                             f"elements): every rank must build the same model")
        buffer_shapes = hello.get("buffer_shapes")
        if buffer_shapes is not None and buffer_shapes != self._buffer_shapes:
            raise ValueError(f"worker {worker + 1}'s model has other buffers (BatchNorm "
                             f"statistics) than the server's ({len(self._buffers)}): every "
                             f"rank must build the same model")

    def check_push(self, worker: int, push: Dict[str, Any], held: int) -> None:
        """Raise ``ValueError`` when ``worker``'s push of the ``held`` samples it held is malformed."""
        grad = push.get("grad")
        if not isinstance(grad, torch.Tensor) or grad.numel() != self._numel or \
                int(push["n"]) != held or not math.isfinite(float(push["compute"])):
            raise ValueError(f"worker {worker + 1} pushed a malformed gradient (a tensor of "
                             f"{self._numel} elements, n = {held} samples and a finite "
                             f"compute time expected; got "
                             f"{grad.numel() if isinstance(grad, torch.Tensor) else grad!r} "
                             f"elements, n = {push.get('n')!r}, compute = {push.get('compute')!r})")
        pushed = push.get("buffers")
        if self._buffers and (not isinstance(pushed, (list, tuple)) or len(pushed) != len(self._buffers)
                              or any(d is not None and (not isinstance(d, torch.Tensor) or d.shape != b.shape)
                                     for d, b in zip(pushed, self._buffers))):
            raise ValueError(f"worker {worker + 1} pushed malformed buffers (a list of "
                             f"{len(self._buffers)} tensors shaped as the model's buffers "
                             f"expected, got {type(pushed).__name__})")

    def start_clock(self) -> None:
        """The snapshots' time counts from the first call."""
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def copy(self) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """The flat parameters and the buffers, copied (what a worker loads)."""
        return (parameters_to_vector([p.detach() for p in self._params]).clone(),
                [b.detach().clone() for b in self._buffers])

    def update(self, pushes: Sequence[Dict[str, Any]]) -> int:
        """Apply one update from ``pushes``: the sum of their summed gradients over their total
        batch into the optimizer, the buffers as in :mod:`hetlb.sync.ps`. The total batch."""
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
        self._update_buffers(pushes, total)
        self.version += 1
        if self.snapshot_every and self.version % self.snapshot_every == 0:
            self.snapshots.append((self.version, time.perf_counter() - (self._t0 or 0.0),
                                   parameters_to_vector([p.detach() for p in self._params]).clone()))
        return total

    def _update_buffers(self, pushes: Sequence[Dict[str, Any]], total: int) -> None:
        """The members' buffers: floating ones by their batch-weighted mean, integer ones by the
        largest (never below the server's; see :mod:`hetlb.sync.ps`)."""
        with torch.no_grad():
            for i, b in enumerate(self._buffers):
                got = [(int(p["n"]), p["buffers"][i]) for p in pushes if p["buffers"][i] is not None]
                if not got:
                    continue
                if b.is_floating_point():
                    b.copy_(sum(d.to(torch.float64) * (n / total) for n, d in got).to(b.dtype))
                else:
                    b.copy_(torch.stack([b] + [d.to(b.dtype) for _, d in got]).amax(0))

    def state_dict(self) -> Dict[str, Any]:
        """The checkpoint's ``model``, ``optimizer`` and ``version``."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "version": self.version}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s keys."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
