"""bench/bench_callgrind.py's reading of callgrind_annotate and its table (a run under valgrind
takes minutes: the bench is run in full by the sessions that measure the step boundary)."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import bench_callgrind  # noqa: E402

# The markers' lines of a real `callgrind_annotate --inclusive=yes --show-percs=no` (60 steps),
# among lines of other functions, a recursive instance and a zero shown as ".".
ANNOTATE = """\
--------------------------------------------------------------------------------
Ir         Dr         Dw         I1mr      D1mr    D1mw    ILmr    DLmr    DLmw    file:function
--------------------------------------------------------------------------------
 60,000,000 18,000,000 10,000,000 2,400,000 790,000 215,000 430,000 227,000  73,000  PROGRAM TOTALS
 33,106,098 10,103,138  5,868,898 1,273,630   371,784 109,398 189,649 140,249  49,784  /tmp/py/./Modules/_operator.c:_operator_call [/lib/libpython3.11.so.1.0]
 20,000,000  6,000,000  3,000,000   800,000   200,000  60,000 100,000  50,000  10,000  /tmp/py/./Modules/_operator.c:_operator_call'2 [/lib/libpython3.11.so.1.0]
 18,327,809  5,889,729  3,300,218   851,600   229,564  63,504 176,960  53,503       .  /tmp/py/./Modules/_operator.c:methodcaller_call [/lib/libpython3.11.so.1.0]
 14,656,507  4,507,628  2,600,999   467,356   279,078  64,160  93,259  74,688  18,162  /tmp/py/./Modules/_functoolsmodule.c:functools_reduce [/lib/libpython3.11.so.1.0]
 14,000,000  4,000,000  2,000,000   400,000   200,000  60,000  90,000  70,000  18,000  /tmp/py/Python/ceval.c:_PyEval_EvalFrameDefault [/lib/libpython3.11.so.1.0]
"""


def test_parse_reads_each_marker_s_inclusive_events_per_step():
    got = bench_callgrind.parse(ANNOTATE, 60)
    assert set(got) == {"next batch", "forward", "backward", "the loss"}
    assert got["the loss"]["Ir"] == 0  # (a phase only hetlb+loss runs)
    assert got["next batch"]["Ir"] == pytest.approx(33_106_098 / 60)
    assert got["next batch"]["DLmw"] == pytest.approx(49_784 / 60)  # not the recursive instance's
    assert got["backward"]["ILmr"] == pytest.approx(176_960 / 60) and got["backward"]["DLmw"] == 0
    assert got["forward"]["DLmr"] == pytest.approx(74_688 / 60)


def test_parse_names_a_missing_marker():
    lines = [ln for ln in ANNOTATE.splitlines() if "functools_reduce" not in ln]
    with pytest.raises(RuntimeError, match=r"no \['forward'\]"):
        bench_callgrind.parse("\n".join(lines), 60)


def test_table_adds_hetlb_s_misses_and_instructions_to_plain_s():
    plain = bench_callgrind.parse(ANNOTATE, 60)
    more = {p: e if p == "the loss" else dict(e, Ir=e["Ir"] + 1000, DLmr=e["DLmr"] + 7)
            for p, e in plain.items()}
    rows = bench_callgrind.table({"plain": plain, "hetlb": more})
    assert len(rows) == 2 + 2 * 4  # three phases (no variant logged a loss) and the step
    hetlb_next = next(r for r in rows if r.startswith("| next batch | hetlb"))
    assert hetlb_next.endswith("| +7 (+1,000 instr.) |")
    step = next(r for r in rows if r.startswith("| the step | hetlb"))
    assert step.endswith("| +21 (+3,000 instr.) |")
