"""Telemetry records, history, checks, probes and the straggler effect."""
import itertools
import os

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hetlb.core.decisions import EXACT_INT, decision_checksum
from hetlb.core.telemetry import (COL, NUM_FIELDS, History, StepRecord, UnusableTelemetry,
                                  require_progress, straggler_effect, validate_record)
from hetlb.core.exchange import next_block_length
from hetlb.comm.probes import Probe, hardware_info, meminfo


def record(step, batch, compute, epoch=0):
    batch = np.asarray(batch, dtype=np.int64)
    return StepRecord(step=step, epoch=epoch, batch=batch, compute=np.asarray(compute, dtype=np.float64),
                      data=batch.astype(np.float64), memory=np.full(len(batch), 0.25),
                      cpu=np.full(len(batch), 0.5))


@given(st.lists(st.integers(0, 2 ** 20), min_size=1, max_size=64))
def test_checksum_is_exact_in_float32_and_deterministic(sizes):
    c = decision_checksum(sizes)
    assert 0 <= c < EXACT_INT
    assert float(np.float32(c)) == c  # survives a float32 bucket slot
    assert decision_checksum(np.array(sizes, dtype=np.int32)) == c  # dtype does not matter


def test_checksum_tells_small_changes_apart():
    base = [16, 16, 16, 16]
    moves = {decision_checksum(base)}
    for i, j in itertools.permutations(range(4), 2):
        s = list(base)
        s[i] -= 1
        s[j] += 1
        moves.add(decision_checksum(s))
    assert len(moves) == 13  # every one-sample move is seen


@given(st.integers(1, 8).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 10 ** 6), min_size=n, max_size=n),
    st.lists(st.floats(0, 100, allow_nan=False), min_size=n, max_size=n))),
    st.integers(0, EXACT_INT - 1))
def test_record_table_and_dict_round_trip(bc, step):
    batch, compute = bc
    table = np.zeros((len(batch), NUM_FIELDS))
    table[:, COL["batch"]] = batch
    table[:, COL["compute"]] = compute
    table[:, COL["data"]] = np.asarray(batch) * 1.5
    table[:, COL["step"]] = step
    table[:, COL["epoch"]] = 3
    table[:, COL["predicted"]] = np.nan
    r = StepRecord.from_table(table)
    assert r.step == step and r.epoch == 3 and r.world == len(batch)
    assert r.batch.tolist() == batch and r.compute.tolist() == compute
    back = StepRecord.from_dict(r.to_dict())
    for f in ("batch", "compute", "data", "memory", "cpu", "predicted"):
        np.testing.assert_array_equal(getattr(back, f), getattr(r, f))
    assert StepRecord.from_table(table, step=2 ** 30).step == 2 ** 30  # not wrapped
    with pytest.raises(ValueError, match="must be"):
        StepRecord.from_table(table[:, :3])


def test_speed_of_idle_ranks_is_zero():
    r = record(0, [4, 0, 6], [0.5, 0.0, 2.0])
    np.testing.assert_allclose(r.speed, [8.0, 0.0, 3.0])
    assert record(0, [4, 2], [np.inf, 1.0]).speed.tolist() == [0.0, 2.0]  # no progress: no speed


def test_history_window_order_and_checkpoint():
    h = History(3, maxlen=5)
    for k in range(8):
        h.append(record(k, [k, 1, 2], [1.0, 1.0, 1.0 + k]))
    assert len(h) == 5 and h[0].step == 3 and h[-1].step == 7
    assert [r.step for r in h.last(2)] == [6, 7] and h.last(0) == [] and len(h.last(99)) == 5
    assert h.column("compute").shape == (5, 3) and h.column("batch", 2)[:, 0].tolist() == [6, 7]
    with pytest.raises(ValueError, match="increase"):
        h.append(record(7, [1, 1, 1], [1, 1, 1]))
    with pytest.raises(ValueError, match="ranks"):
        h.append(record(9, [1, 1], [1, 1]))
    with pytest.raises(UnusableTelemetry):  # the history refuses what no policy could use
        h.append(record(9, [1, 1, 1], [1, np.nan, 1]))
    assert len(h) == 5
    g = History.from_state_dict(h.state_dict())
    assert [r.step for r in g] == [r.step for r in h] and g.column("compute").tolist() == \
        h.column("compute").tolist()
    assert History(2).column("cpu").shape == (0, 2)
    with pytest.raises(ValueError):
        History(0)


