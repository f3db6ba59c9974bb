"""CHRONICA: the runtime prophet, the Chronica policy, size-aware datasets, the emulator on data
amounts, and balanced training with per-rank sample counts that differ (real Gloo ranks)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hetlb
from hetlb.data.sampler import dataset_sample_sizes
from hetlb.sim.emulate import Emulator
from hetlb.core.decisions import ScheduleRule
from hetlb.policies import Context, RuntimeProphet
from hetlb.core.telemetry import History, StepRecord


def feed(prophet, a, b, rng, steps, noise=0.0, world=None):
    world = world or len(a)
    for _ in range(steps):
        w = rng.uniform(50, 500, world)
        t = (np.asarray(a) * w + np.asarray(b)) * (1 + noise * rng.standard_normal(world))
        prophet.update(w, t)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(1e-5, 1e-2), st.floats(0.0, 0.5)), min_size=1, max_size=5),
       st.integers(0, 2 ** 31))
def test_prophet_recovers_a_and_b_from_noisy_feedback(models, seed):
    a, b = (np.array(x) for x in zip(*models))
    p = RuntimeProphet(len(a))
    feed(p, a, b, np.random.default_rng(seed), 400, noise=0.01)
    fa, fb = p.models()
    mean_t = a * 275 + b
    # The fit predicts every rank's time within 1 % over the range seen (1 % noise, 400 steps).
    for w in (50, 275, 500):
        np.testing.assert_allclose(fa * w + fb, a * w + b, rtol=0.01, atol=0.003 * mean_t.max())
    assert np.all(fa > 0) and np.all(fb >= 0)


def test_prophet_exact_without_noise_and_the_brute_force_fit():
    rng = np.random.default_rng(1)
    p = RuntimeProphet(3)
    w = rng.uniform(10, 100, (20, 3))
    t = 0.002 * w + 0.05
    for k in range(20):
        p.update(w[k], t[k])
    a, b = p.models()
    np.testing.assert_allclose(a, 0.002, rtol=1e-9)
    np.testing.assert_allclose(b, 0.05, rtol=1e-9)
    # with forgetting: the weighted least-squares solution of numpy's lstsq on sqrt-weighted rows
    q = RuntimeProphet(1, forget=0.8)
    tt = 0.003 * w[:, 0] + 0.01 + rng.normal(0, 0.01, 20)
    for k in range(20):
        q.update(w[k, :1], tt[k:k + 1])
    sw = np.sqrt(0.8 ** np.arange(19, -1, -1))
    coef = np.linalg.lstsq(np.stack([w[:, 0], np.ones(20)], 1) * sw[:, None], tt * sw, rcond=None)[0]
    qa, qb = q.models()
    np.testing.assert_allclose([qa[0], qb[0]], coef, rtol=1e-9)


def test_prophet_follows_a_step_change_only_with_forgetting():
    rng = np.random.default_rng(2)
    paper, forgetful = RuntimeProphet(2), RuntimeProphet(2, forget=0.9)
    for p in (paper, forgetful):
        feed(p, [0.001, 0.002], [0.01, 0.01], np.random.default_rng(2), 200, noise=0.01)
        feed(p, [0.003, 0.002], [0.01, 0.01], np.random.default_rng(3), 40, noise=0.01)  # rank 0 3x slower
    assert forgetful.predict([300, 300])[0] == pytest.approx(0.003 * 300 + 0.01, rel=0.05)
    assert paper.predict([300, 300])[0] < 0.8 * (0.003 * 300 + 0.01)  # still mostly the old speed
    del rng


def test_prophet_keeps_slopes_positive_and_handles_constant_work():
    p = RuntimeProphet(3)
    for k in range(10):
        # rank 0: time falls with work (noise); rank 1: the same work every step; rank 2: nothing
        p.update(np.array([10.0 + k, 40.0, 0.0]), np.array([1.0 - 0.01 * k, 0.4, np.nan]))
    a, b = p.models()
    assert a[0] > 0 and b[0] == 0.0  # proportional fallback
    assert a[1] == pytest.approx(0.01) and b[1] == 0.0
    assert np.isnan(a[2]) and np.isnan(b[2])


@pytest.mark.parametrize("forget", [1.0, 0.8])
def test_chronica_learns_from_every_record_of_a_block(forget):
    # exchange_every=k: one decision after a block of records must fit what k per-step
    # decisions fit (the prophet's sums and its forgetting are per step).
    per_step, blocks = hetlb.Chronica(forget=forget), hetlb.Chronica(forget=forget)
    per_step.start(Context.simple(3, 30))
    blocks.start(Context.simple(3, 30))
    h = History(3)
    rng = np.random.default_rng(1)
    for k in range(13):
        w = rng.uniform(100, 300, 3)
        t = np.array([0.001, 0.002, 0.004]) * (1 + k / 10) * w + 0.01  # slowing down
        h.append(StepRecord(k, 0, np.array([10, 10, 10]), t, w, np.zeros(3), np.zeros(3)))
        a = per_step.decide(h)
        if k in (0, 4, 12):  # blocks of 1, 4 and 8 records
            b = blocks.decide(h)
    assert a.slope.tobytes() == b.slope.tobytes() and a.intercept.tobytes() == b.intercept.tobytes()
    assert blocks.state_dict()["last_step"] == 12
    assert blocks.decide(h).slope.tobytes() == b.slope.tobytes()  # the same history again


def test_chronica_policy_rules_and_state():
    pol = hetlb.Chronica()
    rule = pol.start(Context.simple(3, 30))
    assert isinstance(rule, ScheduleRule) and rule.slope.tolist() == [1.0, 1.0, 1.0]
    h = History(3)
    rng = np.random.default_rng(0)
    a = np.array([0.001, 0.002, 0.004])
    for k in range(12):
        w = rng.uniform(100, 300, 3)
        t = a * w + 0.01
        h.append(StepRecord(k, 0, np.array([10, 10, 10]), t, w, np.zeros(3), np.zeros(3)))
        rule = pol.decide(h)
    np.testing.assert_allclose(rule.slope, a, rtol=1e-6)
    np.testing.assert_allclose(rule.intercept, 0.01, rtol=1e-4)
    again = hetlb.Chronica()
    with pytest.raises(RuntimeError, match="has not started"):
        again.state_dict()
    again.load_state_dict(pol.state_dict())
    torch.save(pol.state_dict(), "/dev/null")  # plain values
    h.append(StepRecord(12, 0, np.array([10, 10, 10]), a * 200 + 0.01, np.full(3, 200.0), np.zeros(3), np.zeros(3)))
    r1, r2 = pol.decide(h), again.decide(h)
    assert r1.slope.tobytes() == r2.slope.tobytes() and r1.intercept.tobytes() == r2.intercept.tobytes()
    # a rank without feedback gets the others' mean until it has some
    pol2 = hetlb.Chronica()
    pol2.start(Context.simple(2, 10))
    h2 = History(2)
    h2.append(StepRecord(0, 0, np.array([10, 0]), np.array([0.5, 0.0]), np.array([100.0, 0.0]), np.zeros(2), np.zeros(2)))
    r = pol2.decide(h2)
    assert r.slope[1] == r.slope[0] and np.isfinite(r.slope).all()
    with pytest.raises(ValueError, match="forget"):
        hetlb.Chronica(forget=0.0)


def _noisy_history(world, a, steps, rng, noise, slow=None):
    """Records of ranks with slopes ``a`` (times ``1 + noise * N(0, 1)``), intercept 0.01;
    ``slow=(step, rank, factor)`` slows one rank from that step on."""
    h = History(world)
    for k in range(steps):
        w = rng.uniform(100, 300, world)
        aa = np.array(a, dtype=np.float64)
        if slow is not None and k >= slow[0]:
            aa[slow[1]] *= slow[2]
        t = aa * w * (1 + noise * rng.standard_normal(world)) + 0.01
        h.append(StepRecord(k, 0, np.full(world, 10), t, w, np.zeros(world), np.zeros(world)))
    return h


def _predicted(rule, data, sq):
    return rule.intercept + rule.slope * (np.asarray(data, float) + rule.quadratic * np.asarray(sq, float))


@pytest.mark.parametrize("hold", [0.01, 0.05])
def test_chronica_hold_keeps_a_rule_until_a_refit_moves_a_rank_by_more_than_hold(hold):
    # The held rule is replaced exactly when some rank's predicted time for its newest work moves
    # by more than `hold` of the held rule's predicted step; compared here against a brute force
    # replay: a paper Chronica (hold=0) gives every refit, and the held rule is tracked by hand.
    rng = np.random.default_rng(3)
    h = _noisy_history(3, [0.001, 0.002, 0.004], 80, rng, 0.02, slow=(50, 0, 3.0))
    paper, held = hetlb.Chronica(forget=0.9), hetlb.Chronica(forget=0.9, hold=hold)
    ctx = Context.simple(3, 30)
    mine = held.start(ctx)
    assert mine.slope.tobytes() == paper.start(ctx).slope.tobytes()
    kept = replaced = 0
    for k in range(1, len(h) + 1):
        sub = History(3)
        for r in list(h)[:k]:
            sub.append(r)
        refit = paper.decide(sub)
        got = held.decide(sub)
        rec = sub[-1]
        before, after = _predicted(mine, rec.data, rec.data), _predicted(refit, rec.data, rec.data)
        if np.max(np.abs(after - before)) <= hold * np.max(before):
            assert got is mine  # the same rule: the same checksum, the blocks may grow
            kept += 1
        else:
            assert got.slope.tobytes() == refit.slope.tobytes()
            assert got.intercept.tobytes() == refit.intercept.tobytes()
            mine = got
            replaced += 1
    assert kept > 40 and replaced >= 2  # it held for most steps and followed the slow-down:
    assert mine.slope[0] / mine.slope[1] > 1.0  # rank 0 from half rank 1's slope to 1.5 times


def test_chronica_hold_state_round_trip_and_bad_input(tmp_path):
    rng = np.random.default_rng(4)
    h = _noisy_history(2, [0.001, 0.003], 30, rng, 0.02)
    pol = hetlb.Chronica(hold=0.05)
    pol.start(Context.simple(2, 20))
    sub = History(2)
    for r in list(h)[:20]:
        sub.append(r)
        pol.decide(sub)
    path = tmp_path / "chronica.pt"
    torch.save(pol.state_dict(), path)
    state = torch.load(path)  # the default weights_only=True: plain values
    assert state["hold"] == 0.05 and state["held"] is not None
    again = hetlb.Chronica(hold=0.05)
    again.load_state_dict(state)
    again.load_state_dict(state)  # twice: harmless
    for r in list(h)[20:]:
        sub.append(r)
        a, b = pol.decide(sub), again.decide(sub)
        assert a.to_dict() == b.to_dict()
    # `hold` is the policy's own, not the checkpoint's: the paper's Chronica loading this state
    # refits (no held rule), and another hold starts holding from its next refit.
    unheld = hetlb.Chronica()
    unheld.load_state_dict(state)
    assert unheld.hold == 0.0 and unheld.state_dict()["held"] is None
    other = hetlb.Chronica(hold=0.2)
    other.load_state_dict(state)
    assert other.state_dict()["held"] is None
    # The paper's default keeps no rule; a state saved before `hold` existed keeps the policy's
    # own hold, and its next refit becomes the held rule.
    paper = hetlb.Chronica()
    paper.start(Context.simple(2, 20))
    old = paper.state_dict()
    assert old["hold"] == 0.0 and old["held"] is None
    del old["hold"], old["held"]
    fresh = hetlb.Chronica(hold=0.1)
    fresh.load_state_dict(old)
    assert fresh.hold == 0.1 and fresh.state_dict()["held"] is None
    first = fresh.decide(sub)
    assert fresh.state_dict()["held"] == first.to_dict()
    for bad in (-0.01, 1.0, float("nan"), "0.1", True):
        with pytest.raises(ValueError, match="hold"):
            hetlb.Chronica(hold=bad)
    broken = dict(state, held={"slope": [1.0], "intercept": [0.0]})
    with pytest.raises(ValueError, match="held rule has 1 ranks"):
        hetlb.Chronica().load_state_dict(broken)
    with pytest.raises(ValueError, match="malformed held rule"):
        hetlb.Chronica().load_state_dict(dict(state, held={"slope": [1.0, 2.0]}))


def test_chronica_hold_compares_after_a_block_also_at_its_mean_work(monkeypatch):
    # Two rules trading slope for intercept agree at one total only. Held: T = 0.1 + 0.001 W;
    # the refit: T = 0.2 + 0.0005 W, equal at W = 200 (the newest step), 0.05 apart at W = 100
    # (the block's mean with an earlier step of W = 0). After one record the rule holds; after a
    # block of two it is replaced.
    held = ScheduleRule(np.array([0.001, 0.001]), np.array([0.1, 0.1]))
    refit = ScheduleRule(np.array([0.0005, 0.0005]), np.array([0.2, 0.2]))

    def record(k, w):
        return StepRecord(k, 0, np.array([5, 5]), np.full(2, 0.1 + 0.001 * w), np.full(2, float(w)),
                          np.zeros(2), np.zeros(2))

    for works, kept in (([200.0], True), ([0.0, 200.0], False)):
        pol = hetlb.Chronica(hold=0.1)  # 0.1 of the held step (0.3 s): 0.03 s
        pol.start(Context.simple(2, 10))
        h = History(2)
        h.append(record(0, 150.0))
        pol.decide(h)  # the first record consumed; then a block of len(works) records
        for k, w in enumerate(works):
            h.append(record(k + 1, w))
        pol._held = held
        monkeypatch.setattr(pol, "_rule", lambda: refit)
        got = pol.decide(h)
        assert (got is held) == kept, works


def test_chronica_hold_lets_adaptive_blocks_grow_in_the_simulator():
    from hetlb.sim import builtin_scenarios, simulate
    sc = builtin_scenarios()["mixed"]()
    paper = simulate(sc, hetlb.Chronica(), exchange_every=16, adaptive_exchange=True)
    held = simulate(sc, hetlb.Chronica(hold=0.02), exchange_every=16, adaptive_exchange=True)
    per_step = simulate(sc, hetlb.Chronica())
    assert len(paper.exchanges) == len(paper.step_time)  # refitted every decision: blocks of 1
    assert len(held.exchanges) < len(held.step_time) / 4
    assert held.total_time <= 1.01 * per_step.total_time


# ------------------------------------------------------------------------------- datasets


class Sized(torch.utils.data.Dataset):
    def __init__(self, sizes):
        self.sizes = sizes

    def __len__(self):
        return len(self.sizes)

    def __getitem__(self, i):
        return torch.tensor([float(i)])


class WithMethod(Sized):
    def sample_size(self, i):
        return self.sizes[i]


class ChronicaStyle(Sized):
    """CHRONICA's released code: __sizeof__ overridden to take an index."""

    def __sizeof__(self, index):
        return self.sizes[index]


