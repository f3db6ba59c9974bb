"""The hetlb ports of two real DDP scripts, against the originals (tests/port_traces.py reads their
traces): tests/port/imagenet_main_hetlb.py (pytorch/examples imagenet/main.py)
and tests/port/nanogpt_train_hetlb.py (karpathy/build-nanogpt train_gpt2.py), both on the CPU
with Gloo, 2 ranks under torchrun. The ports run through tests/port/uneven.py, which puts every
Balancer they make on a fixed uneven split (LBB on one machine would split by timing noise).

What is compared, and why not more:

* imagenet's training order: DistributedSampler(seed=0) and hetlb's loader (seed=0) draw the same
  permutation every epoch (``torch.randperm`` seeded with ``seed + epoch``), and each step of the
  original (rank r takes every world-th index, 8 per rank) holds the same 16 samples as the
  port's step (contiguous slices of the permutation). They differ in the split inside a step
  (strided or contiguous, 8/8 or 5/11) and in the epoch's short last step: DistributedSampler
  pads 97 samples to 98 with the permutation's first sample, hetlb's last step holds the one
  sample left (so one rank gets an empty batch: the port keeps upstream's accuracy() from
  dividing by its zero size).
* imagenet's parameters: tinynet normalises with BatchNorm2d over each rank's own batch, so the
  parameters depend on how a step is split over the ranks, not only on the step's samples:
  the port with 5/11 and with 8/8 differ by about 3e-2, and so do the original and the port with
  8/8 (strided and contiguous halves). Without BatchNorm (both scripts with nn.Identity in its
  place, 96 samples so there is no padding) the port on 5/11 trains the original's parameters
  (to about 5e-8).
* nanoGPT has no batch statistics (LayerNorm is per token), so the port on uneven (and empty)
  micro-batches logs the original's loss and trains its parameters.

The runs are made once (a module fixture, two at a time) and shared by the tests.
"""
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from test_port import changed_lines, code_lines, torchrun
from port_traces import ABORT, GPTConfig, IMAGENET_ARGS, LOG_LINE, results, trace, write_shards

HERE = os.path.dirname(os.path.abspath(__file__))
PORT = os.path.join(HERE, "port")
IMAGENET = os.path.join(PORT, "imagenet_main.py")
IMAGENET_PORT = os.path.join(PORT, "imagenet_main_hetlb.py")
NANOGPT = os.path.join(PORT, "nanogpt_train.py")
NANOGPT_PORT = os.path.join(PORT, "nanogpt_train_hetlb.py")
UNEVEN = os.path.join(PORT, "uneven.py")

WORLD = 2
SPLIT = [5, 11]  # imagenet: -b 8 on 2 ranks, a global batch of 16
# nanoGPT: B=4 on 2 ranks, a global batch of 8 sequences per micro-step; one split per optimizer
# step (an accumulation window of 2 micro-steps), the last from step 4 on; a rank may get none
NANO_SPLITS = [[3, 5], [6, 2], [0, 8], [8, 0], [5, 3]]


def _variant(src, dst, *substitutions):
    """``src`` with each (old, new) substituted once, written to ``dst``."""
    with open(src) as f:
        text = f.read()
    for old, new in substitutions:
        assert text.count(old) == 1, (src, old)
        text = text.replace(old, new)
    dst.write_text(text)
    return str(dst)


NO_BATCHNORM = ("nn.BatchNorm2d(16)", "nn.Identity()")
# The mistake the library now refuses: the port keeps the DistributedSampler in a variable and
# set_epoch's it, and does not restore the loader's state on --resume.
KEPT_SAMPLER = [
    ("    train_loader = hetlb.DataLoader(\n",
     "    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)\n"
     "    train_loader = hetlb.DataLoader(\n"),
    ("train_loader.set_epoch(epoch)", "train_sampler.set_epoch(epoch)"),
    ("    if args.resume and os.path.isfile(args.resume):\n"
     "        train_loader.load_state_dict(checkpoint['loader'])\n", ""),
]


