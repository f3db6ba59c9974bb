"""A shortened step-interleaved run of bench/bench_overhead.py (2 Gloo ranks), so the overhead
benchmark and its floor variants cannot rot between the sessions that run it in full."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("extra", [[], ["--next-last"], ["--next-last", "--rebuild", "--epoch-steps", "5"]])
def test_overhead_bench_runs_every_kind_of_variant(tmp_path, extra):
    out_md = tmp_path / "out.md"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_overhead.py"), "--interleave", "step",
           "--model", "tiny", "--rounds", "1", "--steps", "6", "--warmup", "2", "--out", str(out_md),
           "--variants", "plain", "plain#2", "exchange", "floor", "default", "default/4", *extra]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                         cwd=os.path.join(ROOT, "bench"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out_md.read_text()
    names = re.findall(r"^\| tiny \| ([^|]+?) \| [\d.]+ \| \*\*([\d.]+)\*\*", text, re.M)
    assert [n for n, _ in names] == ["plain DDP (copy 2)", "DDP + a row all-reduce per step",
                                     "DDP + row all-reduce + no-op hook", "hetlb default",
                                     "hetlb default/4"], text
    assert all(0.2 < float(r) < 5 for _, r in names), names
    assert ("each turn ending with its next batch" in text) == bool(extra), text[:400]
    assert ("built afresh each round" in text) == ("--rebuild" in extra), text[:400]