def test_datasets_declare_their_sample_sizes():
    assert dataset_sample_sizes(WithMethod([3, 1, 2])).tolist() == [3, 1, 2]
    assert dataset_sample_sizes(ChronicaStyle([5, 6])).tolist() == [5, 6]
    assert dataset_sample_sizes(torch.utils.data.TensorDataset(torch.zeros(3))) is None
    assert dataset_sample_sizes([1, 2, 3]) is None  # list.__sizeof__() takes no index
    with pytest.raises(ValueError, match="size of sample 1 is 'big'"):
        dataset_sample_sizes(WithMethod([1, "big"]))
    board = hetlb.data.board.PlanBoard(1, 0, 2)
    loader = hetlb.DataLoader(WithMethod([1.0, 2.0, 3.0, 4.0]), board=board)
    assert loader.sample_sizes.tolist() == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="sample 2 has -1.0"):
        hetlb.DataLoader(WithMethod([1.0, 2.0, -1.0, 4.0]), board=hetlb.data.board.PlanBoard(1, 0, 2))
    with pytest.raises(ValueError, match="4 finite non-negative numbers"):
        hetlb.DataLoader(WithMethod([1.0, 2.0, 3.0, 4.0]), board=hetlb.data.board.PlanBoard(1, 0, 2),
                         sample_sizes=[1.0, 2.0])