def _launch(d, script, *args, split=None, fails=False, tries=3):
    """Run ``script`` under torchrun in ``d`` (PORT_TRACE=trace is relative: each run's own);
    ``split`` runs it through uneven.py. A run that aborts at interpreter exit ("terminate called
    without an active exception": torch's hazard, see port_traces.py; the imagenet
    script, upstream's and its port, never destroys its process group) is run again unless it
    ``fails`` anyway: rank 0 may have been killed before it finished. Returns (completed process,
    directory); ``.aborts`` counts the runs that aborted."""
    split_args = [UNEVEN, "--sizes", ";".join(",".join(map(str, s)) for s in split), script] \
        if split else [script]
    for attempt in range(tries):
        run_dir = d.parent / f"{d.name}-{attempt}"
        (run_dir / "trace").mkdir(parents=True)
        start = time.monotonic()
        r = torchrun(split_args[0], run_dir, *split_args[1:], *args, timeout=300, checked=False)
        r.seconds, r.aborts = time.monotonic() - start, attempt
        if fails or r.returncode == 0 or ABORT not in r.stderr:
            break
    return r, run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("port-scripts")
    write_shards(root / "data")
    nobn = _variant(IMAGENET, root / "imagenet_main_nobn.py", NO_BATCHNORM)
    nobn_port = _variant(IMAGENET_PORT, root / "imagenet_main_hetlb_nobn.py", NO_BATCHNORM)
    kept = _variant(IMAGENET_PORT, root / "imagenet_main_hetlb_kept_sampler.py", *KEPT_SAMPLER)
    at_96 = [a if a != 97 else 96 for a in IMAGENET_ARGS]  # no padding: whole steps only
    out = {}

    def go(name, script, *args, **kw):
        out[name] = _launch(root / name, script, *map(str, args), **kw)

    def resumes():  # one epoch, then its checkpoint resumed by the port and by the kept sampler
        go("imagenet-1", IMAGENET_PORT, *IMAGENET_ARGS, "--epochs", 1, split=[SPLIT])
        ckpt = out["imagenet-1"][1] / "checkpoint.pth.tar"
        go("imagenet-resumed", IMAGENET_PORT, *IMAGENET_ARGS, "--epochs", 2, "--resume", ckpt,
           split=[SPLIT])
        go("kept-sampler-resumed", kept, *IMAGENET_ARGS, "--epochs", 2, "--resume", ckpt,
           split=[SPLIT], fails=True)

    start = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PORT_TRACE", "trace")
        mp.setenv("NANOGPT_DATA", str(root / "data"))
        mp.delenv("PORT_SIZES", raising=False)
        with ThreadPoolExecutor(2) as pool:
            jobs = [pool.submit(resumes),
                    pool.submit(go, "imagenet-2", IMAGENET_PORT, *IMAGENET_ARGS, "--epochs", 2,
                                split=[SPLIT]),
                    pool.submit(go, "nanogpt", NANOGPT),
                    pool.submit(go, "imagenet-original", IMAGENET, *IMAGENET_ARGS, "--epochs", 2),
                    pool.submit(go, "nanogpt-port", NANOGPT_PORT, split=NANO_SPLITS),
                    pool.submit(go, "imagenet-nobn", nobn, *at_96, "--epochs", 2),
                    pool.submit(go, "imagenet-nobn-port", nobn_port, *at_96, "--epochs", 2,
                                split=[SPLIT])]
            for j in jobs:
                j.result()
    print("runs (2 at a time): " + ", ".join(
        f"{k} {r.seconds:.1f} s" + (f" (after {r.aborts} aborted at exit)" if r.aborts else "")
        for k, (r, _) in out.items()) + f"; {time.monotonic() - start:.1f} s in all")
    return out


def _ok(runs, name):
    r, d = runs[name]
    assert r.returncode == 0, f"{name}: exit {r.returncode}\n{r.stderr[-3000:]}"
    return r, d


