"""The mistakes a port of a real DDP script makes which, unchecked, run cleanly and train (or
report) wrong, each fixed in the library or said at the moment it happens (docs/quickstart.md's
porting checklist): what scripts read of a DistributedSampler's loader, ``shuffle=False`` kept from the
sampler idiom, a DistributedSampler kept in a variable, a forgotten Balancer, sequential readers,
the logged loss, a DDP model that joins late, and the smaller ones.

The ports of whole scripts (pytorch/examples' imagenet, build-nanogpt) are in test_port_scripts.py.
"""
from __future__ import annotations

import logging
import math
import os

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

import hetlb
from distributed import run, unwrap
from fixed_policy import Fixed, Scripted

HERE = os.path.dirname(os.path.abspath(__file__))


class Indexed(torch.utils.data.Dataset):
    """Sample ``i`` is ``(x_i, y_i, i)``: every batch says which samples it holds."""

    def __init__(self, n, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g, dtype=torch.float64)
        self.y = torch.randn(n, 1, generator=g, dtype=torch.float64)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def _port_log(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "hetlb.port"]


# ------------------------------------------------------------- 1. an evaluation loader's sampler


def validate_worker(rank, world, n, batch):
    """imagenet's validate(): the loader's pass, then a leftover pass over the samples from
    ``len(val_loader.sampler) * world`` on, which it reads on every rank."""
    ds = Indexed(n)
    out = {}
    for name in ("torch", "hetlb"):
        if name == "torch":
            sampler = DistributedSampler(ds, shuffle=False, drop_last=True)
            loader = DataLoader(ds, batch_size=batch, sampler=sampler)
        else:
            loader = hetlb.DataLoader(ds, batch_size=batch, shuffle=False)
        reads = []
        with torch.no_grad():
            for _, _, i in loader:
                reads += i.tolist()
            if len(loader.sampler) * world < len(loader.dataset):
                aux = DataLoader(Subset(loader.dataset, range(len(loader.sampler) * world, len(loader.dataset))),
                                 batch_size=batch)
                for _, _, i in aux:
                    reads += i.tolist()
        s = loader.sampler  # (read by name: what a script reads of it)
        out[name] = {"reads": reads, "len_sampler": len(s), "len_loader": len(loader),
                     "replicas": getattr(s, "num_replicas", None), "rank": getattr(s, "rank", None)}
    loader.sampler.set_epoch(1)
    out["epoch"] = getattr(loader.sampler, "epoch", None)
    return out


def test_an_unbound_loader_reads_as_a_distributed_sampler_s_loader_and_no_sample_twice():
    n, batch, world = 53, 8, 2
    res = unwrap(run(validate_worker, world, n, batch))
    for name, most in (("torch", 2), ("hetlb", 1)):
        counts = np.bincount(np.concatenate([r[name]["reads"] for r in res]), minlength=n)
        assert counts.min() >= 1 and counts.max() == most, (name, counts)
    for rank, r in enumerate(res):
        h = r["hetlb"]
        # DistributedSampler(drop_last=False)'s count: ceil(N / world), every rank; reads one fewer
        # on some ranks; len(loader) is batches
        assert h["len_sampler"] == math.ceil(n / world) and len(h["reads"]) in (26, 27), h
        assert h["len_loader"] == math.ceil(n / (batch * world))
        assert (h["replicas"], h["rank"], r["epoch"]) == (world, rank, 1)
    # the sampler says what it is when iterated
    loader = hetlb.DataLoader(Indexed(5), batch_size=2)
    with pytest.raises(TypeError, match="draws no indices: iterate the loader"):
        iter(loader.sampler)


def test_a_bound_loader_s_sampler_counts_the_mean_per_rank():
    ds = Indexed(11)
    loader = hetlb.DataLoader(ds, batch_size=4, drop_last=True)
    hetlb.Balancer(torch.nn.Linear(4, 1).double(), loader=loader, policy=hetlb.Uniform())
    assert len(loader.sampler) == 8 and loader.sampler.total_size == 8 and len(loader) == 2