def test_emulator_on_data_amounts():
    emu = Emulator(model=hetlb.LinearModel(0.01, 0.001), speed=2.0, by="data")
    assert emu.affine(0, 300.0) == (0.0, pytest.approx((0.01 + 0.3) / 2))
    assert Emulator(**{k: v for k, v in emu.state_dict().items() if k != "model"},
                    model=hetlb.LinearModel(0.01, 0.001)).by == "data"
    with pytest.raises(ValueError, match="by must be"):
        Emulator(model=hetlb.LinearModel(0, 1), by="tokens")
    with pytest.raises(ValueError, match="needs a time model"):
        Emulator(by="data")


# ------------------------------------------------------------------------------- real ranks


def chronica_worker(rank, world, speeds, epochs, gb):
    from torch.nn.parallel import DistributedDataParallel as DDP
    rng = np.random.default_rng(0)
    n = gb * 6
    sizes = np.clip(rng.normal(45, 32, n), 1, None).round()
    ds = torch.utils.data.TensorDataset(torch.arange(n), torch.tensor(sizes, dtype=torch.float32))
    ddp = DDP(torch.nn.Linear(1, 1))
    emu = Emulator.for_rank(rank, speeds, model=hetlb.LinearModel(0.002, 0.00005), by="data", spin=0.0005)
    bal = hetlb.Balancer(ddp, gb, policy=hetlb.Chronica(), weighting="sizes", emulator=emu, lower=0)
    loader = bal.loader(ds, sample_sizes=sizes)
    seen = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        mine = []
        for idx, sz in loader:
            mine += idx.tolist()
            ddp(sz[:, None]).sum().backward()
        seen.append(mine)
    return {"seen": seen, "batch": [r.batch.tolist() for r in bal.history],
            "data": [r.data.tolist() for r in bal.history],
            "compute": [r.compute.tolist() for r in bal.history]}


