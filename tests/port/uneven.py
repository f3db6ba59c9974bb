"""Run a training script as ``__main__`` with every ``hetlb.Balancer`` it makes on fixed, uneven
batch sizes, so a test of a port gets a deterministic split instead of LBB's (which on one
homogeneous machine follows timing noise):

    PORT_SIZES=5,11 python uneven.py SCRIPT ARGS...
    PORT_SIZES="5,11;11,5" python uneven.py run_checked.py SCRIPT ARGS...   (also checked)

``PORT_SIZES`` is one split (comma-separated, one size per rank, summing to the Balancer's global
batch): every step gets it (``fixed_policy.Fixed``). Several splits separated by ``;`` are taken
in turn, one per decision, the last from then on (``fixed_policy.Scripted``: the first split
is the first step's, the second the next step's, ...; a checkpoint resumes the count). A leading
``--sizes SPLIT`` argument overrides the variable (for runs made in parallel in one test
process, which share its environment). Without either the Balancer is left as it is.

A Balancer the script makes with ``policy=`` of its own keeps it; one without gets the fixed
split and ``lower=0`` (unless the script passed ``lower=``), so a split may give a rank no
sample. The script's own lines stay as they are: ``hetlb.Balancer`` is replaced by a subclass
before the script runs. ``run_checked.py`` as SCRIPT (before the script it runs) also fails the
run when it leaves Gloo threads behind.
"""
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: fixed_policy, run_checked's imports

import hetlb  # noqa: E402  (as the ports do: before init_process_group)
from fixed_policy import Fixed, Scripted  # noqa: E402


def parse(text):
    """``"5,11"`` -> [[5, 11]]; ``"5,11;11,5"`` -> [[5, 11], [11, 5]]."""
    splits = [[int(s) for s in part.split(",")] for part in text.replace(" ", "").split(";") if part]
    if not splits or len({len(s) for s in splits}) != 1:
        raise SystemExit(f"uneven.py: sizes {text!r}: one or more splits separated by ';', each "
                         f"one size per rank separated by ','")
    return splits


args = sys.argv[1:]
sizes = os.environ.get("PORT_SIZES")
if args[:1] == ["--sizes"]:
    sizes, args = args[1], args[2:]
if not args:
    raise SystemExit(__doc__)
splits = parse(sizes) if sizes else None


class UnevenBalancer(hetlb.Balancer):
    """``hetlb.Balancer`` with the fixed split (see the module docstring)."""

    def __init__(self, model, global_batch=None, policy=None, *rest, **kwargs):
        if policy is None and splits is not None:
            policy = Fixed(splits[0]) if len(splits) == 1 else Scripted(splits)
            kwargs.setdefault("lower", 0)
        super().__init__(model, global_batch, policy, *rest, **kwargs)


if splits is not None:
    hetlb.Balancer = UnevenBalancer
script = args[0]
sys.argv = args
runpy.run_path(script, run_name="__main__")
