"""LB-BSP's cross-silo FL evaluation (LB-BSP section 5.5, Fig. 13) on a small offline task:
standard FedAvg against LB-BSP's FL mode, side by side in one run.

5 clients (5 real Gloo processes, :class:`hetlb.sync.fl.Federated`), emulated at the relative
speeds of the paper's EC2 mix (m4.4xlarge, c4.2xlarge, c5.2xlarge, c4.xlarge, c5.xlarge ->
about 1, 0.8, 0.7, 0.45, 0.4; an :class:`hetlb.sim.emulate.Emulator` per client stretches each local
step to ``(A0 + A1 * B) / speed`` seconds: 8.5 ms for 32 samples at speed 1), train an MLP
(64-64-10) on scikit-learn's handwritten digits (LeNet-5 on CIFAR-10 is not available offline).
The data is bench_abs.py's: the 80 % training split with four one-pixel shifts of every image
(7185 samples), the held-out 20 % (360 images) as test set. The split is the paper's worst case:
each client holds exactly two classes (:func:`hetlb.sync.fl.classes_split`); ``--split
dirichlet`` uses a Dirichlet label split instead.

Both methods use identical ``tau`` (local steps per round), ``B`` (batch; with LB-BSP the mean
batch, the total ``5 * B`` kept) and ``eta`` (plain SGD), the same initial model, the same client
data and shuffling seeds:

* ``fedavg``: ``tune=False``, every client ``B`` samples per local step (the paper's baseline);
* ``lbbsp``: ``tune=True``, each client's ``B_i`` from the EMA (alpha 0.2) of its speed.

Rank 0 evaluates the averaged model after every round; the evaluation (and the barrier that
holds the other clients until it is done) is left out of the clock. Reported per method: the
median seconds per round, the fastest client's share of a round spent waiting (the paper: "over
one third" under FedAvg), the best accuracy reached in ``--rounds`` rounds and the seconds to
it, the seconds to a common target (the lower of the two best accuracies, so both methods reach
it) and the rounds it took, the speed-up there, the last round's batches.

    python bench/bench_fl.py [--rounds 200] [--tau 20] [--batch 32] [--lr 0.1] [--seed 0] [--repeats 1]
                             [--split classes|dirichlet] [--alpha 0.5] [--out F] [--json F]
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any, Dict, List

import numpy as np

from report import digits as _digits, emit, on_gloo_ranks

SPEEDS = (1.0, 0.8, 0.7, 0.45, 0.4)  # LB-BSP 5.5's EC2 mix, relative
A0, A1 = 0.0005, 0.00025  # seconds per local step: A0 + A1 * B at speed 1 (8.5 ms for 32)
METHODS = ("fedavg", "lbbsp")
SMOOTH = 10  # rounds in the moving mean of the smoothed target
PAPER_SPEEDUP = 0.27  # LeNet-5, Fig. 13: "a speedup of over 27 percent", accuracy 0.42 as FedAvg


def _net():
    import torch
    torch.manual_seed(0)  # the same initial model for both methods and every client
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _run(rank: int, world: int, method: str, rounds: int, tau: int, batch: int, lr: float,
         split: str, alpha: float, seed: int) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import hetlb
    from hetlb.sim.emulate import Emulator
    from hetlb.sync.fl import Federated, classes_split, dirichlet_split
    train, (xt, yt) = _digits()
    labels = train.tensors[1].numpy()
    parts = classes_split(labels, world, 2, seed=seed) if split == "classes" else \
        dirichlet_split(labels, world, alpha, seed=seed)
    net = _net()
    emu = Emulator(model=hetlb.LinearModel(A0, A1), speed=SPEEDS[rank], rank=rank, spin=0.0005)
    fl = Federated(net, torch.optim.SGD(net.parameters(), lr=lr), tau, batch, tune=method == "lbbsp",
                   emulator=emu)
    curve: List[List[float]] = []  # (seconds, accuracy) per round, rank 0
    excluded = 0.0
    dist.barrier()
    start = time.perf_counter()
    for x, y in fl.loader(train, parts[rank], seed=seed + 1):
        F.cross_entropy(net(x), y).backward()
        if not fl.step():
            continue
        t = time.perf_counter()
        if rank == 0:
            with torch.no_grad():
                acc = float((net(xt).argmax(1) == yt).float().mean())
            curve.append([t - start - excluded, acc])
        dist.barrier()  # nobody starts the next round before the evaluation is done
        excluded += time.perf_counter() - t
        if fl.round == rounds:
            break
    hist = list(fl.history)
    return {"curve": curve, "batch": [h.batch.tolist() for h in hist],
            "compute": [h.compute.tolist() for h in hist], "wait": [h.wait.tolist() for h in hist],
            "classes": [sorted(set(labels[p].tolist())) for p in parts], "sizes": [len(p) for p in parts]}


def _worker(rank: int, world: int, methods: List[str], rounds: int, tau: int, batch: int, lr: float,
            split: str, alpha: float, seed: int, repeats: int) -> Dict[str, List[Dict[str, Any]]]:
    import torch.distributed as dist
    res: Dict[str, List[Dict[str, Any]]] = {m: [] for m in methods}
    for rep in range(repeats):
        for m in (methods if rep % 2 == 0 else methods[::-1]):  # alternate the order
            dist.barrier()
            res[m].append(_run(rank, world, m, rounds, tau, batch, lr, split, alpha, seed))
    return res


def first_round(curve: List[List[float]], target: float, smooth: int = 1) -> int:
    """Index of the first round at which the mean accuracy of the last ``smooth`` rounds
    reaches ``target`` (-1 if none)."""
    acc = np.array([a for _, a in curve])
    for i in range(smooth - 1, len(acc)):
        if acc[i + 1 - smooth:i + 1].mean() >= target - 1e-12:
            return i
    return -1


def best_mean(curve: List[List[float]], smooth: int) -> float:
    acc = np.array([a for _, a in curve])
    return float(np.convolve(acc, np.ones(smooth) / smooth, mode="valid").max())


def summarise(res: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """One repeat (``res[method]`` = one run): per-method figures; the common targets are the
    lower of the methods' best accuracy (raw, and of a :data:`SMOOTH`-round moving mean)."""
    best = {m: max(a for _, a in r["curve"]) for m, r in res.items()}
    target = min(best.values())
    smooth_target = min(best_mean(r["curve"], SMOOTH) for r in res.values())
    out = {}
    for m, r in res.items():
        c = np.array(r["curve"])
        per_round = np.diff(np.concatenate([[0.0], c[:, 0]]))
        comp, wait = np.array(r["compute"]), np.array(r["wait"])
        fastest = int(np.argmax(SPEEDS))
        share = wait[1:, fastest] / (comp[1:, fastest] + wait[1:, fastest])  # round 0 is equal for both
        i_best, i_t, i_s = (first_round(r["curve"], best[m]), first_round(r["curve"], target),
                            first_round(r["curve"], smooth_target, SMOOTH))
        out[m] = {"round_s": float(np.median(per_round)), "total_s": float(c[-1, 0]),
                  "best": best[m], "to_best_s": float(c[i_best, 0]),
                  "target": target, "to_target_s": float(c[i_t, 0]), "to_target_rounds": i_t + 1,
                  "smooth_target": smooth_target, "to_smooth_s": float(c[i_s, 0]), "to_smooth_rounds": i_s + 1,
                  "last10": float(c[-10:, 1].mean()), "fastest_wait": float(np.median(share)),
                  "last_batch": r["batch"][-1]}
    return out