# ------------------------------------------------------------- 2. shuffle=False kept


def test_a_training_loader_without_shuffle_says_so_once(caplog):
    caplog.set_level(logging.WARNING, logger="hetlb.port")
    model = torch.nn.Linear(4, 1).double()
    loader = hetlb.DataLoader(Indexed(8), batch_size=4, shuffle=False)
    bal = hetlb.Balancer(model, loader=loader, policy=hetlb.Uniform())
    said = _port_log(caplog)
    assert len(said) == 1 and "shuffle=False" in said[0] and "DistributedSampler" in said[0], said
    for _ in range(2):
        for x, y, _ in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
    assert len(_port_log(caplog)) == 1 and bal.steps == 4
    caplog.clear()
    loader = hetlb.DataLoader(Indexed(8), batch_size=4)
    hetlb.Balancer(torch.nn.Linear(4, 1).double(), loader=loader, policy=hetlb.Uniform())
    assert _port_log(caplog) == []


# ------------------------------------------------------------- 3. a DistributedSampler kept


def _train_epoch(model, loader):
    seen = []
    for x, y, i in loader:
        torch.nn.functional.mse_loss(model(x), y).backward()
        seen += i.tolist()
    return seen


def stray_worker(rank, world):
    ds = Indexed(24)
    train_sampler = DistributedSampler(ds)  # the script's variable, read by no loader
    used = DistributedSampler(ds)  # read by a DataLoader (an evaluation one, say): not stray
    evaluation = DataLoader(ds, batch_size=4, sampler=used)
    out = {"fresh": [], "error": None}
    logs = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())
    logging.getLogger("hetlb.port").addHandler(handler)
    ddp = DDP(torch.nn.Linear(4, 1).double())
    loader = hetlb.DataLoader(ds, batch_size=4)
    hetlb.Balancer(ddp, loader=loader, policy=hetlb.Uniform())
    for epoch in range(2):  # a fresh run: the sampler follows the loader's epochs, nothing refused
        train_sampler.set_epoch(epoch)
        out["fresh"].append(_train_epoch(ddp, loader))
    # "--resume" at epoch 3 without the loader's state: the loader would train epoch 0's order
    ddp = DDP(torch.nn.Linear(4, 1).double())
    loader = hetlb.DataLoader(ds, batch_size=4)
    hetlb.Balancer(ddp, loader=loader, policy=hetlb.Uniform())
    train_sampler.set_epoch(3)
    try:
        _train_epoch(ddp, loader)
    except RuntimeError as e:
        out["error"] = str(e)
    loader.set_epoch(3)  # what the message says: the loader's own epoch
    out["after"] = _train_epoch(ddp, loader)
    out["logs"] = logs
    del evaluation
    return out


def test_a_distributed_sampler_kept_in_a_variable_is_named_and_a_resume_past_it_refused():
    res = unwrap(run(stray_worker, 2))
    for epoch in range(2):
        assert sorted(res[0]["fresh"][epoch] + res[1]["fresh"][epoch]) == list(range(24))
    assert sorted(res[0]["after"] + res[1]["after"]) == list(range(24))
    for r in res:
        assert "was set to epoch 3 " in r["error"] and "about to train epoch 0" in r["error"] \
            and "load_state_dict" in r["error"], r["error"]
    # named once per training loader, on rank 0: one stray (the evaluation loader's is read)
    said = [m for m in res[0]["logs"] if "DistributedSampler(s)" in m]
    assert len(said) == 2 and all(m.startswith("1 torch DistributedSampler") for m in said), said
    assert "train_sampler.set_epoch" in said[0] and not res[1]["logs"]


# ------------------------------------------------------------- 4. the Balancer forgotten