def _port_steps(reads, split, n):
    """Each step's global batch of an epoch from the ranks' reads (rank r read ``split[r]`` per
    whole step, in step order; the short last step's reads are what is left)."""
    full = n // sum(split)
    steps = [sum((reads[r][s * split[r]:(s + 1) * split[r]] for r in range(WORLD)), [])
             for s in range(full)]
    if n % sum(split):
        steps.append(sum((reads[r][full * split[r]:] for r in range(WORLD)), []))
    return steps


def _sampler_reads(n, epoch):
    """Each rank's reads of an epoch in the original (DistributedSampler, seed 0, padded)."""
    out = []
    for r in range(WORLD):
        s = DistributedSampler(range(n), num_replicas=WORLD, rank=r, seed=0)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def _original_steps(n, epoch, batch=8):
    """Each step's global batch of the original: every rank's next ``batch`` reads."""
    reads = _sampler_reads(n, epoch)
    return [sum((reads[r][k:k + batch] for r in range(WORLD)), [])
            for k in range(0, len(reads[0]), batch)]


def _ints(lines):
    return [int(i) for i in lines]


# ------------------------------------------------------------------ the changed lines


def test_the_ports_change_few_lines():
    # imagenet: import, the samplers and the loaders, the Balancer, the loader's state saved and
    # restored, set_epoch, accuracy() on an empty batch; nanoGPT: DataLoaderLite's shared
    # position, the Balancer, the micro-steps in bal.step() (re-indented), the logged loss
    for before, after, most in ((IMAGENET, IMAGENET_PORT, 19), (NANOGPT, NANOGPT_PORT, 27)):
        changed, added, removed = changed_lines(code_lines(before), code_lines(after))
        print(f"{os.path.basename(after)}: {changed} lines changed ({added} added, {removed} removed)")
        assert changed <= most, (after, changed, added, removed)
    # the instrumentation the traces come from is the originals', line for line
    for before, after in ((IMAGENET, IMAGENET_PORT), (NANOGPT, NANOGPT_PORT)):
        mine = [line for line in code_lines(after) if "port_trace" in line]
        assert mine == [line for line in code_lines(before) if "port_trace" in line]


# ------------------------------------------------------------------ the originals


def test_the_originals_pad_the_training_epoch_and_read_a_validation_sample_twice(runs):
    """What the ports are compared against. imagenet: DistributedSampler pads 97 samples to 98
    (the permutation's first sample twice: first on rank 0, last on rank 1); validation with
    DistributedSampler(shuffle=False, drop_last=True) gives each rank 26 of the 53 samples, then
    every rank's "aux" pass reads the leftover range(len(sampler) * world, 53) = [52]: 54 reads.
    nanoGPT: in each micro-step rank r reads the r-th of the ranks' consecutive B*T-token blocks
    (a shard's tail too short for a whole micro-step is skipped)."""
    out, d = _ok(runs, "imagenet-original")
    for epoch in range(2):
        reads = [_ints(trace(d, "train", r, "epoch")[epoch]) for r in range(WORLD)]
        assert reads == _sampler_reads(97, epoch)
        counts = np.bincount(reads[0] + reads[1], minlength=97)
        assert counts.sum() == 98 and np.flatnonzero(counts == 2).tolist() == [reads[0][0]] == [reads[1][-1]]
        val = [_ints(trace(d, "val", r, "val")[epoch]) for r in range(WORLD)]
        for r in range(WORLD):
            assert val[r] == list(range(r, 52, WORLD)) + [52], (epoch, r)
    assert out.stdout.count("Test: [1/5]") == 2 * WORLD  # len(val_loader) 4, plus 1: the aux pass
    assert results(d, 0) == results(d, 1)
    nano, nd = _ok(runs, "nanogpt")
    B, T, accum = 4, 16, 2
    for step in range(10):
        for m in range(accum):  # the micro-step's ranks read consecutive blocks of one shard
            reads = [tuple(map(int, trace(nd, "train", r, "step")[step][m].split())) for r in range(WORLD)]
            shard, pos = reads[0][:2]
            assert reads == [(shard, pos + r * B * T, B, T) for r in range(WORLD)], (step, m, reads)


# ------------------------------------------------------------------ imagenet


