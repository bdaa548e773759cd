"""Checks for constructor parameters: a wrong value is a ValueError naming the parameter, at once.

``True`` is not an integer here (``rank=True`` is a mistake, not rank 1), floats must be integral,
and infinities and NaN are refused rather than overflowing later.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Collection, TypeVar

_T = TypeVar("_T")


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int, or ValueError: not a bool, integral, within ``[minimum, maximum]``."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not ok and isinstance(value, numbers.Real) and not isinstance(value, bool):
        ok = math.isfinite(value) and float(value).is_integer()
    if not ok:
        raise ValueError(f"{name} must be an integer, got {value!r}")
    number = int(value)
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value!r}")
    return number


def check_float(name: str, value: Any, minimum: float | None = None, above: float | None = None,
                maximum: float | None = None) -> float:
    """``value`` as a finite float, or ValueError (``above``: strictly greater than)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    number = float(value)
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if above is not None and not number > above:
        raise ValueError(f"{name} must be > {above}, got {value!r}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value!r}")
    return number


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_choice(name: str, value: _T, choices: Collection[_T]) -> _T:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value