def test_an_unbound_loader_iterated_with_gradients_says_it_does_not_balance(caplog):
    caplog.set_level(logging.WARNING, logger="hetlb.port")
    model = torch.nn.Linear(4, 1).double()
    loader = hetlb.DataLoader(Indexed(8), batch_size=4)
    with torch.no_grad():  # evaluation: nothing said
        for x, y, _ in loader:
            model(x)
    assert _port_log(caplog) == []
    for _ in range(2):  # training without a Balancer: said once
        _train_epoch(model, loader)
    said = _port_log(caplog)
    assert len(said) == 1 and "bound to no Balancer" in said[0] and "hetlb.Balancer(" in said[0], said


# ------------------------------------------------------------- 5. sequential readers


def sequential_worker(rank, world, sizes, steps):
    """nanoGPT's DataLoaderLite, ported: each step reads this rank's span of the step's
    sequences from a shared position that moves by the global batch."""
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(4, 1).double())
    bal = hetlb.Balancer(ddp, int(sum(sizes[0])), policy=Scripted(sizes), lower=0)
    data = torch.randn(1000, 4, dtype=torch.float64)
    offset, spans, reads, after = 0, [], [], []
    for _ in range(steps):
        start, stop = bal.span
        spans.append((start, stop, bal.batch_sizes.tolist()))
        reads.append(list(range(offset + start, offset + stop)))
        with bal.step():
            ddp(data[offset + start:offset + stop]).sum().backward()
        offset += stop - start  # (this rank's) ...
        offset += int(sum(spans[-1][2])) - (stop - start)  # ... and the others': the global batch
        # the step just run, and the next one's sizes (already decided: a loop without a loader)
        after.append((bal.finished.step, bal.finished.sizes.tolist(), bal.batch_sizes.tolist()))
    return {"spans": spans, "reads": reads, "type": type(bal.batch_sizes).__name__, "after": after}


def test_a_sequential_reader_reads_every_sequence_once_by_the_rank_s_span():
    sizes = [[3, 5], [6, 2], [0, 8], [7, 1]]
    res = unwrap(run(sequential_worker, 2, sizes, 4))
    assert res[0]["type"] == "ndarray"
    for step, want in enumerate(sizes):
        for rank in range(2):
            start, stop, got = res[rank]["spans"][step]
            assert got == want and (start, stop) == (sum(want[:rank]), sum(want[:rank + 1]))
    reads = sorted(i for r in res for step in r["reads"] for i in step)
    assert reads == list(range(32))
    for step, (done, finished, following) in enumerate(res[0]["after"]):
        assert (done, finished) == (step, sizes[step])
        assert following == sizes[min(step + 1, len(sizes) - 1)]


# ------------------------------------------------------------- 6. the logged loss


