"""Parameter-server modes (LSP, SSP, ASP) on real torch.distributed.rpc processes."""
from __future__ import annotations

import os
import time
from functools import partial

import numpy as np
import pytest
import torch

from distributed import run, unwrap
from fixed_policy import Fixed

N, DIM = 96, 5


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, DIM, generator=g)
    y = x @ torch.arange(1.0, DIM + 1) + 0.1 * torch.randn(N, generator=g)
    return torch.utils.data.TensorDataset(x, y.unsqueeze(1))


def _model():
    torch.manual_seed(1)
    return torch.nn.Linear(DIM, 1)


def _bn_model():
    # BatchNorm first: its batch statistics depend on the data only, so a test can replay them
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.BatchNorm1d(DIM), torch.nn.Linear(DIM, 1))


def _ps(rank, world, init, mode, speeds, kw, die=None):
    """One process of a parameter-server run; returns the server's log and model, or the
    worker's iterations."""
    import hetlb
    from hetlb.sync.ps import run_ps

    calls = {"n": 0}

    def loss_fn(out, y):
        calls["n"] += 1
        if die is not None and rank == die[0] and calls["n"] == die[1]:
            if len(die) > 2:
                time.sleep(die[2])  # alive but far too slow: the server drops it meanwhile
            else:
                os._exit(3)  # a worker process killed mid-training
        return torch.nn.functional.mse_loss(out, y)

    emu = None if rank == 0 else hetlb.sim.emulate.Emulator(
        hetlb.LinearModel(0.004, 0.0005), speed=speeds[rank - 1])
    policy = kw.pop("policy", None)
    if policy is not None and rank == 0:
        kw["policy"] = policy()
    model = _bn_model() if kw.pop("bn", False) else _model()
    out = run_ps(mode, model, _data(), loss_fn, global_batch=kw.pop("global_batch", 24),
                 rank=rank, world_size=world, init_method=init, emulator=emu, **kw)
    if rank == 0:
        s = out["server"]
        return {"log": s.log, "model": {k: v.clone() for k, v in s.model.state_dict().items()},
                "sizes": s.sizes.tolist(), "version": s.version, "alive": s.alive.tolist()}
    return {"iterations": len(out["worker"].iterations), "dropped": out["worker"].dropped}


def _applied(log, epochs):
    """Per epoch, how often each sample's gradient was applied."""
    counts = np.zeros((epochs, N), np.int64)
    for e in log:
        if e["kind"] == "sync":
            np.add.at(counts[e["epoch"]], e["indices"], 1)
    return counts


def test_ssp_never_exceeds_staleness_and_asp_does():
    s = 2
    speeds = (1.0, 1.0, 0.2)  # worker 3 five times slower
    server = unwrap(run(_ps, 4, "ssp", speeds, {"staleness": s, "epochs": 2}, backend="rpc"))[0]
    hand = [e for e in server["log"] if e["kind"] == "handout"]
    gaps = [e["clock"] - e["min_clock"] for e in hand]
    assert max(gaps) <= s, f"a worker ran {max(gaps)} iterations ahead (bound {s})"
    assert max(gaps) == s  # the bound was reached, so it is what held the fast workers back
    assert (_applied(server["log"], 2) == 1).all()
    asp = unwrap(run(_ps, 4, "asp", speeds, {"epochs": 2}, backend="rpc"))[0]
    gaps = [e["clock"] - e["min_clock"] for e in asp["log"] if e["kind"] == "handout"]
    assert max(gaps) > s  # without the bound the fast workers run ahead (the check can fail)
    assert (_applied(asp["log"], 2) == 1).all()
    syncs = [e for e in asp["log"] if e["kind"] == "sync"]
    assert all(len(e["members"]) == 1 and e["type"] == "async" for e in syncs)


