"""allocate_proportional, schedule and rebalance against the reference, brute force and bounds."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hetlb
from hetlb import reference as ref

rate = st.floats(0.01, 10, allow_nan=False)
size = st.floats(0, 100, allow_nan=False)


# -- allocate_proportional ---------------------------------------------------------------------

@st.composite
def prop_problem(draw):
    n = draw(st.integers(1, 8))
    speeds = draw(st.lists(st.floats(0, 1e3, allow_nan=False), min_size=n, max_size=n))
    if sum(speeds) == 0:
        speeds[0] = 1.0
    total = draw(st.integers(0, 500))
    lower = upper = None
    if draw(st.booleans()):
        upper = draw(st.lists(st.integers(0, 500), min_size=n, max_size=n))
        if sum(upper) < total:
            upper[int(np.argmax(speeds))] += total - sum(upper)
        lower = [draw(st.integers(0, u)) // 4 for u in upper]
        while sum(lower) > total:
            lower[int(np.argmax(lower))] -= 1
    return speeds, total, lower, upper


@given(prop_problem())
def test_proportional_matches_exact_reference(prob):
    speeds, total, lower, upper = prob
    got = hetlb.allocate_proportional(speeds, total, lower, upper)
    want = ref.allocate_proportional(speeds, total, lower, upper)
    assert got.sum() == total
    if lower:
        assert np.all(got >= lower) and np.all(got <= upper)
    # Doubles may break a near-tie in fractional parts differently from exact arithmetic; then the
    # results differ by moving one sample between workers whose exact shares are within 1e-9.
    diff = got - want
    assert np.abs(diff).max(initial=0) <= 1
    if np.any(diff):
        exact = ref.proportional_shares(speeds, total, lower, upper)
        fr = [float(x - int(x)) for x in exact]
        moved = np.flatnonzero(diff)
        assert max(fr[i] for i in moved) - min(fr[i] for i in moved) < 1e-9


def test_proportional_examples():
    assert hetlb.allocate_proportional([1, 2, 3, 4], 101).tolist() == [10, 20, 30, 41]
    assert hetlb.allocate_proportional([1, 1, 1], 10).tolist() == [4, 3, 3]
    # Bounds: the fast worker is capped and the rest is shared in proportion.
    assert hetlb.allocate_proportional([1, 1, 8], 100, upper=[100, 100, 50]).tolist() == [25, 25, 50]
    assert hetlb.allocate_proportional([0, 1], 10, lower=[3, 0]).tolist() == [3, 7]
    # Speed-0 workers take only what the others cannot hold, shared equally.
    assert hetlb.allocate_proportional([1, 0, 0], 10, upper=[4, 10, 10]).tolist() == [4, 3, 3]
    assert hetlb.allocate_proportional([0, 0, 0], 10).tolist() == [4, 3, 3]
    assert hetlb.allocate_proportional([1.0, 1e-308], 6, upper=[3, 6]).tolist() == [3, 3]


@pytest.mark.parametrize("call,match", [
    (lambda: hetlb.allocate_proportional([], 3), "no workers"),
    (lambda: hetlb.allocate_proportional([1, float("nan")], 3), "finite"),
    (lambda: hetlb.allocate_proportional([1, -2], 3), "finite and >= 0"),
    (lambda: hetlb.allocate_proportional([1, 1], 3, upper=[1, 1]), "upper bounds sum to 2"),
    (lambda: hetlb.allocate_proportional([1, 1], -3), ">= 0"),
    (lambda: hetlb.allocate_proportional([[1, 1]], 3), "1-D"),
])
def test_proportional_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# -- schedule ----------------------------------------------------------------------------------

@st.composite
def sched_problem(draw, max_n=60, max_r=8):
    r = draw(st.integers(1, max_r))
    n = draw(st.integers(0, max_n))
    sizes = draw(st.lists(st.one_of(size, st.integers(0, 5).map(float)), min_size=n, max_size=n))
    slope = draw(st.lists(rate, min_size=r, max_size=r))
    intercept = draw(st.lists(st.floats(0, 50, allow_nan=False), min_size=r, max_size=r))
    return sizes, slope, intercept


def finish(sizes, dest, slope, intercept):
    load = np.zeros(len(slope))
    np.add.at(load, np.asarray(dest, np.int64), np.asarray(sizes, float))
    return np.asarray(intercept) + np.asarray(slope) * load


@given(sched_problem())
def test_schedule_matches_reference(prob):
    sizes, slope, intercept = prob
    got = hetlb.schedule(sizes, slope, intercept)
    np.testing.assert_array_equal(got, ref.schedule(sizes, slope, intercept))
    assert got.shape == (len(sizes),) and (got.size == 0 or (got.min() >= 0 and got.max() < len(slope)))


@given(sched_problem(max_n=7, max_r=3))
def test_schedule_against_brute_force(prob):
    sizes, slope, intercept = prob
    got = finish(sizes, hetlb.schedule(sizes, slope, intercept), slope, intercept).max()
    best = min(finish(sizes, d, slope, intercept).max()
               for d in itertools.product(range(len(slope)), repeat=len(sizes)))
    assert best <= got + 1e-9
    # Earliest-finish LPT on related machines is within a factor 2 of the optimum.
    assert got <= 2 * best + 1e-9


def test_schedule_close_to_bound_at_scale():
    rng = np.random.default_rng(1)
    sizes = rng.lognormal(3, 1, 4096)
    slope = rng.uniform(0.5, 2, 256)
    intercept = rng.uniform(0, 1, 256)
    got = finish(sizes, hetlb.schedule(sizes, slope, intercept), slope, intercept).max()
    assert got <= 1.05 * ref.continuous_bound(sizes.sum(), slope, intercept)


def test_schedule_examples():
    # CHRONICA Fig. 5 in spirit: equal workers get equal load.
    assert sorted(finish([4, 3, 3, 2], hetlb.schedule([4, 3, 3, 2], [1, 1], [0, 0]), [1, 1], [0, 0])) == [6, 6]
    # A rank three times faster takes three times the data.
    d = hetlb.schedule([1.0] * 8, [1, 3], [0, 0])
    assert np.bincount(d).tolist() == [6, 2]


@pytest.mark.parametrize("call,match", [
    (lambda: hetlb.schedule([1], [], []), "no ranks"),
    (lambda: hetlb.schedule([1], [1, 1], [0]), "differ in length"),
    (lambda: hetlb.schedule([-1], [1], [0]), "size of sample 0"),
    (lambda: hetlb.schedule([float("nan")], [1], [0]), "size of sample 0"),
    (lambda: hetlb.schedule([1], [-1], [0]), "slope of rank 0"),
    (lambda: hetlb.schedule([1], [1], [float("nan")]), "intercept of rank 0"),
])
def test_schedule_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# -- rebalance ---------------------------------------------------------------------------------

@st.composite
def shard_problem(draw, max_n=60, max_r=6):
    sizes, slope, intercept = draw(sched_problem(max_n, max_r))
    # -1: a sample no rank holds (its rank left the job)
    owner = draw(st.lists(st.integers(-1 if draw(st.booleans()) else 0, len(slope) - 1),
                          min_size=len(sizes), max_size=len(sizes)))
    return owner, sizes, slope, intercept


def within(sizes, new, slope, intercept, tol):
    """Whether every rank's predicted time is within ``tol`` of the equal-time level (or of its
    own intercept, for a rank whose fixed time alone exceeds the level)."""
    level = ref.rebalance_level(float(np.sum(sizes)), list(map(float, slope)), list(map(float, intercept)))
    eps = 1e-12 * float(np.sum(sizes)) * max(slope) + 1e-12 * abs(level)
    floor = np.maximum(level, np.asarray(intercept, float))
    return bool(np.all(finish(sizes, new, slope, intercept) <= floor + tol + eps))


@given(shard_problem(), st.one_of(st.none(), st.floats(0, 50)))
def test_rebalance_matches_reference(prob, tolerance):
    owner, sizes, slope, intercept = prob
    got = hetlb.rebalance(owner, sizes, slope, intercept, tolerance=tolerance)
    np.testing.assert_array_equal(got, ref.rebalance(owner, sizes, slope, intercept, tolerance))


@given(shard_problem())
def test_rebalance_improves(prob):
    owner, sizes, slope, intercept = prob
    new = hetlb.rebalance(owner, sizes, slope, intercept)
    assert np.all((new >= 0) & (new < len(slope)))
    assert np.all((new == np.asarray(owner)) | (np.asarray(owner) < 0) | (np.asarray(sizes) > 0)), \
        "a zero-size sample was moved"
    held = [r >= 0 for r in owner]
    if all(held):
        before = finish(sizes, owner, slope, intercept).max() if sizes else max(intercept)
        after = finish(sizes, new, slope, intercept).max() if sizes else max(intercept)
        assert after <= before + 1e-9
    # Within one largest sample's time on the slowest rank of the continuous level.
    assert within(sizes, new, slope, intercept, max(sizes, default=0.0) * max(slope))


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 7), st.integers(1, 3), st.integers(0, 2 ** 31), st.booleans())
def test_rebalance_moves_no_more_than_brute_force(n, ranks, seed, integral):
    """Among all R^N reassignments within the tolerance, none moves fewer samples than
    rebalance; rebalance's own result is within it."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 9, n).astype(float) if integral else rng.lognormal(1, 1, n)
    slope = rng.choice([0.5, 1.0, 2.0], ranks) if integral else rng.uniform(0.2, 3, ranks)
    intercept = rng.choice([0.0, 1.0, 4.0], ranks) if integral else rng.uniform(0, 5, ranks)
    owner = rng.integers(-1 if rng.random() < 0.3 else 0, ranks, n)
    tol = float(sizes.max() * slope.max())
    new = hetlb.rebalance(owner, sizes, slope, intercept)
    assert within(sizes, new, slope, intercept, tol)
    moves = int(np.count_nonzero(new != owner))
    best = min(int(np.count_nonzero(np.asarray(a) != owner))
               for a in itertools.product(range(ranks), repeat=n)
               if within(sizes, a, slope, intercept, tol))
    assert moves == best


