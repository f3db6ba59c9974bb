"""A peer that dies or stops: the survivors' errors and the watchdog's diagnosis.

The end-to-end case (a stuck worker named, the job restarted by torchrun and finished exactly
once) is in tests/test_elastic.py."""
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hetlb
from hetlb.ranks.watchdog import describe

from distributed import run, unwrap


def beat(step, stage, progress, at, host="h", pid=1):
    return {"step": step, "stage": stage, "progress": progress, "beat": at, "host": host, "pid": pid}


def test_describe_names_the_rank_behind():
    now = 100.0
    beats = {0: beat(7, 2, 90, 99.5), 1: beat(7, 1, 80, 99.7, host="b", pid=42), 2: beat(7, 2, 90, 99.6)}
    text = describe(beats, [0, 1, 2], now, gone_after=3.0)
    assert text.startswith("behind (alive, not progressing): rank 1 (b, pid 42) at step 7 (compute), "
                           "stalled for 20.0 s"), text
    assert "rank 0" not in text and "step 7 (sent)" in text
    beats[1] = beat(6, 2, 80, 99.7)  # a step behind, though its gradient is sent
    assert "rank 1 (h, pid 1) at step 6 (sent)" in describe(beats, [0, 1, 2], now, 3.0)
    beats[1] = beat(8, 0, 95, 99.7)  # ahead, waiting for its batch: the others are behind
    text = describe(beats, [0, 1, 2], now, 3.0)
    assert "rank 0 (h, pid 1) at step 7 (sent)" in text and "rank 2 (h, pid 1)" in text
    assert "rank 1 (" not in text


def test_describe_names_a_gone_or_silent_rank():
    now = 100.0
    beats = {0: beat(3, 2, 90, 99.5), 1: beat(3, 1, 90, 80.0)}
    text = describe(beats, [0, 1, 2], now, gone_after=3.0)
    assert text.startswith("gone (process exited or frozen, or its node lost): rank 1 (h, pid 1): "
                           "no heartbeat for 20.0 s, last at step 3 (compute)"), text
    assert "rank 2: never sent a heartbeat" in text and "rank 0" not in text
    all_equal = {r: beat(3, 2, 90, 99.5) for r in range(3)}
    assert "none is behind" in describe(all_equal, [0, 1, 2], now, 3.0)


