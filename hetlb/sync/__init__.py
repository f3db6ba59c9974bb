"""Beyond balanced BSP: delayed synchronous training (ABS-SGD)."""
from .delayed import DelayedSync, IterationRecord

__all__ = ["DelayedSync", "IterationRecord"]
