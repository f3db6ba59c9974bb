"""hetlb.init_process_group under torchrun: a worker crashes mid-epoch (or a node is lost, or one
joins), torchrun restarts the group, the script resumes from its checkpoint; the committed
trajectory trains every sample of each epoch exactly once and ends with the uninterrupted run's
model, whatever the number of workers the job came back on."""
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import hetlb

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "elastic_worker.py")


def torchrun(out, *args, nproc=4, restarts=1, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={restarts}", "--monitor-interval=0.2", WORKER, "--out", str(out), *map(str, args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(out, port, *args, host=False, nnodes="3:4", restarts=2, env=(), share_store=False, conf=""):
    """One torchrun agent with one worker: a "node" of a multi-node job on the c10d rendezvous.

    The agents' shared store is turned off (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as docs/restarts.md
    tells users of ``--nnodes MIN:MAX``): with it, torch 2.13's agents cannot re-form a group that a
    node joined (the new round's MASTER_ADDR is never published when rank 0 stays rank 0).
    """
    conf = f"is_host={int(host)},last_call_timeout=2,join_timeout=120" + conf
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=hetlb-test",
           f"--rdzv-conf={conf}", f"--max-restarts={restarts}", "--monitor-interval=0.2",
           WORKER, "--out", str(out), *map(str, args)]
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **dict(env))
    if not share_store:
        e["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return subprocess.Popen(cmd, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(procs, timeout=300):
    """Wait for every agent; the return codes and the stderr tails."""
    deadline = time.monotonic() + timeout
    codes, errs = [], []
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            codes.append(p.returncode)
            errs.append(err[-2000:])
    finally:
        for p in procs:
            p.kill()
    return codes, "\n---\n".join(errs)


def committed(out, epochs=2):
    """Per epoch, the indices trained by the steps that count: those of the last attempt, and the
    earlier attempts' steps before the step the next attempt resumed from; and the number of
    attempts."""
    rows = []
    for name in os.listdir(out):
        if name.startswith("seen."):
            with open(os.path.join(out, name)) as f:
                rows += [tuple(map(int, line.split())) for line in f]
    rows = np.array(rows, dtype=np.int64).reshape(-1, 4)  # attempt id, step, epoch, index
    keep = np.zeros(len(rows), bool)
    ids = np.unique(rows[:, 0])
    for a in ids:
        later = rows[rows[:, 0] > a]
        cut = later[:, 1].min() if len(later) else np.inf  # the step the next attempt started at
        keep |= (rows[:, 0] == a) & (rows[:, 1] < cut)
    rows = rows[keep]
    return [sorted(rows[rows[:, 2] == e, 3].tolist()) for e in range(epochs)], len(ids) - 1


def worlds(out):
    with open(os.path.join(out, "worlds")) as f:
        return [int(w) for _, w in sorted(tuple(map(int, line.split())) for line in f)]


def same_model(a, b):
    for x, y in zip(torch.load(a / "final.pt"), torch.load(b / "final.pt")):
        np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=0, atol=1e-8)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run on 4 workers."""
    ref = tmp_path_factory.mktemp("ref")
    r = torchrun(ref, "--epochs", 3)
    assert r.returncode == 0, r.stderr[-3000:]
    return ref


def test_two_crashes_in_a_row(tmp_path, reference):
    # Each attempt loses a rank one or two steps after its first checkpoint (bench/bench_restarts.py
    # runs 20 in a row): rank 0 at step 4 (mid-epoch, resumed from step 3), then rank 1 at step 8
    # (resumed from step 6, an epoch's end), each restart a crashed worker's.
    r = torchrun(tmp_path, "--epochs", 3, "--crashes", 2, restarts=2)
    assert r.returncode == 0, r.stderr[-3000:]
    epochs, restarts = committed(tmp_path, 3)
    assert restarts == 2
    for e, seen in enumerate(epochs):
        assert seen == list(range(96)), f"epoch {e}"
    same_model(tmp_path, reference)


def test_a_lost_node_restarts_the_job_on_three_workers(tmp_path, reference):
    # Four one-worker nodes on the c10d rendezvous (--nnodes 3:4); the fourth node's agent dies at
    # step 8: the job comes back on three workers, re-planned, from the checkpoint at step 6.
    port = free_port()
    # torch's default shared agent store here (hetlb.init_process_group's fresh-store path). A node
    # whose agent sent no heartbeat for 3 s is dead (torch's default: 15 s, most of this test's time).
    procs = [agent(tmp_path, port, "--epochs", 3, host=i == 0, share_store=True,
                   conf=",keep_alive_interval=1,keep_alive_max_attempt=3",
                   env={"HETLB_TEST_LOSE_NODE": "8"} if i == 3 else {}) for i in range(4)]
    codes, err = finish(procs)
    assert codes[:3] == [0, 0, 0] and codes[3] != 0, err
    assert worlds(tmp_path) == [4, 3], err
    epochs, _ = committed(tmp_path, 3)
    for e, seen in enumerate(epochs):
        assert seen == list(range(96)), f"epoch {e}"
    same_model(tmp_path, reference)


def test_a_joining_node_restarts_the_job_on_five_workers(tmp_path, reference):
    # Four nodes (--nnodes 4:5) train to step 9 and wait there; a fifth agent joins, torchrun
    # restarts the group for the new membership and the job finishes on five workers.
    port = free_port()
    procs = [agent(tmp_path, port, "--epochs", 3, host=i == 0, nnodes="4:5",
                   env={"HETLB_TEST_HOLD": "9"}) for i in range(4)]
    deadline = time.monotonic() + 180
    while not (tmp_path / "held").exists():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), finish(procs, 1)[1]
        time.sleep(0.2)
    procs.append(agent(tmp_path, port, "--epochs", 3, nnodes="4:5"))
    codes, err = finish(procs)
    assert codes == [0] * 5, err
    assert worlds(tmp_path) == [4, 5], err
    epochs, _ = committed(tmp_path, 3)
    for e, seen in enumerate(epochs):
        assert seen == list(range(96)), f"epoch {e}"
    same_model(tmp_path, reference)


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


def test_checkpointer_refuses_what_latest_cannot_load_and_keeps_what_it_wrote(tmp_path, caplog):
    import numpy as np
    ck = hetlb.Checkpointer(tmp_path / "c", keep=2, rank=0)
    for step in (100, 200):
        ck.save({"x": torch.tensor([float(step)])}, step=step)
    # A NumPy scalar used to be saved, then skipped by latest() (weights_only): a silent fresh
    # start, whose own checkpoints keep= then deleted at once (older step numbers).
    with pytest.raises(ValueError, match="not written: torch.load.weights_only=True"):
        ck.save({"x": torch.zeros(1), "best": np.float64(0.5)}, step=300)
    assert ck.steps() == [100, 200] and not [n for n in os.listdir(tmp_path / "c") if ".tmp" in n]
    assert ck.latest()["step"] == 200
    ck.save({"x": torch.zeros(1)}, step=10)  # steps went backwards (a run restarted from scratch)
    assert 10 in ck.steps() and "written below newer ones [100, 200]" in caplog.text
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        hetlb.Checkpointer(tmp_path / "f")


def test_checkpointer_removes_what_a_killed_save_left_behind(tmp_path):
    ck = hetlb.Checkpointer(tmp_path, keep=2, rank=0)
    ck.save({"x": torch.zeros(1)}, step=1)
    # A writer killed mid-save (the previous attempt's pid) leaves a temporary file as large as a
    # checkpoint; it used to stay for good. A writer still running keeps its file.
    import subprocess
    dead = subprocess.Popen(["true"])
    dead.wait()
    for name in (f"ckpt-000000002.pt.tmp.{dead.pid}", f"ckpt-000000005.pt.tmp.{dead.pid}",
                 f"ckpt-000000002.pt.tmp.{os.getppid()}"):
        (tmp_path / name).write_bytes(b"partial")
    ck.save({"x": torch.ones(1)}, step=3)
    assert sorted(os.listdir(tmp_path)) == sorted([
        "ckpt-000000001.pt", "ckpt-000000003.pt", f"ckpt-000000002.pt.tmp.{os.getppid()}",
        f"ckpt-000000005.pt.tmp.{dead.pid}"])  # (a running writer's, and a later step's: kept)
    assert ck.latest()["step"] == 3
    os.remove(tmp_path / f"ckpt-000000002.pt.tmp.{os.getppid()}")
    ck.save({"x": torch.ones(1)}, step=5)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000003.pt", "ckpt-000000005.pt"]


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


def test_a_stuck_worker_is_named_and_the_job_restarts(tmp_path, reference):
    # Rank 2 stops (alive) before the forward of step 5; the others wait in the all-reduce. Their
    # watchdogs (stall 4 s, far below the 60 s collective timeout) name rank 2 as behind, end the
    # attempt, and torchrun restarts the group, which finishes exactly once.
    r = torchrun(tmp_path, "--epochs", 3, "--hang-rank", 2, "--hang-step", 5, "--watchdog", 4)
    assert r.returncode == 0, r.stderr[-3000:]
    named = [line for line in r.stderr.splitlines() if "hetlb watchdog:" in line]
    assert named, r.stderr[-3000:]
    assert all("behind (alive, not progressing): rank 2 (" in line and "at step 4 (compute)" in line
               for line in named), named
    # torchrun logs the first worker that failed: one the watchdog ended (its exit code), or rank
    # 0, whose watchdog waits a moment before it exits (it serves the store the others read) and
    # whose collective may fail first, when a rank that exited closes its connection.
    assert f"exitcode: {hetlb.ranks.watchdog.EXIT_CODE})" in r.stderr or \
        "Connection closed by peer" in r.stderr, r.stderr[-3000:]
    epochs, restarts = committed(tmp_path, 3)
    assert restarts == 1
    for e, seen in enumerate(epochs):
        assert seen == list(range(96)), f"epoch {e}"
    same_model(tmp_path, reference)


def test_probing_a_dead_attempt_s_store_is_quick_and_quiet(capfd):
    # A restarted group probes the store address the failed attempt left; a TCPStore client
    # retried there until its timeout and logged each try with a C++ stack trace (a user audit,
    # session 26: about 40 lines and 4 s per restart).
    from hetlb.ranks.elastic import _connect
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    t = time.perf_counter()
    assert _connect("127.0.0.1", port, 2, "token") is None
    assert time.perf_counter() - t < 1.0
    err = capfd.readouterr().err
    assert "socket.cpp" not in err and "frame #" not in err, err[:500]
    # a live store holding the token is still found
    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    store.set("hetlb/token", "token")
    client = _connect("127.0.0.1", store.port, 2, "token")
    assert client is not None and client.get("hetlb/token") == b"token"
    assert _connect("127.0.0.1", store.port, 2, "other") is None
