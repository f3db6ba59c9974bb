"""ABS-SGD's Table 1 on a real small task: time to a target test accuracy, five methods side by side.

4 real Gloo ranks train an MLP (64-64-10) on scikit-learn's handwritten digits with plain SGD, the
paper's hyper-parameters where they carry over (per-worker batch 32 for the baselines, i.e. a
global batch of 128; reference batch 32 and lam 0.5 for DelayedSync; the same learning rate and
the same number of updates for every method):

* ``bsp``: DDP with the equal split (hetlb's ``Uniform``), the paper's BSP-SGD;
* ``dbs``: DBS, sizes re-split per epoch by the previous epoch's speeds (the paper's DBS-SGD);
* ``lbb``, ``lbbsp``: hetlb's per-step balancing policies (LBB, LB-BSP);
* ``delayed``: :class:`hetlb.DelayedSync` (ABS-SGD);
* ``delayed-scaled``: the same with ``scale_lr=True`` (hetlb's opt-in, not the paper's): the
  summed gradient over the nominal batch (``4 * 32``), i.e. the learning rate scaled by the
  iteration's batch over the nominal one;
* ``lsp``, ``ssp``, ``asp``: :mod:`hetlb.sync.ps` on ``torch.distributed.rpc`` (a server process
  and the same 4 emulated workers; each exchange with the server costs the link's seconds):
  WLBS's limited synchronous parallel (l = 2 of 4 per limited synchronisation, a global one every
  m = 3, WLBS sizing the batches from the equal split of 128), SSP with ABS-SGD's bound s = 10
  and ASP (each worker 32 samples per iteration). An update there is one synchronisation (LSP) or
  one worker's push (SSP, ASP), so these run for the same number of *samples* as the others
  (``updates * 128``, rounded up to whole epochs); the server keeps the parameters after every
  update and the curve is evaluated afterwards (so evaluation is off the clock here too);
* ``localsgd``: torch's post-local SGD (:func:`hetlb.sync.local.local_sgd`: DDP with the
  post-localSGD hook and no warm-up, so no gradient all-reduce, and a model average every
  ``LOCAL_PERIOD`` = 4 steps; per-worker batch 32, the link paid at each average);
* ``fedavg``, ``fl``: :class:`hetlb.sync.fl.Federated` on the same i.i.d. shards (each rank a
  quarter of the training set), ``FL_TAU`` = 8 local steps of batch 32 per round, one model
  average per round (the link paid there): standard FedAvg (``tune=False``) and LB-BSP's FL
  mode (``tune=True``: each client's batch from an EMA of its speed, the learning rate kept).
  An "update" of these three is one local step (the table's batch per update is per worker), and
  rank 0's model is evaluated after each average.

Emulated hardware (an :class:`hetlb.sim.emulate.Emulator` per rank, the same for every method): a
worker's compute for ``b`` samples takes ``(A0 + A1 * b) / speed`` seconds (15 ms for 32 samples
at speed 1, about a ResNet18 CIFAR batch on the paper's RTX 2080Ti); ABS-SGD's three clusters:
``static`` iteration times 1:2:3:4, ``dynamic`` every step (reference batch) prolonged by a
random 0-50 %, ``both``. The link: each all-reduce's result arrives ``--link`` seconds after the
collective completed (DDP's bucket for the baselines, DelayedSync's flat buffer; the model is
one bucket, so for the baselines nothing of it overlaps the backward pass). ``pcie``: 15 ms,
about the paper's ResNet18 all-reduce over PCIe 3.0 x8; ``10gbe``: 60 ms, the same over 10 Gb/s
Ethernet between nodes.

The training set is digits' 80 % split with four one-pixel shifts of every image (7185 samples,
so an epoch is 56 baseline steps rather than 11); the test set is the held-out 20 % (360
original images). Rank 0 evaluates after every update; evaluation time is left out of the clock.
Reported: seconds to the target accuracy (the first update at which the mean of the last 10
evaluations reaches it: one evaluation swings by a few points at this learning rate), the
speed-up of DelayedSync (the paper's) over each method, final accuracy (mean of the last 20
evaluations), mean batch per update, seconds per update, and for DelayedSync the share of the
all-reduce hidden behind computation.

    python bench/bench_abs.py [--updates 300] [--target 0.8] [--links pcie 10gbe]
                              [--plot bench/abs_convergence.png] [--out F]
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List

import numpy as np

from report import digits as _digits, emit, on_gloo_ranks, on_rpc_ranks

SETTINGS = {"static": ((1.0, 1 / 2, 1 / 3, 1 / 4), False), "dynamic": ((1.0, 1.0, 1.0, 1.0), True),
            "both": ((1.0, 1 / 2, 1 / 3, 1 / 4), True)}
LINKS = {"pcie": 0.015, "10gbe": 0.060}
METHODS = ("bsp", "dbs", "lbb", "lbbsp", "delayed", "delayed-scaled", "lsp", "ssp", "asp",
           "localsgd", "fedavg", "fl")
PS_METHODS = ("lsp", "ssp", "asp")
LOCAL_PERIOD, FL_TAU = 4, 8
SMOOTH = 10  # evaluations in the moving average the target is read from
PER_WORKER, REF = 32, 32
A0, A1 = 0.005, 0.010 / 32  # 15 ms for 32 samples at speed 1
# ABS-SGD, BSP, DBS, ASP, SSP (s = 10) seconds to 80 %
PAPER = {"static": (450, 636, 577, 900, 890), "dynamic": (105, 123, 120, 265, 254),
         "both": (535, 798, 795, 916, 966)}


def _emulator(rank: int, setting: str, link: float, nbytes: int):
    import hetlb
    from hetlb.sim.emulate import Emulator
    speeds, dynamic = SETTINGS[setting]
    # ABS-SGD's dynamic heterogeneity, "prolong by a random 0-50 %": x (1 + 0.5 v), v ~ U(0, 1),
    # written as the emulator's mean-preserving noise around 1.25: 1.25 (1 + 0.2 u), u ~ U(-1, 1).
    speed, noise = (speeds[rank] / 1.25, 0.2) if dynamic else (speeds[rank], 0.0)
    return Emulator(model=hetlb.LinearModel(A0, A1), speed=speed, noise=noise, bandwidth=nbytes / link,
                    seed=11, rank=rank, spin=0.0005)


def _net():
    import torch
    torch.manual_seed(0)  # the same initial weights for every method and rank
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _run(rank: int, world: int, setting: str, link: float, method: str, updates: int, lr: float) -> Dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hetlb
    from hetlb.sim import make_policy
    train, (xt, yt) = _digits()
    net = _net()
    nbytes = sum(p.numel() for p in net.parameters()) * 4
    emu = _emulator(rank, setting, link, nbytes)
    curve: List[List[float]] = []  # (seconds, accuracy) per update, rank 0
    excluded = 0.0

    def record(start: float) -> None:
        nonlocal excluded
        if rank != 0:
            return
        t = time.perf_counter()
        with torch.no_grad():
            acc = float((net(xt).argmax(1) == yt).float().mean())
        curve.append([t - start - excluded, acc])
        excluded += time.perf_counter() - t

    out: Dict[str, Any] = {}
    if method.startswith("delayed"):
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        ds = hetlb.DelayedSync(net, opt, REF, lam=0.5, emulator=emu, scale_lr=method == "delayed-scaled")
        loader = ds.loader(train, seed=1)
        epoch, start = 0, time.perf_counter()
        while ds.updates < updates:
            loader.set_epoch(epoch)
            for x, y in loader:
                F.cross_entropy(net(x), y).backward()
                if ds.step():
                    record(start)
                    if ds.updates >= updates:
                        break
            epoch += 1
        hist = list(ds.history)[:updates]
        ds.flush()  # every rank has the same all-reduce in flight; none may be left at exit
        out["batch"] = [int(r.batch.sum()) for r in hist]
        out["sizes"] = [r.batch.tolist() for r in hist]
        settled = [r for r in hist[5:] if np.all(r.batch > 0) and np.all(np.isfinite(r.link))]
        link_s = np.array([r.link for r in settled])
        wait = np.array([r.wait for r in settled])
        out["hidden"] = float(np.median(1.0 - wait / np.maximum(link_s, 1e-12))) if settled else float("nan")
    elif method == "localsgd":
        from hetlb.sync.local import local_sgd
        ddp = DDP(net)
        opt = local_sgd(ddp, torch.optim.SGD(ddp.parameters(), lr=lr), period=LOCAL_PERIOD)
        sampler = torch.utils.data.DistributedSampler(train, world, rank, seed=1)
        loader = torch.utils.data.DataLoader(train, batch_size=PER_WORKER, sampler=sampler,
                                             drop_last=True)
        step, epoch, start = 0, 0, time.perf_counter()
        while step < updates:
            sampler.set_epoch(epoch)
            for x, y in loader:
                t0 = time.perf_counter()
                F.cross_entropy(ddp(x), y).backward()
                emu.stretch(step, len(x), t0)
                opt.step()  # averages after steps 1, 1 + period, ... (torch's counter)
                opt.zero_grad()
                step += 1
                if (step - 1) % LOCAL_PERIOD == 0:
                    emu.sleep_comm(nbytes)  # the average's all-reduce on the emulated link
                    record(start)
                if step >= updates:
                    break
            epoch += 1
        out["batch"] = [PER_WORKER] * updates
        del opt, ddp
    elif method in ("fedavg", "fl"):
        from hetlb.sync.fl import Federated
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        fed = Federated(net, opt, FL_TAU, PER_WORKER, tune=method == "fl", emulator=emu)
        shard = torch.randperm(len(train), generator=torch.Generator().manual_seed(1))[rank::world]
        batches = iter(fed.loader(train, shard.tolist(), seed=1))
        step, start = 0, time.perf_counter()
        while step < updates:
            x, y = next(batches)
            F.cross_entropy(net(x), y).backward()
            step += 1
            if fed.step():
                emu.sleep_comm(nbytes)
                record(start)
        out["batch"] = [int(r.batch.mean()) for r in fed.history for _ in range(FL_TAU)]
        out["sizes"] = [r.batch.tolist() for r in fed.history]
    else:
        ddp = DDP(net)
        policy = make_policy("uniform" if method == "bsp" else method)
        bal = hetlb.Balancer(ddp, world * PER_WORKER, policy=policy, emulator=emu)
        loader = bal.loader(train, seed=1)
        opt = torch.optim.SGD(ddp.parameters(), lr=lr)
        step, epoch, start = 0, 0, time.perf_counter()
        while step < updates:
            loader.set_epoch(epoch)
            for x, y in loader:
                F.cross_entropy(ddp(x), y).backward()
                opt.step()
                opt.zero_grad()
                step += 1
                record(start)
                if step >= updates:
                    break
            epoch += 1
        out["batch"] = [int(r.batch.sum()) for r in list(bal.history)[:updates]]
        out["sizes"] = [r.batch.tolist() for r in list(bal.history)[:updates]]
        del bal, loader, ddp
    out["curve"] = curve
    return out


def _ps_run(rank: int, world: int, init: str, setting: str, link: float, methods: List[str],
            updates: int, lr: float) -> Dict[str, Any]:
    """The parameter-server methods: rank 0 serves, ranks 1..4 are the emulated workers."""
    import math

    import torch
    import torch.nn.functional as F

    from hetlb.sync.ps import run_ps
    train, (xt, yt) = _digits()
    workers = world - 1
    res: Dict[str, Any] = {}
    for i, method in enumerate(methods):
        net = _net()
        nbytes = sum(p.numel() for p in net.parameters()) * 4
        emu = None if rank == 0 else _emulator(rank - 1, setting, link, nbytes)
        epochs = math.ceil(updates * workers * PER_WORKER / len(train))
        opts = {"lsp": {"l": 2, "m": 3}, "ssp": {"staleness": 10}, "asp": {}}[method]
        # A fresh rendezvous per method (the FileStore of one init cannot be reused).
        out = run_ps(method, net, train, F.cross_entropy, global_batch=workers * PER_WORKER,
                     epochs=epochs, rank=rank, world_size=world, init_method=f"{init}.{i}",
                     emulator=emu, link=link, snapshot_every=1, seed=1,
                     optimizer=lambda params: torch.optim.SGD(params, lr=lr), **opts)
        if rank != 0:
            continue
        server = out["server"]
        curve = []
        probe = _net()
        params = [p for p in probe.parameters()]
        for _, t, flat in server.snapshots:
            torch.nn.utils.vector_to_parameters(flat, params)
            with torch.no_grad():
                curve.append([t, float((probe(xt).argmax(1) == yt).float().mean())])
        syncs = [e for e in server.log if e["kind"] == "sync"]
        res[method] = {"curve": curve, "batch": [e["batch"] for e in syncs],
                       "sizes": [e["sizes"] for e in server.log if e["kind"] in ("start", "sizes")],
                       "stale": float(np.mean([s for e in syncs for s in e["stale"]]))}
    return res


def _worker(rank: int, world: int, setting: str, link: float, methods: List[str], updates: int,
            lr: float) -> Dict[str, Any]:
    import torch.distributed as dist
    res = {}
    for m in methods:
        dist.barrier()
        res[m] = _run(rank, world, setting, link, m, updates, lr)
    return res


def time_to(curve: List[List[float]], target: float) -> float:
    """Seconds of the first evaluation at which the mean of the last :data:`SMOOTH` reaches
    ``target`` (inf if none)."""
    acc = np.array([a for _, a in curve])
    for i in range(SMOOTH - 1, len(curve)):
        if acc[i + 1 - SMOOTH:i + 1].mean() >= target:
            return curve[i][0]
    return float("inf")


def table(results: Dict[str, Dict[str, Dict[str, Any]]], target: float) -> List[str]:
    lines = [f"| link | cluster | method | s to {target:.0%} | speed-up over BSP | DelayedSync (paper's) "
             "speed-up over it | final accuracy | batch per update | s per update | all-reduce hidden |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for key, runs in results.items():
        link, setting = key.split("/")
        ours = time_to(runs["delayed"]["curve"], target) if "delayed" in runs else float("nan")
        bsp = time_to(runs["bsp"]["curve"], target) if "bsp" in runs else float("nan")
        for m, r in runs.items():
            t = time_to(r["curve"], target)
            # The last 20 evaluations; the methods evaluated once per average (localsgd,
            # fedavg, fl) have a few dozen: their last eighth.
            k = 20 if len(r["curve"]) >= 100 else max(3, len(r["curve"]) // 8)
            acc = float(np.mean([a for _, a in r["curve"][-k:]]))
            per = r["curve"][-1][0] / len(r["batch"])
            hidden = f"{r['hidden']:.2f}" if "hidden" in r else \
                (f"(staleness {r['stale']:.1f})" if "stale" in r else "-")
            lines.append(f"| {link} | {setting} | {m} | {t:.1f} | {bsp / t:.2f}x | {t / ours:.2f}x | {acc:.3f} | "
                         f"{np.mean(r['batch']):.0f} | {per * 1e3:.0f} ms | {hidden} |")
    lines += ["", "Paper (ABS-SGD Table 1, ResNet18 on CIFAR10 to 80 %, seconds): "
              + "; ".join(f"{s}: ABS-SGD {a}, BSP {b} ({b / a:.2f}x), DBS {d} ({d / a:.2f}x), "
                          f"ASP {x} ({x / a:.2f}x), SSP {y} ({y / a:.2f}x)"
                          for s, (a, b, d, x, y) in PAPER.items())]
    return lines


def plot(results: Dict[str, Dict[str, Dict[str, Any]]], target: float, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = list(results)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for m, r in results[key].items():
            c = np.array(r["curve"])
            smooth = np.convolve(c[:, 1], np.ones(SMOOTH) / SMOOTH, mode="valid")
            ax.plot(c[SMOOTH - 1:, 0], smooth * 100, lw=1.4 if m.startswith("delayed") else 0.9, label=m)
        ax.axhline(target * 100, color="grey", lw=0.6, ls="--")
        ax.set_title(key)
        ax.set_xlabel("seconds")
        ax.set_ylim(50, 100)
    axes[0][0].set_ylabel(f"test accuracy (%, mean of {SMOOTH} evaluations)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("ABS-SGD's clusters on digits: DelayedSync against BSP, DBS, LBB, LB-BSP")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--updates", type=int, default=300)
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--links", nargs="+", default=list(LINKS), choices=list(LINKS))
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--plot", default=None, help="write the accuracy curves to this PNG")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results: Dict[str, Dict[str, Dict[str, Any]]] = {}
    from tqdm import tqdm
    todo = [(lk, s) for lk in args.links for s in args.settings]
    ddp_methods = [m for m in args.methods if m not in PS_METHODS]
    ps_methods = [m for m in args.methods if m in PS_METHODS]
    for lk, s in tqdm(todo, desc="clusters", disable=None):
        res = on_gloo_ranks(_worker, 4, s, LINKS[lk], ddp_methods, args.updates, args.lr) if ddp_methods else {}
        if ps_methods:
            res.update(on_rpc_ranks(_ps_run, 5, s, LINKS[lk], ps_methods, args.updates, args.lr))
        results[f"{lk}/{s}"] = res
    emit(table(results, args.target), args.out)
    if args.plot:
        plot(results, args.target, args.plot)


if __name__ == "__main__":
    main()
