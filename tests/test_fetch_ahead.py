"""Loops that fetch batches ahead of training them (issue 54): steps take the batches in the
order they were handed out and open at their first forward, so the gradient of every step is the
mean over the samples it trained, whatever the loop holds in hand.

The loops are the trainers' shapes, on 2 real Gloo ranks under DDP, with sizes that change every
step: accelerate's prepared loader (one batch beyond the one it yields), the Trainer's
accumulation window taken whole before its first forward (with ``accumulate=`` and without), and
a loop that takes several batches at once and trains each in its own step. Each step's gradient
is compared with one process's gradient over the samples the ranks actually fed the model, the
epoch's samples must each train once, and the ranks must record the same steps.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hetlb  # at the top: spawned workers import it before init_process_group
from distributed import run, unwrap
from test_balancer_dist import Jitter, _data, _loss, _net, _reference


def ahead(loader):
    """accelerate's DataLoaderShard: the next batch is fetched before the current one is yielded."""
    it = iter(loader)
    try:
        current = next(it)
    except StopIteration:
        return
    for following in it:
        yield current
        current = following
    yield current


def windows(loader, k):
    """The Trainer's get_batch_samples: up to ``k`` batches fetched before the first forward."""
    it = iter(loader)
    while True:
        got = []
        for _ in range(k):
            try:
                got.append(next(it))
            except StopIteration:
                break
        if not got:
            return
        yield got


def fetch_ahead_worker(rank, world, style, epochs=2):
    K = 2 if style == "accumulate" else 1
    net = _net()
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    bal = hetlb.Balancer(ddp, 12, policy=Jitter(4), accumulate=K, lower=0)
    x, y, tokens = _data(62)
    loader = bal.loader(torch.utils.data.TensorDataset(x, y, torch.arange(len(x))), seed=3)
    errs, seen, window = [], [], []

    def train(xb, yb, ib, explicit):
        window.append(ib)
        with bal.step() if explicit else contextlib.nullcontext():
            loss = _loss(ddp(xb), yb, torch.ones(len(xb), dtype=torch.float64)) / K
            loss.backward()
        if bal.synced:
            parts = [np.concatenate([p.numpy() for p in rank_ib]) for rank_ib in _gathered(window, world)]
            ref = _reference(net, x, y, tokens, parts, "samples")
            errs.append(max(((p.grad - r).abs().max() / r.abs().max()).item()
                            for p, r in zip(net.parameters(), ref)))
            seen.extend(np.concatenate(parts).tolist())
            window.clear()
            opt.step()
            opt.zero_grad()

    for epoch in range(epochs):
        # (a ported DDP script's sampler.set_epoch: after a loop fetching ahead, whose last
        # batch trained after the loader ran out, the epoch moves on with that step counted)
        (loader.sampler if style == "ahead" else loader).set_epoch(epoch)
        if style == "plain":
            for xb, yb, ib in loader:
                train(xb, yb, ib, explicit=False)
        elif style == "ahead":
            for xb, yb, ib in ahead(loader):
                train(xb, yb, ib, explicit=False)
        elif style in ("window", "accumulate"):
            for got in windows(loader, 3 if style == "window" else K):
                for xb, yb, ib in got:
                    train(xb, yb, ib, explicit=True)
    return {"errs": errs, "seen": seen, "steps": bal.steps,
            "batches": [r.batch.tolist() for r in bal.history]}


def _gathered(window, world):
    """Every rank's indices of the micro-steps in ``window`` (a collective: all ranks call it)."""
    mine = [ib.clone() for ib in window]
    out = [None] * world
    dist.all_gather_object(out, mine)
    return out


@pytest.mark.parametrize("style", ["plain", "ahead", "window", "accumulate"])
def test_a_loop_that_fetches_ahead_trains_every_step_exactly(style):
    res = unwrap(run(fetch_ahead_worker, 2, style))
    for r in res:
        assert max(r["errs"]) < 1e-12, r["errs"]
        assert sorted(r["seen"]) == sorted(list(range(62)) * 2)  # each sample once an epoch
        assert len({tuple(b) for b in r["batches"]}) > 1  # the sizes changed between steps
        # 62 samples, global batch 12: 5 whole steps and a short one an epoch; windows of 2:
        # [0,1] [2,3] [4] [5] (the short last step is a window of its own)
        assert r["steps"] == 2 * (4 if style == "accumulate" else 6)
    assert res[0]["batches"] == res[1]["batches"]