def test_lsp_first_l_and_global_every_m():
    l, m = 2, 3
    speeds = (1.0, 0.7, 0.3)
    server = unwrap(run(_ps, 4, "lsp", speeds, {"l": l, "m": m, "epochs": 2}, backend="rpc"))[0]
    pending: list = []
    since_global = 0
    kinds = []
    working = {1, 2, 3}
    for e in server["log"]:
        if e["kind"] == "push":
            pending.append(e["rank"])
        elif e["kind"] == "epoch":
            working = {1, 2, 3}
        elif e["kind"] == "sync":
            kinds.append(e["type"])
            if e["type"] == "limited":
                assert since_global < m
                assert e["members"] == pending[:l], (e["members"], pending)
                since_global += 1
            elif e["type"] == "global":
                assert since_global == m, f"global after {since_global} limited ones (m={m})"
                assert sorted(e["members"]) == sorted(pending)
                assert set(e["members"]) <= working
                since_global = 0
            else:  # fewer than l workers still had work: the epoch's tail
                assert e["type"] == "flush" and len(e["members"]) < l
                since_global += 1
            for r in e["members"]:
                pending.remove(r)
    assert kinds.count("limited") >= 2 * m and kinds.count("global") >= 2
    assert (_applied(server["log"], 2) == 1).all()
    # The fast worker synchronised more often than the slow one (limited syncs take the first).
    members = [r for e in server["log"] if e["kind"] == "sync" for r in e["members"]]
    assert members.count(1) > members.count(3)


def test_lsp_killed_worker_share_moves_and_training_finishes():
    speeds = (1.0, 1.0, 1.0)
    res = run(_ps, 4, "lsp", speeds, {"l": 2, "m": 2, "epochs": 2, "timeout": 2.0},
              (2, 4), backend="rpc", may_die=(2,))
    assert res[2][0] == "died"
    server = res[0][1]
    assert res[0][0] == "ok" and res[1][0] == "ok" and res[3][0] == "ok", res
    log = server["log"]
    drops = [e for e in log if e["kind"] == "drop"]
    assert [d["rank"] for d in drops] == [2]
    assert server["alive"] == [True, False, True]
    at = log.index(drops[0])
    assert all(e["rank"] != 2 for e in log[at:] if e["kind"] == "handout")
    # Its share went to the survivors: it is held at the lower bound (1), they carry the rest.
    assert server["sizes"][1] == 1 and sum(server["sizes"]) == 24
    assert server["sizes"][0] + server["sizes"][2] == 23
    # The samples it held were handed out again: every sample exactly once per epoch.
    assert (_applied(log, 2) == 1).all()


def test_late_worker_is_dropped_told_and_its_samples_redone(mode="ssp"):
    # Iterations of 0.4 s (speed 0.02), three epochs (about 5 s): worker 2 stalls 2.5 s in its
    # third iteration, is dropped after 1 s and calls in while the others still train.
    res = unwrap(run(_ps, 4, mode, (0.02, 0.02, 0.02), {"epochs": 3, "timeout": 1.0},
                     (2, 3, 2.5), backend="rpc"))
    server = res[0]
    assert res[2]["dropped"] and not res[1]["dropped"] and not res[3]["dropped"]
    assert [e["rank"] for e in server["log"] if e["kind"] == "drop"] == [2]
    # Its late gradient was not applied; the samples it held were trained by the others.
    assert (_applied(server["log"], 3) == 1).all()
    assert not any(2 in e["members"] for e in server["log"]
                   if e["kind"] == "sync" and e["time"] > [d for d in server["log"]
                                                          if d["kind"] == "drop"][0]["time"])


def test_lsp_all_workers_is_one_large_batch():
    """l = K and unequal batches: every update is the mean gradient of the union of the
    workers' batches (sum of summed gradients over the total), replayed in one process."""
    server = unwrap(run(_ps, 3, "lsp", (1.0, 0.5),
                        {"l": 2, "m": 1, "epochs": 1, "policy": partial(Fixed, [7, 3]),
                         "global_batch": 10},
                        backend="rpc"))[0]
    syncs = [e for e in server["log"] if e["kind"] == "sync"]
    assert {len(e["members"]) for e in syncs[:-1]} == {2}
    assert all(st == 0 for e in syncs for st in e["stale"])  # all on the same parameters
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data().tensors
    for e in syncs:
        idx = torch.tensor(e["indices"])
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(server["model"][k], v, rtol=1e-5, atol=1e-6)
    sizes = [e["n"] for e in server["log"] if e["kind"] == "handout"][:2]
    assert sorted(sizes) == [3, 7]


