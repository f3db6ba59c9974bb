"""The loader as a state machine (issue 15): arbitrary sequences of per-step size changes,
checkpoints at any point of the loop, restarts (on another world size too) and epochs keep every
epoch's *committed* samples exactly once.

Ranks are emulated in one process, as in test_data.py: one ``hetlb.DataLoader`` per rank, each
on its own ``PlanBoard``, all fed the same decisions (what replicated decisions guarantee). The
Balancer needs a process group for more than one rank, so each emulated rank's loader is bound
to a ``_Rank``: a few lines doing to the board exactly what ``hetlb.Balancer`` does through the
loader's protocol (``_iteration_starts`` / ``_before_next`` / ``_handed``, ``state_dict`` /
``load_state_dict``; see balancer.py), with a decision per step that is an arbitrary split (a
seeded function of the step, so every rank posts the same one). A second machine drives the real
``hetlb.Balancer`` on one rank through the same rules, so the emulation cannot drift from it.

The rules: a new ``for`` loop; the next batch on every rank (batches not trained yet queue, as
in a loop that fetches ahead; the oldest one's step ends there if its forward ran); the oldest
queued batch's forward and backward, or its forward alone (its step then counts without
gradients, as in a loop body that skips the backward); a read of the position that settles a
trained step (``len(loader)``); the rest of the iteration, its queued batches trained after the
loader ran out (as a loop fetching ahead does) or left, which the next loop refuses; ``set_epoch`` of
``loader.epoch`` (and of other epochs, which must be refused); ``state_dict`` on every rank at
any point (between yields, after a yield before the backward, mid-epoch, at an epoch's end);
a restart from any checkpoint taken so far on 1 to 5 ranks, the state loaded into the bound
loader, into the loader before its Balancer exists, or into the Balancer before its loader
exists; a crash (a few steps, a checkpoint, a restart from it); a checkpoint loaded into the
running loaders. The layouts: global order (with or without ``drop_last``, with or without
per-sample sizes, split by sizes or by size-aware ScheduleRules as Chronica posts) and sharded
(``partition="even"``, rebalanced at every epoch's end).

What "committed" means: a step counts once the Balancer marks it trained on the board
(``PlanBoard.complete``); a restart rolls the committed record back to what the loaded checkpoint
had committed (the model would roll back with it). Invariants, after every rule:

* every epoch before the current one was committed exactly once (``drop_last``: exactly the
  epoch's whole global batches, the tail of the permutation never);
* the current epoch's committed samples are exactly what the position says is trained;
* every batch handed out is the plan's: the same plan on every rank, each rank's batch of the
  plan's size and exactly its slice (or assigned samples, or samples of its own shard).
"""
import functools
import io

import numpy as np
import pytest
import torch
from hypothesis import event as _event, given, settings, strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import hetlb
from hetlb.data.loader import BalancedLoader, check_loader_config
from hetlb.data.board import PlanBoard
from hetlb.core.decisions import ScheduleRule, split_last
from hetlb.data.shards import Partition


