"""Per-rank recomputation (``hetlb.Recompute``): the time model a policy allocates by is the
lesser of a rank's plain and recomputing micro-steps at every integer share (against brute
force), the rank runs each share the way that model says, and on real Gloo ranks (DDP, FSDP2,
HSDP) ranks that recompute beside ranks that do not train the one large batch's gradient."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import hetlb
from hetlb.core.models import LinearModel, PolyModel, lesser_model, micro_step_model
from hetlb.policies import Context
from hetlb.train.profile import Profile

from distributed import run, unwrap
from fixed_policy import Scripted


@settings(max_examples=60, deadline=None)
@given(a0=st.floats(0.0, 1.0), a1=st.floats(1e-4, 0.1), c0=st.floats(0.0, 1.0),
       c1=st.floats(1e-4, 0.1), m=st.integers(1, 12), mr=st.integers(1, 40),
       total=st.integers(1, 300))
def test_the_lesser_of_two_micro_step_models_is_exact_at_every_integer(a0, a1, c0, c1, m, mr, total):
    plain = micro_step_model(LinearModel(a0, a1), m, total)
    again = micro_step_model(LinearModel(c0, c1), mr, total)
    both = lesser_model(plain, again, np.concatenate([plain.batch_sizes, again.batch_sizes]))
    b = np.arange(1, total + 1)
    want = np.minimum([_brute(a0, a1, m, x) for x in b], [_brute(c0, c1, mr, x) for x in b])
    np.testing.assert_allclose(both.time(b), want, rtol=1e-9, atol=1e-12)


def _brute(a0: float, a1: float, m: int, b: int) -> float:
    """``b`` samples in ``ceil(b / m)`` micro-steps, each ``a0 + a1 * size``."""
    k = -(-b // m)
    return sum(a0 + a1 * len(c) for c in np.array_split(np.arange(b), k))


def _profiles():
    """A rank whose plain micro-batch holds 2 samples, each micro-step 0.1 s of fixed cost, and
    which holds 8 recomputing at 30 % more time a sample: plain pays off at 2 samples or fewer."""
    plain = Profile(batch_sizes=[1, 2], times=[0.11, 0.12], limit=2, oom_at=3)
    again = Profile(batch_sizes=[1, 2, 4, 8], times=[0.1 + 0.013 * b for b in (1, 2, 4, 8)],
                    limit=8, oom_at=9)
    return plain, again


def _context(total: int = 24) -> Context:
    plain, again = _profiles()
    prof = {"model": plain.fit("cubic"), "linear": plain.fit("linear"), "limit": 2}
    rc = {"model": again.fit("cubic"), "linear": again.fit("linear"), "micro_batch": 8}
    return Context.simple(2, total, profiles=[prof, dict(prof)], micro_batch=[2, 2],
                          recompute=[rc, None])


def test_a_rank_recomputes_where_its_profiles_say_it_is_faster():
    ctx = _context()
    got = [(b, ctx.recomputes(0, b), ctx.micro_limit(0, b)) for b in (1, 2, 3, 9, 24)]
    assert got == [(1, False, 2), (2, False, 2), (3, True, 8), (9, True, 8), (24, True, 8)]
    assert not any(ctx.recomputes(1, b) for b in range(25)) and ctx.micro_limit(1, 9) == 2
    models = ctx.models()
    for b in range(1, 25):  # the policies' model: each rank's time the way it runs the share
        plain = 0.1 * -(-b // 2) + 0.01 * b
        again = 0.1 * -(-b // 8) + 0.013 * b
        assert models[0].time(b) == pytest.approx(min(plain, again), rel=1e-9)
        assert models[1].time(b) == pytest.approx(plain, rel=1e-9)


def test_lbb_allocates_by_the_faster_way():
    """Both ranks alike but for rank 0's recomputation: LBB's start gives it the larger share
    (24 samples: 12 plain take 0.72 s, recomputing 0.356 s)."""
    lbb = hetlb.LBB()
    sizes = lbb.start(_context())
    assert sizes.sum() == 24 and sizes[0] > sizes[1], sizes
    # its rapid-tune counts the micro-steps of the way each rank ran the measured step
    assert lbb.micro_limits(np.array([2, 9])).tolist() == [2, 2]
    assert lbb.micro_limits(np.array([9, 9])).tolist() == [8, 2]


def test_lbbs_rough_models_keep_the_way_each_rank_takes():
    """The rapid-tune's model of a rank that may recompute, measured running 2 samples plainly
    (0.24 s, twice its profile's 0.12 s): both ways scaled by 2, the lesser at every share, so
    at 24 samples it is the recomputing way's (not 12 plain micro-steps')."""
    from hetlb.core.telemetry import StepRecord
    lbb = hetlb.LBB()
    lbb.start(_context())
    rec = StepRecord(step=0, epoch=0, batch=np.array([2, 22]), compute=np.array([0.24, 1.0]),
                     data=np.array([2.0, 22.0]), memory=np.zeros(2), cpu=np.zeros(2),
                     predicted=np.full(2, np.nan))
    rough = lbb.recomputing_models(rec)
    assert list(rough) == [0]  # (rank 1 cannot recompute)
    for b in (1, 2, 3, 9, 24):
        plain = 0.1 * -(-b // 2) + 0.01 * b
        again = 0.1 * -(-b // 8) + 0.013 * b
        assert rough[0].time(b) == pytest.approx(2 * min(plain, again), rel=1e-9)


def test_recompute_is_made_under_no_grad_and_not_of_the_whole_model():
    net = _Net()
    plain, again = _profiles()
    with torch.no_grad():
        rc = hetlb.Recompute([net.hidden], profile=again)
    assert not rc.enabled
    with pytest.raises(ValueError, match="the Balancer's model itself"):
        hetlb.Balancer(net, 8, recompute=hetlb.Recompute([net], profile=again), micro_batch=2,
                       profile=plain)


def test_bad_recompute_arguments_are_refused():
    net = _Net()
    plain, again = _profiles()
    with pytest.raises(TypeError, match="list of torch.nn.Module"):
        hetlb.Recompute(net.hidden)
    with pytest.raises(ValueError, match="empty"):
        hetlb.Recompute([])
    rc = hetlb.Recompute([net.hidden], profile=again)
    with pytest.raises(ValueError, match="pass micro_batch= and profile="):
        hetlb.Balancer(net, 8, recompute=rc, profile=plain)
    with pytest.raises(ValueError, match="not modules of the Balancer's model"):
        hetlb.Balancer(net, 8, recompute=hetlb.Recompute([_Net().hidden], profile=again),
                       micro_batch=2, profile=plain)
    with pytest.raises(ValueError, match="no profile"):
        hetlb.Balancer(net, 8, recompute=hetlb.Recompute([net.first]), micro_batch=2,
                       profile=plain)
    with pytest.raises(TypeError, match="recompute must be a hetlb.Recompute"):
        hetlb.Balancer(net, 8, recompute=[net.hidden], micro_batch=2, profile=plain)


class _Net(torch.nn.Module):
    """Three layers; ``hidden``'s forward counts its calls (a recomputed one runs twice)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.hidden, self.last = (torch.nn.Linear(4, 8), _Counted(8, 8),
                                              torch.nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.hidden(torch.tanh(self.first(x))))


