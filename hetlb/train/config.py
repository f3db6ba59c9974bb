"""The Balancer's configuration: every argument checked, the defaults resolved."""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from hetlb.comm.gradients import WrapperSettings
from hetlb.comm.wrappers import wrapper_of
from hetlb.comm.probes import hardware_info
from hetlb.comm.weights import WEIGHTINGS
from hetlb.core import checks
from hetlb.core.decisions import EXACT_INT, ScheduleRule
from hetlb.core.exchange import exchange_settings
from hetlb.data.loader import BalancedLoader
from hetlb.ranks.watchdog import Watchdog
from hetlb.train.model_hooks import BatchDim, has_balancer, layer_list, single_sample_layers


log = logging.getLogger("hetlb.balancer")


@dataclass
class BalancerConfig:
    """:class:`hetlb.Balancer`'s arguments after :func:`check_arguments` (see the Balancer for
    each): those whose checked value or default differs from what was passed, and what the
    process group says. ``model``, ``weighting``, ``group``, ``profile``, ``emulator`` and
    ``watchdog`` are checked and used as given."""

    global_batch: int
    policy: Any
    # the process group as this rank sees it
    distributed: bool
    world: int
    rank: int
    #: The transport class of the model's wrapper (:func:`hetlb.comm.wrappers.wrapper_of`) and
    #: what it is told of the settings.
    wrapper: Any
    wrapper_settings: WrapperSettings
    # bounds: lower resolved (2 for a model whose layers refuse one sample), as given, upper
    lower: int
    lower_given: Optional[int]
    upper: Optional[int]
    #: The model's layers that refuse a one-sample batch (empty where lower=1 says they take one).
    single: List[str]
    accumulate: int
    batch_dim: BatchDim
    # the decision loop
    history: int
    max_bad_steps: int
    # the telemetry's path: transport, exchange blocks, hook deferral, the native hook
    transport: Optional[str]
    native_hook: bool
    defer_hook: bool
    #: This rank's largest micro-batch (None: a step's batch in one forward and backward).
    micro_batch: Optional[int]
    #: This rank's recomputation (:class:`hetlb.train.recompute.Recompute`) or None.
    recompute: Any
    exchange_every: int
    adaptive_exchange: bool
    # the run log
    log_dir: Optional[str]
    tensorboard: Optional[bool]