@pytest.mark.parametrize("next_loop", ["set_epoch", "iter"])
def test_a_batch_skipped_before_its_forward_is_named_by_the_next_loop(next_loop):
    # Steps take the batches in order, so the forward after a `continue` trains the skipped
    # batch's step: every later batch runs one plan late, and the loop ends with the last plan
    # untrained. The next loop (or set_epoch) says so, once; a batch skipped after its forward
    # counts, and a loop that fetched ahead and trained what it fetched leaves nothing.
    model = torch.nn.Linear(1, 1).double()
    bal = hetlb.Balancer(model, 2, policy=hetlb.Uniform())
    loader = bal.loader(torch.arange(6.0, dtype=torch.float64)[:, None], shuffle=False)
    for i, x in enumerate(loader):
        if i == 1:
            continue
        model(x).sum().backward()
    assert bal.steps == 2
    with pytest.raises(RuntimeError, match=r"left 1 of the batches it received untrained "
                                           r"\(step\(s\) \[2\] of epoch 0\).*`continue`"):
        loader.set_epoch(1) if next_loop == "set_epoch" else iter(loader)
    for i, x in enumerate(loader):  # drawn again: step 2 of epoch 0
        assert x.flatten().tolist() == [4.0, 5.0]
        model(x).sum()  # a forward, then no backward: the step counts, untrained
    assert bal.steps == 3 and loader.epoch == 1
    loader.set_epoch(1)
    for x in ahead(loader):
        model(x).sum().backward()
    assert bal.steps == 6 and loader.epoch == 2
    loader.set_epoch(2)


def state_worker(rank, world, policy):
    import io

    from hetlb.core.models import LinearModel
    from hetlb.sim.emulate import Emulator
    net = _net()
    ddp = DDP(net)
    sized = policy == "chronica"
    pol = hetlb.Chronica() if sized else hetlb.LBB()
    emu = Emulator(LinearModel(1e-3, 5e-5 if sized else 2e-4), speed=1.0 + rank,
                   by="data" if sized else "batch")  # rank 1 twice as fast
    bal = hetlb.Balancer(ddp, 12, policy=pol, weighting="sizes" if sized else "samples",
                         lower=0 if sized else 1, emulator=emu)
    x, y, tokens = _data(62)
    loader = bal.loader(torch.utils.data.TensorDataset(x, y), seed=3,
                        sample_sizes=tokens.numpy() if sized else None)
    states = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        for i, (xb, yb) in enumerate(ahead(loader)):
            _loss(ddp(xb), yb, torch.ones(len(xb), dtype=torch.float64)).backward()
            ddp.zero_grad()
            if i in (2, 5):  # mid-epoch (a batch fetched ahead) and at the epoch's last step
                buf = io.BytesIO()
                torch.save(bal.state_dict(), buf)
                states.append(buf.getvalue())
    return states


@pytest.mark.parametrize("policy", ["lbb", "chronica"])
def test_the_state_is_the_same_on_every_rank(policy):
    # accelerate's register_for_checkpointing and Lightning save the main process's state only:
    # it must be every rank's (its position, policy, decision and history are replicated).
    a, b = unwrap(run(state_worker, 2, policy))
    assert len(a) == 4 and a == b


def test_a_step_that_raises_gives_its_batch_up_and_the_next_step_takes_the_next_batch():
    # (the "skip the batch on an error" loop; 7 samples, global batch 2: the short last step
    # would be trained under the previous plan if the failed batch stayed queued)
    model = torch.nn.Linear(1, 1).double()
    bal = hetlb.Balancer(model, 2, policy=hetlb.Uniform())
    loader = bal.loader(torch.arange(7.0, dtype=torch.float64)[:, None], shuffle=False)
    for i, x in enumerate(loader):
        try:
            with bal.step():
                if i == 1:
                    raise MemoryError("out of memory")
                model(x).sum().backward()
        except MemoryError:
            pass
    assert bal.steps == 3 and loader.epoch == 1 and not bal.board.handed
    loader.set_epoch(1)
    # without a loader: a failed step's plan is not kept either
    own = hetlb.Balancer(torch.nn.Linear(1, 1).double(), 2)
    for i in range(4):
        with contextlib.suppress(MemoryError), own.step():
            if i == 1:
                raise MemoryError("out of memory")
            own.model(torch.ones(2, 1, dtype=torch.float64)).sum().backward()
    assert own.steps == 3 and not own.board.handed


