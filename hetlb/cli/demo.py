"""``hetlb demo``: balanced training of a real model on real data on an emulated paper cluster.

The launcher starts one process per worker of the scenario through torch's elastic launcher
(Gloo on CPU, no torchrun needed). Every rank is a real DDP worker whose compute is stretched to
its scenario worker's time (:meth:`hetlb.sim.Scenario.emulator`). The same small network is trained
on scikit-learn's handwritten digits (shipped inside scikit-learn) once per policy, from the
same initial weights and through the same global sample order, so every policy sees the same
samples in every step and only the split across ranks differs. Because hetlb weights each rank's
gradient by its share, the *global* training loss (summed over all ranks, divided by the global
batch) follows the same curve under every policy; only the time it takes differs.
"""
from __future__ import annotations

import datetime
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np


__all__ = ["DemoResult", "run_demo", "ideal_speedup", "DEFAULT_POLICIES"]

log = logging.getLogger(__name__)

DEFAULT_POLICIES = ("uniform", "lbb", "lbbsp", "wlbs", "dbs")
#: The demo refuses scenarios with more workers than this (each is a process on this machine).
MAX_WORKERS = 8


@dataclass
class DemoResult:
    """Per policy: ``epoch_time`` (s per epoch), ``step_time`` (rank 0's wall seconds per step),
    ``sizes`` (per step, per rank), ``se`` (per step), ``loss`` (global training loss per step),
    ``accuracy`` (held-out, per epoch), ``wall`` (seconds since the run's start at each epoch end)."""

    cluster: str
    world: int
    global_batch: int
    ideal: float
    runs: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    epochs: int = 0

    def rows(self) -> List[Dict[str, Any]]:
        """One summary per policy (what the table prints)."""
        base = self.runs.get("uniform")
        out = []
        for name, r in self.runs.items():
            last = float(r["epoch_time"][-1])
            row = {"policy": name, "epoch_time": float(np.mean(r["epoch_time"])), "last_epoch_time": last,
                   "speedup": (float(base["epoch_time"][-1]) / last) if base is not None else None,
                   "ideal": self.ideal, "mean_se": float(np.mean(r["se"])),
                   "accuracy": float(r["accuracy"][-1]), "final_loss": float(r["loss"][-1]),
                   "loss_rel_diff": None}
            if base is not None:
                a, b = np.asarray(r["loss"]), np.asarray(base["loss"])
                n = min(a.size, b.size)
                row["loss_rel_diff"] = float(np.max(np.abs(a[:n] - b[:n]) / np.abs(b[:n])))
            out.append(row)
        return out


def ideal_speedup(scenario: Any) -> float:
    """The emulated cluster's best possible speed-up over the equal split: the equal split's
    step over the best integer split's (LBB's exact solver on the true models)."""
    from hetlb.sim import compare_splits
    models = [w.time_model.as_piecewise(scenario.global_batch) for w in scenario.workers]
    uni, best, _ = compare_splits(models, scenario.global_batch, lower=scenario.lower)
    return uni.step / best.step


