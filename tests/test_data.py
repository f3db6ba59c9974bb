"""Plan board and global-order sampler: exactly-once coverage, equal step counts, windows, epochs
and resume, in one process.

The ranks are simulated by one board and sampler per rank fed the same decisions (what replicated
decisions guarantee); the multi-process versions live in test_balancer_dist.py.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from hetlb.data.sampler import GlobalOrderSampler
from hetlb.data.board import PlanBoard
from hetlb.data.stream import StreamBoard
from hetlb.core.decisions import ScheduleRule, decision_checksum, split_last


def ranks(n, B, world, seed=0, drop_last=False, shuffle=True, accumulate=1, sample_sizes=None):
    boards = [PlanBoard(world, r, B, accumulate) for r in range(world)]
    samplers = [GlobalOrderSampler(n, b, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                   sample_sizes=sample_sizes) for b in boards]
    return boards, samplers


def random_decision(rng, world, B):
    w = rng.random(world) + 0.01
    return split_last(np.maximum(1, np.round(w / w.sum() * 1000)).astype(np.int64), B)


def run_epoch(boards, samplers, rng, stop=None, train=True, restart=True):
    """Draw, hand out and (``train``) complete steps on every rank in lockstep, a new decision
    per step; ``restart``: a new iteration (else the one under way goes on). Returns each rank's
    list of index lists and the plans."""
    world = len(boards)
    B = boards[0].global_batch
    if restart:
        for b in boards:
            b.restart()
    its = [iter(s) for s in samplers]
    out = [[] for _ in range(world)]
    plans = []
    while stop is None or len(plans) < stop:
        d = random_decision(rng, world, B)
        for b in boards:
            b.post(d)
        try:
            idx = [next(it) for it in its]
        except StopIteration:
            break
        hp = [b.hand() for b in boards]
        assert len({p.checksum for p in hp}) == 1  # every rank drew the same plan
        plans.append(hp[0])
        for r in range(world):
            out[r].append(idx[r])
            if train:
                boards[r].complete(hp[r])
    return out, plans


@given(n=st.integers(0, 300), B=st.integers(1, 64), world=st.integers(1, 6),
       seed=st.integers(0, 2**16), epochs=st.integers(1, 3))
def test_exactly_once_and_equal_steps(n, B, world, seed, epochs):
    rng = np.random.default_rng(seed)
    boards, samplers = ranks(n, B, world, seed=seed)
    for epoch in range(epochs):
        per_rank, plans = run_epoch(boards, samplers, rng)
        assert {len(x) for x in per_rank} == {int(np.ceil(n / B))}, "every rank runs the same number of steps"
        seen = np.concatenate([np.asarray(i, dtype=np.int64) for steps in per_rank for i in steps]
                              or [np.zeros(0, np.int64)])
        assert np.array_equal(np.sort(seen), np.arange(n)), "each sample exactly once per epoch"
        for step, plan in enumerate(plans):
            assert plan.count == min(B, n - step * B) and plan.epoch == boards[0].epoch
            assert sum(len(per_rank[r][step]) for r in range(world)) == plan.count
            for r in range(world):
                assert len(per_rank[r][step]) == plan.sizes[r]


@given(n=st.integers(1, 200), B=st.integers(1, 32), world=st.integers(1, 4), seed=st.integers(0, 999))
def test_drop_last_drops_only_the_short_step(n, B, world, seed):
    boards, samplers = ranks(n, B, world, seed=seed, drop_last=True)
    per_rank, _ = run_epoch(boards, samplers, np.random.default_rng(seed))
    seen = sorted(i for steps in per_rank for s in steps for i in s)
    assert len(seen) == (n // B) * B and len(set(seen)) == len(seen)


def test_permutation_depends_on_seed_and_epoch_only():
    a = GlobalOrderSampler(50, PlanBoard(2, 0, 8), seed=5)
    b = GlobalOrderSampler(50, PlanBoard(3, 1, 8), seed=5)
    assert np.array_equal(a.permutation(2), b.permutation(2))
    assert not np.array_equal(a.permutation(2), a.permutation(3))
    assert np.array_equal(GlobalOrderSampler(9, PlanBoard(1, 0, 2), shuffle=False).permutation(4), np.arange(9))


@given(n=st.integers(1, 200), B=st.integers(1, 32), world=st.integers(1, 4), seed=st.integers(0, 999),
       cut=st.integers(0, 50), handed=st.integers(0, 3), new_world=st.integers(1, 4))
def test_resume_mid_epoch_covers_the_rest(n, B, world, seed, cut, handed, new_world):
    # Train `cut` steps, hand out `handed` more without training them (a peek, or a checkpoint at
    # the top of the loop body, or prefetch), checkpoint, resume on another world size.
    rng = np.random.default_rng(seed)
    steps = int(np.ceil(n / B))
    cut = min(cut, steps)
    boards, samplers = ranks(n, B, world, seed=seed)
    first, _ = run_epoch(boards, samplers, rng, stop=cut)
    run_epoch(boards, samplers, rng, stop=handed, train=False, restart=False)
    state = boards[0].position()
    assert all(b.position() == state for b in boards) and state["step"] == cut
    boards2, samplers2 = ranks(n, B, new_world, seed=seed)
    for b in boards2:
        b.load_position(state)
    later, _ = run_epoch(boards2, samplers2, rng)
    done = [i for r in range(world) for s in first[r] for i in s]
    rest = [i for r in range(new_world) for s in later[r] for i in s]
    if cut < steps:
        assert sorted(done + rest) == list(range(n))
        assert all(len(s) == steps - cut for s in later)
    else:  # the checkpoint closed the epoch: the resumed loader runs the next one, whole
        assert sorted(done) == list(range(n)) and sorted(rest) == list(range(n))
        assert boards2[0].epoch == 1


def test_a_peek_does_not_consume_a_step():
    rng = np.random.default_rng(0)
    boards, samplers = ranks(40, 4, 2, seed=3)
    peek, _ = run_epoch(boards, samplers, rng, stop=1, train=False)  # next(iter(loader))
    rest, _ = run_epoch(boards, samplers, rng)
    assert rest[0][0] == peek[0][0]  # the peeked step is handed out again
    assert sorted(i for r in rest for s in r for i in s) == list(range(40))


@given(n=st.integers(1, 120), B=st.integers(1, 16), world=st.integers(1, 4), K=st.integers(2, 5),
       seed=st.integers(0, 999))
def test_accumulation_windows_have_fixed_sizes(n, B, world, K, seed):
    boards, samplers = ranks(n, B, world, seed=seed, accumulate=K)
    per_rank, plans = run_epoch(boards, samplers, np.random.default_rng(seed))
    full = n // B
    assert sorted(i for r in per_rank for s in r for i in s) == list(range(n))
    for p in plans:
        if p.step < full:
            start = (p.step // K) * K
            assert p.window_pos == p.step - start and p.window_len == min(K, full - start)
        else:
            assert (p.window_pos, p.window_len) == (0, 1)  # the short last step: its own window
    for a, b in zip(plans, plans[1:]):
        if b.window_pos > 0:
            assert b.sizes.tolist() == a.sizes.tolist(), "sizes change only at a window start"


def test_windows_redraw_from_the_position_after_a_restart():
    boards, samplers = ranks(64, 4, 2, seed=1, accumulate=4)
    rng = np.random.default_rng(4)
    run_epoch(boards, samplers, rng, stop=4)  # one whole window trained
    run_epoch(boards, samplers, rng, stop=2, train=False, restart=False)  # two micro-steps handed out
    assert boards[0].done == 4
    _, plans = run_epoch(boards, samplers, rng, stop=4)
    assert [p.step for p in plans] == [4, 5, 6, 7] and plans[0].window_pos == 0


def test_data_amounts_follow_the_slices():
    sizes = np.arange(20, dtype=np.float64) + 1
    boards, samplers = ranks(20, 6, 2, seed=0, shuffle=False, sample_sizes=sizes)
    for b in boards:
        b.post(np.array([2, 4]))
    plan = None
    for b, s in zip(boards, samplers):
        next(iter(s))
        plan = b.hand()
    assert plan.data.tolist() == [1.0 + 2.0, 3.0 + 4.0 + 5.0 + 6.0]
    boards, samplers = ranks(3, 6, 3, seed=0, shuffle=False, sample_sizes=np.ones(3))
    for b in boards:
        b.post(np.array([2, 2, 2]))
        samplers[b.rank] and next(iter(samplers[b.rank]))
    p = boards[2].hand()  # 3 samples by shares 2:2:2 -> a rank gets none
    assert p.sizes.sum() == 3 and p.data.tolist() == p.sizes.astype(float).tolist()


def test_size_aware_plan_assigns_every_sample_once():
    sizes = np.random.default_rng(2).lognormal(2, 1, 37)
    boards, samplers = ranks(37, 12, 3, seed=5, sample_sizes=sizes)
    rule = ScheduleRule([1e-3, 2e-3, 4e-3], [0.01, 0.0, 0.0])
    seen = []
    for b in boards:
        b.restart()
    its = [iter(s) for s in samplers]
    while True:
        for b in boards:
            b.post(rule)
        try:
            idx = [next(it) for it in its]
        except StopIteration:
            break
        plans = [b.hand() for b in boards]
        p = plans[0]
        assert p.assignment is not None and np.bincount(p.assignment, minlength=3).tolist() == p.sizes.tolist()
        for r in range(3):
            assert len(idx[r]) == p.sizes[r]
            assert p.data[r] == pytest.approx(sizes[idx[r]].sum())
            seen += idx[r]
        for b, q in zip(boards, plans):
            b.complete(q)
    assert sorted(seen) == list(range(37))
    with pytest.raises(ValueError, match="gradient accumulation"):
        PlanBoard(2, 0, 8, accumulate=2).post(ScheduleRule([1, 1], [0, 0]))


def test_set_epoch_rules():
    b = PlanBoard(1, 0, 4)
    b.steps_per_epoch = 3
    b.set_epoch(0)
    b.done = 3  # epoch 0 trained
    with pytest.raises(ValueError, match="already complete"):
        b.set_epoch(0)
    b.set_epoch(1)
    assert (b.epoch, b.done) == (1, 0)
    with pytest.raises(ValueError, match="already at epoch 1"):
        b.set_epoch(0)
    b.done = 1
    b.set_epoch(4)  # without a restore, skipping the rest of an epoch is the script's choice
    assert (b.epoch, b.done) == (4, 0)
    # After a restore the script must continue where the checkpoint stopped.
    b.load_position({"epoch": 2, "step": 1, "global_batch": 4})
    with pytest.raises(ValueError, match="step 1 of 3 of epoch 2"):
        b.set_epoch(3)
    b.set_epoch(2)
    b.load_position({"epoch": 2, "step": 3, "global_batch": 4})
    with pytest.raises(ValueError, match="epoch 2 is already complete .as the loaded checkpoint says"):
        b.set_epoch(2)
    with pytest.raises(ValueError, match="next epoch is 3"):
        b.set_epoch(5)
    b.set_epoch(3)
    # Iterating a finished epoch without set_epoch moves on (a DataLoader iterated again).
    b.done = 3
    b.restart()
    assert (b.epoch, b.done) == (4, 0)
    with pytest.raises(ValueError, match="global_batch=8 differs"):
        b.load_position({"epoch": 0, "step": 0, "global_batch": 8})


def test_split_last_and_checksums():
    assert split_last(np.array([1, 2, 3, 4]), 10).tolist() == [1, 2, 3, 4]
    assert split_last(np.array([1, 2, 3, 4]), 5).sum() == 5
    assert split_last(np.array([10, 10]), 1).tolist() in ([1, 0], [0, 1])
    assert decision_checksum([3, 7]) != decision_checksum([7, 3])
    assert decision_checksum(ScheduleRule([1, 2], [0, 0])) != decision_checksum(ScheduleRule([2, 1], [0, 0]))
    with pytest.raises(ValueError, match="rank 2 outside a world of 2"):
        PlanBoard(2, 2, 4)
    with pytest.raises(ValueError, match="global_batch must be an integer >= 1"):
        PlanBoard(1, 0, 0)
    with pytest.raises(ValueError, match="finite 1-D arrays"):
        ScheduleRule([1.0, np.nan], [0, 0])


@given(n=st.integers(0, 200), world=st.integers(1, 5), seed=st.integers(0, 999),
       cut=st.integers(0, 30), refs=st.lists(st.integers(1, 9), min_size=5, max_size=5),
       first=st.floats(0.0, 1.0))
def test_streams_cover_the_epoch_once_at_each_rank_s_own_pace(n, world, seed, cut, refs, first):
    # Delayed synchronous training: the epoch in two rounds (the first `first` of it, then the
    # rest); every rank draws reference batches of its own size from its own shard of a round; a
    # checkpoint keeps the round and every rank's count; a resume (on the same ranks) continues.
    rng = np.random.default_rng(seed)
    first = max(1, int(first * n)) if n else 0  # an empty round is never posted
    rounds = []
    for size in (first, n - first):
        w = rng.random(world) + 0.1
        rounds.append(split_last(np.maximum(1, np.round(w / w.sum() * 1000)).astype(np.int64), size))
    boards = [StreamBoard(world, r, 8) for r in range(world)]
    samplers = [GlobalOrderSampler(n, b, seed=seed) for b in boards]
    seen = []
    shards = rounds[0]
    used = np.zeros(world, np.int64)
    for r, (b, s) in enumerate(zip(boards, samplers)):
        b.post_shards(shards, refs[r], n)
        b.restart()
        for k, idx in enumerate(s):
            # full reference batches; a tail of more than one batch is split in two halves
            left = shards[r] - used[r]
            assert len(idx) == (refs[r] if left >= 2 * refs[r] else -(-left // 2) if left > refs[r] else left)
            if k < cut:
                seen += idx
                used[r] += len(idx)
            else:
                break
    for b in boards:
        b.consumed(used)
    state = boards[0].position()
    assert state["used"] == used.tolist() and state["shards"] == shards.tolist() and state["base"] == 0
    rest = [StreamBoard(world, r, 8) for r in range(world)]
    for r, b in enumerate(rest):
        b.load_position(state)
        if n and first == n and np.array_equal(used, shards):  # the checkpoint closed the epoch
            b.restart()
            assert b.epoch == 1 and b.shards is None
            with pytest.raises(RuntimeError, match="shards of epoch 1: post_shards"):
                list(GlobalOrderSampler(n, b, seed=seed))
            continue
        b.restart()  # a finished first round moves on to the second
        if b.shards is None:
            assert b.base == first
        else:
            seen += [i for idx in GlobalOrderSampler(n, b, seed=seed) for i in idx]
            b.consumed(shards)
            if n - first:
                b.next_round()
        if n - first and b.base < n:
            assert b.base == first
            b.post_shards(rounds[1], refs[r], n)
            b.restart()
            seen += [i for idx in GlobalOrderSampler(n, b, seed=seed) for i in idx]
            b.consumed(rounds[1])
            assert b.stream_finished()
    assert sorted(seen) == list(range(n))


def test_stream_misuse():
    b = StreamBoard(2, 0, 8)
    with pytest.raises(RuntimeError, match="post_shards"):
        b.draw_stream(10)
    with pytest.raises(ValueError, match="run past the epoch's 9"):
        b.post_shards([6, 4], 3, 9)
    b.post_shards([6, 4], 3, 10)
    with pytest.raises(RuntimeError, match="run past the epoch's 9"):
        b.draw_stream(9)
    with pytest.raises(RuntimeError, match="not trained yet"):
        b.next_round()
    b.consumed([3, 0])
    with pytest.raises(ValueError, match="cannot change"):
        b.post_shards([5, 5], 3, 10)
    with pytest.raises(ValueError, match="within the shards"):
        b.consumed([7, 0])
    # a board of balanced steps takes no shards, and there is no third kind of board
    assert not hasattr(PlanBoard(2, 0, 8), "post_shards")
    with pytest.raises(TypeError):
        PlanBoard(2, 0, 8, mode="stream")



def test_stream_rounds_move_on_and_an_empty_batch_ends_a_used_up_shard():
    b = StreamBoard(2, 1, 8, reference=3)
    b.post_shards([4, 5], 3, 20)
    b.restart()
    plans = []
    while (plan := b.draw_stream(20)) is not None:
        plans.append(b.hand())
        b.drop_current()  # stepped
        assert b.current is None
    assert [(p.start, p.count) for p in plans] == [(0, 3), (3, 2)]  # 5 = 3 + 2 (no batch of 1)
    empty = b.hand_empty()  # the shard is used up: an empty batch at its end
    assert b.current is empty and (empty.epoch, empty.start, empty.count) == (0, 5, 0)
    b.drop_current()
    b.move_on()  # the round is not trained: nothing changes
    assert (b.epoch, b.base, b.shards.tolist()) == (0, 0, [4, 5])
    b.consumed([4, 5])
    b.move_on()  # past the trained round: the next one starts after it, its shards not posted
    assert (b.epoch, b.base, b.shards) == (0, 9, None)
    b.post_shards([6, 5], 3, 20)
    b.consumed([6, 5])
    assert b.stream_finished()
    b.move_on()  # past the trained epoch
    assert (b.epoch, b.base, b.shards, b.used.tolist()) == (1, 0, None, [0, 0])
    with pytest.raises(AttributeError):
        b.shards = np.array([1, 1])  # the board's own: posted, not written from outside


@pytest.mark.parametrize("where", ["no round", "round trained", "epoch trained", "round not begun"])
def test_a_stream_position_resumes_on_another_world_only_at_a_round_boundary(where):
    old = StreamBoard(2, 0, 8, reference=4)
    old.post_shards([6, 4], 4, 20)
    if where in ("round trained", "epoch trained"):
        old.consumed([6, 4])
    if where == "epoch trained":
        old.next_round()
        old.post_shards([6, 4], 4, 20)
        old.consumed([6, 4])
    state = old.position() if where != "no round" else dict(old.position(), shards=None, used=[0, 0])
    same = StreamBoard(2, 1, 8, reference=4)
    same.restore_stream_position(state, 2, 20)
    assert same.position() == state
    new = StreamBoard(3, 2, 12, reference=4)
    new.restore_stream_position(state, 2, 20)
    expect = {"no round": (0, 0), "round not begun": (0, 0), "round trained": (0, 10),
              "epoch trained": (1, 0)}[where]
    assert (new.epoch, new.base, new.shards, new.used.tolist()) == (*expect, None, [0, 0, 0])
    mid = dict(state, shards=[6, 4], used=[2, 0])  # in the middle of a round
    with pytest.raises(ValueError, match=r"middle of a round only on the number of ranks it saved on \(2, now 3\)"):
        StreamBoard(3, 0, 12, reference=4).restore_stream_position(mid, 2, 20)


@given(shares=st.lists(st.integers(0, 9), min_size=1, max_size=6).filter(lambda s: sum(s) > 0),
       accumulate=st.integers(1, 3), seed=st.integers(0, 100))
def test_whole_step_fast_path_draws_the_general_plan(shares, accumulate, seed):
    """A whole step of the posted sizes takes draw()'s fast path (the decision shared, read-only);
    its plans equal the general path's (with per-sample sizes of 1, which takes that path)."""
    world, B = len(shares), sum(shares)
    n = B * 5 + seed % B  # a short last step too
    d = np.asarray(shares, np.int64)
    fast, slow = PlanBoard(world, 0, B, accumulate), PlanBoard(world, 0, B, accumulate)
    for b in fast, slow:
        b.post(d)
    full = n // B
    for step in range(full + (n % B > 0)):
        count = min(B, n - step * B)
        p = fast.draw(0, step, count, full)
        q = slow.draw(0, step, count, full, sample_sizes=np.ones(count))
        assert (p.epoch, p.step, p.checksum, p.window_pos, p.window_len) == \
               (q.epoch, q.step, q.checksum, q.window_pos, q.window_len)
        assert p.sizes.tolist() == q.sizes.tolist() and p.data.tolist() == q.data.tolist()
        assert p.checksum == decision_checksum(p.sizes)
        with pytest.raises(ValueError, match="read-only"):
            p.sizes[0] += 1  # steps share the posted sizes: nobody may change them in place
    d[0] += 1  # the board holds its own copy of what was posted
    assert fast.decision.tolist() == shares