class _Counted(torch.nn.Linear):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Counted.calls += 1
        return torch.tanh(super().forward(x))


SIZES = [2, 5, 4, 9]  # rank 0 plain (2 samples), ranks 1 and 3 recompute, rank 2 cannot


def recompute_worker(rank: int, world: int, wrapper: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    net = _Net()
    if wrapper == "ddp":
        model, inner = torch.nn.parallel.DistributedDataParallel(net), net
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) \
            if wrapper == "hsdp" else init_device_mesh("cpu", (world,))
        for layer in (net.first, net.hidden):
            fully_shard(layer, mesh=mesh)
        model = inner = fully_shard(net, mesh=mesh)
    plain, again = _profiles()
    rc = hetlb.Recompute([inner.hidden], profile=again) if rank != 2 else None
    bal = hetlb.Balancer(model, sum(SIZES), policy=Scripted([SIZES]), micro_batch=2,
                         profile=plain, recompute=rc)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(sum(SIZES), 4, generator=g), torch.randn(sum(SIZES), 2, generator=g)
    lo = sum(SIZES[:rank])
    chunks = []

    def fn(xb, yb):
        chunks.append(len(xb))
        return torch.nn.functional.mse_loss(model(xb), yb)

    _Counted.calls = 0
    with bal.step():
        bal.micro_steps(fn, x[lo:lo + SIZES[rank]], y[lo:lo + SIZES[rank]])
    hidden = _Counted.calls
    got = [p.grad.full_tensor() if wrapper != "ddp" else p.grad for p in model.parameters()]
    ref = _Net()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    rel = max(float((a - r.grad).abs().max() / r.grad.abs().max())
              for a, r in zip(got, ref.parameters()))
    return {"rel": rel, "chunks": chunks, "hidden": hidden,
            "off": rc is None or not rc.enabled}


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp", "hsdp"])
def test_ranks_that_recompute_beside_ranks_that_do_not_train_the_one_large_batch_gradient(wrapper):
    res = unwrap(run(recompute_worker, 4, wrapper, timeout=120))
    for r, out in enumerate(res):
        assert out["rel"] < 1e-6, (r, out)
        # rank 0 plain in one micro-step; 1 and 3 recomputing in micro-steps of up to 8, the
        # hidden layer's forward run again in the backward; 2 plain in micro-steps of 2
        assert out["chunks"] == [[2], [5], [2, 2], [4, 5]][r], (r, out)
        assert out["hidden"] == [1, 2, 2, 4][r], (r, out)
        assert out["off"], (r, out)
