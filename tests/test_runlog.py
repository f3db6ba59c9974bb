"""Run logs: JSON lines and TensorBoard scalars from the Balancer (rank 0 only), read back;
``hetlb report``; ``hetlb profile``."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import hetlb
from hetlb.cli.commands import main
from hetlb.train.runlog import read_run


def train_steps(bal, model, steps):
    for _ in range(steps):
        x = torch.randn(int(bal.batch_sizes[bal.rank]), 2)
        with bal.step():
            model(x).sum().backward()


def test_balancer_writes_json_lines_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    model = torch.nn.Linear(2, 1)
    bal = hetlb.Balancer(model, 6, policy=hetlb.LBB(), log_dir=str(tmp_path), tensorboard=True)
    train_steps(bal, model, 7)
    bal.close()
    steps = read_run(tmp_path)
    assert [s["step"] for s in steps] == list(range(7))
    for s, rec in zip(steps, bal.history):
        assert s["batch"] == rec.batch.tolist() and s["compute"] == pytest.approx(rec.compute.tolist())
        assert s["step_time"] == pytest.approx(float(rec.compute.max()))
        assert s["policy"] == "lbb" and s["decision"] == [6] and s["se"] == 0.0
    ev = EventAccumulator(str(tmp_path))
    ev.Reload()
    assert {"step/time", "step/se", "batch/rank0", "compute/rank0"} <= set(ev.Tags()["scalars"])
    got = ev.Scalars("step/time")
    assert [e.step for e in got] == list(range(7))
    assert [e.value for e in got] == pytest.approx([s["step_time"] for s in steps], rel=1e-6)


def test_log_dir_from_the_environment_and_appending_on_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("HETLB_LOG_DIR", str(tmp_path / "env"))
    model = torch.nn.Linear(2, 1)
    bal = hetlb.Balancer(model, 4, policy=hetlb.Uniform(), tensorboard=False)
    train_steps(bal, model, 3)
    # Uniform exchanges in blocks by default: a checkpoint's history (and so the resumed log)
    # holds the steps of the last exchange; a flush first records the rest.
    bal.flush()
    state = bal.state_dict()
    bal.close()
    model2 = torch.nn.Linear(2, 1)  # a restarted process: a new model and Balancer
    bal2 = hetlb.Balancer(model2, 4, policy=hetlb.Uniform(), tensorboard=False)
    bal2.load_state_dict(state)
    train_steps(bal2, model2, 2)
    bal2.close()
    steps = read_run(tmp_path / "env" / "run.jsonl")
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4]
    assert not any(f.startswith("events") for f in os.listdir(tmp_path / "env"))


def test_no_log_without_a_log_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("HETLB_LOG_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(2, 1)
    bal = hetlb.Balancer(model, 4)
    train_steps(bal, model, 2)
    assert bal.runlog is None and os.listdir(tmp_path) == []


def logged_worker(rank, world, log_dir):
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(torch.nn.Linear(2, 1))
    bal = hetlb.Balancer(ddp, 8, policy=hetlb.LBB(), log_dir=log_dir, tensorboard=False)
    for _ in range(5):
        x = torch.randn(int(bal.batch_sizes[rank]), 2)
        with bal.step():
            ddp(x).sum().backward()
    bal.close()
    return [r.batch.tolist() for r in bal.history]


def test_only_rank_zero_writes_and_the_log_is_the_world_table(tmp_path):
    from distributed import run, unwrap
    res = unwrap(run(logged_worker, 2, str(tmp_path)))
    steps = read_run(tmp_path)
    assert len(steps) == 5 and [s["batch"] for s in steps] == res[0] == res[1]
    assert os.listdir(tmp_path) == ["run.jsonl"]


def test_report_prints_and_plots_and_names_a_bad_line(tmp_path, capsys):
    model = torch.nn.Linear(2, 1)
    bal = hetlb.Balancer(model, 4, policy=hetlb.Uniform(), log_dir=str(tmp_path), tensorboard=False)
    train_steps(bal, model, 4)
    bal.close()
    png = tmp_path / "r.png"
    assert main(["report", str(tmp_path / "run.jsonl"), "--plot", str(png), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 4 and out["ranks"] == 1 and out["last_sizes"] == [4]
    assert png.stat().st_size > 10_000
    with open(tmp_path / "run.jsonl", "a") as f:
        f.write('{"step": 9}\n')
    assert main(["report", str(tmp_path)]) == 2
    assert "run.jsonl:5: not a hetlb step record" in capsys.readouterr().err


def test_report_reads_a_crashed_run_s_log_and_names_a_binary_file(tmp_path, capsys, caplog):
    model = torch.nn.Linear(2, 1)
    bal = hetlb.Balancer(model, 4, policy=hetlb.Uniform(), log_dir=str(tmp_path), tensorboard=False)
    train_steps(bal, model, 4)
    bal.close()
    log = tmp_path / "run.jsonl"
    whole = log.read_text()
    log.write_text(whole + whole.splitlines()[-1][:17])  # a run that stopped mid-line
    assert main(["report", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 4
    assert "the last line is cut off" in caplog.text
    log.write_text(whole + whole.splitlines()[-1][:17] + "\n")  # a whole line that is not JSON
    assert main(["report", str(tmp_path)]) == 2
    assert "run.jsonl:5: not JSON" in capsys.readouterr().err
    log.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    assert main(["report", str(log)]) == 2
    assert "run.jsonl: not a text file" in capsys.readouterr().err


def test_profile_command_writes_a_profile_plan_reads(tmp_path, capsys):
    out = tmp_path / "mlp.json"
    assert main(["profile", "mlp", "--batch-sizes", "2,4,8", "--repeats", "2", "--trim", "0",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "linear fit" in text and "samples/s" in text
    prof = hetlb.Profile.load(out)
    assert prof.batch_sizes == [2, 4, 8] and len(prof.times) == 3 and all(t > 0 for t in prof.times)
    assert main(["plan", str(out), str(out), "--global-batch", "16", "--model", "linear", "--json"]) == 0
    splits = json.loads(capsys.readouterr().out)["splits"]
    assert sum(splits[1]["sizes"]) == 16


@pytest.mark.parametrize("spec, message", [
    ("nosuchmodule_xyz:make", "cannot import"),
    ("hetlb.cli.zoo:nothing", "has no 'nothing'"),
    ("resnet", "expected MODULE:FACTORY"),
])
def test_profile_errors(capsys, spec, message):
    assert main(["profile", spec]) == 2
    assert message in capsys.readouterr().err


def blocked_log_worker(rank, world, log_dir, flush):
    import logging
    from torch.nn.parallel import DistributedDataParallel as DDP
    seen = []
    handler = logging.Handler()
    handler.emit = lambda r: seen.append(r.getMessage())
    logging.getLogger("hetlb").addHandler(handler)
    ddp = DDP(torch.nn.Linear(2, 1))
    bal = hetlb.Balancer(ddp, 8, policy=hetlb.Uniform(), log_dir=log_dir, tensorboard=False)
    for _ in range(5):  # blocks [0] [1-2] [3-6]: steps 3 and 4 wait for their exchange
        with bal.step():
            ddp(torch.randn(4, 2)).sum().backward()
    if flush:
        bal.flush()
    bal.close()
    return [m for m in seen if "bal.close()" in m], len(bal.history)


@pytest.mark.parametrize("flush", [False, True])
def test_close_names_the_steps_a_block_left_out_of_the_log(tmp_path, flush):
    from distributed import run, unwrap
    res = unwrap(run(blocked_log_worker, 2, str(tmp_path), flush))
    logged = [s["step"] for s in read_run(tmp_path)]
    if flush:
        assert logged == list(range(5)) and res == [([], 5), ([], 5)], res
    else:
        assert logged == [0, 1, 2], logged
        warned, n = res[0]  # rank 0 writes the log
        assert n == 3 and len(warned) == 1 and "2 step(s)" in warned[0] and "bal.flush()" in warned[0]
        assert res[1] == ([], 3)  # no log on rank 1: nothing to warn about


def test_report_names_steps_missing_from_or_repeated_in_the_log(tmp_path, capsys):
    # A run resumed from a checkpoint taken inside a telemetry block lacks that block's steps; one
    # resumed from an older checkpoint logs steps twice: the report must not look whole.
    model = torch.nn.Linear(2, 1)
    bal = hetlb.Balancer(model, 4, policy=hetlb.Uniform(), exchange_every=1, log_dir=str(tmp_path),
                         tensorboard=False)
    train_steps(bal, model, 8)
    bal.close()
    log = tmp_path / "run.jsonl"
    lines = log.read_text().splitlines()
    assert main(["report", str(log), "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert whole["missing"] == [] and whole["repeated"] == []
    assert main(["report", str(log)]) == 0
    assert "warning" not in capsys.readouterr().out
    log.write_text("\n".join(lines[:2] + lines[5:] + lines[6:7]) + "\n")  # 2-4 lost, 6 twice
    assert main(["report", str(log), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["missing"] == [[2, 4]] and got["repeated"] == [6] and got["steps"] == 6
    assert main(["report", str(log)]) == 0
    out = capsys.readouterr().out
    assert "3 step(s) missing from the log: 2-4" in out and "bal.flush()" in out
    assert "1 step(s) logged more than once (first: 6)" in out
