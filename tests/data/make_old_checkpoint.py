"""Writes ``checkpoint_c984ae6.pt``: a Balancer checkpoint taken mid-epoch by hetlb at commit
c984ae6 (before the subpackages), which ``tests/test_old_checkpoint.py`` resumes.

Run with that commit's package first on the path (two Gloo ranks on this machine):
``git worktree add /tmp/old c984ae6 && cp hetlb/_C*.so /tmp/old/hetlb/ &&
PYTHONPATH=/tmp/old python tests/data/make_old_checkpoint.py tests/data/checkpoint_c984ae6.pt``
"""
import datetime
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

N, GLOBAL_BATCH, STOP = 61, 8, 5  # 8 steps an epoch (the last short); stop after 5


def worker(rank: int, world: int, store: str, out: str) -> None:
    import hetlb
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(1, 1))
    # Rank 1 three times slower: LBB moves samples to rank 0, so the decision and history differ
    # from a fresh start.
    emulator = hetlb.emulate.Emulator(hetlb.LinearModel(0.001, 0.002), speed=1.0 / (1 + 2 * rank))
    bal = hetlb.Balancer(ddp, GLOBAL_BATCH, policy=hetlb.LBB(), emulator=emulator)
    data = torch.utils.data.TensorDataset(torch.arange(N, dtype=torch.float32).unsqueeze(1),
                                          torch.zeros(N, 1))
    loader = bal.loader(data, seed=3)
    seen = []
    for x, y in loader:
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        seen.append([int(v) for v in x[:, 0].tolist()])
        if bal.steps == STOP:
            break
    state = loader.state_dict()
    everyone = [None] * world
    dist.all_gather_object(everyone, {"seen": seen, "sizes": bal.batch_sizes.tolist()})
    if rank == 0:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=os.path.dirname(hetlb.__file__)).stdout.strip()
        torch.save({"state": state, "seen": [e["seen"] for e in everyone],
                    "sizes": everyone[0]["sizes"], "n": N, "global_batch": GLOBAL_BATCH,
                    "seed": 3, "commit": commit, "torch": str(torch.__version__)}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(2, os.path.join(d, "store"), os.path.abspath(sys.argv[1])), nprocs=2)
