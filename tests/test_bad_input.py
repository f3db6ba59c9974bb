"""Bad input everywhere a user can reach (issue 15): configuration values, profile files,
telemetry reaching the policies, checkpoints of another global batch.

Every bad value gets a ``ValueError`` / ``TypeError`` (or :class:`hetlb.UnusableTelemetry`, a
``ValueError``) whose message names the field, or a documented recovery: a record the policies
cannot use is refused by the :class:`hetlb.core.telemetry.History` and the Balancer keeps the previous
sizes; memory and CPU readings outside ``[0, 1]`` are clamped. Targeted tests first, then
hypothesis fuzz tests over the public entry points.
"""
import json
import logging
import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import hetlb
from hetlb.sim.emulate import Disturbance, Emulator
from hetlb.core.decisions import ScheduleRule
from hetlb.policies.base import Context, check_sizes
from hetlb.train.profile import Profile
from hetlb.core.telemetry import MAX_COMPUTE, MIN_COMPUTE, History, StepRecord, UnusableTelemetry

import distributed


def names(field, message):
    """Whether ``message`` names ``field`` as a word (``step`` is not named by ``fine_step``)."""
    return re.search(rf"(?<![\w]){re.escape(field)}(?![\w])", message) is not None


def record(step, batch, compute, *, data=None, memory=None, cpu=None, epoch=0, epoch_end=False):
    batch = np.asarray(batch, np.int64)
    n = batch.shape[0]
    return StepRecord(step=step, epoch=epoch, epoch_end=epoch_end, batch=batch,
                      compute=np.asarray(compute, np.float64),
                      data=batch.astype(np.float64) if data is None else np.asarray(data, np.float64),
                      memory=np.full(n, 0.5) if memory is None else np.asarray(memory, np.float64),
                      cpu=np.full(n, 0.5) if cpu is None else np.asarray(cpu, np.float64))


def assert_valid_split(sizes, ctx):
    s = np.asarray(sizes)
    assert s.shape == (ctx.world,) and s.dtype.kind in "iu", s
    assert int(s.sum()) == ctx.global_batch, (s, ctx.global_batch)
    assert (s >= ctx.lower).all() and (s <= ctx.upper).all() and (s >= 0).all(), s


def assert_valid_decision(decision, ctx):
    if isinstance(decision, ScheduleRule):
        assert decision.slope.shape == (ctx.world,)
        assert np.all(np.isfinite(decision.slope)) and np.all(decision.slope > 0), decision.slope
        assert np.all(np.isfinite(decision.intercept)) and np.all(decision.intercept >= 0)
    else:
        assert_valid_split(decision, ctx)


# =============================================================================================
# configuration values: targeted
# =============================================================================================

@pytest.mark.parametrize("kwargs, exc, field, shown", [
    ({"global_batch": -8}, ValueError, "global_batch", "-8"),
    ({"global_batch": 0}, ValueError, "global_batch", "0"),
    ({"global_batch": float("nan")}, ValueError, "global_batch", "nan"),
    ({"global_batch": "8"}, ValueError, "global_batch", "'8'"),
    ({"global_batch": 1 << 24}, ValueError, "global_batch", str(1 << 24)),
    ({"global_batch": 8, "lower": -1}, ValueError, "lower", "-1"),
    ({"global_batch": 8, "lower": 2.5}, ValueError, "lower", "2.5"),
    ({"global_batch": 8, "lower": 9}, ValueError, "global_batch", "lower=9"),
    ({"global_batch": 8, "upper": -1}, ValueError, "upper", "-1"),
    ({"global_batch": 8, "upper": float("inf")}, ValueError, "upper", "inf"),
    ({"global_batch": 8, "lower": 3, "upper": 2}, ValueError, "upper", "upper=2"),
    ({"global_batch": 8, "upper": 4}, ValueError, "upper", "4"),
    ({"global_batch": 8, "weighting": "mean"}, ValueError, "weighting", "'mean'"),
    ({"global_batch": 8, "weighting": ["samples"]}, ValueError, "weighting", "['samples']"),
    ({"global_batch": 8, "policy": "lbb"}, TypeError, "policy", "'lbb'"),
    ({"global_batch": 8, "policy": hetlb.LBB}, TypeError, "policy", "LBB"),
    ({"global_batch": 8, "history": 0}, ValueError, "history", "0"),
    ({"global_batch": 8, "history": -5}, ValueError, "history", "-5"),
    ({"global_batch": 8, "max_bad_steps": -1}, ValueError, "max_bad_steps", "-1"),
    ({"global_batch": 8, "accumulate": float("inf")}, ValueError, "accumulate", "inf"),
    ({"global_batch": 8, "batch_dim": "0"}, ValueError, "batch_dim", "'0'"),
    ({"global_batch": 8, "transport": "udp"}, ValueError, "transport", "'udp'"),
    ({"global_batch": 8, "native_hook": "yes"}, ValueError, "native_hook", "'yes'"),
    ({"global_batch": 8, "tensorboard": 1}, ValueError, "tensorboard", "1"),
    ({"global_batch": 8, "log_dir": 123}, TypeError, "log_dir", "123"),
    ({"global_batch": 8, "profile": {"batch_sizes": [2]}}, TypeError, "profile", "dict"),
    ({"global_batch": 8, "emulator": 0.5}, TypeError, "emulator", "0.5"),
])
def test_balancer_refuses_bad_arguments(kwargs, exc, field, shown):
    model = torch.nn.Linear(1, 1)
    with pytest.raises(exc) as e:
        hetlb.Balancer(model, **kwargs)
    assert names(field, str(e.value)) and shown in str(e.value), str(e.value)
    # Refused before anything touched the model: no hook is left behind.
    assert not model._forward_pre_hooks


def test_balancer_refuses_a_model_that_is_not_a_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module.*NoneType"):
        hetlb.Balancer(None, 8)


def test_balancer_refuses_a_profile_with_bad_points():
    p = Profile(batch_sizes=[2, 4], times=[0.1, 0.2], limit=4)
    p.times[1] = float("nan")  # mutated after construction
    with pytest.raises(ValueError, match=r"times\[1\] must be a finite number, got nan"):
        hetlb.Balancer(torch.nn.Linear(1, 1), 8, profile=p)


def _world_larger_than_global_batch(rank, world):
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    try:
        hetlb.Balancer(model, global_batch=1)
    except ValueError as e:
        first = str(e)
    else:
        first = None
    bal = hetlb.Balancer(torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1)),
                         global_batch=1, lower=0, policy=hetlb.Uniform())
    return first, bal.batch_sizes.tolist()


def test_world_larger_than_the_global_batch():
    """Two ranks, a global batch of 1: an error naming global_batch, world and lower; with
    lower=0 a valid split in which one rank idles."""
    for first, sizes in distributed.unwrap(distributed.run(_world_larger_than_global_batch, 2)):
        assert first is not None and "global_batch=1" in first and "2 ranks" in first \
            and "lower=1" in first and "lower=0" in first, first
        assert sorted(sizes) == [0, 1]