class Indices(torch.utils.data.Dataset):
    """Sample ``i`` is the number ``i``: a batch shows which samples it holds."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return int(i)


def event(what):
    """Count ``what`` in ``--hypothesis-show-statistics`` (outside a test run: nothing)."""
    if currently_in_test_context():
        _event(what)


@functools.lru_cache(maxsize=4096)
def decide(seed, g, world, batch, rules):
    """The emulated policy's decision after ``g`` trained steps on ``world`` ranks: an arbitrary
    split of the global batch (ranks with none, one rank with all, random shares), or with
    ``rules`` sometimes a size-aware ScheduleRule (as Chronica's)."""
    rng = np.random.default_rng([seed, g, world, 7])
    kind = int(rng.integers(5 if rules else 4))
    if kind == 0:
        return split_last(np.ones(world, np.int64), batch)
    if kind == 1:
        d = np.zeros(world, np.int64)
        d[rng.integers(world)] = batch
        return d
    if kind in (2, 3):
        w = rng.random(world) * (rng.random(world) > 0.3)
        if w.sum() == 0:
            w[rng.integers(world)] = 1.0
        return split_last(np.maximum(1, np.round(w * 1000)).astype(np.int64) * (w > 0), batch)
    return ScheduleRule(rng.uniform(1e-3, 1e-2, world), rng.uniform(0, 1e-2, world),
                        pivot=bool(rng.integers(2)), quadratic=float(rng.choice([0.0, 0.01])))


@functools.lru_cache(maxsize=1024)
def rebalance_speeds(seed, epoch, world):
    rng = np.random.default_rng([seed, epoch, world, 11])
    return rng.uniform(0.5, 2.0, world), rng.uniform(0.0, 0.01, world)


class _Rank:
    """One emulated rank's Balancer, as the loader sees it: what hetlb.Balancer does to the plan
    board at each point of the loop (no model, no collective)."""

    def __init__(self, loader, seed, rules):
        self.loader, self.board = loader, loader.board
        self.seed, self.rules = seed, rules
        self.open = None  # the step open: the oldest batch handed out, not finished yet
        self.forwarded = False  # its forward ran
        self.trained = False  # its backward ran
        self.steps = 0  # trained steps (the Balancer's step counter)
        self.board.post(self.decision())
        pending = loader.bind(self, self)  # a state loaded before binding, or None
        self.config = loader.order.config()
        if pending is not None:
            self.load_state_dict(pending)

    def decision(self):
        return decide(self.seed, self.steps, self.board.world, self.board.global_batch, self.rules)

    # the loader's protocol (hetlb.data.protocol.StepOwner)
    def settle(self):
        if self.open is not None and self.trained:
            self._finish()
            self._arm()

    def exhausted(self):
        return None

    def iteration_starts(self):
        if self.open is not None:
            if self.trained:
                self._finish()
            else:
                self.open = None  # a peek: handed out again

    def before_next(self):
        if self.open is not None and (self.forwarded or self.trained):
            self._finish()  # trained, or stepped without gradients: it counts
            self._arm()

    def handed(self, plan):
        self._arm()

    def _arm(self):
        if self.open is None and self.board.current is not None:
            self.open, self.forwarded, self.trained = self.board.current, False, False

    def _finish(self):
        plan, self.open = self.open, None
        board = self.board
        board.complete(plan)
        self.steps += 1
        part = board.partition
        if part is not None and part.rebalance and part.pending is None and \
                plan.epoch == board.epoch and board.epoch_finished():
            part.plan(*rebalance_speeds(self.seed, plan.epoch, board.world))
        board.post(self.decision())

    def state_dict(self):
        self.settle()
        return {"steps": self.steps, "position": self.board.position(), "loader": self.config,
                "policy": {}}

    def load_state_dict(self, state):
        check_loader_config(state, self.config)
        self.open = None
        self.board.load_position(state["position"])
        self.steps = int(state["steps"])
        self.board.post(self.decision())


def to_plain(obj):
    """A state with tensors as lists (to compare the ranks' states)."""
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def roundtrip(state):
    """What a checkpoint file gives back: torch.save, then torch.load with weights_only=True."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def expected_permutation(n, seed, epoch, shuffle):
    if not shuffle:
        return np.arange(n)
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).numpy()


class LoaderMachine(RuleBasedStateMachine):
    """Emulated ranks (``_Rank``), any world size from 1 to 5."""

    real = False  # the real hetlb.Balancer (one rank)
    worlds = st.integers(1, 5)

    @initialize(n=st.integers(1, 40), batch=st.integers(1, 10), world=st.integers(1, 5),
                seed=st.integers(0, 2**16), shuffle=st.booleans(),
                layout=st.sampled_from(["global", "global", "drop_last", "sharded", "sharded"]),
                sized=st.booleans(), rules=st.booleans())
    def setup(self, n, batch, world, seed, shuffle, layout, sized, rules):
        if self.real:
            world = 1
        self.n, self.batch, self.seed, self.shuffle = n, batch, seed, shuffle
        self.drop_last, self.sharded = layout == "drop_last", layout == "sharded"
        rng = np.random.default_rng(seed)
        self.sizes = np.where(rng.random(n) < 0.1, 0.0, rng.integers(1, 50, n).astype(np.float64)) \
            if sized else None
        self.rules = rules and sized
        self.committed = {}  # epoch -> samples committed (trained by steps that count)
        self.checkpoints = []  # (state bytes, committed then, world)
        self.build(world)

    # ------------------------------------------------------------------ ranks

    def make_loader(self, world, rank, board=None):
        kw = dict(shuffle=self.shuffle, seed=self.seed, drop_last=self.drop_last,
                  sample_sizes=self.sizes, partition="even" if self.sharded else None)
        if board is None:
            board = PlanBoard(world, rank, self.batch)
        return BalancedLoader(Indices(self.n), board=board, **kw)

    def build(self, world, state=None, order="after"):
        """Fresh ranks (a restarted job); ``state`` loaded before or after binding."""
        self.world = world
        self.loaders, self.drivers = [], []
        for r in range(world):
            board = None
            if state is not None and order == "board":
                # hetlb.Balancer.load_state_dict before bal.loader(): the position waits on the board
                board = PlanBoard(world, r, self.batch)
                board.load_position(state["position"])
            loader = self.make_loader(world, r, board)
            if state is not None and order == "before":
                loader.load_state_dict(state)
            driver = _Rank(loader, self.seed, self.rules)
            if state is not None and order == "after":
                loader.load_state_dict(state)
            self.loaders.append(loader)
            self.drivers.append(driver)
        self.after_build(state)

    def teardown(self):
        # The iterators are freed here, by reference count. Left to the cyclic collector (the
        # machine dropped with them), a DataLoader iterator's queues are finalised before its
        # __del__ stops its workers: the workers never get the stop signal and each shutdown waits
        # out DataLoader's 5 s join timeout per worker (a minute an example run).
        self.iters = None

    def after_build(self, state):
        self.iters = None
        # (every rank's plan, every rank's batch) of each batch handed out and not finished,
        # oldest first, and whether the oldest one's forward and backward ran
        self.queue, self.head_forwarded, self.head_trained = [], False, False
        self.ran_out = False  # the latest loop ran out of batches (its queue may be left)
        self.left = [False] * self.world  # the ranks whose oldest queued step was completed
        self.restored = state is not None
        for r, loader in enumerate(self.loaders):
            self.watch(r, loader.board)

    def watch(self, rank, board):
        """Commit a rank's batch when the Balancer marks its step trained."""
        complete = board.complete

        def commit(plan):
            complete(plan)
            assert self.queue and plan is self.queue[0][0][rank], \
                "a step was completed that is not the oldest one handed out"
            assert plan.epoch == board.epoch, "a step completed after its epoch was left"
            assert self.head_forwarded, "a step counted whose batch was never forwarded"
            self.committed.setdefault(plan.epoch, []).extend(self.queue[0][1][rank])
            self.left[rank] = True
            if all(self.left):
                self.queue.pop(0)
                self.left = [False] * self.world
                self.head_forwarded = self.head_trained = False

        board.complete = commit

    def train(self, backward=True):
        """The loop's forward (and ``backward``) of the oldest queued batch on every rank."""
        self.head_forwarded = True
        self.head_trained = self.head_trained or backward
        for d in self.drivers:
            d.forwarded = True
            d.trained = d.trained or backward

    def new_balancer_steps(self):
        return [d.steps for d in self.drivers]

    @property
    def boards(self):
        return [loader.board for loader in self.loaders]

    # ------------------------------------------------------------------ what is expected

    def epoch_samples(self, epoch):
        if not self.drop_last:
            return list(range(self.n))
        full = (self.n // self.batch) * self.batch
        return sorted(expected_permutation(self.n, self.seed, epoch, self.shuffle)[:full].tolist())

    def check_plan(self, plans, batches, decisions, queued=0):
        """``queued``: batches handed out before this one and not finished."""
        p = plans[0]
        for q in plans[1:]:
            assert (q.epoch, q.step, q.sizes.tolist(), q.checksum) == \
                   (p.epoch, p.step, p.sizes.tolist(), p.checksum), "the ranks drew different plans"
        b = self.boards[0]
        assert (p.epoch, p.step) == (b.epoch, b.done + queued), "a step other than the next untrained one"
        for r, batch in enumerate(batches):
            assert len(batch) == p.sizes[r], f"rank {r}: a batch of {len(batch)}, the plan says {p.sizes[r]}"
            if self.sizes is not None:
                assert p.data[r] == pytest.approx(self.sizes[batch].sum())
            else:
                assert p.data[r] == len(batch)
        assert p.count > 0, "a step with no sample on any rank (its gradient cannot be weighed)"
        if self.sharded:
            owners = self.loaders[0].owners
            for r, batch in enumerate(batches):
                assert np.array_equal(self.loaders[r].owners, owners)
                assert np.all(owners[batch] == r), f"rank {r} got a sample it does not hold"
            return
        count = min(self.batch, self.n - p.step * self.batch)
        assert p.count == count and count > 0
        if self.drop_last:
            assert count == self.batch, "drop_last handed out the short last step"
        window = expected_permutation(self.n, self.seed, p.epoch, self.shuffle)[
            p.step * self.batch:p.step * self.batch + count]
        d = decisions[0]
        if p.assignment is None:
            starts = np.concatenate([[0], np.cumsum(p.sizes)])
            for r, batch in enumerate(batches):
                assert batch == window[starts[r]:starts[r + 1]].tolist(), f"rank {r}: not its slice"
            if d is not None:
                assert isinstance(d, np.ndarray)
                assert p.sizes.tolist() == (d if count == self.batch else split_last(d, count)).tolist()
        else:
            assert np.bincount(p.assignment, minlength=self.world).tolist() == p.sizes.tolist()
            for r, batch in enumerate(batches):
                assert batch == window[p.assignment == r].tolist(), f"rank {r}: not its samples"
            if d is not None:
                assert isinstance(d, ScheduleRule)

    # ------------------------------------------------------------------ rules: the loop

    @rule()
    def new_loop(self):
        """A new ``for batch in loader`` (after a break, a peek, a restart, or the next epoch).
        After a loop that ran out and left batches it received untrained (a skip before the
        forward), every rank refuses it, once."""
        self.iters = None  # the previous loop's iterators go first, as a `for` statement's do
        if self.ran_out and len(self.queue) > (1 if self.head_trained else 0):
            for loader in self.loaders:
                with pytest.raises(RuntimeError, match="left .* untrained"):
                    iter(loader)
            event("a loop that ran out with batches untrained: the next one refused")
        else:
            self.iters = [iter(loader) for loader in self.loaders]
            self.iter_epoch = self.boards[0].epoch
        self._forget()

    def _forget(self):
        """The batches handed out and not trained are handed out again."""
        self.queue, self.head_forwarded, self.head_trained = [], False, False
        self.left = [False] * self.world
        self.ran_out = False

    @precondition(lambda self: self.iters is not None)
    @rule(k=st.integers(1, 3))
    def next_batch(self, k):
        """Ask every rank for its next batch, ``k`` times (the batch queues behind those not
        trained yet; the oldest one's step ends if its forward ran)."""
        for _ in range(k):
            if self.iters is None:
                return
            out = []
            for it in self.iters:
                try:
                    out.append(next(it))
                except StopIteration:
                    out.append(StopIteration)
            stopped = [o is StopIteration for o in out]
            assert len(set(stopped)) == 1, "some ranks ran out of steps before the others"
            if stopped[0]:
                self.iters = None
                self.ran_out = True
                # set_epoch of the next epoch (loader.epoch once this one is complete) may have
                # moved the ranks on while the loop was still open: it ends then too.
                e = self.iter_epoch
                for b in self.boards:
                    assert b.epoch > e or b.epoch == e and (
                        b.epoch_finished() or b.done + len(self.queue) >= b.steps_per_epoch), \
                        "the iteration ended before every step of its epoch was handed out"
                if not self.queue:
                    assert sorted(self.committed.get(e, [])) == self.epoch_samples(e)
                    event("an epoch ran to its end")
                return
            plans = [b.handed[-1] for b in self.boards]
            # the decision posted when the step was drawn (after the previous step finished)
            decisions = [d.decision() if isinstance(d, _Rank) else None for d in self.drivers]
            batches = [o.tolist() for o in out]
            self.check_plan(plans, batches, decisions, queued=len(self.queue))
            self.queue.append((plans, batches))
            if len(self.queue) > 1:
                event("a loop fetched ahead")

    @precondition(lambda self: self.iters is not None)
    @rule(train=st.booleans())
    def run_to_the_end(self, train):
        """The rest of the iteration (``train``: every batch's forward and backward run, the
        batches queued when the loader ran out too, as a loop that fetched ahead trains them)."""
        while self.iters is not None:
            self.next_batch(1)
            if train and self.queue and not self.head_trained:
                self.train()
        while train and self.queue:
            if self.head_trained:
                self.settle()
            else:
                self.train()

    @precondition(lambda self: self.queue and not self.head_trained)
    @rule()
    def backward(self):
        self.train()

    @precondition(lambda self: self.queue and not self.head_forwarded)
    @rule()
    def forward_only(self):
        """The oldest queued batch's forward without a backward (a loop skipping it): its step
        counts (without gradients) once the next batch is asked for."""
        self.train(backward=False)

    @rule()
    def settle(self):
        """``len(loader)`` on every rank: a step whose backward ran counts from now on."""
        for loader in self.loaders:
            len(loader)

    @rule()
    def set_epoch(self):
        """The script's ``for epoch in range(loader.epoch, E): loader.set_epoch(epoch)``."""
        epochs = {loader.epoch for loader in self.loaders}
        assert len(epochs) == 1, "the ranks' loaders are at different epochs"
        e = epochs.pop()
        for loader in self.loaders:
            loader.set_epoch(e)

    @rule()
    def set_epoch_refused(self):
        """Another epoch than the position's is refused (and changes nothing but settling a
        trained step, as every set_epoch does first)."""
        self.settle()
        b = self.boards[0]
        before = [to_plain(x.position()) for x in self.boards]
        for loader in self.loaders:
            if b.epoch > 0:
                with pytest.raises(ValueError, match="already at epoch|already complete"):
                    loader.set_epoch(b.epoch - 1)
            if b.epoch_finished():
                with pytest.raises(ValueError, match="already complete"):
                    loader.set_epoch(b.epoch)
            elif b.restored:
                with pytest.raises(ValueError, match="finish that epoch first"):
                    loader.set_epoch(b.epoch + 1)
            if b.restored and b.epoch_finished():
                with pytest.raises(ValueError, match="the next epoch is"):
                    loader.set_epoch(b.epoch + 2)
        assert [to_plain(x.position()) for x in self.boards] == before

    # ------------------------------------------------------------------ rules: checkpoints

    @rule()
    def checkpoint(self):
        """``loader.state_dict()`` on every rank, anywhere in the loop."""
        states = [loader.state_dict() for loader in self.loaders]
        plain = [to_plain(s) for s in states]
        assert all(p == plain[0] for p in plain), "the ranks' checkpoints differ"
        snapshot = {e: list(v) for e, v in self.committed.items()}
        pos = states[0]["position"]
        mid = 0 < pos["step"] and not pos.get("epoch_end")
        self.checkpoints.append((roundtrip(states[0]), snapshot, self.world, mid))

    @precondition(lambda self: self.checkpoints)
    @rule(which=st.integers(0, 1 << 10), world=st.data(), mid=st.booleans(),
          order=st.sampled_from(["after", "before", "board"]))
    def restart(self, which, world, mid, order):
        """The job restarts (on any world size) from one of the checkpoints taken so far
        (``mid``: one taken in the middle of an epoch, if there is one); the state is loaded
        into the loader after it is bound to its Balancer, before, or into the Balancer (the
        plan board) before the loader exists."""
        some = [c for c in self.checkpoints if c[3]] if mid else []
        some = some or self.checkpoints
        blob, snapshot, old_world, mid = some[-1 - which % len(some)]  # 0: the latest
        state = torch.load(io.BytesIO(blob), weights_only=True)
        new_world = world.draw(self.worlds, label="world")
        self.committed = {e: list(v) for e, v in snapshot.items()}
        event(f"restart {'mid-epoch' if mid else 'at an epoch boundary'}"
              f"{' on another world size' if new_world != old_world else ''}"
              f"{' (sharded)' if self.sharded else ''}, loaded {order} binding")
        self.build(new_world, state, order)
        self.check_resumed(state)

    @precondition(lambda self: self.iters is not None)
    @rule(k=st.integers(0, 6), train=st.booleans(), world=st.data(),
          order=st.sampled_from(["after", "before", "board"]))
    def crash(self, k, train, world, order):
        """``k`` more steps, a checkpoint (after the last batch's backward, or before it), and
        the job dies and restarts from that checkpoint (on any world size)."""
        for _ in range(k):
            if self.iters is None:
                break
            self.next_batch(1)
            if self.queue and not self.head_trained:
                self.train()
        if train and self.queue and not self.head_trained:
            self.train()
        self.checkpoint()
        self.restart(0, world, False, order)

    def check_resumed(self, state):
        pos = state["position"]
        for loader in self.loaders:
            b = loader.board
            assert b.epoch == pos["epoch"]
            if b.partition is None:
                assert b.done == pos["step"]
            assert loader.epoch == (b.epoch + 1 if b.epoch_finished() else b.epoch)
            spe = loader.order.steps_per_epoch
            if b.epoch_finished():  # the next iteration runs the next epoch, whole
                assert len(loader) == (-(-self.n // self.batch) if self.sharded else spe)
            else:
                assert len(loader) == spe - b.done

    @precondition(lambda self: self.checkpoints)
    @rule(which=st.integers(0, 1 << 10))
    def load_in_place(self, which):
        """A checkpoint loaded into the live loaders (same world size): an iteration running
        from before refuses to go on."""
        blob, snapshot, world, _ = self.checkpoints[-1 - which % len(self.checkpoints)]
        state = torch.load(io.BytesIO(blob), weights_only=True)
        if world != self.world:
            return
        for loader in self.loaders:
            loader.load_state_dict(state)
        if self.iters is not None:
            for it in self.iters:
                with pytest.raises(RuntimeError, match="start a new `for` loop"):
                    next(it)
        self.iters, self.restored = None, True
        self._forget()
        self.committed = {e: list(v) for e, v in snapshot.items()}
        self.check_resumed(state)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def ranks_agree(self):
        pos = [to_plain(b.position()) for b in self.boards]
        assert all(p == pos[0] for p in pos), "the ranks' positions differ"
        steps = self.new_balancer_steps()
        assert all(s == steps[0] for s in steps)

    @invariant()
    def committed_is_the_position(self):
        b = self.boards[0]
        assert not self.committed or max(self.committed) <= b.epoch, "a rolled-back epoch is committed"
        for e, samples in self.committed.items():
            assert len(samples) == len(set(samples)), f"epoch {e}: a sample committed twice"
            if e < b.epoch:
                assert sorted(samples) == self.epoch_samples(e), f"epoch {e} was not committed exactly once"
        mine = sorted(self.committed.get(b.epoch, []))
        if b.epoch_finished():
            assert mine == self.epoch_samples(b.epoch)
        elif self.sharded:
            assert mine == np.flatnonzero(b.partition.trained_upto(b.epoch, b.done)).tolist()
        else:
            length = len(self.epoch_samples(b.epoch))
            assert len(mine) == min(b.done * self.batch, length), \
                "the position does not count the trained samples"


class BalancerMachine(LoaderMachine):
    """The same rules on the real hetlb.Balancer (one rank: no process group needed)."""

    real = True
    worlds = st.just(1)
    workers = 0  # DataLoader worker processes (they draw steps ahead of the loop)

    def build(self, world, state=None, order="after"):
        assert world == 1
        self.world = 1
        model = torch.nn.Linear(1, 1).double()
        pol = hetlb.Chronica() if self.rules else hetlb.Uniform()
        weighting = "sizes" if self.rules else "samples"
        kw = dict(shuffle=self.shuffle, seed=self.seed, drop_last=self.drop_last,
                  sample_sizes=self.sizes, partition="even" if self.sharded else None,
                  num_workers=self.workers)
        if order == "board" and state is not None:
            bal = hetlb.Balancer(model, self.batch, policy=pol, weighting=weighting, lower=0)
            bal.load_state_dict(state)  # before the loader exists
            loader = bal.loader(Indices(self.n), **kw)
        elif order == "before" and state is not None:
            # hetlb.DataLoader made before the model, the checkpoint loaded, then the Balancer
            loader = hetlb.DataLoader(Indices(self.n), batch_size=self.batch, **kw)
            loader.load_state_dict(state)
            bal = hetlb.Balancer(model, policy=pol, weighting=weighting, lower=0, loader=loader)
        else:
            bal = hetlb.Balancer(model, self.batch, policy=pol, weighting=weighting, lower=0)
            loader = bal.loader(Indices(self.n), **kw)
            if state is not None:
                loader.load_state_dict(state)
        self.model, self.bal = model, bal
        self.loaders, self.drivers = [loader], [bal]
        self.after_build(state)

    def train(self, backward=True):
        x = torch.tensor(self.queue[0][1][0], dtype=torch.float64)[:, None]
        loss = self.model(x).sum()
        if backward:
            loss.backward()
        self.head_forwarded = True
        self.head_trained = self.head_trained or backward

    def new_balancer_steps(self):
        return [self.bal.steps]

    @invariant()
    def the_open_step_is_the_oldest_batch(self):
        """The Balancer's open step trains the oldest queued batch, its backward as the loop's."""
        if self.queue:
            assert self.bal.board.current is self.queue[0][0][0]
            assert self.bal.telemetry.hooked == self.head_trained


TestLoaderMachine = LoaderMachine.TestCase
# Cheap examples (about 40 ms each): four times the profile's count, so that rare paths (a sharded
# mid-epoch restart on fewer ranks, then the epoch run to its end) come up in every run.
TestLoaderMachine.settings = settings(max_examples=4 * settings().max_examples, stateful_step_count=50)
TestBalancerMachine = BalancerMachine.TestCase


class WorkerMachine(BalancerMachine):
    """The real Balancer with two DataLoader workers: the sampler draws steps ahead of the loop
    (prefetching), which peeks, breaks, checkpoints, set_epoch and restarts must not turn into
    lost, repeated or mismatched batches."""

    workers = 2


TestWorkerMachine = WorkerMachine.TestCase
# Each new loop starts two worker processes (about 0.1 s): fewer, shorter examples.
TestWorkerMachine.settings = settings(max_examples=max(10, settings().max_examples // 3),
                                      stateful_step_count=25)


# ---------------------------------------------------------------- cases the machines found


def test_sharded_epoch_whose_rest_holds_no_sample_is_finished():
    """Found by LoaderMachine: sharded, 7 samples, global batch 1, 4 ranks holding 1-2 samples
    each. Cut at quantiles, a rank's shard left steps empty, here the 7th step of every rank:
    after 6 steps every sample had trained. Resumed there on 1 rank, the rest of the epoch had
    0 steps and the epoch never counted as finished (``loader.epoch`` stayed, no rebalancing);
    that checkpoint resumed on 5 ranks then trained the whole epoch again. A layout now has no
    empty step (test_sharded_layout_has_no_step_without_a_sample), but a checkpoint written
    before that (the rest of epoch 1 on 1 rank: every sample trained, step 0) still resumes as
    the end of its epoch, on the same and on other world sizes."""
    n = 7
    state = {"position": {"epoch": 1, "step": 0, "global_batch": 1, "partition": {
        "world": 1, "home": torch.zeros(n, dtype=torch.int64), "trained": torch.ones(n, dtype=torch.bool),
        "pending": None}}}
    for world in (1, 5, 2):
        b = PlanBoard(world, 0, 1)
        loader = BalancedLoader(Indices(n), board=b, partition="even", shuffle=False)
        loader.load_state_dict(state)
        assert b.epoch_finished() and loader.epoch == 2 and len(loader) == n
        again = loader.state_dict()
        assert again["position"]["epoch_end"]
        assert b.restart() == 0 and (b.epoch, b.partition.steps) == (2, n)  # the next epoch, whole


def test_sharded_step_that_the_quantile_cut_leaves_empty_gets_a_sample():
    """Found by BalancerMachine: sharded, one rank, sizes [100, 1, 1], global batch 1: cut at
    the quantiles of its data, the shard's first step held no sample (the large one spans two
    steps' worth), and the Balancer refused to weigh a step with no samples on any rank
    (ValueError at the hand-out) under either weighting."""
    model = torch.nn.Linear(1, 1).double()
    bal = hetlb.Balancer(model, 1, policy=hetlb.Uniform(), weighting="sizes")
    loader = bal.loader(Indices(3), sample_sizes=[100.0, 1.0, 1.0], partition="even", shuffle=False)
    seen = []
    for x in loader:
        assert len(x) == 1
        model(x.double()[:, None]).sum().backward()
        seen += x.tolist()
    assert sorted(seen) == [0, 1, 2]


@given(n=st.integers(1, 60), world=st.integers(1, 5), batch=st.integers(1, 16), seed=st.integers(0, 99),
       tail=st.floats(0.0, 3.0))
def test_sharded_layout_has_no_step_without_a_sample(n, world, batch, seed, tail):
    rng = np.random.default_rng(seed)
    work = np.round(rng.lognormal(1.0, tail, n)) * (rng.random(n) > 0.1)  # heavy tails, zeros
    home = rng.integers(0, world, n)
    part = Partition(home, world, batch, work, seed=seed)
    orders, counts, data, _ = part.layout(0)
    assert counts.shape == (world, -(-n // batch)) and counts.sum(axis=0).min() >= 1
    seen = []
    for r in range(world):
        for step in range(part.steps):
            idx = part.step_indices(0, step, r)
            assert np.all(home[idx] == r) and data[r, step] == pytest.approx(work[idx].sum())
            seen += idx.tolist()
        assert np.array_equal(np.concatenate([part.step_indices(0, k, r) for k in range(part.steps)]),
                              orders[r])  # each rank's samples in their order, each in one step
    assert sorted(seen) == list(range(n))


def _balanced(n, batch, workers=0):
    model = torch.nn.Linear(1, 1).double()
    bal = hetlb.Balancer(model, batch, policy=hetlb.Uniform())
    return model, bal, bal.loader(Indices(n), shuffle=False, num_workers=workers)


def test_next_epoch_selected_after_the_last_step_ends_the_loop():
    """Found by LoaderMachine: one step per epoch; inside the loop the step trained, a checkpoint,
    then ``set_epoch(loader.epoch)`` (the next epoch, the current one being complete). The loop
    then ends (nothing was left of its epoch) and the next one trains the new epoch whole. The
    same without the checkpoint, with ``set_epoch(epoch + 1)`` in the last step's body."""
    for checkpoint in (True, False):
        model, bal, loader = _balanced(3, 1)
        seen = []
        for x in loader:
            model(x.double()[:, None]).sum().backward()
            seen += x.tolist()
            if len(seen) == 3:
                if checkpoint:
                    bal.state_dict()
                loader.set_epoch(1)
        assert seen == [0, 1, 2] and bal.steps == 3
        again = []
        for x in loader:
            model(x.double()[:, None]).sum().backward()
            again.append(x.tolist())
        assert again == [[0], [1], [2]]
        assert loader.epoch == 2


@pytest.mark.parametrize("workers", [0, 2])
def test_next_epoch_selected_mid_loop_stops_the_loop_with_an_error(workers):
    """``set_epoch`` of the next epoch inside a loop with steps left: before, the loop went on
    handing out the old epoch's batches outside any epoch the position counted (no workers), or
    failed with "a batch the sampler never drew" (workers). Now its next batch says what to do;
    a new loop then runs the new epoch whole."""
    model, bal, loader = _balanced(6, 1, workers)
    seen = []
    with pytest.raises(RuntimeError, match=r"set_epoch\(1\) was called inside a `for` loop over epoch 0"):
        for x in loader:
            model(x.double()[:, None]).sum().backward()
            seen += x.tolist()
            if len(seen) == 2:
                loader.set_epoch(1)
    assert seen == [0, 1]
    again = []
    for x in loader:
        model(x.double()[:, None]).sum().backward()
        again += x.tolist()
    assert again == list(range(6)) and loader.epoch == 2 and bal.steps == 8