def test_rebalance_moves_few():
    rng = np.random.default_rng(2)
    sizes = rng.lognormal(2, 1, 2000)
    owner = np.arange(2000) % 4
    slope, intercept = np.array([1.0, 1.0, 1.0, 2.0]), np.zeros(4)
    new = hetlb.rebalance(owner, sizes, slope, intercept)
    moved = np.count_nonzero(new != owner)
    t = finish(sizes, new, slope, intercept)
    assert within(sizes, new, slope, intercept, 2 * sizes.max())  # one largest sample, slow rank
    # The slow rank holds ~1/4 of the data and should keep ~1/7 of the work: ~ (1/4 - 1/7) of
    # the samples must move; moving largest-first does it with fewer.
    assert moved < 0.5 * (1 / 4 - 1 / 7) * 2000
    # A balanced sharding stays put.
    again = hetlb.rebalance(new, sizes, slope, intercept)
    assert np.count_nonzero(again != new) == 0
    # A tighter tolerance balances tighter and moves more.
    tight = hetlb.rebalance(owner, sizes, slope, intercept, tolerance=0.05 * sizes.max())
    t2 = finish(sizes, tight, slope, intercept)
    assert t2.max() - t2.min() < t.max() - t.min()
    assert t2.max() / t2.min() < 1.02
    assert np.count_nonzero(tight != owner) >= moved


