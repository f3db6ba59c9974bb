"""The hard stop behind pytest-timeout (tests/backstop.py): a test whose timeout was swallowed by a
finaliser must still end the run, with every thread's stack, instead of hanging it."""
import subprocess
import sys
import textwrap
import time
from pathlib import Path

HANG = textwrap.dedent("""
    import time

    class Finaliser:
        def __del__(self):
            time.sleep(30)  # pytest-timeout's exception lands here and is swallowed

    def test_hangs_after_a_swallowed_timeout():
        f = Finaliser()
        del f
        time.sleep(30)  # the test hangs on: pytest-timeout does not fire twice
""")


def test_a_swallowed_timeout_still_ends_the_run(tmp_path):
    (tmp_path / "test_hang.py").write_text(HANG)
    (tmp_path / "conftest.py").write_text("from backstop import pytest_configure, pytest_runtest_protocol  # noqa\n")
    env = {"PYTHONPATH": str(Path(__file__).parent), "HETLB_TEST_BACKSTOP_GRACE": "2",
           "PATH": "/usr/bin:/bin"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--timeout=1", "--rootdir", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "Timeout (0:00:03)!" in out, out  # the backstop's dump, on the terminal's stderr
    # The stack shows where the test hung: its second sleep, after the swallowed timeout.
    hung = out.split("most recent call first):", 1)[1].splitlines()[1]
    line = next(i for i, t in enumerate(HANG.splitlines(), 1) if "the test hangs on" in t)
    assert f"test_hang.py\", line {line} in test_hangs_after_a_swallowed_timeout" in hung, out
    assert took < 25, (took, out)  # the backstop at 1 + 2 s, not the 30 s sleep
