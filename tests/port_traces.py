"""What tests/test_port_scripts.py shares about the two real training scripts it ports
(tests/port/imagenet_main.py, pytorch/examples imagenet/main.py; tests/port/nanogpt_train.py,
karpathy/build-nanogpt train_gpt2.py) and their PORT_TRACE traces, which say which samples each
rank read in which epoch or step: reading the traces, the imagenet arguments, nanoGPT's token
shards and the checkpoint's pickled config.

Plain DDP sometimes aborts at interpreter exit ("terminate called without an active exception",
see tests/test_port.py and docs/restarts.md): rank 0 may then be killed before it finishes, so the
tests run such a run again (they are about the training, not that torch hazard).
"""
import dataclasses
import os
import re

import numpy as np


HERE = os.path.dirname(os.path.abspath(__file__))
IMAGENET = os.path.join(HERE, "port", "imagenet_main.py")
NANOGPT = os.path.join(HERE, "port", "nanogpt_train.py")
ABORT = "terminate called without an active exception"


def trace(d, split, rank, marker):
    """{marker value: [entries]} from a trace file: the lines after each ``<marker> <k>`` line."""
    out = {}
    with open(d / "trace" / f"{split}-rank{rank}.txt") as f:
        for line in f.read().splitlines():
            if line.startswith(marker + " "):
                current = out.setdefault(int(line.split()[1]), [])
            else:
                current.append(line)
    return out


def results(d, rank):
    with open(d / "trace" / f"result-rank{rank}.txt") as f:
        return f.read().splitlines()


IMAGENET_ARGS = ("-j", 0, "-b", 8, "-p", 100, "--lr", 0.05, "--train-size", 97, "--val-size", 53)


def write_shards(root, seed=0):
    """Token shards named as build-nanogpt's fineweb.py names them (uint16): one val shard of
    600 tokens and two train shards of 1000."""
    rng = np.random.default_rng(seed)
    root.mkdir()
    for name, size in [("edufineweb_val_000000", 600), ("edufineweb_train_000001", 1000),
                       ("edufineweb_train_000002", 1000)]:
        np.save(root / f"{name}.npy", rng.integers(0, 64, size).astype(np.uint16))


@dataclasses.dataclass
class GPTConfig:
    """What nanogpt_train.py's checkpoints pickle as ``__main__.GPTConfig`` (upstream's too)."""
    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


GPTConfig.__module__ = "__main__"


LOG_LINE = re.compile(r"^step +(\d+) \| loss: ([0-9.]+) \| lr ", re.M)