@pytest.mark.parametrize("world, global_batch, lower, upper, field", [
    (0, 4, 0, 4, "world"),
    (2, 0, 0, 4, "global_batch"),
    (2, -3, 0, 4, "global_batch"),
    (4, 2, 1, 4, "global_batch"),  # world larger than the global batch with lower=1
    (2, 4, -1, 4, "lower"),
    (2, 4, [0, 0, 0], 4, "lower"),
    (2, 4, 0, [4, float("nan")], "upper"),
    (2, 4, 3, 2, "lower"),
    (2, 4, 0, 1, "upper"),
    ("2", 4, 0, 4, "world"),
    (2, 4, 0, 2.0 ** 63, "upper"),  # a float that would wrap around to -2**63 in int64
    (2, 4, 0, 2 ** 63, "upper"),  # NumPy's uint64
])
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_context_refuses_bad_values(world, global_batch, lower, upper, field):
    with pytest.raises(ValueError) as e:
        Context(world, global_batch, lower, upper)
    assert names(field, str(e.value)) and "-9223372036854775808" not in str(e.value), str(e.value)


def test_world_larger_than_global_batch_with_lower_zero_gives_valid_splits():
    ctx = Context.simple(5, 3, lower=0)
    for p in (hetlb.Uniform(), hetlb.LBB(), hetlb.LBBSP(), hetlb.LBBSP("cpu", predictor=hetlb.EMA()),
              hetlb.WLBS(), hetlb.DBS()):
        assert_valid_split(p.start(ctx), ctx)
    assert Context.simple(2, 4, lower=0, upper=0 + 4).upper.tolist() == [4, 4]
    with pytest.raises(ValueError, match="exceeds the sum of upper"):
        Context.simple(2, 4, lower=0, upper=0)  # upper=0 is a bound, not "no bound"


@pytest.mark.parametrize("make, field, shown", [
    (lambda: hetlb.LBB(fine=float("nan")), "fine", "nan"),
    (lambda: hetlb.LBB(fine=-0.1), "fine", "-0.1"),
    (lambda: hetlb.LBB(rapid=0.01), "rapid", "0.01"),
    (lambda: hetlb.LBB(rapid=float("nan")), "rapid", "nan"),
    (lambda: hetlb.LBB(step=0), "step", "0"),
    (lambda: hetlb.LBB(window=-1), "window", "-1"),
    (lambda: hetlb.LBB(priority=0), "priority", "0"),
    (lambda: hetlb.LBB(fine="0.1"), "fine", "'0.1'"),
    (lambda: hetlb.LBBSP(mode="tpu"), "mode", "'tpu'"),
    (lambda: hetlb.LBBSP(mode=None), "mode", "None"),
    (lambda: hetlb.LBBSP("cpu", predictor="ema"), "predictor", "str"),
    (lambda: hetlb.LBBSP(step=float("inf")), "step", "inf"),
    (lambda: hetlb.LBBSP(fine_window=0), "fine_window", "0"),
    (lambda: hetlb.LBBSP(memory_guard=float("nan")), "memory_guard", "nan"),
    (lambda: hetlb.LBBSP(memory_guard=0), "memory_guard", "0"),
    (lambda: hetlb.LBBSP(settle="no"), "settle", "'no'"),
    (lambda: hetlb.LBBSP(reequilibrate=-1), "reequilibrate", "-1"),
    (lambda: hetlb.WLBS(theta_b=float("nan")), "theta_b", "nan"),
    (lambda: hetlb.WLBS(theta_b=-1), "theta_b", "-1"),
    (lambda: hetlb.WLBS(theta_e=float("inf")), "theta_e", "inf"),
    (lambda: hetlb.WLBS(stall=1.0), "stall", "1.0"),
    (lambda: hetlb.WLBS(relative="yes"), "relative", "'yes'"),
    (lambda: hetlb.WLBS(indicators=[("cpus", 1)]), "indicators", "cpus"),
    (lambda: hetlb.WLBS(indicators={"cpus": "1"}), "indicators", "'1'"),
    (lambda: hetlb.WLBS(indicators={"cpus": float("nan")}), "indicators", "nan"),
    (lambda: hetlb.WLBS(indicators={"cpus": 0}), "indicators", "positive"),
    (lambda: hetlb.LBBSP(memory_guard=1.5), "memory_guard", "1.5"),
    (lambda: hetlb.LBBSP("cpu", settle=True), "only apply in mode='gpu'", "settle=True"),
    (lambda: hetlb.LBBSP("cpu", step=2, window=3), "only apply in mode='gpu'", "step=2, window=3"),
    (lambda: hetlb.WLBS(steps_per_epoch=0), "steps_per_epoch", "0"),
    (lambda: hetlb.DBS(steps_per_epoch=-2), "steps_per_epoch", "-2"),
    (lambda: hetlb.DBS(steps_per_epoch=2.5), "steps_per_epoch", "2.5"),
    (lambda: hetlb.Chronica(forget=0), "forget", "0"),
    (lambda: hetlb.Chronica(forget=float("nan")), "forget", "nan"),
    (lambda: hetlb.Chronica(cap=-1), "cap", "-1"),
    (lambda: hetlb.Chronica(cap="big"), "cap", "'big'"),
    (lambda: hetlb.Chronica(cap=[]), "cap", "[]"),
    (lambda: hetlb.Chronica(cap=[1.0, float("nan")]), "cap", "nan"),
    (lambda: hetlb.Chronica(pivot="yes"), "pivot", "'yes'"),
    (lambda: hetlb.Chronica(quadratic=-1), "quadratic", "-1"),
    (lambda: hetlb.Chronica(quadratic="fitted"), "quadratic", "'fitted'"),
    (lambda: hetlb.EMA(float("nan")), "alpha", "nan"),
    (lambda: hetlb.EMA(0), "alpha", "0"),
    (lambda: hetlb.EMA(1.5), "alpha", "1.5"),
    (lambda: hetlb.EMA("0.2"), "alpha", "'0.2'"),
    (lambda: hetlb.EMA(None), "alpha", "None"),
    (lambda: hetlb.NARX(lookback=0), "lookback", "0"),
    (lambda: hetlb.NARX(lr=float("nan")), "lr", "nan"),
    (lambda: hetlb.NARX(val_fraction=1.0), "val_fraction", "1.0"),
    (lambda: hetlb.NARX(alpha=float("inf")), "alpha", "inf"),
    (lambda: hetlb.NARX(background="yes"), "background", "'yes'"),
])
def test_policy_constructors_refuse_bad_values(make, field, shown):
    with pytest.raises((ValueError, TypeError)) as e:
        make()
    assert names(field, str(e.value)) and shown in str(e.value), str(e.value)


@pytest.mark.parametrize("make, field", [
    (lambda: Emulator(speed=0), "speed"),
    (lambda: Emulator(speed=float("nan")), "speed"),
    (lambda: Emulator(speed="fast"), "speed"),
    (lambda: Emulator(speed=True), "speed"),
    (lambda: Emulator(noise=1.0), "noise"),
    (lambda: Emulator(noise=-0.1), "noise"),
    (lambda: Emulator(jitter=float("inf")), "jitter"),
    (lambda: Emulator(bandwidth=0), "bandwidth"),
    (lambda: Emulator(seed=-1), "seed"),
    (lambda: Emulator(rank=1.5), "rank"),
    (lambda: Emulator(spin=-1), "spin"),
    (lambda: Emulator(by="tokens"), "by"),
    (lambda: Emulator(quadratic=0.5), "quadratic"),
    (lambda: Emulator(model="linear"), "model"),
    (lambda: Emulator(disturbances=5), "disturbances"),
    (lambda: Emulator(disturbances=Disturbance(0)), "disturbances"),
    (lambda: Emulator(disturbances=[{"begin": 0}]), "disturbances"),
    (lambda: Emulator(disturbances=["late"]), "disturbances"),
    (lambda: Emulator.for_rank(0, speeds=2.0), "speeds"),
    (lambda: Emulator.for_rank(3, speeds=[1.0, 2.0]), "rank"),
    (lambda: Disturbance(-1), "start"),
    (lambda: Disturbance(5, 5), "stop"),
    (lambda: Disturbance(0, extra=float("nan")), "extra"),
    (lambda: Disturbance(0, factor=0), "factor"),
    (lambda: Disturbance(0, fail="yes"), "fail"),
])
def test_emulator_refuses_bad_values(make, field):
    with pytest.raises(ValueError) as e:
        make()
    assert names(field, str(e.value)), str(e.value)


