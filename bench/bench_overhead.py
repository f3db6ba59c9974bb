"""hetlb's cost on a homogeneous cluster with real compute: Balancer(Uniform) + its loader against
plain DDP + DistributedSampler, the same model, data and optimizer, side by side.

Each rank is one Gloo process with one thread; each round runs every variant for ``--steps`` steps
(the first ``--warmup`` not counted) in a rotated order, so slow drifts of a shared machine hit
every variant alike; the per-step wall time of a variant in a round is the median over its steps
(rank 0's loop). Reported: each variant's ratio to plain DDP per round, and the median and spread
(min..max) over rounds.

Models: ``mlp`` (512-1024-1024-10, 1.6 M parameters, DDP's last bucket ~2 MB) and ``wide``
(6144-1024-10, 6.3 M parameters: the last bucket is the full 25 MB); ``tiny`` (one 8-10 linear
layer: the passes over gradients vanish, so what is left is the per-step work, e.g. hetlb's Python,
best counted with ``--instructions --world 1``). Variants: ``plain`` (DDP),
``torchhook`` (DDP with torch's own ``allreduce_hook``: what any communication hook costs, since
DDP then copies gradients into buckets without averaging and the hook averages in a pass of its
own), ``side`` (the table in its own small all-reduce), ``carry`` (hetlb's default on CPU: the
table in the last bucket); ``side+backward`` and ``carry+backward`` call ``bal.backward(loss)``
instead of ``loss.backward()`` (the weight rides in the loss, the hook makes no pass). ``--bucket-view`` builds every DDP with ``gradient_as_bucket_view=True``
(no copy into buckets; plain DDP then averages in place, a pass as hetlb's weighting is). With
``--hetlb-path`` the hetlb package is imported from there (an older checkout, for before/after
figures; that version's API is used as it was).

    python bench/bench_overhead.py [--model mlp wide] [--rounds 9] [--steps 120] [--out FILE]

``--interleave step`` builds every variant side by side in one process group and runs one step of
each in turn (the order rotated every step), so each variant's step is compared with plain DDP's
step of the same turn: drifts of the machine slower than a step (other tenants, frequency) cancel,
which round-level interleaving leaves in. A round is then a block of ``--steps`` consecutive turns;
reported is the median over rounds of each round's median per-turn ratio, with min and max. (The
variants share the caches: every step starts after another model's, alike for all.)

``side@first`` and ``side+backward@first`` issue the side route's table before the last
bucket's all-reduce, as hetlb did before session 12 (now: once that all-reduce is done).
``NAME@psutil`` reads the memory probe through ``psutil.virtual_memory()``, as hetlb did before
session 21 (now: ``/proc/meminfo`` read directly on Linux).

``default`` (and ``default+backward``, ``default/K``...) passes no ``transport=``: the Balancer's
own choice ("side" with the hook deferred, as here: Uniform's equal batches need none; else
"carry", or "side" under ``--bucket-view``, where DDP would copy carry's bucket back). Nor does
it pass ``exchange_every``: since session 27 a Balancer running Uniform (a policy that reads no
telemetry) exchanges in adaptive blocks of up to 16 steps by default, where before it exchanged
every step; ``default/1`` is that per-step exchange (the papers' policies' default).
``NAME@hooked`` passes ``defer_hook=False``: the weighted hook registered at once, as every
hetlb variant ran before session 22 (``default@hooked`` is that session's default: "carry").
``NAME@lbb`` runs the Balancer's default policy, ``LBB()``, instead of ``Uniform()``: on a
homogeneous cluster its fine-tune reacts to timing noise, and the first uneven split registers
the hook for good. ``NAME@lbbK`` runs ``LBB(confirm=K)`` (a rapid-tune only after K records in
a row with SE >= RT).

``exchange`` and ``floor`` are plain DDP plus the least a per-step telemetry exchange costs,
written directly in torch (see :func:`floor_variant`): the floor under hetlb's design, which
exchanges a table every step (the papers decide every step), whatever its bookkeeping costs.

A variant ``NAME/K`` (e.g. ``carry/16``, ``side+backward/16``) is hetlb's ``NAME`` with
``Balancer(exchange_every=K)``: the telemetry of K steps in one exchange (the papers decide every
step, ``/1``). ``NAME/Ka`` adds ``adaptive_exchange=True`` (blocks grow from 1 to K
while the sizes hold still; with the Uniform policy here they reach K after a few exchanges).

A variant named ``NAME#2`` (any suffix after ``#``) is a second copy of ``NAME``: ``plain#2``
beside ``plain`` is an A/A comparison, the resolution of the run. In step-interleaved mode a
second table splits every variant's step into its phases (the loader's next batch, forward,
backward, the optimizer's step), as medians and as what each adds to plain DDP's.

By default a turn starts with the variant's next batch, which ends its previous step: that
step's table exchange (or the floor's) then finished during the other variants' steps, so the
wall time a step waits for it is not seen (session 28: 1-2 ms a table on this machine).
``--next-last`` ends each turn with the next batch instead, so the wait falls in the variant's own
turn, as in a training loop.

``--rebuild`` (with ``--interleave step``) builds every variant afresh at each round's start, in
an order rotated by the round, and discards each round's first ``--warmup`` steps: identical
copies of plain DDP built once differ by up to 2.5 % in a run (session 28's A/A/A), by where
their tensors happen to lie; rebuilt, that placement changes every round, so the median over
rounds no longer carries one variant's luck.

``--parts`` (with ``--interleave step`` and one hetlb variant) also times, on rank 0, each part
of hetlb's step boundary inside the harness: the loader's whole ``next`` (``_Iteration.__next__``),
the previous step's end (``Balancer._before_next``), the next step's start (``Balancer._handed``)
and the parts ``bench_cold.py --parts`` times, by wrappers around those methods (a few hundred
nanoseconds each), so the *next batch* phase's excess over plain DDP can be split where it occurs.

The CPU table's last column counts the main thread's minor page faults a step. The variants of
a step-interleaved run share one process heap, and with glibc's dynamic thresholds a gradient
freshly allocated each step (``zero_grad`` sets it to None) is sometimes served by memory the heap
just returned to the system, so its pages fault in again: 6144 faults for ``wide``'s 25 MB weight,
about 5-10 ms of main-thread CPU. Which variant the heap's layout hits is luck (session 27: a
hetlb variant got 1600-2500 faults a step on average where plain DDP got 100-460, by the order
the variants ran; one model per process saw none for either). ``--steady-heap`` fixes glibc's
thresholds in the ranks so no variant is re-faulted.

``--latency`` times one small all-reduce (the telemetry row: 9 float64) between the ranks, back
to back and right after a burst of compute, on the default group and on a second Gloo group: what
any collective beyond DDP's own buckets costs on the machine.

``--instructions`` measures the work instead of the time, which a noisy machine cannot disturb:
every run has both ranks under valgrind's callgrind (every thread counted, Gloo's included), twice
(``--steps`` and 4 steps), and the difference is the instructions of the extra steps. What a
variant adds to plain DDP does not depend on the batch, so variants run at a tiny batch (cheap
under valgrind) and plain DDP once more at the real batch gives the step to compare with.

    python bench/bench_overhead.py --instructions [--model mlp] [--steps 12]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import torch

from report import emit
import torch.distributed as dist
import torch.multiprocessing as mp

MODELS = {"mlp": (512, [1024, 1024], 10), "wide": (6144, [1024], 10), "tiny": (8, [], 10),
          "big": (1024, [4096] * 6, 1000)}  # (92 M parameters: bench_gpu_overhead.py's GPU model)


def make_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    inp, hidden, out = MODELS[name]
    layers, d = [], inp
    for h in hidden:
        layers += [torch.nn.Linear(d, h), torch.nn.ReLU()]
        d = h
    layers.append(torch.nn.Linear(d, out))
    return torch.nn.Sequential(*layers)


def setup_variant(variant: str, model_name: str, args: argparse.Namespace, world: int, steps: int):
    """(DDP model, optimizer, loader, Balancer or None, backward function) of one variant, on a
    dataset of ``steps`` global batches."""
    import hetlb
    from torch.nn.parallel import DistributedDataParallel as DDP
    variant = variant.partition("#")[0]  # "plain#2": a second copy (an A/A comparison)
    variant, _, flag = variant.partition("@")
    variant, _, every = variant.partition("/")
    inp = MODELS[model_name][0]
    n = args.global_batch * steps
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(n, inp, generator=g), torch.randint(0, 10, (n,), generator=g))
    ddp = DDP(make_model(model_name), gradient_as_bucket_view=args.bucket_view)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    new_api = hasattr(hetlb, "DataLoader")
    if variant == "torchhook":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        ddp.register_comm_hook(None, allreduce_hook)
    if variant in ("plain", "torchhook", "floor", "exchange"):
        sampler = torch.utils.data.distributed.DistributedSampler(ds, seed=1)
        loader = torch.utils.data.DataLoader(ds, batch_size=args.global_batch // world, sampler=sampler)
        bal = None
        if variant in ("floor", "exchange"):
            return floor_variant(variant, ddp, opt, loader)
    else:
        transport = variant.partition("+")[0]  # "default": the Balancer's own choice
        kw = {"transport": transport} if new_api and transport != "default" else {}
        if every:  # "16", or "16a": adaptive blocks up to 16
            kw["exchange_every"] = int(every.rstrip("a"))
            kw["adaptive_exchange"] = every.endswith("a")
        if flag == "hooked":  # the weighted hook registered at once (before session 22)
            kw["defer_hook"] = False
        # "@lbb": the Balancer's default policy (LBB, paper settings) instead of Uniform;
        # "@lbbK": LBB(confirm=K)
        if flag.startswith("lbb"):
            policy = hetlb.LBB(confirm=int(flag[3:])) if flag[3:] else hetlb.LBB()
        else:
            policy = hetlb.Uniform()
        bal = hetlb.Balancer(ddp, args.global_batch, policy=policy, **kw)
        loader = bal.loader(ds, seed=1)
        if flag == "first":  # the side table issued before the last bucket's all-reduce (as before session 12)
            bal.telemetry.core.side_first = True
        if flag == "psutil":  # the memory probe through psutil (as before session 21)
            bal.telemetry.probe._proc = False
        if flag == "nocheck":  # (diagnostic) the forward gate without its batch-size check
            for h in ddp._forward_pre_hooks.values():
                if type(h).__name__ == "StepGate":
                    h.batch_dim = None
        if flag == "nogate":  # (diagnostic, wrong timing) no forward gate at all
            ddp._forward_pre_hooks.clear()
            ddp._forward_pre_hooks_with_kwargs.clear()
    backward = bal.backward if variant.endswith("+backward") else torch.Tensor.backward
    return ddp, opt, loader, bal, backward


FLOOR_NAMES = {"exchange": "DDP + a row all-reduce per step", "floor": "DDP + row all-reduce + no-op hook"}


class _Waited:
    """A loader whose batches wait for the previous step's table exchange first (``floor``)."""

    def __init__(self, loader, pending: list) -> None:
        self.loader, self.sampler, self.pending = loader, loader.sampler, pending

    def __iter__(self):
        for batch in self.loader:
            if self.pending:
                self.pending.pop().wait()
            yield batch


