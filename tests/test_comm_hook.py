"""The native (C++) weighted all-reduce hook against the Python one, on real DDP over Gloo.

Both hooks compute ``sum_r w_r * g_r`` with the same elementwise products and the same Gloo sum,
so gradients must agree bit for bit and the telemetry tables in every column that is not a
measurement (compute time, memory, CPU load). The Python hook is itself checked against single-process gradients in
test_balancer_dist.py.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run, unwrap
from fixed_policy import Fixed

from hetlb import _C
from hetlb.telemetry import COL, NUM_FIELDS


def _wide_net(dtype):
    torch.manual_seed(0)
    # ~2 k parameters per layer so that a 1 KiB bucket cap gives several buckets after DDP's
    # first-iteration rebuild.
    return torch.nn.Sequential(torch.nn.Linear(6, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48),
                               torch.nn.Tanh(), torch.nn.Linear(48, 3)).to(dtype)


def compare_worker(rank, world, native, sizes, weighting, options, dtype_name, steps):
    import hetlb
    dtype = getattr(torch, dtype_name)
    net = _wide_net(dtype)
    ddp = DDP(net, bucket_cap_mb=options.get("bucket_cap_mb", 0.001),
              gradient_as_bucket_view=options.get("gradient_as_bucket_view", False),
              static_graph=options.get("static_graph", False))
    bal = hetlb.Balancer(ddp, sum(sizes), policy=Fixed(sizes), weighting=weighting, lower=0,
                         native_hook=native)
    g = torch.Generator().manual_seed(7)
    n = 40
    x = torch.randn(n, 6, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(n, 3, generator=g, dtype=torch.float64).to(dtype)
    ds = torch.utils.data.TensorDataset(x, y)
    loader = bal.loader(ds, sizes=np.arange(1, n + 1) % 5 + 1.0, seed=3)
    grads, tables, buckets = [], [], []
    for step, (xb, yb) in enumerate(loader):
        if step == steps:
            break
        with bal.step():
            out = ddp(xb)
            # An idle rank backpropagates a zero-sample loss (NaN-free: sum over nothing is 0).
            ((out - yb).pow(2).sum() / max(len(xb), 1)).backward()
        grads.append([p.grad.detach().clone() for p in net.parameters()])
        rec = bal.history[-1]
        tables.append({"batch": rec.batch.tolist(), "data": rec.data.tolist(),
                       "memory": rec.memory.tolist(), "cpu": rec.cpu.tolist(),
                       "compute": rec.compute.tolist()})
        buckets.append(bal._state.buckets_run())
        ddp.zero_grad(set_to_none=False)
    return {"native": bal._state.native, "grads": grads, "tables": tables, "buckets": buckets}


CASES = {
    "samples-2": (2, [3, 7], "samples", {}, "float64"),
    "sizes-3-idle": (3, [4, 0, 6], "sizes", {}, "float64"),
    "none-2-f32": (2, [5, 2], "none", {}, "float32"),
    "bucket-view": (2, [1, 8], "samples", {"gradient_as_bucket_view": True}, "float64"),
    "static-graph": (2, [6, 3], "samples", {"static_graph": True}, "float32"),
    "one-bucket": (2, [2, 5], "samples", {"bucket_cap_mb": 25}, "float64"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_native_hook_matches_the_python_hook(case):
    world, sizes, weighting, options, dtype = CASES[case]
    steps = 4
    native = unwrap(run(compare_worker, world, True, sizes, weighting, options, dtype, steps))
    python = unwrap(run(compare_worker, world, False, sizes, weighting, options, dtype, steps))
    for r in range(world):
        assert native[r]["native"] and not python[r]["native"]
        assert native[r]["buckets"] == python[r]["buckets"]
        if options.get("bucket_cap_mb", 0.001) < 1:
            assert max(native[r]["buckets"]) >= 2, native[r]["buckets"]  # really several buckets
        for s in range(steps):
            for a, b in zip(native[r]["grads"][s], python[r]["grads"][s]):
                assert torch.equal(a, b), (r, s, (a - b).abs().max())
            tn, tp = native[r]["tables"][s], python[r]["tables"][s]
            for key in ("batch", "data"):
                assert tn[key] == tp[key], (key, tn[key], tp[key])
            assert tn["batch"] == sizes
            # Measured columns differ between the two runs; they must be sane readings.
            assert all(np.isfinite(tn["compute"])) and min(tn["compute"]) > 0
            assert all(0 < m < 1 for m in tn["memory"]) and all(0 <= c <= 1 for c in tn["cpu"])
        # Every rank sees the same table, compute times included.
        assert native[r]["tables"] == native[0]["tables"]


def fallback_worker(rank, world):
    import hetlb
    from hetlb.emulate import Emulator
    out = {}
    half = DDP(torch.nn.Linear(3, 2).to(torch.bfloat16))
    out["bf16_default"] = hetlb.Balancer(half, 4, policy=Fixed([2, 2]))._state.native
    try:
        hetlb.Balancer(DDP(torch.nn.Linear(3, 2).to(torch.bfloat16)), 4, policy=Fixed([2, 2]),
                       native_hook=True)
    except ValueError as e:
        out["bf16_forced"] = str(e)
    capped = Emulator(bandwidth=1e9)
    out["bandwidth"] = hetlb.Balancer(DDP(torch.nn.Linear(3, 2)), 4, policy=Fixed([2, 2]),
                                      emulator=capped)._state.native
    out["f32_default"] = hetlb.Balancer(DDP(torch.nn.Linear(3, 2)), 4, policy=Fixed([2, 2]))._state.native
    out["f32_python"] = hetlb.Balancer(DDP(torch.nn.Linear(3, 2)), 4, policy=Fixed([2, 2]),
                                       native_hook=False)._state.native
    # A core that does not match the group is refused with both sides named.
    try:
        _C.register_comm_hook(DDP(torch.nn.Linear(3, 2)).reducer,
                              dist.distributed_c10d._get_default_group(), _C.HookCore(rank, 3, NUM_FIELDS))
    except RuntimeError as e:
        out["mismatch"] = str(e)
    return out


def test_the_python_hook_serves_what_the_native_one_cannot():
    for r, out in enumerate(unwrap(run(fallback_worker, 2, timeout=120))):
        assert out["bf16_default"] is False
        assert "torch.bfloat16" in out["bf16_forced"]
        assert out["bandwidth"] is False
        assert out["f32_default"] is True and out["f32_python"] is False
        assert f"rank {r} of 3" in out["mismatch"] and f"rank {r} of 2" in out["mismatch"]


def test_native_hook_needs_ddp():
    import hetlb
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        hetlb.Balancer(torch.nn.Linear(2, 1), 4, native_hook=True)


def test_hook_core_checks_its_inputs():
    with pytest.raises(RuntimeError, match="rank=2 world=2"):
        _C.HookCore(2, 2, NUM_FIELDS)
    core = _C.HookCore(1, 2, NUM_FIELDS)
    assert core.take_table() is None and core.hooks_run == 0 and core.on_last is None
    with pytest.raises(RuntimeError, match=f"must have {NUM_FIELDS} entries, got shape of size 3"):
        core.reset(0.5, np.zeros(3))
    with pytest.raises(RuntimeError, match="finite"):
        core.reset(float("nan"), np.zeros(NUM_FIELDS))
    with pytest.raises(RuntimeError, match=r"column must be in \[0, 9\), got 9"):
        core.set(NUM_FIELDS, 1.0)
    with pytest.raises(RuntimeError, match="callable or None, got <class 'int'>"):
        core.on_last = 3
    row = np.arange(NUM_FIELDS, dtype=np.float64)
    core.reset(0.25, row)
    core.set(COL["compute"], 1.5)
    expect = row.copy()
    expect[COL["compute"]] = 1.5
    assert core.weight == 0.25 and np.array_equal(core.row, expect)
    core.on_last = lambda: None
    assert callable(core.on_last)
    core.on_last = None
    assert core.on_last is None


def test_native_clock_is_the_perf_counter_clock():
    # The native hook times from reset() to the last bucket on this clock; it must be the
    # monotonic clock Python's timers use, advancing at the same rate.
    a0, b0 = time.perf_counter(), _C.monotonic()
    time.sleep(0.05)
    a1, b1 = time.perf_counter(), _C.monotonic()
    assert abs((b1 - b0) - (a1 - a0)) < 5e-3
    assert abs(b0 - a0) < 1.0


def bandwidth_worker(rank, world, delay):
    import time as _time

    import hetlb
    from hetlb.emulate import Emulator
    torch.manual_seed(0)
    net = torch.nn.Linear(40, 10).double()
    nbytes = sum(p.numel() for p in net.parameters()) * 8  # one bucket
    ddp = DDP(net)
    bal = hetlb.Balancer(ddp, 8, policy=Fixed([3, 5]), emulator=Emulator(bandwidth=nbytes / delay))
    x = torch.randn(8, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mine = x[:3] if rank == 0 else x[3:]
    walls = []
    for _ in range(3):
        t0 = _time.perf_counter()
        with bal.step():
            ddp(mine).pow(2).sum(1).mean().backward()
        walls.append(_time.perf_counter() - t0)
        grad = [p.grad.clone() for p in net.parameters()]
        ddp.zero_grad()
    ref = torch.nn.Linear(40, 10).double()
    ref.load_state_dict(net.state_dict())
    ref(x).pow(2).sum(1).mean().backward()
    err = max((g - r.grad).abs().max().item() for g, r in zip(grad, ref.parameters()))
    return {"native": bal._state.native, "walls": walls, "err": err,
            "batch": bal.history[-1].batch.tolist()}


def test_emulated_bandwidth_cap_delays_the_bucket_and_keeps_the_gradient():
    delay = 0.15
    for out in unwrap(run(bandwidth_worker, 2, delay, timeout=120)):
        assert out["native"] is False  # the cap is applied by the Python hook
        assert min(out["walls"]) >= delay, out["walls"]
        assert out["err"] < 1e-12 and out["batch"] == [3, 5]


def hold_worker(rank, world):
    import hetlb
    from hetlb.emulate import Emulator
    from hetlb.models import LinearModel

    class NoPythonStretch(Emulator):
        calls = 0

        def stretch(self, *args):
            NoPythonStretch.calls += 1
            return super().stretch(*args)

    emu = NoPythonStretch(model=LinearModel(0.03, 0.004), speed=[1.0, 0.5][rank], rank=rank)
    ddp = DDP(torch.nn.Linear(4, 2).double())
    bal = hetlb.Balancer(ddp, 10, policy=Fixed([4, 6]), emulator=emu)
    for step in range(4):
        with bal.step():
            ddp(torch.randn(int(bal.batch_sizes[rank]), 4, dtype=torch.float64)).sum().backward()
    targets = [[Emulator(model=LinearModel(0.03, 0.004), speed=s).target(k, b)
                for s, b in zip([1.0, 0.5], [4, 6])] for k in range(4)]
    return {"native": bal._state.native, "stretch_calls": NoPythonStretch.calls,
            "compute": [r.compute.tolist() for r in bal.history], "targets": targets}


def test_native_hook_holds_an_emulated_step_without_python():
    for out in unwrap(run(hold_worker, 2, timeout=120)):
        assert out["native"] and out["stretch_calls"] == 0
        for got, want in zip(out["compute"], out["targets"]):
            # Held to the target (0.046 s and 0.108 s), stamped just after: never early.
            assert all(w <= g < w + 0.01 for g, w in zip(got, want)), (got, want)


def test_hold_until_checks_its_inputs():
    core = _C.HookCore(0, 1, NUM_FIELDS)
    with pytest.raises(RuntimeError, match="deadline=nan"):
        core.hold_until(float("nan"))
    with pytest.raises(RuntimeError, match="spin=-1"):
        core.hold_until(1.0, -1.0)
    core.hold_until(5.0, 0.0)
    assert core.deadline == 5.0
    core.reset(1.0, np.zeros(NUM_FIELDS))
    assert core.deadline == float("-inf")
