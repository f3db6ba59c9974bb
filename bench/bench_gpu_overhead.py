"""hetlb's cost on one GPU with real compute: Balancer(Uniform) + its loader against plain DDP +
DistributedSampler, the same model, data and optimizer, in one NCCL process group of one rank.

One rank makes the all-reduce trivial, so what is left of the difference is hetlb's own work per
step on a CUDA model: the gate, the plan, the weighted hook (PREMUL_SUM on NCCL), the CUDA events of
the compute column, the telemetry table's side all-reduce on its Gloo group. Variants run in
rounds of ``--steps`` steps each, in an order rotated every round, with one synchronize at the end
of a round (a training loop does not synchronize every step); the figure is the median of the
per-round times, and each variant's ratio to ``plain`` is quoted with its min-max over rounds.
``plain#2`` is a second copy of plain (an A/A comparison: the noise floor); ``hooked`` is
``defer_hook=False``; ``NAME/K`` adds ``exchange_every=K``; ``NAME@hostclock`` (a diagnostic)
times steps on the host, without the CUDA events whose one-step-late read waits for the previous
step's end; ``NAME@lagN`` reads them N steps late (``StepTelemetry.set_clock_lag``), so the host
may run N steps ahead of the device.

    python bench/bench_gpu_overhead.py                    # on a CUDA machine (NCCL)
    python bench/bench_gpu_overhead.py --device cpu       # the same on CPU (Gloo), a dry run
    python bench/bench_gpu_overhead.py --trace $OUT       # also where each variant's host time goes
    python bench/bench_gpu_overhead.py --workers 2        # batches collated in loader processes
    python bench/bench_gpu_overhead.py --interleave step  # one step of each in turn, synchronised
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_overhead import MODELS, endless, make_model  # noqa: E402  (the same models)


def setup(variant: str, model: str, batch: int, device: torch.device, n_batches: int, workers: int = 0):
    import hetlb
    from torch.nn.parallel import DistributedDataParallel as DDP
    base = variant.partition("#")[0]
    inp, _, out = MODELS[model]
    n = batch * n_batches
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(n, inp, generator=g), torch.randint(0, out, (n,), generator=g))
    net = make_model(model).to(device)
    ddp = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    pin = device.type == "cuda"
    # workers > 0: batches are collated in DataLoader processes, so the main thread only runs the
    # step (as a tuned training script does) and can run ahead of the GPU
    lkw = dict(num_workers=workers, persistent_workers=True) if workers else {}
    if base == "plain":
        sampler = torch.utils.data.distributed.DistributedSampler(ds, seed=1)
        loader = torch.utils.data.DataLoader(ds, batch_size=batch, sampler=sampler, pin_memory=pin, **lkw)
        return ddp, opt, endless(loader, sampler), None
    base, _, flag = base.partition("@")
    base, _, every = base.partition("/")  # "default/16": the telemetry of 16 steps per exchange
    kw = {"defer_hook": False} if base == "hooked" else {}
    if every:
        kw["exchange_every"] = int(every)
    import hetlb.train.balancer as balancer_module
    device_of = balancer_module.model_device
    if flag == "hostclock":  # (diagnostic) host timing: no CUDA events, no wait for the last step's end
        balancer_module.model_device = lambda m: torch.device("cpu")
    try:
        bal = hetlb.Balancer(ddp, batch, policy=hetlb.Uniform(), **kw)
    finally:
        balancer_module.model_device = device_of
    if flag.startswith("lag"):  # (diagnostic) device times read N steps late: the host runs N ahead
        bal.telemetry.set_clock_lag(int(flag[3:]))
    loader = bal.loader(ds, seed=1, pin_memory=pin, **lkw)
    return ddp, opt, endless(loader), bal


def run_steps(run: tuple, steps: int, device: torch.device) -> None:
    ddp, opt, it, _ = run
    for _ in range(steps):
        x, y = next(it)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()


def trace(runs: dict, model: str, device: torch.device, out: str, steps: int = 30) -> None:
    """Each variant's ``steps`` steps under torch.profiler: the top host-side operators (a
    device synchronisation shows as cudaEventSynchronize / cudaStreamSynchronize) and a Chrome
    trace ``out/{model}_{variant}.json.gz`` per variant."""
    from torch.profiler import ProfilerActivity, profile
    os.makedirs(out, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for v, run in runs.items():
        run_steps(run, 5, device)
        with profile(activities=acts) as prof:
            run_steps(run, steps, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
        name = re.sub(r"[^A-Za-z0-9._-]", "_", v)  # (file names the device tool brings back)
        prof.export_chrome_trace(os.path.join(out, f"{model}_{name}.json.gz"))
        print(f"\n{model} {v}: {steps} steps under torch.profiler, by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))


def interleaved(runs: dict, model: str, batch: int, device: torch.device, args, sync) -> None:
    """One step of each variant in turn (the order rotated every step), each between two device
    synchronisations: neighbouring steps see the same machine, so the per-step ratios are not
    disturbed by the drifts that move whole rounds. The synchronisations stop the host from
    running ahead, so what is measured is each step's full cost with nothing hidden: the wall
    time, and the host time (until the step's calls return, the device still busy)."""
    order = list(runs)
    for v in order:
        run_steps(runs[v], args.warmup, device)
    wall = {v: [] for v in order}
    host = {v: [] for v in order}
    for i in range(args.rounds * args.steps):
        k = i % len(order)
        for v in order[k:] + order[:k]:
            sync()
            t0 = time.perf_counter()
            run_steps(runs[v], 1, device)
            t1 = time.perf_counter()
            sync()
            wall[v].append(time.perf_counter() - t0)
            host[v].append(t1 - t0)
    params = sum(q.numel() for q in runs["plain"][0].parameters())
    print(f"\n{model} ({params / 1e6:.1f} M parameters, batch {batch}), {args.rounds * args.steps} steps "
          f"interleaved, each between synchronisations, {args.workers} loader workers:")
    print("| variant | wall ms/step (median) | wall ratio to plain: median of per-step ratios (IQR) "
          "| host ms/step (median) | host ms added (median of per-step differences) |")
    print("|---|---:|---|---:|---:|")
    for v in order:
        r = np.array(wall[v]) / np.array(wall["plain"])
        d = np.array(host[v]) - np.array(host["plain"])
        q1, q3 = np.percentile(r, [25, 75])
        print(f"| {v} | {np.median(wall[v]) * 1e3:.3f} | {np.median(r):.4f} ({q1:.3f}-{q3:.3f}) | "
              f"{np.median(host[v]) * 1e3:.3f} | {np.median(d) * 1e3:+.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--model", nargs="+", choices=sorted(MODELS), default=["mlp", "big"])
    p.add_argument("--variants", nargs="+", default=["plain", "plain#2", "default"])
    p.add_argument("--batch", type=int, nargs="+", default=None, help="per model (default: mlp 128, big 512)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--interleave", choices=["round", "step"], default="round",
                   help="round: --steps steps of a variant at a time, the host free to run ahead; "
                        "step: one step of each in turn, each between synchronisations (the full cost, nothing hidden)")
    p.add_argument("--workers", type=int, default=0,
                   help="DataLoader worker processes per variant (0: batches collated on the main thread)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="then profile 30 steps (at most --steps) of each variant (torch.profiler): top operators, "
                        "Chrome traces in DIR")
    args = p.parse_args()
    import torch.distributed as dist
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tmp = tempfile.mkdtemp()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp}/store",
                            rank=0, world_size=1)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}")
    batches = args.batch or [128 if m == "mlp" else 512 for m in args.model]
    for model, batch in zip(args.model, batches):
        runs = {v: setup(v, model, batch, device, 64, args.workers) for v in args.variants}
        for v, (_, _, _, bal) in runs.items():
            if bal is not None:
                print(f"{model} {v}: transport {bal.transport!r}")
        if args.interleave == "step":
            interleaved(runs, model, batch, device, args, sync)
            del runs
            continue
        per_round = {v: [] for v in args.variants}
        order = list(args.variants)
        for r in range(args.rounds + 1):  # round 0 is the warm-up
            k = r % len(order)
            for v in order[k:] + order[:k]:
                ddp, opt, it, _ = runs[v]
                steps = args.warmup if r == 0 else args.steps
                sync()
                t = time.perf_counter()
                run_steps(runs[v], steps, device)
                sync()
                if r:
                    per_round[v].append((time.perf_counter() - t) / steps)
        base = per_round["plain"]
        params = sum(q.numel() for q in runs["plain"][0].parameters())
        print(f"\n{model} ({params / 1e6:.1f} M parameters, batch {batch}), {args.rounds} rounds x {args.steps} steps, "
              f"{args.workers} loader workers:")
        print(f"| variant | ms/step (median) | ratio to plain (median, min-max over rounds) |")
        print(f"|---|---|---|")
        for v in args.variants:
            ratios = [a / b for a, b in zip(per_round[v], base)]
            print(f"| {v} | {statistics.median(per_round[v]) * 1e3:.3f} | "
                  f"{statistics.median(ratios):.4f} ({min(ratios):.3f}-{max(ratios):.3f}) |")
        for v, (_, _, _, bal) in runs.items():
            if bal is not None:
                h = bal.history
                print(f"{v}: {bal.steps} steps, compute column median "
                      f"{float(np.median(h.column('compute'))) * 1e3:.3f} ms")
        if args.trace:
            trace(runs, model, device, args.trace, steps=min(30, args.steps))
        del runs
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
