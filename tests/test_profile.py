"""Profiling phase (LBB Algorithm 1): timing, trimming, out-of-memory limits, fitting, JSON."""
import gc
import sys
import time
import weakref

import numpy as np
import pytest
import torch

from hetlb.core.models import LinearModel, PiecewiseModel, PolyModel
from hetlb.train.profile import Profile, profile


class VirtualClock:
    """Stands for the ``time`` module in :mod:`hetlb.train.profile`: its ``perf_counter`` reads
    a clock that only the test's step advances, so the timings are exact on a busy machine."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    c = VirtualClock()
    monkeypatch.setattr("hetlb.train.profile.time", c)
    return c


def test_linear_step_recovers_coefficients(clock):
    a0, a1 = 0.002, 0.0002
    calls = []

    def step(b):
        calls.append(b)
        clock.advance(a0 + a1 * b)

    p = profile(step, batch_sizes=[32, 2, 8, 16, 4], repeats=5, trim=1, warmup=1)
    assert p.batch_sizes == [2, 4, 8, 16, 32]
    assert calls == [b for b in p.batch_sizes for _ in range(6)]
    assert p.limit == 32 and p.oom_at is None and p.device == "cpu"
    assert len(p.samples) == 5 and all(len(s) == 5 for s in p.samples)
    m = p.fit("linear")
    assert isinstance(m, LinearModel)
    assert m.a1 == pytest.approx(a1, rel=1e-6)
    assert m.a0 == pytest.approx(a0, rel=1e-6)
    np.testing.assert_allclose(p.times, [a0 + a1 * b for b in p.batch_sizes], rtol=1e-9)
    assert p.times == sorted(p.times)


def test_default_sizes_powers_of_two_up_to_max_batch():
    seen = []
    p = profile(lambda b: seen.append(b), repeats=1, trim=0, warmup=0, max_batch=100)
    assert p.batch_sizes == [2, 4, 8, 16, 32, 64]
    assert seen == [2, 4, 8, 16, 32, 64]
    assert p.limit == 64 and p.oom_at is None


@pytest.fixture
def one_thread():
    """Intra-op threads stall for a scheduler slice whenever another process holds a core of a
    small box; one thread keeps the measured time the model's."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_real_torch_model(one_thread):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    data = torch.randn(4096, 256)

    def step(b):
        net.zero_grad()
        net(data[:b]).square().mean().backward()

    p = profile(step, repeats=5, trim=2, max_batch=4096)
    assert p.batch_sizes == [2 ** k for k in range(1, 13)]
    assert all(t > 0 for t in p.times)
    # the fastest sample is robust to interference from other processes on a shared box
    assert min(p.samples[-1]) > 2 * min(p.samples[0])
    cubic = p.fit()
    assert isinstance(cubic, PolyModel) and cubic.coeffs.size == 4
    assert np.all(np.isfinite(cubic.time(p.batch_sizes)))


def test_cuda_oom_sets_limit_and_releases():
    refs = []

    class Cycle:
        def __init__(self):
            self.me = self  # only the garbage collector frees this

    def step(b):
        if b >= 64:
            held = Cycle()
            held.tensor = torch.ones(1000)
            refs.append(weakref.ref(held))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    gc.disable()  # only profile's own collection may free the cycle
    try:
        p = profile(step, repeats=2, trim=0, warmup=1)
        assert len(refs) == 1 and refs[0]() is None
    finally:
        gc.enable()
    assert p.limit == 32 and p.oom_at == 64
    assert p.batch_sizes == [2, 4, 8, 16, 32]


def _cpu_allocator_failure() -> RuntimeError:
    """The RuntimeError torch's CPU allocator raises, as it reads. Taken in a child process: a
    failed huge allocation here skews this process's later peak-memory readings."""
    import subprocess
    out = subprocess.run([sys.executable, "-c", "import torch\ntry:\n torch.empty(1 << 62, "
                          "dtype=torch.uint8)\nexcept RuntimeError as e:\n print(e)"],
                         capture_output=True, text=True, timeout=120).stdout.strip()
    assert "DefaultCPUAllocator" in out, out
    return RuntimeError(out)