def test_rebalance_places_unowned_samples():
    sizes = np.ones(12)
    owner = np.array([0] * 4 + [1] * 4 + [-1] * 4)  # rank 2 left; its samples have no holder
    new = hetlb.rebalance(owner, sizes, np.ones(2), np.zeros(2))
    assert np.all(new >= 0)
    assert np.bincount(new, minlength=2).tolist() == [6, 6]
    assert np.all(new[:8] == owner[:8])  # nothing else moved


@pytest.mark.parametrize("call,match", [
    (lambda: hetlb.rebalance([0, 2], [1, 1], [1, 1], [0, 0]), "owner of sample 1"),
    (lambda: hetlb.rebalance([0, -2], [1, 1], [1, 1], [0, 0]), "owner of sample 1 is -2"),
    (lambda: hetlb.rebalance([0], [1], [1], [0], tolerance=-1), "tolerance"),
    (lambda: hetlb.rebalance([0], [1], [1], [0], tolerance=float("nan")), "tolerance"),
    (lambda: hetlb.rebalance([0], [1, 1], [1, 1], [0, 0]), "differ in length"),
    (lambda: hetlb.rebalance([0], [1], [0, 1], [0, 0]), "> 0"),
    (lambda: hetlb.rebalance([0.5], [1], [1], [0]), "integers"),
    # (a float or uint64 of 2**63 or more wrapped around to -2**63 in int64)
    (lambda: hetlb.rebalance([0, 2.0 ** 64], [1, 1], [1], [0]), r"owner must hold integers below 2\*\*63"),
    (lambda: hetlb.rebalance(np.array([0, 2 ** 63], np.uint64), [1, 1], [1], [0]), r"below 2\*\*63"),
    (lambda: hetlb.allocate_proportional([1, 1], 3, upper=[2.0 ** 63, 3]), r"upper must hold integers below"),
])
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_rebalance_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_native_checks_lengths():
    from hetlb import _C

    with pytest.raises(ValueError, match="slope and intercept differ in length: 2 vs 1"):
        _C.schedule(np.ones(3), np.ones(2), np.ones(1))
    with pytest.raises(ValueError, match="owner and sizes differ in length: 2 vs 3"):
        _C.rebalance(np.zeros(2, np.int64), np.ones(3), np.ones(2), np.ones(2))
    with pytest.raises(ValueError, match="sizes must be 1-D"):
        _C.schedule(np.ones((2, 2)), np.ones(2), np.ones(2))


