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
import logging
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from hetlb.comm.hook import StepTelemetry
from hetlb.comm.gradients import GradientTransport
from hetlb.comm.route import choose_route, is_nccl
from hetlb.comm.wrappers import ends_of
from hetlb.core import checks
from hetlb.core.decisions import ScheduleRule, rescale_position
from hetlb.core.telemetry import History
from hetlb.data.board import PlanBoard
from hetlb.data.loader import BalancedLoader, check_loader_config
from hetlb.policies.base import Context, Policy, policy_settings
from hetlb.policies.loop import DecisionLoop
from hetlb.ranks.agreement import Peers, agree_at_start, make_side_group, refuse_everywhere
from hetlb.ranks.watchdog import Watchdog
from hetlb.train.config import check_arguments, check_rule_fits_loader, model_device, start_bounds
from hetlb.train.losses import FinishedStep
from hetlb.train.micro import MicroWays
from hetlb.train.recompute import Recompute
from hetlb.train.model_hooks import (BatchDim, has_balancer, layer_list, single_sample_layers,
                                     ModelHooks)
from hetlb.train.runlog import RunLog, open_runlog
from hetlb.train.steps import StepDriver, equal_weights


log = logging.getLogger("hetlb.balancer")

_FORMAT = 2


_SECOND_LOADER = ("this Balancer already drives a loader; iterate that one every epoch "
                  "(loader.set_epoch(epoch)). A loader for evaluation is a hetlb.DataLoader "
                  "bound to no Balancer, or a plain torch.utils.data.DataLoader (run it under "
                  "torch.no_grad(), or in model.eval() between steps: the Balancer checks only "
                  "training batches)")


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