def test_chronica_trains_every_sample_once_with_counts_that_follow_speed():
    from distributed import run, unwrap
    gb, epochs = 64, 2
    res = unwrap(run(chronica_worker, 3, [1.0, 2.0, 4.0], epochs, gb))
    for e in range(epochs):
        everyone = sorted(sum((r["seen"][e] for r in res), []))
        assert everyone == list(range(gb * 6)), "every sample exactly once per epoch"
    batch = np.array(res[0]["batch"])
    data = np.array(res[0]["data"])
    assert res[1]["batch"] == res[0]["batch"] and res[2]["data"] == res[0]["data"]
    assert (batch.sum(axis=1) == gb).all()
    # after the prophet has feedback the 4x rank takes about 4x the data of the 1x rank
    late = data[4:]
    ratio = late[:, 2] / late[:, 0]
    assert np.median(ratio) == pytest.approx(4.0, rel=0.25), ratio
    comp = np.array(res[0]["compute"])[4:]
    se = (comp.max(1) - comp.min(1)) / comp.mean(1)
    # Measured times of 3 processes on 2 cores: 0.28 in one CI run (under 0.15 in others); an
    # equal split of these speeds would be 1.29, so 0.5 still tells balanced from not.
    assert np.median(se) < 0.5, se


def chronica_resume_worker(rank, world, n, gb, epochs, state=None, stop_after=None, num_workers=0,
                           hold=0.0, every=1):
    from torch.nn.parallel import DistributedDataParallel as DDP
    sizes = np.clip(np.random.default_rng(3).normal(45, 30, n), 1, None).round()
    ddp = DDP(torch.nn.Linear(1, 1).double())
    emu = Emulator.for_rank(rank, [1.0, 3.0, 2.0][:world], model=hetlb.LinearModel(0.001, 2e-5),
                            by="data", spin=0.0005)
    blocks = {"exchange_every": every, "adaptive_exchange": True} if every > 1 else {}
    bal = hetlb.Balancer(ddp, gb, policy=hetlb.Chronica(hold=hold), weighting="sizes", lower=0,
                         emulator=emu, **blocks)
    ds = torch.utils.data.TensorDataset(torch.arange(n, dtype=torch.float64)[:, None])
    kw = {"num_workers": num_workers, "prefetch_factor": 2} if num_workers else {}
    loader = bal.loader(ds, sample_sizes=sizes, seed=4, **kw)
    if state is not None:
        loader.load_state_dict(state)
    seen, steps, lens = {}, 0, []
    epoch = loader.epoch
    while epoch < epochs:
        loader.set_epoch(epoch)
        for (xb,) in loader:
            lens.append(len(bal.history))  # grows at each exchange
            ddp(xb).sum().backward()
            seen.setdefault(epoch, []).extend(int(v) for v in xb[:, 0].tolist())
            steps += 1
            if steps == stop_after:
                return {"seen": seen, "steps": steps, "state": bal.state_dict(),
                        "batch": [r.batch.tolist() for r in bal.history]}
        epoch += 1
    return {"seen": seen, "steps": steps, "state": bal.state_dict(),
            "batch": [r.batch.tolist() for r in bal.history], "exchanges": len(set(lens))}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_chronica_resumes_mid_epoch_exactly_once(num_workers):
    from distributed import run, unwrap
    n, gb = 90, 16
    first = unwrap(run(chronica_resume_worker, 3, n, gb, 2, None, 4, num_workers))
    state = first[0]["state"]
    assert state["position"]["step"] == 4
    assert isinstance(state["decision"], dict)  # a ScheduleRule rides in the checkpoint
    rest = unwrap(run(chronica_resume_worker, 3, n, gb, 2, state, None, num_workers))
    whole0 = sorted(sum((r["seen"].get(0, []) for r in first + rest), []))
    assert whole0 == list(range(n)), "epoch 0: every sample once across the checkpoint"
    assert sorted(sum((r["seen"][1] for r in rest), [])) == list(range(n))
    counts = {tuple(b) for b in rest[0]["batch"]}
    assert len(counts) > 2  # the counts per rank follow the samples, not a fixed split