@pytest.mark.parametrize("ranks", [7, 8, 37, 256])
@pytest.mark.parametrize("ties", [False, True])
def test_schedule_many_ranks_matches_reference(ranks, ties):
    """Exercises the vectorised scan (8 ranks a round plus a tail) and tie-breaking at scale."""
    rng = np.random.default_rng(ranks)
    if ties:  # integer sizes and few distinct rates: many exactly equal finish times
        sizes = rng.integers(0, 4, 300).astype(float)
        slope = rng.choice([1.0, 2.0], ranks)
        intercept = rng.choice([0.0, 1.0], ranks)
    else:
        sizes = rng.lognormal(1, 1, 300)
        slope = rng.uniform(0.5, 2, ranks)
        intercept = rng.uniform(0, 3, ranks)
    np.testing.assert_array_equal(hetlb.schedule(sizes, slope, intercept), ref.schedule(sizes, slope, intercept))
    owner = rng.integers(0, ranks, 300)
    np.testing.assert_array_equal(hetlb.rebalance(owner, sizes, slope, intercept),
                                  ref.rebalance(owner, sizes, slope, intercept))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(1, 70), st.integers(0, 2 ** 31),
       st.sampled_from(["uniform", "lognormal", "ties"]))
def test_schedule_vector_and_scalar_scans_agree_bit_for_bit(n, ranks, seed, kind):
    """Ranks may run on CPUs with and without AVX2: both scans must pick the same rank always."""
    from hetlb import _C
    rng = np.random.default_rng(seed)
    sizes = {"uniform": rng.uniform(0, 100, n), "lognormal": rng.lognormal(3, 1, n),
             "ties": rng.integers(1, 4, n).astype(float)}[kind]
    slope = rng.choice([1e-3, 2e-3, 3e-3], ranks) if kind == "ties" else rng.uniform(1e-4, 1e-2, ranks)
    intercept = np.zeros(ranks) if kind == "ties" else rng.uniform(0, 0.05, ranks)
    fast = _C.schedule(sizes, slope, intercept, simd=True)
    slow = _C.schedule(sizes, slope, intercept, simd=False)
    assert np.array_equal(fast, slow)
    assert np.array_equal(slow, ref.schedule(sizes, slope, intercept))
    assert isinstance(_C.schedule_simd_available(), bool)


