"""Run a script as ``__main__`` (``python run_checked.py SCRIPT ARGS...``), then fail with exit
code 3 if a Gloo process group is still alive: its threads and sockets would otherwise still be
running during interpreter exit, where they can abort the process.

On failure it says what kept them: threads that end by themselves within a moment were only
still being joined; threads that end after ``gc.collect()`` were held by a reference cycle."""
import gc
import os
import runpy
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distributed import gloo_threads  # noqa: E402

script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
left = gloo_threads()
if left:
    time.sleep(0.5)
    later = gloo_threads()
    gc.collect()
    after_gc = gloo_threads()
    print(f"run_checked: {script} left Gloo threads running after it finished: {left}; "
          f"0.5 s later: {later}; after gc.collect(): {after_gc}", file=sys.stderr)
    sys.exit(3)