def test_imagenet_port_reads_each_sample_once_and_resumes_exactly(runs):
    full, d = _ok(runs, "imagenet-2")
    train_size, val_size = 97, 53
    train = [trace(d, "train", r, "epoch") for r in range(WORLD)]
    val = [trace(d, "val", r, "val") for r in range(WORLD)]
    for epoch in range(2):
        reads = [_ints(train[r][epoch]) for r in range(WORLD)]
        # 6 whole steps of 5 + 11 samples, then the short last step's 1 sample, on rank 1 (the
        # larger share); rank 0's batch of that step is empty, and hetlb's collate reads
        # dataset[0] to shape it (hetlb.data.collate.EmptySafeCollate): a read not trained
        assert [len(r) for r in reads] == [31, 67], reads
        assert reads[0][-1] == 0
        reads[0].pop()
        # every training sample trained exactly once per epoch over the ranks (the original: 98)
        assert np.bincount(reads[0] + reads[1], minlength=train_size).tolist() == [1] * train_size
        # each step holds the original's step's samples (the same permutation), in its order;
        # the original's last step also holds the padding (the permutation's first sample again)
        perm = torch.randperm(train_size, generator=torch.Generator().manual_seed(epoch)).tolist()
        mine, theirs = _port_steps(reads, SPLIT, train_size), _original_steps(train_size, epoch)
        assert len(mine) == len(theirs) == 7
        for s in range(6):
            assert mine[s] == perm[16 * s:16 * s + 16] and sorted(mine[s]) == sorted(theirs[s])
        assert mine[6] == [perm[96]] and sorted(theirs[6]) == sorted([perm[96], perm[0]])
        # validation: every sample once (the original: 54 reads, sample 52 on both ranks)
        seen = [_ints(val[r][epoch]) for r in range(WORLD)]
        assert np.bincount(seen[0] + seen[1], minlength=val_size).tolist() == [1] * val_size
        assert sorted(len(s) for s in seen) == [26, 27]
    # no leftover pass: len(val_loader) batches, not the original's len(val_loader) + 1
    assert full.stdout.count("Test: [1/4]") == 2 * WORLD and "Test: [1/5]" not in full.stdout
    assert full.stdout.count("Epoch: [0][1/7]") == WORLD
    # both ranks report the same top-1 over all 53 samples and hold the same weights
    assert results(d, 0) == results(d, 1) and len(results(d, 0)) == 2
    for line in results(d, 0):
        correct = float(line.split()[4]) * val_size / 100
        assert abs(correct - round(correct)) < 1e-3, line

    # Stopped after one epoch and resumed from its checkpoint: the second epoch is the same.
    _, d1 = _ok(runs, "imagenet-1")
    resumed, d2 = _ok(runs, "imagenet-resumed")
    assert results(d1, 0) == results(d, 0)[:1]
    assert resumed.stdout.count("(epoch 1)") == WORLD, resumed.stdout  # "=> loaded checkpoint ..."
    for r in range(WORLD):
        assert trace(d2, "train", r, "epoch") == {1: train[r][1]}
    assert results(d2, 0) == results(d2, 1) == results(d, 0)[1:]
    want, got = torch.load(d / "checkpoint.pth.tar"), torch.load(d2 / "checkpoint.pth.tar")
    assert want["epoch"] == got["epoch"] == 2
    assert want["state_dict"].keys() == got["state_dict"].keys()
    for k, v in want["state_dict"].items():  # parameters and BatchNorm buffers
        assert torch.equal(got["state_dict"][k], v), k
    assert want["loader"]["steps"] == got["loader"]["steps"] == 14


def test_imagenet_port_trains_the_original_s_parameters_without_batchnorm(runs):
    # 96 samples, 6 whole steps an epoch: the original's steps hold the port's samples
    _, orig = _ok(runs, "imagenet-nobn")
    _, port = _ok(runs, "imagenet-nobn-port")
    for epoch in range(2):
        reads = [_ints(trace(port, "train", r, "epoch")[epoch]) for r in range(WORLD)]
        theirs = [_ints(trace(orig, "train", r, "epoch")[epoch]) for r in range(WORLD)]
        mine, want = _port_steps(reads, SPLIT, 96), _original_steps(96, epoch)
        assert theirs == _sampler_reads(96, epoch)
        assert len(mine) == 6 and [sorted(s) for s in mine] == [sorted(s) for s in want]
    a, b = torch.load(orig / "checkpoint.pth.tar"), torch.load(port / "checkpoint.pth.tar")
    for k, v in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][k], v, rtol=0, atol=1e-6)


