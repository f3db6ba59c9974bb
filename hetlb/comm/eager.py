"""Hooks that ``torch.compile`` runs as they are: never traced by TorchDynamo.

The Balancer's forward hooks on the user's model call native builtins (the step clock, the
backward watch) that Dynamo cannot trace, and read the plan's NumPy arrays. Under
``torch.compile(ddp)`` Dynamo traces DDP's call with its hooks (a module with hooks is traced
from its ``__call__``) and would trace into each hook, warning of the builtins and breaking the
graph at the arrays' values; under ``DDP(torch.compile(net))`` the hooks run outside. A hook
marked here is opaque to Dynamo as DDP's own forward context is (``torch.compiler.disable``):
called where Dynamo traces, it runs eagerly, with everything it calls, and the model's forward
is compiled as before. The marks cost nothing per call (no wrapper).
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch


F = TypeVar("F", bound=Callable)

try:  # (the C module: importing torch._dynamo itself takes about a second)
    from torch._C._dynamo.eval_frame import (_FrameAction, _FrameExecStrategy,
                                             set_code_exec_strategy)
except ImportError:  # pragma: no cover (a torch without these: the public wrapper)
    set_code_exec_strategy = None


def never_compiled(fn: F) -> F:
    """``fn`` (a function or a method's function), marked so TorchDynamo never traces it nor
    what it calls; where torch lacks the marks, ``torch.compiler.disable(fn)`` (a wrapper
    costing about half a microsecond a call)."""
    if set_code_exec_strategy is None:
        return torch.compiler.disable(fn)  # type: ignore[return-value]
    skip = _FrameAction.SKIP
    # A frame of its own (run from eager code): skipped, and so is every frame it calls.
    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(skip, skip))
    # Called from code Dynamo traces: not inlined (the attributes torch.compiler.disable sets).
    fn._torchdynamo_disable = True  # type: ignore[attr-defined]
    fn._torchdynamo_disable_msg = "a hetlb hook runs eagerly"  # type: ignore[attr-defined]
    return fn


__all__ = ["never_compiled"]
