"""Local SGD / post-local SGD (Lin et al., "Don't use large mini-batches, use local SGD", 2018),
the baseline users weigh hetlb against, through torch's own implementation (nothing here
re-implements it): :class:`torch.distributed.optim.PostLocalSGDOptimizer` with a
:class:`torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager`, and for a
DDP model the comm hook
:func:`torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook.post_localSGD_hook`.

What torch does (torch 2.x; read from its sources):

* ``PostLocalSGDOptimizer.step()`` runs the wrapped optimizer's ``step()``, then
  ``averager.average_parameters(param_groups)``.
* ``PeriodicModelAverager`` counts those calls in ``averager.step`` (from 0) and averages when
  ``step >= warmup_steps and (step - warmup_steps) % period == 0``: the parameters of the
  optimizer's groups *that have a gradient* are flattened into one buffer, divided by the group
  size and all-reduced (SUM) in the group: a plain mean over the ranks, no weighting, one
  collective. Counting optimizer steps from 1, averages happen after steps ``warmup_steps + 1``,
  ``warmup_steps + 1 + period``, ...; buffers (BatchNorm statistics) are not averaged.
* ``post_localSGD_hook`` (DDP): for the first ``start_localSGD_iter`` iterations it all-reduces
  gradients in the global group like plain DDP (warm-up: the ranks stay identical); afterwards it
  all-reduces them in ``subgroup`` (torch's default: the ranks of one node, made with
  ``dist.new_subgroups()``) or, with ``post_local_gradient_allreduce=False``, not at all
  (pure local SGD: ranks only meet at the model average). hetlb's default is the latter, so the
  baseline is Local SGD proper; pass ``hierarchical=True`` for torch's default (intra-node
  gradient all-reduce).
* ``PostLocalSGDOptimizer.state_dict()`` adds the averager's ``step``; the hook's own counter is
  not saved: :func:`local_sgd` takes ``resume_step`` to set it on a restart.

Without DDP (a plain module) nothing synchronises the warm-up, so ``warmup_steps`` must be 0
there; the ranks must start from identical parameters (broadcast them, or seed alike).

Local SGD's batches are equal on every rank and its averages are periodic in steps, so a slow rank
still holds everyone back at each average; :class:`hetlb.sync.fl.Federated` (LB-BSP's FL mode)
tunes per-rank batches for that.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from hetlb.core.checks import flag, instance, integer


__all__ = ["local_sgd"]


def local_sgd(model: torch.nn.Module, optimizer: torch.optim.Optimizer, period: int,
              warmup_steps: int = 0, *, group: Any = None, hierarchical: bool = False,
              subgroup: Any = None, resume_step: int = 0) -> "torch.distributed.optim.PostLocalSGDOptimizer":
    """Wrap ``optimizer`` for (post-)local SGD with torch's implementation.

    ::

        ddp = DDP(net)
        opt = hetlb.sync.local.local_sgd(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), period=8,
                                         warmup_steps=100)
        for x, y in loader:
            opt.zero_grad(); loss_fn(ddp(x), y).backward(); opt.step()   # averages every 8 steps

    Args:
        model: a ``DistributedDataParallel`` model (the post-localSGD comm hook is registered on
            it: global gradient all-reduce during the warm-up, none afterwards), or a plain
            module (no hook; then ``warmup_steps`` must be 0).
        optimizer: the local optimizer over the model's parameters.
        period: optimizer steps between model averages (>= 1; torch warns that 1 is just DDP).
        warmup_steps: steps of plain synchronous DDP before local SGD starts (the hook's
            ``start_localSGD_iter`` and the averager's ``warmup_steps``, kept equal as torch
            requires).
        group: process group of the averages and the warm-up all-reduce (default: the world).
        hierarchical: after the warm-up, still all-reduce gradients every step within
            ``subgroup`` (torch's default post-local SGD); False: no gradient communication
            between averages (Local SGD).
        subgroup: the per-step group when ``hierarchical`` (default: torch's intra-node
            subgroups).
        resume_step: optimizer steps already taken (restart from a checkpoint): sets the hook's
            iteration counter and the averager's step, so the warm-up is not repeated (loading
            the returned optimizer's ``state_dict`` restores the averager's step too).

    Returns:
        the :class:`torch.distributed.optim.PostLocalSGDOptimizer` to step instead of
        ``optimizer`` (its ``.averager`` is the ``PeriodicModelAverager``).
    """
    with warnings.catch_warnings():  # torch.distributed.optim still scripts with the deprecated torch.jit
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (PostLocalSGDState,
                                                                                    post_localSGD_hook)
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

    instance(model, "model", torch.nn.Module, "a DistributedDataParallel model or a plain torch.nn.Module")
    instance(optimizer, "optimizer", torch.optim.Optimizer, "a torch.optim.Optimizer over the model's parameters")
    period = integer(period, "period", 1)
    warmup_steps = integer(warmup_steps, "warmup_steps", 0)
    hierarchical = flag(hierarchical, "hierarchical")
    resume_step = integer(resume_step, "resume_step", 0)
    if subgroup is not None and not hierarchical:
        raise ValueError("subgroup is the per-step gradient group of hierarchical=True; "
                         f"got subgroup={subgroup!r} with hierarchical=False")
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    if not ddp and warmup_steps:
        raise ValueError(f"warmup_steps must be 0 for a plain module (nothing synchronises the ranks "
                         f"during a warm-up without DDP), got {warmup_steps!r}; wrap the model in DDP")
    if not ddp and hierarchical:
        raise ValueError("hierarchical=True all-reduces gradients through DDP's comm hook; wrap the model in DDP")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("local_sgd needs an initialised torch.distributed process group")
    if ddp:
        state = PostLocalSGDState(process_group=group, subgroup=subgroup, start_localSGD_iter=warmup_steps,
                                  post_local_gradient_allreduce=hierarchical)
        state.iter = resume_step
        model.register_comm_hook(state, post_localSGD_hook)
    averager = PeriodicModelAverager(period=period, warmup_steps=warmup_steps, process_group=group)
    averager.step = resume_step
    return PostLocalSGDOptimizer(optim=optimizer, averager=averager)
