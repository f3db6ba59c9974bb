"""hetlb.DelayedSync (ABS-SGD): the update against a hand-written reference, the epoch, resume."""
import numpy as np
import pytest
import torch

import hetlb
from hetlb.emulate import Emulator

from distributed import run, unwrap


def batch_of(rank, j, m=4):
    g = torch.Generator().manual_seed(1000 * rank + j)
    x = torch.randn(m, 3, generator=g, dtype=torch.float64)
    return x, x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)[:, None] + 0.3


def model0():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1).double()


OPTIMIZERS = {
    "sgd": lambda ps, lr: torch.optim.SGD(ps, lr=lr),
    "momentum": lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9, nesterov=True),
    "adam": lambda ps, lr: torch.optim.Adam(ps, lr=lr),
}


def reference(world, iterations, k, lam, lr, optimizer="sgd"):
    """ABS-SGD Algorithm 1 written out on one process: every rank's k reference batches of an
    iteration at the current parameters; the previous iteration's weighted mean, with delay
    compensation, given to the optimizer as the gradient at the iteration's end."""
    net = model0()
    leaf = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone().requires_grad_()
    opt = OPTIMIZERS[optimizer]([leaf], lr)
    x = leaf.detach().clone()
    shapes = [p.shape for p in net.parameters()]

    def grad_sum(x, rank, j):
        w, b = x[:3].reshape(shapes[0]).clone().requires_grad_(), x[3:].reshape(shapes[1]).clone().requires_grad_()
        xb, yb = batch_of(rank, j)
        loss = ((xb @ w.T + b - yb) ** 2).mean()
        gw, gb = torch.autograd.grad(loss, [w, b])
        return torch.cat([gw.reshape(-1), gb.reshape(-1)]) * xb.shape[0], xb.shape[0]

    inflight = None
    for it in range(iterations):
        G, M = torch.zeros_like(x), 0
        for r in range(world):
            for j in range(it * k, (it + 1) * k):
                g, m = grad_sum(x, r, j)
                G, M = G + g, M + m
        if inflight is not None:
            gbar = inflight[0] / inflight[1]
            leaf.grad = gbar + lam * gbar * gbar * (x - inflight[2])
            opt.step()
        inflight = (G, M, x.clone())
        x = leaf.detach().clone()
    return x


def update_worker(rank, world, iterations, k, lam, lr, optimizer="sgd"):
    net = model0()
    opt = OPTIMIZERS[optimizer](net.parameters(), lr)
    ds = hetlb.DelayedSync(net, opt, reference_batch=4, lam=lam, batches_per_iteration=k)
    applied = []
    for j in range(iterations * k):
        xb, yb = batch_of(rank, j)
        ((net(xb) - yb) ** 2).mean().backward()
        applied.append(ds.step())
    out = {"x": torch.cat([p.detach().reshape(-1) for p in net.parameters()]).tolist(),
           "applied": applied, "batch": [r.batch.tolist() for r in ds.history]}
    ds.flush()  # nothing left in flight when the group goes
    return out


@pytest.mark.parametrize("lam,optimizer", [(0.0, "sgd"), (0.5, "sgd"), (0.5, "momentum"), (0.5, "adam")])
def test_update_equals_the_hand_computed_abs_sgd_update(lam, optimizer):
    """With momentum or Adam the optimizer receives the compensated stale gradient as p.grad."""
    world, iterations, k, lr = 2, 5, 2, 0.05
    res = unwrap(run(update_worker, world, iterations, k, lam, lr, optimizer))
    want = reference(world, iterations, k, lam, lr, optimizer)
    for r in res:
        np.testing.assert_allclose(r["x"], want.tolist(), rtol=1e-12, atol=1e-14)
        # an update after every iteration but the first (nothing was in flight then)
        assert r["applied"] == [False] * k + ([False] * (k - 1) + [True]) * (iterations - 1)
        assert r["batch"] == [[4 * k] * world] * (iterations - 1)
    assert res[0]["x"] == res[1]["x"]  # every rank holds the same parameters


