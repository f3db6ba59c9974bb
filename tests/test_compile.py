"""torch.compile with a balanced DDP model: ``torch.compile(ddp)`` and ``DDP(torch.compile(net))``
train exact gradients, and the Balancer's hooks add no graph break and no Dynamo warning
(backend="eager": Inductor's C++ builds take minutes on this machine)."""
from __future__ import annotations

import contextlib
import warnings

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import hetlb
from distributed import run, unwrap
from fixed_policy import Fixed


class Net(torch.nn.Module):
    """User code (Dynamo compiles its forward; torch.nn's own modules it leaves alone)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 4)
        self.b = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _breaks():
    from torch._dynamo.utils import counters
    return {k.split("\n")[0] + " | " + k.split("Developer debug context:")[-1].split("\n")[0]
            for k in counters["graph_break"]}


def compile_worker(rank, world):
    import torch._dynamo
    torch.manual_seed(0)
    x = torch.randn(8, 3, dtype=torch.float64)
    out = {}
    # "even": Uniform's equal halves, where the communication hook waits (its backward watch
    # is a forward hook of its own)
    for mode in ("plain", "outer", "inner", "even"):
        torch._dynamo.reset()
        torch.manual_seed(1)
        net = Net().double()
        ddp = DDP(torch.compile(net, backend="eager") if mode == "inner" else net)
        model = torch.compile(ddp, backend="eager") if mode != "inner" else ddp
        bal = None
        if mode != "plain":  # sizes 3 and 5: the weighted hook runs
            bal = hetlb.Balancer(ddp, 8, policy=hetlb.Uniform() if mode == "even" else Fixed([3, 5]))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            grads = []
            for step in range(3):
                xb = x[:3] if rank == 0 else x[3:]
                if mode in ("plain", "even"):  # equal halves: plain DDP's gradient is the reference
                    xb = x[:4] if rank == 0 else x[4:]
                with bal.step() if bal is not None else contextlib.nullcontext():
                    model(xb).pow(2).mean().backward()
                grads.append(torch.cat([p.grad.flatten() for p in ddp.parameters()]).clone())
                ddp.zero_grad()
        explain = torch._dynamo.explain(ddp if mode != "inner" else ddp.module)(x[:4])
        out[mode] = {"grads": grads, "warnings": [str(w.message) for w in caught],
                     "breaks": sorted(_breaks()), "explain": explain.graph_break_count}
        if bal is not None:  # the forward check still runs: a batch off the plan is refused
            try:
                with bal.step():
                    model(x[:2]).sum().backward()
            except hetlb.BatchSizeError as e:
                out[mode]["refused"] = str(e)
    return out


def test_compiled_balanced_models_train_exactly_without_graph_breaks():
    for r in unwrap(run(compile_worker, 2, timeout=240)):
        plain = r["plain"]
        for mode in ("outer", "inner", "even"):
            got = r[mode]
            assert got["warnings"] == [], (mode, got["warnings"])
            assert got["explain"] == 0, mode
            assert "gave the model a batch of 2 samples" in got.get("refused", ""), mode
            # Beyond torch's own (DDP's logger, its forward context, as with plain DDP) only the
            # Balancer's hooks, kept out of the compiled region as DDP's context is (the search
            # for unattached models in steps 0, 1, 2: the first of the model's pre-hooks)
            extra = set(got["breaks"]) - set(plain["breaks"])
            hooks = ("StepGate.__call__", "BackwardWatch.__call__", "UnattachedCheck.__call__")
            assert all(b.startswith("Skip inlining `torch.compiler.disable()`d function") and
                       any(h in b for h in hooks) for b in extra), (mode, extra)
            for g, want in zip(got["grads"], plain["grads"]):  # the mean over the same 8 samples
                torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-12)
