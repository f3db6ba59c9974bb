"""The object a training loop talks to: per-rank batch sizes, weighted aggregation, telemetry.

    bal = hetlb.Balancer(ddp_model, global_batch=512, policy=hetlb.LBB())
    loader = bal.loader(dataset, num_workers=2)       # or hetlb.DataLoader(...) + loader=
    for x, y in loader:                               # each batch handed out is one step
        loss_fn(ddp_model(x), y).backward()           # weighted all-reduce, telemetry along
        opt.step(); opt.zero_grad()

``bal.backward(loss)`` in place of ``loss.backward()`` applies the weight to the loss instead of
to the gradient (same gradient, one pass over it fewer; see :meth:`Balancer.backward`).

Step boundaries come from the loader (a batch handed to the loop opens its step) and from the
communication hook (the last gradient bucket ends its compute); ``with bal.step():`` around
forward and backward marks them explicitly instead, and is needed for gradient accumulation.
The compute clock starts at the step's first forward of the model.

Every rank runs the same policy on the same telemetry table, so decisions are replicated without a
coordinator; the checksums of each rank's decision and step plan ride in the next table and any
disagreement raises :class:`DecisionMismatchError` naming the ranks.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hetlb.comm.hook import StepTelemetry
from hetlb.comm.probes import hardware_info
from hetlb.comm.transport import (carry_blocker, carry_penalty, choose_transport, defer_blocker,
                                  is_nccl, keep_groups)
from hetlb.comm.weights import WEIGHTINGS, weights_for
from hetlb.core import checks
from hetlb.core.decisions import EXACT_INT, ScheduleRule, decision_checksum, rescale_position
from hetlb.core.exchange import exchange_settings, next_block_length
from hetlb.core.telemetry import COL, FIELDS, RECORD_ARRAYS, History, StepRecord
from hetlb.data.board import PlanBoard, StepPlan
from hetlb.data.loader import BalancedLoader, check_loader_config
from hetlb.data.shards import Partition, epoch_rates
from hetlb.policies.base import Context, Policy, policy_settings
from hetlb.policies.loop import DecisionLoop
from hetlb.ranks.agreement import make_side_group, raise_refusals, refuse_everywhere
from hetlb.ranks.watchdog import FLUSHING, Watchdog
from hetlb.train.errors import DecisionMismatchError
from hetlb.train.model_hooks import (BatchDim, BackwardEnd, StepGate, UnattachedCheck, check_model,
                                     layer_list, take_over, unattached_message,
                                     single_sample_layers)
from hetlb.train.runlog import ENV_LOG_DIR, RunLog


log = logging.getLogger("hetlb.balancer")

# checksum, plan, step and epoch are adjacent columns: one view of the table checks all four.
assert (COL["plan"], COL["step"], COL["epoch"]) == tuple(COL["checksum"] + i for i in (1, 2, 3))
_IDS = slice(COL["checksum"], COL["epoch"] + 1)
# A StepRecord's arrays are the table's first columns, in order (one slice copies them all).
assert tuple(FIELDS[:len(RECORD_ARRAYS)]) == RECORD_ARRAYS
_RECORD_COLS = len(RECORD_ARRAYS)
_FORMAT = 2


def _num(v: float) -> str:
    """A table entry as an error message shows it: an integer, or the float itself."""
    return str(int(v)) if math.isfinite(v) and v == int(v) else repr(v)


def _same(weights: np.ndarray) -> bool:
    """Whether every rank's weight is the same (each ``1 / world``: DDP's own mean)."""
    return bool((weights == weights[0]).all())


def _groups(values: np.ndarray) -> str:
    """Which ranks hold which value (a corrupt table's NaN and infinities too)."""
    labels = [_num(v) for v in values.tolist()]
    out = []
    for lab in sorted(set(labels), key=lambda x: (len(x), x)):
        out.append(f"ranks {[r for r, x in enumerate(labels) if x == lab]}: {lab}")
        if len(out) > 8:
            out.append("...")
            break
    return "; ".join(out)


_SECOND_LOADER = ("this Balancer already drives a loader; iterate that one every epoch "
                  "(loader.set_epoch(epoch)). A loader for evaluation is a hetlb.DataLoader "
                  "bound to no Balancer, or a plain torch.utils.data.DataLoader (run it under "
                  "torch.no_grad() or model.eval(): the Balancer checks only training batches)")


def _check_rule_bounds(everyone: List[Dict[str, Any]], global_batch: int, policy: str) -> None:
    """Refuse bounds a size-aware rule would ignore (the same on every rank: ``everyone`` is the
    start-up exchange); warn of a profile's memory limit it cannot honour either."""
    asked = []
    for r, e in enumerate(everyone):
        lo, up = e["asked"]["lower"], e["asked"]["upper"]
        what = ([f"lower={lo}"] if lo else []) + ([f"upper={up}"] if up is not None and up < global_batch else [])
        if what:
            asked.append(f"rank {r}: {', '.join(what)}")
    if asked:
        raise ValueError(
            f"{policy} assigns each step's samples to ranks by their estimated time, in counts "
            f"that differ freely (a rank may get none), so the Balancer's lower and upper bounds "
            f"cannot hold ({'; '.join(asked)}). Leave lower and upper out (or lower=0); bound a "
            f"rank's memory with the policy's cap= (its summed sample sizes)")
    limited = [r for r, e in enumerate(everyone)
               if e["profile"] is not None and e["profile"].get("oom_at") is not None]
    if limited:
        log.warning("%s does not bound sample counts: the out-of-memory limits of the profiles of "
                    "ranks %s are not applied (bound memory with cap=)", policy, limited)


@dataclass(slots=True)  # (one a step)
class _Open:
    """The step (or accumulation micro-step) in progress."""

    plan: StepPlan
    explicit: bool
    ship: bool = True  # this step sends the telemetry table (the last of its block)


class Balancer:
    """Per-rank batch sizes for synchronous data-parallel training on uneven workers.

    Args:
        model: the ``DistributedDataParallel`` model (a plain module is accepted when the world
            has one rank). The Balancer registers its communication hook and a forward pre-hook.
            A copy of the model (``copy.deepcopy``, ``torch.save``; an EMA model, say) is not
            balanced: its hook is DDP's own, its forward checks nothing.
        global_batch: samples per step over all ranks; ``sum(batch_sizes) == global_batch``
            (an integer in ``[world * lower, 2**24)``). Optional when ``loader`` is given (then
            ``batch_size * world``).
        policy: a :class:`hetlb.policies.Policy` (default :class:`~hetlb.policies.LBB`).
        weighting: "samples" (``B_r / sum B``), "sizes" (data amount, needs ``sample_sizes=`` in
            the loader) or "none" (the plain mean over ranks with samples, e.g. cross-silo FL).
        loader: a :func:`hetlb.DataLoader` made before the model, to bind to this Balancer.
        group: process group (default: the world).
        lower, upper: bounds on this rank's batch (integers, ``0 <= lower <= upper``; ``lower``
            1 when not given, 2 for a model with layers that refuse a one-sample batch in
            training, :func:`single_sample_layers`; for such a model ``lower=0`` lets a rank idle
            but no split hands it exactly one sample, and ``lower=1`` says its inputs take one).
            ``upper`` is also capped by ``profile.limit`` when the profile ran out of memory (a
            real memory bound). A size-aware policy (:class:`hetlb.Chronica`),
            which assigns each step's samples freely and may give a rank none, cannot honour
            them: a ``lower`` above 0 or an ``upper`` below ``global_batch`` is refused with it
            (bound its memory with ``Chronica(cap=...)``).
        profile: this rank's :class:`hetlb.train.profile.Profile` (LBB starts from the fitted models);
            checked with :meth:`~hetlb.train.profile.Profile.validate`.
        emulator: an :class:`hetlb.sim.emulate.Emulator` that stretches this rank's compute.
        watchdog: a :class:`hetlb.Watchdog` (one per Balancer): heartbeats to the group's store;
            a job stalled for its ``stall`` seconds is diagnosed (which rank, which host) and,
            by default, this worker exits for torchrun to restart the group.
        history: number of steps of telemetry kept (>= 1, and >= ``exchange_every``: a policy
            reads every record of a block).
        max_bad_steps: consecutive steps with unusable telemetry tolerated, keeping the previous
            sizes, before raising :class:`hetlb.UnusableTelemetry`: NaN, negative or implausible
            compute times (outside ``[MIN_COMPUTE, MAX_COMPUTE]`` of :mod:`hetlb.telemetry`),
            or values the policy cannot interpret (``+inf``, no progress, for most policies).
            Memory and CPU readings outside ``[0, 1]`` are clamped, not counted.
        accumulate: micro-steps per optimizer step (gradient accumulation). Each micro-step runs
            in ``with bal.step():``, which enters ``ddp.no_sync()`` on all but the last one of a
            window; divide each micro-step's loss by ``accumulate`` as with DDP; step the
            optimizer when :attr:`synced` is True. Sizes are fixed per window, so the weights
            are exact (weighting "samples" or "none").
        batch_dim: where the model's forward finds the batch size to check against the plan: a
            dimension of the first tensor argument (default 0), a callable ``(args, kwargs) ->
            int``, or None for no check.
        transport: how the telemetry table travels: "carry" (in the last gradient bucket; Gloo
            with CPU float32/float64 only) or "side" (its own small all-reduce on a Gloo group of
            its own, issued with the last bucket; the one to pair with :meth:`backward` on
            Gloo). None (default): "carry" where every rank can, else "side"; also "side" when
            some rank's DDP has ``gradient_as_bucket_view=True`` (DDP would copy the carried
            bucket back into its gradient views), and when the hook is deferred (``defer_hook``:
            no hook to carry the table). Ranks that ask for different transports get
            an error.
        native_hook: False registers the pure-Python reference hook instead of the native one
            (debugging; same collectives, so ranks may mix).
        exchange_every: steps per telemetry exchange. Default (None): 1, every step, as the
            papers decide, for a policy that reads the telemetry; for one that does not
            (:attr:`Policy.reads_telemetry` False: :class:`~hetlb.Uniform`, whose split never
            changes) adaptive blocks of up to 16 steps (at most ``history``), which change none
            of its decisions and save the per-step exchange (``bench/RESULTS.md``, "Uniform
            exchanges in adaptive blocks"); pass 1 for a record every step. With ``k > 1`` each
            step's row is kept and sent with the rows of its block by the block's last step, so
            the other steps add no table copy or
            collective and no record or decision: the records of a block, their checks (every
            rank's step, decision and batch sizes) and one decision happen at its exchange.
            The sizes then change only at exchanges (policies that move a bounded
            amount per decision, as the papers' do, take up to ``k`` times as many steps to
            balance), and a rank disagreement is found up to ``k - 1`` steps late (still an
            error). A block also ends at an epoch's last step; an epoch's first step (ranks that
            set different epochs meet there, after one step) and the first step after the
            Balancer is made or a checkpoint is loaded are exchanges of their own (ranks resumed
            from different checkpoints get ``DecisionMismatchError`` there). The steps after a
            run's last exchange (a ``break`` at a step limit, training without the loader) are
            checked and recorded only by :meth:`flush`. The steps since the last exchange are
            not in a checkpoint's history (unless flushed before it): a run resumed inside a
            block starts a new block, and its decisions may differ from an uninterrupted run's
            (its samples do not: exactly once either way). The same on every rank.
        adaptive_exchange: with ``exchange_every=k > 1`` (opt-in, not in the papers; None:
            True where ``exchange_every`` was left to its default and it gave blocks), grow the
            block while the sizes hold still: a block is 1 step after an exchange whose decision
            changed the sizes (or whose newest step was refused), and twice the previous one,
            up to ``k``, after one that kept them. While the policy is still moving the blocks
            are single steps, so it balances at the papers' per-step pace; on a balanced cluster
            the blocks reach ``k`` after about ``log2(k)`` exchanges, at the overhead of ``k``. A
            change of speed is seen at the next exchange (up to ``k`` steps late), and from
            there the blocks are single steps again. Every rank derives the lengths from the
            same decisions, so they agree. A size-aware policy (:class:`~hetlb.Chronica`, whose
            decision is a rule of fitted time models) refits at every decision, so its blocks
            stay single steps (a warning says so) unless it holds its rule
            (``Chronica(hold=0.02)``, opt-in). Needs ``exchange_every > 1``. The same on every
            rank.
        defer_hook: (default True) leave the model without a communication hook while every
            rank's weight is ``1 / world`` (equal batches, or "none" with samples on every rank;
            never under "sizes" or a size-aware rule such as Chronica, whose weights follow the
            samples drawn):
            DDP's own averaging, which it fuses into its copy into buckets, is then the weighted
            mean, so the gradient costs what plain DDP's costs. The table travels by the side
            transport, issued once DDP has reduced the gradient, and the compute time is taken
            when the backward's compute ends (:class:`hetlb.comm.hook.BackwardWatch`). Before the
            first step whose weights differ (an uneven split, an idle rank, a short last step
            that does not split evenly) the weighted hook is registered, on every rank at the
            same step, and stays (DDP cannot remove a hook). Applies where every rank has a
            CPU DDP model on Gloo, the native hook, no emulator, ``accumulate=1``, no
            ``transport="carry"``, no ``static_graph`` or DDP mixed precision, no hook of another
            already on the model, and DDP averages over the Balancer's group, and where the
            first decision splits evenly; elsewhere the hook is registered at once, as with False.
            The watch sees a backward through the model's outputs; one that reaches the
            parameters only otherwise (a loss of parameters alone) counts as trained only when
            its step ends (see :class:`~hetlb.comm.hook.BackwardWatch`). The same on every rank.
        log_dir: write the world's telemetry of every step there (rank 0 only; every rank holds
            the same table): ``run.jsonl`` and, with ``tensorboard``, TensorBoard scalars (see
            :mod:`hetlb.train.runlog`). Default: the ``HETLB_LOG_DIR`` environment variable, else no log.
            Call :meth:`close` at the end to flush the TensorBoard writer.
        tensorboard: with a ``log_dir``, also write TensorBoard scalars (None: when the
            ``tensorboard`` package is installed).

    Attributes:
        rank, world: this rank and the number of ranks of ``group``.
        history: :class:`hetlb.core.telemetry.History` of the world's telemetry, one record per step
            (on CUDA a step's record completes one step later: compute times come from events
            read without a host synchronisation; with ``exchange_every > 1``, Uniform's default,
            the records of a block arrive at its exchange).
        context: the :class:`hetlb.policies.Context` the policy was started with.
        transport: the telemetry transport every rank uses.
        last_overhead: seconds the Balancer itself spent in the latest step (row, table check,
            record, decision), excluding the user's forward and backward.

    The telemetry table reaches every rank with the gradient all-reduce (see
    :mod:`hetlb.comm.hook`); the Balancer adds no blocking collective per step.

    Every argument is checked before the Balancer touches the model: a wrong type raises
    ``TypeError``, a wrong value ``ValueError``, each naming the argument, the value received and
    what is accepted (e.g. a global batch smaller than ``world * lower``).
    """

    def __init__(self, model: torch.nn.Module, global_batch: Optional[int] = None,
                 policy: Optional[Policy] = None, weighting: str = "samples", *,
                 loader: Optional[BalancedLoader] = None, group: Any = None, lower: Optional[int] = None,
                 upper: Optional[int] = None, profile: Any = None, emulator: Any = None,
                 history: int = 1024, max_bad_steps: int = 10, accumulate: int = 1,
                 batch_dim: BatchDim = 0, transport: Optional[str] = None,
                 native_hook: bool = True, log_dir: Optional[str] = None,
                 tensorboard: Optional[bool] = None, watchdog: Optional[Watchdog] = None,
                 exchange_every: Optional[int] = None, adaptive_exchange: Optional[bool] = None,
                 defer_hook: bool = True) -> None:
        # A rank refusing its arguments tells the others at the start-up exchange, so every rank
        # raises rather than waiting in the collective until its timeout.
        ends = None  # one process: the handle of the BackwardEnd hooks (the gate holds it)
        try:
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
            self.accumulate = checks.integer(accumulate, "accumulate", 1)
            if self.accumulate > 1 and weighting == "sizes":
                raise ValueError('weighting="sizes" cannot be exact with gradient accumulation: the '
                                 'data amounts of a window\'s micro-steps differ, and the accumulated '
                                 'gradient no longer tells them apart')
            self.max_bad_steps = checks.integer(max_bad_steps, "max_bad_steps", 0)
            # (checked with the policy below: their defaults depend on it)
            lower_given = lower  # (a size-aware rule cannot honour bounds: see below)
            # Layers that refuse a one-sample batch in training: no rank gets exactly one.
            single = single_sample_layers(model.module if isinstance(model, DistributedDataParallel)
                                          else model)
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
            self.distributed = dist.is_available() and dist.is_initialized()
            self.world = dist.get_world_size(group) if self.distributed else 1
            self.rank = dist.get_rank(group) if self.distributed else 0
            is_ddp = isinstance(model, DistributedDataParallel)
            if self.world > 1 and not is_ddp:
                raise TypeError(f"with {self.world} ranks the model must be DistributedDataParallel, "
                                f"got {type(model).__name__}")
            if not is_ddp and not native_hook:
                raise ValueError("native_hook=False selects the hook of a DistributedDataParallel model")
            check_model(model, is_ddp, self.accumulate)
            if loader is not None:
                if not isinstance(loader, BalancedLoader):
                    raise TypeError(f"loader must be a hetlb.DataLoader, got {type(loader).__name__}")
                if loader.balancer is not None:
                    raise ValueError("this loader is already bound to a Balancer")
                b = loader.board
                if (b.world, b.rank) != (self.world, self.rank):
                    raise ValueError(f"the loader was made for rank {b.rank} of {b.world}, this "
                                     f"Balancer is rank {self.rank} of {self.world}")
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
            if global_batch < self.world * lower:
                why = (f" (lower is 2 by default for this model: its layers refuse a one-sample "
                       f"batch in training, {layer_list(single)})" if single and lower_given is None
                       else "")
                raise ValueError(f"global_batch={global_batch} is smaller than the world of {self.world} "
                                 f"ranks times lower={lower}{why}; every rank needs at least {lower} "
                                 f"sample(s) per step (pass lower=0 to let ranks idle)")
            if policy is None:
                from hetlb.policies.lbb import LBB
                policy = LBB()
            history = checks.integer(history, "history", 1, sys.maxsize)  # (a deque's maxlen)
            self.exchange_every, self.adaptive_exchange, history = exchange_settings(
                getattr(policy, "reads_telemetry", True), exchange_every, adaptive_exchange, history)
            self.model, self.global_batch = model, global_batch
            self.weighting, self.emulator = weighting, emulator
            self.device = self._device(model)
            self.group = group
            self.watchdog = watchdog

            if is_ddp and self.distributed:
                # From the start, so a start-up that raises (ranks disagree, a policy refuses)
                # leaves no reducer as its group's last owner either (see keep_groups).
                keep_groups(model, (model.process_group,))
            # One exchange at start-up (not per step): configuration, hook capabilities, bounds.
            nccl = self.distributed and is_nccl(group)
            side = self._refusal_side = make_side_group(group) if self.distributed else None
            mine = {"config": {"global_batch": global_batch, "weighting": weighting,
                               "accumulate": self.accumulate, "policy": type(policy).__name__,
                               "exchange_every": self.exchange_every,
                               "adaptive_exchange": self.adaptive_exchange,
                               "defer_hook": defer_hook, "one_sample_refused": bool(single)},
                    "policy_settings": policy_settings(policy),
                    "transport": transport,
                    "carry": carry_blocker(model, group) if is_ddp else "no DDP model",
                    "carry_penalty": carry_penalty(model),
                    "defer": (defer_blocker(model, group, native=native_hook, emulator=emulator,
                                            accumulate=self.accumulate, transport=transport)
                              if is_ddp else "no DDP model"),
                    "asked": {"lower": lower_given, "upper": upper},
                    **self._bounds(lower, upper, profile)}
            everyone = self._all_gather(mine, side)
            self._exchanged = True  # (a later error is every rank's: no second exchange)
            raise_refusals(everyone, "Balancer")
            checks.agree(everyone, "config", "Balancer")
            checks.agree(everyone, "policy_settings", f"{type(policy).__name__} policy")
            context = Context(self.world, global_batch, [e["lower"] for e in everyone],
                                   [e["upper"] for e in everyone],
                                   hardware=[e["hardware"] for e in everyone],
                                   profiles=[e["profile"] for e in everyone])
            have = [r for r, e in enumerate(everyone) if e["profile"] is not None]
            if 0 < len(have) < self.world:  # a policy needs every rank's model to use any
                log.warning("profile= given on ranks %s only (not on %s): the policy cannot use "
                            "profiles and starts without them; pass profile= on every rank",
                            have, sorted(set(range(self.world)) - set(have)))
            # Before any hook is registered: a policy refusing the context leaves the model as it was.
            self._single = bool(single)
            #: The policy, its history, decision and bad-step count (record -> decide -> check).
            self.loop = DecisionLoop(policy, self.world, history=history,
                                     max_bad_steps=self.max_bad_steps, ranks=[self.rank])
            if single:
                self.loop.refuse_single()
            decision = self.loop.start(context)
            if isinstance(decision, ScheduleRule):
                _check_rule_bounds(everyone, global_batch, type(policy).__name__)
            if self.adaptive_exchange and isinstance(decision, ScheduleRule) and \
                    not getattr(policy, "hold", 0):
                log.warning("adaptive_exchange: %s decides a rule of fitted time models, refitted at "
                            "every decision, so its blocks stay single steps (Chronica(hold=0.02) "
                            "keeps a rule while refits change it little; exchange_every=%d without "
                            "adaptive_exchange gives fixed blocks)", type(policy).__name__,
                            self.exchange_every)
            # The hook waits for the first step whose weights differ (see BackwardWatch) where
            # every rank can do without it and the first decision splits evenly; the table then
            # travels by the side transport. (A start that is already uneven, e.g. LBB from
            # profiles, keeps the hook and the transport it would have had.)
            deferred = defer_hook and all(e["defer"] is None for e in everyone) and \
                self._equal_weights(decision)
            self.transport = choose_transport([e["transport"] for e in everyone],
                                              [e["carry"] for e in everyone],
                                              [e["carry_penalty"] for e in everyone],
                                              deferred=deferred)
            if self.transport == "side" and self.distributed and not nccl:
                side = make_side_group(group, own=True)  # not queued behind the gradient's transfers
            self._side = side
            self.telemetry = StepTelemetry(self.rank, self.world, transport=self.transport,
                                           group=group if self.distributed else None, side_group=side,
                                           nccl=nccl, device=self.device, emulator=emulator,
                                           block=self.exchange_every)
            self.telemetry.core.watch(list(model.parameters()))
            self._fast_backward_noted = False
            # A DDP model, whose hook delivers every step's table with the gradient once it is
            # registered (a deferred one by _begin, before the first step whose weights differ).
            self._comm_hook = is_ddp
            self._native, self._lower_given = native_hook, lower_given
            #: Other DDP models trained on the same batches (:meth:`attach`), weighted alike.
            self._attached: List[DistributedDataParallel] = []
            #: The first step looks for DDP models that train in it unattached (:class:`UnattachedCheck`).
            self._check_models = is_ddp
            self._unattached: Optional[UnattachedCheck] = None  # its hooks while that step is open
            self._watch: Any = None  # the deferred hook's BackwardWatch handle (None: hooked)
            if is_ddp and deferred:
                self._watch = self.telemetry.defer(model)
            elif is_ddp:
                self.telemetry.register(model, native=native_hook)
            else:
                params = [p for p in model.parameters() if p.requires_grad]
                if params:  # one process: the end of backward ends the step's compute, as the hook would
                    ends = torch.autograd.graph.register_multi_grad_hook(
                        params, BackwardEnd(self.telemetry), mode="all")
            if loader is not None:
                self.board = loader.board
                self.board.accumulate = self.accumulate
            else:
                self.board = PlanBoard(self.world, self.rank, global_batch, self.accumulate)
            self.board.lower = np.asarray(self.context.lower, dtype=np.int64).copy()
            self.board.single_ok = not self._single
            self._gate = model.register_forward_pre_hook(
                StepGate(self.board, self.telemetry, batch_dim, ends), with_kwargs=True)

            self._step = 0  # completed steps (accumulation windows)
            self._open: Optional[_Open] = None
            self._in_with = False
            self._consumed: Optional[StepPlan] = None  # the handed plan a bal.step() already used
            self._ended: Optional[np.ndarray] = None  # its sizes, until the loop asks for a batch
            self._window_param: Optional[torch.Tensor] = None  # see _check_window_kept
            self._synced_grad: Optional[tuple] = None  # see _check_window_taken
            self._micro = 0  # micro-steps without a loader (window position)
            self._window_data = 0.0
            self._partials: Dict[int, tuple] = {}
            # The block's steps run since the last exchange (exchange_every > 1): (step, plan).
            self._block: List[Tuple[int, StepPlan]] = []
            # The first step after this Balancer is made or a checkpoint is loaded is an exchange of
            # its own (with exchange_every > 1): ranks that start from different positions meet in
            # one table of one shape there and get DecisionMismatchError, not a collective of
            # different shapes.
            self._ship_next = True
            # Steps of the current block: exchange_every, or with adaptive_exchange from 1 up to it.
            self._block_len = 1 if self.adaptive_exchange else self.exchange_every
            # (sizes, data, window_len, (weight, batch, data, equal)) of _weight's latest plan
            self._weight_of: tuple = (None, None, 0, (0.0, 0.0, 0.0, True))
            self._spent = 0.0
            self.last_overhead: float = 0.0
            self.board.post(decision)
            self.runlog: Optional[RunLog] = None
            log_dir = log_dir if log_dir is not None else os.environ.get(ENV_LOG_DIR) or None
            if log_dir is not None and self.rank == 0:
                if tensorboard is None:
                    tensorboard = importlib.util.find_spec("tensorboard") is not None
                self.runlog = RunLog(log_dir, tensorboard=tensorboard)
            # The bound loader's configuration (a value: the loader holds this Balancer, not the
            # other way round), or None before a loader is bound.
            self._loader_config: Optional[Dict[str, Any]] = None
            # A checkpoint's loader order and position, loaded before any loader was bound.
            self._pending_check: Optional[Dict[str, Any]] = None
            if loader is not None:
                self._bind(loader)
            if watchdog is not None and self.distributed:
                watchdog.attach_to(group)
            if not is_ddp:
                take_over(model, keep=self._gate.id)
        except (ValueError, TypeError) as e:
            if not self.__dict__.get("_exchanged", False):
                refuse_everywhere(e, group, self.__dict__.get("_refusal_side"))
            # Refused after the forward hooks were added (the loader's check): take them off, so
            # the model can get a Balancer again (a registered communication hook cannot go).
            for handle in (self.__dict__.get("_gate"), self.__dict__.get("_watch"), ends):
                if handle is not None:
                    handle.remove()
            raise
        del self._refusal_side  # (the telemetry holds the groups it uses)

    # ------------------------------------------------------------------ setup

    @staticmethod
    def _device(model: torch.nn.Module) -> torch.device:
        for p in model.parameters():
            return p.device
        return torch.device("cpu")

    def _bounds(self, lower: int, upper: Optional[int], profile: Any) -> Dict[str, Any]:
        up = self.global_batch if upper is None else checks.integer(upper, "upper", 0)
        prof: Optional[Dict[str, Any]] = None
        if profile is not None:
            if getattr(profile, "oom_at", None) is not None:
                up = min(up, int(profile.limit))  # only a real out-of-memory bound caps the batch
            prof = {"model": profile.fit("cubic"), "linear": profile.fit("linear"),
                    "limit": int(profile.limit), "oom_at": getattr(profile, "oom_at", None)}
        return {"lower": int(lower), "upper": up, "hardware": hardware_info(self.device), "profile": prof}

    def _all_gather(self, mine: Dict[str, Any], side: Any) -> List[Dict[str, Any]]:
        if self.world == 1 or not self.distributed:
            return [mine]
        everyone: List[Any] = [None] * self.world
        dist.all_gather_object(everyone, mine, group=side)
        return everyone

    def loader(self, dataset: Any, batch_size: Optional[int] = None, shuffle: bool = True, *,
               sample_sizes: Optional[Sequence[float]] = None, seed: int = 0,
               drop_last: bool = False, partition: Any = None, rebalance: bool = True,
               **dataloader_kwargs: Any) -> BalancedLoader:
        """This rank's loader of ``dataset`` in the global order (see :mod:`hetlb.data`).

        Args:
            dataset: a map-style dataset.
            batch_size: optional; if given it must be the per-rank average ``global_batch /
                world`` (so a DataLoader line ports unchanged).
            shuffle, seed, drop_last: the permutation per epoch (``seed + epoch``) and whether to
                drop the short last step. The same on every rank (checked).
            sample_sizes: per-sample data amounts (e.g. frames, tokens); required for
                weighting="sizes".
            partition, rebalance: sharded mode, each rank reading only the samples it holds,
                rebalanced at the end of every epoch (see :class:`hetlb.DataLoader` and
                :mod:`hetlb.data.shards`).
            **dataloader_kwargs: passed to ``torch.utils.data.DataLoader`` (num_workers,
                collate_fn, pin_memory, prefetch_factor, persistent_workers, ...).
        """
        if self._loader_config is not None:  # before the new loader touches the shared board
            raise ValueError(_SECOND_LOADER)
        loader = BalancedLoader(dataset, batch_size, shuffle, sample_sizes=sample_sizes, seed=seed,
                                drop_last=drop_last, partition=partition, rebalance=rebalance,
                                board=self.board, **dataloader_kwargs)
        self._bind(loader)
        return loader

    def _bind(self, loader: BalancedLoader) -> None:
        if self._loader_config is not None:
            raise ValueError(_SECOND_LOADER)
        if loader.board.partition is not None and self.accumulate > 1:
            raise ValueError("a sharded loader (partition=) cannot run with gradient accumulation "
                             "(accumulate > 1): a sharded step's sizes follow the shards")
        if self.weighting == "sizes" and loader.sample_sizes is None:
            raise ValueError('weighting="sizes" needs per-sample sizes: '
                             'bal.loader(dataset, sample_sizes=...)')
        everyone = self._all_gather({"loader": loader.sampler.config(), "lag": loader.lag}, self._side)
        checks.agree(everyone, "loader", "loader")
        lags = [e["lag"] for e in everyone]
        if any(lag != lags[0] for lag in lags):
            # A step's sizes are drawn when the DataLoader draws its indices, this many steps
            # ahead: ranks drawing at different depths would draw one step under different
            # decisions (a DecisionMismatchError at the first change of sizes, maybe hours in).
            raise ValueError(
                f"ranks prefetch their batches to different depths (num_workers x prefetch_factor "
                f"steps ahead, 0 without workers; by rank: {lags}): each step's sizes are drawn "
                f"when its indices are, so every rank must draw them equally far ahead. Pass the "
                f"same num_workers and prefetch_factor (or products equal) to bal.loader on every rank")
        d = self.loop.decision
        if isinstance(d, ScheduleRule) and d.cap is not None and loader.board.partition is not None:
            # (a sharded step takes each rank's samples from its own shard: no schedule, no cap)
            raise ValueError("a size-aware policy's cap= (Chronica(cap=...)) cannot bound a sharded "
                             "loader's steps (partition=): each rank's samples come from its own "
                             "shard, not from the scheduler that keeps to the caps. Drop cap= or "
                             "partition=")
        if isinstance(d, ScheduleRule) and d.cap is not None and loader.sample_sizes is not None:
            # Checked here, not when the sample's step comes (possibly hours in); every rank has
            # the same sizes (agreed above), so every rank raises.
            big = int(np.argmax(loader.sample_sizes))
            if loader.sample_sizes[big] > d.cap.max():
                raise ValueError(f"sample {big} (size {loader.sample_sizes[big]:g}) fits in no "
                                 f"rank's cap (largest {d.cap.max():g}): its step would fail. "
                                 f"Raise the policy's cap= or drop the sample from the dataset")
            step = min(self.global_batch, loader.sample_sizes.size)
            worst = float(np.sum(np.partition(loader.sample_sizes, -step)[-step:])) if step else 0.0
            if worst > float(d.cap.sum()):
                log.warning("a step of the %d largest samples would total %g, more than the ranks' "
                            "caps hold together (%g): a step that draws enough of them fails with "
                            "an error when it comes. Raise the policy's cap= or lower the global "
                            "batch to rule it out", step, worst, float(d.cap.sum()))
        if self._pending_check is not None:  # a checkpoint loaded before this loader existed
            check_loader_config(self._pending_check, loader.sampler.config())
            self._pending_check = None
        loader.balancer = self
        self._loader_config = loader.sampler.config()
        pending, loader._pending = loader._pending, None
        if pending is not None:
            self.load_state_dict(pending)

    def attach(self, model: torch.nn.Module) -> None:
        """Weigh another DDP model trained on this Balancer's batches as the balanced one: an
        encoder and a head wrapped separately, a GAN's two networks, a student beside its teacher.

        DDP alone would average such a model's gradient over the ranks' uneven batches
        unweighted; attached, its communication hook multiplies each rank's gradient by the
        same weight as the balanced model's (registered when the balanced model's is: at once,
        or with the deferred hook at the first step whose weights differ), and with accumulation
        ``bal.step()`` enters its ``no_sync()`` too. Its forward is not checked against the plan
        (its batch may be another shape: real and generated samples, say), and the step's
        telemetry is the balanced model's. Call it on every rank, between steps, before the
        model trains (its hook stays for the model's life: DDP cannot remove one).

        The Balancer's first step refuses a DDP model that trains in it without being attached
        (a ``RuntimeError`` naming this method). One process without DDP needs nothing: a plain
        module is accepted and left as it is.

        Raises ``TypeError`` for a model that is not DDP (with more than one rank),
        ``ValueError`` for the balanced model itself, a model already attached or balanced, one
        DDP reduces over another process group, and what the Balancer refuses of its own model
        (a hook of your own, sparse gradients, ``static_graph`` with ``accumulate``)."""
        checks.instance(model, "model", torch.nn.Module, "a DistributedDataParallel model")
        if self._in_with or self._open is not None:
            raise RuntimeError("bal.attach(model) inside a step; attach models between steps, "
                               "before they train")
        is_ddp = isinstance(model, DistributedDataParallel)
        if not is_ddp and self.world == 1:
            return  # (one process: no all-reduce to weigh)
        if not is_ddp:
            raise TypeError(f"bal.attach: with {self.world} ranks the model must be "
                            f"DistributedDataParallel, got {type(model).__name__}")
        if model is self.model or any(model is m for m in self._attached):
            raise ValueError("bal.attach: this model is already weighted by this Balancer "
                             "(the balanced model, or attached before)")
        pg = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
        if model.process_group is not pg:
            raise ValueError("bal.attach: the model's DDP reduces over another process group than "
                             "the Balancer's; wrap it in DistributedDataParallel over the same group")
        check_model(model, True, self.accumulate)
        single = single_sample_layers(model.module)
        if single and not self._single and self._lower_given != 1:
            if self._lower_given == 0:  # no split may hand a rank exactly one sample from now on
                self._single = True
                self.board.single_ok = False
                self.board.post(self.loop.refuse_single())
            else:
                raise ValueError(
                    f"bal.attach: the model's layers refuse a one-sample batch in training "
                    f"({layer_list(single)}), which the Balancer may hand a rank "
                    f"(lower={int(self.context.lower.min())}): make the Balancer with lower=2 (its "
                    f"default for such a model), or lower=0, or lower=1 if their inputs have more "
                    f"than one value per channel")
        keep_groups(model, (pg,))
        if self._watch is None:  # the balanced model's hook is registered: this one's now too
            self.telemetry.register(model, native=self._native, attached=True)
            self._attached.append(model)
        else:
            self._attached.append(model)
            why = defer_blocker(model, self.group, native=True, emulator=self.emulator,
                                accumulate=self.accumulate, transport=self.transport)
            if why is not None:  # it needs its hook now, and so the balanced model its own
                self._register_hook(f"the attached model needs its hook at once ({why})")
        # bal.backward weighs the loss only where no parameter holds a gradient, of either model
        self.telemetry.core.watch([p for m in [self.model] + self._attached for p in m.parameters()])

    # ------------------------------------------------------------------ sizes

    @property
    def batch_sizes(self) -> np.ndarray:
        """int64 ``[world]``: sizes of the step in progress, else of the batch handed out last
        (also once its ``with bal.step():`` has ended it, or its accumulation window), else of
        the next step to be drawn (without the Balancer's loader: of the next step, to draw its
        batch by); under a size-aware rule (:class:`hetlb.Chronica`), whose sizes
        are drawn with each step's samples, of the last step (zeros before any)."""
        if self._open is not None:
            return self._open.plan.sizes.copy()
        if self.board.current is not None:
            return self.board.current.sizes.copy()
        if self._ended is not None:  # a step (window) ended in `with bal.step():`, no next batch yet
            return self._ended.copy()
        d = self.loop.decision
        if isinstance(d, np.ndarray):
            return d.copy()
        last = self.board.last_sizes
        return last.copy() if last is not None else np.zeros(self.world, np.int64)

    @property
    def policy(self) -> Any:
        """The policy (owned by :attr:`loop`)."""
        return self.loop.policy

    @property
    def history(self) -> History:
        """The world's telemetry, one record per step (owned by :attr:`loop`)."""
        return self.loop.history

    @property
    def context(self) -> Context:
        """The :class:`hetlb.policies.Context` the policy was started with."""
        return self.loop.context

    @property
    def steps(self) -> int:
        """Completed steps (accumulation windows); a handed step whose backward ran counts."""
        self._settle()
        return self._step

    def _settle(self) -> None:
        """Finish a handed step whose backward ran now rather than at the next batch (a loop
        left after it: ``len(loader)``, ``bal.steps`` and a checkpoint count it). No collective
        here that the other ranks would not join: its hook (or with a deferred hook, the end of
        its backward) sent the table; one process exchanges with itself."""
        o = self._open
        if o is not None and not o.explicit and not self._in_with and self.telemetry.hooked:
            self._finish()

    @property
    def synced(self) -> bool:
        """Whether the latest ``bal.step()`` ended an accumulation window (its gradient is
        complete: step the optimizer). Always True without accumulation."""
        return self._consumed is None or self._consumed.window_end

    # ------------------------------------------------------------------ the step

    def _weight(self, plan: StepPlan) -> Tuple[float, float, float, bool]:
        """This rank's aggregation weight, batch and data amount in ``plan``, and whether every
        rank's weight is the same (``1 / world``: DDP's own mean); the weight of a window shorter
        than ``accumulate`` (the end of an epoch) scaled by ``accumulate / length``, since each
        micro-step's loss is divided by ``accumulate``."""
        key = self._weight_of
        # Plans are values and whole steps share the posted decision's arrays: the same arrays
        # give the same values (the common case costs no NumPy call).
        if key[0] is plan.sizes and key[1] is plan.data and key[2] == plan.window_len:
            return key[3]
        weights = weights_for(self.weighting, plan.sizes, plan.data)
        w = float(weights[self.rank])
        equal = _same(weights)
        if self.accumulate > 1 and plan.window_len < self.accumulate:
            w *= self.accumulate / plan.window_len
            equal = False
        got = (w, float(plan.sizes[self.rank]), float(plan.data[self.rank]), equal)
        self._weight_of = (plan.sizes, plan.data, plan.window_len, got)
        return got

    def _begin(self, plan: StepPlan, explicit: bool) -> None:
        t = time.perf_counter()
        w, batch, data, equal = self._weight(plan)
        if self._watch is not None:
            if getattr(self.model, "_comm_hooks", None):
                raise RuntimeError(
                    "hetlb: a communication hook was registered on the DDP model besides the "
                    "Balancer's; the Balancer's own hook weighs each rank's gradient by its batch "
                    "(it is registered once the batches differ), and DDP takes one hook only. "
                    "Register no hook of your own on a balanced model")
            if not equal:
                self._register_hook(f"step {plan.step} of epoch {plan.epoch}: the ranks' weights "
                                    f"differ (sizes {plan.sizes.tolist()})")
        first = plan.window_pos == 0
        if first:
            self._window_data = 0.0
        if plan.window_end and plan.window_len > 1:
            data = (self._window_data + data) / plan.window_len
        offset = 0.0 if first else max(float(self.telemetry.core.compute), 0.0)
        pos = len(self._block)
        # An epoch's first step ships too: ranks that set different epochs (and so draw from
        # different orders) meet in a table at once, not up to a block later.
        ship = pos + 1 >= self._block_len or self._ship_next or self._epoch_last(plan) or \
            (plan.step == 0 and self._loader_config is not None)
        tele = self.telemetry
        predicted = self.loop.predict(self.rank, tele.probe.memory()) if self.loop.predictors \
            else math.nan
        tele.start(self._step, w, batch, data, predicted, self.board.checksum, plan.checksum,
                   plan.epoch, offset=offset, new_window=first,
                   sq=0.0 if plan.sq is None else float(plan.sq[self.rank]), pos=pos, ship=ship)
        self._open = _Open(plan, explicit, ship)
        if self._check_models and self._unattached is None:
            self._unattached = UnattachedCheck.watch(self.model, [self.model] + self._attached)
        if self.watchdog is not None:
            self.watchdog.beat(self._step, self.telemetry)
        self._spent += time.perf_counter() - t

    def _equal_weights(self, decision: Any) -> bool:
        """Whether a whole step of ``decision`` weighs every rank ``1 / world`` (a size-aware
        rule's plans, or "sizes" weighting, depend on the samples drawn: not known here)."""
        if not isinstance(decision, np.ndarray) or self.weighting == "sizes":
            return False
        return _same(weights_for(self.weighting, decision, decision))

    def _register_hook(self, why: str) -> None:
        """Register the deferred communication hook now, for good (DDP cannot remove one), and
        the attached models' hooks: the first step whose weights differ is about to run (on
        every rank alike: plans are replicated), so DDP's mean would be wrong from here on."""
        self.telemetry.register(self.model, native=True)  # (first: if DDP refuses, nothing changed)
        for m in self._attached:
            self.telemetry.register(m, native=True, attached=True)
        self._watch.remove()
        self._watch = None
        log.info("%s, so the weighted communication hook is registered from now on", why)

    def _epoch_last(self, plan: StepPlan) -> bool:
        """Whether ``plan`` is the last step of its epoch (known with a loader only)."""
        spe = self.board.steps_per_epoch if self._loader_config is not None else None
        return spe is not None and plan.step + 1 >= spe

    def _plan_without_loader(self) -> StepPlan:
        d = self.loop.decision
        if not isinstance(d, np.ndarray):
            raise RuntimeError("a size-aware decision (ScheduleRule) needs the Balancer's loader")
        k = self.accumulate
        sizes, data = d.copy(), d.astype(np.float64)
        sizes.flags.writeable = data.flags.writeable = False  # a plan is a value (records share it)
        return StepPlan(epoch=0, step=self._step * k + self._micro, sizes=sizes, data=data,
                        checksum=decision_checksum(d), window_pos=self._micro, window_len=k)

    @contextlib.contextmanager
    def step(self) -> Iterator["Balancer"]:
        """Wrap one forward+backward (one micro-step with accumulation): times the compute, sets
        this step's weights, and on exit verifies the table and decides the next sizes. With
        ``accumulate > 1`` it enters ``ddp.no_sync()`` on all but the last micro-step of a
        window."""
        if self._in_with:
            raise RuntimeError("Balancer.step() is already running; steps cannot nest")
        if self._loader_config is not None:
            plan = self.board.current
            if plan is None or plan is self._consumed:
                raise RuntimeError("Balancer.step() without a new batch from the Balancer's loader: "
                                   "every step consumes exactly one batch it hands out")
        else:
            plan = self._plan_without_loader()
            self.board.current = plan
        if isinstance(self.model, DistributedDataParallel) and not self.model.require_backward_grad_sync \
                and self.accumulate == 1:
            raise RuntimeError("hetlb: ddp.no_sync() (gradient accumulation) needs "
                               "Balancer(..., accumulate=K): bal.step() then enters no_sync itself "
                               "and weights the whole window exactly")
        if plan.window_pos > 0:
            self._check_window_kept(plan)
        elif self._synced_grad is not None:
            self._check_window_taken(plan)
        self._begin(plan, explicit=True)
        self._in_with = True
        local = not plan.window_end and isinstance(self.model, DistributedDataParallel)
        try:
            with self._no_sync() if local else contextlib.nullcontext():
                yield self
        except BaseException:
            self._in_with = False
            self._discard()
            raise
        self._in_with = False
        self._consumed = plan
        if self._loader_config is not None:  # (without one, batch_sizes says the next step's)
            self._ended = plan.sizes
        if plan.window_end:
            self._finish()
            if self.accumulate > 1:  # the next window must start from cleared gradients
                # (ids and versions, not the gradients: holding them would keep their memory)
                held = [(p, id(p.grad), p.grad._version) for p in self.model.parameters()
                        if p.grad is not None]
                self._synced_grad = (held, plan) if held else None
        else:
            t = time.perf_counter()
            self.telemetry.stamp(end_window=False)
            self._window_data += float(plan.data[self.rank])
            # One parameter holding a gradient now: the next micro-step checks it still does.
            self._window_param = next((p for p in self.model.parameters() if p.grad is not None), None)
            self.telemetry.close()
            self._open = None
            if self._loader_config is None:
                self._micro += 1
            self._spent += time.perf_counter() - t

    def _no_sync(self) -> Any:
        """``no_sync()`` of the balanced model and the attached ones (a window's weight is
        applied once, by the hooks of its last micro-step)."""
        if not self._attached:
            return self.model.no_sync()
        stack = contextlib.ExitStack()
        for m in [self.model] + self._attached:
            stack.enter_context(m.no_sync())
        return stack

    def _check_window_kept(self, plan: StepPlan) -> None:
        """A micro-step after the first of its window: the gradient the window's earlier
        micro-steps accumulated must still be there. ``optimizer.step()`` and ``zero_grad()`` on
        a micro-step that did not synchronise would update each rank's copy of the model with
        its own local gradient, and the copies would drift apart with no error."""
        p, self._window_param = self._window_param, None
        if p is not None and p.grad is None:
            raise RuntimeError(
                f"hetlb: the gradient accumulated by micro-steps 1-{plan.window_pos} of this "
                f"accumulation window (step {plan.step} of epoch {plan.epoch}) is gone "
                f"(optimizer.zero_grad() after micro-step {plan.window_pos}?). Those micro-steps "
                f"ran under ddp.no_sync(), so an optimizer step there updates each rank's copy "
                f"with its own gradient and the copies drift apart: step the optimizer and zero "
                f"the gradients only when bal.synced is True")

    def _check_window_taken(self, plan: StepPlan) -> None:
        """The first micro-step of a window: the previous window's synchronised gradient must
        have been taken (``optimizer.step()`` then ``zero_grad()``), or it would be added to this
        window's and applied again. A loop that steps on its own count of micro-steps instead of
        ``bal.synced`` does this at an epoch's end, whose last windows may be shorter."""
        held, done = self._synced_grad
        self._synced_grad = None
        # Every gradient untouched (none set to None, zeroed or replaced): parameters that an
        # optimizer does not hold may keep theirs, so one untouched gradient proves nothing. A
        # zeroing through .data leaves the version as it was: the first gradient, all zero, is
        # taken as zeroed.
        if all(p.grad is not None and id(p.grad) == gid and p.grad._version == version
               for p, gid, version in held) and bool(held[0][0].grad.any()):
            raise RuntimeError(
                f"hetlb: the gradient of the accumulation window that ended at step {done.step} of "
                f"epoch {done.epoch} (it was synchronised there: bal.synced was True) is still in "
                f"the parameters as step {plan.step} starts a new window, so it would be added to "
                f"this window's (its samples counted twice in the mean; gradients are not "
                f"accumulated across windows). Step the optimizer and zero the gradients "
                f"whenever bal.synced is True after bal.step(), not on a count of micro-steps: an "
                f"epoch's last windows can be shorter than accumulate={self.accumulate} (its short "
                f"last step is a window of its own)")

    def backward(self, loss: torch.Tensor, gradient: Optional[torch.Tensor] = None,
                 **kwargs: Any) -> None:
        """``loss.backward(gradient, **kwargs)`` with this rank's aggregation weight applied to the
        loss instead of to the gradient: the same gradient, without the hook's pass over it.

        Once a communication hook is registered DDP copies gradients into its buckets unscaled,
        so the hook multiplies every bucket by the weight in a pass of its own (plain DDP fuses
        its averaging into that copy; Gloo has no pre-multiplied sum). Since ``grad(w * loss) =
        w * grad(loss)``, scaling the loss gives the same weighted gradient and the hook only sums.
        On CPU Gloo pair it with ``Balancer(..., transport="side")`` (the default under
        ``gradient_as_bucket_view=True``): "carry" still copies the last bucket next to the
        table. On NCCL the weight rides in PREMUL_SUM either way.

        It falls back to plain ``loss.backward()`` (the hook then weighs, as always) when a
        parameter already holds a gradient (``zero_grad(set_to_none=False)``, or gradients kept
        across steps): the hook must weigh what is already there too. With ``accumulate > 1`` it
        is plain ``loss.backward()``: the window's weight is applied once, by the hook. So it is
        for a float16/bfloat16 loss: ``w`` rounded to 8 or 11 bits would bias this rank's share
        of the mean (its weights would no longer sum to 1), while the hook weighs each gradient
        element in float32 arithmetic.
        (Parameters outside the DDP model, which no hook sees, get ``w`` times their gradient.)

        Args:
            loss: the loss of this rank's batch (a scalar, or any tensor with ``gradient``).
            gradient: as in ``Tensor.backward``.
            **kwargs: ``retain_graph``, ``create_graph``, ``inputs`` as in ``Tensor.backward``.
        """
        if self._open is None:
            raise RuntimeError("hetlb: bal.backward(loss) outside a balanced step; call it for a "
                               "batch of the Balancer's loader, or inside `with bal.step():`")
        core = self.telemetry.core
        w = core.weight
        low = loss.dtype not in (torch.float32, torch.float64) or \
            (gradient is not None and gradient.dtype not in (torch.float32, torch.float64))
        if self._watch is not None:  # no hook yet: DDP's own mean is the weighted one
            torch.autograd.backward(loss, gradient, **kwargs)
            return
        if w == 1.0 or self.accumulate > 1 or low or not core.grads_clear():
            if w != 1.0 and self.accumulate == 1 and not low and not self._fast_backward_noted:
                self._fast_backward_noted = True
                log.warning("bal.backward: parameters already hold gradients, so the hook weighs "
                            "the gradient (as with loss.backward()); zero them with "
                            "optimizer.zero_grad() (set_to_none=True, the default) to skip its pass")
            torch.autograd.backward(loss, gradient, **kwargs)
            return
        if gradient is None:
            if loss.numel() != 1:
                raise RuntimeError(f"bal.backward: a loss of shape {tuple(loss.shape)} needs "
                                   f"gradient= (as Tensor.backward: implicit only for scalars)")
            gradient = torch.full_like(loss, w, memory_format=torch.preserve_format)
        else:
            gradient = gradient * w
        core.prescaled = True
        try:
            torch.autograd.backward(loss, gradient, **kwargs)
        finally:
            core.prescaled = False

    def _discard(self) -> None:
        """Drop the open step without finishing it (a peek, or an exception in its body)."""
        self.telemetry.close()
        self._open = None
        self._stop_model_check()

    def _stop_model_check(self) -> None:
        if self._unattached is not None:
            self._unattached.remove()
            self._unattached = None

    def _finish(self) -> None:
        """End the open step: its table, checks, record, the next decision, the position."""
        t = time.perf_counter()
        plan, ship = self._open.plan, self._open.ship
        tele = self.telemetry
        if not ship:  # inside a block: the row stays in the core until the block's exchange
            tele.end_kept()
            self._open = None
            self._block.append((self._step, plan))
            self._advance(plan)
            self._spent += time.perf_counter() - t
            self.last_overhead, self._spent = self._spent, 0.0
            return
        table = tele.table() if tele.hooked else None
        if table is None:
            if tele.hooked and self._comm_hook and self._watch is None:
                # The communication hook ran to its last bucket but delivered nothing: a bug in
                # hetlb. An exchange here would be a collective the other ranks (whose tables
                # arrived) never join, so it would hang until the timeout instead.
                raise RuntimeError(f"hetlb: step {self._step}: the gradient's communication hook "
                                   f"ran but delivered no telemetry table (transport "
                                   f"{self.transport!r}); please report this with the script")
            if not tele.hooked:
                tele.stamp()
            # No hook carried the row (a step without gradients, or one process without DDP):
            # all-reduce it on its own.
            table = tele.exchange()
        tele.close()
        self._open = None
        steps = self._block + [(self._step, plan)]  # the block's steps, each with its own table
        self._block = []
        self._ship_next = False
        done = self._split(steps, table)
        self._advance(plan)
        self._next_block(self._record([(g, tab) for (g, _), tab in done]))
        part = self.board.partition
        if part is not None and part.rebalance and part.pending is None and \
                plan.epoch == self.board.epoch and self.board.epoch_finished():
            self._rebalance(part, plan.epoch)
        self._spent += time.perf_counter() - t
        self.last_overhead, self._spent = self._spent, 0.0

    def _split(self, steps: List[Tuple[int, StepPlan]], table: np.ndarray) -> list:
        """``table`` (step-major) cut into one table per step of ``steps``, each checked against
        its plan and kept for its record: ``[((step, plan), [world, F] table), ...]``."""
        if table.shape[0] != len(steps) * self.world:
            raise RuntimeError(f"hetlb: step {steps[-1][0]}: the telemetry table has "
                               f"{table.shape[0]} rows for a block of {len(steps)} step(s) of "
                               f"{self.world} ranks; please report this with the script")
        done = list(zip(steps, table.reshape(len(steps), self.world, table.shape[1])))
        for (g, p), tab in done:
            self._verify(tab, p, g)
        for (g, p), tab in done:
            self._partials[g] = (p, tab)
        return done

    def flush(self) -> None:
        """Exchange, check and record the steps run since the last exchange now, and decide
        (``exchange_every > 1``; with 1 every step is exchanged by its own end).

        A block's steps are exchanged by its last step (or an epoch's last); the steps after a
        run's last exchange (a ``break`` at a step limit, training without the loader) are
        otherwise never checked against the other ranks or recorded. Call it between steps on
        every rank at the same point (it is a collective when there is something to send): at
        the end of training, or before a checkpoint whose history should hold every step. A
        step whose backward ran is finished first; a batch handed out but not trained yet (a
        ``break`` at the top of the loop body) stays handed out, its step the first of the
        next block. On CUDA a step's compute time is read one step late (``telemetry.lag`` steps), so
        the last flushed step's record completes with the next step (a checkpoint right after a
        flush lacks it).

        Raises :class:`DecisionMismatchError` as an exchange would."""
        if self._in_with:
            raise RuntimeError("bal.flush() inside `with bal.step():`; call it between steps")
        self._settle()  # a step whose backward ran is trained (and may itself exchange)
        o = self._open
        if not self._block:
            return
        steps, self._block = self._block, []
        if self.watchdog is not None:  # (a rank flushing alone is named as such)
            self.watchdog.beat(self._step, FLUSHING)
        try:
            table = self.telemetry.exchange(kept=len(steps))
        finally:
            if self.watchdog is not None:
                self.watchdog.beat(self._step)
        self._ship_next = False
        if o is not None:  # untrained: reopened below as the first step of the next block
            self._discard()
        try:
            done = self._split(steps, table)
            self._next_block(self._record([(g, tab) for (g, _), tab in done]))
        finally:
            if o is not None:  # (after the decision: the block's length is the new one)
                self._begin(o.plan, o.explicit)

    def _next_block(self, steady: bool) -> None:
        """After an exchange: the next block's length (see ``adaptive_exchange``)."""
        if self.adaptive_exchange:
            self._block_len = next_block_length(self._block_len, steady, self.exchange_every)

    def _advance(self, plan: StepPlan) -> None:
        """``plan``'s step is done: the position, the step count and the watchdog move on."""
        if self._unattached is not None:  # the first step ran with its models checked
            found = self._unattached.found
            self._stop_model_check()
            self._check_models = False
            everyone = self._all_gather({"found": found}, self._side)  # (once: the first step)
            seen = [r for r, e in enumerate(everyone) if e["found"] is not None]
            if seen:
                raise RuntimeError(unattached_message(everyone[seen[0]]["found"], seen))
        self.board.complete(plan)
        if self._loader_config is None:
            self._micro = 0
            self.board.current = None
        self._step += 1
        if self.watchdog is not None:
            self.watchdog.beat(self._step)

    def _rebalance(self, part: Partition, epoch: int) -> None:
        """The epoch ended (sharded mode): decide the moves for the next one, from the size-aware
        policy's time models when it has them, else from each rank's measured time per unit of
        data over the epoch. Every rank computes the same from the same values."""
        d = self.loop.decision
        if isinstance(d, ScheduleRule) and np.all(d.slope > 0):
            slope, intercept = d.slope, d.intercept
        else:
            rates = epoch_rates(self.history, epoch, self.world)
            if rates is None:
                log.warning("epoch %d: no usable timing of every rank; the partition is kept", epoch)
                return
            slope, intercept = rates, np.zeros(self.world)
        moves = part.plan(slope, intercept)
        log.info("epoch %d: rebalancing moves %d of %d samples", epoch, len(moves), part.home.size)

    def _verify(self, table: np.ndarray, plan: StepPlan, g: int) -> None:
        ids = table[:, _IDS].tolist()  # tiny rows: plain lists beat NumPy's per-call cost
        first = ids[0]
        if any(row != first for row in ids) or first[2] != g % EXACT_INT:
            steps = table[:, COL["step"]]
            if (steps != g % EXACT_INT).any():
                raise DecisionMismatchError(f"step {g}: ranks are at different steps ({_groups(steps)})")
            epochs = table[:, COL["epoch"]]
            if (epochs != epochs[0]).any():
                raise DecisionMismatchError(
                    f"step {g}: ranks are training different epochs ({_groups(epochs)}): each "
                    f"would draw its slice of another epoch's order, so samples would be lost and "
                    f"repeated. Call loader.set_epoch(e) with the same e on every rank (or not at "
                    f"all: epochs then follow one another by themselves)")
            for col, what in (("checksum", "batch-size decision"), ("plan", "step plan (sizes used)")):
                c = table[:, COL[col]]
                if (c != c[0]).any():
                    sharded = (col == "plan" and getattr(getattr(self, "board", None),
                                                         "partition", None) is not None)
                    raise DecisionMismatchError(
                        f"step {g}: ranks disagree on the {what}; checksums by rank: {_groups(c)}. "
                        f"The policy must be a deterministic function of the shared telemetry and "
                        f"all ranks must draw their batches at the same point of the loop"
                        + ("; with a sharded loader every rank must also pass the same "
                           "partition= (the same home of every sample)" if sharded else ""))
        if table[:, COL["batch"]].tolist() != plan.sizes.tolist():  # exact: sizes < 2^24 ride in floats
            batch = table[:, COL["batch"]]
            bad = np.flatnonzero(~(batch == plan.sizes)).tolist()
            raise DecisionMismatchError(f"step {g}: ranks {bad} ran batch sizes "
                                        f"[{', '.join(_num(v) for v in batch[bad].tolist())}], "
                                        f"the plan says {plan.sizes[bad].tolist()}")

    def _record(self, steps: List[Tuple[int, np.ndarray]]) -> bool:
        """The records the tables of ``steps`` (in order; one step, or an exchanged block's)
        complete, then one decision. Returns whether the newest step was recorded and the
        decision kept the sizes."""
        records: List[StepRecord] = []
        for g, table in steps:
            done = g - self.telemetry.lag
            if done < 0 or done not in self._partials:
                continue
            plan, old = self._partials.pop(done)
            # One copy holds the record's float columns (the table's first columns, in record
            # order); the batch is the plan's, which _verify matched to the table exactly.
            cols = old[:, :_RECORD_COLS].T.copy()
            cols[COL["compute"]] = table[:, COL["compute"]]
            if plan.window_len != 1:
                cols[COL["compute"]] /= plan.window_len
            records.append(StepRecord(step=done, epoch=plan.epoch, epoch_end=self._epoch_last(plan),
                                      batch=plan.sizes, compute=cols[COL["compute"]],
                                      data=cols[COL["data"]], memory=cols[COL["memory"]],
                                      cpu=cols[COL["cpu"]], predicted=cols[COL["predicted"]],
                                      sq=plan.sq))
        decision = self.loop.advance(records)
        if decision is None:  # the newest step's telemetry (or the history) was refused
            return False
        before = self.board.checksum
        self.board.post(decision)
        steady = self.board.checksum == before
        if self.runlog is not None:
            policy = self.loop.policy
            actions = getattr(policy, "actions", None)
            for record in self.loop.accepted:
                self.runlog.write(record, getattr(policy, "name", type(policy).__name__),
                                  actions[-1] if actions else None, decision)
        return steady

    def close(self) -> None:
        """Flush and close the run log (see ``log_dir``) and stop the watchdog's heartbeat;
        training may not continue logging after it. With one process the steps since the last
        telemetry exchange (``exchange_every > 1``) are recorded first (:meth:`flush`, which
        needs no other rank then); with more, call :meth:`flush` on every rank before it to have
        them in the log (a warning names how many are left out otherwise)."""
        if self._block and not self._in_with:
            if self.world == 1:
                self.flush()
            elif self.runlog is not None:
                log.warning("bal.close(): the %d step(s) since the last telemetry exchange "
                            "(exchange_every=%d) are not in the run log; call bal.flush() on "
                            "every rank before close() to record them", len(self._block),
                            self.exchange_every)
        if self.watchdog is not None:
            self.watchdog.close()
        if self.runlog is not None:
            self.runlog.close()
            self.runlog = None

    # ------------------------------------------------------------------ called by the loader

    def _iteration_starts(self) -> None:
        """A new iteration over the loader: a step that trained is finished; a batch handed out
        and never trained (a peek) is forgotten, and will be handed out again."""
        o = self._open
        if o is not None and not self._in_with:
            if self.telemetry.hooked:
                self._finish()
            else:
                self._discard()
        c = self._consumed
        if c is not None and not c.window_end and self._loader_config is not None:
            # The previous loop was left inside an accumulation window. The new one starts at the
            # window's first micro-step (the position counts whole windows, as a checkpoint
            # must), which is right only if the micro-steps' gradients are gone.
            # Asked of every rank (all reach this point together, windows being aligned): an
            # idle rank's gradients may be zero while the others' are not.
            everyone = self._all_gather({"dropped": self._gradients_dropped()}, self._side)
            if not all(e["dropped"] for e in everyone):
                raise RuntimeError(
                    f"hetlb: the previous loop over the loader was left inside an accumulation "
                    f"window (after micro-step {c.window_pos + 1} of {c.window_len}, step "
                    f"{c.step} of epoch {c.epoch}) and the parameters still hold that window's "
                    f"gradients; a new loop trains the window from its first micro-step, so "
                    f"those samples would count twice. Leave a loop only when bal.synced is "
                    f"True, or drop the window's gradients (optimizer.zero_grad()) on every rank "
                    f"before the new loop")
        self._consumed = None
        self._ended = None

    def _gradients_dropped(self) -> bool:
        """Whether no parameter of the model holds a nonzero gradient."""
        return all(p.grad is None or not bool(p.grad.any()) for p in self.model.parameters())

    def _before_next(self) -> None:
        """The loop asks for the next batch: the previous one's step ends here."""
        self._ended = None
        o = self._open
        if o is not None and not self._in_with:
            self._finish()  # trained (its hook ran), or stepped without gradients: exchanged
        elif self.accumulate > 1 and self.board.current is not None \
                and self.board.current is not self._consumed:
            raise RuntimeError(f"hetlb: with accumulate={self.accumulate} every batch of the loader "
                               f"goes through `with bal.step():`; step {self.board.current.step} "
                               f"of epoch {self.board.current.epoch} did not")

    def _loop_left(self) -> None:
        """The loop over the loader was left with a step open (a ``break``): to the watchdog
        this worker is between steps until its next step opens (see :class:`hetlb.Watchdog`)."""
        if self.watchdog is not None and self._open is not None and not self._in_with:
            self.watchdog.beat(self._step)

    def _handed(self, plan: StepPlan) -> None:
        """The loop received ``plan``'s batch: without accumulation its step opens now."""
        if self.accumulate == 1:
            self._begin(plan, explicit=False)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> Dict[str, Any]:
        """Policy state, decision, telemetry history and data position: tensors and plain Python
        values, loadable with ``torch.load``'s default ``weights_only=True``.

        A batch handed out but not trained yet is not counted: it is handed out again on resume
        (so a checkpoint at the top of the loop body loses nothing). Takes no collective, so
        one rank may save alone.
        """
        if self._in_with:
            raise RuntimeError("state_dict() inside `with bal.step():`; call it between steps")
        self._settle()  # a step whose backward ran is trained
        return {"format": _FORMAT, "world": self.world, "global_batch": self.global_batch,
                "accumulate": self.accumulate, "steps": self._step,
                "position": self.board.position(), "loader": self._loader_config,
                **self.loop.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (or the loader's: the same object); loading twice is
        harmless. On a different world size the data position and step count carry over and the
        policy restarts from :meth:`Policy.start` (its state is per rank).

        Another ``global_batch`` or ``accumulate`` resumes where the samples per optimizer step
        (global batch x accumulate) are the checkpoint's and it lies a whole number of optimizer
        steps into its epoch (a script that divides its accumulation by the world, as nanoGPT,
        resumed on another world size): the position is converted and the policy restarts.

        Raises ``TypeError`` for something other than a dict, and ``ValueError`` naming the field
        for a checkpoint of another format, one that lacks a field, or one of other samples per
        optimizer step, or taken where they cannot be converted (both values and both ways to
        resume are printed); the history and decision are checked before anything is restored.

        On the same world size the policy's state is restored, so the checkpoint must come from
        a policy of the same class and settings (``ValueError`` naming them otherwise). To switch
        policy or settings at a resume, set ``state["policy"] = None`` first: the data position and
        step count are restored and the new policy starts from its :meth:`start` (as on another
        world size)."""
        if not isinstance(state, dict):
            raise TypeError(f"Balancer.load_state_dict: state must be the dict of "
                            f"Balancer.state_dict() (or loader.state_dict()), got {type(state).__name__}")
        if state.get("format") != _FORMAT:
            raise ValueError(f"not a hetlb checkpoint of format {_FORMAT} (format="
                             f"{state.get('format')!r}); expected the dict of Balancer.state_dict() "
                             f"or loader.state_dict()")
        missing = [k for k in ("world", "global_batch", "steps", "position", "decision", "policy",
                               "history") if k not in state]
        if missing:
            raise ValueError(f"checkpoint lacks {missing}; expected the dict of "
                             f"Balancer.state_dict() or loader.state_dict()")
        gb = checks.integer(state["global_batch"], "checkpoint global_batch", 1)
        acc = checks.integer(state.get("accumulate", 1), "checkpoint accumulate", 1)
        position = state["position"]
        # Another global batch with the same samples per optimizer step: the position converted,
        # the policy restarted (its state and history count steps of the old batch)
        rescaled = (gb, acc) != (self.global_batch, self.accumulate)
        if rescaled:
            if not isinstance(position, dict):
                raise ValueError(f"checkpoint position is malformed: {position!r}")
            position = rescale_position(position, (gb, acc), (self.global_batch, self.accumulate))
        world = checks.integer(state["world"], "checkpoint world", 1)
        steps = checks.integer(state["steps"], "checkpoint steps", 0)
        if self._loader_config is not None:
            check_loader_config(state, self._loader_config)
        restored = None
        # No loader yet: its order is checked against the checkpoint's when it is bound.
        pending_check = None if self._loader_config is not None else \
            {"loader": state.get("loader"), "position": position}
        fresh = state["policy"] is None or rescaled  # a policy switched (see the docstring)
        if world == self.world and not fresh:  # parsed before anything changes
            restored = self.loop.prepare(state, "this Balancer",
                                         '; to switch at this resume, set state["policy"] = None '
                                         'before loading (the new policy then starts afresh)')
            backup = self.loop.snapshot()
            self.loop.restore(restored)
        try:
            self.board.load_position(position)
        except BaseException:
            if restored is not None:
                self.loop.restore(backup)
            raise
        self._pending_check = pending_check
        if self._open is not None:
            self._discard()
        self._consumed = None
        self._ended = None
        self._synced_grad = None
        self._partials.clear()
        self._block = []
        self._ship_next = True
        self._block_len = 1 if self.adaptive_exchange else self.exchange_every
        self._micro = 0
        self._step = steps
        if world != self.world or fresh:
            if rescaled:
                log.warning("checkpoint of global_batch=%d x accumulate=%d resumed with "
                            "global_batch=%d x accumulate=%d (the same samples per optimizer "
                            "step): the position is converted and %s restarts", gb, acc,
                            self.global_batch, self.accumulate, self.loop.name)
            elif fresh:
                log.warning("checkpoint resumed without its policy state: %s starts afresh",
                            self.loop.name)
            else:
                log.warning("checkpoint from %d ranks resumed on %d: the policy restarts",
                            world, self.world)
            self.loop.restart()
        self.board.post(self.loop.decision)


__all__ = ["Balancer"]
