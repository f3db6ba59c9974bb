"""Balancer(exchange_every=k): the telemetry of k steps in one exchange (real Gloo ranks, real DDP).

The gradient of every step must stay the union's, every exchanged step must be checked and
recorded with its own step's readings, decisions change only at exchanges, a block ends at an
epoch's end, and a resume inside a block neither loses nor repeats a sample.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import hetlb
from distributed import run, unwrap
from fixed_policy import Fixed
from test_balancer_dist import Jitter, _data, _loss, _net, _reference, mismatch_worker


def block_grad_worker(rank, world, k, steps, options):
    net = _net()
    ddp = DDP(net, bucket_cap_mb=options.get("bucket_cap_mb", 25))
    bal = hetlb.Balancer(ddp, 12, policy=Jitter(5), lower=0, transport=options.get("transport"),
                         native_hook=options.get("native", True), exchange_every=k)
    x, y, tokens = _data(120)  # 10 steps an epoch: no epoch end in the 8 steps
    ds = torch.utils.data.TensorDataset(x, y, tokens, torch.arange(len(x)))
    loader = bal.loader(ds, seed=5)
    errs, sizes, recorded = [], [], []
    for step, (xb, yb, _, ib) in enumerate(loader):
        if step == steps:
            break
        plan = bal.board.current
        sizes.append(plan.sizes.tolist())
        loss = _loss(ddp(xb), yb, torch.ones(len(xb), dtype=torch.float64))
        bal.backward(loss) if options.get("bal_backward") else loss.backward()
        parts = loader.order.step_indices(plan)
        ref = _reference(net, x, y, tokens, parts, "samples")
        errs.append(max(((p.grad - r).abs().max() / (r.abs().max() + 1e-12)).item()
                        for p, r in zip(net.parameters(), ref)))
        ddp.zero_grad(set_to_none=True)
        assert ib.tolist() == parts[rank].tolist()
        recorded.append(len(bal.history))  # records before this step's end
    records = [(r.step, r.batch.tolist(), bool(np.isfinite(r.compute).all())) for r in bal.history]
    return {"errs": errs, "sizes": sizes, "records": records, "recorded": recorded,
            "steps": bal.steps, "transport": bal.transport}


@pytest.mark.parametrize("world, options", [
    (2, {"transport": "carry"}),
    (3, {"transport": "side"}),
    (2, {"transport": "carry", "native": False}),
    (2, {"transport": "side", "native": False, "bucket_cap_mb": 1e-4}),
    (3, {"transport": "side", "bal_backward": True}),
])
def test_blocks_keep_the_union_gradient_and_record_every_exchanged_step(world, options):
    k, steps = 3, 8
    res = unwrap(run(block_grad_worker, world, k, steps, options))
    for r in res:
        assert r["transport"] == options["transport"]
        assert max(r["errs"]) < 1e-12, r["errs"]
        assert r["steps"] == steps
        # Blocks [0] (the first step is an exchange of its own) [1-3] [4-6] [7]: the last is
        # still open (its step 7 ended at the break).
        assert [s for s, _, _ in r["records"]] == list(range(7))
        assert all(finite for _, _, finite in r["records"])
        # Each record holds the sizes its step ran.
        assert [b for _, b, _ in r["records"]] == r["sizes"][:7]
        # Decisions change only at exchanges: one size vector per block, new ones after each.
        blocks = [r["sizes"][0:1], r["sizes"][1:4], r["sizes"][4:7], r["sizes"][7:8]]
        assert all(len({tuple(s) for s in b}) == 1 for b in blocks), blocks
        assert all(a[0] != b[0] for a, b in zip(blocks, blocks[1:])), blocks
        # No record arrives inside a block: the history grows at steps 0, 3 and 6's ends.
        assert r["recorded"] == [0, 1, 1, 1, 4, 4, 4, 7], r["recorded"]
    assert all(r["records"] == res[0]["records"] for r in res)


def block_record_worker(rank, world, naps, k, stop, total):
    import time
    x, y, _ = _data(96)
    ds = torch.utils.data.TensorDataset(x, y)
    seen = []

    def run_steps(state, steps, seen, flush=False):
        ddp = DDP(_net(), bucket_cap_mb=1e-4)
        bal = hetlb.Balancer(ddp, 8, policy=Fixed([4, 4]), exchange_every=k)
        loader = bal.loader(ds, seed=1)
        if state is not None:
            loader.load_state_dict(state)
        for xb, yb in loader:
            if bal.steps == steps:
                break
            seen.extend(xb[:, 0].tolist())
            out = ddp(xb)
            time.sleep(naps[bal.steps])
            out.pow(2).mean().backward()
            ddp.zero_grad()
        if flush:
            bal.flush()
        return bal, loader.state_dict()

    bal, state = run_steps(None, stop, seen)
    first = [(r.step, r.compute.tolist()) for r in bal.history]
    bal, _ = run_steps(state, total, seen, flush=True)
    resumed = [(r.step, r.compute.tolist()) for r in bal.history]
    whole = []
    run_steps(None, total, whole)  # uninterrupted
    return {"first": first, "resumed": resumed, "seen": seen, "whole": whole, "steps": bal.steps}


def test_each_record_of_a_block_holds_its_own_steps_time_across_a_resume_inside_a_block():
    # Blocks of 3 after the first step: [0] [1-3] [4-...]; a checkpoint after step 4 (inside a
    # block): step 4 was never exchanged, so the checkpoint's history is steps 0-3. The resumed
    # run's first step is an exchange of its own again: [5] [6-8] [9-10], the last sent by the
    # flush at its end. Each record must hold its own step's nap, and the data is exactly once.
    k, stop, total = 3, 5, 11
    naps = [0.12 if s % 3 == 1 or s == 9 else 0.0 for s in range(total)]
    res = unwrap(run(block_record_worker, 2, naps, k, stop, total, timeout=180))
    for r in res:
        assert [s for s, _ in r["first"]] == [0, 1, 2, 3]
        assert [s for s, _ in r["resumed"]] == [0, 1, 2, 3, 5, 6, 7, 8, 9, 10]
        assert r["resumed"][:4] == r["first"]
        for step, compute in r["resumed"]:
            if naps[step]:
                assert min(compute) >= naps[step], (step, compute)
            else:
                assert max(compute) < 0.1, (step, compute)
    for r in res:  # the same samples as the uninterrupted run's, in the same order
        assert r["seen"] == r["whole"] and len(r["seen"]) == total * 4
    union = [v for r in res for v in r["seen"]]
    assert len(set(union)) == len(union) == total * 8


def epoch_worker(rank, world, n, gb, k, epochs):
    ddp = DDP(torch.nn.Linear(1, 1).double())
    bal = hetlb.Balancer(ddp, gb, policy=Jitter(7), lower=0, exchange_every=k, defer_hook=False)
    ds = torch.utils.data.TensorDataset(torch.arange(n, dtype=torch.float64)[:, None])
    loader = bal.loader(ds, seed=11, num_workers=1, prefetch_factor=2, persistent_workers=True)
    seen, lens, caps = {}, [], []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for (xb,) in loader:
            ddp(xb).sum().backward()
            seen.setdefault(epoch, []).extend(int(v) for v in xb[:, 0].tolist())
            lens.append(len(bal.history))
            caps.append(bal.telemetry.core.carry_capacity)
    return {"seen": seen, "lens": lens, "ends": [r.step for r in bal.history if r.epoch_end],
            "steps": [r.step for r in bal.history], "caps": caps, "transport": bal.transport}


def test_a_block_ends_at_the_epochs_end():
    # 53 samples of 8: 7 steps an epoch; blocks of 5 are [0] (the first step alone) [1-5] [6] |
    # [7] (an epoch's first step ships: ranks on different epochs meet at once) [8-12] [13].
    n, gb, k = 53, 8, 5
    res = unwrap(run(epoch_worker, 2, n, gb, k, 2))
    for r in res:
        for e in range(2):
            assert sorted(r["seen"][e] + [v for q in res if q is not r for v in q["seen"][e]]) \
                == list(range(n))
        assert r["steps"] == list(range(14))  # every step recorded: the epoch end exchanged
        assert r["ends"] == [6, 13]
        # History length seen in the body of each step (before that step's end).
        assert r["lens"] == [0] + [1] * 5 + [6] + [7] + [8] * 5 + [13], r["lens"]
        # Carry's buffer holds a whole block from the first exchange on: blocks of 1 and 5
        # steps reuse it (one bucket of 2 parameters, then k * world rows of the table).
        assert r["transport"] == "carry"
        assert r["caps"] == [2 + k * 2 * hetlb.core.telemetry.NUM_FIELDS] * 14, r["caps"]


def test_a_disagreement_inside_a_block_is_found_at_its_exchange():
    # Blocks [0] [1-3] [4-6]: the decision after step 3's exchange differs on rank 1 (the
    # policy breaks from step 1 on): steps 4-6 run it, and the exchange at step 6's end names
    # step 4, on every rank.
    for kind, steps, msg in unwrap(run(mismatch_worker, 2, 3, 9)):
        assert kind == "mismatch"
        assert steps == 6
        assert msg.startswith("step 4:") and "disagree" in msg, msg


def disagree_worker(rank, world, option):
    ddp = DDP(torch.nn.Linear(2, 1).double())
    kw = {"exchange_every": rank + 1} if option == "exchange_every" else \
        {"exchange_every": 4, "adaptive_exchange": rank == 0}
    try:
        hetlb.Balancer(ddp, 8, **kw)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("option", ["exchange_every", "adaptive_exchange"])
def test_ranks_with_different_blocks_get_an_error(option):
    for msg in unwrap(run(disagree_worker, 2, option)):
        assert option in msg, msg


def test_one_process_records_in_blocks():
    net = torch.nn.Linear(3, 1)
    bal = hetlb.Balancer(net, 4, policy=Fixed([4]), exchange_every=4)
    lens = []
    for _ in range(10):
        with bal.step():
            net(torch.randn(4, 3)).sum().backward()
        lens.append(len(bal.history))
    # Blocks [0] [1-4] [5-8] [9]: the flush sends the last.
    assert lens == [1, 1, 1, 1, 5, 5, 5, 5, 9, 9]
    assert [r.step for r in bal.history] == list(range(9))
    bal.flush()
    assert [r.step for r in bal.history] == list(range(10))
    assert all(np.isfinite(r.compute).all() for r in bal.history)
    bal.flush()  # nothing left: no change
    assert len(bal.history) == 10


@pytest.mark.parametrize("bad", [0, -2, 2.5, "3", True])
def test_bad_exchange_every_is_refused(bad):
    with pytest.raises(ValueError, match="exchange_every"):
        hetlb.Balancer(torch.nn.Linear(3, 1), 4, exchange_every=bad)


@pytest.mark.parametrize("bad", [1, "yes"])
def test_bad_adaptive_exchange_is_refused(bad):
    with pytest.raises((TypeError, ValueError), match="adaptive_exchange"):
        hetlb.Balancer(torch.nn.Linear(3, 1), 4, exchange_every=4, adaptive_exchange=bad)
    with pytest.raises(ValueError, match="with exchange_every=1 every step is exchanged anyway"):
        hetlb.Balancer(torch.nn.Linear(3, 1), 4, adaptive_exchange=True)


@pytest.mark.parametrize("policy, kwargs, settings", [
    (hetlb.LBB, {}, (1, False)),  # the papers decide every step
    (hetlb.Uniform, {}, (16, True)),  # reads no telemetry: blocks change none of its decisions
    (hetlb.Uniform, {"history": 4}, (4, True)),
    (hetlb.Uniform, {"exchange_every": 1}, (1, False)),
    (hetlb.Uniform, {"adaptive_exchange": False}, (16, False)),
    (hetlb.Uniform, {"exchange_every": 8}, (8, False)),
    (hetlb.LBB, {"exchange_every": 8, "adaptive_exchange": True}, (8, True))])
def test_the_default_blocks_follow_whether_the_policy_reads_telemetry(policy, kwargs, settings):
    bal = hetlb.Balancer(torch.nn.Linear(3, 1), 4, policy=policy(), **kwargs)
    assert (bal.exchange_every, bal.adaptive_exchange) == settings


def test_a_subclass_of_uniform_that_decides_anew_is_exchanged_every_step():
    class Reacting(hetlb.Uniform):  # may read the telemetry: per-step, as the papers' policies
        def decide(self, history):
            return super().decide(history)

    class Quiet(Reacting):  # says it reads none
        reads_telemetry = False

    class Named(hetlb.Uniform):  # decides as Uniform: still blocks
        name = "named"

    got = {cls.__name__: (hetlb.Balancer(torch.nn.Linear(3, 1), 4, policy=cls()).exchange_every)
           for cls in (Reacting, Quiet, Named)}
    assert got == {"Reacting": 1, "Quiet": 16, "Named": 16}


def test_uniform_s_default_blocks_record_what_every_step_exchanges_records():
    # Uniform by default: records arrive a block at a time (1, 2, 4 ... steps; an epoch's last
    # step ends a block), and by the epoch's end they are the per-step run's, sizes and steps.
    ds = torch.utils.data.TensorDataset(torch.randn(44, 3))  # 11 steps of 4
    runs = {}
    for every in (None, 1):
        net = torch.nn.Linear(3, 1)
        bal = hetlb.Balancer(net, 4, policy=hetlb.Uniform(), exchange_every=every)
        lens = []
        for (xb,) in bal.loader(ds, seed=1):
            net(xb).sum().backward()
            net.zero_grad()
            lens.append(len(bal.history))
        lens.append(len(bal.history))  # after the loop: the epoch's last step is recorded
        runs[every] = (lens, [(r.step, r.batch.tolist()) for r in bal.history])
    # A step is recorded when the next batch is asked for (its end): blocks [0] [1-2] [3-6] [7-10]
    assert runs[None][0] == [0, 1, 1, 3, 3, 3, 3, 7, 7, 7, 7, 11], runs[None][0]
    assert runs[1][0] == list(range(12))
    assert runs[None][1] == runs[1][1] == [(s, [4]) for s in range(11)]


def test_history_shorter_than_a_block_is_refused():
    # A policy learns from every record of a block: a history that drops some would undercount.
    with pytest.raises(ValueError, match="history=8 keeps fewer records than a block of exchange_every=16"):
        hetlb.Balancer(torch.nn.Linear(3, 1), 4, exchange_every=16, history=8)
    hetlb.Balancer(torch.nn.Linear(3, 1), 4, exchange_every=16, history=16)


def block_accumulation_worker(rank, world, K, k, n, gb):
    net = _net()
    ddp = DDP(net)
    bal = hetlb.Balancer(ddp, gb, policy=Jitter(1), accumulate=K, lower=0, exchange_every=k)
    x, y, tokens = _data(n)
    ds = torch.utils.data.TensorDataset(x, y, torch.arange(n))
    loader = bal.loader(ds, seed=2)
    errs, parts_all = [], []
    for xb, yb, ib in loader:
        plan = bal.board.current
        with bal.step():
            (_loss(ddp(xb), yb, torch.ones(len(xb), dtype=torch.float64)) / K).backward()
        parts_all.append(loader.order.step_indices(plan))
        if bal.synced:
            parts = [np.concatenate([p[r] for p in parts_all]) for r in range(world)]
            ref = _reference(net, x, y, tokens, parts, "samples")
            errs.append(max(((p.grad - r).abs().max() / r.abs().max()).item()
                            for p, r in zip(net.parameters(), ref)))
            parts_all = []
            ddp.zero_grad()
    return {"errs": errs, "steps": bal.steps,
            "records": [(r.step, bool(np.isfinite(r.compute).all())) for r in bal.history]}


def test_blocks_of_accumulation_windows_are_exact():
    # 50 samples of 6 in windows of 3: windows [0-2] [3-5] [6-7] [8] (4 steps); blocks of 2 steps
    # after the first ([0] [1, 2] [3], the last one ending at the epoch's end): every window
    # recorded.
    for r in unwrap(run(block_accumulation_worker, 2, 3, 2, 50, 6)):
        assert max(r["errs"]) < 1e-12, r["errs"]
        assert r["steps"] == 4
        assert r["records"] == [(s, True) for s in range(4)]


class _Counting(Fixed):
    def __init__(self, sizes):
        super().__init__(sizes)
        self.decisions = 0

    def decide(self, history):
        self.decisions += 1
        return self.sizes.copy()


def test_a_block_whose_newest_step_is_refused_keeps_the_sizes(caplog):
    # As with k = 1: when the newest step's telemetry is unusable (NaN compute) the policy is not
    # asked, the sizes are kept, and the usable steps of the block are still recorded.
    from hetlb.core.telemetry import COL
    net = torch.nn.Linear(3, 1)
    pol = _Counting([4])
    bal = hetlb.Balancer(net, 4, policy=pol, exchange_every=3)
    for step in range(7):  # blocks [0] [1-3] [4-6]
        with bal.step():
            net(torch.randn(4, 3)).sum().backward()
            if step == 3:
                bal.telemetry.core.set(COL["compute"], float("nan"))
        if step == 3:
            assert [r.step for r in bal.history] == [0, 1, 2] and pol.decisions == 1
            assert bal.loop.bad == 1 and "keeping the previous sizes" in caplog.text
    assert [r.step for r in bal.history] == [0, 1, 2, 4, 5, 6] and pol.decisions == 2
    assert bal.loop.bad == 0


def flush_worker(rank, world, transport, same_iterator):
    net = _net()
    ddp = DDP(net)
    bal = hetlb.Balancer(ddp, 12, policy=Jitter(3), lower=0, transport=transport, exchange_every=4)
    x, y, tokens = _data(120)  # 10 steps an epoch
    ds = torch.utils.data.TensorDataset(x, y, tokens, torch.arange(len(x)))
    loader = bal.loader(ds, seed=4)
    errs, seen, before = [], [], None

    def train(batch):
        xb, yb, _, ib = batch
        plan = bal.board.current
        _loss(ddp(xb), yb, torch.ones(len(xb), dtype=torch.float64)).backward()
        ref = _reference(net, x, y, tokens, loader.order.step_indices(plan), "samples")
        errs.append(max(((p.grad - r).abs().max() / (r.abs().max() + 1e-12)).item()
                        for p, r in zip(net.parameters(), ref)))
        ddp.zero_grad(set_to_none=True)
        seen.extend(ib.tolist())

    it = iter(loader)
    for batch in it:
        if bal.steps == 6:
            break  # step 6's batch is handed out, not trained; blocks [0] [1-4] [5-...]
        train(batch)
    before = [r.step for r in bal.history]
    bal.flush()
    flushed = [r.step for r in bal.history]
    bal.flush()  # nothing left: no collective, no change
    assert [r.step for r in bal.history] == flushed
    if same_iterator:  # train the held batch, then go on with the same iterator
        train(batch)
        for batch in it:
            train(batch)
    else:  # a new loop hands step 6's batch out again
        for batch in loader:
            train(batch)
    return {"errs": errs, "seen": seen, "before": before, "flushed": flushed,
            "after": [r.step for r in bal.history], "steps": bal.steps}


@pytest.mark.parametrize("transport, same_iterator", [("carry", False), ("side", True)])
def test_flush_records_the_steps_since_the_last_exchange(transport, same_iterator):
    res = unwrap(run(flush_worker, 2, transport, same_iterator))
    for r in res:
        assert r["before"] == list(range(5))  # step 5 sat in an open block
        assert r["flushed"] == list(range(6))
        assert r["after"] == list(range(10)) and r["steps"] == 10  # the epoch's end exchanged
        assert max(r["errs"]) < 1e-12, r["errs"]
    union = [i for r in res for i in r["seen"]]
    assert sorted(union) == list(range(120))  # exactly once across the flush


def checkpoint_mismatch_worker(rank, world, transport):
    ds = torch.utils.data.TensorDataset(torch.arange(96, dtype=torch.float64)[:, None])

    def make():
        ddp = DDP(torch.nn.Linear(1, 1).double())
        bal = hetlb.Balancer(ddp, 8, policy=Fixed([4, 4]), transport=transport, exchange_every=5)
        return ddp, bal, bal.loader(ds, seed=3)  # 12 steps an epoch

    ddp, bal, loader = make()
    saved = {}
    for (xb,) in loader:
        if bal.steps in (3, 9):
            saved[bal.steps] = loader.state_dict()
        if bal.steps == 10:
            break
        ddp(xb).sum().backward()
    bal.flush()
    # Each rank resumes from a different checkpoint: rank 0 at step 3, rank 1 at step 9, whose
    # epoch ends (an exchange) two steps later. The first step after the load is an exchange of
    # every rank, so they meet in one table and the checks name the disagreement.
    ddp, bal, loader = make()
    loader.load_state_dict(saved[3 if rank == 0 else 9])
    try:
        for (xb,) in loader:
            ddp(xb).sum().backward()
    except hetlb.DecisionMismatchError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("transport", ["carry", "side"])
def test_ranks_resumed_from_different_checkpoints_get_an_error_not_a_hang(transport):
    for msg in unwrap(run(checkpoint_mismatch_worker, 2, transport, timeout=120)):
        assert "ranks are at different steps" in msg, msg


class _Settles(Fixed):
    """Moves one sample back and forth for its first ``moves`` decisions, then holds still."""

    def __init__(self, sizes, moves):
        super().__init__(sizes)
        self.moves, self.calls = moves, 0

    def decide(self, history):
        self.calls += 1
        s = self.sizes.copy()
        if min(self.calls, self.moves + 1) % 2:
            s[0] += 1
            s[1] -= 1
        return s


def adaptive_worker(rank, world, k, moves):
    net = _net()
    ddp = DDP(net)
    bal = hetlb.Balancer(ddp, 12, policy=_Settles([6, 6], moves), exchange_every=k,
                         adaptive_exchange=True)
    x, y, tokens = _data(240)  # 20 steps an epoch
    ds = torch.utils.data.TensorDataset(x, y, tokens)
    loader = bal.loader(ds, seed=6)
    errs, sizes, lens = [], [], []
    for xb, yb, _ in loader:
        plan = bal.board.current
        sizes.append(plan.sizes.tolist())
        lens.append(len(bal.history))
        _loss(ddp(xb), yb, torch.ones(len(xb), dtype=torch.float64)).backward()
        ref = _reference(net, x, y, tokens, loader.order.step_indices(plan), "samples")
        errs.append(max(((p.grad - r).abs().max() / (r.abs().max() + 1e-12)).item()
                        for p, r in zip(net.parameters(), ref)))
        ddp.zero_grad(set_to_none=True)
    return {"errs": errs, "sizes": sizes, "lens": lens,
            "steps": [r.step for r in bal.history]}


def test_adaptive_blocks_are_single_steps_while_the_sizes_move_then_grow():
    # The policy changes the sizes at its first 4 decisions (the exchanges of steps 0-3), so
    # steps 0-4 exchange alone; then it holds: blocks of 2, 4, 8 follow ([5-6] [7-10] [11-18])
    # and the epoch's end closes [19].
    k = 8
    res = unwrap(run(adaptive_worker, 2, k, 3))
    exchanges = [0, 1, 2, 3, 4, 6, 10, 18, 19]
    want = [sum(e < s for e in exchanges) and max(e for e in exchanges if e < s) + 1 for s in range(20)]
    for r in res:
        assert max(r["errs"]) < 1e-12, r["errs"]
        assert r["steps"] == list(range(20))
        assert r["lens"] == want, (r["lens"], want)
        # The sizes change right after the first exchanges only, then hold.
        changed = [s for s in range(1, 20) if r["sizes"][s] != r["sizes"][s - 1]]
        assert changed == [1, 2, 3, 4], changed
    assert res[0]["sizes"] == res[1]["sizes"]


def test_adaptive_blocks_double_up_to_k_in_one_process():
    net = torch.nn.Linear(3, 1)
    bal = hetlb.Balancer(net, 4, policy=Fixed([4]), exchange_every=8, adaptive_exchange=True)
    lens = []
    for _ in range(24):
        with bal.step():
            net(torch.randn(4, 3)).sum().backward()
        lens.append(len(bal.history))
    # Blocks [0] [1-2] [3-6] [7-14] [15-22]: the one rank's sizes never move.
    ends = [0, 2, 6, 14, 22]
    assert lens == [max([e + 1 for e in ends if e <= s] or [0]) for s in range(24)], lens


class _MovesAt(Fixed):
    """Moves one sample (back and forth) at the decisions numbered in ``at`` (1-based), else
    holds."""

    def __init__(self, sizes, at):
        super().__init__(sizes)
        self.at, self.calls, self.current = set(at), 0, np.asarray(sizes, np.int64)

    def decide(self, history):
        self.calls += 1
        if self.calls in self.at:
            shift = 1 if self.current[0] == self.sizes[0] else -1
            self.current = self.current + np.array([shift, -shift])
        return self.current.copy()


def adaptive_flush_worker(rank, world):
    ddp = DDP(torch.nn.Linear(1, 1).double())
    # Decisions 1 (step 0's exchange) and 4 (the flush's) move the sizes.
    bal = hetlb.Balancer(ddp, 12, policy=_MovesAt([6, 6], {1, 4}), exchange_every=8,
                         adaptive_exchange=True)
    ds = torch.utils.data.TensorDataset(torch.arange(240, dtype=torch.float64)[:, None])
    loader = bal.loader(ds, seed=2)  # 20 steps an epoch
    it = iter(loader)
    lens, seen = [], []
    for (xb,) in it:
        if bal.steps == 6:
            break  # blocks [0] [1] [2-3] [4-...]: steps 4 and 5 wait; step 6's batch is held
        lens.append(len(bal.history))
        ddp(xb).sum().backward()
        seen.extend(xb[:, 0].tolist())
    bal.flush()  # decision 4 moves: the held step is a block of its own
    after_flush = len(bal.history)
    def train(xb):
        lens.append(len(bal.history))
        ddp(xb).sum().backward()
        seen.extend(xb[:, 0].tolist())

    train(xb)  # the held batch
    for (xb,) in it:
        train(xb)
    return {"lens": lens, "after_flush": after_flush, "seen": seen,
            "steps": [r.step for r in bal.history]}


def test_a_flush_that_moves_the_sizes_makes_the_held_step_a_block_of_its_own():
    # Exchanges: 0 (moved), 1, [2-3], the flush of [4-5] (moved), then 6 alone (the rule's one
    # step after a move, though its batch was handed out before the flush), [7-8], [9-12],
    # [13-19] (the epoch's end).
    res = unwrap(run(adaptive_flush_worker, 2))
    exchanges = [0, 1, 3, 5, 6, 8, 12, 19]
    want = [max([e + 1 for e in exchanges if e < s] or [0]) for s in range(20)]
    for r in res:
        assert r["after_flush"] == 6
        assert r["lens"] == want, (r["lens"], want)
        assert r["steps"] == list(range(20))
    union = sorted(v for r in res for v in r["seen"])
    assert union == list(range(240))


def test_flush_between_steps_only():
    net = torch.nn.Linear(3, 1)
    bal = hetlb.Balancer(net, 4, policy=Fixed([4]), exchange_every=4)
    with bal.step():
        with pytest.raises(RuntimeError, match=r"bal.flush\(\) inside `with bal.step\(\):`"):
            bal.flush()
        net(torch.randn(4, 3)).sum().backward()
    bal.flush()  # step 0 exchanged alone: nothing left
    assert [r.step for r in bal.history] == [0]


def skipped_epoch_worker(rank, world):
    ddp = DDP(torch.nn.Linear(1, 1).double())
    bal = hetlb.Balancer(ddp, 4, policy=hetlb.Uniform())  # adaptive blocks of up to 16
    ds = torch.utils.data.TensorDataset(torch.arange(100, dtype=torch.float64)[:, None])
    loader = bal.loader(ds, seed=2)  # 25 steps an epoch
    trained = 0
    try:
        for epoch in (0, 1 + rank):  # rank 1 skips an epoch: another order from step 25 on
            loader.set_epoch(epoch)
            for (xb,) in loader:
                ddp(xb).sum().backward()
                trained += 1
    except hetlb.DecisionMismatchError as e:
        return trained, str(e)
    return trained, None


def test_ranks_on_different_epochs_meet_at_the_epoch_s_first_step():
    # Blocks reach 16 steps in the first epoch; the second epoch's first step ships alone, so a
    # rank that set another epoch is found after one step of it, not up to a block later.
    for trained, msg in unwrap(run(skipped_epoch_worker, 2)):
        assert msg is not None and "step 25: ranks are training different epochs" in msg, msg
        assert trained == 26, trained  # step 25's end exchanged it
