"""The loader under a user's mistakes and awkward loops: every sample of an epoch trains exactly
once, or a clear error says what to do (one process; the multi-rank forms are in
test_balancer_dist.py). Found by a new-user audit (session 19)."""
import dataclasses
from collections import Counter, UserDict, namedtuple

from hypothesis import given, strategies as st
import numpy as np
import pytest
import torch

import hetlb
from hetlb.data.collate import Packed, Padded, packed_collate, to_nested
from hetlb.data.collate import EmptySafeCollate, _empty_like
from hetlb.data.board import PlanBoard
from hetlb.core.decisions import split_last


class Indexed(torch.utils.data.Dataset):
    """Sample ``i`` is ``(tensor([i]), i)``."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i)]), i


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(1, 1)


def step(m, x):
    m(x).sum().backward()
    for p in m.parameters():
        p.grad = None


def test_an_older_iterator_refuses_once_a_newer_one_started():
    m = model()
    bal = hetlb.Balancer(m, 2, policy=hetlb.Uniform())
    ld = bal.loader(Indexed(10))
    seen = []
    outer = iter(ld)
    x, i = next(outer)
    step(m, x)
    seen += i.tolist()
    for x, i in ld:  # a newer loop: it goes on from the position (step 1) to the epoch's end
        step(m, x)
        seen += i.tolist()
    assert sorted(seen) == list(range(10))
    with pytest.raises(RuntimeError, match="newer iteration"):
        next(outer)
    assert bal.steps == 5


def test_nested_loops_refuse_instead_of_training_twice():
    m = model()
    bal = hetlb.Balancer(m, 2, policy=hetlb.Uniform())
    ld = bal.loader(Indexed(8))
    seen = []
    with pytest.raises(RuntimeError, match="newer iteration"):
        for x, i in ld:
            step(m, x)
            seen += i.tolist()
            for x2, i2 in ld:
                step(m, x2)
                seen += i2.tolist()
                break
    assert max(Counter(seen).values()) == 1


def test_a_refused_second_loader_leaves_the_first_untouched():
    m = model()
    bal = hetlb.Balancer(m, 4, policy=hetlb.Uniform())
    ld = bal.loader(Indexed(40))
    with pytest.raises(ValueError, match="already drives a loader"):
        bal.loader(Indexed(8))
    seen = []
    for k, (x, i) in enumerate(ld):
        step(m, x)
        seen += i.tolist()
        if k == 2:
            break
    assert ld.epoch == 0 and len(ld) == 7
    state = bal.state_dict()
    assert not state["position"].get("epoch_end", False)
    m2 = model()
    bal2 = hetlb.Balancer(m2, 4, policy=hetlb.Uniform())
    ld2 = bal2.loader(Indexed(40))
    ld2.load_state_dict(state)
    for x, i in ld2:
        step(m2, x)
        seen += i.tolist()
    assert sorted(seen) == list(range(40))


class Triples(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def _accumulating_run(break_at=None, zero=False):
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    bal = hetlb.Balancer(m, 2, policy=hetlb.Uniform(), accumulate=2)
    ld = bal.loader(Triples(), shuffle=False)
    seen = []

    def micro(x, y, i):
        with bal.step():
            (torch.nn.functional.mse_loss(m(x), y) / 2).backward()
        seen.extend(i.tolist())
        if bal.synced:
            opt.step()
            opt.zero_grad()

    for k, (x, y, i) in enumerate(ld):
        micro(x, y, i)
        if k == break_at:
            break
    if break_at is not None:
        if zero:
            opt.zero_grad(set_to_none=zero == "none")
        for x, y, i in ld:
            micro(x, y, i)
    return m, seen


def test_a_new_loop_inside_an_accumulation_window_with_its_gradient_kept_raises():
    with pytest.raises(RuntimeError, match="accumulation window"):
        _accumulating_run(break_at=0)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_new_loop_after_the_window_s_gradient_was_dropped_redoes_the_window(set_to_none):
    ref, seen_ref = _accumulating_run()
    # zero_grad(set_to_none=False) leaves zeros: the same (nothing would count twice)
    got, seen = _accumulating_run(break_at=0, zero="none" if set_to_none else "zeros")
    assert seen[2:] == seen_ref  # the first micro-step (2 samples) is trained again, from zero
    for a, b in zip(ref.parameters(), got.parameters()):
        torch.testing.assert_close(a, b)


def test_breaking_at_a_window_end_then_a_new_loop_goes_on():
    ref, seen_ref = _accumulating_run()
    got, seen = _accumulating_run(break_at=1)
    assert seen == seen_ref
    for a, b in zip(ref.parameters(), got.parameters()):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------- the short last step


@given(st.lists(st.integers(0, 30), min_size=1, max_size=6), st.data())
def test_split_last_keeps_every_rank_at_its_lower_bound_when_the_step_allows(shares, data):
    shares = np.array(shares, np.int64)
    if shares.sum() == 0:
        shares[0] = 1
    lower = np.array([data.draw(st.integers(0, int(s))) for s in shares], np.int64)
    count = data.draw(st.integers(0, int(shares.sum())))
    sizes = split_last(shares, count, lower)
    assert sizes.sum() == count and (sizes >= 0).all() and (sizes <= shares).all()
    if count == shares.sum():
        assert sizes.tolist() == shares.tolist()
    if count >= lower.sum():
        assert (sizes >= lower).all() and (sizes <= shares).all()
    elif any(0 < lo <= count for lo in lower.tolist()):  # not every rank can have its bound
        assert any(lo > 0 and v >= lo for v, lo in zip(sizes.tolist(), lower.tolist()))
    assert split_last(shares, count, np.zeros_like(shares)).tolist() == split_last(shares, count).tolist()


def test_split_last_brute_force_on_tiny_cases():
    # count >= sum(lower): the sizes within [lower, shares] closest to the proportional split
    for shares in ([14, 2], [3, 3, 2], [5, 0, 1]):
        shares = np.array(shares)
        for lower in np.ndindex(*(s + 1 for s in shares)):
            lower = np.array(lower)
            for count in range(int(lower.sum()), int(shares.sum()) + 1):
                got = split_last(shares, count, lower)
                ideal = count * shares / shares.sum()
                best = min((np.abs(np.array(c) - ideal).max()
                            for c in np.ndindex(*(s + 1 for s in shares))
                            if sum(c) == count and all(lo <= v for lo, v in zip(lower, c))),
                           default=None)
                assert np.abs(got - ideal).max() <= best + 1, (shares, lower, count, got)


def test_the_board_splits_the_short_last_step_within_lower():
    board = PlanBoard(2, 0, 16)
    board.lower = np.array([2, 2])
    board.post(np.array([14, 2]))
    plan = board.draw(0, 1, 5, 1)
    assert plan.sizes.tolist() == [3, 2]
    plan = board.draw(0, 1, 4, 1)
    assert plan.sizes.tolist() == [2, 2]
    plan = board.draw(0, 1, 3, 1)
    assert sorted(plan.sizes.tolist()) == [0, 3]
    board = PlanBoard(2, 0, 6)
    board.lower = np.array([3, 3])
    board.post(np.array([3, 3]))
    assert board.draw(0, 1, 5, 1).sizes.tolist() == [3, 2]  # never above a share (upper)


# ---------------------------------------------------------------------- empty batches


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    names: list
    tag: str = "train"


def _collated_empty(sample, collate):
    return EmptySafeCollate(_One(sample), collate)([])


class _One(torch.utils.data.Dataset):
    def __init__(self, sample):
        self.sample = sample

    def __len__(self):
        return 1

    def __getitem__(self, i):
        return self.sample


def test_an_empty_batch_holds_no_sample_whatever_the_collate_returns():
    from torch.utils.data import default_collate
    # Strings collate into lists: an empty batch has empty lists, not sample 0's text.
    e = _collated_empty((torch.ones(3), "text0"), default_collate)
    assert e[0].shape == (0, 3) and len(e[1]) == 0
    e = _collated_empty({"x": torch.ones(2), "name": "a"}, default_collate)
    assert e["x"].shape == (0, 2) and len(e["name"]) == 0
    # The identity collate: a list of samples.
    assert _collated_empty((torch.ones(1), 0), lambda b: b) == []
    # A mapping other than dict (e.g. transformers' BatchEncoding is a UserDict).
    e = _collated_empty(torch.ones(2), lambda b: UserDict(x=torch.stack(b)))
    assert isinstance(e, UserDict) and e["x"].shape == (0, 2)
    # A dataclass batch; a field that is not per sample is kept.
    e = _collated_empty(("a", torch.ones(2)),
                        lambda b: Batch(torch.stack([s[1] for s in b]), [s[0] for s in b]))
    assert isinstance(e, Batch) and e.x.shape == (0, 2) and e.names == [] and e.tag == "train"
    # Padded and packed batches drop their per-sample strings too.
    e = _collated_empty((torch.ones(4, 2), "t"), hetlb.data.collate.pad_collate)
    assert isinstance(e, Padded) and e.data.shape[0] == 0 and len(e.rest[0]) == 0
    e = _collated_empty((torch.ones(4, 2), "t"), packed_collate)
    assert isinstance(e, Packed) and e.data.shape[0] == 0 and e.cu_seqlens.tolist() == [0]


def test_an_empty_batch_never_raises_on_the_idle_rank():
    # An idle rank that raised would leave the others waiting in the all-reduce: what hetlb cannot
    # read as per-sample is kept, a count of the samples becomes 0, grown dimensions are cut.
    class Opaque:
        def __init__(self, n):
            self.n = n

    e = _collated_empty(torch.ones(1), lambda b: Opaque(len(b)))
    assert isinstance(e, Opaque)
    e = _collated_empty(torch.ones(2), lambda b: (torch.stack(b), len(b), float("nan")))
    assert e[0].shape == (0, 2) and e[1] == 0 and e[2] != e[2]
    e = _collated_empty(torch.ones(2), lambda b: {"x": torch.stack(b), "pairs": torch.ones(len(b), len(b))})
    assert e["x"].shape == (0, 2) and e["pairs"].shape == (0, 0)
    # A tensor that does not grow with the samples is not per sample: kept whole (a causal mask
    # or a position table shared by the batch; cut to 0 rows an attention layer refuses it).
    e = _collated_empty(torch.ones(2), lambda b: (torch.stack(b), torch.tril(torch.ones(5, 5)),
                                                  torch.arange(5)))
    assert e[0].shape == (0, 2) and e[1].shape == (5, 5) and e[2].tolist() == list(range(5))
    e = _collated_empty(torch.ones(2), lambda b: {"x": torch.stack(b), "scale": torch.tensor(2.0)})
    assert e["x"].shape == (0, 2) and e["scale"].item() == 2.0


def test_empty_like_of_a_batch_handles_lists_of_strings_and_mappings():
    Pair = namedtuple("Pair", "x y")
    e = _empty_like({"a": torch.ones(3, 2), "names": ["p", "q", "r"], "c": Pair(torch.ones(3), "s")})
    assert e["a"].shape == (0, 2) and e["names"] == [] and e["c"].x.shape == (0,)
    e = _empty_like(UserDict(a=torch.ones(3)))
    assert isinstance(e, UserDict) and e["a"].shape == (0,)


def test_to_nested_of_an_empty_packed_batch_says_what_to_do():
    empty = packed_collate([(torch.ones(3, 4),)]).empty()
    with pytest.raises(ValueError, match="no samples.*nested_tensor"):
        to_nested(empty)


# ---------------------------------------------------------------------- the loader's arguments


@pytest.mark.parametrize("kwargs, match", [
    ({"drop_last": "False"}, "drop_last must be True or False"),
    ({"shuffle": "no"}, "shuffle must be True or False"),
    ({"sample_sizes": ["1"] * 10}, "sample_sizes"),
    ({"seed": 2 ** 70}, "seed"),
    ({"seed": -1}, "seed"),
])
def test_loader_arguments_are_checked(kwargs, match):
    bal = hetlb.Balancer(model(), 2, policy=hetlb.Uniform())
    with pytest.raises(ValueError, match=match):
        bal.loader(Indexed(10), **kwargs)


def test_an_iterable_dataset_is_refused_clearly():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

        def __len__(self):
            return 10

    bal = hetlb.Balancer(model(), 2, policy=hetlb.Uniform())
    with pytest.raises(TypeError, match="map-style"):
        bal.loader(Stream())


def test_a_checkpoint_position_without_a_step_or_past_the_epoch_is_refused():
    bal = hetlb.Balancer(model(), 2, policy=hetlb.Uniform())
    ld = bal.loader(Indexed(10))
    state = bal.state_dict()
    bad = dict(state, position={k: v for k, v in state["position"].items() if k != "step"})
    with pytest.raises(ValueError, match="no 'step'"):
        ld.load_state_dict(bad)
    bad = dict(state, position=dict(state["position"], step=99))
    with pytest.raises(ValueError, match="past the end"):
        ld.load_state_dict(bad)
    ld.load_state_dict(dict(state, position=dict(state["position"], step=5)))  # the epoch's end
    assert ld.epoch == 1


def test_batch_sizes_under_a_size_aware_rule_are_the_last_step_s():
    bal = hetlb.Balancer(model(), 4, policy=hetlb.Chronica(), lower=0)
    ld = bal.loader(Indexed(8), sample_sizes=np.arange(1.0, 9.0))
    m = bal.model
    sizes = []
    for x, i in ld:
        step(m, x)
        sizes.append(bal.batch_sizes.tolist())
        assert sizes[-1] == [len(i)]
    assert bal.batch_sizes.tolist() == sizes[-1]  # between steps: the last step's, not zeros