def floor_variant(variant: str, ddp, opt, loader):
    """Plain DDP plus the least any per-step telemetry exchange costs, written as directly as
    torch allows: ``exchange`` all-reduces a 10-float64 row on a second Gloo group after every
    backward (issued from the loop, waited by a Python generator around the loader before the
    next batch, as hetlb's side table is); ``floor`` adds a no-op forward pre-hook on the model
    (what checking a batch costs at the least: the module call's hook path). No record,
    no policy, no plan: the floor under any design that exchanges telemetry every step."""
    import torch.distributed as dist
    side = dist.new_group(backend="gloo")
    row = torch.zeros(10, dtype=torch.float64)
    pending: list = []

    def backward(loss):
        loss.backward()
        pending.append(dist.all_reduce(row, group=side, async_op=True))

    if variant == "floor":
        ddp.register_forward_pre_hook(lambda module, args, kwargs: None, with_kwargs=True)
    return ddp, opt, _Waited(loader, pending), None, backward


def run_variant(variant: str, model_name: str, args: argparse.Namespace, rank: int, world: int) -> float:
    import hetlb
    new_api = hasattr(hetlb, "DataLoader")
    ddp, opt, loader, bal, backward = setup_variant(variant, model_name, args, world, args.steps)
    times, cpu = [], []
    t_prev, c_prev = time.perf_counter(), time.process_time()
    for x, y in loader:
        if bal is not None and not new_api:
            with bal.step():
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
        else:
            backward(torch.nn.functional.cross_entropy(ddp(x), y))
        opt.step()
        opt.zero_grad()
        now, c_now = time.perf_counter(), time.process_time()
        times.append(now - t_prev)
        cpu.append(c_now - c_prev)
        t_prev, c_prev = now, c_now
    return statistics.median(times[args.warmup:]), statistics.median(cpu[args.warmup:])


