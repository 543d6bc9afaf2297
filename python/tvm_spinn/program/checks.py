"""Checks of JSON values in a program header, each failing with a :class:`ProgramError` whose
message starts with the field (``layers[3].attrs.strides: expected 2 entries, got 3``).

Shared by the validator (:mod:`.validate`) and the operator families' attribute schemas
(:mod:`.ops`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from .model import ProgramError

__all__ = ["fail", "is_int", "check_int", "check_bool", "check_num", "check_str", "check_list",
           "check_dict", "check_keys", "check_ints", "POS2", "PAD4", "POSINT", "NONNEG", "ZERO",
           "RELU"]


def fail(field: str, message: str) -> None:
    raise ProgramError(f"{field}: {message}")


# -- JSON value checks ---------------------------------------------------------------------------
def is_int(v: Any) -> bool:
    return type(v) is int  # JSON integers; bool is a subclass of int and is refused


def check_int(v: Any, field: str, lo: int | None = None, hi: int | None = None) -> int:
    if not is_int(v):
        fail(field, f"expected an integer, got {v!r:.60}")
    if lo is not None and v < lo:
        fail(field, f"{v} is below the minimum {lo}")
    if hi is not None and v > hi:
        fail(field, f"{v} is above the maximum {hi}")
    return v


def check_bool(v: Any, field: str) -> bool:
    if type(v) is not bool:
        fail(field, f"expected true/false, got {v!r:.60}")
    return v


def check_num(v: Any, field: str) -> float:
    try:
        ok = type(v) in (int, float) and math.isfinite(float(v))
    except OverflowError:  # an integer beyond the float range
        ok = False
    if not ok:
        fail(field, f"expected a finite number, got {v!r:.60}")
    return float(v)


def check_str(v: Any, field: str, choices: tuple[str, ...] | None = None) -> str:
    if type(v) is not str:
        fail(field, f"expected a string, got {v!r:.60}")
    if choices is not None and v not in choices:
        fail(field, f"{v!r:.60} is not one of {list(choices)}")
    return v


def check_list(v: Any, field: str, length: int | None = None) -> list:
    if type(v) is not list:
        fail(field, f"expected a list, got {type(v).__name__}")
    if length is not None and len(v) != length:
        fail(field, f"expected {length} entries, got {len(v)}")
    return v


def check_dict(v: Any, field: str) -> dict:
    if type(v) is not dict:
        fail(field, f"expected an object, got {type(v).__name__}")
    return v


def check_keys(d: Any, field: str, required: frozenset | set, optional: frozenset | set = frozenset()) -> dict:
    d = check_dict(d, field)
    missing = sorted(set(required) - d.keys())
    if missing:
        fail(field, f"missing key(s) {missing}")
    unknown = sorted(d.keys() - set(required) - set(optional))
    if unknown:
        fail(field, f"unknown key(s) {[str(k)[:40] for k in unknown]}")
    return d


def check_ints(v: Any, field: str, length: int, lo: int) -> list[int]:
    return [check_int(x, f"{field}[{i}]", lo) for i, x in enumerate(check_list(v, field, length))]


#: Attribute checkers of the layer kinds' schemas: ``checker(value, field) -> value``.
_Check = Callable[[Any, str], Any]
POS2: _Check = lambda v, f: check_ints(v, f, 2, 1)  # noqa: E731
PAD4: _Check = lambda v, f: check_ints(v, f, 4, 0)  # noqa: E731
POSINT: _Check = lambda v, f: check_int(v, f, 1)  # noqa: E731
NONNEG: _Check = lambda v, f: check_int(v, f, 0)  # noqa: E731
ZERO: _Check = lambda v, f: check_int(v, f, -128, 255)  # noqa: E731  (a zero point)
RELU = {"relu": check_bool}
