"""Uniform, LBB, DBS and WLBS on an in-process emulated cluster.

Each rank's step time is a known function ``T_r(step, b)``; the loop feeds the policy the
records a real trainer would (optionally applying decisions ``lag`` steps late, as a prefetching
data loader does) and every decision is checked against the context's bounds.
"""
import collections
import logging
import math
import pickle
from typing import Callable, List, Optional, Sequence

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import hetlb
from hetlb.policies.base import Context, check_sizes
from hetlb.policies.dbs import DBS
from hetlb.policies.lbb import LBB
from hetlb.policies.uniform import Uniform
from hetlb.policies.wlbs import WLBS
from hetlb.core.telemetry import History, StepRecord, UnusableTelemetry, straggler_effect

SPEEDS = np.array([1.0, 2.0, 3.0, 4.0])
A0, A1 = 0.01, 0.001  # 10 ms start-up, 1 ms per sample on the slowest rank


# -- emulated cluster --------------------------------------------------------------------------

def linear_cluster(speeds: Sequence[float] = SPEEDS, a0: float = A0, a1: float = A1,
                   noise: float = 0.0, seed: int = 0, disturb: Optional[tuple] = None,
                   ) -> Callable[[int, int, int], float]:
    """``T_r(step, b) = a0 + a1 * b / speed_r`` (+ seeded Gaussian noise of std ``noise`` s,
    + ``extra`` s on rank ``rank`` from step ``start`` for ``disturb=(rank, start, extra)``)."""
    speeds = np.asarray(speeds, float)
    a0s = np.broadcast_to(np.asarray(a0, float), speeds.shape)
    rng = np.random.default_rng(seed)
    cache = {}

    def T(r: int, step: int, b: int) -> float:
        t = a0s[r] + a1 * b / speeds[r]
        if noise:
            key = (r, step)  # the same draw however often a step is asked for
            if key not in cache:
                cache[key] = rng.normal(0.0, noise)
            t = max(t + cache[key], 1e-4)
        if disturb is not None and r == disturb[0] and step >= disturb[1]:
            t += disturb[2]
        return t
    return T


class Run:
    """Result of :func:`run`: sizes used, times, SE per step, decisions and the history."""

    def __init__(self) -> None:
        self.used: List[np.ndarray] = []
        self.times: List[np.ndarray] = []
        self.se: List[float] = []
        self.decisions: List[np.ndarray] = []
        self.history: Optional[History] = None


def record(step: int, sizes, times, epoch: int = 0) -> StepRecord:
    sizes = np.asarray(sizes, np.int64)
    n = sizes.size
    return StepRecord(step=step, epoch=epoch, batch=sizes, compute=np.asarray(times, float),
                      data=sizes.astype(float), memory=np.full(n, 0.1), cpu=np.full(n, 0.1))