def test_a_window_whose_micro_step_raised_is_refused():
    model = torch.nn.Linear(1, 1).double()
    bal = hetlb.Balancer(model, 2, policy=hetlb.Uniform(), accumulate=2)
    loader = bal.loader(torch.arange(8.0, dtype=torch.float64)[:, None], shuffle=False)
    it = iter(loader)
    next(it)
    with contextlib.suppress(MemoryError), bal.step():
        raise MemoryError("out of memory")
    x = next(it)
    with pytest.raises(RuntimeError, match="micro-step 1 of the accumulation window that started "
                                           "at step 0 of epoch 0 raised"):
        with bal.step():
            model(x).sum().backward()


def test_a_loop_that_fetches_between_forward_and_backward_is_refused():
    # nanoGPT's shape: the next batch is taken after the forward, before the backward, which then
    # lands in the next batch's step
    model = torch.nn.Linear(1, 1).double()
    bal = hetlb.Balancer(model, 2, policy=hetlb.Uniform())
    it = iter(bal.loader(torch.arange(8.0, dtype=torch.float64)[:, None]))
    x = next(it)
    with pytest.raises(RuntimeError, match="backward of step 1 of epoch 0 ran before its forward"):
        for _ in range(3):
            loss = model(x).sum()
            x = next(it)
            loss.backward()


def test_a_model_trained_in_eval_mode_is_told_why_no_step_opened():
    """A forward in eval() mode opens no step (it is taken for an evaluation): fine-tuning in
    eval mode with the loader's steps gets an error naming the mode; with `with bal.step():` it
    trains, and its gradient is the batch's."""
    model = torch.nn.Linear(1, 1).double().eval()
    bal = hetlb.Balancer(model, 2, policy=hetlb.Uniform())
    loader = bal.loader(torch.arange(8.0, dtype=torch.float64)[:, None])
    with pytest.raises(RuntimeError, match=r"ran without a training forward: the model is in "
                                           r"eval\(\) mode.*`with bal.step\(\):`"):
        for x in loader:
            model(x).sum().backward()
    model = torch.nn.Linear(1, 1).double().eval()
    bal = hetlb.Balancer(model, 2, policy=hetlb.Uniform())
    for x in bal.loader(torch.arange(8.0, dtype=torch.float64)[:, None]):
        with bal.step():
            model(x).sum().backward()
        assert model.weight.grad.item() == x.sum().item()
        model.zero_grad()
    assert len(bal.history) == 4


def test_inside_a_step_a_forward_in_eval_mode_is_checked_as_the_steps():
    """Inside `with bal.step():` a forward with gradients in eval() mode trains: its batch is
    checked against the plan (a wrong one would be weighted as the planned one); an evaluation
    there under torch.no_grad() is left alone."""
    model = torch.nn.Linear(1, 1).double().eval()
    bal = hetlb.Balancer(model, 2, policy=hetlb.Uniform())
    loader = bal.loader(torch.arange(8.0, dtype=torch.float64)[:, None])
    x = next(iter(loader))
    other = torch.zeros(5, 1, dtype=torch.float64)
    model(other)  # (a step handed out, outside the block: an evaluation, not checked)
    with pytest.raises(hetlb.BatchSizeError, match=r"eval\(\) mode inside `with bal.step\(\):`.*"
                                                    r"torch.no_grad\(\)"):
        with bal.step():
            model(torch.cat([x, x])).sum().backward()
    model.zero_grad()
    for x in loader:
        model(other)  # (after the block that raised, too)
        with bal.step():
            with torch.no_grad():
                model(other)  # (an evaluation: not checked)
            model(x).sum().backward()
        assert model.weight.grad.item() == x.sum().item()
        model.zero_grad()


def test_the_sampler_copies_without_the_balancer():
    import copy
    import pickle
    bal = hetlb.Balancer(torch.nn.Linear(1, 1), 2)
    loader = bal.loader(torch.arange(8.0)[:, None])
    for s in (copy.deepcopy(loader.sampler), pickle.loads(pickle.dumps(loader.sampler))):
        assert s.order.owner is None and len(s) == len(loader.sampler)
    assert loader.sampler.order.owner is not None
