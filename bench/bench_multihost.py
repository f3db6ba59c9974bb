"""Two hosts x two workers with one host's link capped: LB-BSP's bandwidth experiment on one machine.

Two network namespaces joined by veth to a bridge (tests/multihost.py) are the hosts; a multi-node
torchrun job (c10d rendezvous, Gloo) runs tests/multihost_worker.py on two workers per host: a
float64 MLP (64-512-512-8, 300k parameters, 2.4 MB of gradient per step), DDP, ``hetlb.Balancer``,
global batch 256. For each policy the same job runs with host 1's link uncapped and capped both
ways by a tbf qdisc at each ``--rates`` rate. Per run, after ``--warmup`` steps, medians over
steps of:

* ``step``: the slowest rank's wall time of the step (forward, backward with DDP's all-reduces,
  optimizer);
* ``compute``: the slowest rank's compute as hetlb's telemetry recorded it (first forward to last
  gradient bucket ready);
* ``comm``: ``step - compute``, the all-reduce's exposed time; ``share``: ``comm / step``;
* ``ring est.``: what a ring all-reduce must push through the capped link per step,
  ``2 (n-1)/n * gradient bytes / rate`` (the link carries that much each way whatever the split);
* ``split``: the median samples per host (host 1 is the capped one);
* ``µs/sample``: per host, the median over steps of its ranks' mean compute per sample as the
  telemetry recorded it (what the policies read as the host's speed);
* ``moved/step``: samples that changed rank between consecutive steps (median, mean, max), and
  between hosts (mean);
* ``max |dθ|``: the largest difference of the final parameters from the same policy's uncapped
  run (the same global batches, split differently).

``--trace RATE`` also prints every step (sizes per rank, step and compute ms) of the runs at RATE.
Needs root and ``ip netns`` (the reason is printed otherwise).

    python bench/bench_multihost.py [--rates 1gbit,200mbit,50mbit] [--policies lbbsp,lbb] \
        [--steps 40] [--trace 50mbit] [--out F]

Policies: ``lbbsp`` (LB-BSP GPU mode, Algorithm 2), ``lbbsp-cpu`` (Algorithm 1, sizes proportional
to speed; the EMA predictor, since NARX needs 500 steps of warm-up), ``lbb``, ``uniform``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import multihost  # noqa: E402
import multihost_worker as mw  # noqa: E402
from report import emit  # noqa: E402

WORKER = os.path.join(HERE, "..", "tests", "multihost_worker.py")


def run_job(cluster, out, args, policy, port):
    os.makedirs(out, exist_ok=True)
    t = time.monotonic()
    codes = cluster.torchrun([WORKER, "--out", out, "--steps", args.steps,
                              "--global-batch", args.global_batch, "--hidden", args.hidden,
                              "--policy", policy, "--timeout", 120],
                             nproc_per_node=2, logs=out, timeout=args.timeout, port=port)
    if codes != [0, 0]:
        raise RuntimeError(f"{policy} job failed: {codes}\n" + cluster._tails(out, [0, 1]))
    return mw.load_run(out), time.monotonic() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", default="1gbit,200mbit,50mbit")
    p.add_argument("--policies", default="lbbsp,lbbsp-cpu,lbb")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--trace", default=None, help="print every step of the runs at this rate")
    p.add_argument("--timeout", type=float, default=400.0, help="per job, seconds")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    reason = multihost.available()
    if reason is not None:
        print(f"bench_multihost: cannot run here: {reason}")
        sys.exit(2)
    rates = [None] + [r for r in args.rates.split(",") if r]
    policies = [q for q in args.policies.split(",") if q]
    lines = ["| policy | link of host 1 | step ms | compute ms | comm ms | share | ring est. ms | "
             "split host 0 / host 1 | µs/sample host 0 / host 1 | moved/step median / mean / max | "
             "between hosts mean | max abs dθ |",
             "|---|---|---:|---:|---:|---:|---:|---|---|---|---:|---:|"]
    traces = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, multihost.Cluster(hosts=2) as cluster:
        port = 29400
        for policy in policies:
            base = None
            for rate in rates:
                if rate is None:
                    cluster.uncap(1)
                else:
                    cluster.cap(1, rate)
                port += 1
                out = os.path.join(tmp, f"{policy}-{rate or 'none'}")
                run, took = run_job(cluster, out, args, policy, port)
                final = torch.load(os.path.join(out, "final.pt"))
                if base is None:
                    base = final
                diff = max(float((a - b).abs().max()) for a, b in zip(final, base))
                s = mw.summarize(run, args.warmup)
                m = s["median"]
                grad_bytes = run["info"]["params"] * 8
                world = run["world"]
                est = "" if rate is None else \
                    f"{2 * (world - 1) / world * grad_bytes * 8 / multihost._rate_bps(rate) * 1e3:.0f}"
                hb = m["host_batch"]
                lines.append(
                    f"| {policy} | {rate or 'uncapped'} | {m['step'] * 1e3:.1f} | {m['compute'] * 1e3:.1f} | "
                    f"{m['comm'] * 1e3:.1f} | {m['share']:.2f} | {est} | {hb[0]:.0f} / {hb[1]:.0f} | "
                    f"{m['host_cost'][0] * 1e6:.0f} / {m['host_cost'][1] * 1e6:.0f} | "
                    f"{m['moved']:.0f} / {s['moved'].mean():.1f} / {s['moved'].max():.0f} | "
                    f"{s['host_moved'].mean():.1f} | {diff:.1e} |")
                print(lines[-1], f"({took:.0f} s)", flush=True)
                if args.trace is not None and rate == args.trace:
                    step, comp = run["wall"].max(1), run["compute"].max(1)
                    traces += ["", f"{policy}, host 1 capped at {rate}: every step", "",
                               "| step | sizes (ranks 0-3; hosts " +
                               " ".join(str(h) for h in run["host"]) + ") | step ms | compute ms |",
                               "|---:|---|---:|---:|"]
                    traces += [f"| {t} | {' '.join(str(int(b)) for b in run['batch'][t])} | "
                               f"{step[t] * 1e3:.0f} | {comp[t] * 1e3:.1f} |" for t in range(len(step))]
        cluster.uncap(1)
    lines += ["", f"{args.steps} steps per run, medians after {args.warmup} warm-up steps; "
              f"{run['info']['params']} float64 parameters ({grad_bytes / 1e6:.1f} MB), global batch "
              f"{args.global_batch}, 2 hosts x 2 workers; {time.monotonic() - started:.0f} s in all"]
    emit(lines + traces, args.out)
    leftovers = [ns for ns in multihost._netns_list() if ns.startswith(multihost.PREFIX)]
    if leftovers:
        print(f"warning: namespaces left: {leftovers}")


if __name__ == "__main__":
    main()