@given(n=st.integers(1, 200), B=st.integers(1, 24), world=st.integers(1, 5),
       accumulate=st.integers(1, 3), seed=st.integers(0, 999))
def test_each_rank_s_batch_is_its_slice_of_the_plan(n, B, world, accumulate, seed):
    """The sampler yields, on every rank and step, the plan's positions of that rank
    (``StepPlan.positions``, via ``step_indices``): whole steps of the posted sizes through the
    rank's span found when they were posted (a new decision every step here), others (a short
    last step, a window that keeps its first step's sizes) through the plan."""
    boards, samplers = ranks(n, B, world, seed=seed, accumulate=accumulate)
    out, plans = run_epoch(boards, samplers, np.random.default_rng(seed))
    assert len(plans) == -(-n // B)
    for k, plan in enumerate(plans):
        want = samplers[0].step_indices(plan)
        assert [out[r][k] for r in range(world)] == [w.tolist() for w in want]


def test_post_refuses_sizes_that_cannot_be_a_decision():
    b = PlanBoard(3, 0, 6)
    with pytest.raises(ValueError, match="3 non-negative sizes, got \\[2, 4\\]"):
        b.post(np.array([2, 4]))
    with pytest.raises(ValueError, match="got \\[2, -1, 5\\]"):
        b.post(np.array([2, -1, 5]))


@given(n=st.integers(0, 200), B=st.integers(1, 40), world=st.integers(1, 5),
       seed=st.integers(0, 2**16), drop_last=st.booleans(), shuffle=st.booleans(),
       epoch=st.integers(0, 3))
def test_an_evaluation_pass_reads_every_sample_once_in_equal_steps(n, B, world, seed, drop_last,
                                                                   shuffle, epoch):
    boards, samplers = ranks(n, B, world, seed=seed, drop_last=drop_last, shuffle=shuffle)
    for b in boards:
        b.set_epoch(epoch)
    passes = [list(s.evaluation()) for s in samplers]
    assert len({len(p) for p in passes}) == 1  # every rank the same number of steps
    steps = len(passes[0])
    assert steps == (n // B if drop_last else -(-n // B))
    # brute force: each step's count split as evenly as possible, in rank order, over the order
    perm = samplers[0].permutation(epoch)
    flat = []
    for s in range(steps):
        count = min(B, n - s * B)
        got = [passes[r][s] for r in range(world)]
        assert max(map(len, got)) - min(map(len, got)) <= 1
        assert [len(g) for g in got] == sorted((len(g) for g in got), reverse=True)
        step = [i for g in got for i in g]
        assert step == perm[s * B:s * B + count].tolist()
        flat += step
    if not shuffle:
        assert flat == list(range(len(flat)))
    assert len(flat) == len(set(flat)) == (steps * B if drop_last else n)
    # an evaluation pass moves nothing: the training position is where it was
    assert all(b.done == 0 and b.epoch == epoch and not b.drawn for b in boards)


def test_an_unbound_loader_evaluates_with_workers_and_idle_ranks():
    import torch
    from hetlb.data.loader import BalancedLoader
    ds = torch.utils.data.TensorDataset(torch.arange(11.0)[:, None])
    world, seen = 4, []
    for r in range(world):  # global batch 8: steps of 8 and 3 samples (ranks 3 idle in the last)
        loader = BalancedLoader(ds, 2, board=PlanBoard(world, r, 8), num_workers=1)
        assert len(loader) == 2
        batches = [x[:, 0].tolist() for (x,) in loader]
        assert [len(b) for b in batches] == [2, 1 if r < 3 else 0]
        seen += [v for b in batches for v in b]
        assert [x.shape[0] for (x,) in loader] == [2, 1 if r < 3 else 0]  # again, whole
    assert sorted(seen) == [float(i) for i in range(11)]


def _no_single_brute(sizes, room):
    """The fewest samples moved by any split of sum(sizes) with no rank at 1 (None: none)."""
    import itertools
    best = None
    for x in itertools.product(*[[0] + list(range(2, r + 1)) for r in room]):
        if sum(x) == sum(sizes):
            d = sum(abs(a - b) for a, b in zip(x, sizes))
            best = d if best is None else min(best, d)
    return best


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=4))
def test_avoid_single_finds_a_split_whenever_one_exists(pairs):
    from hetlb.core.decisions import SingleSampleError, avoid_single
    room = np.array([max(a, b) for a, b in pairs], np.int64)
    sizes = np.array([min(a, b) for a, b in pairs], np.int64)
    brute = _no_single_brute(sizes.tolist(), room.tolist())
    try:
        out = avoid_single(sizes, room)
    except SingleSampleError:
        assert brute is None, (sizes, room)
        return
    assert brute is not None
    assert not np.any(out == 1) and out.sum() == sizes.sum()
    assert np.all(out >= 0) and np.all(out <= room)
    if not np.any(sizes == 1):
        assert out is sizes


