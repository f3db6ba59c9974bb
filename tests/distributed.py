"""Run a function on N real Gloo processes (spawned) with timeouts everywhere; never hangs.

Rendezvous goes through a FileStore in a fresh temporary directory, so parallel test runs share
no port; Gloo's own connections use ephemeral loopback ports chosen by the OS.
"""
from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import traceback
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


def _entry(fn: Callable, rank: int, world: int, store: str, out: str, args: tuple,
           backend: str = "gloo", env: Optional[dict] = None) -> None:
    if env is not None:  # the parent's environment now, not the fork server's at its start
        os.environ.clear()
        os.environ.update(env)
    import torch
    torch.set_num_threads(1)
    result: Any
    if backend == "rpc":  # the function initialises torch.distributed.rpc itself
        try:
            result = ("ok", fn(rank, world, f"file://{store}", *args))
        except BaseException as e:  # noqa: BLE001 (reported to the parent, which re-raises)
            result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        with open(os.path.join(out, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        return
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                                world_size=world, timeout=COLLECTIVE_TIMEOUT)
        result = ("ok", fn(rank, world, *args))
    except BaseException as e:  # noqa: BLE001 (reported to the parent, which re-raises)
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    # Torn down once the exception is gone: its traceback's frames hold the worker's objects
    # (a DDP model), which must not outlive the process group.
    try:
        import gc
        gc.collect()
        if dist.is_initialized():  # a worker may have torn it down itself
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        if result[0] == "ok":
            result = ("error", f"teardown: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(os.path.join(out, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def gloo_threads() -> List[str]:
    """Names of this process's Gloo threads (Linux): non-empty while a Gloo group is alive."""
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(n for n in names if "gloo" in n)


#: Imported once by the fork server, so a rank starts in milliseconds instead of importing torch
#: (about 2 s of CPU per rank on the CI machine, for every multi-process test).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.rpc", "numpy", "hetlb",
           "torch._dynamo"]


def _context() -> Any:
    """Processes forked from a server that imported :data:`PRELOAD` (fresh, like spawn's: the
    server has no threads, no process group and no CUDA context); ``HETLB_TEST_START=spawn``
    goes back to spawning every rank."""
    method = os.environ.get("HETLB_TEST_START", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run(fn: Callable, world: int, *args: Any, timeout: float = 180.0, backend: str = "gloo",
        may_die: tuple = ()) -> List[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` processes; return each rank's result.

    With ``backend="rpc"`` no process group is made: ``fn(rank, world, init_method, *args)``
    gets a fresh ``file://`` rendezvous for ``torch.distributed.rpc.init_rpc``.

    Raises ``AssertionError`` with the rank's traceback if any rank failed, and kills every
    process if the group does not finish within ``timeout`` seconds. A rank in ``may_die`` that
    exits without a result (a staged crash) gets the result ``("died", exit code)``.
    """
    ctx = _context()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        env = dict(os.environ)
        procs = [ctx.Process(target=_entry, args=(fn, r, world, store, tmp, args, backend, env),
                             daemon=False)
                 for r in range(world)]
        for p in procs:
            p.start()
        import time
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        if hung:
            raise AssertionError(f"ranks {hung} did not finish within {timeout} s")
        results = []
        for r in range(world):
            path = os.path.join(tmp, f"{r}.pkl")
            if not os.path.exists(path) and r in may_die:
                results.append(("died", procs[r].exitcode))
                continue
            if not os.path.exists(path):
                raise AssertionError(f"rank {r} died without a result (exit code {procs[r].exitcode})")
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    return results


def unwrap(results: List[Any]) -> List[Any]:
    """Values of every rank, or AssertionError with every failing rank's traceback.

    A rank that crashes usually makes its peers fail with "Connection closed by peer"; all
    failures are shown, the ranks that did not fail that way first, so the cause comes first.
    """
    failed = [(r, v) for r, (status, v) in enumerate(results) if status != "ok"]
    if failed:
        failed.sort(key=lambda rv: "closed by peer" in rv[1])
        raise AssertionError("\n".join(f"rank {r} failed:\n{v}" for r, v in failed))
    return [v for _, v in results]


def torchrun(script: str, out: Any, *args: Any, nproc: int = 2, timeout: float = 300.0) -> Any:
    """``script --out OUT ARGS`` under ``torchrun --standalone`` with ``nproc`` processes of one
    thread each; asserts that it succeeded (the stderr's tail otherwise) and returns the JSON the
    script wrote to ``out``."""
    return torchrun_each(script, [(out, args)], nproc=nproc, timeout=timeout)[0]


def torchrun_each(script: str, runs: List[Tuple[Any, Sequence[Any]]], nproc: int = 2,
                  timeout: float = 300.0) -> List[Any]:
    """Several runs of ``script`` in one launch, one after the other in the same processes:
    ``script --out OUT1 ARGS1 --then --out OUT2 ARGS2 ...`` (the script runs each part, see
    :func:`each_run`); the JSON each run wrote. A launch costs seconds of imports (Lightning's
    about 6 s a process), the runs themselves a fraction of that."""
    import json
    import subprocess
    import sys
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           script]
    for i, (out, args) in enumerate(runs):
        cmd += (["--then"] if i else []) + ["--out", str(out), *map(str, args)]
        if os.path.exists(out):
            os.remove(out)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0 and ABORT_AT_EXIT in r.stderr and all(os.path.exists(o) for o, _ in runs):
        # The script wrote its results after its last collective: the abort is torch's at
        # interpreter shutdown (docs/restarts.md, "Known issue (torch)"), not the run's.
        import warnings
        warnings.warn(f"{os.path.basename(script)}: a rank aborted after writing its results "
                      f"({ABORT_AT_EXIT!r}); the results are checked")
    else:
        assert r.returncode == 0, r.stderr[-4000:]
    results = []
    for out, _ in runs:
        with open(out) as f:
            results.append(json.load(f))
    return results


def each_run(argv: List[str]) -> List[List[str]]:
    """A worker's command line split into its runs (:func:`torchrun_each`'s ``--then``)."""
    runs: List[List[str]] = [[]]
    for a in argv:
        if a == "--then":
            runs.append([])
        else:
            runs[-1].append(a)
    return runs


#: What a process prints when it aborts in Gloo's teardown at exit (see :func:`torchrun`).
ABORT_AT_EXIT = "terminate called without an active exception"


def union_gradient_errors(make: Callable, kept: dict, trained_by_rank: List[Any],
                          loss_of: Callable) -> dict:
    """For each kept step (``step: [(parameter, gradient), ...]``, taken before the optimizer
    step): the largest difference between its gradient and one process's gradient over the
    samples every rank trained in that step (``trained_by_rank[r]``: ``(step, indices)`` pairs),
    on a fresh ``make()`` holding the step's parameters; ``loss_of(model, indices)`` is the loss
    of those samples."""
    import torch
    errors = {}
    for step, pairs in kept.items():
        union = [i for rank in trained_by_rank for s, idx in rank if s == step for i in idx]
        model = make()
        with torch.no_grad():
            for p, (value, _) in zip(model.parameters(), pairs):
                p.copy_(value)
        loss_of(model, union).backward()
        errors[step] = max(float((p.grad - g).abs().max()) for p, (_, g) in
                           zip(model.parameters(), pairs))
    return errors
