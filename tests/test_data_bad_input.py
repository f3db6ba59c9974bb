"""Dataset-level bad input (issue 15): sample sizes that are not data amounts, a dataset whose
length changes, a checkpoint resumed over another dataset, another global batch or another
partition setting. Each is a ValueError naming the field, the values and what to do, or a
documented recovery tested here; none hangs and none changes the sample order silently.

(Another world size is a supported resume, not bad input: test_loader_machine.py.)
"""
import re

import numpy as np
import pytest
import torch

import hetlb
from hetlb.data.loader import BalancedLoader
from hetlb.data.sampler import GlobalOrderSampler, dataset_sample_sizes
from hetlb.data.board import PlanBoard


class Indices(torch.utils.data.Dataset):
    """Sample ``i`` is the number ``i``; the length can change (``n``)."""

    def __init__(self, n, sizes=None):
        self.n, self.sizes = n, sizes

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return int(i)


class WithMethod(Indices):
    def sample_size(self, i):
        return self.sizes[i]


class ChronicaStyle(Indices):
    def __sizeof__(self, index):
        return self.sizes[index]


def balancer(batch, dataset, **kw):
    """A one-rank Balancer and its loader (no process group needed)."""
    model = torch.nn.Linear(1, 1).double()
    bal = hetlb.Balancer(model, batch, policy=hetlb.Uniform())
    return model, bal, bal.loader(dataset, **kw)


def train(model, loader, steps=None):
    """The plain loop; returns the samples trained."""
    seen = []
    for k, x in enumerate(loader):
        model(x.double()[:, None]).sum().backward()
        seen += x.tolist()
        if steps is not None and k + 1 == steps:
            break
    return seen


# ---------------------------------------------------------------- sample sizes