def test_no_split_of_a_board_gives_one_sample_when_refused():
    from hetlb.core.decisions import SingleSampleError
    # the short last step: 3 samples by shares [4, 4] with lower 2 would be [2, 1]
    boards, samplers = ranks(19, 8, 2, shuffle=False)
    for b in boards:
        b.lower = np.array([2, 2])
        b.single_ok = False
        b.post(np.array([4, 4]))
    got = [[len(i) for i in s] for s in samplers]
    assert got == [[4, 4, 3], [4, 4, 0]]
    # a size-aware step whose schedule gives rank 2 one sample: it goes to another rank
    board = PlanBoard(3, 0, 6)
    board.single_ok = False
    board.post(ScheduleRule(slope=np.array([1.0, 1.0, 1.0]), intercept=np.array([0.0, 0.0, 0.0])))
    plan = board.draw(0, 0, 6, 1, np.array([9.0, 4.0, 4.0, 1.0, 1.0, 1.0]))
    assert not np.any(plan.sizes == 1) and plan.sizes.sum() == 6
    assert np.bincount(plan.assignment, minlength=3).tolist() == plan.sizes.tolist()
    # one sample in the whole step: nothing to do but refuse, naming what to change
    board = PlanBoard(2, 0, 8)
    board.single_ok = False
    board.post(np.array([4, 4]))
    with pytest.raises(SingleSampleError, match="drop_last=True.*lower="):
        board.draw(0, 2, 1, 2)