def endless(loader, sampler=None):
    """Batches of ``loader`` over consecutive epochs (``set_epoch`` as a training script does)."""
    epoch = 0
    while True:
        (sampler or loader).set_epoch(epoch)
        yield from loader
        epoch += 1


def run_interleaved(model_name: str, args: argparse.Namespace, world: int) -> Dict[str, List[tuple]]:
    """Every variant side by side in one process group, one step each in turn (the order rotated
    every step): neighbouring steps of two variants see the same machine, so the ratio of their
    times is not disturbed by drifts slower than a step. Returns each variant's steps as (step,
    next batch, forward, backward, optimizer) times."""
    import hetlb
    if not hasattr(hetlb, "DataLoader"):
        raise SystemExit("--interleave step needs a hetlb whose loader ends steps itself")
    per_epoch = args.epoch_steps or max(args.steps // 4, 8)
    order = list(args.variants)
    times: Dict[str, List[tuple]] = {v: [] for v in args.variants}
    # Built once for the whole run, or with --rebuild afresh each round in a rotated order (the
    # same on every rank: building is collective), so where a variant's tensors land in memory
    # changes from round to round; each build's first --warmup steps are not counted
    builds, steps = (args.rounds, args.steps) if args.rebuild else (1, args.rounds * args.steps)
    import gc
    for r in range(builds):
        runs = _build(order[r % len(order):] + order[:r % len(order)], model_name, args, world, per_epoch)
        got: Dict[str, List[tuple]] = {v: [] for v in order}
        _interleaved_steps(runs, order, args.warmup + steps, args, got)
        for v in order:
            times[v] += got[v][args.warmup:]
        del runs, got
        gc.collect()
    return times


def _build(order: List[str], model_name: str, args: argparse.Namespace, world: int,
           per_epoch: int) -> Dict[str, tuple]:
    """Every variant of ``order``, built in that order: {variant: (ddp, opt, batches, backward)}."""
    runs = {}
    for v in order:
        ddp, opt, loader, bal, backward = setup_variant(v, model_name, args, world, per_epoch)
        sampler = loader.sampler if bal is None else None
        runs[v] = (ddp, opt, endless(loader, sampler), backward)
    return runs


def _interleaved_steps(runs: Dict[str, tuple], order: List[str], total: int,
                       args: argparse.Namespace, times: Dict[str, List[tuple]]) -> None:
    """``total`` turns of one step of every variant (the order rotated every turn), each step's
    phase times appended to ``times[variant]``."""
    # --next-last: each turn ends with the next batch, so a step's end (hetlb's table taken, the
    # floor's exchange waited for) falls in the variant's own turn, not after the others' steps
    held = {v: next(runs[v][2]) for v in order} if args.next_last else {}
    for step in range(total):
        k = step % len(order)
        for v in order[k:] + order[:k]:
            ddp, opt, it, backward = runs[v]
            f = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            c = time.thread_time()
            t = time.perf_counter()
            x, y = held[v] if args.next_last else next(it)
            t1 = time.perf_counter()
            c1 = time.thread_time()
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            t2 = time.perf_counter()
            c2 = time.thread_time()
            backward(loss)
            t3 = time.perf_counter()
            c3 = time.thread_time()
            opt.step()
            opt.zero_grad()
            t4 = time.perf_counter()
            c4 = time.thread_time()
            tn = cn = 0.0  # the step's end and the next batch, at the turn's end (--next-last)
            if args.next_last:
                held[v] = next(it)
                tn, cn = time.perf_counter() - t4, time.thread_time() - c4
            nx, cx = (tn, cn) if args.next_last else (t1 - t, c1 - c)
            f4 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            times[v].append((t4 - t + tn, nx, t2 - t1, t3 - t2, t4 - t3,
                             c4 - c + cn, cx, c2 - c1, c3 - c2, c4 - c3, f4 - f))


@contextlib.contextmanager
def part_timers(on: bool):
    """Wrap the step boundary's methods (see ``--parts``); yields {label: [seconds, ...]}."""
    if not on:
        yield {}
        return
    from bench_cold import _part_targets, method_timers
    from hetlb import balancer, data
    targets = [(data._Iteration, "__next__", "hetlb loader: next(it), the whole step boundary"),
               (balancer.Balancer, "_before_next", "Balancer._before_next (calls _finish)"),
               (balancer.Balancer, "_handed", "Balancer._handed (calls _begin)")] + _part_targets()
    with method_timers(targets) as times:
        yield times


def latency(args: argparse.Namespace) -> Dict[tuple, float]:
    """Median seconds of one all-reduce of a 9-float64 row: back to back and after ~10 ms of
    compute (the threads that carry it have slept), on the default group and a second group."""
    side = dist.new_group(backend="gloo")
    row = torch.zeros(9, dtype=torch.float64)
    x0 = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    out = {}
    for name, group in (("default group", None), ("a second group", side)):
        for after in (False, True):
            ts = []
            for _ in range(args.steps):
                if after:
                    x = x0
                    for _ in range(30):
                        x = torch.tanh(x @ x0)
                t = time.perf_counter()
                dist.all_reduce(row, group=group)
                ts.append(time.perf_counter() - t)
            when = "after compute (skew included)" if after else "back to back"
            out[(name, when)] = statistics.median(ts[args.warmup:])
    return out


def worker(rank: int, world: int, store: str, args: argparse.Namespace, jobs: List[tuple], out: str) -> None:
    if args.hetlb_path:
        sys.path.insert(0, args.hetlb_path)
    import hetlb  # noqa: F401  (before init_process_group)
    torch.set_num_threads(1)
    if args.pin:  # one core per rank (its communication threads inherit it): fewer migrations
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]})
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    results = []
    try:
        if args.latency:
            dist.barrier()
            results.append(latency(args))
        elif args.interleave == "step":
            for model_name in args.model:
                dist.barrier()
                with part_timers(args.parts and rank == 0) as parts:
                    times = run_interleaved(model_name, args, world)
                results.append((model_name, times, parts))
        for model_name, rnd, variant in ([] if args.interleave == "step" or args.latency else jobs):
            dist.barrier()
            results.append((model_name, rnd, variant, run_variant(variant, model_name, args, rank, world)))
    finally:
        import gc
        gc.collect()
        dist.destroy_process_group()
    if rank == 0:
        torch.save(results, out)