class Balancer:
    """Per-rank batch sizes for synchronous data-parallel training on uneven workers.

    Args:
        model: the DDP model (``torch.nn.parallel``'s), a model sharded with FSDP2's
            ``fully_shard`` (docs/fsdp2.md: its loss goes through :meth:`backward`), or, when the
            world has one rank, a plain module. For a DDP model the Balancer registers its
            communication hook; for every model a forward pre-hook.
            A copy of the model (``copy.deepcopy``, ``torch.save``; an EMA model, say) is not
            balanced: its hook is DDP's own, its forward checks nothing.
        global_batch: samples per step over all ranks; ``sum(batch_sizes) == global_batch``
            (an integer in ``[world * lower, 2**24)``). Optional when ``loader`` is given (then
            ``batch_size * world``).
        policy: a :class:`hetlb.policies.Policy` (default :class:`~hetlb.policies.LBB`).
        weighting: "samples" (``B_r / sum B``), "sizes" (data amount, needs ``sample_sizes=`` in
            the loader), "none" (the plain mean over ranks with samples, e.g. cross-silo FL) or
            "world" (``1 / world`` for every rank, idle ones included: DDP's own mean, for a
            loss already normalised over the whole step).
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
            are exact (weighting "samples", "none" or "world").
        batch_dim: where the model's forward finds the batch size to check against the plan: a
            dimension of the first tensor argument (default 0), a callable ``(args, kwargs) ->
            int``, or None for no check.
        transport: the telemetry table's route (:mod:`hetlb.comm.route`; not the gradient
            transport, which follows the model's wrapper): "carry" (in the last gradient bucket; Gloo
            with CPU float32/float64 only) or "side" (its own small all-reduce on a Gloo group of
            its own, issued with the last bucket; the one to pair with :meth:`backward` on
            Gloo). None (default): "carry" where every rank can, else "side"; also "side" when
            some rank's DDP has ``gradient_as_bucket_view=True`` (DDP would copy the carried
            bucket back into its gradient views), and when the hook is deferred (``defer_hook``:
            no hook to carry the table). Ranks that ask for different routes get
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
            rank's weight is ``1 / world`` (equal batches, "none" with samples on every rank, or
            "world";
            never under "sizes" or a size-aware rule such as Chronica, whose weights follow the
            samples drawn):
            DDP's own averaging, which it fuses into its copy into buckets, is then the weighted
            mean, so the gradient costs what plain DDP's costs. The table travels by the side
            route, issued once DDP has reduced the gradient, and the compute time is taken
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
        micro_batch: this rank's largest micro-batch (opt-in; e.g. its profile's ``limit``), for
            :meth:`micro_steps`: a batch beyond it runs as several micro-steps, so a fast rank
            with little memory still takes its share (a profile's out-of-memory limit then does
            not cap ``upper``). Ranks may differ; not with ``accumulate > 1``.
        recompute: this rank's :class:`hetlb.Recompute` (opt-in, with ``micro_batch`` and
            ``profile``): each step, :meth:`micro_steps` runs the rank's share recomputing the
            named modules' activations in the backward (larger micro-batches, a second forward)
            where its two profiles say that is faster. Ranks may differ.
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
        route: the telemetry table's route every rank uses ("carry" or "side"; also readable as
            ``transport``, the argument's name).
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
                 defer_hook: bool = True, micro_batch: Optional[int] = None,
                 recompute: Optional[Recompute] = None) -> None:
        # A rank refusing its arguments tells the others at the start-up exchange, so every rank
        # raises rather than waiting in the collective until its timeout.
        try:
            cfg = check_arguments(model, global_batch, policy, weighting, loader=loader, group=group,
                                  lower=lower, upper=upper, profile=profile, emulator=emulator,
                                  history=history, max_bad_steps=max_bad_steps,
                                  accumulate=accumulate, batch_dim=batch_dim, transport=transport,
                                  native_hook=native_hook, log_dir=log_dir, tensorboard=tensorboard,
                                  watchdog=watchdog, exchange_every=exchange_every,
                                  adaptive_exchange=adaptive_exchange, defer_hook=defer_hook,
                                  micro_batch=micro_batch, recompute=recompute)
            self.distributed, self.world, self.rank = cfg.distributed, cfg.world, cfg.rank
            self.accumulate, self.max_bad_steps = cfg.accumulate, cfg.max_bad_steps
            self.exchange_every, self.adaptive_exchange = cfg.exchange_every, cfg.adaptive_exchange
            policy, global_batch, lower, upper = cfg.policy, cfg.global_batch, cfg.lower, cfg.upper
            lower_given, single, history = cfg.lower_given, cfg.single, cfg.history
            wrapper, wrapping = cfg.wrapper, cfg.wrapper_settings
            native_hook, defer_hook, batch_dim = cfg.native_hook, cfg.defer_hook, cfg.batch_dim
            log_dir, tensorboard = cfg.log_dir, cfg.tensorboard
            self.model, self.global_batch = model, global_batch
            self.weighting, self.emulator = weighting, emulator
            self.device = model_device(model)
            self.group = group
            self.watchdog = watchdog

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
                    "wrapper": {"wrapper": wrapper.name},
                    **wrapper.capabilities(model, wrapping),
                    "asked": {"lower": lower_given, "upper": upper},
                    "micro_batch": cfg.micro_batch,
                    **start_bounds(lower, upper, profile, global_batch, self.device,
                                   capped=cfg.micro_batch is None, recompute=cfg.recompute)}
            self._exchanged = True  # (a later error is every rank's: no second exchange)
            everyone = agree_at_start(mine, side, self.world, self.distributed, "Balancer",
                                      [("config", "Balancer"),
                                       ("policy_settings", f"{type(policy).__name__} policy"),
                                       ("wrapper", "model")])
            context = Context(self.world, global_batch, [e["lower"] for e in everyone],
                              [e["upper"] for e in everyone],
                              hardware=[e["hardware"] for e in everyone],
                              profiles=[e["profile"] for e in everyone],
                              micro_batch=[e["micro_batch"] for e in everyone],
                              recompute=[e["recompute"] for e in everyone])
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
            # travels by the side route. (A start that is already uneven, e.g. LBB from
            # profiles, keeps the hook and the route it would have had.)
            deferred = defer_hook and all(e["defer"] is None for e in everyone) and \
                equal_weights(weighting, decision)
            self.route = choose_route([e["transport"] for e in everyone],
                                      [e["carry"] for e in everyone],
                                      [e["carry_penalty"] for e in everyone], deferred=deferred)
            if self.route == "side" and self.distributed and not nccl:
                side = make_side_group(group, own=True)  # not queued behind the gradient's transfers
            #: Small values gathered from every rank between steps (through the side group).
            self.peers = Peers(side, self.world, self.distributed)
            self.telemetry = StepTelemetry(self.rank, self.world, route=self.route,
                                           group=group if self.distributed else None, side_group=side,
                                           nccl=nccl, device=self.device, emulator=emulator,
                                           block=self.exchange_every)
            self.telemetry.core.watch(list(model.parameters()))
            self._lower_given = lower_given
            self.board = loader.board if loader is not None else \
                PlanBoard(self.world, self.rank, global_batch, self.accumulate)
            self.board.configure(self.accumulate, context.lower, single_ok=not self._single)
            #: How this rank's weighted gradient reaches the others (for a DDP model its
            #: communication hook): everything about the model's wrapper.
            self.gradient_transport: GradientTransport = wrapper(model, self.telemetry, wrapping,
                                                                 deferred=deferred)
            #: The Balancer's other hooks on the user's model (the forward check).
            self.hooks = ModelHooks(model, self.telemetry, self.board,
                                    transport=self.gradient_transport, wrapper=wrapper,
                                    batch_dim=batch_dim, ends=ends_of(self.gradient_transport))
            self.board.post(decision)
            #: Runs the steps: the open step, the telemetry block, the accumulation window.
            self.driver = StepDriver(model, self.telemetry, self.board, self.loop, self.hooks,
                                     self.gradient_transport,
                                     rank=self.rank, world=self.world, weighting=weighting,
                                     accumulate=self.accumulate, exchange_every=self.exchange_every,
                                     adaptive_exchange=self.adaptive_exchange,
                                     route=self.route, watchdog=watchdog,
                                     runlog=open_runlog(log_dir, tensorboard, self.rank),
                                     peers=self.peers)
            self.driver.micro = MicroWays(cfg.micro_batch, cfg.recompute, context, self.rank)
            # The bound loader's configuration (a value: the loader holds this Balancer, not the
            # other way round), or None before a loader is bound.
            self._loader_config: Optional[Dict[str, Any]] = None
            if loader is not None:
                self._bind(loader)
            if watchdog is not None and self.distributed:
                watchdog.attach_to(group)
            if wrapper.takes_over:
                self.hooks.take_over()
        except (ValueError, TypeError) as e:
            if not self.__dict__.get("_exchanged", False):
                refuse_everywhere(e, group, self.__dict__.get("_refusal_side"))
            # Refused after the forward hooks were added (the loader's check): take them off, so
            # the model can get a Balancer again (a registered communication hook cannot go).
            if "hooks" in self.__dict__:
                self.hooks.remove()
            if "gradient_transport" in self.__dict__:
                self.gradient_transport.remove()
            raise
        del self._refusal_side  # (the telemetry holds the groups it uses)

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
        everyone = self.peers.gather({"loader": loader.order.config(), "lag": loader.lag})
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
        check_rule_fits_loader(self.loop.decision, loader, self.global_batch)
        # (a checkpoint loaded before the loader existed: checked and applied by the binding)
        pending = loader.bind(self.driver, self)
        self._loader_config = loader.order.config()
        self.driver.bound = True
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
        checks.instance(model, "model", torch.nn.Module, "a DDP model")
        if self.driver.in_step:
            raise RuntimeError("bal.attach(model) inside a step; attach models between steps, "
                               "before they train")
        if not self.gradient_transport.check_attach(model, has_balancer(model)):
            return  # (one process: no all-reduce to weigh)
        single = single_sample_layers(self.hooks.inner(model))
        if single and not self._single and self._lower_given != 1:
            if self._lower_given == 0:  # no split may hand a rank exactly one sample from now on
                self._single = True
                self.board.configure(self.accumulate, self.context.lower, single_ok=False)
                self.board.post(self.loop.refuse_single())
            else:
                raise ValueError(
                    f"bal.attach: the model's layers refuse a one-sample batch in training "
                    f"({layer_list(single)}), which the Balancer may hand a rank "
                    f"(lower={int(self.context.lower.min())}): make the Balancer with lower=2 (its "
                    f"default for such a model), or lower=0, or lower=1 if their inputs have more "
                    f"than one value per channel")
        self.gradient_transport.attach(model)

    @property
    def transport(self) -> str:
        """:attr:`route`, under the name of the argument that asks for it."""
        return self.route

    # ------------------------------------------------------------------ sizes

    @property
    def batch_sizes(self) -> np.ndarray:
        """int64 ``[world]`` (a NumPy array, a fresh copy): sizes of the step in progress, else of
        the oldest batch handed out and not trained yet (the next step's), else of the step that
        a ``with bal.step():`` block (or its accumulation window) has just ended, else of the
        next step to be drawn (without the Balancer's loader:
        of the next step, to draw its batch by); under a size-aware rule
        (:class:`hetlb.Chronica`), whose sizes are drawn with each step's samples, of the last
        step (zeros before any). A step that has ended: :attr:`finished` ``.sizes``."""
        return self.driver.batch_sizes()

    @property
    def span(self) -> Tuple[int, int]:
        """``(start, stop)``: this rank's positions in the global batch of the step whose sizes
        :attr:`batch_sizes` gives (``start = sum(batch_sizes[:rank])``), for a loop that reads
        its own data sequentially (docs/quickstart.md, "A loop that reads its own data")."""
        return self.driver.span()

    @property
    def finished(self) -> Optional[FinishedStep]:
        """The newest step (accumulation window) whose telemetry arrived: its step, epoch, sizes,
        every rank's logged loss and the step's global mean loss
        (:class:`hetlb.train.losses.FinishedStep`); None before one. A CPU model's step arrives
        when it ends, a CUDA model's one step later; with ``exchange_every > 1`` a block's steps
        arrive at its exchange (docs/balancer.md, "The logged loss")."""
        return self.driver.finished

    def log_loss(self, loss: Any) -> None:
        """Send this rank's loss of the step in progress (the mean over its samples: a tensor of
        one element, or a number; with accumulation each micro-step's, undivided) with the step's
        telemetry, for :attr:`finished` ``.loss``: no collective, no wait for a device. Call it
        between the forward and the backward: ``RuntimeError`` outside a step or after the
        backward (the row has been sent), ``ValueError`` for a tensor of several elements."""
        self.driver.log_loss(loss)

    @property
    def last_overhead(self) -> float:
        """Seconds the Balancer itself spent in the latest step (row, table check, record,
        decision), excluding the user's forward and backward."""
        return self.driver.last_overhead

    @property
    def runlog(self) -> Optional[RunLog]:
        """The run log (rank 0 with ``log_dir``; None after :meth:`close`)."""
        return self.driver.runlog

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
        return self.driver.steps

    @property
    def synced(self) -> bool:
        """Whether the latest ``bal.step()`` ended an accumulation window (its gradient is
        complete: step the optimizer). Always True without accumulation."""
        return self.driver.synced

    # ------------------------------------------------------------------ the step

    @contextlib.contextmanager
    def step(self) -> Iterator["Balancer"]:
        """Wrap one forward+backward (one micro-step with accumulation): times the compute, sets
        this step's weights, and on exit verifies the table and decides the next sizes. With
        ``accumulate > 1`` it enters ``ddp.no_sync()`` on all but the last micro-step of a
        window."""
        with self.driver.step(self) as owner:
            yield owner

    def micro_steps(self, fn: Any, *batch: Any, reduce: str = "last") -> torch.Tensor:
        """This rank's batch of the step as micro-steps of at most ``micro_batch`` samples (or a
        ``recompute=`` rank's recomputing limit; docs/balancer.md, "Micro-steps"): ``fn(*chunk)``
        returns the mean loss over a chunk of ``batch`` (sliced along the first dimension), the
        Balancer runs its weighted backward; every rank calls it every step. The step reduces in
        the last micro-step's backward, or with ``reduce="after"`` in an empty one after them
        (FSDP2 on Gloo: docs/fsdp2.md, "Micro-steps"). Returns this rank's mean loss."""
        return self.driver.micro_steps(fn, batch, reduce)

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
        self.driver.backward(loss, gradient, **kwargs)

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
        self.driver.flush()

    def close(self) -> None:
        """Flush and close the run log (see ``log_dir``) and stop the watchdog's heartbeat;
        training may not continue logging after it. With one process the steps since the last
        telemetry exchange (``exchange_every > 1``) are recorded first (:meth:`flush`, which
        needs no other rank then); with more, call :meth:`flush` on every rank before it to have
        them in the log (a warning names how many are left out otherwise)."""
        self.driver.close()
        if self.watchdog is not None:
            self.watchdog.close()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> Dict[str, Any]:
        """Policy state, decision, telemetry history and data position: tensors and plain Python
        values, loadable with ``torch.load``'s default ``weights_only=True``.

        A batch handed out but not trained yet is not counted: it is handed out again on resume
        (so a checkpoint at the top of the loop body loses nothing). Takes no collective, so
        one rank may save alone.
        """
        if self.driver.in_with:
            raise RuntimeError("state_dict() inside `with bal.step():`; call it between steps")
        return {"format": _FORMAT, "world": self.world, "global_batch": self.global_batch,
                "accumulate": self.accumulate, "steps": self.driver.steps,
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
        # No loader yet: its order is checked against the checkpoint's when it is bound.
        self.board.keep_order(None if self._loader_config is not None else
                              {"loader": state.get("loader"), "position": position})
        self.driver.reset(steps)
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
