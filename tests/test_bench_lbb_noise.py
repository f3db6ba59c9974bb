"""A shortened run of bench/bench_lbb_noise.py, so the benchmark behind RESULTS' noise table
cannot rot: both parts, a few steps, and the table's figures checked for sense."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_lbb_noise_bench_runs(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_lbb_noise.py"), "--steps", "12",
           "--policies", "LBB(fine=100, rapid=100)", "LBB(fine=0.0, rapid=math.inf)"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    real = re.findall(r"^\| `(.+?)` \| (\d+) \| (\d+) \| (\d+) % \| (-?\d+) \|", out.stdout, re.M)
    assert [r[0] for r in real] == ["LBB(fine=100, rapid=100)", "LBB(fine=0.0, rapid=math.inf)"], out.stdout
    frozen, eager = real
    assert frozen[1:] == ("0", "0", "0", "-1")  # never moves: the even split throughout
    # FT = 0 fine-tunes on every record that ran its latest decision; step 0 ran the start's
    # even split, so step 1 is the first uneven one
    assert int(eager[1]) >= 3 and eager[2] == "0" and eager[4] == "1", out.stdout
    emulated = re.findall(r"^\| `(.+?)` \| ([\d.]+) / (\w+) \|", out.stdout, re.M)
    assert [e[0] for e in emulated] == [r[0] for r in real]
    assert emulated[0][2] == "never"  # a frozen split never settles after the disturbance