def one_run(args: argparse.Namespace) -> None:
    """``--worker``: this process is one rank of one variant (run under valgrind)."""
    if args.hetlb_path:
        sys.path.insert(0, args.hetlb_path)
    import hetlb  # noqa: F401
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=3600))
    args.warmup = min(args.warmup, args.steps - 1)
    run_variant(args.variants[0], args.model[0], args, args.rank, args.world)
    import gc
    gc.collect()
    dist.destroy_process_group()


def count(args: argparse.Namespace, model: str, variant: str, steps: int, global_batch: int) -> float:
    """Instructions of one rank (mean over the ranks) for a run of ``steps`` steps, under callgrind."""
    here = os.path.abspath(__file__)
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for r in range(args.world):
            cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.{r}",
                   f"--separate-threads={'yes' if args.main_thread else 'no'}",
                   sys.executable, here, "--worker", "--rank", str(r), "--store", f"{tmp}/store",
                   "--world", str(args.world), "--model", model, "--variants", variant,
                   "--steps", str(steps), "--global-batch", str(global_batch)]
            if args.hetlb_path:
                cmd += ["--hetlb-path", args.hetlb_path]
            if args.bucket_view:
                cmd.append("--bucket-view")
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        total = 0.0
        for r, pr in enumerate(procs):
            _, err = pr.communicate()
            if pr.returncode != 0:
                raise RuntimeError(f"{model} {variant} rank {r} failed:\n{err[-3000:]}")
            if args.main_thread:  # thread 1's own file (the training loop, the hook, DDP)
                with open(f"{tmp}/cg.{r}-01") as f:
                    total += float(re.search(r"^(?:summary|totals): (\d+)", f.read(), re.M).group(1))
            else:
                total += float(re.search(r"Collected : (\d+)", err).group(1))
    n = total / args.world
    print(f"{model} {variant} batch {global_batch}, {steps} steps: {n:.6g} instructions per rank", flush=True)
    return n


