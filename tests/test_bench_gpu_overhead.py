"""A shortened run of bench/bench_gpu_overhead.py on CPU, so the GPU benchmark cannot rot between
the rare sessions that have a GPU."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_overhead_bench_runs_on_cpu(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_gpu_overhead.py"), "--device", "cpu",
           "--model", "mlp", "--rounds", "1", "--steps", "3", "--warmup", "1",
           "--variants", "plain", "default", "hooked", "default/2@hostclock", "--trace", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = dict(re.findall(r"^\| (\S+) \| [\d.]+ \| ([\d.]+) ", out.stdout, re.M))
    assert set(rows) == {"plain", "default", "hooked", "default/2@hostclock"}, out.stdout
    assert float(rows["plain"]) == 1.0
    assert "default: transport 'side'" in out.stdout.replace("mlp default", "default")
    assert "hooked: transport 'carry'" in out.stdout.replace("mlp hooked", "hooked")
    assert sorted(p.name for p in tmp_path.glob("*.json.gz")) == \
        ["mlp_default.json.gz", "mlp_default_2_hostclock.json.gz", "mlp_hooked.json.gz", "mlp_plain.json.gz"]


def test_gpu_overhead_bench_interleaved_with_workers_on_cpu(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_gpu_overhead.py"), "--device", "cpu",
           "--model", "mlp", "--rounds", "1", "--steps", "4", "--warmup", "1", "--workers", "1",
           "--interleave", "step", "--variants", "plain", "plain#2", "default/2"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "4 steps interleaved, each between synchronisations, 1 loader workers" in out.stdout, out.stdout
    rows = dict(re.findall(r"^\| (\S+) \| [\d.]+ \| ([\d.]+) \([\d.]+-[\d.]+\) \| [\d.]+ \| [+-][\d.]+ \|$",
                           out.stdout, re.M))
    assert set(rows) == {"plain", "plain#2", "default/2"}, out.stdout
    assert float(rows["plain"]) == 1.0 and 0.2 < float(rows["plain#2"]) < 5, rows
