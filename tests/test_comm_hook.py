"""The native (C++) weighted all-reduce hook against the Python reference, on real DDP over Gloo.

Both hooks compute ``sum_r w_r * g_r`` with the same elementwise products and the same Gloo sum,
so gradients must agree bit for bit, and the telemetry tables in every column that is not a
measurement (compute time, memory, CPU load). The reference is itself checked against
single-process gradients in test_balancer_dist.py.
"""
from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel as DDP

import hetlb  # before init_process_group in the spawned workers
from distributed import run, unwrap
from fixed_policy import Fixed

from hetlb import _C
from hetlb.core.telemetry import COL, NUM_FIELDS


def _wide_net(dtype):
    torch.manual_seed(0)
    # ~2 k parameters per layer so that a 1 KiB bucket cap gives several buckets after DDP's
    # first-iteration rebuild.
    return torch.nn.Sequential(torch.nn.Linear(6, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48),
                               torch.nn.Tanh(), torch.nn.Linear(48, 3)).to(dtype)


def compare_worker(rank, world, native, sizes, weighting, options, dtype_name, steps, transport):
    dtype = getattr(torch, dtype_name)
    net = _wide_net(dtype)
    ddp = DDP(net, bucket_cap_mb=options.get("bucket_cap_mb", 0.001),
              gradient_as_bucket_view=options.get("gradient_as_bucket_view", False),
              static_graph=options.get("static_graph", False))
    mine = native if isinstance(native, bool) else native[rank]
    bal = hetlb.Balancer(ddp, sum(sizes), policy=Fixed(sizes), weighting=weighting, lower=0,
                         native_hook=mine, transport=transport)
    # The side table issued before the last bucket's all-reduce instead of after it.
    bal.telemetry.core.side_first = bool(options.get("side_first"))
    g = torch.Generator().manual_seed(7)
    n = 40
    x = torch.randn(n, 6, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(n, 3, generator=g, dtype=torch.float64).to(dtype)
    ds = torch.utils.data.TensorDataset(x, y)
    loader = bal.loader(ds, sample_sizes=np.arange(1, n + 1) % 5 + 1.0, seed=3)
    grads, tables, buckets, scaled = [], [], 0, []
    for step, (xb, yb) in enumerate(loader):
        if step == steps:
            break
        out = ddp(xb)
        # An idle rank's mean loss is NaN (a mean over nothing): its weight 0 must zero it.
        loss = (out - yb).pow(2).sum(1).mean()
        if options.get("bal_backward"):
            bal.backward(loss)  # the weight rides in the loss, the hook only sums
        else:
            loss.backward()
        buckets = max(buckets, bal.telemetry.core.hooks_run)  # native hook only
        scaled.append(bal.telemetry.core.scaled_buckets)
        grads.append([p.grad.detach().clone() for p in net.parameters()])
        ddp.zero_grad(set_to_none=bool(options.get("bal_backward")))
    for rec in bal.history:
        tables.append({"batch": rec.batch.tolist(), "data": rec.data.tolist(),
                       "memory": rec.memory.tolist(), "cpu": rec.cpu.tolist(),
                       "compute": rec.compute.tolist()})
    return {"transport": bal.transport, "grads": grads, "tables": tables, "buckets": buckets,
            "scaled": scaled}


CASES = {
    "samples-2": (2, [3, 7], "samples", {}, "float64"),
    "sizes-3-idle": (3, [4, 0, 6], "sizes", {}, "float64"),
    "none-3-idle-f32": (3, [5, 0, 2], "none", {}, "float32"),
    "bucket-view": (2, [1, 8], "samples", {"gradient_as_bucket_view": True}, "float64"),
    "static-graph": (2, [6, 3], "samples", {"static_graph": True}, "float32"),
    "one-bucket": (2, [2, 5], "samples", {"bucket_cap_mb": 25}, "float64"),
    "bal-backward": (2, [3, 7], "samples", {"bal_backward": True}, "float64"),
    "bal-backward-idle": (3, [4, 0, 6], "sizes", {"bal_backward": True}, "float32"),
    "side-first": (3, [4, 0, 6], "sizes", {"side_first": True}, "float64"),
}


@pytest.mark.parametrize("transport", ["side", "carry"])
@pytest.mark.parametrize("case", list(CASES))
def test_native_hook_matches_the_reference(case, transport):
    world, sizes, weighting, options, dtype = CASES[case]
    steps = 3
    native = unwrap(run(compare_worker, world, True, sizes, weighting, options, dtype, steps, transport))
    python = unwrap(run(compare_worker, world, False, sizes, weighting, options, dtype, steps, transport))
    for r in range(world):
        assert native[r]["transport"] == python[r]["transport"] == transport
        if options.get("bucket_cap_mb", 0.001) < 1:
            assert native[r]["buckets"] >= 2, native[r]["buckets"]  # really several buckets
        for s in range(steps):
            for a, b in zip(native[r]["grads"][s], python[r]["grads"][s]):
                assert torch.equal(a, b), (r, s, (a - b).abs().max())
                assert torch.isfinite(a).all()  # the idle rank's NaN never reached anyone
        for tn, tp in zip(native[r]["tables"], python[r]["tables"]):
            for key in ("batch", "data"):
                assert tn[key] == tp[key], (key, tn[key], tp[key])
            assert tn["batch"] == sizes
            # Measured columns differ between the two runs; they must be sane readings.
            busy = [c for c, b in zip(tn["compute"], sizes) if b > 0]
            assert all(np.isfinite(tn["compute"])) and min(busy) > 0
            assert all(0 < m < 1 for m in tn["memory"]) and all(0 <= c <= 1 for c in tn["cpu"])
        # Every rank sees the same table, compute times included.
        assert native[r]["tables"] == native[0]["tables"]
        # The native hook made its pass over the gradient unless the loss carried the weight.
        if options.get("bal_backward"):
            assert native[r]["scaled"] == [0] * steps, native[r]["scaled"]
        elif sizes[r] > 0:  # (an idle rank's bucket is zeroed, not scaled)
            assert min(native[r]["scaled"]) >= 1, native[r]["scaled"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_buckets_match_the_reference(dtype):
    native = unwrap(run(compare_worker, 2, True, [3, 7], "samples", {}, dtype, 3, None))
    python = unwrap(run(compare_worker, 2, False, [3, 7], "samples", {}, dtype, 3, None))
    for r in range(2):
        assert native[r]["transport"] == "side"
        for s in range(3):
            for a, b in zip(native[r]["grads"][s], python[r]["grads"][s]):
                assert torch.equal(a, b)


def test_ranks_may_mix_the_native_and_the_reference_hook():
    # The two hooks issue the same collectives, so a job where one rank debugs with the
    # reference hook neither hangs nor differs.
    for transport in ("side", "carry"):
        mixed = unwrap(run(compare_worker, 2, [True, False], [3, 7], "samples", {}, "float64", 3, transport))
        same = unwrap(run(compare_worker, 2, True, [3, 7], "samples", {}, "float64", 3, transport))
        for r in range(2):
            for s in range(3):
                for a, b in zip(mixed[r]["grads"][s], same[r]["grads"][s]):
                    assert torch.equal(a, b)


def agreement_worker(rank, world, case):
    if case == "transports":
        ddp = DDP(torch.nn.Linear(3, 2))
        hetlb.Balancer(ddp, 4, policy=Fixed([2, 2]), transport=["side", "carry"][rank])
    elif case == "config":
        hetlb.Balancer(DDP(torch.nn.Linear(3, 2)), 4, policy=Fixed([2, 2]),
                       weighting=["samples", "none"][rank])
    elif case == "seed":
        bal = hetlb.Balancer(DDP(torch.nn.Linear(3, 2)), 4, policy=Fixed([2, 2]))
        bal.loader(torch.utils.data.TensorDataset(torch.zeros(10, 3)), seed=rank)
    return "no error"


@pytest.mark.parametrize("case, match", [
    ("transports", "rank 0: 'side', rank 1: 'carry'"),
    ("config", "rank 0 has weighting='samples'; rank 1 has weighting='none'"),
    ("seed", "rank 0 has seed=0; rank 1 has seed=1"),
])
def test_ranks_agree_at_start_up_or_get_an_error_naming_them(case, match):
    res = run(agreement_worker, 2, case, timeout=120)
    for status, msg in res:
        assert status == "error" and "ValueError" in msg and match in msg, msg


def failed_start_worker(rank, world):
    ddp = DDP(torch.nn.Linear(3, 2))
    try:
        hetlb.Balancer(ddp, 4, policy=Fixed([2, 2]), transport=["side", "carry"][rank])
    except ValueError:
        pass
    keys = list(ddp.__dict__)
    kept = ddp.__dict__.get("_hetlb_groups_kept")
    return {"kept": kept is not None and any(g is ddp.process_group for g in kept.groups),
            "after_reducer": "reducer" in keys and kept is not None and
                             keys.index("_hetlb_groups_kept") > keys.index("reducer")}


def test_a_start_up_that_raises_leaves_the_reducer_no_last_owner_of_its_group():
    # The reducer's destructor holds the GIL while it joins Gloo's threads: if it dropped the
    # group's last reference, an exit after a failed start-up could hang (seen once in CI).
    for res in run(failed_start_worker, 2, timeout=120):
        assert res == ("ok", {"kept": True, "after_reducer": True}), res


def test_transport_choice_over_the_ranks():
    # (Ranks of one DDP job cannot differ in parameter dtype, but can in device, e.g. CPU and
    # CUDA ranks in one Gloo job: the choice works from each rank's carry blocker.)
    from hetlb.comm.route import carry_blocker, choose_route
    assert choose_route([None, None], [None, None]) == "carry"
    assert choose_route([None, None], [None, "the group uses NCCL"]) == "side"
    assert choose_route(["side", None], [None, None]) == "side"
    assert choose_route([None, "carry"], [None, None]) == "carry"
    with pytest.raises(ValueError, match="rank 1: a parameter is torch.bfloat16"):
        choose_route(["carry", None], [None, "a parameter is torch.bfloat16 on cpu"])
    with pytest.raises(ValueError, match="rank 0: 'side', rank 2: 'carry'"):
        choose_route(["side", None, "carry"], [None] * 3)
    assert carry_blocker(torch.nn.Linear(2, 2).to(torch.bfloat16), None) == "a parameter is torch.bfloat16 on cpu"
    assert carry_blocker(torch.nn.Linear(2, 2), None) is None
    # A penalty (one rank's DDP would copy the carried bucket back) moves the default to "side";
    # an explicit "carry" is still honoured.
    view = "DDP(gradient_as_bucket_view=True) would copy the carried bucket back"
    assert choose_route([None, None], [None, None], [None, view]) == "side"
    assert choose_route([None, None], [None, None], [None, None]) == "carry"
    assert choose_route(["carry", None], [None, None], [view, view]) == "carry"


def outside_worker(rank, world):
    ddp = DDP(torch.nn.Linear(3, 1))
    hetlb.Balancer(ddp, 8, policy=Fixed([4, 4]))  # registers its hooks on ddp
    ds = torch.utils.data.TensorDataset(torch.randn(16, 3))
    # A plain DataLoader with DistributedSampler and no bal.step(): the gradient weights would
    # be wrong, so the first backward says so.
    dl = torch.utils.data.DataLoader(ds, batch_size=4, sampler=torch.utils.data.distributed.DistributedSampler(ds))
    try:
        for (x,) in dl:
            ddp(x).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_backward_outside_a_balanced_step_raises():
    for msg in unwrap(run(outside_worker, 2, timeout=120)):
        assert "outside a balanced step" in msg and "bal.step()" in msg, msg


def test_step_core_checks_its_inputs():
    with pytest.raises(RuntimeError, match="rank=2 world=2"):
        _C.StepCore(2, 2, NUM_FIELDS, False, False, COL["compute"], COL["cpu"])
    with pytest.raises(RuntimeError, match="compute_col and cpu_col"):
        _C.StepCore(0, 1, NUM_FIELDS, False, False, NUM_FIELDS, 0)
    with pytest.raises(RuntimeError, match="carry transport needs a Gloo group"):
        _C.StepCore(0, 1, NUM_FIELDS, True, True, COL["compute"], COL["cpu"])
    core = _C.StepCore(1, 2, NUM_FIELDS, False, False, COL["compute"], COL["cpu"])
    assert core.take_table() is None and core.hooks_run == 0 and not core.open
    with pytest.raises(RuntimeError, match=f"row must have {NUM_FIELDS} entries, got 3"):
        core.start(0.5, np.zeros(3))
    with pytest.raises(RuntimeError, match="weight must be finite and >= 0"):
        core.start(float("nan"), np.zeros(NUM_FIELDS))
    with pytest.raises(RuntimeError, match=rf"column must be in \[0, {NUM_FIELDS}\), got {NUM_FIELDS}"):
        core.set(NUM_FIELDS, 1.0)
    with pytest.raises(RuntimeError, match="finite factor"):
        core.hold(float("inf"), 0.0)
    row = np.arange(NUM_FIELDS, dtype=np.float64)
    core.start(0.25, row)
    assert core.open and core.weight == 0.25 and np.array_equal(core.row, row)
    assert core.slots.shape == (2 * NUM_FIELDS,) and core.slots[:NUM_FIELDS].eq(0).all()
    assert torch.equal(core.slots[NUM_FIELDS:], torch.from_numpy(row))
    c = core.last_ready()
    assert c >= 0 and core.row[COL["compute"]] == c and 0 <= core.row[COL["cpu"]] <= 1
    core.close()
    assert not core.open
    # A CPU core times on the host: no device clock, no lag to set.
    assert core.clock_depth == 0
    with pytest.raises(RuntimeError, match="a CPU step core has no device clock"):
        core.clock_depth = 2
    tele = hetlb.comm.hook.StepTelemetry(0, 1)
    assert tele.lag == 0
    with pytest.raises(ValueError, match="steps must be an integer >= 1, got 0"):
        tele.set_clock_lag(0)
    with pytest.raises(RuntimeError, match="no device clock"):
        tele.set_clock_lag(2)
    assert tele.lag == 0


@settings(max_examples=40, deadline=None)
@given(world=st.integers(1, 5), data=st.data())
def test_block_slots_match_the_reference(world, data):
    """A block's region (Balancer(exchange_every=k)): every stamped row at its position, the
    current row last, this rank's slot of each table, against hetlb.reference.ref_block_slots."""
    from hetlb.reference import ref_block_slots
    rank = data.draw(st.integers(0, world - 1))
    k = data.draw(st.integers(1, 6))
    core = _C.StepCore(rank, world, NUM_FIELDS, False, False, COL["compute"], COL["cpu"])
    core.set_block(k)
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    for _ in range(data.draw(st.integers(1, 2))):  # a second block reuses the rows
        n = data.draw(st.integers(1, k))
        stamped = []
        for j in range(n):
            core.start(0.5, rng.normal(size=NUM_FIELDS), pos=j, ship=j == n - 1)
            assert core.pos == j and core.ship == (j == n - 1)
            if j < n - 1 or data.draw(st.booleans()):
                core.last_ready()  # (the current step's row is sent stamped or not)
            stamped.append(core.row)
            assert torch.equal(core.slots, ref_block_slots(stamped, rank, world))
            # A flush sends the stamped rows alone, whether or not the current step stamped.
            kept = j + 1 if core.last_buckets else j
            if kept:
                assert torch.equal(core.kept_slots(kept), ref_block_slots(stamped[:kept], rank, world))
            core.close()


@settings(max_examples=30, deadline=None)
@given(values=st.lists(st.floats(-1e6, 1e6), min_size=9, max_size=9), junk=st.integers(0, 2 ** 32 - 1),
       pos=st.integers(0, 2), ship=st.booleans())
def test_begin_with_numbers_opens_the_step_start_opens_with_their_row(values, junk, pos, ship):
    """StepCore.begin (the step boundary's one call, the values of ROW_VALUES as numbers) leaves
    the same row, block position and clock state as start() with the row array: compute NaN and
    CPU 0 until stamped, whatever an earlier step left in the row."""
    from hetlb.core.telemetry import ROW_VALUES
    row = np.zeros(NUM_FIELDS)
    row[COL["compute"]] = math.nan
    for name, v in zip(ROW_VALUES, values):
        row[COL[name]] = v
    a, b = (_C.StepCore(0, 2, NUM_FIELDS, False, False, COL["compute"], COL["cpu"]) for _ in range(2))
    b.set_columns([COL[c] for c in ROW_VALUES])
    for core in (a, b):
        core.set_block(3)
        core.start(1.0, np.random.default_rng(junk).normal(size=NUM_FIELDS))  # an earlier step
        core.last_ready()
        core.close()
    a.start(0.25, row, 0.5, False, pos, ship)
    b.begin(0.25, 0.5, False, pos, ship, *values)
    assert np.array_equal(a.row, b.row, equal_nan=True) and b.open and b.weight == 0.25
    assert (b.pos, b.ship, b.last_buckets) == (pos, ship, 0)
    assert 0.5 <= b.last_ready(False) < 0.6 and b.row[COL["compute"]] >= 0.5


def test_end_kept_stamps_a_step_no_hook_ended_and_closes_it():
    from hetlb.core.telemetry import ROW_VALUES
    core = _C.StepCore(0, 1, NUM_FIELDS, False, False, COL["compute"], COL["cpu"])
    with pytest.raises(RuntimeError, match="set_columns\\(\\) was never called"):
        core.begin(1.0, 0.0, True, 0, True, *range(9))
    with pytest.raises(RuntimeError, match=f"column must be in \\[0, {NUM_FIELDS}\\), got -1"):
        core.set_columns([-1])
    with pytest.raises(RuntimeError, match=f"column {COL['epoch']} is named 0 times"):
        core.set_columns([COL[c] for c in ROW_VALUES if c != "epoch"])
    with pytest.raises(RuntimeError, match=f"column {COL['batch']} is named 2 times"):
        core.set_columns([COL["batch"]] + [COL[c] for c in ROW_VALUES])
    with pytest.raises(RuntimeError, match=f"column {COL['compute']} is named 2 times"):
        core.set_columns([COL["compute"]] + [COL[c] for c in ROW_VALUES if c != "data"])
    core.set_columns([COL[c] for c in ROW_VALUES])
    with pytest.raises(RuntimeError, match="begin: weight must be finite and >= 0, got -1"):
        core.begin(-1.0, 0.0, True, 0, True, *range(9))
    core.begin(1.0, 0.0, True, 0, True, *range(9))
    assert core.end_kept() is False  # no hook ran: stamped here
    assert not core.open and core.last_buckets == 1 and core.row[COL["compute"]] >= 0
    core.begin(1.0, 0.0, True, 0, True, *range(9))
    core.last_ready()  # as a hook would
    stamped = core.row
    assert core.end_kept() is True and not core.open
    assert np.array_equal(core.row, stamped)  # not stamped twice


@settings(max_examples=30, deadline=None)
@given(values=st.lists(st.floats(-1e6, 1e6), min_size=9, max_size=9), weight=st.floats(0, 10),
       offset=st.floats(0, 10), pos=st.integers(0, 2), ship=st.booleans(), new_window=st.booleans(),
       hooked=st.booleans())
def test_step_calls_do_what_the_core_s_methods_do(values, weight, offset, pos, ship, new_window, hooked):
    """The per-step builtins of _C.step_calls (no pybind11 dispatch) leave a core as its pybind
    methods of the same names leave another: begin's row and state, end_kept's stamp and
    result, restart_clock's clock."""
    from hetlb.core.telemetry import ROW_VALUES
    a, b = (_C.StepCore(0, 2, NUM_FIELDS, False, False, COL["compute"], COL["cpu"]) for _ in range(2))
    begin, end_kept, restart_clock, _ = _C.step_calls(b)
    for core in (a, b):
        core.set_columns([COL[c] for c in ROW_VALUES])
        core.set_block(3)
    # numpy scalars and ints pass as pybind11 would take them
    a.begin(weight, offset, new_window, pos, ship, *values)
    begin(np.float64(weight), offset, new_window, np.int64(pos), ship, *values)
    assert np.array_equal(a.row, b.row, equal_nan=True)
    assert (b.open, b.weight, b.pos, b.ship, b.last_buckets) == (True, weight, pos, ship, 0)
    time.sleep(0.02)
    restart_clock()  # the clock restarts at the step's first forward: 20 ms not counted
    a.restart_clock()
    if hooked:  # as a hook would
        a.last_ready()
        b.last_ready()
    assert end_kept() is a.end_kept() is hooked and not b.open and b.last_buckets == 1
    assert offset <= b.row[COL["compute"]] < offset + 0.015
    assert restart_clock() is None and not b.open  # (outside a step it does nothing)


def test_step_calls_refuse_bad_arguments():
    from hetlb.core.telemetry import ROW_VALUES
    core = _C.StepCore(0, 2, NUM_FIELDS, False, False, COL["compute"], COL["cpu"])
    begin, end_kept, restart_clock, watch = _C.step_calls(core)
    with pytest.raises(RuntimeError, match="set_columns\\(\\) was never called"):
        begin(1.0, 0.0, True, 0, True, *range(9))
    core.set_columns([COL[c] for c in ROW_VALUES])
    with pytest.raises(TypeError, match="takes 14 arguments .*got 13"):
        begin(1.0, 0.0, True, 0, True, *range(8))
    with pytest.raises(TypeError, match="must be real number, not str"):
        begin(1.0, 0.0, True, 0, True, "x", *range(8))
    with pytest.raises(TypeError, match="cannot be interpreted as an integer"):
        begin(1.0, 0.0, True, 0.5, True, *range(9))
    with pytest.raises(RuntimeError, match="begin: weight must be finite and >= 0, got -1"):
        begin(-1.0, 0.0, True, 0, True, *range(9))
    with pytest.raises(RuntimeError, match=r"pos must be in \[0, 1\)"):
        begin(1.0, 0.0, True, 1, True, *range(9))
    assert not core.open  # (nothing was opened by a refused call)
    with pytest.raises(TypeError, match="takes no arguments"):
        end_kept(1)
    with pytest.raises(TypeError, match="needs a tensor, got list"):
        watch([1.0])
    with pytest.raises(RuntimeError, match="no side process group: none was given, or it was destroyed"):
        watch(torch.ones(2, requires_grad=True))  # (step_calls without a side group)
    with pytest.raises(RuntimeError, match="need a StepCore, got None"):
        _C.step_calls(None)
    assert unwrap(run(_step_calls_group_size, 1)) == ["refused"]


def _step_calls_group_size(rank, world):
    core = _C.StepCore(0, 2, NUM_FIELDS, False, False, COL["compute"], COL["cpu"])
    with pytest.raises(RuntimeError, match="need the side group of 2 ranks, got one of 1"):
        _C.step_calls(core, dist.group.WORLD)
    return "refused"


def test_step_core_checks_its_block():
    core = _C.StepCore(0, 2, NUM_FIELDS, False, False, COL["compute"], COL["cpu"])
    with pytest.raises(RuntimeError, match="at least 1 step, got 0"):
        core.set_block(0)
    with pytest.raises(RuntimeError, match=r"pos must be in \[0, 1\) \(the block set by set_block\), got 1"):
        core.start(1.0, np.zeros(NUM_FIELDS), pos=1)
    core.set_block(3)
    assert core.block == 3
    with pytest.raises(RuntimeError, match=r"pos must be in \[0, 3\).*got -1"):
        core.start(1.0, np.zeros(NUM_FIELDS), pos=-1)
    core.start(1.0, np.zeros(NUM_FIELDS), pos=2)
    with pytest.raises(RuntimeError, match="a step is open"):
        core.set_block(2)
    assert core.slots.shape == (3 * 2 * NUM_FIELDS,)
    for bad in (0, 4):
        with pytest.raises(RuntimeError, match=rf"need 1 <= n <= block \(3\), got {bad}"):
            core.kept_slots(bad)


def test_step_core_holds_and_reports_no_progress():
    core = _C.StepCore(0, 1, NUM_FIELDS, False, False, COL["compute"], COL["cpu"])
    core.start(1.0, np.zeros(NUM_FIELDS))
    core.hold(0.0, 0.05, 0.001)  # a time model: 50 ms whatever the measured time
    t0 = time.perf_counter()
    c = core.last_ready()
    assert 0.05 <= c < 0.09 and time.perf_counter() - t0 >= 0.049  # never early; late only if descheduled
    core.start(1.0, np.zeros(NUM_FIELDS))
    time.sleep(0.02)
    core.hold(2.0, 0.0)  # twice the measured time
    c = core.last_ready()
    assert 0.04 <= c < 0.09
    core.start(1.0, np.zeros(NUM_FIELDS))
    core.report_no_progress()
    core.last_ready()
    assert core.row[COL["compute"]] == math.inf and np.isfinite(core.compute)
    core.start(1.0, np.zeros(NUM_FIELDS), 0.5, False)  # a later micro-step: 0.5 s before it
    assert 0.5 <= core.last_ready(False) < 0.6


def test_native_clock_is_the_perf_counter_clock():
    # The step core stamps compute times on this clock: it must be Python's perf_counter clock.
    # Bracketing each native reading between two Python ones holds however loaded the machine is.
    for _ in range(3):
        a0 = time.perf_counter()
        b0 = _C.monotonic()
        a0b = time.perf_counter()
        time.sleep(0.02)
        a1 = time.perf_counter()
        b1 = _C.monotonic()
        a1b = time.perf_counter()
        assert a0 <= b0 <= a0b and a1 <= b1 <= a1b
        assert a1 - a0b <= b1 - b0 <= a1b - a0


def bandwidth_worker(rank, world, delay, native):
    from hetlb.sim.emulate import Emulator
    torch.manual_seed(0)
    net = torch.nn.Linear(40, 10).double()
    nbytes = sum(p.numel() for p in net.parameters()) * 8  # one bucket
    ddp = DDP(net)
    bal = hetlb.Balancer(ddp, 8, policy=Fixed([3, 5]), emulator=Emulator(bandwidth=nbytes / delay),
                         native_hook=native)
    x = torch.randn(8, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mine = x[:3] if rank == 0 else x[3:]
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        with bal.step():
            ddp(mine).pow(2).sum(1).mean().backward()
        walls.append(time.perf_counter() - t0)
        grad = [p.grad.clone() for p in net.parameters()]
        ddp.zero_grad()
    ref = torch.nn.Linear(40, 10).double()
    ref.load_state_dict(net.state_dict())
    ref(x).pow(2).sum(1).mean().backward()
    err = max((g - r.grad).abs().max().item() for g, r in zip(grad, ref.parameters()))
    return {"walls": walls, "err": err, "batch": bal.history[-1].batch.tolist()}


def test_emulated_bandwidth_cap_delays_the_bucket_and_keeps_the_gradient():
    delay = 0.15
    for out in unwrap(run(bandwidth_worker, 2, delay, True, timeout=120)):
        assert min(out["walls"]) >= delay, out["walls"]
        assert out["err"] < 1e-12 and out["batch"] == [3, 5]


def hold_worker(rank, world, model_based):
    from hetlb.sim.emulate import Emulator
    from hetlb.core.models import LinearModel

    class Counting(Emulator):
        calls = 0

        def stretch(self, *args):
            Counting.calls += 1
            return super().stretch(*args)

    class Slow(torch.nn.Linear):
        def forward(self, x):  # 20 ms of known "compute" (a sleep holds steady under load)
            time.sleep(0.02)
            return super().forward(x)

    kw = {"model": LinearModel(0.03, 0.004)} if model_based else {}
    speeds = [1.0, 0.5] if model_based else [1.0, 0.1]
    emu = Counting(speed=speeds[rank], rank=rank, **kw)
    ddp = DDP(Slow(4, 2).double())
    bal = hetlb.Balancer(ddp, 10, policy=Fixed([4, 6]), emulator=emu)
    for step in range(4):
        with bal.step():
            ddp(torch.randn(int(bal.batch_sizes[rank]), 4, dtype=torch.float64)).sum().backward()
    targets = [[Emulator(speed=s, **kw).target(k, b, measured=1e-3) for s, b in zip(speeds, [4, 6])]
               for k in range(4)]
    return {"stretch_calls": Counting.calls, "compute": [r.compute.tolist() for r in bal.history],
            "targets": targets}


@pytest.mark.parametrize("model_based", [True, False])
def test_native_hook_holds_an_emulated_step_without_python(model_based):
    # Lower bounds only: a hold sleeps until its target, so a busy machine can only make a step
    # later: how soon after its target a step is stamped is a timing claim, not checked here.
    for out in unwrap(run(hold_worker, 2, model_based, timeout=120)):
        assert out["stretch_calls"] == 0
        for got, want in zip(out["compute"], out["targets"]):
            if model_based:  # held to the target (0.046 s and 0.108 s), not stamped twice
                assert all(w <= g < w + 1.0 for g, w in zip(got, want)), (got, want)
            else:  # the tenth-speed rank reports ten times its compute (>= 10 x the 20 ms sleep)
                assert got[0] >= 0.02 and got[1] >= 0.2, got


# name: (carry transport, side table on a group of its own, side_first)
TRANSPORTS = {"side-same-group": (False, False, False), "side-own-group": (False, True, False),
              "side-own-group-first": (False, True, True), "carry": (True, False, False)}


def reduce_worker(rank, world):
    from hetlb.ranks.agreement import make_side_group
    pg = dist.distributed_c10d._get_default_group()
    own = make_side_group(None, own=True)
    out = {}
    try:
        _C.StepCore(rank, world, NUM_FIELDS, False, False, COL["compute"], COL["cpu"]).reduce(
            torch.zeros(2), False, pg, None)
    except RuntimeError as e:
        out["none"] = str(e)
    # The side table on the gradient group (issued before the last bucket), on a group of its own
    # (issued once the last bucket is reduced) and on its own group issued first; the carry.
    for carry, (carries, on_own, first) in TRANSPORTS.items():
        side = own if on_own else pg
        core = _C.StepCore(rank, world, NUM_FIELDS, carries, False, COL["compute"], COL["cpu"])
        core.side_first = first
        row = np.full(NUM_FIELDS, float(rank + 1))
        core.start(0.25, row)
        buf = torch.arange(6, dtype=torch.float32) + rank
        got = core.reduce(buf, False, pg, side)
        out[f"scaled-{carry}"] = got.tolist()
        core.start(0.0 if rank == 1 else 1.0, row)  # rank 1 has no samples: its NaN must vanish
        nan = torch.full((6,), float("nan")) if rank == 1 else torch.ones(6)
        got = core.reduce(nan, True, pg, side)
        out[f"zeroed-{carry}"] = got.tolist()
        out[f"table-{carry}"] = core.take_table().tolist()
        # The weight is already in the gradient (a scaled loss): the hook only sums; a weight-0
        # rank is still zeroed.
        core.start(0.0 if rank == 1 else 0.25, row)
        core.prescaled = True
        got = core.reduce(nan if rank == 1 else torch.arange(6, dtype=torch.float32), True, pg, side)
        out[f"prescaled-{carry}"] = (got.tolist(), core.scaled_buckets)
        core.take_table()
    return out


def test_the_hook_body_scales_zeroes_and_delivers_the_table():
    res = unwrap(run(reduce_worker, 2, timeout=120))
    for carry in TRANSPORTS:
        want = (0.25 * (torch.arange(6.0) + torch.arange(6.0) + 1)).tolist()
        assert res[0][f"scaled-{carry}"] == res[1][f"scaled-{carry}"] == want
        assert res[0][f"zeroed-{carry}"] == res[1][f"zeroed-{carry}"] == [1.0] * 6
        assert res[0][f"prescaled-{carry}"] == res[1][f"prescaled-{carry}"] == (torch.arange(6.0).tolist(), 0)
        table = np.array(res[0][f"table-{carry}"])
        assert table.shape == (2, NUM_FIELDS) and (table[0] == 1).sum() >= NUM_FIELDS - 2
        assert table[1, COL["batch"]] == 2.0 and res[1][f"table-{carry}"] == res[0][f"table-{carry}"]
    assert "need a process group and a side group" in res[0]["none"]


def lost_table_worker(rank, world, transport):
    ddp = DDP(torch.nn.Linear(3, 2))
    bal = hetlb.Balancer(ddp, 4, policy=Fixed([2, 2]), transport=transport, defer_hook=False)
    ds = torch.utils.data.TensorDataset(torch.randn(40, 3))
    it = iter(bal.loader(ds, seed=0))
    (x,) = next(it)
    ddp(x).sum().backward()
    next(it)  # a step whose table arrived ends normally
    ddp(x[:2]).sum().backward()
    bal.telemetry.core.take_table()  # as if the hook had lost this step's table
    try:
        next(it)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("transport", ["carry", "side"])
def test_a_table_the_hook_did_not_deliver_is_an_error_not_a_lone_exchange(transport):
    # A lone blocking exchange on one rank would wait for peers that never join it.
    for msg in unwrap(run(lost_table_worker, 2, transport, timeout=120)):
        assert "step 1: the gradient's communication hook ran but delivered no telemetry table" in msg, msg