def _digits(global_batch: int):
    import torch
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    n_train = (int(0.8 * len(x)) // global_batch) * global_batch  # whole steps only
    if n_train == 0:
        raise ValueError(f"global batch {global_batch} exceeds the digits training set "
                         f"({int(0.8 * len(x))} samples); use a scenario with a smaller batch")
    train = torch.utils.data.TensorDataset(x[:n_train], y[:n_train])
    return train, (x[n_train:], y[n_train:])


def _worker(cfg: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """One rank of the demo (run by the elastic agent with the rendezvous in the environment)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hetlb
    from hetlb.sim import load_scenario, make_policy
    from hetlb.core.telemetry import straggler_effect

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        sc = load_scenario(cfg["scenario"])
        gb = sc.global_batch
        train, (xt, yt) = _digits(gb)
        runs: Dict[str, Dict[str, Any]] = {}
        bar = None
        if rank == 0 and cfg["progress"]:
            from hetlb.core.progress import progress_bar
            bar = progress_bar(total=len(cfg["policies"]) * cfg["epochs"] * (len(train) // gb), unit="step",
                               desc="hetlb demo", leave=False, disable=None)
        for name in cfg["policies"]:
            torch.manual_seed(0)  # the same initial weights for every policy and rank
            net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
            ddp = DDP(net)
            bal = hetlb.Balancer(ddp, gb, policy=make_policy(name),
                                 emulator=sc.emulator(rank, spin=0.0005))
            loader = bal.loader(train, seed=1)  # the same global order for every policy
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
            r: Dict[str, Any] = {"epoch_time": [], "step_time": [], "accuracy": [], "wall": []}
            loss_sums: List[float] = []
            start = time.perf_counter()
            for epoch in range(cfg["epochs"]):
                loader.set_epoch(epoch)
                t0 = prev = time.perf_counter()
                for x, y in loader:
                    out = ddp(x)
                    # mean over this rank's samples; the Balancer weights it by the rank's share
                    loss = torch.nn.functional.cross_entropy(out, y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    loss_sums.append(float(loss.detach()) * len(x))
                    now = time.perf_counter()
                    r["step_time"].append(now - prev)
                    prev = now
                    if bar is not None:
                        bar.update(1)
                r["epoch_time"].append(time.perf_counter() - t0)
                with torch.no_grad():
                    r["accuracy"].append(float((net(xt).argmax(1) == yt).float().mean()))
                r["wall"].append(time.perf_counter() - start)
            # The global loss of every step: each rank's summed loss, added over ranks (one
            # collective at the end, none in the timed loop).
            sums = torch.tensor(loss_sums, dtype=torch.float64)
            dist.all_reduce(sums)
            r["loss"] = (sums / gb).tolist()
            r["sizes"] = [rec.batch.tolist() for rec in bal.history]
            r["se"] = [straggler_effect(rec.compute, rec.batch) for rec in bal.history]
            runs[name] = r
            del bal, loader, ddp
        if bar is not None:
            bar.close()
        return runs if rank == 0 else None
    finally:
        dist.destroy_process_group()


def run_demo(cluster: str = "abs-sgd-1234", policies: Sequence[str] = DEFAULT_POLICIES,
             epochs: int = 4, progress: bool = True, min_steps: int = 40) -> DemoResult:
    """Run the demo: one process per scenario worker through torch's elastic launcher.

    Args:
        cluster: a built-in scenario name or a scenario file whose events are ``disturb`` only.
        policies: policy names (:data:`hetlb.sim.POLICY_NAMES`); ``uniform`` is the baseline.
        epochs: passes over the digits training set per policy, raised until every policy
            runs at least ``min_steps`` steps (a large global batch makes short epochs).
        progress: a progress bar on rank 0.
        min_steps: see ``epochs`` (a warning says when it raises them; 0 never does).
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from hetlb.sim import POLICY_NAMES, load_scenario, unknown_policies
    sc = load_scenario(cluster)
    if sc.world > MAX_WORKERS:
        raise ValueError(f"scenario {cluster!r} has {sc.world} workers; the demo runs each as a "
                         f"process on this machine (at most {MAX_WORKERS}). Try `hetlb simulate "
                         f"{cluster}` instead")
    sc.emulator(0)  # refuses simulator-only events before anything is spawned
    bad = unknown_policies(list(policies))
    if bad or not policies:
        raise ValueError(f"unknown policies {bad or list(policies)}; expected some of {', '.join(POLICY_NAMES)}")
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if min_steps < 0:
        raise ValueError(f"min_steps must be >= 0, got {min_steps}")
    train, _ = _digits(sc.global_batch)  # fails early (scikit-learn missing, batch too large)
    per_epoch = len(train) // sc.global_batch
    needed = -(-int(min_steps) // per_epoch)
    if needed > epochs:
        log.warning("epochs raised from %d to %d so that every policy runs at least %d steps (%d per "
                    "epoch at global batch %d); min_steps=0 (--min-steps 0) keeps %d", epochs, needed,
                    min_steps, per_epoch, sc.global_batch, epochs)
    epochs = max(int(epochs), needed)
    cfg = {"scenario": sc.to_dict(), "policies": [p.strip().lower() for p in policies],
           "epochs": int(epochs), "progress": progress}
    lc = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=sc.world, run_id=f"hetlb-demo-{uuid.uuid4().hex[:8]}",
                      rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                      monitor_interval=0.5, start_method="spawn")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = elastic_launch(lc, _worker)(cfg)
    return DemoResult(cluster=sc.name or str(cluster), world=sc.world, global_batch=sc.global_batch,
                      ideal=ideal_speedup(sc), runs=out[0], epochs=epochs)


def plot_demo(res: DemoResult, path: str) -> None:
    """Step time per step, batch sizes per rank (first balancing policy), accuracy against wall time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, r in res.runs.items():
        axes[0].plot(np.asarray(r["step_time"]) * 1e3, label=name, lw=1)
        axes[2].plot(r["wall"], np.asarray(r["accuracy"]) * 100, marker="o", label=name)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("step time (ms)")
    axes[0].legend()
    bal = next((n for n in res.runs if n != "uniform"), next(iter(res.runs)))
    sizes = np.asarray(res.runs[bal]["sizes"])
    for k in range(sizes.shape[1]):
        axes[1].plot(sizes[:, k], label=f"rank {k}")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel(f"batch size ({bal})")
    axes[1].legend()
    axes[2].set_xlabel("wall time (s)")
    axes[2].set_ylabel("held-out accuracy (%)")
    axes[2].legend()
    fig.suptitle(f"hetlb demo: {res.cluster}, {res.world} ranks, global batch {res.global_batch}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
