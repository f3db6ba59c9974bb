"""Argument checks shared by every public constructor: one wording for every error.

Each check returns the value converted (``int`` / ``float`` / ``bool``) or raises saying which
argument was wrong, what it must be, and what was received: ``ValueError`` for a value out of
range, :class:`ArgumentTypeError` (both a ``TypeError`` and a ``ValueError``, so either
``except`` catches it) for a value of the wrong type, ``TypeError`` for :func:`instance`. Strings are never taken for numbers (``"0.1"`` is refused, not parsed): a number
given as text is almost always a configuration mistake.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Dict, Optional, Sequence, Tuple, Type, Union

import numpy as np


__all__ = ["ArgumentTypeError", "integer", "number", "optional_integer", "flag", "choice", "instance",
           "agree"]


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (a string or a bool for a number, a number for a flag): a
    ``TypeError`` as Python's own, and a ``ValueError`` as hetlb's checks raised before."""


def _show(value: Any) -> str:
    """``repr`` of a received value, cut to a readable length."""
    r = repr(value)
    return r if len(r) <= 120 else r[:117] + "..."


def integer(value: Any, name: str, minimum: Optional[int] = None,
            maximum: Optional[int] = None) -> int:
    """``value`` as an ``int`` (bools, strings and non-integral numbers are refused; an integral
    float such as ``2.0`` is taken), within ``[minimum, maximum]`` where given."""
    if isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be an integer, got {_show(value)}")
    try:
        i = operator.index(value)
    except TypeError:
        if isinstance(value, (float, np.floating)) and float(value).is_integer():
            i = int(value)
        elif isinstance(value, (float, np.floating)):
            raise ValueError(f"{name} must be an integer, got {_show(value)}") from None
        else:
            raise ArgumentTypeError(f"{name} must be an integer, got {_show(value)}") from None
    if minimum is not None and i < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {_show(value)}")
    if maximum is not None and i > maximum:
        raise ValueError(f"{name} must be an integer <= {maximum}, got {_show(value)}")
    return int(i)


def optional_integer(value: Any, name: str, minimum: Optional[int] = None) -> Optional[int]:
    """``None`` or :func:`integer`."""
    return None if value is None else integer(value, name, minimum)


def number(value: Any, name: str, *, minimum: Optional[float] = None,
           maximum: Optional[float] = None, above: Optional[float] = None,
           below: Optional[float] = None, finite: bool = True) -> float:
    """``value`` as a ``float`` within the given bounds (``minimum``/``maximum`` inclusive,
    ``above``/``below`` exclusive). NaN is always refused; infinities unless ``finite=False``;
    bools and strings always."""
    if isinstance(value, (bool, np.bool_, str, bytes)):
        raise ArgumentTypeError(f"{name} must be a number, got {_show(value)}")
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ArgumentTypeError(f"{name} must be a number, got {_show(value)}") from None
    if math.isnan(x) or (finite and math.isinf(x)):
        raise ValueError(f"{name} must be a finite number, got {_show(value)}")
    for bound, ok, word in ((minimum, lambda b: x >= b, ">="), (maximum, lambda b: x <= b, "<="),
                            (above, lambda b: x > b, ">"), (below, lambda b: x < b, "<")):
        if bound is not None and not ok(bound):
            raise ValueError(f"{name} must be {word} {bound}, got {_show(value)}")
    return x


def flag(value: Any, name: str) -> bool:
    """``value`` as a ``bool``: only ``True`` / ``False`` (NumPy's too) are taken, so a string such
    as ``"no"`` is not silently true."""
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be True or False, got {_show(value)}")
    return bool(value)


def choice(value: Any, name: str, options: Sequence[Any]) -> Any:
    """``value`` if it is one of ``options`` (compared with ``==``, unhashable values refused)."""
    try:
        ok = isinstance(value, type(options[0])) and value in options
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}; got {_show(value)}")
    return value


def instance(value: Any, name: str, types: Union[Type, Tuple[Type, ...]], what: str) -> Any:
    """``value`` if it is an instance of ``types``, else ``TypeError`` saying ``what`` is accepted."""
    if not isinstance(value, types):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {_show(value)}")
    return value


def agree(everyone: Sequence[Dict[str, Any]], key: str, what: str) -> None:
    """Raise ``ValueError`` naming the settings under ``key`` (dicts) on which a rank differs from
    rank 0; ``everyone`` is every rank's all-gathered dict, so every rank raises the same."""
    ref = everyone[0][key]
    for r, e in enumerate(everyone):
        if e[key] != ref:
            keys = list(ref) + [k for k in e[key] if k not in ref]  # rank 0's order, then the rest
            diff = {k: (ref.get(k), e[key].get(k)) for k in keys if ref.get(k) != e[key].get(k)}
            raise ValueError(f"ranks disagree on the {what} settings: rank 0 has "
                             + ", ".join(f"{k}={a!r}" for k, (a, _) in diff.items())
                             + f"; rank {r} has " + ", ".join(f"{k}={b!r}" for k, (_, b) in diff.items()))
