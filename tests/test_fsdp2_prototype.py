"""The gradient-transport interface takes a second implementation: a prototype FSDP2 transport
(tests/fsdp2_prototype.py) under the unchanged Balancer and step driver trains the one-large-batch
gradient on 2 Gloo ranks with uneven batches, and a backward outside ``bal.backward`` is refused."""
import numpy as np
import pytest
import torch

from distributed import run, unwrap
from fixed_policy import Scripted

fsdp = pytest.importorskip("torch.distributed.fsdp")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def fsdp2_worker(rank: int, world: int, plain_backward: bool):
    import hetlb
    from hetlb.comm import wrappers
    from fsdp2_prototype import FSDP2Prototype
    from torch.distributed.fsdp import FSDPModule, fully_shard

    wrappers.WRAPPERS[FSDPModule] = FSDP2Prototype
    try:
        model = _model()
        fully_shard(model[0])
        fully_shard(model)
        bal = hetlb.Balancer(model, 8, policy=Scripted([[3, 5], [6, 2], [1, 7]]))
        errors = []
        for step in range(3):
            x, y = _data(step)
            sizes = bal.batch_sizes
            lo = int(sizes[:rank].sum())
            xb, yb = x[lo:lo + int(sizes[rank])], y[lo:lo + int(sizes[rank])]
            for p in model.parameters():
                p.grad = None
            with bal.step():
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                if plain_backward:
                    try:
                        loss.backward()
                    except RuntimeError as e:
                        return {"refused": str(e)}
                else:
                    bal.backward(loss)
            got = [p.grad.full_tensor() for p in model.parameters()]
            ref = _model()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            errors.append((sizes.tolist(), max(float((a - r.grad).abs().max())
                                               for a, r in zip(got, ref.parameters()))))
        return {"errors": errors, "steps": bal.steps, "records": len(bal.history)}
    finally:
        del wrappers.WRAPPERS[FSDPModule]


def test_a_prototype_fsdp2_transport_trains_the_one_large_batch_gradient():
    for res in unwrap(run(fsdp2_worker, 2, False)):
        assert [s for s, _ in res["errors"]] == [[3, 5], [6, 2], [1, 7]]
        assert max(e for _, e in res["errors"]) < 1e-6, res
        assert res["steps"] == 3 and res["records"] == 3


def test_the_prototype_refuses_a_backward_outside_bal_backward():
    for res in unwrap(run(fsdp2_worker, 2, True)):
        assert "goes through bal.backward" in res["refused"]


def refused_worker(rank: int, world: int) -> str:
    import hetlb
    from torch.distributed.fsdp import fully_shard
    model = _model()
    fully_shard(model)
    try:
        hetlb.Balancer(model, 8)
    except TypeError as e:
        return str(e)
    return "accepted"


def test_without_a_transport_for_it_an_fsdp2_model_is_refused():
    for msg in unwrap(run(refused_worker, 2)):
        assert "must be DistributedDataParallel" in msg


def mixed_worker(rank: int, world: int) -> str:
    import hetlb
    from hetlb.comm import wrappers
    from fsdp2_prototype import FSDP2Prototype

    # Each rank's own transport class for the same model type: the ranks disagree on the wrapper.
    wrappers.WRAPPERS[torch.nn.Linear] = type("Named", (FSDP2Prototype,), {"name": f"wrapper {rank}"})
    try:
        hetlb.Balancer(torch.nn.Linear(4, 2), 8, policy=hetlb.Uniform())
    except ValueError as e:
        return str(e)
    finally:
        del wrappers.WRAPPERS[torch.nn.Linear]
    return "accepted"


def test_ranks_whose_models_have_different_wrappers_are_refused_at_start_up():
    msgs = unwrap(run(mixed_worker, 2))
    assert msgs[0] == msgs[1] and "disagree on the model" in msgs[0] and "wrapper 1" in msgs[0], msgs
