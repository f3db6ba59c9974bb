"""Emulated heterogeneity: target-time math, determinism, stretching accuracy, bandwidth."""
import re
import statistics
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetlb.sim.emulate import Disturbance, Emulator, sleep_until
from hetlb.core.models import LinearModel, PolyModel


def _plain_target(model, speed, noise, jitter, dist, seed, rank, step, batch, measured=0.0):
    """The documented formula, written out independently."""
    base = max(model.a0 + model.a1 * batch, 0.0) if model is not None else measured
    r = np.random.default_rng([seed, rank, step]).random(2)
    t = base / speed * (1 + noise * (2 * r[0] - 1)) + jitter * r[1]
    for start, stop, extra, factor in dist:
        if start <= step and (stop is None or step < stop):
            t = t * factor + extra
    return t


def test_target_matches_formula():
    model = LinearModel(0.01, 0.002)
    dist = [(5, 10, 0.05, 1.0), (8, None, 0.0, 2.0), (20, 21, 0.01, 0.5)]
    emu = Emulator(model, speed=0.5, noise=0.2, jitter=0.003, seed=7, rank=3,
                   disturbances=[Disturbance(*d) for d in dist])
    for step in range(25):
        for batch in (0, 1, 17, 64):
            want = _plain_target(model, 0.5, 0.2, 0.003, dist, 7, 3, step, batch)
            assert emu.target(step, batch) == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_target_without_noise_is_exact():
    emu = Emulator(LinearModel(0.01, 0.001), speed=2.0, disturbances=[Disturbance(3, 4, extra=0.05)])
    assert emu.target(0, 10) == pytest.approx(0.01)
    assert emu.target(3, 10) == pytest.approx(0.06)  # LBB's +50 ms disturbance
    assert emu.target(4, 10) == pytest.approx(0.01)
    # measured time is ignored when there is a model, used when there is not
    assert emu.target(0, 10, measured=5.0) == pytest.approx(0.01)
    assert Emulator(speed=0.25).target(0, 10, measured=0.01) == pytest.approx(0.04)
    # a fitted cubic that dips below zero is clamped
    assert Emulator(PolyModel([-1.0, 0.0])).target(0, 3) == 0.0


def test_deterministic_per_seed_and_step():
    a = Emulator(LinearModel(0.01, 0.0), noise=0.5, seed=1)
    b = Emulator(LinearModel(0.01, 0.0), noise=0.5, seed=1)
    c = Emulator(LinearModel(0.01, 0.0), noise=0.5, seed=2)
    steps = list(range(50))
    ta = [a.target(s, 4) for s in steps]
    assert ta == [b.target(s, 4) for s in reversed(steps)][::-1]  # order of queries is irrelevant
    assert ta != [c.target(s, 4) for s in steps]
    assert len(set(ta)) == len(ta)  # it does vary per step
    # ranks sharing a seed are perturbed independently
    r1 = Emulator.for_rank(1, [1.0, 1.0], model=LinearModel(0.01, 0.0), noise=0.5, seed=1)
    assert ta != [r1.target(s, 4) for s in steps]


def test_noise_bounded_and_mean_preserving():
    emu = Emulator(LinearModel(0.1, 0.0), noise=0.3, seed=0)
    t = np.array([emu.target(s, 1) for s in range(2000)])
    assert t.min() >= 0.1 * 0.7 and t.max() <= 0.1 * 1.3
    assert t.min() < 0.1 * 0.72 and t.max() > 0.1 * 1.28  # the whole range is used
    assert t.mean() == pytest.approx(0.1, rel=0.02)
    jit = Emulator(LinearModel(0.1, 0.0), jitter=0.02)
    tj = np.array([jit.target(s, 1) for s in range(500)])
    assert tj.min() >= 0.1 and tj.max() <= 0.12 and tj.max() > 0.115


def test_stretch_takes_target():
    emu = Emulator(LinearModel(0.005, 0.0005), speed=0.5)  # target 0.02 s at batch 10
    target = emu.target(0, 10)
    assert target == pytest.approx(0.02)
    elapsed, returned = [], []
    for step in range(7):
        start = time.perf_counter()
        returned.append(emu.stretch(step, 10, start))
        elapsed.append(time.perf_counter() - start)
    assert returned == [target] * 7
    assert min(elapsed) >= target
    assert statistics.median(elapsed) < target + 0.05  # (never early; late only on a loaded machine)


def test_stretch_counts_compute_already_done():
    emu = Emulator(LinearModel(0.03, 0.0))
    start = time.perf_counter()
    time.sleep(0.01)  # "compute" that already took a third of the target
    emu.stretch(0, 1, start)
    elapsed = time.perf_counter() - start
    assert 0.03 <= elapsed < 0.03 + 0.05


def test_stretch_never_shortens():
    emu = Emulator(LinearModel(0.001, 0.0))
    start = time.perf_counter() - 0.05  # compute took 50 ms, longer than the 1 ms target
    t0 = time.perf_counter()
    got = emu.stretch(0, 1, start)
    assert time.perf_counter() - t0 < 0.03
    assert got >= 0.05
    # without a model the target follows the measured time
    slow = Emulator(speed=0.5)
    start = time.perf_counter() - 0.01
    assert slow.stretch(0, 1, start) >= 0.02
    assert time.perf_counter() - start >= 0.02


def test_sleep_until_accuracy():
    over = []
    for _ in range(5):
        deadline = time.perf_counter() + 0.005
        sleep_until(deadline)
        over.append(time.perf_counter() - deadline)
    assert min(over) >= 0
    assert statistics.median(over) < 0.02