@pytest.mark.parametrize("compute, bad", [
    ([1.0, float("nan"), 1.0], [1]),
    ([float("-inf"), 1.0, 1.0], [0]),
    ([1.0, 1.0, 0.0], [2]),
    ([-1.0, 1.0, float("nan")], [0, 2]),
])
def test_validate_names_the_bad_ranks(compute, bad):
    with pytest.raises(UnusableTelemetry) as e:
        validate_record(record(5, [2, 3, 4], compute))
    msg = str(e.value)
    assert "step 5" in msg
    for r in range(3):
        assert (f"rank {r} " in msg) == (r in bad), msg


def test_validate_accepts_an_idle_rank_and_no_progress():
    validate_record(record(0, [0, 3, 4], [0.0, 1.0, 1.0]))
    validate_record(record(0, [2, 3, 4], [float("inf"), 1.0, 1.0]))  # a rank without progress
    with pytest.raises(UnusableTelemetry, match="ranks \\[0\\] made no progress.*LBB"):
        require_progress(record(0, [2, 3, 4], [float("inf"), 1.0, 1.0]), "LBB")
    with pytest.raises(ValueError, match="rank 0"):
        validate_record(record(0, [-1, 3, 4], [0.0, 1.0, 1.0]))


@given(st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=10))
def test_straggler_effect_matches_the_definition(t):
    a = np.asarray(t)
    assert straggler_effect(t) == pytest.approx((a.max() - a.min()) / a.mean())


def test_straggler_effect_ignores_idle_ranks():
    assert straggler_effect([0.0, 1.0, 1.0], batch=[0, 5, 5]) == 0.0
    assert straggler_effect([1.0, 2.0], batch=[0, 0]) == 0.0
    assert straggler_effect([1.0, 3.0]) == pytest.approx(1.0)


def test_probe_readings_and_refresh_interval():
    # The machine's memory in use (what a co-located process also sees), refreshed per interval.
    import psutil
    fresh = Probe(torch.device("cpu"), interval=0.0)
    cached = Probe(torch.device("cpu"), interval=3600.0)
    m0 = fresh.memory()
    vm = psutil.virtual_memory()
    assert 0.0 < m0 <= 1.0 and abs(m0 - (1 - vm.available / vm.total)) < 0.05
    held = cached.memory()
    block = np.ones(512 * 2 ** 20 // 8)  # 512 MiB, touched
    assert fresh.memory() > m0  # re-read: sees the allocation
    assert cached.memory() == held  # within the interval: the earlier reading
    del block
    with pytest.raises(ValueError, match="interval"):
        Probe(torch.device("cpu"), interval=float("nan"))


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="Linux only: /proc/meminfo")
def test_meminfo_reports_psutils_figures():
    # The probe's fast path reads what psutil reports (its MemAvailable and MemTotal).
    import psutil
    got = meminfo()
    vm = psutil.virtual_memory()
    assert got is not None and got[1] == vm.total
    assert abs(got[0] - vm.available) < 0.02 * vm.total  # (read a moment apart)


def test_meminfo_parses_the_two_lines_and_refuses_the_rest(tmp_path):
    f = tmp_path / "meminfo"
    f.write_bytes(b"MemTotal:       24684092 kB\nMemFree:        23255092 kB\n"
                  b"MemAvailable:   24234424 kB\nBuffers:           14136 kB\n")
    assert meminfo(str(f)) == (24234424 * 1024, 24684092 * 1024)
    f.write_bytes(b"MemTotal:       24684092 kB\nMemFree:        23255092 kB\n")  # kernel < 3.14
    assert meminfo(str(f)) is None
    f.write_bytes(b"MemTotal:       24684092 MB\nMemAvailable:   24234424 kB\n")  # unknown unit
    assert meminfo(str(f)) is None
    f.write_bytes(b"MemTotal: -1 kB\nMemAvailable: 2 kB\n")
    assert meminfo(str(f)) is None
    assert meminfo(str(tmp_path / "missing")) is None


