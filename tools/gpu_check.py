"""GPU checks of hetlb that no CPU machine can run (called by tools/gpu_check.sh).

Each check prints ``PASS name: detail`` or ``FAIL name: error``; the exit code is the number of
failures. Run from the repository root with the extension built in place (``PYTHONPATH=.``);
arguments name the checks to run (prefixes of their names), none runs them all:

* ``nccl_premul``: the hook's NCCL path on a one-rank NCCL group: PREMUL_SUM with a tensor factor
  in float32/bfloat16/float16, a weight-0 bucket holding NaN (zeroed before it is sent), and the
  side table on the Gloo side group.
* ``nccl_balancer``: a one-rank NCCL Balancer on a CUDA model: steps through the loader, the
  compute column from CUDA events (one step late; and two with ``set_clock_lag(2)``), the memory
  column from ``mem_get_info``; two forward-backward passes a step are timed to the second's end.
* ``gloo_cuda``: two Gloo ranks with CUDA tensors sharing the GPU, sizes 3:7: the gradient equals
  one process over the union, with the native hook and with the Python reference.
* ``logged_loss``: ``bal.log_loss`` on CUDA tensors (two Gloo ranks, sizes 3:7): each step's
  global mean loss arrives with the next step's table, equal to one process's over the union.
* ``fsdp2``: a one-rank NCCL Balancer on a CUDA model sharded with ``fully_shard``: steps of
  ``bal.micro_steps`` (micro-batches of 3 of 10 samples) give the whole batch's gradient, and
  the compute column fills from CUDA events.
* ``fsdp2_micro_memory``: under a memory cap (``set_per_process_memory_fraction``) a batch whose
  one pass runs out of CUDA memory trains as micro-steps (``k = 8``) of an FSDP2 model on one
  NCCL rank, with the one-pass gradient of an unsharded copy.
* ``fsdp2_clock``: three Gloo ranks with CUDA tensors sharing the GPU, an FSDP2 model, emulated
  speeds 1:2:6 spread over the layers: the device's compute times leave out FSDP's waits (events
  around each wait on the stream) and follow the speeds; LBB reaches the proportional split.
* ``fsdp2_profile``: two such ranks profile an FSDP2 model together on the device's clock (CUDA
  events); the fast rank's waits for the slow one's host sleeps are left out.
* ``profile_oom``: ``hetlb.profile`` stops at a real CUDA out-of-memory and frees it.
* ``probe``: the memory probe sees another allocation on the device.
"""
from __future__ import annotations

import os
import sys
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import hetlb  # noqa: E402  (before any process group)
from distributed import run, unwrap  # noqa: E402


def nccl_premul_worker(rank, world):
    import torch.distributed as dist
    from hetlb import _C
    from hetlb.ranks.agreement import make_side_group
    from hetlb.core.telemetry import COL, NUM_FIELDS
    pg = dist.distributed_c10d._get_default_group()
    side = make_side_group(None)  # NCCL: a Gloo group for the table
    out = {}
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float16, 1e-3)):
        core = _C.StepCore(0, 1, NUM_FIELDS, False, True, COL["compute"], COL["cpu"], torch.device("cuda", 0))
        row = np.arange(NUM_FIELDS, dtype=np.float64)
        core.start(0.375, row)
        buf = torch.randn(1000, device="cuda", dtype=dtype)
        got = core.reduce(buf.clone(), False, pg, side)
        err = ((got.float() - buf.float() * 0.375).abs().max() / buf.float().abs().max()).item()
        assert err < tol, (dtype, err)
        core.start(0.0, row)
        nan = torch.full((1000,), float("nan"), device="cuda", dtype=dtype)
        got = core.reduce(nan, True, pg, side)  # the last bucket: also the side table
        assert torch.count_nonzero(got).item() == 0 and not torch.isnan(got).any(), dtype
        table = core.take_table()
        assert table is not None and table[0, COL["batch"]] == row[COL["batch"]]
        out[str(dtype)] = err
    return out


