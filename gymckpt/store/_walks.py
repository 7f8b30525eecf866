"""The records codec's type walks: what decides how :func:`gymckpt.store.codec.encode_record` writes a record.

- :func:`fast_path_safe`: orjson's line is exact as it is (only exact JSON types, finite
  floats), asked of a value orjson has just written;
- :func:`with_fragments`: the record with NaN, +/-Infinity and integers beyond 64 bits as
  ``orjson.Fragment`` objects, for orjson to write them exactly; None for anything else.

Both are here in Python and in C (``gymckpt.store._exact``, from ``_exact.c``, built at
install where a C compiler works). They answer the same for every value orjson writes;
:data:`FAST_WALK` and :data:`FRAGMENT_WALK` are the C ones where they are built, unless
``GYMCKPT_PURE_PYTHON`` is set (to anything but ``0``), else the Python ones.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType

__all__ = [
    "ACCELERATED",
    "FAST_WALK",
    "FRAGMENT_WALK",
    "INFINITY",
    "MAX_LEVELS",
    "NAN",
    "NEGATIVE_INFINITY",
    "SUMMED_LIST",
    "fast_path_safe",
    "int_fragment",
    "with_fragments",
]

#: the deepest nesting orjson writes (the record is level 1); the fragment walk gives up below it
MAX_LEVELS = 254
#: lists longer than this are first looked at whole (:func:`_plain_numbers`), then item by item
SUMMED_LIST = 8
#: the integers orjson writes itself
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1
NAN = orjson.Fragment(b"NaN")
INFINITY = orjson.Fragment(b"Infinity")
NEGATIVE_INFINITY = orjson.Fragment(b"-Infinity")
#: digits converted at a time when an integer has more than the interpreter converts at once
#: (640 is the lowest limit ``sys.set_int_max_str_digits`` accepts, so this never trips it)
_DIGITS_AT_A_TIME = 600


def _plain_numbers(node: list[Any]) -> bool:
    """True for a (non-empty) list of ints only or of floats only, exactly those types, no float NaN
    or an infinity: the types are counted and the floats summed in C (a NaN or an infinity makes
    the total one; so may an overflow, which only sends the list to the item-by-item look).

    Counting the types is what keeps an IntEnum out: it sums like an int, and orjson writes it as one.
    """
    first = type(node[0])
    if (first is not int and first is not float) or list(map(type, node)).count(first) != len(node):
        return False
    if first is int:
        return True
    total = sum(node)
    return total - total == 0.0


def fast_path_safe(value: object) -> bool:
    """True when orjson writes ``value`` exactly: only exact JSON types, finite floats.

    Asked only of a value orjson has just written (which rules out big integers, non-string
    keys, cycles and deep nesting). A long list of numbers is looked at whole
    (:func:`_plain_numbers`); any other list item by item.
    """
    stack = [value]
    pop = stack.pop
    push = stack.append
    while stack:
        node = pop()
        if type(node) is dict:
            items = node.values()
        else:
            items = node
            if len(node) > SUMMED_LIST and _plain_numbers(node):
                continue
        for item in items:
            kind = type(item)
            if kind is str or kind is int or item is None or kind is bool:
                continue
            if kind is dict or kind is list:
                push(item)
            elif kind is float:
                if item - item != 0.0:
                    return False
            else:
                return False
    return True


def int_fragment(number: int) -> orjson.Fragment:
    """An integer beyond 64 bits as the decimal digits orjson is to write.

    More digits than the interpreter converts at once (4,300 by default) are converted a few
    hundred at a time, so the interpreter-wide limit is never touched.
    """
    try:
        return orjson.Fragment(str(number))
    except ValueError:
        pass
    rest = abs(number)
    base = 10**_DIGITS_AT_A_TIME
    pieces: list[int] = []
    while rest:
        rest, piece = divmod(rest, base)
        pieces.append(piece)
    head = str(pieces.pop())
    digits = "".join(str(piece).zfill(_DIGITS_AT_A_TIME) for piece in reversed(pieces))
    return orjson.Fragment(("-" if number < 0 else "") + head + digits)


class _Refused(Exception):
    """A value :func:`with_fragments` leaves to the standard library's encoder."""


def _fragment_of(item: object) -> object:
    """A scalar as orjson is to write it exactly: itself or a Fragment; any other type is refused."""
    kind = type(item)
    if kind is str or item is None or kind is bool:
        return item
    if kind is int:
        return item if INT_MIN <= item <= INT_MAX else int_fragment(item)  # type: ignore[operator, arg-type]
    if kind is float:
        if item - item == 0.0:  # type: ignore[operator]
            return item
        return NAN if math.isnan(item) else INFINITY if item > 0 else NEGATIVE_INFINITY  # type: ignore[operator, arg-type]
    raise _Refused


def _fragments_in(node: dict[Any, Any] | list[Any], level: int) -> dict[Any, Any] | list[Any]:
    """``node`` itself, or a copy with :func:`_fragment_of` in place of what orjson cannot write."""
    if level > MAX_LEVELS:
        raise _Refused
    copy: dict[Any, Any] | list[Any] | None = None
    if type(node) is dict:
        for key, item in node.items():
            if type(key) is not str:
                raise _Refused
            kind = type(item)
            if kind is str or item is None:
                continue
            replaced = _fragments_in(item, level + 1) if kind is dict or kind is list else _fragment_of(item)
            if replaced is not item:
                if copy is None:
                    copy = node.copy()  # assigning a key it holds keeps the key's place
                copy[key] = replaced
    else:
        if len(node) > SUMMED_LIST and _plain_numbers(node) and min(node) >= INT_MIN and max(node) <= INT_MAX:
            return node
        for index, item in enumerate(node):
            kind = type(item)
            if kind is str or item is None:
                continue
            replaced = _fragments_in(item, level + 1) if kind is dict or kind is list else _fragment_of(item)
            if replaced is not item:
                if copy is None:
                    copy = node.copy()
                copy[index] = replaced
    return node if copy is None else copy


def with_fragments(value: object) -> object:
    """``value`` with NaN, +/-Infinity and integers beyond 64 bits as orjson Fragments.

    ``value`` itself when it holds none; else copies of the containers on the way to them
    (the rest is shared). None when it holds a type that is not exactly a JSON one, a key
    that is not a str, or nests deeper than orjson writes (:data:`MAX_LEVELS`).
    """
    try:
        kind = type(value)
        return _fragments_in(value, 1) if kind is dict or kind is list else _fragment_of(value)  # type: ignore[arg-type]
    except _Refused:
        return None


def _load_accelerator() -> ModuleType | None:
    """The C walks, configured; None where they are not built or ``GYMCKPT_PURE_PYTHON`` is set (not ``0``)."""
    if os.environ.get("GYMCKPT_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        from gymckpt.store import _exact  # type: ignore[attr-defined]
    except ImportError:
        return None
    _exact.configure(NAN, INFINITY, NEGATIVE_INFINITY, int_fragment)
    return _exact


ACCELERATOR = _load_accelerator()
#: True when the walks in use are the C ones
ACCELERATED = ACCELERATOR is not None
FAST_WALK: Callable[[object], bool] = fast_path_safe if ACCELERATOR is None else ACCELERATOR.fast_path_safe
FRAGMENT_WALK: Callable[[object], object] = with_fragments if ACCELERATOR is None else ACCELERATOR.with_fragments
