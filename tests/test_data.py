"""Global-order sampler: exactly-once coverage, equal step counts, resume — in one process.

The ranks are simulated by one sampler per rank fed the same plan sequence (what replicated
decisions guarantee); the multi-process versions live in test_balancer_dist.py.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from hetlb.data import GlobalOrderSampler, split_last


def random_plan(world, global_batch, seed):
    """Deterministic 'policy': fresh random sizes for every drawn step (same on every rank)."""
    rng = np.random.default_rng(seed)
    draws = []

    def plan(count):
        w = rng.random(world) + 0.01
        sizes = split_last(np.maximum(1, np.round(w / w.sum() * 1000)).astype(np.int64), count)
        draws.append(sizes)
        return sizes
    return plan, draws


def epoch_slices(n, B, world, seed, epoch, start_step=0, drop_last=False, shuffle=True):
    samplers = []
    for r in range(world):
        p, _ = random_plan(world, B, seed * 7919 + epoch)
        s = GlobalOrderSampler(n, B, r, world, p, shuffle=shuffle, seed=seed, drop_last=drop_last)
        s.epoch, s.start_step = epoch, start_step
        samplers.append(s)
    return [list(s) for s in samplers]


@given(n=st.integers(0, 300), B=st.integers(1, 64), world=st.integers(1, 6),
       seed=st.integers(0, 2**16), epochs=st.integers(1, 3))
def test_exactly_once_and_equal_steps(n, B, world, seed, epochs):
    for epoch in range(epochs):
        per_rank = epoch_slices(n, B, world, seed, epoch)
        counts = {len(x) for x in per_rank}
        assert counts == {int(np.ceil(n / B))}, "every rank runs the same number of steps"
        seen = np.concatenate([np.asarray(i, dtype=np.int64) for steps in per_rank for i in steps]
                              or [np.zeros(0, np.int64)])
        assert np.array_equal(np.sort(seen), np.arange(n)), "each sample exactly once per epoch"
        for step in range(len(per_rank[0])):
            total = sum(len(per_rank[r][step]) for r in range(world))
            assert total == min(B, n - step * B)


@given(n=st.integers(1, 200), B=st.integers(1, 32), world=st.integers(1, 4), seed=st.integers(0, 999))
def test_drop_last_drops_only_the_short_step(n, B, world, seed):
    per_rank = epoch_slices(n, B, world, seed, 0, drop_last=True)
    seen = sorted(i for steps in per_rank for s in steps for i in s)
    assert len(seen) == (n // B) * B and len(set(seen)) == len(seen)


def test_permutation_depends_on_seed_and_epoch_only():
    a = GlobalOrderSampler(50, 8, 0, 2, lambda c: split_last(np.array([1, 1]), c), seed=5)
    b = GlobalOrderSampler(50, 8, 1, 3, lambda c: split_last(np.array([1, 1, 1]), c), seed=5)
    assert np.array_equal(a.permutation(2), b.permutation(2))
    assert not np.array_equal(a.permutation(2), a.permutation(3))
    assert np.array_equal(GlobalOrderSampler(9, 2, 0, 1, None, shuffle=False).permutation(4), np.arange(9))


@given(n=st.integers(1, 200), B=st.integers(1, 32), world=st.integers(1, 4), seed=st.integers(0, 999),
       cut=st.integers(0, 50))
def test_resume_mid_epoch_covers_the_rest(n, B, world, seed, cut):
    steps = int(np.ceil(n / B))
    cut = min(cut, steps)
    first = epoch_slices(n, B, world, seed, 1)
    done = [i for r in range(world) for s in first[r][:cut] for i in s]
    # Same permutation (seed stays); the sizes after the resume differ from before.
    rest = [GlobalOrderSampler(n, B, r, world, random_plan(world, B, 3)[0], seed=seed) for r in range(world)]
    for s in rest:
        s.epoch, s.start_step = 1, cut
    later = [i for s in rest for idx in s for i in idx]
    assert sorted(done + later) == list(range(n))
    assert all(len(s) == steps - cut for s in rest)


def test_split_last_and_bad_plan():
    assert split_last(np.array([1, 2, 3, 4]), 10).tolist() == [1, 2, 3, 4]
    assert split_last(np.array([1, 2, 3, 4]), 5).sum() == 5
    assert split_last(np.array([10, 10]), 1).tolist() in ([1, 0], [0, 1])
    s = GlobalOrderSampler(10, 4, 0, 2, lambda c: np.array([1, 1]))
    with pytest.raises(RuntimeError, match="does not split 4 samples"):
        list(s)
    with pytest.raises(ValueError, match="rank 2 outside world of 2"):
        GlobalOrderSampler(10, 4, 2, 2, None)
    with pytest.raises(ValueError, match="global_batch must be >= 1"):
        GlobalOrderSampler(10, 0, 0, 1, None)
