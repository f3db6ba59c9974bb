"""The ``hetlb`` command: demo, profile, plan, simulate, report."""
from hetlb.cli.commands import main


__all__ = ["main"]
