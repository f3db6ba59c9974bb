"""Reproducer of the open exit hang (docs/restarts.md, "Shutdown"): counts clean, hung and
aborted exits.

A 2-rank Gloo job trains a DDP model with a collective of its own on Python objects every step
(``all_gather_object``, as scripts do for metrics), calls ``destroy_process_group()`` and returns.
Variants: ``plain`` (no hetlb), ``import`` (``import hetlb`` first, which imports
``torch.distributed.nn`` before the group exists), ``import-del`` (that, with the DDP model
deleted before ``destroy_process_group()``), ``balancer`` (plus a ``hetlb.Balancer``) and
``outlive`` (the Balancer deleted before the model).
A rank still alive 25 s after its training counts as hung (faulthandler ends it).

    python tools/exit_hang_repro.py --runs 8 --variants plain import balancer

Measured on the 2-core CI-like machine (session 19): plain 0 of 8 hung; balancer 4 of 8 hung;
with hetlb's early import of ``torch.distributed.nn`` removed, balancer 0 hung but 2 of 8 aborted
at exit ("terminate called without an active exception"). gdb (a new-user audit): the main
thread joins Gloo's threads in ``~ProcessGroupGloo`` (from ``~Reducer``) holding the GIL, while a
Gloo thread destroying the last ``AsyncAllgatherWork`` waits for the GIL to free a Python tensor.
Session 19: the Balancer kept a Python reference to the group, dropped after its model (so the
group went through a destructor that releases the GIL): balancer 0 of 24 hung. Session 20 (12 runs
each, two audits running beside): plain 12 clean; import 3 hung; balancer 12 clean; outlive 2
hung with that reference, 12 clean since the groups the hook holds are kept on the DDP model after
its reducer (``aggregate._GroupsKept``); import-del 12 clean. With the early import removed:
import 12 clean, balancer 12 clean (the group is then pinned to interpreter exit, where plain DDP
has been seen to abort; see ``tests/test_port.py``).
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import subprocess
import sys


VARIANTS = ("plain", "import", "import-del", "balancer", "outlive")


def worker(variant: str) -> None:
    import faulthandler
    if variant != "plain":
        import hetlb  # noqa: F401
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)

    def main() -> None:
        dist.init_process_group("gloo")
        ddp = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                      torch.nn.Linear(16, 1)).double())
        bal = None
        if variant in ("balancer", "outlive"):
            import hetlb
            bal = hetlb.Balancer(ddp, global_batch=24, policy=hetlb.Uniform())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for _ in range(27):
            x = torch.randn(12, 8, dtype=torch.float64)
            if bal is not None:
                with bal.step():
                    ddp(x).pow(2).mean().backward()
            else:
                ddp(x).pow(2).mean().backward()
            seen = [None] * dist.get_world_size()
            dist.all_gather_object(seen, ([1, 2, 3], True))
            opt.step()
            opt.zero_grad()
        if variant == "outlive":
            del bal  # the model outlives its Balancer
        if variant == "import-del":
            del ddp  # the known issue's workaround (docs/restarts.md, "Shutdown")
        faulthandler.dump_traceback_later(25, exit=True)
        dist.destroy_process_group()

    main()


def one(variant: str) -> str:
    port = random.randrange(20000, 40000)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(port), __file__, "--worker", variant]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        return "hung (launcher timeout)"
    if "Timeout (0:00:25)" in r.stderr:
        return "hung"
    if "terminate called" in r.stderr:
        return "aborted"
    return "clean" if r.returncode == 0 else f"failed (rc {r.returncode})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS),
                   choices=VARIANTS)
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker)
        return
    for v in args.variants:
        counts = collections.Counter(one(v) for _ in range(args.runs))
        print(f"{v:9s} " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())), flush=True)


if __name__ == "__main__":
    main()