@pytest.mark.parametrize("bad", [-2.0, float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("partition", [None, "even"])
def test_sizes_that_are_not_data_amounts_are_refused(bad, partition):
    sizes = [1.0, bad, 3.0, bad]
    with pytest.raises(ValueError) as e:
        BalancedLoader(Indices(4), board=PlanBoard(2, 0, 2), sample_sizes=sizes, partition=partition)
    msg = str(e.value)
    assert msg.startswith("sample_sizes: sizes must be finite and non-negative")
    assert f"sample 1 has {bad!r}" in msg and f"sample 3 has {bad!r}" in msg and "(2 bad of 4)" in msg
    assert "Fix those sizes, or leave the samples out" in msg


@pytest.mark.parametrize("partition", [None, "even"])
def test_sizes_too_large_to_sum_are_refused(partition):
    # A user audit, session 26: 1e300 was taken, with only NumPy's overflow warning (its square
    # is inf in the step's sums of squared sizes).
    with pytest.raises(ValueError, match=r"sample_sizes: sample 2 has size 1e\+300, above 1e\+15 "
                                         r"\(1 such of 4\).*larger unit"):
        BalancedLoader(Indices(4), board=PlanBoard(2, 0, 2), sample_sizes=[1.0, 2.0, 1e300, 3.0],
                       partition=partition)
    BalancedLoader(Indices(4), board=PlanBoard(2, 0, 2), sample_sizes=[1.0, 2.0, 1e15, 3.0],
                   partition=partition)


@pytest.mark.parametrize("kind,source", [(WithMethod, "WithMethod.sample_size(index)"),
                                         (ChronicaStyle, "ChronicaStyle.__sizeof__(index)")])
def test_sizes_a_dataset_declares_are_checked_and_named(kind, source):
    ds = kind(3, [1.0, float("nan"), 2.0])
    with pytest.raises(ValueError, match=re.escape(source) + ": .*sample 1 has nan"):
        dataset_sample_sizes(ds)
    with pytest.raises(ValueError, match="sample 1 has nan"):
        balancer(2, ds)
    with pytest.raises(ValueError, match=r"size of sample 2 is 'x', not a number"):
        dataset_sample_sizes(kind(3, [1.0, 2.0, "x"]))


def test_zero_sizes_are_data_amounts():
    loader = BalancedLoader(Indices(3), board=PlanBoard(1, 0, 2), sample_sizes=[0.0, 0.0, 1.0])
    assert loader.sample_sizes.tolist() == [0.0, 0.0, 1.0]


def test_sizes_changed_in_place_later_do_not_reach_the_loader():
    sizes = np.array([1.0, 2.0, 3.0, 4.0])
    loader = BalancedLoader(Indices(4), board=PlanBoard(2, 0, 2), sample_sizes=sizes)
    sizes[0] = -5.0  # the caller's array
    assert loader.sample_sizes.tolist() == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="read-only"):
        loader.sample_sizes[0] = 7.0


def test_a_step_of_only_zero_size_samples_under_size_weighting():
    """weighting='sizes' with a step whose samples all have size 0 (legal sizes): the step is
    weighed by samples (0/0 has no answer) and training goes on over every sample."""
    model = torch.nn.Linear(1, 1).double()
    bal = hetlb.Balancer(model, 2, policy=hetlb.Uniform(), weighting="sizes")
    loader = bal.loader(Indices(4), sample_sizes=[0.0, 0.0, 1.0, 1.0], shuffle=False)
    assert sorted(train(model, loader)) == [0, 1, 2, 3]


@pytest.mark.parametrize("sizes,match", [
    ([1.0, 2.0], r"sample_sizes must be 3 finite non-negative numbers .one per sample., got shape \(2,\)"),
    ([[1.0], [2.0], [3.0]], r"got shape \(3, 1\)"),
    (["a", "b", "c"], "sample_sizes must be 3 numbers"),
])
def test_sizes_of_the_wrong_shape(sizes, match):
    with pytest.raises(ValueError, match=match):
        BalancedLoader(Indices(3), board=PlanBoard(1, 0, 2), sample_sizes=sizes)


# ---------------------------------------------------------------- a dataset changing length


@pytest.mark.parametrize("new", [25, 15])
def test_a_dataset_changing_length_between_epochs_is_refused(new):
    ds = Indices(20)
    model, bal, loader = balancer(4, ds, seed=1)
    assert sorted(train(model, loader)) == list(range(20))
    ds.n = new
    with pytest.raises(ValueError, match=rf"len\(dataset\) is {new} now, 20 when this loader was made.*"
                                         r"checkpoint at the end of an epoch"):
        iter(loader)
    ds.n = 20  # back as it was: training goes on, epoch 1 whole
    loader.set_epoch(1)
    assert sorted(train(model, loader)) == list(range(20))


def test_a_dataset_changing_length_mid_epoch_is_refused():
    ds = Indices(20)
    model, bal, loader = balancer(4, ds, seed=1)
    first = train(model, loader, steps=2)
    ds.n = 30
    with pytest.raises(ValueError, match="len.dataset. is 30 now, 20"):
        next(iter(loader))
    ds.n = 20
    assert sorted(first + train(model, loader)) == list(range(20))  # nothing lost meanwhile


@pytest.mark.parametrize("new", [27, 13])
@pytest.mark.parametrize("sharded", [False, True])
def test_recovery_checkpoint_at_the_end_of_an_epoch_resumes_over_the_changed_dataset(new, sharded):
    """The documented recovery: a checkpoint that closed its epoch resumes in a new job over
    another dataset (more or fewer samples, other sizes, another seed), at the next epoch."""
    part = "even" if sharded else None
    model, bal, loader = balancer(4, Indices(20), seed=1, sample_sizes=np.arange(20.0) + 1,
                                  partition=part)
    assert sorted(train(model, loader)) == list(range(20))
    state = bal.state_dict()
    assert state["position"]["epoch_end"] and state["position"]["step"] == 5
    model2, bal2, loader2 = balancer(4, Indices(new), seed=9, sample_sizes=np.ones(new),
                                     partition=None if sharded else part)
    if sharded:  # a sharded checkpoint holds the owner of every sample: same partition= setting
        with pytest.raises(ValueError, match="taken with a sharded loader and this loader is global-order"):
            loader2.load_state_dict(state)
        model2, bal2, loader2 = balancer(4, Indices(new), seed=9, partition=part)
        with pytest.raises(ValueError, match=f"partition covers 20 samples, the dataset has {new}"):
            loader2.load_state_dict(state)
        return
    loader2.load_state_dict(state)
    assert loader2.epoch == 1 and len(loader2) == -(-new // 4)
    with pytest.raises(ValueError, match="epoch 0 is already complete"):
        loader2.set_epoch(0)
    loader2.set_epoch(1)
    assert sorted(train(model2, loader2)) == list(range(new))
    assert loader2.epoch == 2


@pytest.mark.parametrize("order", ["board", "loader"])
def test_recovery_on_emulated_ranks_and_loaded_before_the_loader(order):
    """The same on three emulated ranks (one board per rank, as test_data.py), the checkpoint
    loaded into the board before the loader is made (Balancer.load_state_dict before
    bal.loader()) or into the loader."""
    old = PlanBoard(3, 0, 6)
    GlobalOrderSampler(20, old, seed=1)
    old.done = old.steps_per_epoch  # epoch 0 trained
    config = GlobalOrderSampler(20, PlanBoard(3, 0, 6), seed=1).config()
    state = {"position": old.position(), "loader": config}
    seen = []
    boards = [PlanBoard(3, r, 6) for r in range(3)]
    samplers = []
    for b in boards:
        if order == "board":
            b.load_position(state["position"])
            samplers.append(BalancedLoader(Indices(31), board=b, seed=2).order)
        else:
            loader = BalancedLoader(Indices(31), board=b, seed=2)
            loader.load_state_dict(state)
            samplers.append(loader.order)
        b.post(np.array([1, 2, 3]))
        assert b.epoch_finished()
        b.restart()
        assert (b.epoch, b.done) == (1, 0)
    its = [iter(s) for s in samplers]
    for _ in range(6):
        for r, it in enumerate(its):
            seen += next(it)
            boards[r].complete(boards[r].hand())
    assert sorted(seen) == list(range(31)) and all(b.epoch_finished() for b in boards)


# ---------------------------------------------------------------- a checkpoint of another dataset


def mid_epoch_state(n=20, batch=4, **kw):
    model, bal, loader = balancer(batch, Indices(n), **kw)
    train(model, loader, steps=2)
    return bal.state_dict()


@pytest.mark.parametrize("change,match", [
    (dict(n=25, sample_sizes=np.arange(25.0)), r"length=20 then, 25 now"),
    (dict(seed=2), r"seed=1 then, 2 now"),
    (dict(shuffle=False), r"shuffle=True then, False now"),
    (dict(drop_last=True), r"drop_last=False then, True now"),
    (dict(sample_sizes=np.arange(20.0)[::-1].copy()), r"sample_sizes_crc=\d+ then, \d+ now"),
    (dict(sample_sizes=None), r"sample_sizes=190.0 then, None now"),
])
@pytest.mark.parametrize("into", ["balancer", "loader"])
def test_a_mid_epoch_checkpoint_over_another_dataset_is_refused(change, match, into):
    base = dict(n=20, seed=1, shuffle=True, drop_last=False, sample_sizes=np.arange(20.0))
    state = mid_epoch_state(**base)
    kw = {**base, **change}
    n = kw.pop("n")
    if into == "balancer":
        model, bal, loader = balancer(4, Indices(n), **kw)
    else:  # made before its Balancer, the checkpoint loaded into it
        loader = hetlb.DataLoader(Indices(n), batch_size=4, **kw)
    before = loader.board.position()
    with pytest.raises(ValueError, match=r"taken in the middle of epoch 0 \(after step 2\) with a "
                                         r"different global order.*" + match + r".*Resume with the same "
                                         r"dataset.*or from a checkpoint taken at the end of an epoch"):
        loader.load_state_dict(state)
    assert loader.board.position() == before  # nothing changed


def test_sizes_that_sum_the_same_but_differ_would_move_a_sharded_epoch():
    """Why the sizes' CRC is checked: in sharded mode a step's samples are cut by the sizes, so
    the steps already trained would not be the same samples under other sizes."""
    sizes = np.arange(1.0, 21.0)
    other = sizes[::-1].copy()  # the same sum
    model, bal, loader = balancer(4, Indices(20), sample_sizes=sizes, partition="even")
    first = train(model, loader, steps=2)
    state = bal.state_dict()
    _, bal2, loader2 = balancer(4, Indices(20), sample_sizes=other, partition="even")
    with pytest.raises(ValueError, match="sample_sizes_crc"):
        loader2.load_state_dict(state)
    # with the check out of the way the resumed epoch would repeat and lose samples
    state["loader"] = dict(state["loader"], sample_sizes_crc=bal2._loader_config["sample_sizes_crc"])
    loader2.load_state_dict(state)
    rest = train(bal2.model, loader2)
    assert sorted(first + rest) != list(range(20))


@pytest.mark.parametrize("into", ["balancer", "loader", "board"])
def test_a_checkpoint_of_other_samples_per_update_is_refused(into):
    state = mid_epoch_state(batch=4)
    both = (r"4 x accumulate=1 = 4 samples per optimizer step, this Balancer global_batch=8 x "
            r"accumulate=1 = 8: resume with the checkpoint's global_batch=4 and accumulate=1, or "
            r"with any global_batch x accumulate = 4")
    if into == "balancer":
        model, bal, loader = balancer(8, Indices(20))
        with pytest.raises(ValueError, match=both):
            loader.load_state_dict(state)
    elif into == "loader":  # made first: its Balancer converts the position or refuses it
        loader = hetlb.DataLoader(Indices(20), batch_size=8)
        loader.load_state_dict(state)
        with pytest.raises(ValueError, match=both):
            hetlb.Balancer(torch.nn.Linear(1, 1).double(), policy=hetlb.Uniform(), loader=loader)
    else:
        with pytest.raises(ValueError, match="Resume with global_batch=4"):
            PlanBoard(2, 0, 8).load_position(state["position"])


@pytest.mark.parametrize("order", ["balancer-first", "loader-first", "bound"])
def test_a_checkpoint_of_the_other_partition_setting_is_refused(order):
    sharded = mid_epoch_state(partition="even")
    plain = mid_epoch_state()
    for state, part, other in ((sharded, None, "sharded"), (plain, "even", "global-order")):
        model = torch.nn.Linear(1, 1).double()
        match = f"taken with a {other} loader.*resume with the same partition= setting"
        with pytest.raises(ValueError, match=match):
            if order == "balancer-first":
                bal = hetlb.Balancer(model, 4, policy=hetlb.Uniform())
                bal.load_state_dict(state)
                bal.loader(Indices(20), partition=part)
            elif order == "loader-first":
                hetlb.DataLoader(Indices(20), batch_size=4, partition=part).load_state_dict(state)
            else:
                bal = hetlb.Balancer(model, 4, policy=hetlb.Uniform())
                bal.loader(Indices(20), partition=part).load_state_dict(state)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_checkpoint_loaded_before_the_loader_resumes_exactly(sharded):
    """docs/data.md: 'a state loaded before the loader exists is kept' (sharded mode too)."""
    part = "even" if sharded else None
    model, bal, loader = balancer(4, Indices(22), seed=3, partition=part)
    first = train(model, loader, steps=3)
    state = bal.state_dict()
    model2 = torch.nn.Linear(1, 1).double()
    bal2 = hetlb.Balancer(model2, 4, policy=hetlb.Uniform())
    bal2.load_state_dict(state)
    loader2 = bal2.loader(Indices(22), seed=3, partition=part)
    assert len(loader2) == 6 - 3
    rest = train(model2, loader2)
    assert sorted(first + rest) == list(range(22))


def test_a_mid_epoch_checkpoint_loaded_before_a_loader_over_another_dataset_is_refused():
    state = mid_epoch_state(n=20, seed=1)
    bal = hetlb.Balancer(torch.nn.Linear(1, 1).double(), 4, policy=hetlb.Uniform())
    bal.load_state_dict(state)
    with pytest.raises(ValueError, match="length=20 then, 25 now"):
        bal.loader(Indices(25), seed=1)


def test_a_checkpoint_loaded_early_waits_on_the_board_and_is_applied_once_when_the_loader_binds():
    """hetlb.data.early: the board holds what a checkpoint loaded before binding still has to
    apply (the owner's part, the loader order to check), and the binding applies it once."""
    state = mid_epoch_state(n=20, seed=1)
    board = PlanBoard(1, 0, 4)
    board.load_position(state["position"])  # Balancer.load_state_dict before bal.loader()
    board.keep_order({"loader": state["loader"], "position": state["position"]})
    assert board.holds_checkpoint() and board.owner_state() is None
    other = BalancedLoader(Indices(25), board=board, seed=1)
    with pytest.raises(ValueError, match="length=20 then, 25 now"):
        other.bind(object(), object())
    assert other.balancer is None  # refused: not bound, and the order still waits for a loader
    with pytest.raises(ValueError, match="length=20 then, 25 now"):
        board.bind(other.order.config())
    loader = BalancedLoader(Indices(20), board=PlanBoard(1, 0, 4), seed=1)
    loader.load_state_dict(state)  # a hetlb.DataLoader made before its Balancer
    assert loader.state_dict() is state  # its Balancer's part, kept for the Balancer
    assert loader.bind(object(), object()) is state  # handed over when it binds
    assert loader.board.owner_state() is None and loader.board.bind({}) is None  # once


@pytest.mark.parametrize("state,match", [
    ({}, r"not a hetlb loader state .* got a dict with keys \[\]"),
    ({"steps": 3}, r"got a dict with keys \['steps'\]"),
    ([1, 2], "got list"),
    ({"position": {"step": 2}}, r"not a hetlb data position .* with keys \['step'\]"),
    ({"position": {"epoch": -1, "step": 0, "global_batch": 4}}, "checkpoint epoch must be an integer >= 0"),
    ({"position": {"epoch": 0, "step": 1.5, "global_batch": 4}}, "checkpoint step must be an integer"),
])
def test_something_else_than_a_loader_state(state, match):
    loader = hetlb.DataLoader(Indices(20), batch_size=4)
    with pytest.raises(ValueError, match=match):
        loader.load_state_dict(state)
