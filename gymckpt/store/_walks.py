"""The records codec's compiled helpers and their Python twins: what decides how
:func:`gymckpt.store.codec.encode_record` writes a record, and the exact line it writes.

- :func:`fast_path_safe`: orjson's line is exact as it is (only exact JSON types, finite
  floats), asked of a value orjson has just written;
- the exact line, for a record orjson cannot write exactly (NaN, +/-Infinity, integers
  beyond 64 bits): ``json.dumps(record, ensure_ascii=True, allow_nan=True,
  separators=(",", ": "))``, the same bytes gymckpt has always written for it, so a commit
  retried after an upgrade hashes the same. In Python it is that call
  (:func:`gymckpt.store.codec._exact_line`); in C, ``_exact.exact_line``, byte for byte the
  same and several times faster, or None for what it leaves to the Python path.

The C module (``gymckpt.store._exact``, from ``_exact.c``) is built at install where a C
compiler works. :data:`FAST_WALK` and :data:`EXACT_LINE` are its functions where it is
built, unless ``GYMCKPT_PURE_PYTHON`` is set (to anything but ``0``); else the Python walk
and None (the codec then calls ``json.dumps`` itself).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType

__all__ = ["ACCELERATED", "EXACT_LINE", "FAST_WALK", "MAX_LEVELS", "SUMMED_LIST", "fast_path_safe"]

#: the deepest nesting orjson writes (the record is level 1); the C exact encoder leaves deeper values to Python
MAX_LEVELS = 254
#: lists longer than this are first looked at whole (:func:`_plain_numbers`), then item by item
SUMMED_LIST = 8


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


def _load_accelerator() -> ModuleType | None:
    """The C walks, configured; None where they are not built or ``GYMCKPT_PURE_PYTHON`` is set (not ``0``)."""
    if os.environ.get("GYMCKPT_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        from gymckpt.store import _exact  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _exact


ACCELERATOR = _load_accelerator()
#: True when the walks in use are the C ones
ACCELERATED = ACCELERATOR is not None
FAST_WALK: Callable[[object], bool] = fast_path_safe if ACCELERATOR is None else ACCELERATOR.fast_path_safe
#: the C exact encoder, or None where the codec calls ``json.dumps`` itself
EXACT_LINE: Callable[[object], bytes | None] | None = None if ACCELERATOR is None else ACCELERATOR.exact_line
