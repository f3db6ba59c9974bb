"""The ``hetlb`` command: plan (LBB Table 2), simulate, help, errors that say what to do."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata

import numpy as np
import pytest

import hetlb
from hetlb.cli.commands import main
from hetlb.sim import compare_splits

# LBB Table 2: a line through the two (batch, ms) points of each worker.
TABLE2 = [((128, 81.81), (167, 104.94)), ((128, 81.49), (167, 104.14)),
          ((128, 85.39), (158, 103.46)), ((128, 392.92), (20, 104.41))]


def table2_linear():
    out = []
    for (b0, t0), (b1, t1) in TABLE2:
        a1 = (t1 - t0) / (b1 - b0)
        out.append(f"{t0 - a1 * b0},{a1}")
    return out


def run_cli(capsys, *argv):
    code = main(list(argv))
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_plan_reproduces_lbb_table2(capsys):
    args = ["plan", "--global-batch", "512", "--json"]
    for text in table2_linear():
        args += ["--linear", text]
    code, out, _ = run_cli(capsys, *args)
    assert code == 0
    res = {s["rule"]: s for s in json.loads(out)["splits"]}
    assert res["uniform"]["sizes"] == [128] * 4
    assert res["uniform"]["step"] == pytest.approx(392.92, abs=1e-6)
    paper = np.array([167, 167, 158, 20])
    assert np.abs(np.array(res["lbb"]["sizes"]) - paper).max() <= 3
    assert sum(res["lbb"]["sizes"]) == 512
    assert res["lbb"]["step"] == pytest.approx(104.94, rel=0.02)
    assert res["lbb"]["speedup"] == pytest.approx(392.92 / res["lbb"]["step"])
    # LB-BSP's proportional rule ignores the intercepts: slower than the exact split here
    assert res["lbbsp"]["step"] > res["lbb"]["step"] * 1.2
    code, text, _ = run_cli(capsys, *[a for a in args if a != "--json"])
    assert code == 0 and "LBB (exact)" in text and "392.92" in text and "3.7" in text


def test_plan_from_the_builtin_scenario_and_from_profiles(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "plan", "--scenario", "lbb-table2", "--json")
    assert code == 0
    lbb = json.loads(out)["splits"][1]
    assert lbb["step"] == pytest.approx(0.10494, rel=0.02)
    # Profile files: the plan is compare_splits on the fitted models, limits as upper bounds
    rng = np.random.default_rng(0)
    paths, models, limits = [], [], []
    for i, (a0, a1, oom) in enumerate([(0.01, 0.001, None), (0.02, 0.004, 64), (0.005, 0.002, None)]):
        bs = [2, 4, 8, 16, 32, 64, 128]
        if oom is not None:
            bs = [b for b in bs if b <= oom]
        ts = [a0 + a1 * b * (1 + 0.01 * rng.random()) for b in bs]
        p = hetlb.Profile(batch_sizes=bs, times=ts, limit=bs[-1],
                          oom_at=None if oom is None else 2 * oom)
        path = tmp_path / f"w{i}.json"
        p.save(path)
        paths.append(str(path))
        models.append(p.fit("cubic"))
        limits.append(oom if oom is not None else 2 ** 62)
    code, out, _ = run_cli(capsys, "plan", *paths, "--global-batch", "300", "--json")
    assert code == 0
    got = json.loads(out)
    want = compare_splits(models, 300, upper=[min(u, 300) for u in limits])
    for g, w in zip(got["splits"], want):
        assert g["sizes"] == w.sizes.tolist() and g["step"] == pytest.approx(w.step)
    assert got["splits"][1]["sizes"][1] <= 64
    code, out, _ = run_cli(capsys, "plan", *paths, "--global-batch", "300", "--upper", "100", "--json")
    assert code == 0 and max(json.loads(out)["splits"][1]["sizes"]) <= 100


@pytest.mark.parametrize("argv, message", [
    (["plan", "--global-batch", "10"], "give the workers one way"),
    (["plan", "--linear", "1,2"], "--global-batch is required"),
    (["plan", "--global-batch", "10", "--linear", "1;2"], "--linear #0: expected A0,A1"),
    (["plan", "--global-batch", "10", "--linear", "1,2", "--linear", "1,2", "--upper", "3,4,5"],
     "give one bound or one per worker"),
    (["plan", "--global-batch", "10", "--linear", "1,2", "--upper", "4"],
     "--upper: the bounds sum to 4, below --global-batch 10: raise them or lower --global-batch"),
    # flag names, not the library's argument names (a user audit, session 26)
    (["profile", "mlp", "--max-batch", "3", "--repeats", "1"],
     "got --trim 1 with --repeats 1: pass --trim 0, or --repeats 2 or more"),
    (["profile", "mlp", "--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["profile", "mlp", "--max-batch", "0"], "--max-batch must be >= 1, got 0"),
    (["profile", "mlp", "--batch-sizes", "0,2"], "--batch-sizes: expected positive integers, got '0,2'"),
    (["demo", "--epochs", "0"], "--epochs must be >= 1, got 0"),
    (["demo", "--min-steps", "-2"], "--min-steps must be >= 0, got -2"),
    (["plan", "--scenario", "nope"], "not a built-in"),
    (["simulate", "--policy", "uniform,best"], "--policy: unknown"),
    (["simulate", "abs-sgd-1234", "--workers", "4"], "not both"),
    (["simulate", "--exchange-every", "0"], "--exchange-every must be >= 1, got 0"),
    (["simulate", "--adaptive-exchange"], "--adaptive-exchange grows blocks up to --exchange-every K"),
    (["simulate", "--policy", "uniform,lbb", "--adaptive-exchange"], "lbb exchange every step by default"),
    # zero used to mean "the scenario's steps", silently
    (["simulate", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["simulate", "--steps", "-3"], "--steps must be >= 1, got -3"),
    (["simulate", "--workers", "2", "--seed", "-1"], "--seed must be >= 0, got -1"),
    # wrong input reaching a library call: its message, no traceback
    (["simulate", "--workers", "3", "--global-batch", "2"], "global_batch=2 is smaller than"),
    (["simulate", "--plot", "/nonexistent-dir/x.png"], "the directory /nonexistent-dir does not exist"),
    (["profile", "mlp", "--device", "foo"], "--device: expected cpu or cuda[:N], got 'foo'"),
    (["profile", "mlp", "--memory-limit", "-1"], "--memory-limit (MiB above the start) must be > 0"),
    # refused before the profiling, not after it
    (["profile", "mlp", "--out", "/nonexistent-dir/x.json"], "the directory /nonexistent-dir"),
    (["plan", "--global-batch", "0", "--linear", "1,1"], "--global-batch must be in [1, 16777216)"),
    (["plan", "--scenario", "abs-sgd-1234", "--global-batch", "0"], "--global-batch must be in [1,"),
    (["plan", "--global-batch", "16777216", "--linear", "1,1"], "(the Balancer's range)"),
    (["plan", "--global-batch", "1", "--linear", "1,1", "--linear", "1,1"],
     "--global-batch 1 is smaller than the 2 workers"),
    (["report", "/"], "/: no run.jsonl in this directory"),
    # a worker taking no time made every speed-up "infx" (x/0)
    (["plan", "--global-batch", "8", "--linear", "0,0", "--linear", "1,1"],
     "worker 0: its time model gives 0 at batch 4 (the uniform split [4, 4])"),
])
def test_errors_say_what_to_do(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and message in err and out == ""


def test_without_the_demo_extras_simulate_runs_and_plot_says_what_to_install(capsys, monkeypatch):
    # tqdm and matplotlib are optional (hetlb[demo]); a progress bar is not worth a traceback
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, out, err = run_cli(capsys, "simulate", "--workers", "2", "--steps", "5", "--policy", "lbb")
    assert code == 0 and "lbb" in out, err
    code, out, err = run_cli(capsys, "simulate", "--workers", "2", "--plot", "x.png")
    assert code == 2 and "pip install 'hetlb[demo]'" in err and out == ""


def test_malformed_scenario_file_names_the_field(capsys, tmp_path):
    p = tmp_path / "cluster.json"
    p.write_text(json.dumps({"global_batch": 8, "workers": [{"model": [0.01, 0.001], "sped": 2}]}))
    code, _, err = run_cli(capsys, "simulate", str(p))
    assert code == 2 and "cluster.json.workers[0]: unknown field(s) ['sped']" in err


def test_simulate_compares_policies_and_plots(capsys, tmp_path):
    png = tmp_path / "sim.png"
    code, out, _ = run_cli(capsys, "simulate", "lbb-disturbance", "--policy", "uniform,lbb,lbbsp",
                           "--steps", "120", "--json")
    assert code == 0
    res = {r["policy"]: r for r in json.loads(out)["results"]}
    assert res["uniform"]["speedup"] == pytest.approx(1.0)
    assert res["lbb"]["speedup"] > 1.8 and res["lbbsp"]["speedup"] > 1.4
    assert res["lbb"]["tail_se"] < 0.1
    code, out, _ = run_cli(capsys, "simulate", "abs-sgd-1234", "--policy", "uniform,lbb",
                           "--steps", "40", "--plot", str(png))
    assert code == 0 and "speed-up" in out and png.stat().st_size > 10_000
    code, out, _ = run_cli(capsys, "simulate", "--list")
    assert code == 0 and "lbbsp-cluster-a" in out and "lbb-table2" in out
    code, out, _ = run_cli(capsys, "simulate", "--workers", "64", "--steps", "20", "--json")
    assert code == 0 and json.loads(out)["workers"] == 64
    # Decisions once per 8 steps: the same policy balances more slowly than deciding every step.
    runs = {}
    for k in ("1", "8"):
        code, out, _ = run_cli(capsys, "simulate", "lbb-disturbance", "--policy", "lbb", "--steps",
                               "120", "--exchange-every", k, "--json")
        assert code == 0
        runs[k] = json.loads(out)["results"][0]
    assert runs["8"]["total_time"] > runs["1"]["total_time"]
    # Adaptive blocks stay single steps while the sizes move: close to the per-step run.
    code, out, _ = run_cli(capsys, "simulate", "lbb-disturbance", "--policy", "lbb", "--steps",
                           "120", "--exchange-every", "8", "--adaptive-exchange", "--json")
    assert code == 0
    auto = json.loads(out)["results"][0]
    assert auto["total_time"] < runs["8"]["total_time"], (auto, runs)
    assert auto["total_time"] < 1.03 * runs["1"]["total_time"], (auto, runs)
    # Every step; or step 0 alone, blocks of 8, the epoch ends (50 steps an epoch) at 49, 99 and
    # the epochs' first steps, 50 and 100, alone.
    assert runs["1"]["exchanges"] == 120 and runs["8"]["exchanges"] == 19
    assert runs["8"]["exchanges"] < auto["exchanges"] < 120, auto
    # uniform has adaptive blocks by default: --adaptive-exchange alone is its default (it was
    # refused without --exchange-every, a user audit of session 27)
    blocks = []
    for extra in ([], ["--adaptive-exchange"]):
        code, out, err = run_cli(capsys, "simulate", "lbb-disturbance", "--policy", "uniform",
                                 "--steps", "120", "--json", *extra)
        assert code == 0, err
        blocks.append(json.loads(out)["results"][0]["exchanges"])
    assert blocks[0] == blocks[1] < 30, blocks
    code, out, _ = run_cli(capsys, "simulate", "lbb-disturbance", "--policy", "wlbs", "--steps",
                           "120", "--exchange-every", "8", "--adaptive-exchange")
    assert code == 0 and "exchanges" in out.splitlines()[2], out
    # Chronica refits every decision (blocks of one step) unless it holds its rule.
    chron = {}
    for extra in ([], ["--chronica-hold", "0.02"]):
        code, out, _ = run_cli(capsys, "simulate", "mixed", "--policy", "chronica", "--steps", "100",
                               "--exchange-every", "16", "--adaptive-exchange", "--json", *extra)
        assert code == 0
        chron[bool(extra)] = json.loads(out)["results"][0]
    assert chron[False]["exchanges"] == 100 and chron[True]["exchanges"] < 40, chron
    for bad, msg in ((["--policy", "lbb", "--chronica-hold", "0.02"], "add chronica"),
                     (["--policy", "chronica", "--chronica-hold", "1.5"], r"\[0, 1\)")):
        code, _, err = run_cli(capsys, "simulate", "mixed", "--steps", "5", *bad)
        assert code != 0 and re.search(msg, err), err


@pytest.mark.parametrize("sub", [[], ["plan"], ["simulate"]])
def test_help_on_every_subcommand(capsys, sub):
    with pytest.raises(SystemExit) as e:
        main(sub + ["--help"])
    assert e.value.code == 0 and "usage: hetlb" in capsys.readouterr().out


def test_console_script_and_module_entry_points():
    eps = [e for e in metadata.entry_points(group="console_scripts") if e.name == "hetlb"]
    assert eps and eps[0].value == "hetlb.cli:main"
    r = subprocess.run([sys.executable, "-m", "hetlb", "plan", "--global-batch", "8",
                        "--linear", "1,1", "--linear", "1,3"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "LBB (exact)" in r.stdout
    r = subprocess.run([sys.executable, "-m", "hetlb"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "plan" in r.stdout
