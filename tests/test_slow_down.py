"""hetlb.sim.slow_down: emulated speeds for a plain DDP loop (no Balancer), on real Gloo ranks."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hetlb  # noqa: F401  (spawned workers import it before init_process_group)
from distributed import run, unwrap
from hetlb.core.models import LinearModel
from hetlb.sim.emulate import Disturbance, Emulator
from hetlb.sim import SlowedSteps, slow_down

SPEEDS = [1.0, 0.25]
MODEL = LinearModel(0.01, 0.004)  # seconds at b samples, before the speed


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1)).double()


def _data(rank, step, n):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randn(n, 1, generator=g, dtype=torch.float64)


def _steps(ddp, opt, rank, sizes, times=None):
    for step, n in enumerate(sizes):
        x, y = _data(rank, step, n)
        dist.barrier()
        t = time.perf_counter()  # (CLOCK_MONOTONIC: one clock for every process of the machine)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        if times is not None:
            times.append((t, time.perf_counter()))
        opt.step()
        opt.zero_grad()


def _slowed(rank, world):
    sizes = [10, 30, 20]
    plain = DDP(_net())
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    _steps(plain, opt, rank, sizes)
    ddp = DDP(_net())
    emu = Emulator.for_rank(rank, SPEEDS, model=MODEL)
    held = slow_down(ddp, emu, amount=lambda args, kwargs: len(args[0]))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    times = []
    _steps(ddp, opt, rank, sizes, times)
    same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), ddp.parameters()))
    errors = {}
    try:
        slow_down(ddp, Emulator(speed=0.5))
    except RuntimeError as e:
        errors["twice"] = str(e)
    other = DDP(_net())
    for name, emulator, kw in [
            ("fail", Emulator(disturbances=[Disturbance(0, 1, fail=True)]), {}),
            ("bandwidth", Emulator(bandwidth=1e6), {}),
            ("amount", Emulator(MODEL), {}),
            ("first_step", Emulator(), {"first_step": -1})]:
        try:
            slow_down(other, emulator, **kw)
        except ValueError as e:
            errors[name] = str(e)
    return {"records": held.records, "steps": held.steps, "times": times, "same": same,
            "errors": errors}


def test_a_plain_ddp_loop_runs_at_the_emulated_speeds_with_ddp_s_gradient():
    out = unwrap(run(_slowed, 2, timeout=120))
    sizes = [10, 30, 20]
    for rank, r in enumerate(out):
        assert r["same"]  # DDP's mean (2 ranks, float64: to the bit here)
        assert r["steps"] == 3
        emu = Emulator.for_rank(rank, SPEEDS, model=MODEL)
        for step, ((measured, held), b) in enumerate(zip(r["records"], sizes)):
            assert held == max(emu.target(step, b), measured)  # the time model at the step's samples
    slow = [held for _, held in out[1]["records"]]
    # The fast rank's backward ends only once the slow rank's hold released the last bucket, the
    # slow rank's emulated time after its forward began: the fast one waits in the all-reduce.
    for (_, fast_end), (slow_start, _), held in zip(out[0]["times"], out[1]["times"], slow):
        assert fast_end >= slow_start + held, (out[0]["times"], out[1]["times"], slow)
    errors = out[0]["errors"]
    assert "has one already" in errors["twice"] and "Balancer(emulator=)" in errors["twice"]
    assert "fail=True" in errors["fail"] and "bandwidth" in errors["bandwidth"]
    assert "amount=" in errors["amount"] and "first_step" in errors["first_step"]


QUADRATIC = dict(model=LinearModel(0.0, 0.002), by="data", quadratic=0.5)


def _window(rank, world):
    ddp = DDP(_net())
    emu = Emulator.for_rank(rank, [1.0, 0.5], **QUADRATIC)
    held = slow_down(ddp, emu, amount=lambda args, kwargs: (len(args[0]), 2 * len(args[0])),
                     first_step=5)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with torch.no_grad():  # an evaluation forward opens no step
        ddp(torch.zeros(3, 5, dtype=torch.float64))
    ddp(torch.zeros(7, 5, dtype=torch.float64))  # a loss never backpropagated: dropped below
    time.sleep(1.0)
    x, y = _data(rank, 9, 6)
    torch.nn.functional.mse_loss(ddp(x), y).backward()  # step 5: its own 6 samples, timed from its forward
    opt.step()
    opt.zero_grad()
    for micro, n in enumerate([4, 6, 5]):  # step 6: one window
        x, y = _data(rank, micro, n)
        if micro < 2:
            with ddp.no_sync():
                torch.nn.functional.mse_loss(ddp(x), y).backward()
        else:
            torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    return {"records": held.records, "steps": held.steps}


def test_an_accumulation_window_is_one_emulated_step_and_evaluation_starts_none():
    out = unwrap(run(_window, 2, timeout=120))
    for rank, r in enumerate(out):
        assert r["steps"] == 2 and len(r["records"]) == 2, r
        emu = Emulator.for_rank(rank, [1.0, 0.5], **QUADRATIC)
        # samples evaluated at n + 0.5 * 2n, as the Balancer evaluates data and squared sizes
        (measured, held), (window_measured, window_held) = r["records"]
        assert held == max(emu.target(5, 12), measured) and measured < 1.0
        assert window_held == max(emu.target(6, 30), window_measured)  # 15 samples, one step


def test_it_needs_ddp_and_squares_for_a_quadratic_emulator():
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        slow_down(torch.nn.Linear(2, 1), Emulator(speed=0.5))
    steps = SlowedSteps(Emulator(**QUADRATIC), lambda args, kwargs: 3.0, 0, None, cuda=False)
    with pytest.raises(ValueError, match=r"must return \(data, squared sizes\)"):
        steps.forward_starts(torch.nn.Linear(2, 1), (torch.zeros(3, 2),), {})