def nccl_balancer_worker(rank, world, lag=1, passes=1):
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).cuda()
    ddp = DDP(net, device_ids=[0])
    bal = hetlb.Balancer(ddp, 32, policy=hetlb.LBB())
    if lag != 1:
        bal.telemetry.set_clock_lag(lag)
    ds = torch.utils.data.TensorDataset(torch.randn(320, 64), torch.randn(320, 8))
    for x, y in bal.loader(ds):
        for _ in range(passes):  # passes > 1: the step's end event moves to the last backward's end
            torch.nn.functional.mse_loss(ddp(x.cuda()), y.cuda()).backward()
    h = bal.history
    compute = h.column("compute")
    # CUDA events: each record completes `lag` steps later
    assert bal.steps == 10 and len(h) == 10 - lag and h[0].step == 0, (bal.steps, len(h))
    assert np.all(np.isfinite(compute)) and np.all(compute > 0), compute
    assert np.all((h.column("memory") > 0) & (h.column("memory") < 1))
    return {"transport": bal.transport, "compute_ms": float(np.median(compute) * 1e3)}


def _gloo_cuda_setup(**balancer_kw):
    """A CUDA model in DDP on a Gloo rank, balanced 3:7, and its data: (net, ddp, bal, loader, x, y)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from fixed_policy import Fixed
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double().cuda()
    ddp = DDP(net, device_ids=[0])
    bal = hetlb.Balancer(ddp, 10, policy=Fixed([3, 7]), **balancer_kw)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 5, generator=g, dtype=torch.float64)
    y = torch.randn(40, 3, generator=g, dtype=torch.float64)
    loader = bal.loader(torch.utils.data.TensorDataset(x, y), seed=2)
    return net, ddp, bal, loader, x, y


def gloo_cuda_worker(rank, world, native, bal_backward=False):
    net, ddp, bal, loader, x, y = _gloo_cuda_setup(native_hook=native)
    errs, scaled = [], []
    for step, (xb, yb) in enumerate(loader):
        plan = bal.board.current
        loss = (ddp(xb.cuda()) - yb.cuda()).pow(2).sum(1).mean()
        bal.backward(loss) if bal_backward else loss.backward()  # the weight in the loss, or the hook
        scaled.append(bal.telemetry.core.scaled_buckets)
        idx = np.concatenate(loader.order.step_indices(plan))
        ref = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
        ref.load_state_dict({k: v.cpu() for k, v in net.state_dict().items()})
        (ref(x[idx]) - y[idx]).pow(2).sum(1).mean().backward()
        errs.append(max((p.grad.cpu() - r.grad).abs().max().item() for p, r in zip(net.parameters(), ref.parameters())))
        ddp.zero_grad()
    compute = bal.history.column("compute")
    assert np.all(np.isfinite(compute)) and np.all(compute > 0), compute
    if native:  # the native hook counts the buckets it weighed
        assert all(n == 0 for n in scaled) if bal_backward else all(n > 0 for n in scaled), scaled
    return {"err": max(errs), "transport": bal.transport}


def logged_loss_worker(rank, world):
    """bal.log_loss on CUDA: the loss stays on the device and rides in the next step's row (the
    compute clock's lag), so each step's global loss arrives one step later, exact."""
    net, ddp, bal, loader, x, y = _gloo_cuda_setup()
    want, got = [], []
    for step, (xb, yb) in enumerate(loader):
        idx = np.concatenate(loader.order.step_indices(bal.board.current))
        with torch.no_grad():  # the union's mean at these parameters (no optimizer: they stay)
            want.append(torch.nn.functional.mse_loss(net(x[idx].cuda()), y[idx].cuda()).item())
        loss = torch.nn.functional.mse_loss(ddp(xb.cuda()), yb.cuda())
        bal.log_loss(loss)
        loss.backward()
        ddp.zero_grad()
        done = bal.finished
        got.append(None if done is None else (done.step, done.loss))
    assert got[0] is None and [s for s, _ in got[1:]] == list(range(len(got) - 1)), got
    err = max(abs(loss - want[s]) for s, loss in got[1:])
    assert err < 1e-9, (got, want)
    return {"err": err, "steps": len(got)}


def fsdp2_worker(rank, world):
    """FSDP2 on CUDA tensors: the loss-side weight and the micro-step loop on one NCCL rank."""
    import copy
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).cuda()
    ref = copy.deepcopy(net)
    fully_shard(net[0])
    fully_shard(net)
    bal = hetlb.Balancer(net, 10, policy=hetlb.Uniform(), micro_batch=3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, 5, generator=g).cuda(), torch.randn(10, 3, generator=g).cuda()
    errs = []
    for _ in range(4):
        with bal.step():
            bal.micro_steps(lambda xb, yb: torch.nn.functional.mse_loss(net(xb), yb), x, y)
        ref.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        errs.append(max(float((p.grad.full_tensor() - r.grad).abs().max())
                        for p, r in zip(net.parameters(), ref.parameters())))
        net.zero_grad()
    bal.flush()
    compute = bal.history.column("compute")
    assert max(errs) < 1e-5, errs
    assert np.all(np.isfinite(compute)) and np.all(compute > 0), compute
    return {"err": max(errs), "records": len(compute)}


def fsdp2_micro_memory_worker(rank, world):
    """A real CUDA out-of-memory avoided by micro-steps: the cap is set from a step in 8
    micro-steps; the same batch in one pass then runs out of memory."""
    import copy
    from torch.distributed.fsdp import fully_shard
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    d, m, k = 2048, 1024, 8
    net = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.ReLU(), torch.nn.Linear(d, d),
                              torch.nn.ReLU(), torch.nn.Linear(d, 1)).cuda()
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(m * k, d, device="cuda", generator=g)
    y = torch.randn(m * k, 1, device="cuda", generator=g)
    ref = copy.deepcopy(net)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    want = [p.grad.detach().cpu() for p in ref.parameters()]
    del ref
    fully_shard(net[0])
    fully_shard(net[2])
    fully_shard(net)
    bal = hetlb.Balancer(net, m * k, policy=hetlb.Uniform(), micro_batch=m)

    def fn(xb, yb):
        return torch.nn.functional.mse_loss(net(xb), yb)

    with bal.step():  # (a first step: FSDP's buffers, the allocator's blocks)
        bal.micro_steps(fn, x, y)
    net.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with bal.step():
        bal.micro_steps(fn, x, y)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_reserved()
    total = torch.cuda.get_device_properties(0).total_memory
    net.zero_grad()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(1.0, 1.2 * peak / total))
    try:
        with bal.step():
            bal.micro_steps(fn, x, y)
        got = [p.grad.full_tensor().cpu() for p in net.parameters()]
        err = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want))
        net.zero_grad()
        oom = False
        try:
            with bal.step():
                bal.backward(fn(x, y))
        except Exception as e:  # noqa: BLE001 (what matters is that it is an out-of-memory)
            oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e)
            if not oom:
                raise
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert err < 1e-4, err
    assert oom, "one pass of the whole batch fit under the cap: the check shows nothing"
    return {"cap_mib": round(1.2 * peak / 2**20), "err": err, "one_pass_oom": oom}


SPEEDS = [1.0, 2.0, 6.0]


def _fsdp2_cuda_net():
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                torch.nn.Tanh(), torch.nn.Linear(64, 1)).cuda()
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    return model


def fsdp2_clock_worker(rank, world, steps):
    """tests/test_fsdp2.py's emulated 1:2:6 cluster with CUDA tensors: the compute column is the
    device's, read one step late, with FSDP's waits on the stream left out."""
    from hetlb.sim.emulate import Emulator
    model = _fsdp2_cuda_net()
    # One step before the Balancer: the first on a GPU also creates cuBLAS's handle and FSDP's
    # buffers (140 ms more on the fastest rank: a measured first step LBB would trust).
    model(torch.randn(4, 16, device="cuda")).sum().backward()
    model.zero_grad()
    emu = Emulator.for_rank(rank, SPEEDS, model=hetlb.LinearModel(0.0, 0.02))
    bal = hetlb.Balancer(model, 90, policy=hetlb.LBB(), emulator=emu)
    for _ in range(steps):
        with bal.step():
            bal.backward(model(torch.randn(int(bal.batch_sizes[rank]), 16, device="cuda")).sum())
    bal.flush()
    return {"sizes": [r.batch.tolist() for r in bal.history],
            "compute": [r.compute.tolist() for r in bal.history], "lag": bal.telemetry.lag}


def check_fsdp2_clock():
    res = unwrap(run(fsdp2_clock_worker, 3, 16, timeout=300))[0]
    rows = [(s, c) for s, c in zip(res["sizes"], res["compute"]) if all(np.isfinite(c))]
    sizes, first = rows[0]
    assert sizes == [30, 30, 30], res
    # 600, 300 and 100 ms of emulated compute; counting the waits, all three would be about 600
    assert 1.5 < first[0] / first[1] < 2.7 and 4.0 < first[0] / first[2] < 8.0, res
    want = np.array([10, 20, 60])
    for sizes in res["sizes"][-5:]:
        assert np.abs(np.array(sizes) - want).max() <= 0.05 * 90, res
    return {"first_ms": [round(1e3 * c, 1) for c in first], "last_sizes": res["sizes"][-1],
            "lag": res["lag"]}


def fsdp2_profile_worker(rank, world):
    import time
    model = _fsdp2_cuda_net()
    if rank == 1:  # a slower rank: the other waits for it in FSDP's collectives
        model[0].register_forward_hook(lambda m, a, o: time.sleep(0.005 * a[0].shape[0]))

    def step_fn(b):
        model(torch.randn(b, 16, device="cuda")).sum().backward()
        model.zero_grad()

    p = hetlb.profile(step_fn, model=model, batch_sizes=[4, 8, 16], repeats=3, trim=0,
                      device="cuda")
    return {"times": p.times, "sizes": p.batch_sizes}


def check_fsdp2_profile():
    fast, slow = unwrap(run(fsdp2_profile_worker, 2, timeout=300))
    assert fast["sizes"] == slow["sizes"] == [4, 8, 16], (fast, slow)
    for f, s, b in zip(fast["times"], slow["times"], fast["sizes"]):
        assert s >= 0.005 * b and f < 0.5 * s, (fast, slow)
    return {"fast_ms": [round(1e3 * t, 2) for t in fast["times"]],
            "slow_ms": [round(1e3 * t, 2) for t in slow["times"]]}


def delayed_worker(rank, world, device):
    """DelayedSync (deterministic mode) on ``device``: the update must not depend on the device."""
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 4).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ds = hetlb.DelayedSync(net, opt, reference_batch=4, batches_per_iteration=2)
    for j in range(12):
        g = torch.Generator().manual_seed(100 * rank + j)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        torch.nn.functional.mse_loss(net(x.to(device)), y.to(device)).backward()
        ds.step()
    ds.flush()
    return {"x": [p.detach().cpu().reshape(-1).tolist() for p in net.parameters()], "updates": ds.updates}


def check_delayed_cuda():
    cuda = unwrap(run(delayed_worker, 2, "cuda", timeout=300))
    cpu = unwrap(run(delayed_worker, 2, "cpu", timeout=300))
    for a, b in zip(cuda, cpu):
        assert a["updates"] == b["updates"]
        for p, q in zip(a["x"], b["x"]):
            np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6)
    return {"updates": cuda[0]["updates"]}


def check_profile_oom():
    free, total = torch.cuda.mem_get_info()
    chunk = max(int(free // 40), 1 << 20)  # bytes per sample: fits up to ~32 samples

    def step(b):
        t = torch.empty(b * chunk, dtype=torch.uint8, device="cuda")
        t.fill_(1)
        torch.cuda.synchronize()

    p = hetlb.profile(step, repeats=1, trim=0, warmup=0, device="cuda")
    torch.cuda.synchronize()
    after = torch.cuda.mem_get_info()[0]
    assert p.oom_at is not None and p.limit < p.oom_at, p
    assert after > free * 0.9, (free, after)
    return {"limit": p.limit, "oom_at": p.oom_at}


def check_probe():
    from hetlb.comm.probes import Probe
    probe = Probe(torch.device("cuda", 0), interval=0.0)
    before = probe.memory()
    block = torch.empty(int(torch.cuda.mem_get_info()[1] * 0.2), dtype=torch.uint8, device="cuda")
    during = probe.memory()
    del block
    torch.cuda.empty_cache()
    assert 0 <= before < during <= 1 and during - before > 0.15, (before, during)
    return {"before": before, "during": during}


def main() -> int:
    checks = {
        "nccl_premul": lambda: unwrap(run(nccl_premul_worker, 1, backend="nccl", timeout=300))[0],
        "nccl_balancer": lambda: unwrap(run(nccl_balancer_worker, 1, backend="nccl", timeout=300))[0],
        "nccl_balancer (clock lag 2)": lambda: unwrap(run(nccl_balancer_worker, 1, 2, backend="nccl",
                                                          timeout=300))[0],
        "nccl_balancer (two backward passes a step)": check_two_backward,
        "gloo_cuda (native)": lambda: _gloo(True),
        "gloo_cuda (reference)": lambda: _gloo(False),
        "gloo_cuda (bal.backward)": lambda: _gloo(True, True),
        "logged_loss (cuda, one step late)": lambda: unwrap(run(logged_loss_worker, 2, timeout=300))[0],
        "delayed_sync (gloo, cuda tensors)": check_delayed_cuda,
        "fsdp2 (nccl, micro-steps)": lambda: unwrap(run(fsdp2_worker, 1, backend="nccl", timeout=300))[0],
        "fsdp2_micro_memory (nccl)": lambda: unwrap(run(fsdp2_micro_memory_worker, 1, backend="nccl",
                                                        timeout=300))[0],
        "fsdp2_clock (gloo, cuda tensors, 1:2:6)": check_fsdp2_clock,
        "fsdp2_profile (gloo, cuda tensors)": check_fsdp2_profile,
        "profile_oom": check_profile_oom,
        "probe": check_probe,
    }
    only = sys.argv[1:]  # names (prefixes) of the checks to run; default: all
    failures = 0
    for name, fn in checks.items():
        if only and not any(name.startswith(o) for o in only):
            continue
        try:
            detail = fn()
            print(f"PASS {name}: {detail}", flush=True)
        except Exception as e:  # noqa: BLE001 (every check reports)
            failures += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}\n{traceback.format_exc()}", flush=True)
    return failures


def check_two_backward():
    one, two = (unwrap(run(nccl_balancer_worker, 1, 1, passes, backend="nccl", timeout=300))[0]
                for passes in (1, 2))
    ratio = two["compute_ms"] / one["compute_ms"]
    # before the end event moved, a second backward kept the first one's end: ratio about 1
    assert ratio > 1.3, (one, two)
    return {"one_ms": one["compute_ms"], "two_ms": two["compute_ms"], "ratio": round(ratio, 2)}


def _gloo(native: bool, bal_backward: bool = False):
    res = unwrap(run(gloo_cuda_worker, 2, native, bal_backward, timeout=300))
    assert all(r["err"] < 1e-12 for r in res), res
    return res[0]


if __name__ == "__main__":
    sys.exit(main())
