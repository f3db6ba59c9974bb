"""hetlb.allocate against the reference, brute force and scipy's MILP; time models; bad input."""
import itertools
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import hetlb
from hetlb import reference as ref
from hetlb.core.solve import allocate_linear



# -- strategies --------------------------------------------------------------------------------

coef = st.floats(0, 10, allow_nan=False, allow_infinity=False)
linear = st.builds(hetlb.LinearModel, coef, coef)
poly = st.lists(st.floats(-3, 3, allow_nan=False), min_size=1, max_size=4).map(hetlb.PolyModel)


@st.composite
def piecewise(draw):
    k = draw(st.integers(1, 4))
    xs = sorted(draw(st.sets(st.integers(1, 40), min_size=k, max_size=k)))
    ts = draw(st.lists(st.floats(0, 20, allow_nan=False), min_size=k, max_size=k))
    return hetlb.PiecewiseModel(xs, ts)


model = st.one_of(linear, poly, piecewise())


@st.composite
def problem(draw, max_n=5, max_total=30):
    n = draw(st.integers(1, max_n))
    models = draw(st.lists(model, min_size=n, max_size=n))
    total = draw(st.integers(0, max_total))
    lower = upper = None
    if draw(st.booleans()):
        upper = draw(st.lists(st.integers(0, max_total), min_size=n, max_size=n))
        if sum(upper) < total:
            upper[draw(st.integers(0, n - 1))] += total - sum(upper)
        lower = [draw(st.integers(0, u)) for u in upper]
        while sum(lower) > total:
            j = int(np.argmax(lower))
            lower[j] -= 1
    return models, total, lower, upper


def tau(m, b):
    return float(m.effective_time(np.array([b]))[0])


def brute_force(models, total, lower, upper):
    """Every integer allocation: the least makespan, then the largest floor over takers-part."""
    n = len(models)
    lo = lower or [0] * n
    hi = [min(u, total) for u in upper] if upper else [total] * n
    best, allocs = None, []
    for b in itertools.product(*[range(a, z + 1) for a, z in zip(lo, hi)]):
        if sum(b) != total:
            continue
        ms = max(tau(m, x) for m, x in zip(models, b))
        if best is None or ms < best:
            best, allocs = ms, [b]
        elif ms == best:
            allocs.append(b)
    part = [i for i in range(n) if any(b[i] >= 1 for b in allocs)]
    floor = max(min([tau(models[i], b[i]) for i in part], default=0.0) for b in allocs)
    return best, floor, part


def objectives(models, b, part):
    return (max(tau(m, x) for m, x in zip(models, b)),
            min([tau(models[i], b[i]) for i in part], default=0.0))


# -- correctness -------------------------------------------------------------------------------

@given(problem())
def test_matches_reference(prob):
    models, total, lower, upper = prob
    got = hetlb.allocate(models, total, lower, upper)
    want = ref.allocate(models, total, lower, upper)
    np.testing.assert_array_equal(got, want)


@given(problem(max_n=3, max_total=9))
def test_brute_force_optimal(prob):
    models, total, lower, upper = prob
    b = hetlb.allocate(models, total, lower, upper)
    assert b.dtype == np.int64 and b.sum() == total
    if lower:
        assert np.all(b >= lower) and np.all(b <= upper)
    best, floor, part = brute_force(models, total, lower, upper)
    got_ms, got_floor = objectives(models, b, part)
    assert got_ms == best
    assert got_floor == floor


@given(problem(max_n=64, max_total=400))
def test_many_workers_match_reference(prob):
    # Dozens of workers: the searches' interpolation and the workers dropping out of the bracket.
    models, total, lower, upper = prob
    np.testing.assert_array_equal(hetlb.allocate(models, total, lower, upper),
                                  ref.allocate(models, total, lower, upper))


@st.composite
def linear_problem(draw):
    n = draw(st.integers(1, 40))
    a0 = draw(st.lists(coef, min_size=n, max_size=n))
    a1 = draw(st.lists(coef, min_size=n, max_size=n))
    total = draw(st.integers(0, 300))
    upper = None
    if draw(st.booleans()):
        upper = draw(st.lists(st.integers(0, 300), min_size=n, max_size=n))
        upper[draw(st.integers(0, n - 1))] += max(0, total - sum(upper))
    return a0, a1, total, upper