def check_arguments(model: torch.nn.Module, global_batch: Optional[int], policy: Any, weighting: str, *,
                    loader: Any, group: Any, lower: Optional[int], upper: Optional[int],
                    profile: Any, emulator: Any, history: int, max_bad_steps: int, accumulate: int,
                    batch_dim: BatchDim, transport: Optional[str], native_hook: bool,
                    log_dir: Optional[str], tensorboard: Optional[bool], watchdog: Any,
                    exchange_every: Optional[int], adaptive_exchange: Optional[bool],
                    defer_hook: bool, micro_batch: Optional[int] = None,
                    recompute: Any = None) -> BalancerConfig:
    """:class:`hetlb.Balancer`'s arguments checked, with their defaults resolved: a wrong type raises
    ``TypeError``, a wrong value ``ValueError``, each naming the argument, the value received and
    what is accepted. Touches neither the model nor the process group, but for what the
    wrapper's transport keeps from the start (:meth:`hetlb.comm.gradients.Wrapper.admit`)."""
    # Every argument is checked before anything touches the model (hooks) or the group.
    checks.instance(model, "model", torch.nn.Module, "a torch.nn.Module (DDP-wrapped with "
                    "more than one rank)")
    checks.choice(weighting, "weighting", WEIGHTINGS)
    if isinstance(policy, type):
        raise TypeError(f"policy must be a policy instance, got the class {policy.__name__}; "
                        f"pass {policy.__name__}()")
    if policy is not None:
        missing = [m for m in ("start", "decide", "state_dict", "load_state_dict")
                   if not callable(getattr(policy, m, None))]
        if missing:
            raise TypeError(f"policy must be a hetlb policy (e.g. hetlb.LBB()) with start, "
                            f"decide, state_dict and load_state_dict; got "
                            f"{type(policy).__name__} {policy!r}, which lacks {missing}")
    native_hook = checks.flag(native_hook, "native_hook")
    defer_hook = checks.flag(defer_hook, "defer_hook")
    if micro_batch is not None:
        micro_batch = checks.integer(micro_batch, "micro_batch", 1)
    if tensorboard is not None:
        tensorboard = checks.flag(tensorboard, "tensorboard")
    if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
        raise TypeError(f"log_dir must be a path (str or os.PathLike) or None, got "
                        f"{type(log_dir).__name__} {log_dir!r}")
    if profile is not None:
        from hetlb.train.profile import Profile
        checks.instance(profile, "profile", Profile, "a hetlb.Profile (from hetlb.train.profile(...) "
                        "or Profile.load) or None")
        profile.validate()
    if emulator is not None:
        from hetlb.sim.emulate import Emulator
        checks.instance(emulator, "emulator", Emulator, "a hetlb.sim.emulate.Emulator or None")
    if watchdog is not None:
        checks.instance(watchdog, "watchdog", Watchdog, "a hetlb.Watchdog or None")
    accumulate = checks.integer(accumulate, "accumulate", 1)
    if accumulate > 1 and weighting == "sizes":
        raise ValueError('weighting="sizes" cannot be exact with gradient accumulation: the '
                         'data amounts of a window\'s micro-steps differ, and the accumulated '
                         'gradient no longer tells them apart')
    max_bad_steps = checks.integer(max_bad_steps, "max_bad_steps", 0)
    # (checked with the policy below: their defaults depend on it)
    lower_given = lower  # (a size-aware rule cannot honour bounds: see below)
    # Layers that refuse a one-sample batch in training: no rank gets exactly one.
    single = single_sample_layers(wrapper_of(model, 1).inner(model))
    lower = (2 if single else 1) if lower is None else checks.integer(lower, "lower", 0)
    if single and lower == 1:  # the user's choice: one sample is fine for these inputs
        log.warning("lower=1: a rank may train a batch of one sample, which the model's "
                    "layers refuse in training where their input is (N, C) (%s); leave "
                    "lower out (2 for such a model) unless their inputs have more values "
                    "per channel", layer_list(single))
        single = []
    if batch_dim is not None and not callable(batch_dim):
        batch_dim = checks.integer(batch_dim, "batch_dim", 0)
    if transport is not None:
        checks.choice(transport, "transport", ("side", "carry"))
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    rank = dist.get_rank(group) if distributed else 0
    wrapper = wrapper_of(model, world)
    if recompute is not None:
        _check_recompute(recompute, model, micro_batch, profile)
    if micro_batch is not None and accumulate > 1:
        raise ValueError(f"micro_batch={micro_batch} splits each step into micro-steps of its own; "
                         f"it does not combine with accumulate={accumulate} (leave one out)")
    settings = WrapperSettings(group=group, native=native_hook, accumulate=accumulate,
                               emulator=emulator, route=transport,
                               micro_steps=micro_batch is not None)
    wrapper.admit(model, settings, has_balancer(model))
    if loader is not None:
        if not isinstance(loader, BalancedLoader):
            raise TypeError(f"loader must be a hetlb.DataLoader, got {type(loader).__name__}")
        if loader.balancer is not None:
            raise ValueError("this loader is already bound to a Balancer")
        b = loader.board
        if (b.world, b.rank) != (world, rank):
            raise ValueError(f"the loader was made for rank {b.rank} of {b.world}, this "
                             f"Balancer is rank {rank} of {world}")
        if global_batch is not None and checks.integer(global_batch, "global_batch", 1) != b.global_batch:
            raise ValueError(f"global_batch={global_batch} differs from the loader's "
                             f"batch_size * world = {b.global_batch}")
        global_batch = b.global_batch
    if global_batch is None:
        raise ValueError("global_batch is required (or pass loader=hetlb.DataLoader(...), "
                         "whose batch_size * world is the global batch)")
    global_batch = checks.integer(global_batch, "global_batch", 1)
    if global_batch >= EXACT_INT:  # sizes ride in float32 telemetry slots, exact below 2^24
        raise ValueError(f"global_batch must be < {EXACT_INT} samples per step, got {global_batch}")
    if upper is not None and checks.integer(upper, "upper", 0) < lower:
        raise ValueError(f"upper={upper} is smaller than lower={lower}; each rank's batch must be "
                         f"able to lie in [lower, upper]")
    if global_batch < world * lower:
        why = (f" (lower is 2 by default for this model: its layers refuse a one-sample "
               f"batch in training, {layer_list(single)})" if single and lower_given is None
               else "")
        raise ValueError(f"global_batch={global_batch} is smaller than the world of {world} "
                         f"ranks times lower={lower}{why}; every rank needs at least {lower} "
                         f"sample(s) per step (pass lower=0 to let ranks idle)")
    if policy is None:
        from hetlb.policies.lbb import LBB
        policy = LBB()
    history = checks.integer(history, "history", 1, sys.maxsize)  # (a deque's maxlen)
    exchange_every, adaptive_exchange, history = exchange_settings(
        getattr(policy, "reads_telemetry", True), exchange_every, adaptive_exchange, history)
    return BalancerConfig(
        global_batch=global_batch, policy=policy, distributed=distributed, world=world, rank=rank,
        wrapper=wrapper, wrapper_settings=settings, lower=lower, lower_given=lower_given, upper=upper,
        single=single,
        accumulate=accumulate, batch_dim=batch_dim, history=history, max_bad_steps=max_bad_steps,
        transport=transport, native_hook=native_hook, defer_hook=defer_hook,
        exchange_every=exchange_every, adaptive_exchange=adaptive_exchange, micro_batch=micro_batch,
        recompute=recompute,
        log_dir=log_dir,
        tensorboard=tensorboard)