@given(gb=st.integers(1, 12), acc=st.integers(1, 4), acc2=st.integers(1, 8),
       windows=st.integers(0, 20), tail=st.integers(0, 3), end=st.booleans())
def test_a_position_rescales_to_another_global_batch_with_the_same_samples_per_update(
        gb, acc, acc2, windows, tail, end):
    from hetlb.core.decisions import rescale_position
    per = gb * acc
    if per % acc2:
        return
    gb2 = per // acc2
    step = windows * acc + tail  # (a tail: past the whole windows, as an epoch's shorter last ones)
    pos = {"epoch": 2, "step": step, "global_batch": gb, **({"epoch_end": True} if end else {})}
    if (gb, acc) == (gb2, acc2):
        assert rescale_position(pos, (gb, acc), (gb2, acc2)) is pos
        return
    if not end and step and (step * gb) % per:
        with pytest.raises(ValueError, match="not a whole number of"):
            rescale_position(pos, (gb, acc), (gb2, acc2))
        return
    out = rescale_position(pos, (gb, acc), (gb2, acc2))
    assert out["global_batch"] == gb2 and out["epoch"] == 2 and out.get("epoch_end") == pos.get("epoch_end")
    if not end:  # the same samples of the order trained, in whole new windows
        assert out["step"] * gb2 == step * gb and out["step"] % acc2 == 0
    with pytest.raises(ValueError, match="samples per optimizer step"):
        rescale_position(pos, (gb, acc), (gb2 + 1, acc2))