@pytest.mark.parametrize("kwargs, field", [
    ({"reference_batch": 0}, "reference_batch"),
    ({"reference_batch": float("nan")}, "reference_batch"),
    ({"reference_batch": "4"}, "reference_batch"),
    ({"reference_batch": 4, "lam": float("nan")}, "lam"),
    ({"reference_batch": 4, "lam": -1}, "lam"),
    ({"reference_batch": 4, "weighting": "mean"}, "weighting"),
    ({"reference_batch": 4, "batches_per_iteration": 0}, "batches_per_iteration"),
    ({"reference_batch": 4, "probe_batches": -1}, "probe_batches"),
    ({"reference_batch": 4, "scale_lr": "yes"}, "scale_lr"),
])
def test_delayed_sync_refuses_bad_values(kwargs, field):
    model = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError) as e:
        hetlb.DelayedSync(model, torch.optim.SGD(model.parameters(), 0.1), **kwargs)
    assert names(field, str(e.value)), str(e.value)


def test_delayed_sync_refuses_wrong_types():
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    for args, kwargs, field in [((None, opt, 4), {}, "model"), ((model, None, 4), {}, "optimizer"),
                                ((model, opt, 4), {"emulator": "fast"}, "emulator"),
                                ((model, opt, 4), {"watchdog": 120}, "watchdog"),
                                ((model, opt, 4), {"weighting": 3}, "weighting")]:
        with pytest.raises((TypeError, ValueError)) as e:
            hetlb.DelayedSync(*args, **kwargs)
        assert names(field, str(e.value)), str(e.value)


def test_checkpointer_refuses_a_directory_that_is_not_a_path():
    with pytest.raises(TypeError, match="directory must be a path .* got NoneType None"):
        hetlb.Checkpointer(None)


@pytest.mark.parametrize("args, kwargs, field", [
    ((0,), {}, "keep"),
    ((float("nan"),), {}, "keep"),
    ((3,), {"rank": -1}, "rank"),
    ((3,), {"writer": 1.5}, "writer"),
])
def test_checkpointer_refuses_bad_values(tmp_path, args, kwargs, field):
    with pytest.raises(ValueError) as e:
        hetlb.Checkpointer(tmp_path, *args, **kwargs)
    assert names(field, str(e.value)), str(e.value)
    ck = hetlb.Checkpointer(tmp_path)
    with pytest.raises(ValueError, match="step must be an integer >= 0, got -1"):
        ck.save({}, step=-1)
    with pytest.raises(ValueError, match="state must be a dict"):
        ck.save([1, 2], step=1)


# =============================================================================================
# profile files
# =============================================================================================

def good_profile():
    return Profile(batch_sizes=[2, 4, 8, 16], times=[0.010, 0.012, 0.020, 0.035], limit=16,
                   repeats=3, trim=1, warmup=1, oom_at=32, samples=[[0.01, 0.01, 0.02]] * 4,
                   memory=[100, 200, None, 800])