def loss_worker(rank, world, sizes, accumulate, exchange_every):
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1).double()
    ddp = DDP(net)
    bal = hetlb.Balancer(ddp, int(sum(sizes[0])), policy=Scripted(sizes), lower=0,
                         accumulate=accumulate, exchange_every=exchange_every)
    loader = bal.loader(Indexed(40, seed=1), seed=3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    out, window, errors = [], [], []  # (window: this rank's samples of each micro-step)
    params = [p.detach().clone() for p in net.parameters()]
    for x, y, i in loader:
        with bal.step():
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            bal.log_loss(loss)
            (loss / accumulate).backward()
        window.append(i.tolist())
        if bal.synced:
            f = bal.finished
            out.append({"step": f.step, "sizes": f.sizes.tolist(), "loss": f.loss,
                        "losses": f.losses.tolist(), "window": window,
                        "params": [p.tolist() for p in params]})
            opt.step()
            opt.zero_grad()
            params = [p.detach().clone() for p in net.parameters()]
            window = []
    bal.flush()
    last = bal.finished
    # misuse: after the backward of a step that sends its row, and outside a step
    for x, y, _ in loader:
        with bal.step():
            ddp(x).sum().backward()
            try:
                bal.log_loss(torch.tensor(1.0))
            except RuntimeError as e:
                errors.append(str(e))
        if errors:
            break
    try:
        bal.log_loss(1.0)
    except RuntimeError as e:
        errors.append(str(e))
    return {"out": out, "last_step": last.step, "errors": errors}


@pytest.mark.parametrize("accumulate,exchange_every", [(1, 1), (2, 1), (1, 4)])
def test_the_logged_loss_is_the_mean_over_the_step_s_samples(accumulate, exchange_every):
    sizes = [[3, 5], [6, 2], [0, 8], [7, 1]]
    res = unwrap(run(loss_worker, 2, sizes, accumulate, exchange_every))
    ds = Indexed(40, seed=1)
    net = torch.nn.Linear(4, 1).double()
    mine, theirs = res[0]["out"], res[1]["out"]
    assert len(mine) == len(theirs) == 5 // accumulate + (5 % accumulate > 0)
    checked = 0
    for j, (a, b) in enumerate(zip(mine, theirs)):
        assert (a["step"], a["sizes"], a["loss"]) == (b["step"], b["sizes"], b["loss"])
        if a["step"] != j:
            continue  # a block's step: the newest that arrived is an earlier one
        with torch.no_grad():
            for p, v in zip(net.parameters(), a["params"]):
                p.copy_(torch.tensor(v, dtype=torch.float64))
            # each micro-step's mean over every rank's samples, averaged over the window
            micro = [torch.nn.functional.mse_loss(net(ds.x[m0 + m1]), ds.y[m0 + m1]).item()
                     for m0, m1 in zip(a["window"], b["window"])]
        want = float(np.mean(micro))
        assert a["loss"] == pytest.approx(want, rel=1e-12, abs=1e-12), (a, want)
        # not the mean of the ranks' means, which a script's all_reduce(AVG) logs
        if 0 < a["sizes"][0] != a["sizes"][1] > 0:
            assert abs(np.mean(a["losses"]) - want) > 1e-6
        checked += 1
    assert checked == (len(mine) if exchange_every == 1 else 2)  # (blocks: steps 0 and 4)
    if exchange_every == 1:
        assert [r["step"] for r in mine] == list(range(len(mine)))
    assert res[0]["last_step"] == res[1]["last_step"] == len(mine) - 1
    err = res[0]["errors"]
    assert "after this step's backward" in err[0] and "before loss.backward()" in err[0]
    assert "outside a balanced step" in err[1]


def test_log_loss_takes_one_number():
    model = torch.nn.Linear(4, 1).double()
    bal = hetlb.Balancer(model, 8, policy=hetlb.Uniform(), exchange_every=1)
    with bal.step():
        loss = model(torch.randn(8, 4, dtype=torch.float64)).pow(2).mean()
        with pytest.raises(ValueError, match="must be one number"):
            bal.log_loss(torch.ones(2))
        with pytest.raises(TypeError, match="tensor of one element or a number"):
            bal.log_loss("0.5")
        bal.log_loss(loss)
        loss.backward()
    assert bal.finished.step == 0 and bal.finished.loss == pytest.approx(loss.item())
    with bal.step():
        model(torch.randn(8, 4, dtype=torch.float64)).pow(2).mean().backward()
    assert bal.finished.step == 1 and math.isnan(bal.finished.loss)  # nothing logged


class _Lagged:
    """What LossLog reads of a step telemetry whose rows lag by ``lag`` steps (a device clock)."""

    def __init__(self, lag):
        self.lag = lag


@pytest.mark.parametrize("lag", [1, 2])
def test_a_lagged_row_carries_the_loss_of_the_window_lag_windows_back(lag):
    """On a device clock the row of window w carries window w - lag's mean (the record of w - lag
    completes with w's table): the windows' means line up with their records whatever the
    micro-steps, dropped micro-steps and re-opened rows do."""
    from hetlb.train.losses import LossLog

    def same(a, b):
        return a == b or (math.isnan(a) and math.isnan(b))

    log = LossLog(_Lagged(lag))
    windows = [[1.0, 3.0], [], [5.0], [2.0, 4.0, 6.0], [7.0]]
    rows = []
    for values in windows:
        rows.append(log.value())
        log.log(99.0)  # a micro-step dropped untrained (a peek, an exception): its loss goes too
        log.discard()
        for j, v in enumerate(values):
            if j:
                log.micro_step_done()
            assert same(log.value(), rows[-1])  # every micro-step's row (and a re-opened one)
            log.log(torch.tensor(v) if j % 2 else v)
        log.window_done()
    means = [float(np.mean(v)) if v else math.nan for v in windows]
    for w, row in enumerate(rows):
        assert same(row, means[w - lag] if w >= lag else math.nan), (w, row)


# ------------------------------------------------------------- 7. a DDP model that joins late


def late_head_worker(rank, world, joins, alone):
    torch.manual_seed(0)
    enc = DDP(torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh()).double())
    bal = hetlb.Balancer(enc, 8, policy=Fixed([3, 5]))
    loader = bal.loader(Indexed(80), seed=1)
    head = None
    try:
        for step, (x, y, _) in enumerate(loader):
            if step == joins:
                torch.manual_seed(1)
                head = DDP(torch.nn.Linear(6, 1).double())  # created late, never attached
            h = enc(x)
            out = head(h) if head is not None else h.sum(1, keepdim=True)
            torch.nn.functional.mse_loss(out, y).backward()
            if rank == 0 or not alone:
                bal.steps  # (ends the step: its check runs at its end)
    except RuntimeError as e:
        return {"steps": bal.steps, "error": str(e)}
    return {"steps": bal.steps, "error": None}