def _related_ranks(rng, kind, ranks, n):
    """Sizes and rates of one step: the cases where the groups' expiries must be right."""
    if kind == "ties":  # few distinct rates and integer sizes: exact ties in f and in c
        return (rng.integers(0, 4, n).astype(float), rng.choice([1.0, 2.0, 3.0], ranks),
                rng.choice([0.0, 1.0], ranks))
    if kind == "near":  # slopes one or two ulps apart: lines that cross within rounding
        base = rng.uniform(0.5, 2.0)
        return (rng.integers(1, 50, n).astype(float),
                base * (1 + rng.integers(0, 3, ranks) * np.finfo(float).eps), rng.uniform(0, 1e-12, ranks))
    if kind == "zero":  # ranks of slope 0 and samples of size 0 (and -0.0) mixed in
        return (np.where(rng.random(n) < 0.2, rng.choice([0.0, -0.0], n), rng.uniform(0, 10, n)),
                np.where(rng.random(ranks) < 0.2, 0.0, rng.uniform(0.5, 2, ranks)), rng.uniform(0, 5, ranks))
    if kind == "huge":  # loads that overflow to infinity
        return rng.uniform(1e306, 1e307, n), rng.uniform(0.5, 2.0, ranks), np.zeros(ranks)
    return rng.lognormal(3, 1, n), rng.uniform(0.5, 2.0, ranks), rng.uniform(0, 5, ranks)


@given(st.integers(1, 600), st.integers(64, 300), st.integers(0, 2 ** 31),
       st.sampled_from(["lognormal", "ties", "near", "zero", "huge"]), st.booleans())
def test_schedule_by_groups_picks_what_the_scan_picks(n, ranks, seed, kind, use_first):
    """From 64 related ranks on, groups of ranks replace the scan of every rank: the same picks."""
    from hetlb import _C
    rng = np.random.default_rng(seed)
    sizes, slope, intercept = _related_ranks(rng, kind, ranks, n)
    first = int(rng.integers(n)) if use_first else -1
    grouped = _C.schedule(sizes, slope, intercept, first=first)
    assert np.array_equal(grouped, _C.schedule(sizes, slope, intercept, first=first, grouped=False))
    assert np.array_equal(grouped, _C.schedule(sizes, slope, intercept, first=first, grouped=False, simd=False))
    if n * ranks <= 20000:
        want = ref.schedule(sizes, slope, intercept, first=None if first < 0 else first)
        assert np.array_equal(grouped, want)


@pytest.mark.parametrize("equal_slopes", [False, True])
def test_schedule_orders_many_samples_as_the_reference(equal_slopes):
    """From 256 samples on they are ordered by a radix sort of their bit patterns: ties (and -0.0
    against 0.0) by index, as the reference's sort."""
    rng = np.random.default_rng(11)
    sizes = rng.integers(0, 5, 3000).astype(float)
    sizes[rng.random(3000) < 0.1] = -0.0
    sizes[:50] = rng.lognormal(3, 1, 50)
    slope = np.ones(16) if equal_slopes else rng.uniform(0.5, 2, 16)
    intercept = rng.uniform(0, 5, 16)
    np.testing.assert_array_equal(hetlb.schedule(sizes, slope, intercept), ref.schedule(sizes, slope, intercept))


