"""Field validators shared by every config (EngineConfig, RouterConfig, ClusterConfig).

Each takes the field's name and value and raises ValueError naming the field, so a bad
value is reported the same way whichever layer's config it reaches first. bool is never
accepted as a number (True is an int to Python, never a count or a fraction here).
"""

from __future__ import annotations

import math
from collections.abc import Collection


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def positive_int(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def non_negative_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def positive_float(name: str, value: object) -> None:
    """A finite number > 0 (an int is fine)."""
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def non_negative_float(name: str, value: object, allow_none: bool = False) -> None:
    """A finite number >= 0 (an int is fine); None too when allow_none."""
    if value is None and allow_none:
        return
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        extra = " or None" if allow_none else ""
        raise ValueError(f"{name} must be a finite number >= 0{extra}, got {value!r}")


def number_in(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> None:
    """low <= value <= high, or low < value <= high when low_open."""
    if not (_is_number(value) and (low < value if low_open else low <= value) and value <= high):
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low:g}, {high:g}], got {value!r}")


def one_of(name: str, value: object, choices: Collection[object]) -> None:
    if isinstance(value, bool) or value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def is_bool(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool{' or None' if allow_none else ''}, got {value!r}")


def non_empty_str(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
