"""One entry point for every way hetlb synchronises workers: :func:`train`.

The modes side by side (docs/modes.md, "Choosing a mode", says more):

=========== ======================= =============================== ==============================
mode        consistency             speed                           heterogeneity it tolerates
=========== ======================= =============================== ==============================
``bsp``     exact large-batch SGD   every step waits for the        static and slowly changing
            (same math as one       slowest rank; a balancing       speeds (the policy re-sizes
            process)                policy makes them finish         batches every step / epoch)
                                    together
``delayed`` one-step-stale          no rank idles: the all-reduce   fast-changing speeds and slow
            gradients, delay-       overlaps the next compute       links (ABS-SGD)
            compensated
``lsp``     the first ``l`` ranks   fast ranks sync among           a few slow or failing ranks;
            sync; all every ``m``   themselves; all wait only       a dead worker is dropped and
            syncs (parameter        every ``m`` syncs               its share moved (WLBS)
            server)
``ssp``     gradients at most ``s`` no barrier; a rank waits only   transient stragglers
            iterations stale        when ``s`` ahead of the slowest
``asp``     unbounded staleness     never waits                     anything, at the price of
                                                                    stale updates
``localsgd`` models averaged every  ``period``-times fewer          slow links; not speed
            ``period`` steps        all-reduces                     differences (torch's post-
            (torch's post-local                                     local SGD)
            SGD)
``fl``      FedAvg: clients' models one average per round of       clients of different speeds
            averaged after ``tau``  ``tau`` local steps; B tuned    with their own (non-i.i.d.)
            local steps             so clients finish together      data (LB-BSP's FL mode)
=========== ======================= =============================== ==============================
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist

from hetlb.core.checks import choice, integer
from hetlb.sim.emulate import Emulator


__all__ = ["train", "TRAIN_MODES"]

TRAIN_MODES = ("bsp", "delayed", "lsp", "ssp", "asp", "localsgd", "fl")

Optim = Callable[[Any], torch.optim.Optimizer]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def train(mode: str, model: torch.nn.Module, dataset: Any, loss_fn: Callable, *, global_batch: int,
          epochs: int = 1, optimizer: Optional[Optim] = None, policy: Any = None,
          emulator: Optional[Emulator] = None, seed: int = 0, collate_fn: Optional[Callable] = None,
          **options: Any) -> Dict[str, Any]:
    """Train ``model`` on ``dataset`` in ``mode`` (call on every rank, e.g. under torchrun).

    Args:
        mode: one of :data:`TRAIN_MODES` (see the module docstring's table).
        model: the model (plain ``nn.Module``; wrapped in DDP here where the mode needs it).
        dataset: map-style dataset of ``(input, target)``; every rank holds the same one.
        loss_fn: ``loss_fn(output, target)``, the mean over the batch.
        global_batch: samples per step over all ranks (``bsp``, ``lsp``/``ssp``/``asp``: the
            policy's total; ``delayed``: ``global_batch // world`` is the reference batch;
            ``localsgd``: ``global_batch // world`` per rank and step; ``fl``: the mean client
            batch is ``global_batch // world``).
        epochs: passes over the dataset.
        optimizer: ``optimizer(params) -> torch.optim.Optimizer`` (default SGD, lr 0.1).
        policy: the balancing policy (``bsp``: default :class:`hetlb.policies.LBB`;
            parameter-server modes: default WLBS for ``lsp``, equal split otherwise).
        emulator: emulated heterogeneity of this rank.
        seed: seed of the sample order.
        collate_fn: builds a batch ``(input, target)`` from a list of samples, in every mode
            (default: torch's ``default_collate``).
        options: passed on: ``bsp`` to :class:`hetlb.Balancer`, ``delayed`` to
            :class:`hetlb.DelayedSync`, the parameter-server modes to
            :func:`hetlb.sync.ps.run_ps` (``l``, ``m``, ``staleness``, ``timeout``, ...),
            ``localsgd`` to :func:`hetlb.sync.local.local_sgd` (``period``, default 4;
            ``warmup_steps``), ``fl`` to :class:`hetlb.sync.fl.Federated` (``local_steps``,
            default 20; ``tune``, ``average``, ...) plus ``indices``: this client's samples
            (default: a ``1/world`` i.i.d. shard). ``fl`` runs the same number of rounds on
            every client (each round's average needs all of them): enough for ``epochs`` passes
            over the *largest* client's data at the mean batch ``global_batch // world``, rounded
            up to whole rounds. A smaller client (or one whose tuned batch is above the mean)
            makes more passes over its own data than ``epochs``.

    ``bsp``, ``delayed``, ``localsgd`` and ``fl`` need a process group
    (:func:`hetlb.init_process_group`); the parameter-server modes initialise
    ``torch.distributed.rpc`` themselves (rank 0 serves).

    Returns:
        ``{"mode", "model", "seconds", "updates"}`` plus the mode's object: ``"balancer"``,
        ``"delayed"``, ``"server"`` (rank 0) or ``"worker"``, ``"optimizer"`` (``localsgd``: the
        ``PostLocalSGDOptimizer``), ``"federated"``. ``localsgd``'s model is averaged once more
        after the last step, so every rank returns the same parameters (its batches come from
        torch's ``DistributedSampler``, which pads an epoch to a multiple of the world size by
        repeating samples, as in plain DDP).
    """
    mode = choice(mode, "train: mode", TRAIN_MODES)
    global_batch = integer(global_batch, "train: global_batch", 1)
    epochs = integer(epochs, "train: epochs", 1)
    make = optimizer or _sgd
    if not callable(make):
        raise ValueError(f"train: optimizer must be a callable params -> torch.optim.Optimizer, "
                         f"got {optimizer!r}")
    if collate_fn is not None and not callable(collate_fn):
        raise ValueError(f"train: collate_fn must be callable, got {collate_fn!r}")
    loader_kw = {} if collate_fn is None else {"collate_fn": collate_fn}
    t0 = time.perf_counter()
    if mode in ("lsp", "ssp", "asp"):
        from hetlb.sync.ps import run_ps
        if policy is not None:
            options["policy"] = policy
        out = run_ps(mode, model, dataset, loss_fn, optimizer=make, global_batch=global_batch,
                     epochs=epochs, emulator=emulator, seed=seed, **loader_kw, **options)
        updates = out["server"].version if "server" in out else len(out["worker"].iterations)
        return {"mode": mode, "model": model, "seconds": time.perf_counter() - t0,
                "updates": updates, **out}
    if not dist.is_initialized():
        raise RuntimeError(f"train(mode={mode!r}) needs a process group: call "
                           f"hetlb.init_process_group(...) first (under torchrun)")
    if mode == "bsp":
        from hetlb.train.balancer import Balancer
        from hetlb.policies import LBB
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        bal = Balancer(ddp, global_batch, policy=policy if policy is not None else LBB(),
                       emulator=emulator, **options)
        loader = bal.loader(dataset, seed=seed, **loader_kw)
        opt = make(ddp.parameters())
        updates = 0
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for x, y in loader:
                with bal.step():
                    loss_fn(ddp(x), y).backward()
                opt.step()
                opt.zero_grad()
                updates += 1
        return {"mode": mode, "model": model, "seconds": time.perf_counter() - t0,
                "updates": updates, "balancer": bal}
    if mode == "localsgd":
        from hetlb.sync.local import local_sgd
        world, rank = dist.get_world_size(), dist.get_rank()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        period = options.pop("period", 4)
        opt = local_sgd(ddp, make(ddp.parameters()), period, **options)
        sampler = torch.utils.data.DistributedSampler(dataset, world, rank, seed=seed)
        loader = torch.utils.data.DataLoader(dataset, batch_size=max(global_batch // world, 1),
                                             sampler=sampler, **loader_kw)
        updates = 0
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                start = time.perf_counter()
                loss_fn(ddp(x), y).backward()
                if emulator is not None:
                    emulator.stretch(updates, len(x), start)
                opt.step()
                opt.zero_grad()
                updates += 1
        # The steps after the last periodic average left each rank its own parameters: one more
        # average, so every rank returns the same model.
        from torch.distributed.algorithms.model_averaging.utils import average_parameters
        average_parameters(model.parameters(), dist.group.WORLD)
        return {"mode": mode, "model": model, "seconds": time.perf_counter() - t0,
                "updates": updates, "optimizer": opt}
    if mode == "fl":
        import math

        from hetlb.sync.fl import Federated
        world, rank = dist.get_world_size(), dist.get_rank()
        indices = options.pop("indices", None)
        if indices is None:
            order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))
            indices = order[rank::world].tolist()
        local_steps = options.pop("local_steps", 20)
        batch = max(global_batch // world, 1)
        fed = Federated(model, make(model.parameters()), local_steps, batch, emulator=emulator,
                        **options)
        loader = fed.loader(dataset, indices, seed=seed, **loader_kw)
        # Every client runs the same number of rounds (the all-reduce needs all of them): the
        # largest client's data, `epochs` times over, at the mean batch.
        mine = torch.tensor([len(indices)], dtype=torch.int64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        rounds = max(1, math.ceil(epochs * int(mine) / (batch * local_steps)))
        for x, y in loader:
            loss_fn(model(x), y).backward()
            if fed.step() and fed.round >= rounds:
                break
        return {"mode": mode, "model": model, "seconds": time.perf_counter() - t0,
                "updates": fed.steps, "federated": fed}
    # delayed
    from hetlb.sync.delayed import DelayedSync
    world = dist.get_world_size()
    ref = max(global_batch // world, 1)
    opt = make(model.parameters())
    ds = DelayedSync(model, opt, ref, emulator=emulator, **options)
    loader = ds.loader(dataset, seed=seed, **loader_kw)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            loss_fn(model(x), y).backward()
            ds.step()
    ds.flush()
    return {"mode": mode, "model": model, "seconds": time.perf_counter() - t0,
            "updates": ds.updates, "delayed": ds}