def run(policy, ctx: Context, T, steps: int, steps_per_epoch: int = 10, lag: int = 0,
        block: int = 1) -> Run:
    """Run ``steps`` steps; a decision made after step k is used at step ``k + 1 + lag``. With
    ``block > 1`` the policy decides after the first step, then after every ``block`` steps and
    at each epoch's end (as ``Balancer(exchange_every=block)`` does); the sizes hold in between."""
    out = Run()
    h = History(ctx.world)
    s0 = d = check_sizes(policy.start(ctx), ctx, policy.name)
    since = 0  # steps since the last decision
    out.decisions.append(s0)
    pending = collections.deque([s0] * (lag + 1))
    for k in range(steps):
        b = pending.popleft()
        t = np.array([T(r, k, int(b[r])) for r in range(ctx.world)])
        h.append(record(k, b, t, epoch=k // steps_per_epoch))
        out.used.append(b)
        out.times.append(t)
        out.se.append(straggler_effect(t, b))
        since += 1
        if k == 0 or since == block or (k + 1) % steps_per_epoch == 0:
            d = check_sizes(policy.decide(h), ctx, policy.name)
            since = 0
        out.decisions.append(d)
        pending.append(d)
    out.history = h
    return out


def gap(times) -> float:
    t = np.asarray(times)
    return float((t.max() - t.min()) / t.mean())


def profiles(speeds=SPEEDS, a0=A0, a1=A1):
    """What profiling would give for the linear cluster: a cubic (with zero high terms) and a line."""
    return [{"model": hetlb.PolyModel([0.0, 0.0, a1 / s, a0]), "linear": hetlb.LinearModel(a0, a1 / s),
             "limit": 10**6} for s in speeds]


# -- Uniform -----------------------------------------------------------------------------------

def test_uniform_equal_split_remainder_to_low_ranks():
    ctx = Context.simple(4, 10, lower=0)
    r = run(Uniform(), ctx, linear_cluster(), 5)
    for d in r.decisions:
        assert d.tolist() == [3, 3, 2, 2]


def test_uniform_respects_upper_bounds():
    ctx = Context(3, 30, lower=[0, 0, 0], upper=[4, 30, 30])
    r = run(Uniform(), ctx, linear_cluster(SPEEDS[:3]), 3)
    assert all(d.tolist() == [4, 13, 13] for d in r.decisions)


def test_emit_checks_every_new_decision_and_hands_out_copies():
    """emit() skips the bounds check only for the unchanged decision it already checked; the
    remembered decision is read-only, so it cannot change unchecked."""
    p = Uniform()
    ctx = Context.simple(3, 9)
    first = p.start(ctx)
    first[0] = 100  # a copy: the policy's own decision is unaffected
    assert p.emit(p.last).tolist() == [3, 3, 3]
    with pytest.raises(ValueError, match="read-only"):
        p.last[0] += 1
    moved = p.last.copy()
    moved[0] += 1
    with pytest.raises(ValueError, match="summing to 10"):
        p.emit(moved)
    p.last = np.array([9, 0, 0])  # replaced, not checked yet
    with pytest.raises(ValueError, match="outside bounds"):
        p.emit(p.last)
    restored = Uniform()
    with pytest.raises(ValueError, match="summing to 12"):  # a restored decision is checked
        restored.load_state_dict({**p.state_dict(), "last": np.array([4, 4, 4])})
    restored.load_state_dict({**p.state_dict(), "last": np.array([4, 4, 1])})
    restored.last = np.array([4, 4, 4])  # replaced after the load: checked on its first emit
    with pytest.raises(ValueError, match="summing to 12"):
        restored.emit(restored.last)


# -- LBB ---------------------------------------------------------------------------------------

def test_lbb_with_profiles_balanced_at_once():
    ctx = Context.simple(4, 500, lower=1, profiles=profiles())
    p = LBB()
    r = run(p, ctx, linear_cluster(), 20)
    assert r.used[0].tolist() == [50, 100, 150, 200]
    assert max(r.se) < 0.05
    assert set(p.actions) == {"none"}


@pytest.mark.parametrize("lag", [0, 1])
def test_lbb_without_profiles_converges_from_uniform(lag):
    ctx = Context.simple(4, 500, lower=1)
    p = LBB()
    r = run(p, ctx, linear_cluster(noise=1e-5, seed=1), 60, lag=lag)
    assert r.used[0].tolist() == [125, 125, 125, 125] and r.se[0] > 1.0
    assert p.actions[0] == "rapid" and p.actions.count("rapid") == 1
    assert r.se[2 + lag] < 0.3  # rough balance right after the rapid-tune
    assert max(r.se[-10:]) < 0.05  # fine-tuning finished the job
    assert p.last_se == pytest.approx(r.se[-1])


@pytest.mark.parametrize("rank", [0, 3])
@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("priority", [math.inf, 0.1])
def test_lbb_recovers_from_disturbance_with_one_rapid_tune(rank, lag, priority):
    # LBB's case study: +50 ms on one worker. The paper's fine-tune (the default) moves one
    # sample per step after the rapid-tune; the opt-in priority halves a much slower rank's
    # excess, and settles several times sooner (measured 2-10 steps against 17-56).
    k = 30
    ctx = Context.simple(4, 500, lower=1, profiles=profiles())
    p = LBB(priority=priority)
    T = linear_cluster(noise=2e-4, seed=rank, disturb=(rank, k, 0.05))
    r = run(p, ctx, T, 130, lag=lag)
    assert max(r.se[:k]) < 0.1 and r.se[k] > 0.3  # the disturbance is severe
    assert p.actions[:k].count("rapid") == 0
    assert p.actions[k:].count("rapid") == 1
    assert p.actions[k] == "rapid"  # reacted at the first disturbed record
    settled = next(i for i in range(k, 126) if max(r.se[i:i + 5]) < 0.1)
    if math.isinf(priority):
        assert set(p.actions[k + 1:]) <= {"none", "fine"}
        assert settled <= k + 60 and max(r.se[-20:]) <= 0.06
    else:
        assert settled <= k + 8 * (lag + 1)
    # The disturbed rank lost work to the others.
    assert r.used[-1][rank] < r.used[k][rank]


def test_lbb_first_fine_tune_moves_one_sample():
    # [100]*4, one rank 25 % slower: SE = 0.25 / 1.0625 = 0.235, a fine-tune. The paper moves
    # "usually 1" sample from the slowest rank to the fastest; the opt-in priority moves more.
    h = History(4)
    h.append(record(0, [100] * 4, [1.25, 1.0, 1.0, 1.0]))
    p = LBB()
    p.start(Context.simple(4, 400, lower=0))
    assert p.decide(h).tolist() == [99, 101, 100, 100] and p.actions == ["fine"]
    q = LBB(priority=0.1)
    q.start(Context.simple(4, 400, lower=0))
    assert q.decide(h).tolist() == [93, 103, 102, 102]


def test_lbb_fine_tune_moves_step_from_slowest_to_fastest():
    ctx = Context.simple(4, 400, lower=0)
    p = LBB(step=3)
    p.start(ctx)
    h = History(4)
    h.append(record(0, [100] * 4, [1.0, 1.1, 1.05, 1.08]))  # SE 0.095, slowest excess 4 %
    assert p.decide(h).tolist() == [103, 97, 100, 100]
    assert p.actions == ["fine"]
    assert p.last_se == pytest.approx(0.1 / np.mean([1.0, 1.1, 1.05, 1.08]))


def test_lbb_keeps_sizes_below_fine_threshold():
    p = LBB()
    p.start(Context.simple(4, 400, lower=0))
    h = History(4)
    h.append(record(0, [100] * 4, [1.0, 1.04, 1.02, 1.0]))
    assert p.decide(h).tolist() == [100] * 4 and p.actions == ["none"]


def test_lbb_fine_tune_waits_for_its_decision_to_take_effect():
    p = LBB()
    p.start(Context.simple(4, 400, lower=0))
    h = History(4)
    h.append(record(0, [100] * 4, [1.0, 1.1, 1.05, 1.08]))
    d1 = p.decide(h)
    assert d1.tolist() == [101, 99, 100, 100]
    # The loader prefetched: the next step still ran the old sizes. No second move on stale data.
    h.append(record(1, [100] * 4, [1.0, 1.1, 1.05, 1.08]))
    assert p.decide(h).tolist() == d1.tolist() and p.actions[-1] == "none"
    h.append(record(2, d1, [1.01, 1.09, 1.05, 1.08]))
    assert p.decide(h).tolist() == [102, 98, 100, 100]


def test_lbb_rapid_tune_is_the_rough_model_solution():
    prof = profiles()
    prof[2]["linear"] = hetlb.LinearModel(0.5, 0.001)  # a0 larger than the step: guard drops it
    ctx = Context.simple(4, 500, lower=1, profiles=prof)
    p = LBB()
    p.start(ctx)
    h = History(4)
    b, t = np.array([125] * 4), np.array([0.2, 0.1, 0.07, 0.05])
    h.append(record(0, b, t))
    got = p.decide(h)
    assert p.actions == ["rapid"]
    a0 = np.array([A0, A0, 0.0, A0])
    want = hetlb.allocate([hetlb.LinearModel(a0[i], (t[i] - a0[i]) / b[i]) for i in range(4)],
                          500, ctx.lower, ctx.upper)
    assert got.tolist() == want.tolist()
    # Inside the observation window a high SE does not rapid-tune again.
    h.append(record(1, b, t))
    p.decide(h)
    assert p.actions == ["rapid", "none"]


def test_lbb_observation_window_counts_records_that_ran_the_rapid_tune():
    p = LBB(window=3)
    p.start(Context.simple(2, 100, lower=0))
    h = History(2)
    # A severe straggler, and the loader keeps delivering the sizes from before the rapid-tune
    # (a prefetch deeper than the window): those stale records do not count, so no second
    # rapid-tune on stale information.
    for k in range(6):
        h.append(record(k, [50, 50], [1.0, 2.0]))
        p.decide(h)
    assert p.actions == ["rapid"] + ["none"] * 5 and p.waiting == p.last.tolist()
    # Once records run the rapid-tune's sizes, `window` of them allow only fine-tuning (the
    # first one fine-tunes; later ones ran older sizes than its move); then a rapid-tune again.
    d = p.last.copy()
    for k in range(6, 10):
        h.append(record(k, d, [1.0, 2.0]))
        p.decide(h)
    assert p.actions[6:10] == ["fine", "none", "none", "rapid"]
    assert p.waiting == p.last.tolist() != d.tolist()  # the new rapid-tune's wait


def test_lbb_confirm_rapid_tunes_only_after_that_many_high_records_in_a_row():
    # Two identical ranks; one noisy step (SE 0.4) fine-tunes under confirm=3 where the paper's
    # rule rapid-tunes; three in a row rapid-tune on the third.
    noisy = [1.0, 1.4]
    paper, confirmed = LBB(), LBB(confirm=3)
    for p in (paper, confirmed):
        p.start(Context.simple(2, 128, lower=1))
    h = History(2)
    h.append(record(0, [64, 64], noisy))
    assert paper.decide(h).tolist() != [64, 64] and paper.actions == ["rapid"]
    assert confirmed.decide(h).tolist() == [65, 63] and confirmed.actions == ["fine"]
    assert confirmed.high == 1
    h.append(record(1, [65, 63], [1.0, 1.0]))  # a calm step ends the run
    confirmed.decide(h)
    assert confirmed.high == 0
    sizes = confirmed.last.tolist()
    for k in range(2, 5):
        h.append(record(k, sizes, [1.0, 1.5]))
        sizes = confirmed.decide(h).tolist()
    assert confirmed.actions[2:] == ["fine", "fine", "rapid"] and confirmed.high == 0


def test_lbb_confirm_does_not_count_records_inside_the_window():
    p = LBB(window=2, confirm=2)
    p.start(Context.simple(2, 100, lower=0))
    h = History(2)
    for k in range(2):
        h.append(record(k, [50, 50], [1.0, 2.0]))
        p.decide(h)
    assert p.actions == ["fine", "rapid"]
    d = p.last.tolist()
    for k in range(2, 4):  # the window: two records of the rapid-tune's sizes, still slow
        h.append(record(k, d, [1.0, 2.0]))
        p.decide(h)
        assert p.high == 0
    h.append(record(4, p.last, [1.0, 2.0]))
    p.decide(h)
    assert p.actions[-1] == "fine" and p.high == 1  # the first high record after the window


def test_a_checkpoint_from_before_a_setting_existed_resumes_with_its_default():
    from hetlb.policies.base import check_same_policy
    old = {"policy_type": "LBB", "policy_settings": {k: v for k, v in LBB().settings().items()
                                                     if k != "confirm"}}
    check_same_policy(LBB(), old, "this run")  # confirm=1 is what the old run did
    with pytest.raises(ValueError, match="confirm"):
        check_same_policy(LBB(confirm=3), old, "this run")


def rapid_tuned_lbb():
    """An LBB(window=10) that rapid-tuned on step 0; its history and the sizes it waits for."""
    p = LBB(window=10)
    p.start(Context.simple(2, 100, lower=0))
    h = History(2)
    h.append(record(0, [50, 50], [1.0, 2.0]))
    p.decide(h)
    assert p.actions == ["rapid"] and p.window_left == 10
    return p, h, p.last.tolist()


def test_lbb_observation_window_counts_every_record_of_a_block():
    # With exchange_every=k the policy decides once per block of k records: all of them count
    # in the window (8 of 10 here), not one per decision, which would stretch the window k-fold.
    p, h, d = rapid_tuned_lbb()
    for k in range(1, 9):
        h.append(record(k, d, [1.0, 1.02]))
    p.decide(h)
    assert p.waiting is None and p.window_left == 2 and p.last_step == 8
    p.decide(h)  # the same history again: nothing new to count
    assert p.window_left == 2
    for k in range(9, 12):
        h.append(record(k, p.last, [1.0, 2.0]))
    p.decide(h)  # records 9 and 10 close the window; record 11 is outside it
    assert p.actions[-1] == "rapid" and p.waiting == p.last.tolist() and p.window_left == 10


@pytest.mark.parametrize("make", [lambda: DBS(steps_per_epoch=10),
                                  lambda: WLBS(steps_per_epoch=10, theta_b=1e9, theta_e=1e-3)])
def test_epoch_totals_count_every_record_of_a_block(make):
    # DBS (and WLBS with small adjustments off) change sizes only at an epoch's end, from the
    # epoch's totals: deciding once per block of 5 steps must give exactly the per-step run.
    ctx = Context.simple(4, 500, lower=1, hardware=[{"cpus": c, "cores": c, "memory": 1e9}
                                                     for c in (1, 1, 1, 1)])
    T = linear_cluster(noise=2e-3, seed=3, disturb=(2, 13, 0.05))
    per_step = run(make(), ctx, T, 40)
    blocks = run(make(), ctx, T, 40, block=5)
    assert [u.tolist() for u in blocks.used] == [u.tolist() for u in per_step.used]
    assert len({tuple(u.tolist()) for u in per_step.used}) > 2  # the sizes did move


@pytest.mark.parametrize("make", [lambda: DBS(steps_per_epoch=4),
                                  lambda: WLBS(steps_per_epoch=4, theta_b=1e9, theta_e=1e-3)])
def test_a_refused_record_is_not_counted_at_the_next_decision(make):
    # Step 1 made no progress anywhere: the policy refuses it as the newest record, and must not
    # count it when it reads the records since its last decision at step 2 (k = 1 as before).
    recs = [record(k, [50, 50], [1.0, 2.0 + 0.1 * k]) for k in range(4)]
    recs[1] = record(1, [50, 50], [np.inf, np.inf])
    ctx = Context.simple(2, 100, lower=1)
    with_refused, without = make(), make()
    with_refused.start(ctx)
    without.start(ctx)
    h, clean = History(2), History(2)
    for r in recs:
        h.append(r)
        try:
            a = with_refused.decide(h)
        except UnusableTelemetry:
            continue
        clean.append(r)
        b = without.decide(clean)
    assert a.tolist() == b.tolist() and a.tolist() != [50, 50]


def test_lbb_window_skips_a_refused_record():
    p, h, d = rapid_tuned_lbb()
    for k, t in ((1, [1.0, 1.02]), (2, [np.inf, np.inf]), (3, [1.0, 1.02])):
        h.append(record(k, d, t))
        try:
            p.decide(h)
        except UnusableTelemetry:
            pass
    assert p.window_left == 8  # records 1 and 3; the refused step 2 is not counted


def test_lbb_state_saved_without_last_step_counts_from_the_restored_history():
    p = LBB()
    p.start(Context.simple(2, 100))
    p.last_step = 50  # an instance that has decided before
    old = {k: v for k, v in p.state_dict().items() if k != "last_step"}
    p.load_state_dict(old)
    assert p.last_step is None


def test_lbb_memory_limit_never_exceeded():
    ctx = Context(4, 500, lower=np.ones(4), upper=[500, 500, 500, 120])
    p = LBB()
    r = run(p, ctx, linear_cluster(noise=1e-4), 60)
    used = np.array(r.used)
    assert used[:, 3].max() <= 120
    assert used[-1, 3] == 120  # the fastest rank is held at its limit...
    t = r.times[-1][:3]
    assert gap(t) < 0.05  # ...and the others share the rest evenly in time


def nonlinear_cluster(kind: str, speeds: Sequence[float] = SPEEDS):
    """Time models that are not lines (LBB Fig. 3): "saturating", flat below a batch size then
    linear (an unsaturated GPU); "cubic", a launch overhead plus a cubic growth."""
    speeds = np.asarray(speeds, float)

    def t_true(r: int, b: float) -> float:
        s = speeds[r]
        if kind == "saturating":
            return 0.02 + 0.001 * max(b, 64.0) / s
        return (0.015 + 2e-4 * b + 4e-7 * b ** 2 + 1e-9 * b ** 3) / s

    def T(r: int, step: int, b: int) -> float:
        return t_true(r, b)
    return T, t_true


@pytest.mark.parametrize("kind", ["saturating", "cubic"])
@pytest.mark.parametrize("profiled", [False, True])
def test_lbb_on_nonlinear_clusters(kind, profiled):
    # Rapid-tune's rough lines are not exact here; fine-tuning finishes the job.
    T, t_true = nonlinear_cluster(kind)
    prof = []
    if profiled:  # LBB's profiling phase: powers of two, a cubic fit
        pts = [2 ** p for p in range(1, 10)]
        prof = [{"model": hetlb.PolyModel.fit(pts, [t_true(r, b) for b in pts], degree=3),
                 "linear": hetlb.LinearModel.fit(pts, [t_true(r, b) for b in pts]), "limit": 512}
                for r in range(4)]
    ctx = Context.simple(4, 500, lower=1, profiles=prof)
    p = LBB()
    r = run(p, ctx, T, 200)
    best = hetlb.allocate([hetlb.PiecewiseModel(list(range(1, 501)), [t_true(q, b) for b in range(1, 501)])
                           for q in range(4)], 500, ctx.lower, ctx.upper)
    best_times = [t_true(q, int(b)) for q, b in enumerate(best)]
    final = max(r.times[-1])
    assert final <= max(best_times) * 1.05, (r.used[-1], best, final, max(best_times))
    # A rank in the flat (unsaturated) region cannot be equalised in time: compare SE with the
    # optimum's own.
    assert max(r.se[-20:]) < max(0.1, straggler_effect(best_times) + 0.05)
    if not profiled:
        assert p.actions.count("rapid") <= 2


# -- DBS ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("steps_per_epoch_known", [True, False])
def test_dbs_per_epoch_proportional(steps_per_epoch_known):
    spe = 10
    ctx = Context.simple(4, 500, lower=1)
    p = DBS(steps_per_epoch=spe if steps_per_epoch_known else None)
    T = linear_cluster(a0=0.0)
    r = run(p, ctx, T, 3 * spe, steps_per_epoch=spe)
    used = np.array(r.used)
    first = 0 if steps_per_epoch_known else 1  # the boundary is seen one step late otherwise
    for e in range(3):
        block = used[e * spe + first:(e + 1) * spe]
        assert (block == block[0]).all(), f"sizes changed within epoch {e}"
    assert used[0].tolist() == [125] * 4
    assert used[spe + first].tolist() == [50, 100, 150, 200]
    assert p.speed == pytest.approx(SPEEDS / A1)


def test_dbs_speeds_include_overhead():
    # With a start-up cost, the epoch speed (samples / seconds) is what the split follows.
    ctx = Context.simple(4, 500, lower=1)
    p = DBS(steps_per_epoch=5)
    r = run(p, ctx, linear_cluster(), 6, steps_per_epoch=5)
    v = 125 / (A0 + A1 * 125 / SPEEDS)
    assert r.used[5].tolist() == hetlb.allocate_proportional(v, 500, ctx.lower, ctx.upper).tolist()


def test_dbs_rank_without_samples_keeps_its_last_speed():
    ctx = Context.simple(3, 300, lower=0)
    p = DBS(steps_per_epoch=1)
    p.start(ctx)
    h = History(3)
    h.append(record(0, [100, 100, 100], [1000.0, 1.0, 2.0], epoch=0))
    assert p.decide(h).tolist() == [0, 200, 100]  # rank 0 is 1000x slower: nothing for it
    h.append(record(1, [0, 200, 100], [0.0, 2.0, 1.0], epoch=1))
    # No sample, no new measurement: still the last known (tiny) speed, not a guess.
    assert p.decide(h).tolist() == [0, 150, 150]
    assert p.speed[0] == pytest.approx(0.1)


# -- WLBS --------------------------------------------------------------------------------------

def test_wlbs_initial_division_from_hardware(caplog):
    # The paper's indicators (CPUs, cores, memory), each normalised, equal weights.
    hw = [{"cpus": c, "cores": c / 2, "memory": m} for c, m in ((8, 8e9), (8, 16e9), (16, 16e9), (16, 32e9))]
    scores = np.array([(8 / 16 + 4 / 8 + 8 / 32), (8 / 16 + 4 / 8 + 16 / 32), (1 + 1 + 16 / 32), 3.0]) / 3
    p = WLBS()
    got = p.start(Context.simple(4, 1000, lower=1, hardware=hw))
    assert got.tolist() == hetlb.allocate_proportional(scores, 1000).tolist()
    # Configured weights: GPUs only.
    hwg = [{"cpus": 8.0, "cores": 4.0, "memory": 1e9, "gpu_sms": s} for s in (10, 20, 30, 40)]
    assert WLBS(indicators={"gpu_sms": 1.0}).start(Context.simple(4, 500, lower=1, hardware=hwg)).tolist() == \
        [50, 100, 150, 200]
    # A missing indicator somewhere: the equal split, named in a warning (a misspelt name was
    # silently the equal split).
    with caplog.at_level(logging.WARNING, "hetlb.policies"):
        assert WLBS().start(Context.simple(4, 10, lower=0, hardware=[{"cpus": 1}] * 4)).tolist() == [3, 3, 2, 2]
        assert "indicator(s) ['cores', 'memory'] not reported by every rank" in caplog.text
        caplog.clear()
        assert WLBS(indicators={"cpu": 1}).start(Context.simple(4, 10, lower=0, hardware=hw)).tolist() \
            == [3, 3, 2, 2] and "['cpu'] not reported" in caplog.text
        caplog.clear()
        assert WLBS().start(Context.simple(4, 10, lower=0)).tolist() == [3, 3, 2, 2]  # no info
        assert caplog.text == ""


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("relative", [False, True])
def test_wlbs_converges_from_wrong_hardware_ratio(lag, relative):
    hw = [{"cpus": c, "cores": c, "memory": 1e9} for c in (8, 4, 6, 2)]  # the opposite of 1:2:3:4
    p = WLBS(theta_b=0.05, relative=True) if relative else WLBS(theta_b=0.005)
    ctx = Context.simple(4, 500, lower=1, hardware=hw)
    r = run(p, ctx, linear_cluster(noise=1e-5, seed=3), 60, lag=lag)
    assert r.used[0][0] > r.used[0][3] and gap(r.times[0]) > 1.0
    assert "small" in p.actions
    final = [np.asarray(t) for t in r.times[-15:]]
    if relative:
        assert max(gap(t) for t in final) < p.theta_b
    else:
        assert max(t.max() - t.min() for t in final) < 2 * p.theta_b


def test_wlbs_small_adjustment_only_touches_slowest_and_fastest():
    p = WLBS()
    p.start(Context.simple(4, 400, lower=0))
    h = History(4)
    h.append(record(0, [100] * 4, [1.0, 2.0, 1.5, 1.2]))
    d = p.decide(h)
    assert d[2] == 100 and d[3] == 100
    assert d.tolist() == [133, 67, 100, 100]  # pair of 200 split 2:1 by speed
    assert p.actions == ["small"]


def test_wlbs_small_adjustment_does_not_swap_back_and_forth():
    # Two equal ranks and an odd batch: no integer split is within theta_b; moving a sample
    # would only make the other rank the straggler.
    ctx = Context.simple(2, 3, lower=0)
    p = WLBS()
    r = run(p, ctx, linear_cluster([1.0, 1.0], a0=0.0), 10)
    assert all(d.tolist() == [2, 1] for d in r.decisions)
    assert set(p.actions) == {"none"}


def test_wlbs_major_adjustment_at_epoch_boundary():
    # Step times equal within theta_b each step, but rank 0 was slow in one step of epoch 0.
    p = WLBS(theta_b=0.5, theta_e=0.05)
    p.start(Context.simple(2, 200, lower=0))
    h = History(2)
    h.append(record(0, [100, 100], [1.0, 1.4], epoch=0))
    h.append(record(1, [100, 100], [1.0, 1.4], epoch=0))
    assert p.decide(h).tolist() == [100, 100]
    h.append(record(2, [100, 100], [1.0, 1.0], epoch=1))
    assert p.decide(h).tolist() == [117, 83]  # epoch speeds 200/2.0 : 200/2.8
    assert p.actions[-1] == "major"


@pytest.mark.parametrize("theta_e, want", [(0.1, [133, 100, 67]), (5.0, [100, 100, 100])])
def test_wlbs_major_adjustment_moves_only_between_best_and_worst(theta_e, want):
    # Epoch times 2.0, 3.0, 4.0 s: only ranks 0 (best) and 2 (worst) change, their pair of 200
    # split 2:1 by epoch speed; within theta_e nothing changes.
    p = WLBS(theta_b=10.0, theta_e=theta_e)
    p.start(Context.simple(3, 300, lower=0))
    h = History(3)
    for k in range(2):
        h.append(record(k, [100] * 3, [1.0, 1.5, 2.0], epoch=0))
        p.decide(h)
    h.append(record(2, [100] * 3, [1.0, 1.5, 2.0], epoch=1))
    assert p.decide(h).tolist() == want
    assert p.actions[-1] == ("major" if want[1] == 100 and want[0] != 100 else "none")


def test_wlbs_epoch_end_from_the_record_closes_the_epoch_on_time():
    # The Balancer's loader marks an epoch's last step: the major adjustment applies from the
    # next epoch's first step, without steps_per_epoch.
    p = WLBS(theta_b=10.0, theta_e=0.1)
    p.start(Context.simple(2, 200, lower=0))
    h = History(2)
    h.append(record(0, [100, 100], [1.0, 2.0]))
    assert p.decide(h).tolist() == [100, 100]
    h.append(StepRecord(1, 0, np.array([100, 100]), np.array([1.0, 2.0]), np.array([100.0, 100.0]),
                        np.full(2, 0.1), np.full(2, 0.1), epoch_end=True))
    assert p.decide(h).tolist() == [133, 67] and p.actions[-1] == "major"


def test_wlbs_redistributes_stalled_rank():
    hw = [{"cpus": c, "cores": c, "memory": 1e9} for c in (1, 2, 3, 4)]
    ctx = Context.simple(4, 500, lower=1, hardware=hw)
    p = WLBS()

    def T(r, k, b):
        base = linear_cluster()(r, k, b)
        return base * 1000 if (r == 2 and k >= 5) else base  # all but stopped
    r = run(p, ctx, T, 30)
    assert p.actions[5] == "redistribute" and p.actions.count("redistribute") == 1
    assert p.failed.tolist() == [False, False, True, False]
    assert r.used[-1][2] == 1  # held at its lower bound
    # Its share went to the others in proportion to their speeds: still balanced.
    assert gap(np.delete(r.times[-1], 2)) < 0.05
    assert r.used[-1].sum() == 500


def test_wlbs_inf_time_is_a_failure_and_failed_rank_can_come_back():
    p = WLBS(steps_per_epoch=2)
    p.start(Context(3, 300, lower=[10, 10, 10], upper=[300] * 3))
    h = History(3)
    h.append(record(0, [100] * 3, [1.0, np.inf, 1.0]))
    d = p.decide(h)
    assert d.tolist() == [145, 10, 145] and p.actions == ["redistribute"]
    h.append(record(1, d, [1.45, 0.1, 1.45]))  # the rank is back and fast again
    d = p.decide(h)  # end of epoch 0: it stalled in it, so it stays out
    assert d[1] == 10 and p.failed[1]
    h.append(record(2, d, [1.45, 0.1, 1.45], epoch=1))
    p.decide(h)
    h.append(record(3, d, [1.45, 0.1, 1.45], epoch=1))
    d = p.decide(h)  # a whole epoch without stalling: taken back at its measured speed
    assert not p.failed.any() and p.actions[-1] == "major" and d[1] > 10


# -- every policy ------------------------------------------------------------------------------

POLICIES = [Uniform, LBB, DBS, WLBS]


@st.composite
def clusters(draw):
    n = draw(st.integers(1, 8))
    B = draw(st.integers(n, 2000))
    lower = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    upper = draw(st.lists(st.integers(1, B), min_size=n, max_size=n))
    upper = np.maximum(upper, lower)
    short = B - int(upper.sum())
    if short > 0:  # make the memory limits feasible
        upper = upper + short // n + 1
    speeds = draw(st.lists(st.floats(0.05, 20), min_size=n, max_size=n))
    a0 = draw(st.lists(st.floats(0, 0.05), min_size=n, max_size=n))
    seed = draw(st.integers(0, 2**16))
    lag = draw(st.integers(0, 2))
    prof = draw(st.booleans())
    hw = [{"cpus": float(draw(st.integers(1, 64))), "cores": float(draw(st.integers(1, 64))), "memory": 1e9}
          for _ in range(n)] if draw(st.booleans()) else []
    return n, B, np.array(lower), upper, np.array(speeds), np.array(a0), seed, lag, prof, hw


@given(clusters(), st.sampled_from(POLICIES))
def test_random_clusters_always_valid(cluster, cls):
    n, B, lower, upper, speeds, a0, seed, lag, prof, hw = cluster
    ctx = Context(n, B, lower, upper, hardware=hw,
                  profiles=profiles(speeds, a0=float(a0.mean())) if prof else [])
    T = linear_cluster(speeds, a0=a0, noise=1e-4, seed=seed,
                       disturb=(seed % n, 7, 0.05) if seed % 2 else None)
    r = run(cls(), ctx, T, 16, steps_per_epoch=5, lag=lag)  # run() checks every decision
    for d in r.decisions:
        assert d.dtype == np.int64 and d.sum() == B
        assert np.all(d >= ctx.lower) and np.all(d <= ctx.upper)


@pytest.mark.parametrize("make", [Uniform, LBB, DBS, WLBS, lambda: LBB(step=4, window=2),
                                  lambda: LBB(confirm=2, window=2), lambda: WLBS(steps_per_epoch=5)])
def test_state_dict_round_trip_decides_identically(make):
    ctx = Context.simple(4, 500, lower=1, hardware=[{"cpus": c, "cores": c, "memory": 1e9} for c in (4, 3, 2, 1)])
    T = linear_cluster(noise=3e-4, seed=7, disturb=(1, 12, 0.05))
    a = make()
    h = History(4)
    sizes = a.start(ctx)
    b = None
    a_out, b_out = [], []
    for k in range(30):
        t = np.array([T(r, k, int(sizes[r])) for r in range(4)])
        h.append(record(k, sizes, t, epoch=k // 5))
        if k == 8:
            # A fresh instance restored from a pickled state, without start().
            b = make()
            b.load_state_dict(pickle.loads(pickle.dumps(a.state_dict())))
        da = a.decide(h)
        if b is not None:
            a_out.append(da.tolist())
            b_out.append(b.decide(h).tolist())
        sizes = da
    assert a_out == b_out
    if make is not Uniform:
        assert len({tuple(x) for x in a_out}) > 1  # the policy did adapt after the restore


@pytest.mark.parametrize("bad", [np.nan, 0.0, -1.0])
def test_structurally_bad_telemetry_never_reaches_a_policy(bad):
    h = History(3)
    with pytest.raises(UnusableTelemetry, match="rank 1"):
        h.append(record(0, [10, 10, 10], [1.0, bad, 1.0]))
    assert len(h) == 0


@pytest.mark.parametrize("cls", POLICIES)
def test_a_rank_without_progress(cls):
    # +inf compute passes the structural check; what it means is the policy's to say.
    p = cls()
    p.start(Context.simple(3, 30, lower=1))
    h = History(3)
    h.append(record(0, [10, 10, 10], [1.0, np.inf, 1.0]))
    if cls in (LBB, DBS):
        with pytest.raises(UnusableTelemetry, match="ranks \\[1\\] made no progress"):
            p.decide(h)
    elif cls is WLBS:
        assert p.decide(h).tolist() == [15, 1, 14] and p.actions == ["redistribute"]
    else:  # Uniform: the split does not depend on anyone's speed
        assert p.decide(h).tolist() == [10, 10, 10]


@pytest.mark.parametrize("cls", POLICIES)
def test_misuse_raises(cls):
    p = cls()
    with pytest.raises(RuntimeError, match="start"):
        p.decide(History(2))
    p.start(Context.simple(2, 10))
    with pytest.raises(ValueError, match="empty history"):
        p.decide(History(2))
    h = History(3)
    h.append(record(0, [3, 3, 4], [1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="3 ranks"):
        p.decide(h)


def test_all_ranks_inf_raises_for_wlbs():
    p = WLBS()
    p.start(Context.simple(2, 10))
    h = History(2)
    h.append(record(0, [5, 5], [np.inf, np.inf]))
    with pytest.raises(ValueError, match="no rank made progress"):
        p.decide(h)


@pytest.mark.parametrize("kwargs", [dict(fine=-0.1), dict(fine=0.3, rapid=0.1), dict(step=0),
                                    dict(step=1.5), dict(window=-1), dict(priority=0),
                                    dict(rapid=float("nan")), dict(confirm=0), dict(confirm=1.5)])
def test_lbb_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        LBB(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(theta_b=-1), dict(theta_e=np.nan), dict(stall=1.0),
                                    dict(indicators={"cpus": -1.0}), dict(indicators={"cpus": 0.0}),
                                    dict(steps_per_epoch=0)])
def test_wlbs_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        WLBS(**kwargs)


def test_lbb_action_log_is_bounded(monkeypatch):
    monkeypatch.setattr(LBB, "ACTIONS_KEPT", 8)
    ctx = Context.simple(4, 500, lower=1, profiles=profiles())
    p = LBB()
    run(p, ctx, linear_cluster(), 20)
    assert len(p.actions) == 8 and set(p.actions) == {"none"}
    q = LBB()
    q.load_state_dict(p.state_dict())
    assert q.actions == p.actions


def test_lbb_models_the_overhead_of_each_micro_step():
    """A rank with Balancer(micro_batch=m) runs ceil(b / m) passes: LBB's start (profiled models)
    and its rapid-tune (rough models) count one overhead a pass, as the step takes."""
    from hetlb.core.models import micro_step_model
    lin = [hetlb.LinearModel(0.05, 0.004), hetlb.LinearModel(0.05, 0.001)]
    prof = [{"model": m, "linear": m, "limit": 10} for m in lin]
    ctx = Context(2, 100, [1, 1], [100, 100], profiles=prof, micro_batch=[None, 10])
    p = LBB()
    got = p.start(ctx)
    want = hetlb.allocate([lin[0], micro_step_model(lin[1], 10, 100)], 100)
    assert got.tolist() == want.tolist()
    assert got.tolist() != hetlb.allocate(lin, 100).tolist()  # (one pass: more to rank 1)
    # A record of k passes: the rapid-tune recovers the slope under k overheads.
    h = History(2)
    b = np.array([50, 50])
    t = np.array([0.05 + 0.004 * 50, 5 * 0.05 + 0.001 * 50]) * np.array([1.0, 3.0])  # (a change)
    h.append(record(0, b, t))
    got = p.decide(h)
    assert p.actions == ["rapid"]
    slope = [(t[0] - 0.05) / 50, (t[1] - 5 * 0.05) / 50]
    want = hetlb.allocate([hetlb.LinearModel(0.05, slope[0]),
                           micro_step_model(hetlb.LinearModel(0.05, slope[1]), 10, 100)], 100)
    assert got.tolist() == want.tolist()


def test_a_context_refuses_a_bad_micro_batch():
    with pytest.raises(ValueError, match="micro_batch"):
        Context(2, 10, [1, 1], [10, 10], micro_batch=[0, 2])
    with pytest.raises(ValueError, match="micro_batch"):
        Context(2, 10, [1, 1], [10, 10], micro_batch=[3])