@pytest.mark.parametrize("kwargs, match", [
    ({"stall": 0}, "stall must be"), ({"stall": float("nan")}, "stall must be"),
    ({"interval": -1}, "interval must be"), ({"stall": 2, "interval": 1.5}, "at most half"),
    ({"action": "kill"}, "action must be"), ({"stall": True}, "stall must be")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hetlb.Watchdog(**kwargs)


def _peer_dies(rank, world, transport, native):
    torch.manual_seed(0)
    net = DDP(torch.nn.Linear(4, 1))
    bal = hetlb.Balancer(net, 12, policy=hetlb.Uniform(), transport=transport, native_hook=native)
    data = torch.utils.data.TensorDataset(torch.randn(120, 4), torch.randn(120, 1))
    try:
        for i, (x, y) in enumerate(bal.loader(data)):
            if rank == 1 and i == 3:
                os._exit(3)
            torch.nn.functional.mse_loss(net(x), y).backward()
    except Exception as e:  # noqa: BLE001 (what the survivor's user sees)
        return type(e).__name__, str(e)[:300]
    return "finished", ""


@pytest.mark.parametrize("transport, native", [("carry", True), ("side", True)])
def test_a_dead_peer_fails_the_collective_not_the_checks(transport, native):
    # The carry transport's bucket callback once ignored the failed all-reduce and handed DDP the
    # rank's own unreduced gradient (and a table of zeros, reported as "ranks are at different
    # steps"); the survivors must see the collective's own error.
    out = run(_peer_dies, 3, transport, native, may_die=(1,), timeout=120)
    assert out[1] == ("died", 3)
    for r in (0, 2):
        status, (kind, msg) = out[r]
        assert status == "ok" and kind == "RuntimeError" and "DecisionMismatch" not in kind, out[r]
        assert "Connection" in msg or "peer" in msg, out[r]


def _until_stuck(rank, batches, stuck_at, train, dog):
    """Train on ``batches`` with ``train(x, y)`` (True: stop); rank 2 stops at batch ``stuck_at``
    (before its forward: its own work, in which its watchdog sees no wait for the others) for
    three stalls, while the others' watchdogs speak after one, then dies. The other ranks'
    collective fails once it is gone, which ends their loop."""
    try:
        for i, (x, y) in enumerate(batches):
            if rank == 2 and i == stuck_at:
                time.sleep(3 * dog.stall)
                os._exit(4)
            if train(x, y):
                break
    except Exception:  # noqa: BLE001 (the collective fails once rank 2 is gone)
        pass


def _stuck_peer(rank, world):
    torch.manual_seed(0)
    net = DDP(torch.nn.Linear(4, 1))
    dog = hetlb.Watchdog(stall=2.0, interval=0.25, action="log")
    bal = hetlb.Balancer(net, 12, policy=hetlb.Uniform(), watchdog=dog)
    data = torch.utils.data.TensorDataset(torch.randn(120, 4), torch.randn(120, 1))
    _until_stuck(rank, bal.loader(data), 3,
                 lambda x, y: torch.nn.functional.mse_loss(net(x), y).backward(), dog)
    bal.close()
    return dog.diagnosis


def test_the_watchdog_names_a_stuck_peer_long_before_the_collective_timeout():
    out = run(_stuck_peer, 3, may_die=(2,), timeout=120)
    for r in (0, 1):
        status, text = out[r]
        assert status == "ok" and text is not None, out[r]
        assert f"rank {r} made no progress for" in text and "at step 3 (sent)" in text, text
        assert "behind (alive, not progressing): rank 2 (" in text and "at step 3 (compute)" in text, text


def _stuck_delayed_peer(rank, world):
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    dog = hetlb.Watchdog(stall=2.0, interval=0.25, action="log")
    ds = hetlb.DelayedSync(net, torch.optim.SGD(net.parameters(), lr=0.01), reference_batch=4,
                           batches_per_iteration=2, watchdog=dog)
    data = torch.utils.data.TensorDataset(torch.randn(240, 4), torch.randn(240, 1))

    def train(x, y):
        torch.nn.functional.mse_loss(net(x), y).backward()
        ds.step()
    # Batch 5: 2 iterations sent (batch 4 is the probe round's empty batch).
    _until_stuck(rank, ds.loader(data, shuffle=False), 5, train, dog)
    ds.close()
    return dog.diagnosis


def test_the_watchdog_names_a_stuck_delayed_sync_peer():
    # DelayedSync's ranks wait on an iteration's all-reduce, not a step's: the diagnosis names
    # the rank at the lowest iteration (its "step"), still computing.
    out = run(_stuck_delayed_peer, 3, may_die=(2,), timeout=120)
    for r in (0, 1):
        status, text = out[r]
        assert status == "ok" and text is not None, out[r]
        assert f"rank {r} made no progress for" in text and "at step 3 (sent)" in text, text
        assert "behind (alive, not progressing): rank 2 (" in text and "at step 2 (compute)" in text, text


def _stuck_federated_client(rank, world):
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    dog = hetlb.Watchdog(stall=2.0, interval=0.25, action="log")
    fl = hetlb.sync.Federated(net, torch.optim.SGD(net.parameters(), lr=0.01), local_steps=3,
                              batch=4, watchdog=dog)
    data = torch.utils.data.TensorDataset(torch.randn(240, 4), torch.randn(240, 1))

    def train(x, y):
        torch.nn.functional.mse_loss(net(x), y).backward()
        fl.step()
        return fl.round == 3
    _until_stuck(rank, fl.loader(data), 4, train, dog)  # batch 4: round 1's second local step
    fl.close()
    return dog.diagnosis


def test_the_watchdog_names_a_stuck_federated_client():
    out = run(_stuck_federated_client, 3, may_die=(2,), timeout=120)
    for r in (0, 1):
        status, text = out[r]
        assert status == "ok" and text is not None, out[r]
        assert f"rank {r} made no progress for" in text and "at step 1 (sent)" in text, text
        assert "behind (alive, not progressing): rank 2 (" in text and "at step 1 (compute)" in text, text


def _idle_after_training(rank, world):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    out = []
    net = torch.nn.Linear(4, 1)
    dog = hetlb.Watchdog(stall=1.0, interval=0.25, action="log")
    ds = hetlb.DelayedSync(net, torch.optim.SGD(net.parameters(), lr=0.01), reference_batch=4,
                           batches_per_iteration=2, watchdog=dog)
    for x, y in ds.loader(data):
        torch.nn.functional.mse_loss(net(x), y).backward()
        ds.step()
    ds.flush()
    time.sleep(2.5)  # the script's own work after training (evaluating, saving): not a stall
    out.append(dog.diagnosis)
    ds.close()
    dist.barrier()
    dog = hetlb.Watchdog(stall=1.0, interval=0.25, action="log")
    fl = hetlb.sync.Federated(net, torch.optim.SGD(net.parameters(), lr=0.01), local_steps=2,
                              batch=4, watchdog=dog)
    for x, y in fl.loader(data):
        torch.nn.functional.mse_loss(net(x), y).backward()
        if fl.step() and fl.round == 3:
            break
    time.sleep(2.5)
    out.append(dog.diagnosis)
    fl.close()
    return out


def test_no_stall_is_reported_after_delayed_sync_or_federated_training_ends():
    for r in unwrap(run(_idle_after_training, 2, timeout=120)):
        assert r == [None, None], r


def _leave_then_idle(net, loop, stop, step, dog):
    """Train ``stop`` batches of ``loop`` (``step()`` after each), leave it with ``break`` right
    after the next batch is handed out, then do the script's own work (2.5 s, not a stall); the
    watchdog's diagnosis."""
    for i, (x, y) in enumerate(loop):
        if i == stop:
            break
        torch.nn.functional.mse_loss(net(x), y).backward()
        step()
    time.sleep(2.5)
    return dog.diagnosis


def _idle_after_a_break(rank, world):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    out = {}
    # A Balancer's loop left right after a batch was handed out, and after one was trained
    # (a max_steps loop): the open step is not where the script works any more.
    for trained in (False, True):
        net = DDP(torch.nn.Linear(4, 1))
        dog = hetlb.Watchdog(stall=1.0, interval=0.25, action="log")
        bal = hetlb.Balancer(net, 8, policy=hetlb.Uniform(), watchdog=dog)
        for i, (x, y) in enumerate(bal.loader(data)):
            if i == 3 and not trained:
                break
            torch.nn.functional.mse_loss(net(x), y).backward()
            if i == 3:
                break
        time.sleep(2.5)  # the script's own work after the loop: not a stall
        out[f"balancer-{trained}"] = dog.diagnosis
        bal.close()
        dist.barrier()
    net = torch.nn.Linear(4, 1)
    dog = hetlb.Watchdog(stall=1.0, interval=0.25, action="log")
    ds = hetlb.DelayedSync(net, torch.optim.SGD(net.parameters(), lr=0.01), reference_batch=4,
                           batches_per_iteration=2, watchdog=dog)
    out["delayed"] = _leave_then_idle(net, ds.loader(data), 3, ds.step, dog)
    ds.close()
    dist.barrier()
    # A federated loop left in the middle of a round, right after a batch was handed out.
    dog = hetlb.Watchdog(stall=1.0, interval=0.25, action="log")
    fl = hetlb.sync.Federated(net, torch.optim.SGD(net.parameters(), lr=0.01), local_steps=3,
                              batch=4, watchdog=dog)
    out["federated"] = _leave_then_idle(net, fl.loader(data), 4, fl.step, dog)
    fl.close()
    return out


def test_no_stall_is_reported_after_a_loop_is_left_with_a_break():
    for r in unwrap(run(_idle_after_a_break, 2, timeout=120)):
        assert r == {"balancer-False": None, "balancer-True": None, "delayed": None,
                     "federated": None}, r


def test_describe_names_a_rank_flushing_alone():
    # Stage 3: in bal.flush() between steps, before the step's compute: behind a rank that sent
    # its gradient at the same step, ahead of one still waiting for its batch.
    now = 100.0
    beats = {0: beat(3, 3, 90, 99.5), 1: beat(3, 2, 90, 99.6, pid=7)}
    text = describe(beats, [0, 1], now, gone_after=3.0)
    assert text.startswith("behind (alive, not progressing): rank 0 (h, pid 1) at step 3 (flush)"), text
    assert "the others are at step 3 (sent)" in text and "bal.flush() is a collective" in text, text
    beats[1] = beat(3, 0, 90, 99.6)
    assert "rank 1 (h, pid 1) at step 3 (data)" in describe(beats, [0, 1], now, 3.0)
    beats[1] = beat(3, 1, 90, 99.6)  # computing step 3: the flushing rank is the one behind
    assert "rank 0 (h, pid 1) at step 3 (flush)" in describe(beats, [0, 1], now, 3.0)


def _flush_alone(rank, world):
    import threading
    torch.manual_seed(0)
    net = DDP(torch.nn.Linear(4, 1))
    dog = hetlb.Watchdog(stall=2.0, interval=0.25, action="log")
    bal = hetlb.Balancer(net, 12, policy=hetlb.Uniform(), exchange_every=4, adaptive_exchange=False,
                         watchdog=dog)
    data = torch.utils.data.TensorDataset(torch.randn(120, 4), torch.randn(120, 1))
    if rank == 1:  # once its watchdog has spoken, rank 1 leaves: rank 0's flush then fails
        def leave():
            t0 = time.monotonic()
            while dog.diagnosis is None and time.monotonic() - t0 < 60:
                time.sleep(0.1)
            time.sleep(1.0)
            os._exit(4)
        threading.Thread(target=leave, daemon=True).start()
    try:
        for x, y in bal.loader(data):
            if rank == 0 and bal.steps == 3:
                bal.flush()  # the misuse: inside `if rank == 0:` (steps 1-2 wait in a block)
            torch.nn.functional.mse_loss(net(x), y).backward()
    except Exception:  # noqa: BLE001 (the flush's all-reduce fails once rank 1 is gone)
        pass
    return dog.diagnosis


def test_the_watchdog_names_a_rank_flushing_alone():
    # A user audit (session 27): bal.flush() on one rank hangs until the collective's timeout
    # (30 min under Gloo); the watchdog named that rank "at step 3 (data)". It says flush now.
    out = run(_flush_alone, 2, may_die=(1,), timeout=120)
    status, text = out[0]
    assert status == "ok" and text is not None, out
    assert "rank 0 made no progress for" in text and "at step 3 (flush)" in text, text
    assert "behind (alive, not progressing): rank 0 (" in text and "bal.flush() is a collective" in text, text


def _reduced_flags(rank, world):
    out = {}
    for name, kwargs in (("native", {"defer_hook": False}), ("reference", {"native_hook": False}),
                         ("deferred", {})):
        torch.manual_seed(0)
        net = DDP(torch.nn.Linear(4, 1))
        bal = hetlb.Balancer(net, 8, policy=hetlb.Uniform(), **kwargs)
        data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
        core = bal.telemetry.core
        seen = []
        for x, y in bal.loader(data):
            seen.append((core.restarted, core.reduced))  # handed out, before the forward
            loss = torch.nn.functional.mse_loss(net(x), y)
            seen.append((core.restarted, core.reduced))
            loss.backward()
            time.sleep(0.2)  # (the last bucket's continuation runs on a Gloo thread)
            seen.append((core.restarted, core.reduced))
        out[name] = (seen, bal.gradient_transport.deferred)
    return out


def test_a_step_waits_for_the_others_from_its_forward_until_its_gradient_is_reduced():
    # The watchdog's "waiting" window (StepCore.restarted and not StepCore.reduced), for the
    # native hook, the Python reference hook and the deferred hook.
    for res in unwrap(run(_reduced_flags, 2)):
        for name, (seen, deferred) in res.items():
            assert deferred == (name == "deferred"), (name, deferred)
            assert seen == [(False, False), (True, False), (True, True)] * 2, (name, seen)