def table(res: Dict[str, List[Dict[str, Any]]], args: argparse.Namespace) -> List[str]:
    methods = list(res)
    reps = [summarise({m: res[m][k] for m in methods}) for k in range(len(res[methods[0]]))]
    lines = ["| repeat | method | s per round (median) | fastest client waiting | best accuracy | s to best | "
             "common target (lower best) | s to it | rounds to it | common target, 10-round mean | "
             "s to it | rounds to it | mean accuracy, last 10 rounds | batches, last round |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for k, s in enumerate(reps):
        for m in methods:
            r = s[m]
            lines.append(f"| {k} | {m} | {r['round_s']:.3f} | {r['fastest_wait']:.0%} | {r['best']:.3f} | "
                         f"{r['to_best_s']:.1f} | {r['target']:.3f} | {r['to_target_s']:.1f} | "
                         f"{r['to_target_rounds']} | {r['smooth_target']:.3f} | {r['to_smooth_s']:.1f} | "
                         f"{r['to_smooth_rounds']} | {r['last10']:.3f} | {r['last_batch']} |")
    if "fedavg" in methods and "lbbsp" in methods:
        def gain(key: str) -> List[float]:
            return [1 - s["lbbsp"][key] / s["fedavg"][key] for s in reps]

        def show(v: List[float], pct: bool = True) -> str:
            f = (lambda x: f"{x:.1%}") if pct else (lambda x: f"{100 * x:+.1f}")
            return f(float(np.median(v))) + (f" (runs: {', '.join(f(x) for x in v)})" if len(v) > 1 else "")

        acc = [s["lbbsp"]["best"] - s["fedavg"]["best"] for s in reps]
        lines += ["", f"LB-BSP FL mode against FedAvg, median over {len(reps)} repeat(s): "
                  f"{show(gain('round_s'))} less time per round; {show(gain('to_best_s'))} less time to its own "
                  f"best accuracy; {show(gain('to_target_s'))} less time to the common target; "
                  f"{show(gain('to_smooth_s'))} less time to the common 10-round-mean target; best accuracy "
                  f"{show(acc, pct=False)} points. Paper (LeNet-5, Fig. 13): over {PAPER_SPEEDUP:.0%} faster, "
                  f"same accuracy."]
    first = res[methods[0]][0]
    lines += ["", f"{args.rounds} rounds, tau={args.tau}, B={args.batch}, eta={args.lr}, seed={args.seed}, "
              f"split={args.split}" + (f" (alpha {args.alpha})" if args.split == "dirichlet" else "")
              + f"; client classes {first['classes']}, sizes {first['sizes']}; speeds {list(SPEEDS)}."]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--tau", type=int, default=20, help="local steps per round")
    p.add_argument("--batch", type=int, default=32, help="B (FedAvg's per-client batch; LB-BSP's mean)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0, help="seed of the split and of the clients' shuffling")
    p.add_argument("--split", choices=("classes", "dirichlet"), default="classes")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration (--split dirichlet)")
    p.add_argument("--repeats", type=int, default=1, help="run the methods this many times (order alternating)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--out", default=None, help="also write the table here")
    p.add_argument("--json", default=None, help="write the raw curves and histories here")
    args = p.parse_args()
    res = on_gloo_ranks(_worker, len(SPEEDS), args.methods, args.rounds, args.tau, args.batch, args.lr,
                        args.split, args.alpha, args.seed, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": res}, f)
    emit(table(res, args), args.out)


if __name__ == "__main__":
    main()
