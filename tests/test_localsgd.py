"""hetlb.sync.local.local_sgd: torch's post-local SGD on real Gloo ranks. Parameters are identical
on every rank right after each average (and equal the mean of the ranks' local updates), differ
between averages, and the warm-up runs synchronous DDP."""
import copy

import pytest
import torch
import torch.distributed as dist

from hetlb.sync.local import local_sgd

from distributed import run, unwrap

LR = 0.05


def batch_of(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64) + rank  # each rank its own data
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64)


def flat(params):
    return torch.cat([p.detach().reshape(-1) for p in params])


def worker(rank, world, period, warmup, steps, use_ddp):
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1).double()
    model = torch.nn.parallel.DistributedDataParallel(net) if use_ddp else net
    opt = local_sgd(model, torch.optim.SGD(model.parameters(), lr=LR), period, warmup)
    same, matches_mean, own = [], [], []
    for s in range(steps):
        x, y = batch_of(rank, s)
        twin = copy.deepcopy(net)  # a plain copy: this rank's own gradient
        ((twin(x) - y) ** 2).mean().backward()
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        # what this rank's plain local SGD step would give (its gradient as DDP left it)
        local = flat(net.parameters()) - LR * flat(p.grad for p in net.parameters())
        own.append(bool(torch.allclose(flat(p.grad for p in net.parameters()),
                                       flat(p.grad for p in twin.parameters()), rtol=1e-12, atol=0)))
        opt.step()
        now = flat(net.parameters())
        every = [torch.zeros_like(now) for _ in range(world)]
        dist.all_gather(every, now)  # (the test's own collective)
        locals_ = [torch.zeros_like(local) for _ in range(world)]
        dist.all_gather(locals_, local)
        same.append(all(torch.equal(e, every[0]) for e in every))
        matches_mean.append(bool(torch.allclose(now, torch.stack(locals_).mean(0), rtol=0, atol=1e-12)))
    return {"same": same, "mean": matches_mean, "own": own, "averager_step": opt.averager.step,
            "state_step": opt.state_dict()["step"]}


@pytest.mark.parametrize("world,period,warmup,use_ddp", [(3, 3, 2, True), (2, 4, 0, False)],
                         ids=["ddp-3ranks-warmup", "module-2ranks"])
def test_parameters_identical_after_each_average_and_differ_between(world, period, warmup, use_ddp):
    steps = warmup + 3 * period + 1
    res = unwrap(run(worker, world, period, warmup, steps, use_ddp))
    # torch's rule: average after optimizer step s (counted from 0) when s >= warmup and
    # (s - warmup) % period == 0; during the warm-up DDP all-reduces gradients every step
    averaged = [s >= warmup and (s - warmup) % period == 0 for s in range(steps)]
    synced = [s < warmup or a for s, a in enumerate(averaged)]
    assert sum(averaged) == 4
    for r in res:
        assert r["same"] == synced, (r["same"], synced)
        # an average is the plain mean of every rank's local update (no weighting)
        assert all(m for m, a in zip(r["mean"], averaged) if a)
        # between averages each rank is on its own: its local update, not the mean
        assert not any(m for m, s in zip(r["mean"], synced) if not s)
        # after the warm-up DDP leaves each rank its own gradient (no all-reduce, no division)
        assert r["own"][warmup:] == [True] * (steps - warmup)
        assert not any(r["own"][:warmup])  # the warm-up's gradients are the all-reduced mean
        assert r["averager_step"] == steps and r["state_step"] == steps


def test_bad_arguments_name_the_argument_and_value():
    """(Checked before the process group is needed: no group in this process.)"""
    net = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    cases = [(dict(period=0), ValueError, r"period.*0"),
             (dict(period=2, warmup_steps=-1), ValueError, r"warmup_steps.*-1"),
             (dict(period="4"), ValueError, r"period.*'4'"),
             (dict(period=2, warmup_steps=5), ValueError, r"warmup_steps must be 0 for a plain module.*5"),
             (dict(period=2, hierarchical="yes"), ValueError, r"hierarchical.*'yes'"),
             (dict(period=2, hierarchical=True), ValueError, r"hierarchical=True.*DDP"),
             (dict(period=2, subgroup=object()), ValueError, r"subgroup"),
             (dict(period=2, resume_step=-3), ValueError, r"resume_step.*-3")]
    for kw, err, pattern in cases:
        with pytest.raises(err, match=pattern):
            local_sgd(net, opt, **kw)
    with pytest.raises(TypeError, match="optimizer"):
        local_sgd(net, "sgd", 2)
    with pytest.raises(TypeError, match="model"):
        local_sgd("net", opt, 2)


def test_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    net = torch.nn.Linear(3, 1)
    with pytest.raises(RuntimeError, match="process group"):
        local_sgd(net, torch.optim.SGD(net.parameters(), lr=0.1), 2)