def test_chronica_hold_with_adaptive_blocks_on_two_ranks_resumes_exactly_once():
    # Chronica(hold) + adaptive blocks on two emulated ranks (speeds 1:3 on data amounts): a
    # checkpoint mid-epoch (inside a block) carries the held rule; the resumed run covers every
    # sample once, and both ranks run the same plans.
    from distributed import run, unwrap
    n, gb = 240, 16  # 15 steps an epoch
    first = unwrap(run(chronica_resume_worker, 2, n, gb, 3, None, 9, 0, 0.05, 8))
    state = first[0]["state"]
    assert state["policy"]["hold"] == 0.05 and state["policy"]["held"] is not None
    rest = unwrap(run(chronica_resume_worker, 2, n, gb, 3, state, None, 0, 0.05, 8))
    whole0 = sorted(sum((r["seen"].get(0, []) for r in first + rest), []))
    assert whole0 == list(range(n)), "epoch 0: every sample once across the checkpoint"
    for e in (1, 2):
        assert sorted(sum((r["seen"][e] for r in rest), [])) == list(range(n))
    assert rest[0]["batch"] == rest[1]["batch"]
    assert rest[0]["exchanges"] < rest[0]["steps"] * 0.75, rest[0]  # the held rule let blocks grow


def test_rule_pivot_cap_checksum_and_checkpoint_form():
    from hetlb.data.board import PlanBoard
    from hetlb.core.decisions import decision_checksum
    base = ScheduleRule([1.0, 2.0], [0.0, 0.0])
    piv = ScheduleRule([1.0, 2.0], [0.0, 0.0], pivot=True)
    cap = ScheduleRule([1.0, 2.0], [0.0, 0.0], cap=[100.0, 50.0])
    assert len({decision_checksum(r) for r in (base, piv, cap)}) == 3
    for r in (base, piv, cap):
        again = ScheduleRule.from_dict(r.to_dict())
        assert decision_checksum(again) == decision_checksum(r)
    assert base.first(1, 0, 0, 10) is None
    picks = {piv.first(1, 0, s, 10) for s in range(30)}
    assert len(picks) > 3 and picks <= set(range(10))
    assert piv.first(1, 2, 5, 10) == piv.first(1, 2, 5, 10)
    sizes = np.arange(1.0, 13.0)
    a, b = PlanBoard(2, 0, 12), PlanBoard(2, 1, 12)
    for board in (a, b):
        board.post(piv)
    pa = a.draw(0, 0, 12, 1, sizes, seed=3)
    pb = b.draw(0, 0, 12, 1, sizes, seed=3)
    assert np.array_equal(pa.assignment, pb.assignment) and pa.checksum == pb.checksum
    first = piv.first(3, 0, 0, 12)
    assert np.array_equal(pa.assignment, hetlb.schedule(sizes, piv.slope, piv.intercept, first=first))
    # a plan's checksum covers the assignment, not only the counts
    c = PlanBoard(2, 0, 12)
    c.post(ScheduleRule([1.0, 2.0], [0.0, 0.0]))
    pc = c.draw(0, 0, 12, 1, sizes, seed=3)
    assert pc.checksum != pa.checksum or np.array_equal(pc.assignment, pa.assignment)


