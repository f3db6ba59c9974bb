"""Run a script as ``__main__`` (``python run_checked.py SCRIPT ARGS...``), then fail with exit
code 3 if a Gloo process group is still alive: its threads and sockets would otherwise still be
running during interpreter exit, where they can abort the process.

Gloo threads still listed right after the script may only be ending: a group's destructor joins
them, and the kernel lists an exiting thread until it has been reaped, which on a busy machine
can take a while. So the threads are polled, with the garbage collector off, for up to
:data:`DEADLINE` seconds; only threads alive after that fail the run. The failure's first line
is its diagnosis: ``held by a reference cycle`` when ``gc.collect()`` then ends them, else
``still running after gc.collect()`` (something reachable keeps the group: a leak).

``HETLB_RUN_CHECKED_LOG=FILE`` appends one line to FILE for every run whose threads were still
listed right after the script, with how long they took to go (a passing run's evidence)."""
import gc
import os
import runpy
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed import gloo_threads  # noqa: E402

#: Seconds the Gloo threads may take to end after the script returns.
DEADLINE = 20.0


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
    left = gloo_threads()
    if not left:
        return
    # Off while polling: a collection here would hide threads that only a cycle keeps.
    gc.disable()
    t0 = time.monotonic()
    later = left
    while later and time.monotonic() - t0 < DEADLINE:
        time.sleep(0.01)
        later = gloo_threads()
    waited = time.monotonic() - t0
    log = os.environ.get("HETLB_RUN_CHECKED_LOG")
    if not later:
        if log:
            with open(log, "a") as f:
                f.write(f"{script}: {left} still listed right after it, gone {waited:.3f} s later\n")
        return
    gc.collect()
    after_gc = gloo_threads()
    why = ("held by a reference cycle (gc.collect() ended them)" if not after_gc else
           "still running after gc.collect() (something reachable keeps the group: a leak)")
    msg = (f"run_checked: {why}: {script} left Gloo threads running after it finished: {left}; "
           f"{DEADLINE:.0f} s later: {later}; after gc.collect(): {after_gc}")
    if log:
        with open(log, "a") as f:
            f.write(msg + "\n")
    print(msg, file=sys.stderr)
    sys.exit(3)


main()