def test_server_checkpoint_resume_exactly_once(tmp_path):
    kw = {"l": 2, "m": 2, "epochs": 2, "checkpoint_every": 3, "timeout": 5.0, "global_batch": 12}
    res = run(_ps_ckpt, 4, "lsp", (1.0, 0.8, 0.6), kw, str(tmp_path), 6, backend="rpc",
              may_die=(0, 1, 2, 3))
    assert res[0] == ("died", 4)  # the server process died right after checkpointing update 6
    assert all(r[0] == "error" or r[0] == "died" for r in res[1:])  # the workers noticed, no hang
    import hetlb
    state = hetlb.Checkpointer(str(tmp_path), rank=0).latest()
    assert state["version"] == 6 and state["epoch"] == 0
    before = state["applied"].numpy()
    assert 0 < before.sum() < N
    second = unwrap(run(_ps_ckpt, 4, "lsp", (1.0, 0.8, 0.6), kw, str(tmp_path), None,
                        backend="rpc"))[0]
    counts = _applied(second["log"], 2)
    counts[0] += before
    assert (counts == 1).all()
    first = [e for e in second["log"] if e["kind"] == "sync"][0]
    assert first["version"] == 7  # continues from the checkpoint's update count


def _ps_ckpt(rank, world, init, mode, speeds, kw, directory, die_at):
    import hetlb

    class Dying(hetlb.Checkpointer):
        def save(self, state, step):
            path = super().save(state, step)
            if die_at is not None and step >= die_at:
                os._exit(4)  # the server process dies right after this checkpoint
            return path

    kw = dict(kw)
    if rank == 0:
        kw["checkpointer"] = Dying(directory, keep=2, rank=0)
    return _ps(rank, world, init, mode, speeds, kw)


def test_bad_arguments():
    from hetlb.sync.ps import ParameterServer
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="mode"):
        ParameterServer(model, opt, N, 24, 3, "bsp")
    with pytest.raises(ValueError, match="l must be <= workers"):
        ParameterServer(model, opt, N, 24, 3, "lsp", l=4)
    with pytest.raises(ValueError, match="global_batch"):
        ParameterServer(model, opt, N, 2, 3, "lsp")
    with pytest.raises(ValueError, match="policy"):
        ParameterServer(model, opt, N, 24, 3, "lsp", policy=object())
    with pytest.raises(ValueError, match="timeout"):
        ParameterServer(model, opt, N, 24, 3, "ssp", timeout=0)
    ps = ParameterServer(model, opt, N, 24, 3, "ssp")
    with pytest.raises(ValueError, match="not a ParameterServer checkpoint"):
        ps.load_state_dict({"model": {}})
    other = ParameterServer(model, opt, N, 24, 2, "ssp").state_dict()
    with pytest.raises(ValueError, match="workers=2"):
        ps.load_state_dict(other)
    # It used to resume with the checkpoint's batch sizes (summing to 12), the new total ignored.
    other = ParameterServer(model, opt, N, 12, 3, "ssp").state_dict()
    with pytest.raises(ValueError, match="the checkpoint has global_batch=12, this server 24"):
        ps.load_state_dict(other)
    # The policy's state used to load into a policy of any class or settings.
    import hetlb
    other = ParameterServer(model, opt, N, 24, 3, "ssp", policy=hetlb.WLBS()).state_dict()
    with pytest.raises(ValueError, match="holds the state of a WLBS policy, this server runs Uniform"):
        ps.load_state_dict(other)
    ps = ParameterServer(model, opt, N, 24, 3, "ssp", policy=hetlb.WLBS())
    other = ParameterServer(model, opt, N, 24, 3, "ssp", policy=hetlb.WLBS(stall=4.0)).state_dict()
    with pytest.raises(ValueError, match="WLBS policy has stall=4.0, this one stall=10.0"):
        ps.load_state_dict(other)
    ps.load_state_dict(ParameterServer(model, opt, N, 24, 3, "ssp", policy=hetlb.WLBS()).state_dict())