def write(tmp_path, text, name="prof.json"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_profile_file_round_trips(tmp_path):
    p = good_profile()
    p.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == p


def test_truncated_profile_files_name_the_file(tmp_path):
    text = json.dumps(good_profile().to_dict(), indent=1)
    # Every proper prefix (a crash while writing, a copy cut short) and the empty file.
    for cut in list(range(0, len(text), 7)) + [len(text) - 1]:
        path = write(tmp_path, text[:cut])
        with pytest.raises(ValueError, match=re.escape(str(path))):
            Profile.load(path)
    assert Profile.load(write(tmp_path, text)) == good_profile()


def test_binary_garbage_profile_file(tmp_path):
    path = tmp_path / "prof.json"
    path.write_bytes(b"\x80\x81\xff\x00garbage")
    with pytest.raises(ValueError, match="prof.json"):
        Profile.load(path)


@pytest.mark.parametrize("change, field", [
    ({"version": 2}, "version"),
    ({"version": "1"}, "version"),
    ({"batch_sizes": [4, 2, 8, 16]}, "batch_sizes"),  # not monotone
    ({"batch_sizes": [2, 4, 4, 16]}, "batch_sizes"),  # a repeated size
    ({"batch_sizes": [0, 4, 8, 16]}, "batch_sizes"),
    ({"batch_sizes": [2, 4, 8.5, 16]}, "batch_sizes"),
    ({"batch_sizes": []}, "batch_sizes"),  # empty
    ({"batch_sizes": [], "times": []}, "batch_sizes"),
    ({"times": [0.01, float("nan"), 0.02, 0.035]}, "times"),
    ({"times": [0.01, float("inf"), 0.02, 0.035]}, "times"),
    ({"times": [0.01, -0.01, 0.02, 0.035]}, "times"),
    ({"times": [0.01, 0.012, 0.02]}, "times"),
    ({"times": "fast"}, "times"),
    ({"limit": 8}, "limit"),
    ({"limit": None}, "limit"),
    ({"oom_at": 16}, "oom_at"),
    ({"repeats": 0}, "repeats"),
    ({"trim": 3}, "trim"),
    ({"warmup": -1}, "warmup"),
    ({"samples": [[0.01, float("nan"), 0.02]] * 4}, "samples"),
    ({"samples": [[0.01]] * 3}, "samples"),
    ({"memory": [1, 2]}, "memory"),
    ({"memory": [1, 2, -3, 4]}, "memory"),
    ({"device": 0}, "device"),
    ({"bogus": 1}, "bogus"),
])
def test_bad_profile_files_name_the_field(tmp_path, change, field):
    d = {**good_profile().to_dict(), **change}
    path = write(tmp_path, json.dumps(d))  # json writes NaN / Infinity tokens, as a hand edit might
    with pytest.raises(ValueError) as e:
        Profile.load(path)
    assert names(field, str(e.value)) and str(path) in str(e.value), str(e.value)


@pytest.mark.parametrize("text, match", [
    ("[1, 2, 3]", "JSON object"),
    ("null", "JSON object"),
    ('{"times": [1.0], "limit": 2}', "lacks.*batch_sizes"),
])
def test_profile_files_of_the_wrong_shape(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        Profile.load(write(tmp_path, text))


def test_profile_objects_are_checked_too():
    with pytest.raises(ValueError, match=r"times\[0\] must be a finite number, got nan"):
        Profile(batch_sizes=[2], times=[float("nan")], limit=2)
    with pytest.raises(ValueError, match="batch_sizes must be strictly increasing"):
        Profile(batch_sizes=[4, 2], times=[0.1, 0.2], limit=4)
    p = good_profile()
    p.batch_sizes = []
    with pytest.raises(ValueError, match="batch_sizes must be a non-empty list"):
        p.fit()
    with pytest.raises(ValueError, match="batch_sizes"):
        p.save("never-written.json")


@pytest.mark.parametrize("kw, field", [
    (dict(device="abacus"), "device"),
    (dict(memory_limit="1GB"), "memory_limit"),
    (dict(memory_limit=[1]), "memory_limit"),
    (dict(batch_sizes=5), "batch_sizes"),
    (dict(repeats=2.5), "repeats"),
])
def test_profile_function_refuses_bad_arguments(kw, field):
    with pytest.raises(ValueError) as e:
        hetlb.profile(lambda b: None, **kw)
    assert names(field, str(e.value)), str(e.value)


# =============================================================================================
# telemetry reaching the policies
# =============================================================================================

@pytest.mark.parametrize("bad", [math.nan, -1.0, -math.inf, 0.0, 1e-300, 5e-324, 1e9, 1e300])
def test_history_refuses_a_rank_with_an_implausible_time(bad):
    h = History(3)
    with pytest.raises(UnusableTelemetry) as e:
        h.append(record(0, [4, 4, 4], [0.1, bad, 0.1]))
    msg = str(e.value)
    assert "rank 1 " in msg and f"compute={bad!r}" in msg and "rank 0" not in msg
    assert f"[{MIN_COMPUTE:g}, {MAX_COMPUTE:g}]" in msg  # what is accepted
    assert len(h) == 0
    # The edges of the plausible range are accepted; zero and anything without samples too.
    h.append(record(1, [4, 4, 0], [MIN_COMPUTE, MAX_COMPUTE, 0.0]))
    h.append(record(2, [4, 4, 4], [0.1, math.inf, 0.1]))  # +inf: no progress, the policy's call
    assert len(h) == 2


def test_memory_and_cpu_outside_their_range_are_clamped_with_a_warning(caplog):
    h = History(3)
    with caplog.at_level(logging.WARNING, logger="hetlb.telemetry"):
        h.append(record(0, [4, 4, 4], [0.1] * 3, memory=[0.5, 1.5, -0.2], cpu=[0.5, 0.5, 7.0]))
        h.append(record(1, [4, 4, 4], [0.1] * 3, memory=[0.5, 1.5, 0.5]))
    assert h[0].memory.tolist() == [0.5, 1.0, 0.0] and h[0].cpu.tolist() == [0.5, 0.5, 1.0]
    assert h[1].memory.tolist() == [0.5, 1.0, 0.5]
    assert h.clamped == 4
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 3  # once per rank and column
    assert any("rank 1 reported memory=1.5" in m for m in warned)
    with pytest.raises(UnusableTelemetry, match="rank 2"):
        h.append(record(2, [4, 4, 4], [0.1] * 3, cpu=[0.5, 0.5, math.nan]))  # non-finite: refused


@pytest.mark.parametrize("policy", [
    lambda: hetlb.LBB(), lambda: hetlb.LBBSP(), lambda: hetlb.LBBSP("cpu", predictor=hetlb.EMA()),
    lambda: hetlb.WLBS(), lambda: hetlb.DBS(steps_per_epoch=2), lambda: hetlb.Uniform(),
    lambda: hetlb.Chronica()])
def test_one_absurd_rank_is_skipped_and_later_steps_decide(policy):
    """The Balancer's recovery, step by step: a refused record keeps the previous decision; the
    next sound record is acted on as if the bad one had not been there."""
    ctx = Context.simple(3, 30)
    p = policy()
    decision = p.start(ctx)
    h = History(3)
    for step, times in enumerate([[0.1, 0.2, 0.3], [0.1, 1e9, 0.3], [0.1, math.nan, 0.3],
                                  [0.1, 0.2, 0.3], [0.1, 0.2, 0.3]]):
        sizes = decision if isinstance(decision, np.ndarray) else np.array([10, 10, 10])
        try:
            h.append(record(step, sizes, times, epoch=step // 2, epoch_end=step % 2 == 1))
        except UnusableTelemetry as e:
            assert "rank 1 " in str(e) and step in (1, 2)
            continue
        decision = p.decide(h)
        assert_valid_decision(decision, ctx)
    assert [r.step for r in h] == [0, 3, 4]


def test_chronica_survives_absurd_data_amounts():
    """Data amounts whose squares overflow, or that make a slope underflow to 0, do not make
    Chronica's rule invalid: the rank is modelled as the mean of the usable ones."""
    ctx = Context.simple(3, 30)
    p = hetlb.Chronica(quadratic="fit")
    p.start(ctx)
    h = History(3)
    for step, data in enumerate([[10, 10, 10], [1e300, 12, 9], [1e200, 1e-300, 8], [11, 1e308, 7],
                                 [12, 9, 11]]):
        h.append(record(step, [10, 10, 10], [0.1, 0.2, 0.3], data=data))
        assert_valid_decision(p.decide(h), ctx)


def test_balancer_keeps_sizes_on_unusable_telemetry_and_raises_after_max_bad_steps(caplog):
    """One process: an emulated rank that stops making progress reports +inf compute; LBB
    cannot use it, so the Balancer keeps the previous sizes, logs a warning, and raises once
    ``max_bad_steps`` consecutive steps were unusable (no hang, no NaN sizes)."""
    model = torch.nn.Linear(1, 1)
    emu = Emulator(disturbances=[Disturbance(2, fail=True)])
    bal = hetlb.Balancer(model, 8, policy=hetlb.LBB(), emulator=emu, max_bad_steps=2)
    with caplog.at_level(logging.WARNING, logger="hetlb.balancer"):
        for _ in range(4):
            with bal.step():
                model(torch.randn(int(bal.batch_sizes[0]), 1)).sum().backward()
            assert bal.batch_sizes.tolist() == [8]
        with pytest.raises(UnusableTelemetry, match="3 consecutive steps.*made no progress"):
            with bal.step():
                model(torch.randn(8, 1)).sum().backward()
    assert sum("keeping the previous sizes" in r.getMessage() for r in caplog.records) == 2


# =============================================================================================
# checkpoints of another global batch (another world size is a supported resume)
# =============================================================================================

def trained_balancer(global_batch=8, steps=3, policy=None):
    model = torch.nn.Linear(1, 1)
    bal = hetlb.Balancer(model, global_batch, policy=policy or hetlb.LBB())
    for _ in range(steps):
        with bal.step():
            model(torch.randn(int(bal.batch_sizes[0]), 1)).sum().backward()
    return bal


def test_balancer_checkpoint_of_another_global_batch_names_the_field():
    state = trained_balancer(8).state_dict()
    other = trained_balancer(6, steps=1)
    with pytest.raises(ValueError) as e:
        other.load_state_dict(state)
    msg = str(e.value)
    assert names("global_batch", msg) and "global_batch=8" in msg and "global_batch=6" in msg
    assert other.steps == 1  # nothing was restored


@pytest.mark.parametrize("change, exc, match", [
    (lambda s: [s], TypeError, "state must be the dict"),
    (lambda s: {**s, "format": 1}, ValueError, "format"),
    (lambda s: {k: v for k, v in s.items() if k != "steps"}, ValueError, "lacks \\['steps'\\]"),
    (lambda s: {**s, "global_batch": "8"}, ValueError, "checkpoint global_batch must be an integer"),
    (lambda s: {**s, "steps": -1}, ValueError, "checkpoint steps must be an integer >= 0"),
    (lambda s: {**s, "accumulate": 2}, ValueError, "accumulate=2"),
    (lambda s: {**s, "decision": [7]}, ValueError, "summing to 7"),
    (lambda s: {**s, "history": {"world": 1}}, ValueError, "history"),
    (lambda s: {**s, "decision": [math.inf]}, ValueError, "decision"),
    (lambda s: {**s, "policy": {"world": 1}}, ValueError, "lacks"),
    (lambda s: {**s, "policy": {**s["policy"], "global_batch": 6}}, ValueError, "global_batch=6"),
    (lambda s: {**s, "position": "x"}, ValueError, "data position"),
])
def test_balancer_refuses_malformed_checkpoints(change, exc, match):
    state = trained_balancer(8).state_dict()
    bal = trained_balancer(8, steps=1)
    before = bal.batch_sizes.tolist()
    with pytest.raises(exc, match=match):
        bal.load_state_dict(change(state))
    # Nothing was restored: not the step count, the sizes, nor the policy's state.
    assert bal.steps == 1 and bal.batch_sizes.tolist() == before
    assert len(bal.policy.actions) == 1 and len(bal.history) == 1


def test_balancer_checkpoint_of_another_world_size_still_resumes():
    """Another world size is a supported resume: the position carries over, the policy restarts."""
    state = trained_balancer(8, steps=3).state_dict()
    state["world"] = 4  # as saved by a run on 4 ranks
    bal = trained_balancer(8, steps=0)
    bal.load_state_dict(state)
    assert bal.steps == 3 and bal.batch_sizes.tolist() == [8]


@pytest.mark.parametrize("make", [hetlb.Uniform, hetlb.LBB, hetlb.LBBSP, hetlb.WLBS, hetlb.DBS,
                                  lambda: hetlb.LBBSP("cpu", predictor=hetlb.EMA()), hetlb.Chronica])
def test_policy_state_of_another_global_batch_names_the_field(make):
    a = make()
    a.start(Context.simple(2, 8))
    state = a.state_dict()
    b = make()
    b.start(Context.simple(2, 6))
    with pytest.raises(ValueError) as e:
        b.load_state_dict(state)
    msg = str(e.value)
    assert names("global_batch", msg) and "global_batch=8" in msg and "global_batch=6" in msg, msg
    fresh = make()  # a policy not started yet takes any sound state
    fresh.load_state_dict(state)
    assert fresh.state_dict().keys() == state.keys()
    with pytest.raises(TypeError, match="state must be a dict"):
        make().load_state_dict([("global_batch", 8)])


def test_sized_policy_state_with_bad_bounds_is_refused():
    p = hetlb.LBB()
    p.start(Context.simple(2, 8))
    state = p.state_dict()
    with pytest.raises(ValueError, match="lower"):
        hetlb.LBB().load_state_dict({**state, "lower": np.array([-1, 0])})
    with pytest.raises(ValueError, match="global_batch"):
        hetlb.LBB().load_state_dict({**state, "global_batch": float("nan")})
    with pytest.raises(ValueError, match="lacks"):
        hetlb.LBB().load_state_dict({k: v for k, v in state.items() if k != "last"})


def test_state_kind_error_on_each_kind():
    from hetlb.policies.base import state_kind_error as kind
    fits = [(3, 4.5), (0.5, 7), (np.int64(2), 3.0), (True, False), (np.bool_(True), True),
            ("gpu", "cpu"), (np.zeros(3), [1, 2, 3]), (np.zeros(2), torch.tensor([1.0, 2.0])),
            (np.zeros(2), np.array([True, False])), ([1], ("a",)), ({"a": 1}, {}), (None, "x"), (5, None)]
    for current, value in fits:
        assert kind(current, value) is None, (current, value)
    wrong = [(3, "3"), (3, True), (0.5, [0.5]), (True, 1), ("gpu", 1), (np.zeros(3), "abc"),
             (np.zeros(2), [1, "x"]), (np.zeros(2), {"a": 1}), (np.zeros(2), 5), ([1], "ab"),
             ({"a": 1}, [("a", 1)])]
    for current, value in wrong:
        assert kind(current, value) is not None, (current, value)


@pytest.mark.parametrize("make", [hetlb.Uniform, hetlb.LBB, hetlb.LBBSP, hetlb.WLBS,
                                  lambda: hetlb.DBS(steps_per_epoch=4),
                                  lambda: hetlb.LBBSP("cpu", predictor=hetlb.EMA())])
def test_policy_state_values_of_the_wrong_kind_name_the_field(make):
    # Caught at load, naming the field, instead of as an obscure error at some later decide; a
    # policy not started yet is checked against one started with the state's context.
    p = make()
    p.start(Context.simple(3, 30))
    state = p.state_dict()
    checked = 0
    for key, value in state.items():
        if (value is None and key not in p._optional_kinds) or key in ("predictor", "ema", "meter") \
                or isinstance(value, str):
            continue  # untyped optional values, and the nested states their owners check
        garbage = "garbage" if not isinstance(value, str) else 3
        for target in (make(), p):
            with pytest.raises(ValueError) as e:
                target.load_state_dict({**state, key: garbage})
            assert key in str(e.value), (key, str(e.value))
        checked += 1
    assert checked >= 5, checked
    assert p.state_dict().keys() == state.keys()
    make().load_state_dict(state)  # the sound state still loads into a fresh policy


@pytest.mark.parametrize("make, key, good", [
    (hetlb.LBB, "waiting", [10, 20]), (hetlb.LBBSP, "last_step", 3),
    (hetlb.LBBSP, "remove_warning", 2), (hetlb.LBBSP, "reequilibrate", 0.2),
    (hetlb.WLBS, "theta_e", 0.5), (hetlb.WLBS, "steps_per_epoch", 10)])
def test_policy_fields_that_hold_none_until_used_are_checked_too(make, key, good):
    """A field the policy holds as None (optional, or not set yet) takes a value of its kind from
    a state, and refuses one of another kind naming the field (before, anything went in)."""
    p = make()
    p.start(Context.simple(2, 30))
    state = p.state_dict()
    assert state[key] is None
    for target in (make(), p):
        with pytest.raises(ValueError, match=f"{key} must be"):
            target.load_state_dict({**state, key: "garbage"})
    q = make()
    q.load_state_dict({**state, key: good})
    assert q.state_dict()[key] == good


@pytest.mark.parametrize("make, key, bad, want", [
    (hetlb.LBB, "waiting", [10, "20"], "a list of integers"),
    (hetlb.LBB, "waiting", [10, True], "a list of integers"),
    (hetlb.LBB, "waiting", [10, 10, 10], None),
    (hetlb.LBB, "actions", ["rapid", 3], "a list of str"),
    (hetlb.WLBS, "actions", [None], "a list of str"),
    (hetlb.LBBSP, "warned", [1.5], "a list of integers")])
def test_policy_state_lists_with_items_of_the_wrong_kind_are_refused(make, key, bad, want):
    """A list's items are checked too: LBB waiting for sizes no record can match would never
    close its observation window, silently."""
    p = make()
    p.start(Context.simple(2, 30))
    state = p.state_dict()
    match = f"{key} must be {want}" if want else f"{key} must hold one size per rank"
    for target in (make(), p):
        with pytest.raises(ValueError, match=match):
            target.load_state_dict({**state, key: bad})
    assert p.state_dict()[key] == state[key]  # nothing changed


def test_chronica_and_epoch_meter_states_of_the_wrong_kind_are_refused():
    c = hetlb.Chronica()
    c.start(Context.simple(2, 8))
    state = c.state_dict()
    with pytest.raises(ValueError, match="pivot must be True or False"):
        hetlb.Chronica().load_state_dict({**state, "pivot": "garbage"})
    for cap in ("garbage", -1.0, [1.0, float("nan")], [[1.0]]):
        with pytest.raises(ValueError, match="cap must be None, a positive number or one per rank"):
            hetlb.Chronica().load_state_dict({**state, "cap": cap})
    with pytest.raises(ValueError, match="Chronica state: last_step"):
        hetlb.Chronica().load_state_dict({**state, "last_step": "x"})
    ok = hetlb.Chronica()
    ok.load_state_dict({**state, "cap": [4.0, 5.0], "pivot": False})
    assert ok.cap == [4.0, 5.0] and ok.pivot is False
    w = hetlb.WLBS()
    w.start(Context.simple(2, 8))
    state = w.state_dict()
    for key, bad in (("epoch", "x"), ("steps", -1), ("samples", [1.0]), ("time", [1.0, float("nan")]),
                     ("steps_per_epoch", 0), ("last_step", -2), ("last_step", "x")):
        with pytest.raises(ValueError, match=f"EpochMeter state: {key}"):
            hetlb.WLBS().load_state_dict({**state, "meter": {**state["meter"], key: bad}})
    inf = {**state["meter"], "time": [1.0, float("inf")]}  # a rank without progress: kept
    hetlb.WLBS().load_state_dict({**state, "meter": inf})
    old = {k: v for k, v in state["meter"].items() if k != "last_step"}  # saved before it was kept
    hetlb.WLBS().load_state_dict({**state, "meter": old})
    with pytest.raises(ValueError, match="last_step must be a number"):
        hetlb.LBB().load_state_dict({**hetlb.LBB().state_dict(), "last_step": "x"})


def test_lbbsp_state_with_an_unknown_mode_or_predictor_is_refused():
    p = hetlb.LBBSP("cpu", predictor=hetlb.EMA())
    p.start(Context.simple(2, 8))
    state = p.state_dict()
    with pytest.raises(ValueError, match="mode must be 'gpu' or 'cpu', got 'tpu'"):
        hetlb.LBBSP().load_state_dict({**state, "mode": "tpu"})
    with pytest.raises(ValueError, match="predictor must be a predictor's state dict"):
        hetlb.LBBSP().load_state_dict({**state, "predictor": "garbage"})


# =============================================================================================
# fuzz: random garbage for every argument of the public entry points
# =============================================================================================

GARBAGE = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.integers(-10 ** 12, 10 ** 12),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(-2, 2),
    st.sampled_from([0, 1, 2, 0.5, 1.0, -1, 2 ** 62, -2 ** 63, 2 ** 64, math.nan, math.inf, -math.inf,
                     1e-300, 1e300, "1", "",
                     "gpu", "cpu", "fit", "samples", b"1", (), [], {}, [1, 2], {"cpus": 1},
                     np.float64(0.3), np.int64(2), np.nan, np.bool_(True), object(), print]),
    st.text(max_size=4), st.lists(st.floats(allow_nan=True), max_size=3),
    st.dictionaries(st.text(max_size=3), st.floats(allow_nan=True), max_size=2),
)


def call_or_named_error(call, fields):
    """``call()`` succeeds, or raises ValueError/TypeError naming one of ``fields``."""
    try:
        return call()
    except (ValueError, TypeError) as e:
        assert any(names(f, str(e)) for f in fields), f"{type(e).__name__}: {e} names none of {fields}"
        return None


POLICY_ARGS = {
    hetlb.LBB: ["fine", "rapid", "step", "window", "priority"],
    hetlb.LBBSP: ["mode", "predictor", "step", "window", "fine_step", "fine_window", "memory_guard",
                  "settle", "reequilibrate"],
    hetlb.WLBS: ["theta_b", "theta_e", "relative", "stall", "indicators", "steps_per_epoch"],
    hetlb.DBS: ["steps_per_epoch"],
    hetlb.Chronica: ["forget", "pivot", "cap", "quadratic"],
    hetlb.EMA: ["alpha"],
    hetlb.NARX: ["lookback", "hidden", "warmup", "retrain_every", "max_samples", "epochs",
                 "patience", "lr", "val_fraction", "alpha", "seed", "background"],
}


@given(data=st.data(), cls=st.sampled_from(sorted(POLICY_ARGS, key=lambda c: c.__name__)))
def test_fuzz_policy_constructors(data, cls):
    args = POLICY_ARGS[cls]
    kwargs = data.draw(st.dictionaries(st.sampled_from(args), GARBAGE, min_size=1, max_size=3))
    if cls is hetlb.LBBSP and "mode" in kwargs and kwargs["mode"] == "cpu":
        kwargs.setdefault("predictor", hetlb.EMA())
    p = call_or_named_error(lambda: cls(**kwargs), list(kwargs))
    if p is None or cls in (hetlb.EMA, hetlb.NARX):
        return
    ctx = Context.simple(3, 12, lower=data.draw(st.sampled_from([0, 1])))
    # Whatever it accepted makes a working policy; what depends on the world (Chronica's cap of
    # one entry per rank) is checked at start, naming the field.
    decision = call_or_named_error(lambda: p.start(ctx), list(kwargs))
    if decision is None:
        assert cls is hetlb.Chronica and "cap" in kwargs
        return
    assert_valid_decision(decision, ctx)
    h = History(3)
    sizes = decision if isinstance(decision, np.ndarray) else np.array([4, 4, 4])
    h.append(record(0, sizes, [0.1, 0.2, 0.4], epoch_end=True))
    assert_valid_decision(p.decide(h), ctx)


@given(world=GARBAGE, global_batch=GARBAGE, lower=GARBAGE, upper=GARBAGE)
def test_fuzz_context(world, global_batch, lower, upper):
    ctx = call_or_named_error(lambda: Context(world, global_batch, lower, upper),
                              ["world", "global_batch", "lower", "upper"])
    if ctx is not None:
        assert ctx.world >= 1 and ctx.global_batch >= 1
        assert (ctx.lower >= 0).all() and (ctx.lower <= ctx.upper).all()
        assert ctx.lower.sum() <= ctx.global_batch <= ctx.upper.sum()
        assert_valid_split(hetlb.Uniform().start(ctx), ctx)


class Scale(torch.nn.Module):
    """One weight times the input: takes a batch of any shape."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x * self.w


BALANCER_ARGS = ["global_batch", "policy", "weighting", "lower", "upper", "profile", "emulator",
                 "history", "max_bad_steps", "accumulate", "batch_dim", "transport", "native_hook"]


@given(kwargs=st.dictionaries(st.sampled_from(BALANCER_ARGS), GARBAGE, min_size=1, max_size=3))
def test_fuzz_balancer_constructor(kwargs):
    kwargs = {"global_batch": 8, **kwargs}
    model = Scale()
    bal = call_or_named_error(lambda: hetlb.Balancer(model, **kwargs), list(kwargs))
    if bal is None:
        assert not model._forward_pre_hooks  # refused before touching the model
        return
    ctx = bal.context
    sizes = bal.batch_sizes
    assert_valid_split(sizes, ctx)
    # A batch laid out along the accepted batch_dim (beyond the tensor's dims nothing is checked).
    dim = kwargs.get("batch_dim", 0)
    shape = [1]
    if dim is not None and not callable(dim):
        dim = int(dim)  # accepted: integral
        shape = [1] * (min(dim, 3) + 1)
        if dim <= 3:
            shape[dim] = int(sizes[0])
    with bal.step():
        model(torch.randn(shape)).sum().backward()
    assert_valid_split(bal.batch_sizes, ctx)


EMULATOR_ARGS = ["model", "speed", "noise", "disturbances", "bandwidth", "seed", "jitter", "rank",
                 "spin", "by", "quadratic"]


@given(kwargs=st.dictionaries(st.sampled_from(EMULATOR_ARGS), GARBAGE, min_size=1, max_size=3),
       step=st.integers(0, 1000), batch=st.integers(0, 1000))
def test_fuzz_emulator(kwargs, step, batch):
    emu = call_or_named_error(lambda: Emulator(**kwargs), list(kwargs))
    if emu is not None:
        t = emu.target(step, batch, measured=0.01)
        factor, extra = emu.affine(step, batch)
        assert math.isfinite(t) and t >= 0 and factor >= 0 and extra >= 0


@given(kwargs=st.dictionaries(st.sampled_from(["start", "stop", "extra", "factor", "fail"]), GARBAGE,
                              min_size=1, max_size=3))
def test_fuzz_disturbance(kwargs):
    kwargs = {"start": 0, **kwargs}
    d = call_or_named_error(lambda: Disturbance(**kwargs), list(kwargs))
    if d is not None:
        assert math.isfinite(d.apply(1.0)) and d.apply(1.0) > 0


@given(kwargs=st.dictionaries(st.sampled_from(["reference_batch", "lam", "weighting",
                                               "batches_per_iteration", "probe_batches", "scale_lr"]),
                              GARBAGE, min_size=1, max_size=3))
def test_fuzz_delayed_sync_settings(kwargs):
    kwargs = {"reference_batch": 4, **kwargs}
    model = torch.nn.Linear(1, 1)
    call_or_named_error(lambda: hetlb.DelayedSync(model, torch.optim.SGD(model.parameters(), 0.1),
                                                  **kwargs), list(kwargs))


@given(field=st.sampled_from(sorted(good_profile().to_dict())), value=GARBAGE)
def test_fuzz_profile_fields(field, value):
    d = {**good_profile().to_dict(), field: value}
    p = call_or_named_error(lambda: Profile.from_dict(d), [field])
    if p is not None:
        for kind in ("cubic", "linear", "piecewise"):
            assert math.isfinite(float(p.fit(kind).time(8)))


@given(kwargs=st.dictionaries(st.sampled_from(["batch_sizes", "repeats", "trim", "warmup", "device",
                                               "memory_limit", "max_batch"]),
                              st.one_of(GARBAGE.filter(lambda v: not isinstance(v, (int, float))
                                                       or isinstance(v, bool) or abs(v) < 1e6),
                                        st.integers(-2, 6)), min_size=1, max_size=3))
def test_fuzz_profile_function(kwargs):
    kwargs.setdefault("max_batch", 64)  # a no-op step: keep the sizes few
    if isinstance(kwargs.get("repeats"), int) and kwargs["repeats"] > 20:
        kwargs["repeats"] = 20
    if isinstance(kwargs.get("warmup"), int) and kwargs["warmup"] > 20:
        kwargs["warmup"] = 20
    p = call_or_named_error(lambda: hetlb.profile(lambda b: None, **kwargs), list(kwargs) + ["batch size"])
    if p is not None:
        assert p.batch_sizes and all(math.isfinite(t) and t >= 0 for t in p.times)


# =============================================================================================
# fuzz: random telemetry, including non-finite and absurd values, through every policy
# =============================================================================================

AWKWARD = st.sampled_from([0.0, -0.0, -1.0, math.nan, math.inf, -math.inf, 1e-300, 5e-324, MIN_COMPUTE,
                           1e-6, 1e3, 1e9, MAX_COMPUTE, 1e300, 1.7e308])
TIME = st.one_of(st.floats(0.01, 2.0), AWKWARD)

POLICIES = {
    "uniform": lambda: hetlb.Uniform(),
    "lbb": lambda: hetlb.LBB(),
    "lbb-priority": lambda: hetlb.LBB(priority=0.1, window=2),
    "lbbsp": lambda: hetlb.LBBSP(window=2, fine_window=3),
    "lbbsp-settle": lambda: hetlb.LBBSP(settle=True, reequilibrate=0.3, window=2),
    "lbbsp-ema": lambda: hetlb.LBBSP("cpu", predictor=hetlb.EMA()),
    "lbbsp-memoryless": lambda: hetlb.LBBSP("cpu", predictor=hetlb.Memoryless()),
    "lbbsp-narx": lambda: hetlb.LBBSP("cpu", predictor=hetlb.NARX(warmup=8, retrain_every=6, epochs=20,
                                                                   background=False)),
    "wlbs": lambda: hetlb.WLBS(),
    "wlbs-relative": lambda: hetlb.WLBS(theta_b=0.05, relative=True),
    "dbs": lambda: hetlb.DBS(steps_per_epoch=3),
    "chronica": lambda: hetlb.Chronica(),
    "chronica-fit": lambda: hetlb.Chronica(quadratic="fit", forget=0.9),
}


@given(name=st.sampled_from(sorted(POLICIES)), world=st.integers(1, 4), data=st.data())
def test_fuzz_telemetry_keeps_every_split_valid(name, world, data):
    """Driven as the Balancer drives it (a refused record keeps the previous decision), a policy
    fed random telemetry with NaN, infinities, zeros, negatives and absurd values on any rank
    returns only valid decisions, raises nothing but UnusableTelemetry, and every record it
    reads is within the plausible range."""
    global_batch = data.draw(st.integers(world, 64), label="global_batch")
    lower = data.draw(st.sampled_from([0, 1]), label="lower")
    ctx = Context.simple(world, global_batch, lower=lower)
    p = POLICIES[name]()
    decision = p.start(ctx)
    assert_valid_decision(decision, ctx)
    local = p.local_predictor(0)
    h = History(world, maxlen=16)
    steps = data.draw(st.integers(1, 14), label="steps")
    for step in range(steps):
        if isinstance(decision, np.ndarray):
            sizes = decision
        else:  # a schedule: any split of the step's samples
            sizes = np.asarray(hetlb.allocate_proportional(np.ones(world), global_batch), np.int64)
        n = st.lists(TIME, min_size=world, max_size=world)
        frac = st.lists(st.one_of(st.floats(0, 1), AWKWARD), min_size=world, max_size=world)
        # A huge time times a size may overflow to inf, and inf times a size of 0 is NaN: wanted
        with np.errstate(over="ignore", invalid="ignore"):
            amounts = sizes * np.asarray(data.draw(st.lists(st.one_of(st.just(1.0), TIME), min_size=world,
                                                            max_size=world), label="data"))
        rec = StepRecord(
            step=step, epoch=step // 3, epoch_end=step % 3 == 2, batch=sizes.copy(),
            compute=np.asarray(data.draw(n, label="compute")),
            data=amounts,
            memory=np.asarray(data.draw(frac, label="memory")),
            cpu=np.asarray(data.draw(frac, label="cpu")),
            predicted=np.asarray(data.draw(st.lists(st.one_of(st.just(math.nan), TIME), min_size=world,
                                                    max_size=world), label="predicted")))
        try:
            h.append(rec)
            if local is not None:
                local.observe(h[-1], 0)
            decision = p.decide(h)
        except UnusableTelemetry:
            continue  # the Balancer keeps the previous sizes
        t = h[-1].compute
        assert np.all(np.isposinf(t) | ((t >= 0) & (t <= MAX_COMPUTE)))
        assert np.all((h[-1].memory >= 0) & (h[-1].memory <= 1))
        assert_valid_decision(decision, ctx)
        if isinstance(decision, np.ndarray):
            assert check_sizes(decision, ctx, name).tolist() == decision.tolist()


@pytest.mark.parametrize("history", [2 ** 63, 9.223372036854776e18])
def test_a_history_beyond_a_deques_reach_is_a_named_error(history):
    # (found by the fuzz test: it was an OverflowError from the deque)
    with pytest.raises(ValueError, match=r"history must be an integer <= \d+"):
        hetlb.Balancer(torch.nn.Linear(2, 1), 8, history=history)
    with pytest.raises(ValueError, match=r"History: maxlen must be an integer <= \d+"):
        hetlb.core.telemetry.History(2, maxlen=history)


@pytest.mark.parametrize("make", [
    lambda: hetlb.Balancer(torch.nn.Linear(1, 1), "4"),
    lambda: hetlb.Balancer(torch.nn.Linear(1, 1), 4, lower=True),
    lambda: hetlb.LBB(priority="0.1"),
    lambda: hetlb.Balancer(torch.nn.Linear(1, 1), 4, adaptive_exchange="yes"),
])
def test_a_wrong_type_is_a_type_error_as_documented_and_still_a_value_error(make):
    with pytest.raises(TypeError) as e:
        make()
    assert isinstance(e.value, ValueError)
    with pytest.raises(ValueError, match="must be"):
        make()


def test_a_non_integral_number_for_an_integer_is_a_value_error_only():
    with pytest.raises(ValueError) as e:
        hetlb.Balancer(torch.nn.Linear(1, 1), 4.5)
    assert not isinstance(e.value, TypeError)


# ---------------------------------------------------------------- the host solvers' native inputs

NUMBER = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2 ** 63, 2 ** 63 - 1),
                   st.sampled_from([0.0, -0.0, 1.0, 5e-324, 1e-300, 1e300, 2.0 ** 62, -1.0]))
VECTOR = st.one_of(st.lists(NUMBER, max_size=6), GARBAGE)
COUNT = st.one_of(st.integers(-3, 40), st.sampled_from([2 ** 31, 2 ** 62, 2 ** 63 - 1, -2 ** 63]), GARBAGE)


def solved_or_value_error(call):
    """``call()`` returns, or raises ValueError/TypeError (a message); nothing else, no crash."""
    try:
        return call()
    except (ValueError, TypeError) as e:
        assert str(e), repr(e)
        return None


@given(a0=VECTOR, a1=VECTOR, total=COUNT, lower=st.one_of(st.none(), VECTOR), upper=st.one_of(st.none(), VECTOR))
def test_fuzz_allocate(a0, a1, total, lower, upper):
    from hetlb.core.solve import allocate_linear
    out = solved_or_value_error(lambda: allocate_linear(a0, a1, total, lower, upper))
    if out is not None:
        n = len(a0)
        lo = np.zeros(n) if lower is None else np.asarray(lower, np.float64)
        hi = np.full(n, float(total)) if upper is None else np.asarray(upper, np.float64)
        assert out.dtype == np.int64 and out.shape == (n,) and int(out.sum()) == int(total)
        assert np.all(out >= lo) and np.all(out <= np.maximum(hi, lo))
    models = solved_or_value_error(lambda: [hetlb.LinearModel(x, y) for x, y in zip(a0, a1)] +
                                   [hetlb.PolyModel(a0), hetlb.PiecewiseModel(np.abs(a1) + 1, a0)])
    if models is not None:
        solved_or_value_error(lambda: hetlb.allocate(models, total, lower, upper))


@given(kinds=VECTOR, params=VECTOR, offsets=VECTOR, cands=VECTOR, cand_offsets=VECTOR, total=COUNT,
       lower=VECTOR, upper=VECTOR)
def test_fuzz_native_allocate(kinds, params, offsets, cands, cand_offsets, total, lower, upper):
    """The packed form straight into the extension: errors, never a crash or a read out of range."""
    from hetlb import _C
    try:  # (what NumPy cannot convert never reaches the extension)
        arrays = [np.asarray(v, dtype) for v, dtype in
                  [(kinds, np.int64), (params, np.float64), (offsets, np.int64), (cands, np.int64),
                   (cand_offsets, np.int64), (lower, np.int64), (upper, np.int64)]]
        count = int(total)
    except (ValueError, TypeError, OverflowError):
        return
    solved_or_value_error(lambda: _C.allocate(*arrays[:5], count, *arrays[5:]))


@given(sizes=VECTOR, slope=VECTOR, intercept=VECTOR, first=st.one_of(st.none(), COUNT),
       cap=st.one_of(st.none(), VECTOR), owner=VECTOR, tolerance=st.one_of(st.none(), NUMBER))
def test_fuzz_schedule_and_rebalance(sizes, slope, intercept, first, cap, owner, tolerance):
    got = solved_or_value_error(lambda: hetlb.schedule(sizes, slope, intercept, first=first, cap=cap))
    if got is not None:
        assert got.shape == (len(sizes),) and np.all((got >= 0) & (got < len(slope)))
    got = solved_or_value_error(lambda: hetlb.rebalance(owner, sizes, slope, intercept, tolerance=tolerance))
    if got is not None:
        assert got.shape == (len(sizes),) and np.all((got >= 0) & (got < len(slope)))
    solved_or_value_error(lambda: hetlb.allocate_proportional(slope, first if first is not None else 3,
                                                              upper=cap))


@given(n=st.integers(1, 300), ranks=st.integers(1, 200), seed=st.integers(0, 2 ** 31),
       scale=st.sampled_from([1e-300, 1e-5, 1.0, 1e5, 1e300]))
def test_fuzz_schedule_at_extreme_magnitudes(n, ranks, seed, scale):
    """Times near under- and overflow: the groups (64 ranks or more) and the vector scan pick as
    the scalar scan (whose own tests compare it with the reference)."""
    from hetlb import _C
    rng = np.random.default_rng(seed)
    sizes, slope = rng.lognormal(0, 2, n) * scale, rng.uniform(0, 2, ranks) * scale
    intercept = rng.uniform(0, 1, ranks) * scale
    scalar = _C.schedule(sizes, slope, intercept, grouped=False, simd=False)
    assert np.all((scalar >= 0) & (scalar < ranks))
    assert np.array_equal(_C.schedule(sizes, slope, intercept, grouped=False), scalar)
    assert np.array_equal(_C.schedule(sizes, slope, intercept), scalar)