@pytest.mark.parametrize("exc", [RuntimeError("CUDA error: out of memory"), MemoryError(), "cpu"])
def test_other_oom_forms(exc):
    # torch's CPU allocator failure used to abort the profile with a traceback.
    exc = _cpu_allocator_failure() if exc == "cpu" else exc

    def step(b):
        if b > 8:
            raise exc

    p = profile(step, repeats=1, trim=0)
    assert p.limit == 8 and p.oom_at == 16


def test_oom_in_a_timed_repeat_counts():
    count = {}

    def step(b):
        count[b] = count.get(b, 0) + 1
        if b == 16 and count[b] == 3:  # warm-up and first timed call fit, the second does not
            raise torch.OutOfMemoryError("out of memory")

    p = profile(step, repeats=3, trim=0, warmup=1)
    assert p.limit == 8 and p.oom_at == 16


def test_other_errors_propagate():
    def step(b):
        if b == 4:
            raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        profile(step, repeats=1, trim=0)


@pytest.mark.parametrize("probe", ["hwm", "sampled"])
def test_memory_limit_bytes(probe, monkeypatch):
    if probe == "sampled":  # the portable fallback: an RSS sampler thread
        from hetlb.train.memory_peak import ProcHWMPeak
        monkeypatch.setattr(ProcHWMPeak, "available", staticmethod(lambda: False))
    mib = 2 ** 20

    def step(b):
        x = torch.ones(b * mib // 4)  # b MiB, pages touched
        time.sleep(0.005)  # held a while, as activations are, so a 1 ms sampler sees it
        return float(x[-1])

    p = profile(step, repeats=1, trim=0, warmup=1, memory_limit=40 * mib, max_batch=1024)
    assert p.limit == 32 and p.oom_at == 64
    assert p.memory[-1] is not None and 31 * mib <= p.memory[-1] <= 40 * mib


def test_nothing_fits():
    def step(b):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(ValueError, match=r"first batch size 2 .*OutOfMemoryError"):
        profile(step, repeats=1, trim=0)
    with pytest.raises(ValueError, match=r"first batch size 4 .*memory_limit"):
        profile(lambda b: torch.ones(b * 2 ** 18).sum(), batch_sizes=[4, 8], repeats=1, trim=0,
                memory_limit=2 ** 20)


def test_trim_drops_injected_outliers(clock):
    base, slow = 0.002, 0.04

    def make_step():
        count = {}

        def step(b):
            count[b] = count.get(b, 0) + 1
            clock.advance(slow if count[b] in (2, 5) else base)  # two of six timed calls are disturbed

        return step

    p = profile(make_step(), batch_sizes=[2, 4], repeats=6, trim=2, warmup=0)
    for t, samples in zip(p.times, p.samples):
        assert sum(s > slow * 0.9 for s in samples) == 2
        assert t == pytest.approx(base, rel=1e-9)
    untrimmed = profile(make_step(), batch_sizes=[2], repeats=6, trim=0, warmup=0)
    assert untrimmed.times[0] == pytest.approx((4 * base + 2 * slow) / 6, rel=1e-9)


def test_save_load_roundtrip(tmp_path):
    p = Profile(batch_sizes=[2, 4, 8, 16], times=[0.01, 0.012, 0.02, 0.035], limit=16, device="cuda:1",
                repeats=5, trim=1, warmup=2, oom_at=32, samples=[[0.01] * 5] * 4,
                memory=[100, 200, None, 800])
    path = tmp_path / "prof.json"
    p.save(path)
    q = Profile.load(path)
    assert q == p
    assert Profile.from_dict(p.to_dict()) == p
    for kind, cls in (("cubic", PolyModel), ("linear", LinearModel), ("piecewise", PiecewiseModel)):
        a, b = p.fit(kind), q.fit(kind)
        assert isinstance(a, cls) and a == b
    with pytest.raises(ValueError, match="unknown model kind"):
        p.fit("quartic")
    with pytest.raises(ValueError, match="unknown profile fields"):
        Profile.from_dict({**p.to_dict(), "bogus": 1})


def test_fit_degree_drops_with_few_points():
    p = Profile(batch_sizes=[2, 4], times=[1.0, 2.0], limit=4)
    m = p.fit("cubic")
    assert m.coeffs.size == 2 and float(m.time(8)) == pytest.approx(4.0)
    one = Profile(batch_sizes=[2], times=[1.0], limit=2)
    assert float(one.fit().time(2)) == pytest.approx(1.0)


@pytest.mark.parametrize("kw, match", [
    (dict(repeats=0), "repeats"),
    (dict(repeats=3, trim=3), "trim"),
    (dict(trim=-1), "trim"),
    (dict(warmup=-1), "warmup"),
    (dict(batch_sizes=[]), "empty"),
    (dict(batch_sizes=[0, 2]), "positive"),
    (dict(batch_sizes=[2.5]), "integer"),
    (dict(batch_sizes=[True]), "integer"),
    (dict(memory_limit=0), "memory_limit"),
    (dict(memory_limit=float("nan")), "memory_limit"),
    (dict(max_batch=1), "max_batch"),
    (dict(batch_sizes=[64], max_batch=32), "max_batch"),
    pytest.param(dict(device="cuda"), "CUDA is not available",  # (an AssertionError before)
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")),
])
def test_bad_args(kw, match):
    calls = []
    with pytest.raises(ValueError, match=match):
        profile(calls.append, **kw)
    assert calls == []


def test_balancer_caps_the_batch_only_at_a_real_memory_bound():
    # profile(step_fn, max_batch=8) on CPU: nothing ran out of memory, so limit 8 is only the
    # largest size tried; it must not cap a global batch of 64.
    import hetlb
    tried = profile(lambda b: torch.ones(b).sum(), max_batch=8, repeats=1, trim=0)
    assert tried.limit == 8 and tried.oom_at is None
    bal = hetlb.Balancer(torch.nn.Linear(1, 1), 64, profile=tried)
    assert bal.context.upper.tolist() == [64] and bal.batch_sizes.tolist() == [64]
    # A real out-of-memory bound does cap it.
    def step(b):
        if b > 16:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    bound = profile(step, repeats=1, trim=0)
    assert bound.limit == 16 and bound.oom_at == 32
    with pytest.raises(ValueError, match="exceeds the sum of upper bounds 16 .*a profile's limit"):
        hetlb.Balancer(torch.nn.Linear(1, 1), 64, profile=bound)
    assert hetlb.Balancer(torch.nn.Linear(1, 1), 16, profile=bound).context.upper.tolist() == [16]


def test_the_cache_keeps_one_profile_per_host_and_settings(tmp_path, caplog):
    # A restarted job (another attempt, maybe another number of workers) reuses this host's
    # profile instead of measuring again; other settings, or a damaged file, measure again.
    calls = []

    def step(b):
        calls.append(b)

    first = profile(step, [2, 4], repeats=2, trim=0, warmup=0, cache=tmp_path / "c")
    assert calls == [2, 2, 4, 4]
    files = list((tmp_path / "c").iterdir())
    assert len(files) == 1 and files[0].name.startswith(__import__("socket").gethostname() + "-cpu-")
    again = profile(step, [2, 4], repeats=2, trim=0, warmup=0, cache=tmp_path / "c")
    assert calls == [2, 2, 4, 4] and again.times == first.times and again.batch_sizes == [2, 4]
    profile(step, [2, 4, 8], repeats=2, trim=0, warmup=0, cache=tmp_path / "c")
    assert calls[4:] == [2, 2, 4, 4, 8, 8] and len(list((tmp_path / "c").iterdir())) == 2
    files[0].write_text('{"version": ')  # torn
    with caplog.at_level("WARNING", logger="hetlb"):
        redo = profile(step, [2, 4], repeats=2, trim=0, warmup=0, cache=tmp_path / "c")
    assert calls[10:] == [2, 2, 4, 4] and "unusable" in caplog.text and redo.batch_sizes == [2, 4]
    assert Profile.load(files[0]).batch_sizes == [2, 4]  # rewritten whole
    with pytest.raises(TypeError, match="cache must be a directory path"):
        profile(step, [2], cache=3)