def test_out_of_step_push_stops_the_server_and_answers_everyone():
    """In-process (no RPC): a push of samples the worker does not hold is an error for every
    waiting worker, and serve() raises instead of training on."""
    from hetlb.sync.ps import ParameterServer
    model = _model()
    ps = ParameterServer(model, torch.optim.SGD(model.parameters(), lr=0.1), N, 24, 2, "lsp",
                         l=2, timeout=5.0)
    a = ps.call(1, {"hello": True, "hardware": {}})
    b = ps.call(2, {"hello": True, "hardware": {}})
    ra, rb = a.wait(), b.wait()
    assert len(ra["indices"]) == len(rb["indices"]) == 12 and ra["params"] is not None
    g = torch.zeros(DIM + 1)
    first = ps.call(1, {"grad": g, "n": 12, "compute": 0.01, "version": 0,
                        "indices": ra["indices"]})
    assert not first.done()  # waits for the second member of the limited synchronisation
    bad = ps.call(2, {"grad": g, "n": 12, "compute": 0.01, "version": 0,
                      "indices": ra["indices"]})
    for f in (first, bad):
        with pytest.raises(RuntimeError, match="parameter server 'hetlb-ps' failed in worker 2's "
                                               "call and stopped: RuntimeError: .*does not hold"):
            f.wait()
    ps.bye(1)  # what each worker does on the error; serve() waits for it (at most timeout)
    ps.bye(2)
    with pytest.raises(RuntimeError, match="does not hold"):
        ps.serve()


def test_in_process_checks_model_size_and_keeps_float64():
    """In-process: a worker with another model is refused at its hello; a float64 model is
    updated in float64 (sum of summed gradients over the total, then the optimizer)."""
    from hetlb.sync.ps import ParameterServer
    model = _model().double()
    ps = ParameterServer(model, torch.optim.SGD(model.parameters(), lr=0.5), N, 8, 1, "asp",
                         timeout=5.0)
    with pytest.raises(ValueError, match="same model"):  # the server's error keeps its type
        ps.call(1, {"hello": True, "hardware": {}, "numel": 3}).wait()
    # The same element count in other shapes (a user audit, session 25: before, it trained).
    from hetlb.comm.hook import shapes_digest as _shapes_digest
    other = [torch.zeros(DIM + 1, 1, dtype=torch.float64)]
    ps = ParameterServer(model, torch.optim.SGD(model.parameters(), lr=0.5), N, 8, 1, "asp",
                         timeout=5.0)
    with pytest.raises(ValueError, match="other shapes or dtypes.*same model"):
        ps.call(1, {"hello": True, "hardware": {}, "numel": DIM + 1,
                    "shapes": _shapes_digest(other)}).wait()
    ps = ParameterServer(model, torch.optim.SGD(model.parameters(), lr=0.5), N, 8, 1, "asp",
                         timeout=5.0)
    r = ps.call(1, {"hello": True, "hardware": {}, "numel": DIM + 1,
                    "shapes": _shapes_digest(list(model.parameters()))}).wait()
    assert len(r["indices"]) == 8
    model = _model().double()
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    ps = ParameterServer(model, torch.optim.SGD(model.parameters(), lr=0.5), N, 8, 1, "asp",
                         timeout=5.0)
    r = ps.call(1, {"hello": True, "hardware": {}, "numel": DIM + 1}).wait()
    g = torch.full((DIM + 1,), 1e-9, dtype=torch.float64) * torch.arange(1, DIM + 2)
    with pytest.raises(ValueError, match="malformed"):
        ps.call(1, {"grad": g[:2], "n": 8, "compute": 0.1, "version": 0,
                    "indices": r["indices"]}).wait()
    ps = ParameterServer(model, torch.optim.SGD(model.parameters(), lr=0.5), N, 8, 1, "asp",
                         timeout=5.0)
    r = ps.call(1, {"hello": True, "hardware": {}, "numel": DIM + 1}).wait()
    nxt = ps.call(1, {"grad": g * 8, "n": 8, "compute": 0.1, "version": 0,
                      "indices": r["indices"]}).wait()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert after.dtype == torch.float64
    torch.testing.assert_close(after, before - 0.5 * g, rtol=0, atol=1e-18)
    assert nxt["version"] == 1 and len(nxt["indices"]) == 8


