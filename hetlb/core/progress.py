"""Progress bars for long work (profiling, simulations, the demo), optional like their package.

``tqdm`` is one of the optional packages of ``hetlb[demo]``; without it the work runs the same,
with no bar.
"""
from __future__ import annotations

from typing import Any


__all__ = ["progress_bar"]


class _NoBar:
    """Stands in for a tqdm bar: every call does nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(**kwargs: Any) -> Any:
    """``tqdm(**kwargs)``, or a stand-in whose ``update``, ``set_postfix`` and ``close`` do
    nothing when tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(**kwargs)