def test_comm_delay():
    emu = Emulator(bandwidth=1e9)
    assert emu.comm_delay(0) == 0.0
    assert emu.comm_delay(25e6) == pytest.approx(0.025)
    assert Emulator().comm_delay(1e12) == 0.0
    start = time.perf_counter()
    assert emu.sleep_comm(10e6) == pytest.approx(0.01)
    assert 0.01 <= time.perf_counter() - start < 0.06
    with pytest.raises(ValueError, match="nbytes"):
        emu.comm_delay(-1)


def test_for_rank_and_state_dict():
    speeds = [1.0, 0.5, 0.25]
    dist = {2: [Disturbance(10, 20, extra=0.05)]}
    emus = [Emulator.for_rank(r, speeds, model=LinearModel(0.0, 0.001), disturbances=dist,
                              bandwidth=1e8, seed=3) for r in range(3)]
    assert [e.speed for e in emus] == speeds
    assert [len(e.disturbances) for e in emus] == [0, 0, 1]
    assert [e.target(15, 10) for e in emus] == pytest.approx([0.01, 0.02, 0.09])
    state = emus[2].state_dict()
    other = Emulator()
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert [other.target(s, 7) for s in range(30)] == [emus[2].target(s, 7) for s in range(30)]
    with pytest.raises(ValueError, match="rank 3 out of range"):
        Emulator.for_rank(3, speeds)
    # Keys as JSON gives them matched no rank: the disturbance silently never happened.
    with pytest.raises(ValueError, match=r"keys must be ranks .* got \['2'\]"):
        Emulator.for_rank(2, speeds, disturbances={"2": [Disturbance(10, 20, extra=0.05)]})


def test_an_emulator_of_a_scenario_worker_reloads_its_state():
    # WorkerModel.to_dict had no "kind": Emulator().load_state_dict raised "unknown model kind".
    from hetlb.sim import load_scenario
    emu = load_scenario("lbbsp-cluster-a").emulator(3)
    other = Emulator()
    other.load_state_dict(emu.state_dict())
    assert other.state_dict() == emu.state_dict()
    assert [other.target(s, 37) for s in range(20)] == [emu.target(s, 37) for s in range(20)]
    from hetlb.core.models import model_from_dict
    with pytest.raises(ValueError, match=r"a linear model has no field\(s\) \['speed'\]"):
        model_from_dict({"kind": "linear", "a0": 0.01, "a1": 0.001, "speed": 4})
    for bad, shown in (({"kind": "worker"}, "needs ['model']"), ({"kind": ["x"]}, "unknown model kind"),
                       (3, "a dict from TimeModel.to_dict"), ({"kind": "linear", "a0": 1}, "needs ['a1']")):
        with pytest.raises(ValueError, match=re.escape(shown)):
            model_from_dict(bad)


@pytest.mark.parametrize("kw, match", [
    (dict(speed=0), "speed"),
    (dict(speed=-1.0), "speed"),
    (dict(speed=float("inf")), "speed"),
    (dict(noise=-0.1), "noise"),
    (dict(noise=1.0), "noise"),
    (dict(noise=float("nan")), "noise"),
    (dict(bandwidth=0), "bandwidth"),
    (dict(bandwidth=float("inf")), "bandwidth"),
    (dict(jitter=-0.01), "jitter"),
    (dict(seed=-1), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(model="linear"), "model"),
    (dict(disturbances=[3]), "Disturbance"),
])
def test_bad_args(kw, match):
    with pytest.raises(ValueError, match=match):
        Emulator(**kw)


@pytest.mark.parametrize("args, match", [
    ((-1,), "start"),
    ((5, 5), "stop"),
    ((0, None, -0.05), "extra"),
    ((0, None, 0.0, 0.0), "factor"),
    ((0, None, float("nan")), "extra"),
])
def test_bad_disturbance(args, match):
    with pytest.raises(ValueError, match=match):
        Disturbance(*args)


def test_bad_target_args():
    emu = Emulator(LinearModel(0.01, 0.0))
    with pytest.raises(ValueError, match="step"):
        emu.target(-1, 1)
    with pytest.raises(ValueError, match="batch"):
        emu.target(0, -1)
    with pytest.raises(ValueError, match="measured"):
        emu.target(0, 1, measured=float("nan"))


@given(model=st.booleans(), speed=st.floats(0.1, 5.0), noise=st.floats(0.0, 0.9),
       jitter=st.floats(0.0, 0.05), step=st.integers(0, 50), batch=st.integers(0, 300),
       measured=st.floats(0.0, 2.0),
       dist=st.lists(st.tuples(st.integers(0, 40), st.floats(0.0, 0.1), st.floats(0.2, 3.0)), max_size=3))
def test_affine_is_the_target_for_every_measured_time(model, speed, noise, jitter, step, batch,
                                                      measured, dist):
    # The native step core holds a step to measured * factor + extra: it must be exactly the
    # target the Python stretch would wait for.
    emu = Emulator(model=LinearModel(0.01, 0.002) if model else None, speed=speed, noise=noise,
                   jitter=jitter, disturbances=[Disturbance(s, None, e, f) for s, e, f in dist],
                   seed=3, rank=1)
    factor, extra = emu.affine(step, batch)
    assert measured * factor + extra == pytest.approx(emu.target(step, batch, measured), rel=1e-12, abs=1e-15)
    if model:
        assert factor == 0.0


def test_fail_disturbance():
    emu = Emulator(disturbances=[Disturbance(3, 5, fail=True), Disturbance(4, extra=0.1)])
    assert [emu.failed(k) for k in range(7)] == [False, False, False, True, True, False, False]
    assert emu.affine(4, 10) == (1.0, 0.1)  # a failing step still has a target
    assert Disturbance(**Disturbance(1, 2, fail=True).to_dict()).fail
    with pytest.raises(ValueError, match="fail must be True or False"):
        Disturbance(0, fail="yes")
