"""The README's runnable example keeps working."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_solvers_example_runs():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "solvers.py")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "allocate 512 samples over speeds 1:2:3:4 -> [52, 104, 156, 200]" in out.stderr
    assert "unflatten_ round trip" in out.stderr