@given(linear_problem())
def test_linear_arrays_match_models_and_reference(prob):
    a0, a1, total, upper = prob
    models = [hetlb.LinearModel(x, y) for x, y in zip(a0, a1)]
    got = allocate_linear(np.array(a0), np.array(a1), total, upper=upper)
    np.testing.assert_array_equal(got, ref.allocate(models, total, upper=upper))
    np.testing.assert_array_equal(got, hetlb.allocate(models, total, upper=upper))


def test_linear_arrays_bad_input():
    with pytest.raises(ValueError, match="worker 1: linear model has a negative coefficient"):
        allocate_linear([1.0, 1.0], [1.0, -1.0], 4)
    with pytest.raises(ValueError, match="worker 0: model has a non-finite"):
        allocate_linear([np.nan, 1.0], [1.0, 1.0], 4)
    with pytest.raises(ValueError, match="a1 has 1 entries, expected 2"):
        allocate_linear([1.0, 1.0], [1.0], 4)
    with pytest.raises(ValueError, match="no workers"):
        allocate_linear([], [], 4)
    with pytest.raises(ValueError, match="upper bounds sum to 2"):
        allocate_linear([1.0, 1.0], [1.0, 1.0], 4, upper=[1, 1])
    # sums over the workers that int64 could not hold: an error, not a wrapped-around sum
    with pytest.raises(ValueError, match="too large for 2 workers"):
        allocate_linear([1.0, 1.0], [1.0, 1.0], 2 ** 62, upper=[2 ** 62, 2 ** 62])
    with pytest.raises(ValueError, match="lower bound 9223372036854775807 of worker 1 exceeds total 5"):
        allocate_linear([1.0, 1.0], [1.0, 1.0], 5, lower=[0, 2 ** 63 - 1], upper=[9, 2 ** 63 - 1])
    with pytest.raises(ValueError, match="total must be below 2\\*\\*63"):
        allocate_linear([1.0], [1.0], 2.0 ** 63)
    with pytest.raises(ValueError, match="lower bound 9223372036854775807 of worker 0 exceeds total 5"):
        hetlb.allocate_proportional([1, 1], 5, lower=[2 ** 63 - 1, 0], upper=[2 ** 63 - 1, 9])
    np.testing.assert_array_equal(allocate_linear([1.0, 1.0], [1.0, 1.0], 2 ** 40), [2 ** 39, 2 ** 39])


def test_a_subclass_of_linear_model_is_a_model():
    class Tagged(hetlb.LinearModel):
        pass

    models = [Tagged(0, 1), hetlb.LinearModel(0, 2), hetlb.PolyModel([1.0, 0.0])]
    np.testing.assert_array_equal(hetlb.allocate(models, 30), ref.allocate(models, 30))


