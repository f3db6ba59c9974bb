"""hetlb.init_process_group under torchrun: a worker crashes mid-epoch, torchrun restarts the group,
the script resumes from its checkpoint; the committed trajectory trains every sample of each epoch
exactly once and ends with the uninterrupted run's model."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import hetlb

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "elastic_worker.py")


def torchrun(out, *args, nproc=4, restarts=1):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={restarts}", "--monitor-interval=0.2", WORKER, "--out", str(out), *map(str, args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def committed(out, epochs=2):
    """Per epoch, the indices trained by the steps that count: those of the last attempt, and the
    earlier attempts' steps before the step that attempt resumed from."""
    rows = []
    for name in os.listdir(out):
        if name.startswith("seen."):
            with open(os.path.join(out, name)) as f:
                rows += [tuple(map(int, line.split())) for line in f]
    rows = np.array(rows).reshape(-1, 4)  # attempt, step, epoch, index
    keep = np.zeros(len(rows), bool)
    last = rows[:, 0].max()
    for a in range(last + 1):
        later = rows[rows[:, 0] > a]
        cut = later[:, 1].min() if len(later) else np.inf  # the step the next attempt started at
        keep |= (rows[:, 0] == a) & (rows[:, 1] < cut)
    rows = rows[keep]
    return [sorted(rows[rows[:, 2] == e, 3].tolist()) for e in range(epochs)], last


def test_a_crashed_worker_is_restarted_and_the_run_continues_exactly_once(tmp_path):
    ref, crash = tmp_path / "ref", tmp_path / "crash"
    ref.mkdir()
    crash.mkdir()
    r = torchrun(ref)
    assert r.returncode == 0, r.stderr[-3000:]
    r = torchrun(crash, "--kill-rank", 1, "--kill-step", 8)
    assert r.returncode == 0, r.stderr[-3000:]
    epochs, attempts = committed(crash)
    assert attempts == 1  # it did restart
    for e, seen in enumerate(epochs):
        assert seen == list(range(96)), f"epoch {e}"
    want = torch.load(ref / "final.pt")
    got = torch.load(crash / "final.pt")
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-8)


def test_checkpointer_keeps_the_last_k_and_skips_a_damaged_file(tmp_path):
    ck = hetlb.Checkpointer(tmp_path / "c", keep=2, rank=0)
    assert ck.latest() is None
    for step in (3, 6, 9):
        ck.save({"x": torch.tensor([float(step)])}, step=step)
    assert ck.steps() == [6, 9] and not [n for n in os.listdir(tmp_path / "c") if ".tmp" in n]
    assert ck.latest()["step"] == 9 and ck.latest()["x"].item() == 9.0
    with open(ck.path(9), "wb") as f:
        f.write(b"torn")  # a file damaged outside the helper
    assert ck.latest()["step"] == 6
    other = hetlb.Checkpointer(tmp_path / "c", keep=2, rank=1)
    assert other.save({"x": torch.zeros(1)}, step=12) is None and ck.steps() == [6, 9]
    with pytest.raises(ValueError, match="keep must be"):
        hetlb.Checkpointer(tmp_path, keep=0)
    with pytest.raises(ValueError, match="state must be a dict"):
        ck.save([1], step=1)


def test_outside_torchrun_it_is_torch_s(monkeypatch):
    # No agent store: the arguments go to torch unchanged (a FileStore rendezvous here).
    import tempfile
    import torch.distributed as dist
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with tempfile.TemporaryDirectory() as d:
        hetlb.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        finally:
            dist.destroy_process_group()