def test_worker_refuses_an_emulated_failure():
    """fail=True used to have no effect on a worker (it pushed at full speed), while the
    Disturbance docstring said the rank reports +inf compute; a dead worker is emulated by a
    delay past the server's timeout instead."""
    import hetlb
    from hetlb.sim.emulate import Disturbance, Emulator
    from hetlb.sync.ps import Worker
    emu = Emulator(hetlb.LinearModel(0.0, 0.001), disturbances=[Disturbance(2, fail=True)])
    with pytest.raises(ValueError, match=r"fail=True is emulated by the Balancer only.*timeout"):
        Worker(_model(), _data(), torch.nn.functional.mse_loss, 1, emulator=emu)
    Worker(_model(), _data(), torch.nn.functional.mse_loss, 1,
           emulator=Emulator(disturbances=[Disturbance(2, extra=30.0)]))  # taken


@pytest.mark.parametrize("mode,kw", [("lsp", {"l": 2, "m": 1}), ("asp", {})])
def test_running_statistics_reach_the_server(mode, kw):
    """The server runs no forward pass; its BatchNorm statistics are the members' pushed ones,
    batch-weighted, at each update (a user audit, session 25: they kept their initial values, and
    the saved model normalised with mean 0 / var 1 in eval mode). Replayed in one process from
    the log: an update sets sum_k n_k * ((1 - momentum) * base_k + momentum * stat_k) / sum_k n_k,
    where base_k is the server's statistics at the version member k computed on."""
    # Even sizes over 96 samples: however the workers' pulls interleave, what is left of the
    # epoch is even, so no batch of one sample (BatchNorm refuses it in training) can occur.
    server = unwrap(run(_ps, 3, mode, (1.0, 0.5),
                        dict(kw, epochs=1, policy=partial(Fixed, [6, 4]), global_batch=10, bn=True),
                        backend="rpc"))[0]
    x = _data().tensors[0].double()
    bn = _bn_model()[0]
    mean, var = bn.running_mean.double().clone(), bn.running_var.double().clone()
    versions = [(mean.clone(), var.clone())]  # the server's statistics after each update
    syncs = [e for e in server["log"] if e["kind"] == "sync"]
    for e in syncs:
        sm, sv, off = 0.0, 0.0, 0
        for n, stale in zip(e["ns"], e["stale"]):
            m0, v0 = versions[e["version"] - 1 - stale]  # what that member loaded
            xb = x[e["indices"][off:off + n]]
            off += n
            sm = sm + n * (0.9 * m0 + 0.1 * xb.mean(0))
            sv = sv + n * (0.9 * v0 + 0.1 * xb.var(0, unbiased=True))
        mean, var = sm / e["batch"], sv / e["batch"]
        versions.append((mean.clone(), var.clone()))
    got = server["model"]
    assert got["0.running_mean"].abs().max() > 0.01  # moved off its initial zeros
    torch.testing.assert_close(got["0.running_mean"].double(), mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["0.running_var"].double(), var, rtol=1e-5, atol=1e-6)
    if mode == "lsp":  # one forward pass per update, as one large batch
        assert int(got["0.num_batches_tracked"]) == len(syncs)
        assert any(len(e["members"]) == 2 for e in syncs)
    else:  # the freshest count pushed: a stale worker's adds nothing
        assert 0 < int(got["0.num_batches_tracked"]) <= len(syncs)
        assert any(s > 0 for e in syncs for s in e["stale"])  # stale members replayed too


