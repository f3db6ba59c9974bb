"""Per-rank activation checkpointing (opt-in): recompute named modules' activations in the
backward where that makes a rank's step faster.

Recomputing a module's forward in the backward keeps only its inputs alive, so a micro-batch of
more samples fits in a rank's memory, at the price of a second forward of those modules. A rank
whose plain micro-batch is small (many micro-steps, each paying its fixed cost) may finish its
share sooner in fewer, larger, recomputing micro-steps; a rank with memory to spare does not.
Each rank decides for its own step from its two profiles (plain and recomputing), the same rule
the policies allocate by (:meth:`hetlb.policies.Context.recomputes`), so the ranks need not
agree on it: recomputation communicates nothing of its own.

The switch is torch's composable checkpoint (``torch.distributed._composable.checkpoint``),
applied to each module once and turned on and off per step: parameter names, ``state_dict`` keys
and hooks stay as they were, and it composes with FSDP2 (a module's recomputation finds its
parameters unsharded inside the Balancer's micro-step window, so it gathers nothing).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Sequence

import torch

from hetlb.core import checks

__all__ = ["Recompute"]


def _checkpoint() -> Any:
    from torch.distributed._composable import checkpoint

    return checkpoint


def _load_checkpoint_machinery() -> None:
    """One tiny checkpointed backward: the first loads torch's checkpoint machinery (about
    80 MiB of a CPU process's memory), which a profile taken recomputing would otherwise count
    against its first batch size."""
    from torch.utils.checkpoint import checkpoint as run_checkpointed

    with torch.inference_mode(False), torch.enable_grad():  # (made under no_grad() too)
        t = torch.ones(1, requires_grad=True)
        run_checkpointed(torch.sin, t, use_reentrant=False).backward()


class Recompute:
    """The modules a rank may recompute in the backward, and what recomputing costs it.

    Args:
        modules: the model's modules to checkpoint (e.g. its transformer blocks): each gets
            torch's composable checkpoint, off until a step turns it on. Under FSDP2 these are
            typically the modules given to ``fully_shard``.
        profile: this rank's :class:`hetlb.Profile` measured with recomputation on (profile
            inside ``with rc.on():``); set it later as ``rc.profile = ...`` if the profile needs
            the modules checkpointed first.
        micro_batch: the largest micro-batch that fits while recomputing (default: the
            profile's ``limit``).

    Pass it as ``hetlb.Balancer(..., micro_batch=m, profile=plain, recompute=rc)``: in each step
    :meth:`hetlb.Balancer.micro_steps` runs the rank's share either plainly, in micro-steps of at
    most ``m``, or recomputing, in micro-steps of at most ``micro_batch``, whichever its
    profiles say is faster for that share (docs/balancer.md, "Recomputation").
    """

    def __init__(self, modules: Sequence[torch.nn.Module], profile: Any = None,
                 micro_batch: Optional[int] = None) -> None:
        if isinstance(modules, torch.nn.Module) or not isinstance(modules, (list, tuple)):
            raise TypeError(f"Recompute: modules must be a list of torch.nn.Module (e.g. "
                            f"list(model.layers)), got {type(modules).__name__}")
        if not modules:
            raise ValueError("Recompute: modules is empty; name the modules to recompute")
        for i, m in enumerate(modules):
            checks.instance(m, f"Recompute: modules[{i}]", torch.nn.Module, "a torch.nn.Module")
        if len({id(m) for m in modules}) != len(modules):
            raise ValueError("Recompute: a module is named twice")
        checkpoint = _checkpoint()
        self.modules: List[torch.nn.Module] = list(modules)
        for m in self.modules:
            if checkpoint.state(m) is None:
                checkpoint(m)
            checkpoint.state(m).enable_hook = False
        self.profile = profile
        self.micro_batch = None if micro_batch is None else \
            checks.integer(micro_batch, "Recompute: micro_batch", 1)
        _load_checkpoint_machinery()

    @property
    def enabled(self) -> bool:
        """Whether the modules recompute now (the same for all of them)."""
        return bool(_checkpoint().state(self.modules[0]).enable_hook)

    def _set(self, on: bool) -> None:
        checkpoint = _checkpoint()
        for m in self.modules:
            checkpoint.state(m).enable_hook = on

    @contextlib.contextmanager
    def on(self, enabled: bool = True) -> Iterator["Recompute"]:
        """Recompute (or, with ``enabled=False``, not) inside the block, e.g. to profile; the
        previous setting comes back at its end."""
        before = self.enabled
        self._set(bool(enabled))
        try:
            yield self
        finally:
            self._set(before)

    def limit(self) -> int:
        """The largest recomputing micro-batch: ``micro_batch`` or the profile's ``limit``."""
        if self.micro_batch is not None:
            return self.micro_batch
        if self.profile is None:
            raise ValueError("Recompute: needs a profile measured with recomputation on "
                             "(profile inside `with rc.on():` and set rc.profile) or micro_batch")
        return int(self.profile.limit)

    def entry(self) -> dict:
        """This rank's entry of the Balancer's start-up agreement: the recomputing profile's
        fitted models and micro-batch (``ValueError`` without a profile)."""
        from hetlb.train.profile import Profile

        if self.profile is None:
            raise ValueError("recompute=: the Recompute has no profile; profile the step inside "
                             "`with rc.on():` and set rc.profile (the rank chooses between "
                             "recomputing and not from the two profiles' times)")
        checks.instance(self.profile, "recompute: profile", Profile, "a hetlb.Profile")
        self.profile.validate()
        return {"model": self.profile.fit("cubic"), "linear": self.profile.fit("linear"),
                "micro_batch": self.limit()}

    def __repr__(self) -> str:
        return (f"Recompute({len(self.modules)} modules, micro_batch={self.micro_batch}, "
                f"profile={'set' if self.profile is not None else None})")
