"""A parameter-server script run by tests/test_ps.py under torchrun with ``--max-restarts``.

Rank 0 serves, ranks 1.. work (ASP, float64 linear regression); the server checkpoints every 3
updates through ``hetlb.Checkpointer`` and resumes from the newest on start. On the first attempt
worker ``--kill-rank`` exits at its ``--kill-at``-th sample read (a crash: torchrun restarts the
group), and every other worker stops at its own ``--kill-at``-th read until torchrun ends it, so
that none trains on into the next epoch while the agent reacts (the test reads the last epoch as
trained whole by the restarted attempt). The server writes its final state to ``--out``/server.pt.

    torchrun --standalone --nproc-per-node 3 --max-restarts 1 tests/ps_restart_worker.py --out DIR
"""
import argparse
import os
import time

import torch

import hetlb

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--kill-rank", type=int, default=1)
p.add_argument("--kill-at", type=int, default=20)
p.add_argument("--epochs", type=int, default=2)
args = p.parse_args()
rank = int(os.environ["RANK"])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
n = 96
g = torch.Generator().manual_seed(0)
x = torch.randn(n, 4, dtype=torch.float64, generator=g)
y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64)


class Data(torch.utils.data.Dataset):
    def __init__(self):
        self.reads = 0

    def __len__(self):
        return n

    def __getitem__(self, i):
        self.reads += 1
        if attempt == 0 and self.reads == args.kill_at:
            if rank == args.kill_rank:
                os._exit(7)  # a worker process dies mid-training
            time.sleep(120)  # the others wait here for torchrun to end them
        return x[i], y[i]


torch.manual_seed(0)
model = torch.nn.Linear(4, 1).double()
kw = {"checkpointer": hetlb.Checkpointer(os.path.join(args.out, "ckpt")), "checkpoint_every": 3,
      "timeout": 30.0} if rank == 0 else {}
out = hetlb.sync.train("asp", model, Data(), torch.nn.functional.mse_loss, global_batch=8,
                       epochs=args.epochs, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05), **kw)
if rank == 0:
    s = out["server"]
    torch.save({"attempt": attempt, "epoch": s.epoch, "version": s.version, "log": s.log},
               os.path.join(args.out, "server.pt"))
