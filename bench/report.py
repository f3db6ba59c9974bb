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
