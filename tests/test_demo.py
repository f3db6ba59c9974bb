"""``hetlb demo`` shortened: 4 real Gloo ranks through torch's elastic launcher on the emulated
1:2:3:4 cluster, digits, uniform against LBB. The balanced run must follow Uniform's global loss
(same samples per step), reach the same accuracy, and come near the cluster's ideal speed-up."""
from __future__ import annotations

import json

import pytest

from hetlb.cli.commands import main


def test_shortened_demo_matches_uniform_and_balances(capsys, caplog, tmp_path):
    png = tmp_path / "demo.png"
    code = main(["demo", "--epochs", "1", "--min-steps", "22", "--policy", "uniform,lbb", "--plot",
                 str(png), "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    # 11 steps an epoch at global batch 128: --min-steps 22 raises 1 epoch to 2, and says so
    # (the default, 40, would make it 4)
    assert out["epochs"] == 2 and "epochs raised from 1 to 2" in caplog.text
    rows = {r["policy"]: r for r in out["results"]}
    assert out["world"] == 4 and out["global_batch"] == 128
    assert out["ideal_speedup"] == pytest.approx(2.06, abs=0.02)  # (296 ms) / (144 ms)
    lbb, uni = rows["lbb"], rows["uniform"]
    assert lbb["loss_rel_diff"] < 1e-3  # the same global loss at every step
    assert abs(lbb["accuracy"] - uni["accuracy"]) <= 0.01
    assert uni["accuracy"] > 0.5  # it learns
    # within 10 % of the ideal on an idle machine; 20 % leaves room for a loaded CI runner
    assert lbb["speedup"] >= 0.8 * out["ideal_speedup"], rows
    sizes = out["runs"]["lbb"]["sizes"]
    assert all(sum(s) == 128 for s in sizes) and sizes[-1][0] > sizes[-1][3]
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("argv, message", [
    (["demo", "--cluster", "lbbsp-cluster-a"], "hetlb simulate lbbsp-cluster-a"),
    (["demo", "--policy", "uniform,best"], "unknown policies"),
    (["demo", "--epochs", "0"], "epochs must be >= 1"),
    (["demo", "--min-steps", "-1"], "--min-steps must be >= 0, got -1"),
])
def test_demo_errors_before_spawning(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