def instructions(args: argparse.Namespace) -> List[str]:
    """Per-step instructions (see the module docstring). What hetlb adds does not depend on the
    batch (its passes scale with the parameters, the rest is per step), so the variants run at a
    small batch where the matrix products are cheap under valgrind, and plain DDP once more at
    the real batch gives the step it is compared with."""
    short, long = 4, args.steps
    small = 4 * args.world
    lines = [f"### Instructions per step (callgrind, {'main thread' if args.main_thread else 'every thread'} of a rank, mean of {args.world} ranks"
             f"{'; gradient_as_bucket_view=True' if args.bucket_view else ''}"
             f"{'; main thread only' if args.main_thread else ''}"
             f"{'; ' + args.label if args.label else ''})", "",
             f"Each variant at global batch {small} ({long} minus {short} steps), so the difference to "
             f"plain DDP is what the variant adds per step; relative to plain DDP's step at global batch "
             f"{args.global_batch}.", "",
             "| model | variant | added per step | plain DDP step at the real batch | added / step |",
             "|---|---|---:|---:|---:|"]
    for m in args.model:
        per = {}
        for v in args.variants:
            per[v] = (count(args, m, v, long, small) - count(args, m, v, short, small)) / (long - short)
        real = (count(args, m, "plain", 10, args.global_batch) - count(args, m, "plain", short, args.global_batch)) / (10 - short)
        for v in args.variants:
            if v == "plain":
                continue
            name = variant_name(v)
            added = per[v] - per["plain"]
            lines.append(f"| {m} | {name} | {added / 1e6:.2f} M | {real / 1e6:.1f} M | {added / real:.4f} |")
    return lines


