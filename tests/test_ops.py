"""torch.ops.hetlb tensor kernels against the plain references in hetlb/reference.py.

Grid over devices (cpu, plus cuda when available) and the four floating dtypes, in the style of
pytorch_scatter's tests. Tolerances are per dtype: the kernels compute in float32 (float64 for
float64) like the references, so differences come only from operation order and rounding.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetlb import ops
from hetlb.reference import ref_delay_compensate_, ref_flatten_scaled, ref_scale_, ref_unflatten_

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
GRID = list(itertools.product(DTYPES, DEVICES))
IDS = [f"{str(d).split('.')[-1]}-{dev}" for d, dev in GRID]
TOL = {
    torch.float32: dict(rtol=1e-6, atol=1e-6),
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    # One rounding of the float32 result into the storage type; allow one ulp.
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=8e-3, atol=8e-3),
}

# Odd sizes hit the vector tails; 70_000 spans several parallel_for grains (32K) and CUDA tiles.
SHAPES = [(), (1,), (7,), (33,), (0,), (3, 5), (4, 0, 2), (70_000,), (17, 129)]


def rand(shape, dtype, device, gen=None):
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


def close(a, b, dtype):
    torch.testing.assert_close(a, b, **TOL[dtype])


def make_list(dtype, device, shapes=SHAPES):
    return [rand(s, dtype, device) for s in shapes]


# ---- scale_ ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,device", GRID, ids=IDS)
def test_scale(dtype, device):
    ts = make_list(dtype, device)
    ref = [t.clone() for t in ts]
    ops.scale_(ts, 0.37)
    ref_scale_(ref, 0.37)
    for a, b in zip(ts, ref):
        close(a, b, dtype)


@pytest.mark.parametrize("dtype,device", GRID, ids=IDS)
def test_scale_noncontiguous(dtype, device):
    base = rand((40, 30), dtype, device)
    big = rand((64, 64), dtype, device)
    # transposed, strided slice, expanded-free column, and a contiguous neighbour in one list
    ts = [base.t(), big[::2, 1::3], big[:, 5], rand((9,), dtype, device)]
    ref = [t.clone() for t in ts]
    ops.scale_(ts, -2.5)
    ref_scale_(ref, -2.5)
    for a, b in zip(ts, ref):
        close(a, b, dtype)
    # the write went through the views into their bases
    close(base.t(), ref[0], dtype)
    close(big[::2, 1::3], ref[1], dtype)


def test_scale_empty_list_is_noop():
    ops.scale_([], 3.0)


@pytest.mark.parametrize("device", DEVICES)
def test_scale_many_small_tensors(device):
    # Many tiny tensors whose segments straddle parallel chunks (CPU) and span 9 launches (CUDA: 48
    # segments a launch).
    ts = [torch.randn(n, device=device) for n in range(1, 400)] + [torch.randn(100_000, device=device)]
    ref = [t.clone() for t in ts]
    ops.scale_(ts, 1.5)
    ref_scale_(ref, 1.5)
    for a, b in zip(ts, ref):
        assert torch.equal(a, b)


# ---- flatten_scaled ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,device", GRID, ids=IDS)
@pytest.mark.parametrize("extra_dtype", [None, torch.float32, torch.int64])
def test_flatten_scaled(dtype, device, extra_dtype):
    ts = make_list(dtype, device)
    extra = None
    if extra_dtype is not None:
        extra = torch.arange(5, device=device).to(extra_dtype)
    out = ops.flatten_scaled(ts, 0.25, extra)
    ref = ref_flatten_scaled(ts, 0.25, extra)
    assert out.dtype == dtype and out.device.type == device and out.dim() == 1
    assert out.numel() == sum(t.numel() for t in ts) + (5 if extra is not None else 0)
    close(out, ref, dtype)


@pytest.mark.parametrize("dtype,device", GRID, ids=IDS)
def test_flatten_scaled_noncontiguous(dtype, device):
    a = rand((20, 12), dtype, device)
    ts = [a.t(), a[1::3, ::2], rand((5,), dtype, device)]
    extra = rand((10,), torch.float32, device)[::2]  # 1-D, strided
    close(ops.flatten_scaled(ts, 3.0, extra), ref_flatten_scaled(ts, 3.0, extra), dtype)


def test_flatten_scaled_empty_list():
    out = ops.flatten_scaled([], 2.0)
    assert out.shape == (0,) and out.dtype == torch.float32
    extra = torch.tensor([1.0, 2.0], dtype=torch.float64)
    out = ops.flatten_scaled([], 2.0, extra)
    assert torch.equal(out, extra) and out.data_ptr() != extra.data_ptr()  # unscaled, a copy


# ---- unflatten_ --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,device", GRID, ids=IDS)
def test_unflatten(dtype, device):
    ts = make_list(dtype, device)
    total = sum(t.numel() for t in ts)
    flat = rand((total + 11,), dtype, device)  # a longer tail is ignored
    ref = [t.clone() for t in ts]
    ops.unflatten_(flat, ts, 0.5)
    ref_unflatten_(flat, ref, 0.5)
    for a, b in zip(ts, ref):
        close(a, b, dtype)


@pytest.mark.parametrize("dtype,device", GRID, ids=IDS)
def test_unflatten_noncontiguous(dtype, device):
    a, b = rand((16, 24), dtype, device), rand((16, 24), dtype, device)
    ts = [a.t(), b[::3, 1::2], rand((3, 3), dtype, device)]  # distinct bases: no overlap
    total = sum(t.numel() for t in ts)
    flat = rand((2 * total,), dtype, device)[::2]  # strided flat as well
    ref = [t.clone() for t in ts]
    ops.unflatten_(flat, ts, -1.25)
    ref_unflatten_(flat, ref, -1.25)
    for x, y in zip(ts, ref):
        close(x, y, dtype)
    close(b[::3, 1::2], ref[1], dtype)


@pytest.mark.parametrize("dtype,device", GRID, ids=IDS)
def test_flatten_unflatten_roundtrip(dtype, device):
    ts = make_list(dtype, device)
    flat = ops.flatten_scaled(ts, 2.0, torch.ones(3, device=device))
    back = [torch.empty_like(t) for t in ts]
    ops.unflatten_(flat, back, 0.5)
    for a, b in zip(ts, back):
        assert torch.equal(a, b)  # scaling by powers of two is exact


# ---- delay_compensate_ ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,device", GRID, ids=IDS)
@pytest.mark.parametrize("shape", [(), (1,), (7,), (33,), (0,), (130, 517)])
def test_delay_compensate(dtype, device, shape):
    g, p, q = (rand(shape, dtype, device) for _ in range(3))
    ref = g.clone()
    ops.delay_compensate_(g, p, q, 0.3)
    ref_delay_compensate_(ref, p, q, 0.3)
    close(g, ref, dtype)


@pytest.mark.parametrize("dtype,device", GRID, ids=IDS)
def test_delay_compensate_noncontiguous(dtype, device):
    gb = rand((30, 40), dtype, device)
    g = gb.t()
    p = rand((40, 30), dtype, device)
    q = rand((80, 30), dtype, device)[::2]
    ref = g.clone()
    ops.delay_compensate_(g, p, q, 0.7)
    ref_delay_compensate_(ref, p, q, 0.7)
    close(gb.t(), ref, dtype)


@pytest.mark.parametrize("dtype,device", GRID, ids=IDS)
def test_delay_compensate_lists(dtype, device):
    # 80 tensors: more than one CUDA launch (36 a launch), with empty and non-contiguous ones
    gen = torch.Generator().manual_seed(3)
    shapes = [(int(torch.randint(0, 300, (1,), generator=gen)),) for _ in range(77)] + [(0,), (5, 0), (70_000,)]
    grads = [rand(s, dtype, device, gen) for s in shapes]
    params = [rand(s, dtype, device, gen) for s in shapes]
    prevs = [rand(s, dtype, device, gen) for s in shapes]
    base = rand((40, 30), dtype, device, gen)
    grads.append(base.t())  # non-contiguous, written back
    params.append(rand((30, 40), dtype, device, gen))
    prevs.append(rand((60, 40), dtype, device, gen)[::2])
    refs = [g.clone() for g in grads]
    ops.delay_compensate_(grads, params, prevs, 0.4)
    for r, p, q in zip(refs, params, prevs):
        ref_delay_compensate_(r, p, q, 0.4)
    for g, r in zip(grads, refs):
        close(g, r, dtype)
    close(base.t(), refs[-1], dtype)


def test_delay_compensate_lists_same_as_one_by_one():
    # the list form is the per-tensor op applied position by position, bit for bit
    gen = torch.Generator().manual_seed(4)
    shapes = [(3, 4), (0,), (1000,), (17,)]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    params = [torch.randn(s, generator=gen) for s in shapes]
    prevs = [torch.randn(s, generator=gen) for s in shapes]
    each = [g.clone() for g in grads]
    ops.delay_compensate_(grads, params, prevs, 0.25)
    for g, p, q in zip(each, params, prevs):
        ops.delay_compensate_(g, p, q, 0.25)
    assert all(torch.equal(a, b) for a, b in zip(grads, each))
    ops.delay_compensate_([], [], [], 0.25)  # no-op


def test_delay_compensate_float32_matches_eager_bitwise():
    # Same evaluation order as the eager formula, no FMA contraction (-ffp-contract=off).
    g, p, q = (torch.randn(100_003) for _ in range(3))
    expected = g + 0.3 * g * g * (p - q)
    ops.delay_compensate_(g, p, q, 0.3)
    torch.testing.assert_close(g, expected, rtol=1e-6, atol=1e-7)


# ---- hypothesis: random lists and shapes ------------------------------------------------------

shape_st = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
shapes_st = st.lists(shape_st, min_size=1, max_size=8)
weight_st = st.floats(-4.0, 4.0, allow_nan=False)


@settings(max_examples=40, deadline=None)
@given(shapes=shapes_st, w=weight_st, dtype=st.sampled_from(DTYPES), n_extra=st.integers(0, 3))
def test_hypothesis_flatten_unflatten_scale(shapes, w, dtype, n_extra):
    ts = [rand(s, dtype, "cpu") for s in shapes]
    extra = torch.randn(n_extra) if n_extra else None
    close(ops.flatten_scaled(ts, w, extra), ref_flatten_scaled(ts, w, extra), dtype)

    a, b = [t.clone() for t in ts], [t.clone() for t in ts]
    ops.scale_(a, w)
    ref_scale_(b, w)
    for x, y in zip(a, b):
        close(x, y, dtype)

    flat = rand((sum(t.numel() for t in ts) + n_extra,), dtype, "cpu")
    a, b = [torch.zeros_like(t) for t in ts], [torch.zeros_like(t) for t in ts]
    ops.unflatten_(flat, a, w)
    ref_unflatten_(flat, b, w)
    for x, y in zip(a, b):
        close(x, y, dtype)


@settings(max_examples=30, deadline=None)
@given(shapes=shapes_st, lam=weight_st, dtype=st.sampled_from(DTYPES),
       transpose=st.lists(st.booleans(), min_size=8, max_size=8))
def test_hypothesis_delay_compensate_lists(shapes, lam, dtype, transpose):
    grads, params, prevs = ([rand(s, dtype, "cpu") for s in shapes] for _ in range(3))
    for i, t in enumerate(transpose[:len(shapes)]):
        if t and grads[i].dim() >= 2:
            grads[i], prevs[i] = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (grads[i], prevs[i]))
    refs = [g.clone() for g in grads]
    ops.delay_compensate_(grads, params, prevs, lam)
    for r, p, q in zip(refs, params, prevs):
        ref_delay_compensate_(r, p, q, lam)
    for g, r in zip(grads, refs):
        close(g, r, dtype)


@settings(max_examples=30, deadline=None)
@given(shape=shape_st, lam=weight_st, dtype=st.sampled_from(DTYPES), transpose=st.booleans())
def test_hypothesis_delay_compensate(shape, lam, dtype, transpose):
    g, p, q = (rand(shape, dtype, "cpu") for _ in range(3))
    if transpose and g.dim() >= 2:
        # same shapes, column-major storage: exercises the non-contiguous path
        g, p = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (g, p))
    ref = g.clone()
    ops.delay_compensate_(g, p, q, lam)
    ref_delay_compensate_(ref, p, q, lam)
    close(g, ref, dtype)


# ---- errors ------------------------------------------------------------------------------------


def test_error_mixed_dtypes():
    with pytest.raises(RuntimeError, match=r"tensors\[0\] is Float\[2\].*tensors\[1\] is Double\[3\]"):
        ops.scale_([torch.zeros(2), torch.zeros(3, dtype=torch.float64)], 1.0)
    with pytest.raises(RuntimeError, match="share dtype and device"):
        ops.flatten_scaled([torch.zeros(2), torch.zeros(2, dtype=torch.half)], 1.0)
    with pytest.raises(RuntimeError, match=r"flat is Float.*tensors\[0\] is BFloat16"):
        ops.unflatten_(torch.zeros(4), [torch.zeros(2, dtype=torch.bfloat16)], 1.0)
    with pytest.raises(RuntimeError, match=r"grads\[0\] is Float.*params\[0\] is Double"):
        ops.delay_compensate_(torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.zeros(2), 1.0)
    with pytest.raises(RuntimeError, match=r"grads\[0\] is Float\[2\].*grads\[1\] is Half"):
        ops.delay_compensate_([torch.zeros(2), torch.zeros(2, dtype=torch.half)], [torch.zeros(2)] * 2,
                              [torch.zeros(2)] * 2, 1.0)


def test_error_unsupported_dtype():
    with pytest.raises(RuntimeError, match=r"must be float32, float64, float16 or bfloat16, got Long"):
        ops.scale_([torch.zeros(2, dtype=torch.int64)], 2.0)


def test_error_shape_mismatch():
    with pytest.raises(RuntimeError, match=r"same shape.*grads\[0\] Float\[2, 3\].*params\[0\] Float\[3, 2\]"):
        ops.delay_compensate_(torch.zeros(2, 3), torch.zeros(3, 2), torch.zeros(2, 3), 0.1)
    with pytest.raises(RuntimeError, match=r"prev_params\[1\] Float\[4\]"):
        ops.delay_compensate_([torch.zeros(2), torch.zeros(3)], [torch.zeros(2), torch.zeros(3)],
                              [torch.zeros(2), torch.zeros(4)], 0.1)


def test_error_delay_compensate_lists():
    with pytest.raises(RuntimeError, match="same length, got 2, 1 and 2"):
        ops.delay_compensate_([torch.zeros(2)] * 2, [torch.zeros(2)], [torch.zeros(2)] * 2, 0.1)
    with pytest.raises(TypeError, match="all as tensors or all as lists, got Tensor, list, Tensor"):
        ops.delay_compensate_(torch.zeros(2), [torch.zeros(2)], torch.zeros(2), 0.1)


def test_error_flat_too_short():
    with pytest.raises(RuntimeError, match="flat has 5 elements but the tensors need 6"):
        ops.unflatten_(torch.zeros(5), [torch.zeros(2), torch.zeros(4)], 1.0)
    with pytest.raises(RuntimeError, match="flat must be 1-D"):
        ops.unflatten_(torch.zeros(2, 3), [torch.zeros(2)], 1.0)


def test_error_extra_not_1d():
    with pytest.raises(RuntimeError, match=r"extra must be 1-D, got Float\[2, 2\]"):
        ops.flatten_scaled([torch.zeros(3)], 1.0, torch.zeros(2, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_error_mixed_devices():
    with pytest.raises(RuntimeError, match="share dtype and device"):
        ops.scale_([torch.zeros(2, device="cuda"), torch.zeros(2)], 1.0)


# ---- opcheck and torch.compile ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    mk = lambda *s: torch.randn(*s).to(dtype)  # noqa: E731
    torch.library.opcheck(torch.ops.hetlb.scale_.default, ([mk(3, 4), mk(5), mk(0)], 0.5))
    torch.library.opcheck(torch.ops.hetlb.flatten_scaled.default, ([mk(3, 4), mk(5)], 0.5, None))
    torch.library.opcheck(torch.ops.hetlb.flatten_scaled.default,
                          ([mk(3, 4), mk(5)], 0.5, torch.arange(3.0)))
    torch.library.opcheck(torch.ops.hetlb.unflatten_.default, (mk(20), [mk(3, 4), mk(5)], 2.0))
    torch.library.opcheck(torch.ops.hetlb.delay_compensate_.default,
                          ([mk(6, 7), mk(5), mk(0)], [mk(6, 7), mk(5), mk(0)], [mk(6, 7), mk(5), mk(0)], 0.3))


def test_torch_compile_fullgraph():
    def step(grads, params, prevs, w):
        ops.delay_compensate_(grads, params, prevs, 0.1)
        ops.scale_(grads, w)
        return ops.flatten_scaled(grads, 1.0, torch.ones(1))

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    mk = lambda: [torch.randn(4, 5), torch.randn(7)]  # noqa: E731
    grads, params, prevs = mk(), mk(), mk()
    g_ref = [g.clone() for g in grads]
    for g, p, q in zip(g_ref, params, prevs):
        ref_delay_compensate_(g, p, q, 0.1)
    ref_scale_(g_ref, 0.5)
    out = compiled(grads, params, prevs, 0.5)
    close(out, ref_flatten_scaled(g_ref, 1.0, torch.ones(1)), torch.float32)
    for a, b in zip(grads, g_ref):
        close(a, b, torch.float32)


# ---- the eager calls (hetlb._C.scale_call, delay_compensate_call) --------------------------------


class _Counted(torch.Tensor):
    """A subclass that takes part in __torch_function__: its calls must reach torch.ops."""

    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


class _Recorder(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_eager_calls_run_the_op_with_plain_tensors_and_parameters():
    # The direct call runs the same op: the results are the references', lists in order.
    grads = make_list(torch.float32, "cpu")
    params = [torch.nn.Parameter(rand(s, torch.float32, "cpu")) for s in SHAPES]
    prevs = make_list(torch.float32, "cpu")
    want = [g.clone() for g in grads]
    for g, p, q in zip(want, params, prevs):
        ref_delay_compensate_(g, p.detach(), q, 0.3)
    ref_scale_(want, -0.7)
    from hetlb import _C
    assert _C.delay_compensate_call(grads, params, prevs, 0.3) is True
    assert _C.scale_call(grads, -0.7) is True
    for a, b in zip(grads, want):
        close(a, b, torch.float32)


def test_eager_calls_leave_subclasses_and_modes_to_torch_ops():
    from hetlb import _C
    t = torch.ones(3).as_subclass(_Counted)
    _Counted.seen.clear()
    assert _C.scale_call([torch.ones(2), t], 2.0) is False  # nothing run
    assert torch.equal(t.as_subclass(torch.Tensor), torch.ones(3))
    ops.scale_([t], 2.0)
    assert torch.ops.hetlb.scale_.default in _Counted.seen
    assert torch.equal(t.as_subclass(torch.Tensor), torch.full((3,), 2.0))
    g, p, q = torch.ones(2), torch.ones(2), torch.zeros(2)
    with _Recorder() as mode:
        assert _C.delay_compensate_call([g], [p], [q], 1.0) is False
        ops.delay_compensate_([g], [p], [q], 1.0)
        ops.scale_([g], 3.0)
    assert mode.seen == [torch.ops.hetlb.delay_compensate_.default, torch.ops.hetlb.scale_.default]
    assert torch.equal(g, torch.full((2,), 6.0))  # (1 + 1 * 1 * 1 * 1) * 3


def test_eager_calls_leave_a_non_tensor_to_torch_ops():
    from hetlb import _C
    assert _C.scale_call([torch.ones(2), 1.0], 2.0) is False
    assert _C.delay_compensate_call([torch.ones(2)], [torch.ones(2)], ["x"], 2.0) is False
    with pytest.raises(RuntimeError, match=r"Expected a value of type 'List\[Tensor\]'"):
        ops.scale_([torch.ones(2), 1.0], 2.0)


def test_eager_calls_raise_torch_errors_without_the_cpp_backtrace():
    from hetlb import _C
    with pytest.raises(RuntimeError) as e:
        _C.scale_call([torch.zeros(2), torch.zeros(3, dtype=torch.float64)], 1.0)
    assert "tensors[1] is Double[3]" in str(e.value) and "Exception raised from" not in str(e.value)