def test_chronica_cap_bounds_every_rank():
    pol = hetlb.Chronica(cap=[200.0, 400.0])
    rule = pol.start(Context.simple(2, 10))
    assert rule.cap.tolist() == [200.0, 400.0] and rule.pivot
    with pytest.raises(ValueError, match="cap has 2 entries for 3 ranks"):
        hetlb.Chronica(cap=[1.0, 2.0]).start(Context.simple(3, 9))
    with pytest.raises(ValueError, match="positive number"):
        hetlb.Chronica(cap=0)
    from hetlb.sim import Scenario, simulate
    sc = Scenario.from_dict({"global_batch": 64, "work": "data", "lower": 0,
                             "samples": {"kind": "normal", "mean": 45, "std": 20, "min": 1},
                             "workers": [{"model": [0.002, 1e-4], "speed": s} for s in (1, 4)]})
    free = simulate(sc, hetlb.Chronica(), 30)
    capped = simulate(sc, hetlb.Chronica(cap=[1400.0, 2000.0]), 30)
    assert free.data[:, 1].max() > 2000  # the fast rank would take more
    assert (capped.data[:, 0] <= 1400).all() and (capped.data[:, 1] <= 2000).all()


def cap_worker(rank, world, big):
    from torch.nn.parallel import DistributedDataParallel as DDP
    sizes = np.full(40, 5.0)
    sizes[33] = big
    ds = torch.utils.data.TensorDataset(torch.arange(40))
    bal = hetlb.Balancer(DDP(torch.nn.Linear(1, 1)), 8, policy=hetlb.Chronica(cap=[40.0, 60.0]))
    try:
        loader = bal.loader(ds, sample_sizes=sizes, shuffle=False)
    except ValueError as e:
        return str(e)
    return sum(1 for _ in loader)


def test_a_sample_larger_than_every_cap_is_refused_at_the_loader():
    # It used to fail only when its step came (here step 4 of 5; in a real run, hours in).
    from distributed import run, unwrap
    for msg in unwrap(run(cap_worker, 2, 61.0)):
        assert isinstance(msg, str) and "sample 33 (size 61) fits in no rank's cap (largest 60)" in msg, msg
    assert unwrap(run(cap_worker, 2, 30.0)) == [5, 5]


def cap_total_worker(rank, world, cap, partition):
    from torch.nn.parallel import DistributedDataParallel as DDP
    sizes = np.full(40, 5.0)
    sizes[:8] = 30.0  # the first step (shuffle=False) totals 240
    ds = torch.utils.data.TensorDataset(torch.arange(40).double()[:, None])
    ddp = DDP(torch.nn.Linear(1, 1).double())
    bal = hetlb.Balancer(ddp, 8, policy=hetlb.Chronica(cap=[cap, cap]), weighting="sizes")
    try:
        loader = bal.loader(ds, sample_sizes=sizes, shuffle=False, partition=partition)
        steps = 0
        for (x,) in loader:
            ddp(x).sum().backward()
            steps += 1
    except ValueError as e:
        return str(e)
    return steps