def interleaved_table(args: argparse.Namespace, res: List[tuple]) -> List[str]:
    """Per round (a block of --steps consecutive steps): the median over its steps of each
    variant's step time over plain DDP's step next to it; median and spread over rounds."""
    lines = [f"### Homogeneous overhead with real compute, step-interleaved{' (' + args.label + ')' if args.label else ''}: "
             f"{args.world} Gloo ranks x 1 thread{', pinned' if args.pin else ''}, global batch {args.global_batch}, "
             f"{'gradient_as_bucket_view=True, ' if args.bucket_view else ''}"
             f"every variant one step in turn{' (each turn ending with its next batch)' if args.next_last else ''}, "
             f"{'every variant built afresh each round, ' if args.rebuild else ''}"
             f"{args.rounds} rounds of {args.steps} steps each "
             f"(first {args.warmup}{' of each round' if args.rebuild else ''} not counted)", "",
             "Ratio: per step, the variant's step time over plain DDP's step of the same turn; per "
             "round the median of those; median, min and max over rounds. Rank 0's loop.", "",
             "| model | variant | step (ms) | ratio: median | min | max | mean of all steps |",
             "|---|---|---:|---:|---:|---:|---:|"]
    phases = ["| model | variant | next batch | forward | backward | optimizer | step |",
              "|---|---|---:|---:|---:|---:|---:|"]
    cpu = ["| model | variant | next batch | forward | backward | optimizer | step | step added / plain's wall step | page faults a step (mean) |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    part_lines: List[str] = []
    for m, times, parts in res:
        if parts:
            part_lines += [f"| {m} | {lab.replace('  ', '&nbsp;&nbsp;')} | {1e6 * statistics.median(v[args.warmup:]):.1f} | "
                           f"{len(v) - args.warmup} |" for lab, v in parts.items() if len(v) > args.warmup]
        plain = [s[0] for s in times["plain"]]
        base = [statistics.median(s[i] for s in times["plain"]) for i in range(5)]
        lines.append(f"| {m} | plain DDP | {1e3 * statistics.median(plain):.2f} | 1 | | | |")
        for v in args.variants:
            med = [statistics.median(s[i] for s in times[v]) for i in range(5)]
            cells = [f"{1e3 * med[i]:.2f}" if v == "plain" else f"{1e3 * med[i]:.2f} ({1e3 * (med[i] - base[i]):+.2f})"
                     for i in (1, 2, 3, 4, 0)]
            phases.append(f"| {m} | {variant_name(v)} | " + " | ".join(cells) + " |")
            # the main thread's CPU time per phase (thread_time)
            cm = [statistics.median(s[i] for s in times[v]) for i in range(5, 10)]
            cb = [statistics.median(s[i] for s in times["plain"]) for i in range(5, 10)]
            cells = [f"{1e3 * cm[i]:.2f}" if v == "plain" else f"{1e3 * cm[i]:.2f} ({1e3 * (cm[i] - cb[i]):+.2f})"
                     for i in (1, 2, 3, 4, 0)]
            share = "" if v == "plain" else f"{100 * (cm[0] - cb[0]) / base[0]:+.2f} %"
            faults = statistics.mean(s[10] for s in times[v])
            cpu.append(f"| {m} | {variant_name(v)} | " + " | ".join(cells) + f" | {share} | {faults:.0f} |")
            if v == "plain":
                continue
            t = [s[0] for s in times[v]]
            ratios = [a / b for a, b in zip(t, plain)]
            rounds = [statistics.median(ratios[i:i + args.steps]) for i in range(0, len(ratios), args.steps)]
            lines.append(f"| {m} | {variant_name(v)} | {1e3 * statistics.median(t):.2f} | **{statistics.median(rounds):.4f}** | "
                         f"{min(rounds):.4f} | {max(rounds):.4f} | {sum(t) / sum(plain):.4f} |")
    if part_lines:
        phases += ["", "hetlb's step boundary by part (rank 0, median µs per call after the first "
                   f"{args.warmup} calls; the labels of bench_cold.py --parts):", "",
                   "| model | part | µs | calls |", "|---|---|---:|---:|"] + part_lines
    return lines + ["", "Phases: median milliseconds of each phase of a step (rank 0), and in brackets what it "
                    "adds to plain DDP's median of the same phase. The medians of the phases need not sum "
                    "to the median step.", ""] + phases + [
                    "", "Main-thread CPU time (`time.thread_time`, rank 0): median milliseconds per phase, and "
                    "in brackets what each adds to plain DDP's. Waiting (for the other rank, for Gloo's "
                    "threads) costs the main thread no CPU, so this is the work a variant adds on the "
                    "thread that runs the step, without the wall clock's scheduling noise; the last column "
                    "is that work over plain DDP's median wall step. (Gloo's own threads are not counted.)",
                    ""] + cpu


def variant_name(v: str) -> str:
    """The table's name of a variant."""
    name, _, copy = v.partition("#")
    name = {"plain": "plain DDP", "torchhook": "DDP + torch allreduce_hook", **FLOOR_NAMES}.get(name, f"hetlb {name}")
    return f"{name} (copy {copy})" if copy else name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", nargs="+", choices=sorted(MODELS), default=["mlp", "wide"])
    p.add_argument("--variants", nargs="+", default=["plain", "side", "carry"])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--bucket-view", action="store_true", help="DDP(gradient_as_bucket_view=True)")
    p.add_argument("--interleave", choices=["round", "step"], default="round",
                   help="round: each variant runs --steps steps in turn per round; step: every variant "
                        "side by side in one process group, one step each in turn, rounds being "
                        "consecutive blocks of --steps steps")
    p.add_argument("--pin", action="store_true", help="pin rank r to core r")
    p.add_argument("--next-last", action="store_true",
                   help="with --interleave step: end each variant's turn with its next batch, so "
                        "its step's end (hetlb's table taken, the floor's exchange waited for) is "
                        "timed in its own turn; by default a turn starts with it, after the other "
                        "variants' steps, when any exchange has long finished")
    p.add_argument("--epoch-steps", type=int, default=None,
                   help="with --interleave step: steps per epoch (default: a quarter of --steps, at "
                        "least 8). An epoch's first and last steps each exchange a table, so short "
                        "epochs make blocked exchanges (Uniform's default) look dearer than in "
                        "training, whose epochs are hundreds of steps")
    p.add_argument("--rebuild", action="store_true",
                   help="with --interleave step: build every variant afresh each round, in a "
                        "rotated order (each round then discards its first --warmup steps), so a "
                        "variant's memory placement changes from round to round")
    p.add_argument("--parts", action="store_true",
                   help="with --interleave step: time each part of hetlb's step boundary (rank 0)")
    p.add_argument("--steady-heap", action="store_true",
                   help="fix glibc's mmap and trim thresholds in the ranks (MALLOC_MMAP_THRESHOLD_, "
                        "MALLOC_TRIM_THRESHOLD_), so a variant's fresh gradients reuse the heap "
                        "instead of being faulted in again on the steps the shared heap's layout "
                        "happens to return them to the system (see the page-fault column)")
    p.add_argument("--hetlb-path", default=None, help="import hetlb from this checkout instead")
    p.add_argument("--label", default="", help="a name for this code version in the table")
    p.add_argument("--out", default=None)
    p.add_argument("--instructions", action="store_true", help="count instructions (callgrind)")
    p.add_argument("--main-thread", action="store_true",
                   help="with --instructions: count the main thread only (communication threads "
                        "poll, so their counts vary from run to run)")
    p.add_argument("--latency", action="store_true",
                   help="time one small all-reduce (the telemetry row) between the ranks instead")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--store", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return one_run(args)
    if args.instructions:
        return emit(instructions(args), args.out)
    variants = list(args.variants)
    jobs = []
    for m in args.model:
        for rnd in range(args.rounds):
            k = rnd % len(variants)
            for v in variants[k:] + variants[:k]:  # rotated order per round
                jobs.append((m, rnd, v))
    if args.steady_heap:  # read by glibc when each spawned rank starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(32 << 20)  # glibc's largest
        os.environ["MALLOC_TRIM_THRESHOLD_"] = str(1 << 40)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.pt")
        mp.spawn(worker, args=(args.world, os.path.join(tmp, "store"), args, jobs, out), nprocs=args.world, join=True)
        res = torch.load(out)
    if args.latency:
        return emit([f"### One all-reduce of 9 float64 between {args.world} Gloo ranks{', pinned' if args.pin else ''} "
                     f"(median of {args.steps - args.warmup})", "",
                     "| group | when | microseconds |", "|---|---|---:|"] +
                    [f"| {group} | {when} | {1e6 * v:.0f} |" for (group, when), v in res[0].items()], args.out)
    if args.interleave == "step":
        return emit(interleaved_table(args, res), args.out)
    wall: Dict[tuple, float] = {(m, r, v): t[0] for m, r, v, t in res}
    cpu: Dict[tuple, float] = {(m, r, v): t[1] for m, r, v, t in res}
    lines = [f"### Homogeneous overhead with real compute{' (' + args.label + ')' if args.label else ''}: "
             f"{args.world} Gloo ranks x 1 thread{', pinned' if args.pin else ''}, global batch {args.global_batch}, "
             f"{'gradient_as_bucket_view=True, ' if args.bucket_view else ''}"
             f"{args.rounds} interleaved rounds of {args.steps} steps (first {args.warmup} not counted)",
             "", "Wall: median step time of rank 0's loop; CPU: median per-step CPU time of rank 0's "
             "process (all its threads). Ratios are to plain DDP in the same round.", "",
             "| model | variant | wall (ms) | wall ratio: median | min | max | CPU (ms) | CPU ratio: median | min | max |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    R = range(args.rounds)
    for m in args.model:
        lines.append(f"| {m} | plain DDP | {1e3 * statistics.median([wall[(m, r, 'plain')] for r in R]):.2f} | 1 | | | "
                     f"{1e3 * statistics.median([cpu[(m, r, 'plain')] for r in R]):.2f} | 1 | | |")
        for v in variants:
            if v == "plain":
                continue
            rw = [wall[(m, r, v)] / wall[(m, r, "plain")] for r in R]
            rc = [cpu[(m, r, v)] / cpu[(m, r, "plain")] for r in R]
            name = variant_name(v)
            lines.append(f"| {m} | {name} | {1e3 * statistics.median([wall[(m, r, v)] for r in R]):.2f} | "
                         f"**{statistics.median(rw):.4f}** | {min(rw):.4f} | {max(rw):.4f} | "
                         f"{1e3 * statistics.median([cpu[(m, r, v)] for r in R]):.2f} | "
                         f"**{statistics.median(rc):.4f}** | {min(rc):.4f} | {max(rc):.4f} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
