"""The deferred communication hook (``Balancer(defer_hook=True)``, the default on CPU Gloo).

While every rank's weight is ``1 / world`` the model runs without a hook (DDP's own mean is the
weighted one) and the table travels by the side route from the end of backward; the weighted
hook is registered before the first step whose weights differ. Every step's gradient is checked
against the single-process gradient of the union of the ranks' samples, before, at and after
that switch, and the telemetry against the plan.
"""
from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hetlb  # before init_process_group in the spawned workers
from distributed import run, unwrap
from fixed_policy import Fixed
from hetlb.comm.route import choose_route
from test_balancer_dist import _data, _loss, _net, _reference


class EvenThenUneven(Fixed):
    """A policy that starts with an even split and then decides ``sizes``."""

    def start(self, ctx):
        return np.full(len(self.sizes), int(self.sizes.sum()) // len(self.sizes))


class TwoOutputs(torch.nn.Module):
    """``(aux, out)``: a first output that needs a gradient and that the loss does not use."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net[0](x).sum(1), self.net(x)


def deferred_worker(rank, world, n, global_batch, options):
    net = _net()
    module = TwoOutputs(net) if options.get("aux_first") else net
    ddp = DDP(module, bucket_cap_mb=options.get("bucket_cap_mb", 25),
              gradient_as_bucket_view=options.get("gradient_as_bucket_view", False),
              find_unused_parameters=options.get("find_unused_parameters", False))
    policy = Fixed(options["sizes"]) if "sizes" in options else \
        EvenThenUneven(options["later"]) if "later" in options else hetlb.Uniform()
    bal = hetlb.Balancer(ddp, global_batch, policy=policy, lower=options.get("lower", 1),
                         weighting=options.get("weighting", "samples"),
                         defer_hook=options.get("defer_hook", True),
                         transport=options.get("transport"),
                         exchange_every=options.get("exchange_every", 1))
    x, y, tokens = _data(n)
    loader = bal.loader(torch.utils.data.TensorDataset(x, y), seed=2)
    steps = []
    for epoch in range(options.get("epochs", 1)):
        loader.set_epoch(epoch)
        for xb, yb in loader:
            plan = bal.board.current
            out = ddp(xb)
            if options.get("aux_first"):  # the loss uses the second output only
                out = out[1]
            loss = _loss(out, yb, torch.ones(len(yb), dtype=torch.float64))
            if options.get("bal_backward"):
                bal.backward(loss)
            else:
                loss.backward()
            parts = loader.order.step_indices(plan)
            ref = _reference(net, x, y, tokens, parts, options.get("weighting", "samples"))
            err = max(((p.grad - r).abs().max() / (r.abs().max() + 1e-12)).item()
                      for p, r in zip(net.parameters(), ref))
            steps.append({"sizes": plan.sizes.tolist(), "err": err, "hooked": not bal.gradient_transport.deferred,
                          "hooks_run": bal.telemetry.core.hooks_run})
            ddp.zero_grad()
    bal.flush()
    records = [(r.batch.tolist(), bool(np.isfinite(r.compute).all() and (r.compute > 0).all()))
               for r in bal.history]
    return {"steps": steps, "records": records, "transport": bal.transport, "done": bal.steps}


def _check(res, world):
    same = [[(s["sizes"], s["hooked"]) for s in res[r]["steps"]] for r in range(world)]
    assert all(v == same[0] for v in same), same  # every rank switches at the same step
    for r in range(world):
        for s in res[r]["steps"]:
            assert s["err"] < 1e-12, res[r]["steps"]
        # Every step recorded with its plan's sizes and a measured (finite, positive) compute time.
        assert [b for b, _ in res[r]["records"]] == [s["sizes"] for s in res[r]["steps"]]
        assert all(ok for _, ok in res[r]["records"]), res[r]["records"]
        assert res[r]["done"] == len(res[r]["steps"])


def test_equal_weights_run_without_a_hook_and_give_the_union_mean():
    # 40 samples, 16 a step over 2 ranks: 8/8, 8/8, 4/4: equal every step, never hooked.
    res = unwrap(run(deferred_worker, 2, 40, 16, {"epochs": 2}))
    _check(res, 2)
    for r in range(2):
        assert res[r]["transport"] == "side"
        assert not any(s["hooked"] for s in res[r]["steps"])
        assert all(s["hooks_run"] == 0 for s in res[r]["steps"])  # DDP's own reduction


@pytest.mark.parametrize("options", [{}, {"gradient_as_bucket_view": True}, {"exchange_every": 2}])
def test_the_hook_is_registered_at_the_first_step_whose_weights_differ(options):
    # 41 samples, 16 a step: the epoch's short last step has 9 samples, split 5/4 (with blocks of
    # 2 the switch falls inside a block: steps 1-2).
    res = unwrap(run(deferred_worker, 2, 41, 16, {"epochs": 2, "bucket_cap_mb": 0.0001, **options}))
    _check(res, 2)
    for r in range(2):
        steps = res[r]["steps"]
        assert [s["sizes"] for s in steps[:3]] == [[8, 8], [8, 8], [5, 4]]
        assert [s["hooked"] for s in steps] == [False, False, True, True, True, True]
        assert [s["hooks_run"] > 0 for s in steps] == [False, False, True, True, True, True]


@pytest.mark.parametrize("options", [
    {"sizes": [3, 9]},                                           # uneven from the first step
    {"sizes": [6, 0, 6], "lower": 0, "weighting": "none"},       # an idle rank (its loss is NaN)
    {"sizes": [4, 4, 4], "weighting": "none"},                   # "none", every rank with samples
    {"sizes": [3, 9], "weighting": "world"},                     # "world": 1/world whatever the sizes
    {"bal_backward": True},                                      # no double division by world
    {"bal_backward": True, "sizes": [5, 7]},
    {"gradient_as_bucket_view": True},
    {"find_unused_parameters": True},
    {"aux_first": True},                                         # the loss skips the first output
    {"exchange_every": 4},
])
def test_deferred_hook_keeps_the_union_mean(options):
    world = len(options.get("sizes", [0, 0]))
    res = unwrap(run(deferred_worker, world, 36, 12, options))
    _check(res, world)
    sizes = res[0]["steps"][0]["sizes"]
    equal = options.get("weighting") == "none" and 0 not in sizes or len(set(sizes)) == 1 or \
        options.get("weighting") == "world"
    for r in range(world):
        assert all(s["hooked"] != equal for s in res[r]["steps"]), res[r]["steps"]


def test_defer_hook_false_registers_the_hook_at_once():
    res = unwrap(run(deferred_worker, 2, 40, 16, {"defer_hook": False}))
    _check(res, 2)
    assert res[0]["transport"] == "carry"
    assert all(s["hooks_run"] > 0 for s in res[0]["steps"])


def outside_worker(rank, world):
    ddp = DDP(_net())
    bal = hetlb.Balancer(ddp, 8, policy=hetlb.Uniform())
    x, y, _ = _data(8)
    for xb, yb in bal.loader(torch.utils.data.TensorDataset(x, y)):
        ddp(xb).pow(2).mean().backward()
    assert bal.gradient_transport.deferred
    try:
        ddp(x[:4]).pow(2).mean().backward()  # no batch of the loader: outside any step
    except RuntimeError as e:
        return str(e)
    return None


def test_a_backward_outside_a_step_raises_without_a_hook_too():
    for msg in unwrap(run(outside_worker, 2)):
        assert msg is not None and "outside a balanced step" in msg, msg


def copy_worker(rank, world):
    ddp = DDP(_net())
    bal = hetlb.Balancer(ddp, 8, policy=hetlb.Uniform())
    twin = copy.deepcopy(ddp)
    torch.save(ddp, io.BytesIO())
    x, y, _ = _data(16)
    for xb, yb in bal.loader(torch.utils.data.TensorDataset(x, y)):
        ddp(xb).pow(2).mean().backward()
        ddp.zero_grad()
    twin(x).pow(2).mean().backward()  # the copy is plain DDP: no step needed
    return bal.steps, bal.gradient_transport.deferred


def test_a_model_with_a_deferred_hook_copies_and_saves():
    for steps, deferred in unwrap(run(copy_worker, 2)):
        assert steps == 2 and deferred


def mismatch_worker(rank, world):
    ddp = DDP(_net())
    try:
        hetlb.Balancer(ddp, 8, policy=hetlb.Uniform(), defer_hook=(rank == 0))
    except ValueError as e:
        return str(e)
    return None


def test_ranks_must_agree_on_defer_hook():
    for msg in unwrap(run(mismatch_worker, 2)):
        assert msg is not None and "defer_hook" in msg, msg


def blocked_worker(rank, world, kind):
    ddp = DDP(_net())
    kwargs = {"transport": "carry"} if kind == "carry" else {"native_hook": False} if kind == "python" \
        else {"emulator": hetlb.sim.emulate.Emulator.for_rank(rank, [1.0, 1.0])}
    bal = hetlb.Balancer(ddp, 8, policy=hetlb.Uniform(), **kwargs)
    return not bal.gradient_transport.deferred, bal.transport


@pytest.mark.parametrize("kind", ["carry", "python", "emulator"])
def test_the_hook_is_registered_at_once_where_it_cannot_wait(kind):
    for hooked, transport in unwrap(run(blocked_worker, 2, kind)):
        assert hooked and transport == "carry"


def test_choose_route_picks_side_for_a_deferred_hook():
    assert choose_route([None, None], [None, None], deferred=True) == "side"
    assert choose_route(["side", None], [None, None], deferred=True) == "side"
    assert choose_route([None, None], [None, None], deferred=False) == "carry"


def stamp_worker(rank, world, every):
    import time
    ddp = DDP(_net())
    bal = hetlb.Balancer(ddp, 8, policy=hetlb.Uniform(), exchange_every=every)
    x, y, _ = _data(32)
    sent = []
    for step, (xb, yb) in enumerate(bal.loader(torch.utils.data.TensorDataset(x, y))):
        ddp(xb).pow(2).mean().backward()
        # By the end of backward the compute is stamped and the table's all-reduce issued
        # (taken here, and put back for the step's end).
        table = bal.telemetry.table()
        sent.append(table is not None)
        if table is not None:
            bal.telemetry.core.store_table(table)
        time.sleep(0.15 if step == 1 else 0.0)  # after backward: not compute
    return {"sent": sent, "hooked": not bal.gradient_transport.deferred,
            "compute": [float(r.compute.max()) for r in bal.history]}


@pytest.mark.parametrize("every, sent", [
    (1, [True] * 4),
    # Uniform's default: adaptive blocks (1 step after the start's own exchange, then 2, ...;
    # the epoch's last step ends a block)
    (None, [True, False, True, True])])
def test_the_table_is_sent_and_the_time_stamped_by_the_end_of_backward(every, sent):
    for r in unwrap(run(stamp_worker, 2, every)):
        assert not r["hooked"] and r["sent"] == sent, r
        assert len(r["compute"]) == 4, r["compute"]  # every step recorded by the epoch's end
        assert max(r["compute"]) < 0.1, r["compute"]  # step 1's nap after backward not counted


def own_hook_worker(rank, world):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    ddp = DDP(_net())
    bal = hetlb.Balancer(ddp, 8, policy=hetlb.Uniform())
    ddp.register_comm_hook(None, allreduce_hook)  # accepted by DDP: no hook was registered yet
    x, y, _ = _data(16)
    try:
        for xb, yb in bal.loader(torch.utils.data.TensorDataset(x, y)):
            ddp(xb).pow(2).mean().backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_a_hook_of_the_user_s_own_on_a_balanced_model_is_refused():
    for msg in unwrap(run(own_hook_worker, 2)):
        assert msg is not None and "communication hook was registered" in msg, msg


def resume_worker(rank, world):
    x, y, tokens = _data(48)
    ds = torch.utils.data.TensorDataset(x, y)

    def train(state, steps):
        net = _net()
        ddp = DDP(net)
        bal = hetlb.Balancer(ddp, 12, policy=EvenThenUneven([4, 8]))
        loader = bal.loader(ds, seed=3)
        if state is not None:
            loader.load_state_dict(state)
        out = []
        for xb, yb in loader:
            if bal.steps == steps:
                break
            plan = bal.board.current
            _loss(ddp(xb), yb, torch.ones(len(yb), dtype=torch.float64)).backward()
            ref = _reference(net, x, y, tokens, loader.order.step_indices(plan), "samples")
            out.append((plan.sizes.tolist(), not bal.gradient_transport.deferred,
                        max(((p.grad - r).abs().max() / r.abs().max()).item()
                            for p, r in zip(net.parameters(), ref))))
            ddp.zero_grad()
        return out, loader.state_dict()

    first, state = train(None, 2)
    second, _ = train(state, 4)  # a new model and Balancer: the checkpoint's decision is uneven
    return first, second


def test_a_resumed_uneven_decision_registers_the_hook_before_its_first_step():
    for first, second in unwrap(run(resume_worker, 2)):
        assert [(s, h) for s, h, _ in first] == [([6, 6], False), ([4, 8], True)]
        assert [(s, h) for s, h, _ in second] == [([4, 8], True), ([4, 8], True)]
        assert all(e < 1e-12 for _, _, e in first + second), (first, second)


def bypass_worker(rank, world):
    net = _net()
    ddp = DDP(net)
    bal = hetlb.Balancer(ddp, 8, policy=hetlb.Uniform())
    x, y, _ = _data(24)
    ok = []
    for xb, yb in bal.loader(torch.utils.data.TensorDataset(x, y)):
        inp = xb.clone().requires_grad_()
        out = ddp(inp)
        # A pass for given inputs (an adversarial example, say) is not the step's backward.
        torch.autograd.grad(out.sum(), inp, retain_graph=True)
        skipped = bal.telemetry.core.last_buckets == 0
        # The step's loss reaches the parameters through none of the outputs: not watched.
        loss = sum(p.pow(2).sum() for p in net.parameters()) + 0 * out.detach().sum()
        loss.backward()
        ok.append(skipped and all(torch.allclose(p.grad, 2 * p.detach()) for p in net.parameters()))
        ddp.zero_grad()
    return ok, bal.steps, len(bal.history)


def test_a_backward_the_watch_does_not_see_is_exchanged_at_the_step_s_end():
    for ok, steps, records in unwrap(run(bypass_worker, 2)):
        assert ok == [True] * 3 and steps == records == 3, (ok, steps, records)
