"""A shortened step-interleaved run of bench/bench_overhead.py (2 Gloo ranks), so the overhead
benchmark and its floor variants cannot rot between the sessions that run it in full. It checks
what the bench reports (every variant in every table, with numbers), not the ratios themselves:
one round of 6 steps on a busy machine can put any variant at several times plain DDP's step."""
from __future__ import annotations

import math
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
    assert all(math.isfinite(float(r)) and float(r) > 0 for _, r in names), names
    # the phase and main-thread CPU tables: a row of milliseconds for plain DDP and every variant
    variants = ["plain DDP"] + [n for n, _ in names]
    for cells in (7, 9):  # | model | variant | phases... | (and, in the CPU table, two columns more)
        cell = r" [-+\d.() %]* \|"  # a number, or a number and its difference, or nothing
        rows = re.findall(r"^\| tiny \| ([^|]+?) \|((?:" + cell + "){" + str(cells - 2) + "})$", text, re.M)
        assert [n for n, _ in rows] == variants, (cells, text)
        assert all(re.match(r" \d+\.\d\d", c) for _, r in rows for c in r.split("|")[:5]), (cells, rows)
    assert ("each turn ending with its next batch" in text) == bool(extra), text[:400]
    assert ("built afresh each round" in text) == ("--rebuild" in extra), text[:400]