def test_a_step_over_the_caps_together_says_which_and_why(caplog):
    # A user audit, session 26: it failed as "schedule: sample 8 (size 5) fits in no rank's
    # cap", naming a position in the step, no epoch, step or total, and nothing warned before.
    from distributed import run, unwrap
    for msg in unwrap(run(cap_total_worker, 2, 100.0, None)):
        assert isinstance(msg, str) and "step 0 of epoch 0 cannot keep to the caps: its 8 samples " \
            "total 240 (largest 30), more than the ranks' caps [100.0, 100.0] (200 together" in msg, msg
    assert unwrap(run(cap_total_worker, 2, 130.0, None)) == [5, 5]
    import logging
    policy = hetlb.Chronica(cap=[100.0])
    bal = hetlb.Balancer(torch.nn.Linear(1, 1), 8, policy=policy)
    with caplog.at_level(logging.WARNING, logger="hetlb"):
        bal.loader(torch.utils.data.TensorDataset(torch.arange(40.0)[:, None]),
                   sample_sizes=np.r_[np.full(8, 30.0), np.full(32, 5.0)])
    assert any("a step of the 8 largest samples would total 240, more than the ranks' caps hold "
               "together (100)" in r.getMessage() for r in caplog.records), caplog.text


def test_a_cap_with_a_sharded_loader_is_refused():
    # A user audit, session 26: a sharded step takes each rank's samples from its own shard, and
    # the cap was silently ignored (103 per rank against a cap of 60).
    from distributed import run, unwrap
    for msg in unwrap(run(cap_total_worker, 2, 130.0, "even")):
        assert isinstance(msg, str) and "cannot bound a sharded loader's steps" in msg, msg


# ------------------------------------------------------------------ the quadratic work term


def feed_quadratic(prophet, a, b, c, rng, steps, noise=0.0):
    """Steps of lognormal token lengths per rank, time ``a*(S + c*Q) + b``."""
    a, b = np.asarray(a), np.asarray(b)
    for _ in range(steps):
        lens = [np.clip(rng.lognormal(5, 1, rng.integers(4, 40)), 16, 2048) for _ in a]
        S = np.array([x.sum() for x in lens])
        Q = np.array([(x * x).sum() for x in lens])
        prophet.update(S, (a * (S + c * Q) + b) * (1 + noise * rng.standard_normal(a.size)), Q)


@settings(max_examples=25, deadline=None)
@given(st.floats(1e-4, 1e-2), st.integers(0, 2 ** 31))
def test_prophet_fits_the_quadratic_term(c, seed):
    a, b = np.array([1e-3, 5e-4, 2.5e-4]), np.array([0.01, 0.02, 0.0])
    p = RuntimeProphet(3, quadratic="fit")
    feed_quadratic(p, a, b, c, np.random.default_rng(seed), 300, noise=0.01)
    assert p.coefficient() == pytest.approx(c, rel=0.1)
    fa, _ = p.models()
    np.testing.assert_allclose(fa, a, rtol=0.1)
    # Exact without noise, and a given c reproduces the linear fit on transformed work.
    q = RuntimeProphet(3, quadratic=c)
    feed_quadratic(q, a, b, c, np.random.default_rng(seed), 30)
    qa, qb = q.models()
    np.testing.assert_allclose(qa, a, rtol=1e-6)
    np.testing.assert_allclose(qb, b, rtol=1e-4, atol=1e-9)


def test_prophet_quadratic_bad_input_and_old_checkpoints():
    with pytest.raises(ValueError, match="quadratic must be"):
        RuntimeProphet(2, quadratic="auto")
    with pytest.raises(ValueError, match="quadratic"):
        RuntimeProphet(2, quadratic=-1.0)
    with pytest.raises(ValueError, match="squared sizes"):
        RuntimeProphet(2, quadratic=0.1).update(np.ones(2), np.ones(2))
    with pytest.raises(ValueError, match="cap= with a quadratic"):
        hetlb.Chronica(cap=100.0, quadratic="fit")
    with pytest.raises(ValueError, match="cap"):
        ScheduleRule([1.0], [0.0], cap=[5.0], quadratic=0.1)
    # A linear prophet's checkpoint (5 rows) still loads and gives the same models.
    p = RuntimeProphet(2)
    feed(p, [0.001, 0.002], [0.01, 0.0], np.random.default_rng(0), 20)
    old = p.state_dict()
    n, s, q, ss, sq, qq, t, st_, qt = p.stats
    old["stats"] = np.stack([n, s, ss, t, st_]).tolist()
    del old["quadratic"]
    again = RuntimeProphet(2)
    again.load_state_dict(old)
    np.testing.assert_array_equal(again.models()[0], p.models()[0])


