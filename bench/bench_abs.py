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
  iteration's batch over the nominal one.

Emulated hardware (an :class:`hetlb.emulate.Emulator` per rank, the same for every method): a
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

from report import emit, on_gloo_ranks

SETTINGS = {"static": ((1.0, 1 / 2, 1 / 3, 1 / 4), False), "dynamic": ((1.0, 1.0, 1.0, 1.0), True),
            "both": ((1.0, 1 / 2, 1 / 3, 1 / 4), True)}
LINKS = {"pcie": 0.015, "10gbe": 0.060}
METHODS = ("bsp", "dbs", "lbb", "lbbsp", "delayed", "delayed-scaled")
SMOOTH = 10  # evaluations in the moving average the target is read from
PER_WORKER, REF = 32, 32
A0, A1 = 0.005, 0.010 / 32  # 15 ms for 32 samples at speed 1
PAPER = {"static": (450, 636, 577), "dynamic": (105, 123, 120), "both": (535, 798, 795)}


def _digits():
    import torch
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32).view(-1, 8, 8)
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    n = int(0.8 * len(x))
    train = [x[:n]]
    for dy, dx in ((0, 1), (0, -1), (1, 0), (-1, 0)):
        s = torch.roll(x[:n], (dy, dx), (1, 2))
        if dx:
            s[:, :, 0 if dx > 0 else -1] = 0  # what rolled in from the other edge
        if dy:
            s[:, 0 if dy > 0 else -1, :] = 0
        train.append(s)
    xs = torch.cat(train).reshape(-1, 64)
    return torch.utils.data.TensorDataset(xs, y[:n].repeat(len(train))), (x[n:].reshape(-1, 64), y[n:])


def _emulator(rank: int, setting: str, link: float, nbytes: int):
    import hetlb
    from hetlb.emulate import Emulator
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
            acc = float(np.mean([a for _, a in r["curve"][-20:]]))
            per = r["curve"][-1][0] / len(r["curve"])
            hidden = f"{r['hidden']:.2f}" if "hidden" in r else "-"
            lines.append(f"| {link} | {setting} | {m} | {t:.1f} | {bsp / t:.2f}x | {t / ours:.2f}x | {acc:.3f} | "
                         f"{np.mean(r['batch']):.0f} | {per * 1e3:.0f} ms | {hidden} |")
    lines += ["", "Paper (ABS-SGD Table 1, ResNet18 on CIFAR10 to 80 %, seconds): "
              + "; ".join(f"{s}: ABS-SGD {a}, BSP {b} ({b / a:.2f}x), DBS {d} ({d / a:.2f}x)"
                          for s, (a, b, d) in PAPER.items())]
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
    for lk, s in tqdm(todo, desc="clusters", disable=None):
        results[f"{lk}/{s}"] = on_gloo_ranks(_worker, 4, s, LINKS[lk], args.methods, args.updates, args.lr)
    emit(table(results, args.target), args.out)
    if args.plot:
        plot(results, args.target, args.plot)


if __name__ == "__main__":
    main()
