"""Shared by the benchmark scripts: print a markdown table and write it to a file; run a function
on spawned Gloo ranks."""
from __future__ import annotations

from typing import Any, Callable, List, Optional


def emit(lines: List[str], out: Optional[str]) -> None:
    """Print ``lines``; also write them to ``out`` when given."""
    text = "\n".join(lines)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


def digits():
    """scikit-learn's handwritten digits as the benchmarks use them: ``(train, (x_test, y_test))``
    where ``train`` is a ``TensorDataset`` of the 80 % split plus four one-pixel shifts of every
    image (7185 samples of 64 features) and the test set is the held-out 20 % (360 images)."""
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


def _gloo_entry(rank: int, world: int, store: str, out: str, fn: Callable[..., Any], args: tuple) -> None:
    import datetime
    import json

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        # The worker's objects (a DDP model's reducer) go before the process group they hold,
        # also those a reference cycle keeps: torn down after it, a process may abort at exit.
        import gc
        gc.collect()
        dist.destroy_process_group()


def on_gloo_ranks(fn: Callable[..., Any], world: int, *args: Any) -> Any:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes in one Gloo group (a
    FileStore rendezvous: no port); return rank 0's result (JSON-ready). ``fn`` must be a
    module-level function."""
    import json
    import os
    import tempfile

    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_gloo_entry, args=(world, os.path.join(tmp, "store"), out, fn, args), nprocs=world)
        with open(out) as f:
            return json.load(f)


def _rpc_entry(rank: int, world: int, store: str, out: str, fn: Callable[..., Any], args: tuple) -> None:
    import json

    import torch
    torch.set_num_threads(1)
    result = fn(rank, world, f"file://{store}", *args)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def on_rpc_ranks(fn: Callable[..., Any], world: int, *args: Any) -> Any:
    """Run ``fn(rank, world, init_method, *args)`` on ``world`` spawned processes that initialise
    ``torch.distributed.rpc`` themselves from ``init_method`` (a FileStore: no port); return rank
    0's result (JSON-ready)."""
    import json
    import os
    import tempfile

    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_rpc_entry, args=(world, os.path.join(tmp, "store"), out, fn, args), nprocs=world)
        with open(out) as f:
            return json.load(f)