def test_rule_schedules_by_quadratic_work():
    from hetlb.data.board import PlanBoard
    from hetlb.core.decisions import decision_checksum
    lin = ScheduleRule([1.0, 1.0], [0.0, 0.0])
    quad = ScheduleRule([1.0, 1.0], [0.0, 0.0], quadratic=0.5)
    assert decision_checksum(lin) != decision_checksum(quad)
    assert ScheduleRule.from_dict(quad.to_dict()).quadratic == 0.5
    with pytest.raises(ValueError, match="quadratic"):
        ScheduleRule([1.0], [0.0], quadratic=-1)
    # One long sample against many short ones: by size they tie, by quadratic work they do not.
    sizes = np.array([8.0] + [1.0] * 8)
    board = PlanBoard(2, 0, 9)
    board.post(quad)
    plan = board.draw(0, 0, 9, 1, sizes)
    np.testing.assert_array_equal(plan.assignment, hetlb.schedule(quad.work(sizes), [1.0, 1.0], [0.0, 0.0]))
    assert plan.sizes.tolist() == [1, 8]  # the long sample alone: work 40 vs 8 * 1.5
    assert plan.data.tolist() == [8.0, 8.0]  # data (for weighting) stays the summed size
    assert plan.sq.tolist() == [64.0, 8.0]


def quadratic_worker(rank, world, quadratic, gb, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP
    n = gb * steps
    lens = np.clip(np.random.default_rng(5).lognormal(4.5, 1.0, n), 16, 1024).round()
    ds = torch.utils.data.TensorDataset(torch.arange(n))
    ddp = DDP(torch.nn.Linear(1, 1))
    emu = Emulator.for_rank(rank, [1.0, 2.0], model=hetlb.LinearModel(0.0, 3e-6), by="data",
                            quadratic=0.01, spin=0.0005)
    bal = hetlb.Balancer(ddp, gb, policy=hetlb.Chronica(quadratic=quadratic), weighting="sizes",
                         lower=0, emulator=emu)
    loader = bal.loader(ds, sample_sizes=lens, seed=1)
    for epoch in range(2):
        loader.set_epoch(epoch)
        for (idx,) in loader:
            ddp(idx[:, None].float()).sum().backward()
    recs = [r for r in bal.history if r.epoch == 1]
    assert all(r.sq is not None for r in recs)
    c = bal.policy._prophet.coefficient()
    return {"c": c}


def test_quadratic_work_is_fitted_in_a_balancer_on_attention_bound_ranks():
    """Emulated ranks 1:2 whose time is quadratic in sequence length: the records of a real
    Balancer carry the squared sizes, and Chronica(quadratic="fit") finds a positive quadratic
    term where the linear model (the paper's) keeps none. That the fitted term balances the
    steps where the linear model does not is a claim about times: test_sim.py's
    test_chronica_quadratic_schedules_by_work_in_the_simulator makes it on the simulator's exact
    times, bench_chronica.py on real emulated ranks (a loaded machine's noise on the measured
    times moves the fit: c came out between 0.0055 and 0.047 for a true 0.01 under load)."""
    from distributed import run, unwrap
    fit = unwrap(run(quadratic_worker, 2, "fit", 32, 10))
    lin = unwrap(run(quadratic_worker, 2, 0.0, 32, 10))
    assert 0 < fit[0]["c"] < np.inf and fit[0]["c"] == fit[1]["c"], (fit[0]["c"], fit[1]["c"])
    assert lin[0]["c"] == lin[1]["c"] == 0.0


@pytest.mark.parametrize("hold", [0.0, 0.5])
def test_chronica_hold_in_a_balancer_with_adaptive_blocks(hold, caplog):
    # One process: the paper's Chronica (hold=0) is refitted every decision, so its adaptive
    # blocks stay single steps (and the Balancer says so); with a hold the rule stays and the
    # blocks grow.
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    sizes = np.random.default_rng(0).integers(1, 50, 400)
    ds = torch.utils.data.TensorDataset(torch.randn(400, 2))
    with caplog.at_level("WARNING", logger="hetlb"):
        bal = hetlb.Balancer(net, 8, policy=hetlb.Chronica(hold=hold), lower=0,
                             exchange_every=8, adaptive_exchange=True)
    assert ("stay single steps" in caplog.text) == (hold == 0)
    loader = bal.loader(ds, sample_sizes=sizes)
    lens = []
    for (x,) in loader:
        net(x).sum().backward()
        net.zero_grad()
        lens.append(len(bal.history))
    assert len(bal.history) == 50  # every step recorded (the last when the loop ended)
    exchanges = len(set(lens))  # inside the loop the history grows at each exchange
    if hold == 0:
        assert exchanges == 50
    else:
        assert exchanges < 20, lens