def test_effective_time_is_running_max():
    m = hetlb.PolyModel([-0.01, 0.5, 1.0, 2.0])  # rises, then falls past b ~ 34
    b = np.arange(0, 120)
    eff = m.effective_time(b)
    raw = np.maximum.accumulate(np.maximum(m.time(np.maximum(b, 1)), 0))
    raw[0] = 0.0
    np.testing.assert_allclose(eff, raw, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(eff, ref.effective_times(m, 119))


@pytest.mark.parametrize("n,total", [(4, 64), (8, 300), (16, 1000)])
def test_linear_optimal_against_milp(n, total):
    from scipy.optimize import Bounds, LinearConstraint, milp

    rng = np.random.default_rng(n + total)
    a0, a1 = rng.uniform(0, 5, n), rng.uniform(0.1, 3, n)
    upper = rng.integers(total // n, total, n)
    models = [hetlb.LinearModel(x, y) for x, y in zip(a0, a1)]
    b = hetlb.allocate(models, total, upper=upper)
    got = max(a0[i] + a1[i] * b[i] for i in range(n) if b[i] > 0)
    # Variables: b (n integers), y (n binaries: takes part), M. Minimise M.
    c = np.r_[np.zeros(2 * n), 1.0]
    rows = [np.r_[np.ones(n), np.zeros(n), 0.0]]
    lb, ub = [total], [total]
    for i in range(n):
        r = np.zeros(2 * n + 1); r[i], r[n + i], r[-1] = a1[i], a0[i], -1.0
        rows.append(r); lb.append(-np.inf); ub.append(0.0)  # a0*y + a1*b <= M
        r = np.zeros(2 * n + 1); r[i], r[n + i] = 1.0, -upper[i]
        rows.append(r); lb.append(-np.inf); ub.append(0.0)  # b <= upper*y
    res = milp(c, constraints=LinearConstraint(np.array(rows), lb, ub),
               integrality=np.r_[np.ones(2 * n), 0.0],
               bounds=Bounds(np.zeros(2 * n + 1), np.r_[upper, np.ones(n), np.inf]))
    assert res.success
    assert got <= res.fun + 1e-6 * max(1.0, res.fun)


def test_nonlinear_optimal_against_milp():
    """Cubic and piecewise models, one-hot MILP over every batch size (tiny B)."""
    from scipy.optimize import LinearConstraint, milp

    models = [hetlb.PolyModel([0.002, -0.05, 1.0, 3.0]), hetlb.PiecewiseModel([1, 10, 20], [4, 6, 30]),
              hetlb.LinearModel(2.0, 0.7), hetlb.PolyModel([0.01, 0.3, 1.0])]
    total, n = 40, len(models)
    T = [m.effective_time(np.arange(total + 1)) for m in models]
    nv = n * (total + 1) + 1
    c = np.zeros(nv); c[-1] = 1.0
    A, lb, ub = [], [], []
    for i in range(n):
        r = np.zeros(nv); r[i * (total + 1):(i + 1) * (total + 1)] = 1
        A.append(r); lb.append(1); ub.append(1)  # exactly one size per worker
        r = np.zeros(nv); r[i * (total + 1):(i + 1) * (total + 1)] = T[i]; r[-1] = -1
        A.append(r); lb.append(-np.inf); ub.append(0)  # T_i(b_i) <= M
    r = np.zeros(nv)
    for i in range(n):
        r[i * (total + 1):(i + 1) * (total + 1)] = np.arange(total + 1)
    A.append(r); lb.append(total); ub.append(total)
    res = milp(c, constraints=LinearConstraint(np.array(A), lb, ub), integrality=np.r_[np.ones(nv - 1), 0])
    b = hetlb.allocate(models, total)
    assert max(T[i][b[i]] for i in range(n)) == pytest.approx(res.fun, rel=1e-9)


def test_large_instance_near_continuous_optimum():
    rng = np.random.default_rng(0)
    n, total = 1024, 1 << 20
    a0, a1 = rng.uniform(0, 0.01, n), rng.uniform(1e-5, 4e-5, n)
    models = [hetlb.LinearModel(x, y) for x, y in zip(a0, a1)]
    upper = np.full(n, 4096)
    b = hetlb.allocate(models, total, upper=upper)
    assert b.sum() == total and b.max() <= 4096 and b.min() >= 0
    got = np.max(np.where(b > 0, a0 + a1 * b, 0))
    # Fractional samples, everyone taking part: the level T with sum clip((T - a0) / a1, 0, upper)
    # = total. Here nobody gains by sitting out, so no integer allocation beats T, and rounding
    # costs at most one sample on some worker.
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.clip((mid - a0) / a1, 0, upper).sum() < total else (lo, mid)
    assert hi - 1e-12 <= got <= hi + a1.max() + 1e-12


def test_zero_samples_cost_nothing():
    # A worker whose start-up cost exceeds what the others need sits out.
    models = [hetlb.LinearModel(0, 1), hetlb.LinearModel(100, 0.001)]
    np.testing.assert_array_equal(hetlb.allocate(models, 10), [10, 0])
    assert hetlb.allocate(models, 0).tolist() == [0, 0]


def test_upper_bound_is_memory_limit():
    models = [hetlb.LinearModel(0, 1), hetlb.LinearModel(0, 10)]
    np.testing.assert_array_equal(hetlb.allocate(models, 100, upper=[30, 100]), [30, 70])


# -- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("call,match", [
    (lambda: hetlb.allocate([], 10), "no workers"),
    (lambda: hetlb.allocate([hetlb.LinearModel(1, 1)], -1), ">= 0"),
    (lambda: hetlb.allocate([hetlb.LinearModel(1, 1)], 2.5), "integer"),
    (lambda: hetlb.allocate([hetlb.LinearModel(1, 1)] * 2, 10, upper=[3, 3]), "upper bounds sum to 6"),
    (lambda: hetlb.allocate([hetlb.LinearModel(1, 1)] * 2, 10, lower=[6, 6]), "lower bounds sum to 12"),
    (lambda: hetlb.allocate([hetlb.LinearModel(1, 1)] * 2, 10, lower=[1, 2, 3]), "expected 2"),
    (lambda: hetlb.allocate([hetlb.LinearModel(1, 1)] * 2, 10, lower=[5, 0], upper=[4, 10]), "lower <= upper"),
    (lambda: hetlb.allocate([hetlb.LinearModel(1, 1), "fast"], 10), "not a hetlb time model"),
    (lambda: hetlb.LinearModel(float("nan"), 1), "finite"),
    (lambda: hetlb.LinearModel(-1, 1), ">= 0"),
    (lambda: hetlb.PolyModel([1.0, float("inf")]), "finite"),
    (lambda: hetlb.PolyModel([]), "at least one"),
    (lambda: hetlb.PiecewiseModel([4, 2], [1, 2]), "increase strictly"),
    (lambda: hetlb.PiecewiseModel([1, 2], [1]), "differ in length"),
    (lambda: hetlb.PiecewiseModel([0, 2], [1, 2]), "positive"),
    (lambda: hetlb.PolyModel.fit([1, 2], [1, 2], degree=3), "distinct"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_native_rejects_bad_packed_models():
    from hetlb import _C

    z = np.zeros(0, np.int64)
    with pytest.raises(ValueError, match="non-finite"):
        _C.allocate(np.array([0]), np.array([np.nan, 1.0]), np.array([0, 2]), z, np.array([0, 0]),
                    5, np.array([0]), np.array([5]))
    with pytest.raises(ValueError, match="negative coefficient"):
        _C.allocate(np.array([0]), np.array([-1.0, 1.0]), np.array([0, 2]), z, np.array([0, 0]),
                    5, np.array([0]), np.array([5]))
    with pytest.raises(ValueError, match="offsets"):
        _C.allocate(np.array([0]), np.array([1.0, 1.0]), np.array([0, 9]), z, np.array([0, 0]),
                    5, np.array([0]), np.array([5]))


# -- models ------------------------------------------------------------------------------------

def test_fits_recover_models():
    b = np.array([2, 4, 8, 16, 32, 64], float)
    lin = hetlb.LinearModel.fit(b, 3.0 + 0.5 * b)
    assert lin.a0 == pytest.approx(3.0) and lin.a1 == pytest.approx(0.5)
    cub = hetlb.PolyModel.fit(b, 1e-4 * b**3 - 0.01 * b**2 + b + 2)
    np.testing.assert_allclose(cub.coeffs, [1e-4, -0.01, 1, 2], atol=1e-8)
    pw = hetlb.PiecewiseModel.fit([2, 2, 4], [1.0, 3.0, 5.0])
    np.testing.assert_array_equal(pw.times, [2.0, 5.0])
    assert pw.time(3) == pytest.approx(3.5) and pw.time(6) == pytest.approx(8.0)
    # Noisy data that pulls the intercept negative stays non-negative.
    neg = hetlb.LinearModel.fit([1, 2, 3], [0.0, 2.0, 4.0])
    assert neg.a0 >= 0 and neg.a1 > 0


@pytest.mark.parametrize("m", [hetlb.LinearModel(1, 2), hetlb.PolyModel([1, 2, 3]),
                               hetlb.PiecewiseModel([1, 5], [2, 3])])
def test_model_roundtrip(m):
    from hetlb.core.models import model_from_dict

    again = model_from_dict(json.loads(json.dumps(m.to_dict())))
    assert again == m
    np.testing.assert_array_equal(again.time(np.arange(1, 9)), m.time(np.arange(1, 9)))
    for b in range(1, 9):
        assert ref.raw_time(m, b) == pytest.approx(float(m.time(b)), rel=1e-15)


def test_the_stated_spread_definition_on_the_documented_example():
    # Two workers T(b) = b capped at 10 and one with T = 10 for any batch, total 20, lower 0.
    # [10, 10, 0] and [10, 9, 1] both have makespan 10; allocate keeps the third worker busy
    # (least time 9 over the workers that can take part, the idle one counting 0).
    models = [hetlb.LinearModel(0.0, 1.0), hetlb.LinearModel(0.0, 1.0), hetlb.LinearModel(10.0, 0.0)]
    b = hetlb.allocate(models, 20, lower=[0, 0, 0], upper=[10, 10, 20])
    assert b.tolist() == [10, 9, 1]
    best, floor, part = brute_force(models, 20, [0, 0, 0], [10, 10, 20])
    assert (best, floor, part) == (10.0, 9.0, [0, 1, 2])
    assert objectives(models, b, part) == (best, floor)


# -- micro-steps -------------------------------------------------------------------------------

def _micro_brute(base, limit: int, b: int) -> float:
    """Time of ``b`` samples as hetlb.train.micro's chunks, each one pass of ``base``."""
    from hetlb.train.micro import micro_bounds
    return sum(float(base.effective_time(hi - lo)) for lo, hi in micro_bounds(b, limit))


@given(linear, st.integers(1, 9), st.integers(1, 60))
def test_micro_step_model_of_a_linear_model_is_exact_at_every_batch(base, limit, total):
    from hetlb.core.models import micro_step_model
    m = micro_step_model(base, limit, total)
    b = np.arange(1, total + 1)
    want = [_micro_brute(base, limit, int(x)) for x in b]
    np.testing.assert_allclose(m.effective_time(b), want, rtol=1e-12, atol=1e-12)
    assert float(m.effective_time(0)) == 0.0


@given(st.one_of(poly, piecewise()), st.integers(1, 9), st.integers(1, 60))
def test_micro_step_model_is_exact_where_the_micro_step_count_changes(base, limit, total):
    from hetlb.core.models import micro_step_model
    m = micro_step_model(base, limit, total)
    for k in range(1, -(-total // limit) + 1):
        for b in {(k - 1) * limit + 1, min(k * limit, total)}:
            assert float(m.time(b)) == pytest.approx(_micro_brute(base, limit, b), rel=1e-9,
                                                     abs=1e-9), (k, b)


def test_allocate_over_micro_step_models_is_the_brute_force_optimum():
    from hetlb.core.models import micro_step_model
    base = [hetlb.LinearModel(0.5, 0.1), hetlb.LinearModel(0.3, 0.05), hetlb.LinearModel(0.2, 0.02)]
    limits = [None, 3, 2]
    total = 14
    models = [b if m is None else micro_step_model(b, m, total) for b, m in zip(base, limits)]
    got = hetlb.allocate(models, total)

    def makespan(sizes):
        return max((_micro_brute(b, m, s) if m else float(b.effective_time(s))) if s else 0.0
                   for b, m, s in zip(base, limits, sizes))
    best = min(makespan(s) for s in itertools.product(range(total + 1), repeat=3) if sum(s) == total)
    assert makespan(got) == pytest.approx(best)
    # A rank in micro-steps pays an overhead for each: one pass of the fastest would take more.
    assert got.tolist() != hetlb.allocate(base, total).tolist()


@pytest.mark.parametrize("limit, total", [(0, 5), (2.5, 5), (True, 5), (2, 0)])
def test_micro_step_model_refuses_bad_input(limit, total):
    from hetlb.core.models import micro_step_model
    with pytest.raises(ValueError, match="micro_step_model"):
        micro_step_model(hetlb.LinearModel(0, 1), limit, total)