def test_in_process_buffer_checks():
    """A worker with other buffers is refused at its hello; a push without its buffers is
    malformed; a bool buffer stays the server's; a counter never goes back."""
    from hetlb.comm.hook import shapes_digest
    from hetlb.sync.ps import ParameterServer
    model = _bn_model()
    model.register_buffer("mask", torch.ones(DIM, dtype=torch.bool))
    ps = ParameterServer(model, torch.optim.SGD(model.parameters(), lr=0.1), N, 8, 1, "asp", timeout=5.0)
    with pytest.raises(ValueError, match="other buffers"):
        ps.call(1, {"hello": True, "hardware": {}, "numel": 2 * DIM + DIM + 1,
                    "buffer_shapes": shapes_digest([torch.zeros(3)])}).wait()
    ps = ParameterServer(model, torch.optim.SGD(model.parameters(), lr=0.1), N, 8, 1, "asp", timeout=5.0)
    r = ps.call(1, {"hello": True, "hardware": {}, "buffer_shapes": shapes_digest(list(model.buffers()))}).wait()
    names = [n for n, _ in model.named_buffers()]
    assert sorted(names) == ["0.num_batches_tracked", "0.running_mean", "0.running_var", "mask"]
    assert [tuple(b.shape) for b in r["buffers"]] == [tuple(b.shape) for b in model.buffers()]
    push = {"grad": torch.zeros(2 * DIM + DIM + 1), "n": 8, "compute": 0.1, "version": 0,
            "indices": r["indices"]}
    with pytest.raises(ValueError, match="malformed buffers"):
        ps.call(1, push).wait()
    ps = ParameterServer(model, torch.optim.SGD(model.parameters(), lr=0.1), N, 8, 1, "asp", timeout=5.0)
    r = ps.call(1, {"hello": True, "hardware": {}}).wait()
    pushed = {"0.running_mean": torch.full((DIM,), 0.5), "0.running_var": torch.full((DIM,), 0.75),
              "0.num_batches_tracked": torch.tensor(3), "mask": None}
    r = ps.call(1, dict(push, indices=r["indices"], buffers=[pushed[n] for n in names])).wait()
    bn = model[0]
    torch.testing.assert_close(bn.running_mean, torch.full((DIM,), 0.5))
    torch.testing.assert_close(bn.running_var, torch.full((DIM,), 0.75))
    assert int(bn.num_batches_tracked) == 3 and bool(model.mask.all())
    stale = dict(pushed, **{"0.num_batches_tracked": torch.tensor(1)})  # a stale worker's count
    ps.call(1, dict(push, indices=r["indices"], buffers=[stale[n] for n in names])).wait()
    assert int(bn.num_batches_tracked) == 3


def test_running_statistics_stay_bounded_with_many_stale_workers():
    """A review of session 26: adding each worker's change to newer statistics is a delayed
    feedback, x <- x + m * (stat - x_{t-s}), which diverges once m > 2 sin(pi / (2 (2s + 1))):
    17 ASP workers at BatchNorm's momentum 0.1, 4 at 0.5 (running_var went negative). The
    server's exact logic, in process: 20 workers round robin, each on the version it was handed."""
    from hetlb.sync.ps import ParameterServer
    from hetlb.sync.ps.worker import pushed as _pushed
    torch.manual_seed(0)
    model = torch.nn.BatchNorm1d(1, momentum=0.5)
    ps = ParameterServer(model, torch.optim.SGD(model.parameters(), lr=0.0), 10_000, 160, 20, "asp",
                         timeout=30.0)
    futs = {w: ps.call(w, {"hello": True, "hardware": {}}) for w in range(1, 21)}  # all, then wait
    held = {w: f.wait() for w, f in futs.items()}
    for it in range(400):
        w = it % 20 + 1
        reply = held[w]
        worker = torch.nn.BatchNorm1d(1, momentum=0.5)
        with torch.no_grad():
            for b, v in zip(worker.buffers(), reply["buffers"]):
                b.copy_(v)
        worker(5.0 + torch.randn(len(reply["indices"]), 1))
        held[w] = ps.call(w, {"grad": torch.zeros(2), "n": len(reply["indices"]), "compute": 0.1,
                              "version": reply["version"], "indices": reply["indices"],
                              "buffers": [_pushed(b) for b in worker.buffers()]}).wait()
    assert 4.0 < float(model.running_mean) < 6.0 and 0.3 < float(model.running_var) < 3.0, \
        (model.running_mean, model.running_var)


