"""Balancer in one process (no process group): API, errors, checkpoints, aggregation weights.

The multi-process behaviour (real DDP over Gloo) is in test_balancer_dist.py.
"""
from collections import namedtuple

import numpy as np
import pytest
import torch

import hetlb
from hetlb.aggregate import weights_for
from hetlb.data import _empty_like

from fixed_policy import Fixed


def dataset(n=50):
    return torch.utils.data.TensorDataset(torch.arange(n, dtype=torch.float32)[:, None])


def train(bal, loader, model, steps=None):
    seen = []
    for k, (x,) in enumerate(loader):
        with bal.step():
            model(x).sum().backward()
        seen.extend(int(v) for v in x[:, 0])
        if steps is not None and k + 1 == steps:
            break
    return seen


def test_single_process_training_records_telemetry():
    model = torch.nn.Linear(1, 1)
    bal = hetlb.Balancer(model, 8)
    loader = bal.loader(dataset(50), seed=2)
    seen = train(bal, loader, model)
    assert sorted(seen) == list(range(50))
    assert bal.steps == 7 and len(bal.history) == 7
    r = bal.history[-1]
    assert r.batch.tolist() == [2] and r.step == 6  # the short last step: 50 = 6 * 8 + 2
    assert np.all(bal.history.column("compute") > 0)
    assert bal.batch_sizes.tolist() == [8]
    assert 0 < bal.last_overhead < 0.1


def test_step_without_a_loader_uses_the_decision():
    model = torch.nn.Linear(2, 1)
    bal = hetlb.Balancer(model, 5, policy=hetlb.Uniform())
    for _ in range(3):
        with bal.step():
            model(torch.randn(int(bal.batch_sizes[0]), 2)).sum().backward()
    assert bal.steps == 3 and bal.history[-1].batch.tolist() == [5]


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"global_batch": 0}, ValueError, "positive integer"),
    ({"global_batch": 2.5}, ValueError, "positive integer"),
    ({"global_batch": True}, ValueError, "positive integer"),
    ({"global_batch": 4, "weighting": "mean"}, ValueError, "weighting must be one of"),
    ({"global_batch": 4, "policy": Fixed([3])}, ValueError, "summing to 3"),
    ({"global_batch": 4, "policy": Fixed([4.0])}, ValueError, "expected 1 integers"),
    ({"global_batch": 4, "upper": 2}, ValueError, "exceeds the sum of upper"),
])
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        hetlb.Balancer(torch.nn.Linear(1, 1), **kwargs)


def test_policy_that_breaks_the_sum_later_is_caught():
    class Drifting(Fixed):
        def decide(self, history):
            return self.sizes + 1

    model = torch.nn.Linear(1, 1)
    bal = hetlb.Balancer(model, 4, policy=Drifting([4]))
    with pytest.raises(ValueError, match="Drifting returned sizes \\[5\\] summing to 5"):
        with bal.step():
            model(torch.randn(4, 1)).sum().backward()


def test_misuse_is_reported():
    model = torch.nn.Linear(1, 1)
    bal = hetlb.Balancer(model, 4, weighting="sizes")
    with pytest.raises(ValueError, match="needs per-sample sizes"):
        bal.loader(dataset())
    with pytest.raises(ValueError, match="sizes must be 50 finite"):
        bal.loader(dataset(), sizes=[1.0] * 49)
    with pytest.raises(ValueError, match="batch_size= is decided by the Balancer"):
        bal.loader(dataset(), sizes=[1.0] * 50, batch_size=3)
    bal.loader(dataset(), sizes=[1.0] * 50)
    with pytest.raises(RuntimeError, match="without a new batch"):
        with bal.step():
            pass
    bal2 = hetlb.Balancer(model, 4)
    with pytest.raises(RuntimeError, match="cannot nest"):
        with bal2.step():
            with pytest.raises(RuntimeError, match="inside a step"):
                bal2.state_dict()
            with bal2.step():
                pass