# A model made inside a step (after the step opened, which is when a step's search starts) is
# found in the next step: a DDP model was made since the last search. Read on one rank only,
# `bal.steps` ends the step on that rank alone: the ranks compare their searches at the next
# batch (comparing at the read would be a collective the other rank never joins).
@pytest.mark.parametrize("joins,found,alone", [(2, 3, False), (5, 6, False), (2, 3, True),
                                               (5, 6, True)])
def test_a_ddp_model_that_joins_late_is_refused_at_the_next_check(joins, found, alone):
    rs = unwrap(run(late_head_worker, 2, joins, alone))
    print([(r["steps"], r["error"][:60]) for r in rs])
    for r in rs:
        assert r["steps"] == found + 1, r
        assert f"found in step {found}" in r["error"] and "bal.attach(model)" in r["error"]


# ------------------------------------------------------------- 8. smaller ones


def grad_sync_worker(rank, world):
    out = []
    for loader in (False, True):
        ddp = DDP(torch.nn.Linear(4, 1).double())
        bal = hetlb.Balancer(ddp, 8, policy=Fixed([3, 5]))
        ddp.require_backward_grad_sync = False  # nanoGPT's accumulation, without accumulate=
        try:
            if loader:  # the forward's check
                for x, y, _ in bal.loader(Indexed(16)):
                    ddp(x)
            else:  # bal.step()'s
                with bal.step():
                    ddp(torch.randn([3, 5][rank], 4, dtype=torch.float64))
        except RuntimeError as e:
            out.append(str(e))
    return out


def test_the_no_sync_error_names_require_backward_grad_sync():
    for msgs in unwrap(run(grad_sync_worker, 2)):
        assert len(msgs) == 2
        for msg in msgs:
            assert "require_backward_grad_sync = False" in msg and "accumulate=K" in msg, msg


def test_the_docs_state_the_rules_as_coded():
    """README's port line count says how it counts (the diff it shows has 6 lines, counted as 5),
    and docs/modes.md states DelayedSync's counter rule as hetlb/sync/delayed.py codes it
    (test_delayed.py checks the rule itself)."""
    root = os.path.dirname(HERE)
    with open(os.path.join(root, "README.md")) as f:
        readme = " ".join(f.read().split())
    assert "a replaced line counts once" in readme
    with open(os.path.join(root, "docs", "modes.md")) as f:
        modes = " ".join(f.read().split())
    assert "each training forward pass on any rank counted once" not in modes
    assert "every rank that trained a sample in the iteration" in modes