def _check_recompute(recompute: Any, model: torch.nn.Module, micro_batch: Optional[int],
                     profile: Any) -> None:
    """``recompute=``: a Recompute of the model's own modules, with the two profiles and the
    plain micro-batch a rank chooses its way by."""
    from hetlb.train.recompute import Recompute

    checks.instance(recompute, "recompute", Recompute, "a hetlb.Recompute or None")
    if micro_batch is None or profile is None:
        raise ValueError("recompute= chooses, per step, between micro-steps of at most micro_batch "
                         "samples and recomputing ones, by their profiled times: pass micro_batch= "
                         "and profile= (both measured without recomputation) too")
    mine = {id(m) for m in model.modules()}
    stray = [i for i, m in enumerate(recompute.modules) if id(m) not in mine]
    if stray:
        raise ValueError(f"recompute: modules {stray} are not modules of the Balancer's model")
    root = {id(model), id(wrapper_of(model, 1).inner(model))}
    whole = [i for i, m in enumerate(recompute.modules) if id(m) in root]
    if whole:  # (its recomputation would run the Balancer's own forward checks in the backward)
        raise ValueError(f"recompute: modules {whole} are the Balancer's model itself; name the "
                         f"modules inside it to recompute (e.g. its layers)")
    recompute.entry()  # (its profile is checked here, before the start-up agreement)


def check_rule_fits_loader(d: Any, loader: BalancedLoader, global_batch: int) -> None:
    """Refuse a size-aware rule's caps (``Chronica(cap=...)``) that a loader's samples cannot
    keep to: a sharded loader's steps, a sample larger than every cap; warn where a step of the
    largest samples would exceed the caps together. Every rank has the same samples (agreed
    when the loader binds), so every rank raises alike."""
    if isinstance(d, ScheduleRule) and d.cap is not None and loader.board.partition is not None:
        # (a sharded step takes each rank's samples from its own shard: no schedule, no cap)
        raise ValueError("a size-aware policy's cap= (Chronica(cap=...)) cannot bound a sharded "
                         "loader's steps (partition=): each rank's samples come from its own "
                         "shard, not from the scheduler that keeps to the caps. Drop cap= or "
                         "partition=")
    if isinstance(d, ScheduleRule) and d.cap is not None and loader.sample_sizes is not None:
        # Checked here, not when the sample's step comes (possibly hours in); every rank has
        # the same sizes (agreed when the loader binds), so every rank raises.
        big = int(np.argmax(loader.sample_sizes))
        if loader.sample_sizes[big] > d.cap.max():
            raise ValueError(f"sample {big} (size {loader.sample_sizes[big]:g}) fits in no "
                             f"rank's cap (largest {d.cap.max():g}): its step would fail. "
                             f"Raise the policy's cap= or drop the sample from the dataset")
        step = min(global_batch, loader.sample_sizes.size)
        worst = float(np.sum(np.partition(loader.sample_sizes, -step)[-step:])) if step else 0.0
        if worst > float(d.cap.sum()):
            log.warning("a step of the %d largest samples would total %g, more than the ranks' "
                        "caps hold together (%g): a step that draws enough of them fails with "
                        "an error when it comes. Raise the policy's cap= or lower the global "
                        "batch to rule it out", step, worst, float(d.cap.sum()))


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without one)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def start_bounds(lower: int, upper: Optional[int], profile: Any, global_batch: int,
                 device: torch.device, capped: bool = True,
                 recompute: Any = None) -> Dict[str, Any]:
    """This rank's entry of the start-up agreement: its bounds on a batch (``upper`` capped by a
    profile's out-of-memory limit unless not ``capped``: micro-steps take a larger batch), its
    hardware, its profile's fitted models and its recomputing profile's."""
    up = global_batch if upper is None else checks.integer(upper, "upper", 0)
    prof: Optional[Dict[str, Any]] = None
    if profile is not None:
        if getattr(profile, "oom_at", None) is not None and capped:
            up = min(up, int(profile.limit))  # only a real out-of-memory bound caps the batch
        prof = {"model": profile.fit("cubic"), "linear": profile.fit("linear"),
                "limit": int(profile.limit), "oom_at": getattr(profile, "oom_at", None)}
    return {"lower": int(lower), "upper": up, "hardware": hardware_info(device), "profile": prof,
            "recompute": None if recompute is None else recompute.entry()}