def test_exception_inside_a_step_leaves_the_balancer_usable():
    model = torch.nn.Linear(1, 1)
    bal = hetlb.Balancer(model, 4)
    with pytest.raises(KeyError):
        with bal.step():
            raise KeyError("user error")
    with bal.step():
        model(torch.randn(4, 1)).sum().backward()
    assert bal.steps == 1


def test_resume_mid_epoch_continues_the_same_order():
    model = torch.nn.Linear(1, 1)
    whole = hetlb.Balancer(model, 6, policy=hetlb.LBB())
    ref = train(whole, whole.loader(dataset(40), seed=4), model)

    a = hetlb.Balancer(model, 6, policy=hetlb.LBB())
    first = train(a, a.loader(dataset(40), seed=4), model, steps=3)
    state = a.state_dict()
    b = hetlb.Balancer(model, 6, policy=hetlb.LBB())
    loader = b.loader(dataset(40), seed=0)  # the checkpoint's seed wins
    b.load_state_dict(state)
    assert b.steps == 3 and len(b.history) == 3
    rest = train(b, loader, model)
    assert first + rest == ref
    with pytest.raises(ValueError, match="global_batch"):
        hetlb.Balancer(model, 7).load_state_dict(state)


def test_weights_for():
    b = np.array([1, 3, 0, 4])
    np.testing.assert_allclose(weights_for("samples", b), [1 / 8, 3 / 8, 0, 4 / 8])
    np.testing.assert_allclose(weights_for("sizes", b, np.array([2.0, 2.0, 0.0, 4.0])), [.25, .25, 0, .5])
    np.testing.assert_allclose(weights_for("none", b), [0.25] * 4)
    with pytest.raises(ValueError, match="no samples"):
        weights_for("samples", np.zeros(3))
    with pytest.raises(ValueError, match="needs the data amount"):
        weights_for("sizes", b)
    with pytest.raises(ValueError, match="finite non-negative"):
        weights_for("sizes", b, np.array([1.0, np.nan, 1.0, 1.0]))


def test_empty_batches_keep_their_structure():
    Pair = namedtuple("Pair", "x y")
    batch = {"a": torch.ones(3, 2), "b": [torch.zeros(3), np.ones((3, 4))], "c": Pair(torch.ones(3), "s")}
    e = _empty_like(batch)
    assert e["a"].shape == (0, 2) and e["b"][0].shape == (0,) and e["b"][1].shape == (0, 4)
    assert isinstance(e["c"], Pair) and e["c"].x.shape == (0,) and e["c"].y == "s"


def test_balancer_and_persistent_workers_free_promptly():
    # No reference cycle through the DataLoader: freed by reference counting, workers shut down
    # at once (a cycle left them to the garbage collector: 5 s per worker).
    import gc
    import time
    import weakref
    model = torch.nn.Linear(1, 1)
    bal = hetlb.Balancer(model, 6)
    loader = bal.loader(dataset(30), num_workers=2, persistent_workers=True)
    train(bal, loader, model)
    ref = weakref.ref(bal)
    gc.disable()
    try:
        t = time.perf_counter()
        del bal, loader
        assert ref() is None
        assert time.perf_counter() - t < 3.0
    finally:
        gc.enable()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_premul_factor_matches_the_bucket(dtype):
    # NCCL reads a PREMUL_SUM tensor factor with the reduced data's type: it must match.
    from hetlb.aggregate import HookState, premul_factor
    state = HookState(group=None, rank=0, world=2)
    state.reset(52 / 512, np.zeros(9))
    buf = torch.zeros(10, dtype=dtype)
    f = premul_factor(state, buf)
    assert f.dtype == dtype and f.device == buf.device and f.numel() == 1
    assert premul_factor(state, buf) is f  # one per step and dtype
    assert abs(float(f) - 52 / 512) <= 2 ** -8 * 52 / 512
    state.reset(0.5, np.zeros(9))
    assert float(premul_factor(state, buf)) == 0.5