def test_probe_falls_back_to_psutil_without_proc_meminfo(monkeypatch):
    import psutil
    import hetlb.comm.probes as tm
    monkeypatch.setattr(tm, "meminfo", lambda path="/proc/meminfo": None)
    probe = Probe(torch.device("cpu"), interval=0.0)
    vm = psutil.virtual_memory()
    assert abs(probe.memory() - (1 - vm.available / vm.total)) < 0.05


def test_hardware_info_on_cpu():
    info = hardware_info(torch.device("cpu"))
    assert info["cpus"] >= 1 and info["cores"] >= 1 and info["memory"] > 2 ** 20
    assert "gpu_sms" not in info


_SPECIAL = st.sampled_from([0.0, -0.0, 1.0, 0.5, -1.0, 1e308, -1e308, float("inf"), float("-inf"),
                            float("nan"), 1e-12, 1e9])


@given(batch=st.lists(st.integers(-2, 5), min_size=1, max_size=70),
       values=st.data())
def test_validate_fast_path_agrees_with_the_full_check(batch, values):
    """validate_record's per-step fast path (_looks_sound) only ever accepts what the full check
    accepts, and validate_record's verdict is the full check's on random awkward values."""
    from hetlb.core.telemetry import _looks_sound
    n = len(batch)
    col = lambda: np.asarray(values.draw(st.lists(_SPECIAL, min_size=n, max_size=n)), dtype=np.float64)
    r = StepRecord(step=0, epoch=0, batch=np.asarray(batch, np.int64), compute=col(), data=col(),
                   memory=col(), cpu=col())
    b, t, d = r.batch, r.compute, r.data
    from hetlb.core.telemetry import MAX_COMPUTE, MIN_COMPUTE
    with np.errstate(invalid="ignore"):
        bad = ((b < 0) | np.isnan(t) | (t < 0) | ((b > 0) & (t < MIN_COMPUTE)) | ~np.isfinite(d)
               | (d < 0) | (np.isfinite(t) & (t > MAX_COMPUTE))
               | ~np.isfinite(r.memory) | ~np.isfinite(r.cpu)).any()
    if _looks_sound(r):
        assert not bad
    # History.append's one-pass check: the same verdict, and the readings' range when sound.
    from hetlb.core.telemetry import _quick_check, _readings_in_range
    sound, in_range = _quick_check(r)
    if sound:
        assert not bad
        inside = bool(((r.memory >= 0) & (r.memory <= 1) & (r.cpu >= 0) & (r.cpu <= 1)).all())
        assert in_range == inside == _readings_in_range(r)
    if bad:
        with pytest.raises(UnusableTelemetry):
            validate_record(r)
    else:
        validate_record(r)


def test_validate_fast_path_on_sound_records_of_any_world():
    from hetlb.core.telemetry import _looks_sound
    for world in (1, 3, 64, 65, 500):
        r = record(0, np.full(world, 4), np.full(world, 0.1))
        assert _looks_sound(r)
        validate_record(r)
        bad = record(0, np.full(world, 4), np.r_[np.full(world - 1, 0.1), np.nan])
        assert not _looks_sound(bad)
        with pytest.raises(UnusableTelemetry, match=f"rank {world - 1} "):
            validate_record(bad)


def test_next_block_length_doubles_while_steady_and_restarts_on_a_move():
    seq, n = [], 1
    for steady in [True] * 6 + [False, True, True]:
        n = next_block_length(n, steady, 16)
        seq.append(n)
    assert seq == [2, 4, 8, 16, 16, 16, 1, 2, 4]
    assert next_block_length(3, True, 5) == 5  # capped at exchange_every, not a power of 2
