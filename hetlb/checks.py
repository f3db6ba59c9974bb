"""Argument checks shared by every public constructor: one wording for every error.

Each check returns the value converted (``int`` / ``float``) or raises ``ValueError`` saying which
argument was wrong, what it must be, and what was received.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Optional

__all__ = ["integer", "number", "optional_integer"]


def integer(value: Any, name: str, minimum: Optional[int] = None) -> int:
    """``value`` as an ``int`` (bools and non-integral numbers are refused)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        i = operator.index(value)
    except TypeError:
        if isinstance(value, float) and value.is_integer():
            i = int(value)
        else:
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if minimum is not None and i < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(i)


def optional_integer(value: Any, name: str, minimum: Optional[int] = None) -> Optional[int]:
    """``None`` or :func:`integer`."""
    return None if value is None else integer(value, name, minimum)


def number(value: Any, name: str, *, minimum: Optional[float] = None,
           maximum: Optional[float] = None, above: Optional[float] = None,
           below: Optional[float] = None, finite: bool = True) -> float:
    """``value`` as a ``float`` within the given bounds (``minimum``/``maximum`` inclusive,
    ``above``/``below`` exclusive). NaN is always refused; infinities unless ``finite=False``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if math.isnan(x) or (finite and math.isinf(x)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    for bound, ok, word in ((minimum, lambda b: x >= b, ">="), (maximum, lambda b: x <= b, "<="),
                            (above, lambda b: x > b, ">"), (below, lambda b: x < b, "<")):
        if bound is not None and not ok(bound):
            raise ValueError(f"{name} must be {word} {bound}, got {value!r}")
    return x