def test_lambda_zero_is_one_step_delayed_sgd():
    """With lam = 0 each update is the plain weighted mean of the gradients of one iteration
    earlier: x_{t+1} = x_t - lr * mean_grad(x_{t-1})."""
    lr = 0.05

    def mean_grad(x_net, j):
        grads = []
        for r in range(2):
            x_net.zero_grad()
            xb, yb = batch_of(r, j)
            ((x_net(xb) - yb) ** 2).mean().backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in x_net.parameters()]))
        return (grads[0] + grads[1]) / 2

    x0 = reference(2, 1, 1, 0.0, lr)  # iteration 0 applies nothing: nothing was in flight
    x1 = reference(2, 2, 1, 0.0, lr)
    x2 = reference(2, 3, 1, 0.0, lr)
    net = model0()
    np.testing.assert_allclose(x0, torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    g0, g1 = mean_grad(net, 0), mean_grad(net, 1)  # iterations 0 and 1 both ran at x0
    np.testing.assert_allclose(x1, x0 - lr * g0, rtol=1e-12)
    np.testing.assert_allclose(x2, x1 - lr * g1, rtol=1e-12)


def loader_worker(rank, world, speeds, n, epochs, state=None, stop_at=None):
    torch.manual_seed(0)
    net = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    emu = Emulator.for_rank(rank, speeds, model=hetlb.LinearModel(0.0, 0.012), spin=0.0005)
    ds = hetlb.DelayedSync(net, opt, reference_batch=8, emulator=emu)
    data = torch.utils.data.TensorDataset(torch.arange(n, dtype=torch.float32)[:, None])
    loader = ds.loader(data, seed=5)
    if state is not None:
        loader.load_state_dict(state)
    seen, shards = {}, {}
    epoch = ds.board.epoch
    while epoch < epochs:
        loader.set_epoch(epoch)
        for (x,) in loader:
            shards[epoch] = ds.board.shards.tolist()
            net(x).sum().backward()
            seen.setdefault(epoch, []).extend(int(v) for v in x[:, 0].tolist())
            if ds.step() and stop_at is not None and ds.updates == stop_at:
                return {"seen": seen, "state": loader.state_dict(), "shards": shards}
        epoch += 1
    return {"seen": seen, "shards": shards, "batch": [r.batch.tolist() for r in ds.history],
            "updates": ds.updates, "x": [p.detach().tolist() for p in net.parameters()]}


def test_every_sample_once_and_shards_follow_speed():
    n = 800
    res = unwrap(run(loader_worker, 4, [1.0, 2.0, 3.0, 4.0], n, 2))
    for e in range(2):
        assert sorted(sum((r["seen"][e] for r in res), [])) == list(range(n)), f"epoch {e}"
    assert len({str(r["x"]) for r in res}) == 1 and len({r["updates"] for r in res}) == 1
    share = np.array([1, 2, 3, 4]) / 10
    # Epoch 1's shards are cut by epoch 0's measured shares.
    np.testing.assert_allclose(np.array(res[0]["shards"][1]) / n, share, rtol=0.15)
    # Settled iterations: every rank computing, past the first of an epoch (nothing is in
    # flight at an epoch's start, so every rank sends after one reference batch there).
    busy = np.array([b for b in res[0]["batch"] if min(b) > 0 and max(b) > 8], dtype=float)
    np.testing.assert_allclose(busy.sum(0) / busy.sum(), share, rtol=0.15)


def test_checkpoint_with_an_all_reduce_in_flight_resumes_exactly_once():
    n = 240
    first = unwrap(run(loader_worker, 2, [1.0, 2.0], n, 2, None, 4))
    state = first[0]["state"]
    rest = unwrap(run(loader_worker, 2, [1.0, 2.0], n, 2, state))
    before = sum((r["seen"].get(0, []) for r in first), [])
    after = sum((r["seen"].get(0, []) for r in rest), [])
    assert sorted(before + after) == list(range(n))
    assert sorted(sum((r["seen"][1] for r in rest), [])) == list(range(n))


def test_bad_input():
    net = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="weighting"):
        hetlb.DelayedSync(net, opt, 4, weighting="mean")
    with pytest.raises(ValueError, match="reference_batch"):
        hetlb.DelayedSync(net, opt, 0)
    ds = hetlb.DelayedSync(net, opt, 4)
    with pytest.raises(ValueError, match="batch_size= is not accepted"):
        ds.loader(torch.utils.data.TensorDataset(torch.zeros(8, 1)), batch_size=4)