def test_a_dropped_worker_back_after_training_ended_stops_cleanly():
    # Worker 2 stalls 6 s in its second iteration, is dropped after 1 s, and the others finish
    # the epoch (about 2 s) and leave: its push then finds no server. Before: a raw tensorpipe
    # "eof" RuntimeError and a failed rank, though training had ended correctly (a user audit,
    # session 25); now it knows it was dropped (it held its batch past the server's timeout).
    res = unwrap(run(_ps, 3, "ssp", (0.02, 0.02), {"epochs": 1, "timeout": 1.0},
                     (2, 2, 6.0), backend="rpc"))
    server = res[0]
    assert res[2]["dropped"] and not res[1]["dropped"]
    assert [e["rank"] for e in server["log"] if e["kind"] == "drop"] == [2]
    assert (_applied(server["log"], 1) == 1).all()


def test_torchrun_restarts_a_parameter_server_job_from_its_checkpoint(tmp_path):
    # A worker dies mid-epoch; torchrun --max-restarts brings the job back and the server resumes
    # from its newest checkpoint. Before: every restart failed in rpc.init_rpc with "Connection
    # refused" (the agent's shared store held the dead attempt's addresses; a user audit,
    # session 25).
    import subprocess
    import sys
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ps_restart_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
           "--max-restarts=1", "--monitor-interval=0.2", worker, "--out", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    server = torch.load(tmp_path / "server.pt", weights_only=False)
    assert server["attempt"] == 1  # it did restart
    assert server["epoch"] == 2
    # The last epoch ran whole in the restarted attempt: every sample applied exactly once.
    assert (_applied(server["log"], 2)[1] == 1).all()


class _Refusing(torch.optim.SGD):
    """An optimizer whose step fails (a user's optimizer raising on the server)."""

    def step(self, closure=None):
        raise ValueError("the refusing optimizer does not step")


def _refused(rank, world, init):
    """Two servers, each with one worker, in one RPC group: ranks 0 and 1 serve, rank 2 works for
    rank 0 (whose optimizer raises at the first update) and rank 3 for rank 1 (it pushes a
    gradient of one sample fewer than it was handed). Returns the error each rank raised."""
    import torch.distributed.rpc as rpc
    from hetlb.sync.ps import ParameterServer, Worker

    class OutOfStep(Worker):
        def _call(self, push, *args, **kw):
            if push is not None and "grad" in push:
                push = dict(push, indices=push["indices"][1:])
            return super()._call(push, *args, **kw)

    names = ["ps-optimizer", "ps-out-of-step", "w-optimizer", "w-out-of-step"]
    rpc.init_rpc(names[rank], rank=rank, world_size=world,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=init, rpc_timeout=30))
    try:
        model = _model()
        if rank < 2:
            opt = (_Refusing if rank == 0 else torch.optim.SGD)(model.parameters(), lr=0.1)
            server = ParameterServer(model, opt, N, 8, 1, "asp", timeout=10.0, name=names[rank])
            server.serve()
        else:
            make = Worker if rank == 2 else OutOfStep
            make(model, _data(), torch.nn.functional.mse_loss, 1, timeout=30.0,
                 server=names[rank - 2]).run()
        return None
    except Exception as e:  # noqa: BLE001 (the error is what is checked)
        return type(e).__name__, str(e)
    finally:
        rpc.shutdown(graceful=False)


def test_a_server_refusal_reaches_its_worker_with_the_servers_message():
    # Before: torch's rpc_sync returns (does not raise) the exception set on an async_execution
    # future, so the worker failed with "TypeError: 'RuntimeError' object does not support item
    # assignment" and the server's reason was lost.
    res = unwrap(run(_refused, 4, backend="rpc", timeout=60))
    assert res[0] == ("ValueError", "the refusing optimizer does not step"), res[0]
    assert res[1][0] == "RuntimeError" and "does not hold" in res[1][1], res[1]
    kind, msg = res[2]
    assert kind == "ValueError" and "the refusing optimizer does not step" in msg, res[2]
    assert "parameter server 'ps-optimizer'" in msg, msg
    kind, msg = res[3]
    assert kind == "RuntimeError" and "worker 1 pushed a gradient of samples it does not hold" in msg, res[3]
    assert "parameter server 'ps-out-of-step'" in msg, msg