def test_a_kept_distributed_sampler_without_the_loader_state_fails_the_resume(runs):
    r, d = runs["kept-sampler-resumed"]
    assert r.returncode != 0, r.stdout[-2000:]
    # said when the loader's first training iteration starts, then refused: the sampler says
    # epoch 1, the loader (its state not restored) would train epoch 0's order again
    assert "1 torch DistributedSampler(s) over this training loader's dataset" in r.stderr
    assert "was set to epoch 1 (set_epoch), but this hetlb loader is about to train epoch 0" in r.stderr, \
        r.stderr[-3000:]
    for rank in range(WORLD):  # before reading a sample
        assert trace(d, "train", rank, "epoch") == {1: []}


# ------------------------------------------------------------------ nanoGPT


def test_nanogpt_port_reads_the_original_s_sequences_logs_its_loss_and_trains_its_model(runs):
    orig, od = _ok(runs, "nanogpt")
    port, pd = _ok(runs, "nanogpt-port")
    steps, T, accum = 10, 16, 2
    for name, out in (("original", orig), ("port", port)):
        assert "=> calculated gradient accumulation steps: 2" in out.stdout, name
    theirs = [trace(od, "train", r, "step") for r in range(WORLD)]
    mine = [trace(pd, "train", r, "step") for r in range(WORLD)]

    def sequences(reads):
        """(shard, first token) of every sequence the ranks' reads of one micro-step hold."""
        out = []
        for shard, pos, b, t in (tuple(map(int, line.split())) for line in reads):
            assert t == T
            out += [(shard, pos + i * T) for i in range(b)]
        return out

    for step in range(steps):
        split = NANO_SPLITS[min(step, len(NANO_SPLITS) - 1)]
        for m in range(accum):
            got = sequences([mine[r][step][m] for r in range(WORLD)])
            want = sequences([theirs[r][step][m] for r in range(WORLD)])
            # the micro-step's 8 consecutive sequences, none twice, none skipped, split unevenly
            assert len(got) == len(set(got)) == 8 and sorted(got) == sorted(want), (step, m, got, want)
            assert [int(mine[r][step][m].split()[2]) for r in range(WORLD)] == split, (step, m)
    # the logged loss: the step's mean over all its tokens (the original's all_reduce AVG of
    # equal splits); printed with 6 decimals, so equal to one unit of the last digit
    want = [(int(s), float(v)) for s, v in LOG_LINE.findall(orig.stdout)]
    got = [(int(s), float(v)) for s, v in LOG_LINE.findall(port.stdout)]
    assert [s for s, _ in got] == [s for s, _ in want] == list(range(steps))
    for (s, a), (_, b) in zip(got, want):
        assert abs(a - b) <= 1e-6 + 1e-9, (s, a, b)
    with open(pd / "log" / "log.txt") as f:
        log = f.read().splitlines()
    assert [line for line in log if " train " in line] == [f"{s} train {v:.6f}" for s, v in got]
    # the validation (equal splits, not balanced) and the parameters it checkpoints (after 5 and 9
    # of the 10 optimizer steps)
    for step in (5, 9):
        with torch.serialization.safe_globals([GPTConfig]):
            a = torch.load(od / "log" / f"model_{step:05d}.pt")
            b = torch.load(pd / "log" / f"model_{step:05d}.pt")
        assert abs(a["val_loss"] - b["val_loss"]) < 1e-6, step
        for k, v in a["model"].items():
            torch.testing.assert_close(b["model"][k], v, rtol=0, atol=1e-5)
    for r in range(WORLD):  # the validation reads as the original's
        assert trace(pd, "val", r, "val") == trace(od, "val", r, "val")