@pytest.mark.parametrize("ranks", [8, 9, 64, 100])
def test_schedule_with_overflowing_times_picks_as_the_reference(ranks):
    """Times that overflow to inf on every rank: ties of (inf, inf) go to the lowest rank, on the
    vector scan (8 or more ranks; it once returned a rank past the last) and by groups."""
    rng = np.random.default_rng(ranks)
    sizes = rng.lognormal(0, 2, 40) * 1e300
    slope, intercept = rng.uniform(0, 2, ranks) * 1e300, rng.uniform(0, 1, ranks) * 1e300
    with np.errstate(over="ignore"):
        want = ref.schedule(sizes, slope, intercept)
    np.testing.assert_array_equal(hetlb.schedule(sizes, slope, intercept), want)


@pytest.mark.parametrize("ranks, kind", [(2048, "clustered"), (5000, "clustered"), (5000, "ties"),
                                         (5000, "zero")])
def test_schedule_by_groups_at_scale(ranks, kind):
    """Thousands of ranks and samples, a pivot first: the plain scan's picks. Above 4,096 ranks a
    group holds more than 64 ranks, one word of its tie bits: ties there take the full pass."""
    from hetlb import _C
    rng = np.random.default_rng(ranks)
    if kind == "clustered":
        sizes = rng.lognormal(3, 1, 20000)
        slope = rng.choice([1.0, 2.0, 3.0, 4.0], ranks) * rng.uniform(0.9, 1.1, ranks)
        intercept = rng.uniform(0, 5, ranks)
    else:
        sizes, slope, intercept = _related_ranks(rng, kind, ranks, 20000)
    got = _C.schedule(sizes, slope, intercept, first=123)
    assert np.array_equal(got, _C.schedule(sizes, slope, intercept, first=123, grouped=False))


@given(st.integers(1, 60), st.integers(1, 9), st.integers(0, 2 ** 31), st.booleans(), st.booleans())
def test_schedule_first_pivot_and_caps_match_the_reference(n, ranks, seed, use_first, use_cap):
    from hetlb import _C
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 20, n).astype(float)
    slope = rng.choice([1.0, 2.0], ranks) if seed % 2 else rng.uniform(0.5, 2.0, ranks)
    intercept = rng.uniform(0, 5, ranks)
    first = int(rng.integers(n)) if use_first else None
    cap = None
    if use_cap:  # room for everything, unevenly spread
        w = rng.uniform(0.5, 1.5, ranks)
        cap = np.ceil(w / w.sum() * sizes.sum() * 1.3) + sizes.max()
    got = hetlb.schedule(sizes, slope, intercept, first=first, cap=cap)
    want = ref.schedule(sizes, slope, intercept, first=first, cap=cap)
    assert np.array_equal(got, want)
    fast = _C.schedule(sizes, slope, intercept, simd=True, first=-1 if first is None else first, cap=cap)
    slow = _C.schedule(sizes, slope, intercept, simd=False, first=-1 if first is None else first, cap=cap)
    assert np.array_equal(fast, slow) and np.array_equal(fast, got)
    if cap is not None:
        assert np.all(np.bincount(got, weights=sizes, minlength=ranks) <= cap)
    if first is not None:  # the pivot goes where it finishes first on empty ranks
        assert got[first] == min(range(ranks), key=lambda r: (intercept[r] + slope[r] * sizes[first], intercept[r], r))


def test_schedule_cap_errors():
    with pytest.raises(ValueError, match="fits in no rank's cap"):
        hetlb.schedule([5.0, 5.0, 5.0], [1.0, 1.0], [0.0, 0.0], cap=[6.0, 6.0])
    with pytest.raises(ValueError, match="cap has 1 entries"):
        hetlb.schedule([1.0], [1.0, 1.0], [0.0, 0.0], cap=[3.0])
    with pytest.raises(ValueError, match="first=3 is not a sample index"):
        hetlb.schedule([1.0, 2.0], [1.0], [0.0], first=3)
