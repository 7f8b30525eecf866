"""Text taken from a checkpoint, made safe to show: on a terminal (:func:`printable`) and in JSON (:func:`json_text`).

File names, object keys, kinds, instances, extras and the details of findings are data an
attacker with write access to a checkpoint chooses. Printed raw, an ESC byte in a file name
would reach the operator's terminal as a control sequence (recolour, move the cursor,
rewrite the title, or worse). Every line the ``gymckpt`` command shows a person goes through
:func:`printable`, the one place this is decided.

The escaped forms are Python's: a character that is not printable (controls, format
characters such as bidirectional overrides, line and paragraph separators, lone
surrogates, unassigned code points) is shown as ``\\t``, ``\\n``, ``\\r``, ``\\xNN``, ``\\uNNNN``
or ``\\UNNNNNNNN``. A byte of a file name that is not UTF-8 (which Python reads as a lone
surrogate, ``surrogateescape``) is shown as ``\\xNN``, the byte itself, there and in JSON
(:func:`json_text`), since JSON text cannot hold a lone surrogate that strict parsers accept.
A backslash is not escaped: no name gymckpt writes or reads as state holds one.
"""

from __future__ import annotations

import re

__all__ = ["json_text", "printable"]

_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}
_SURROGATE = re.compile("[\ud800-\udfff]")


def _escape(char: str) -> str:
    code = ord(char)
    if char in _SHORT:
        return _SHORT[char]
    if 0xDC80 <= code <= 0xDCFF:  # a byte that is not UTF-8, as surrogateescape decoded it
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: object) -> str:
    """``text`` as a string with every character a terminal could act on escaped (module docstring).

    Ordinary text (letters, digits, punctuation, spaces, any printable script) is returned as is.
    """
    text = str(text)
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else _escape(char) for char in text)


def json_text(text: object) -> str:
    """``text`` with its lone surrogates escaped (``\\xNN`` for a non-UTF-8 byte, else ``\\uNNNN``), so any
    JSON encoder writes it and any parser reads it; everything else is kept as is (JSON escapes controls)."""
    text = str(text)
    if text.isascii():
        return text
    return _SURROGATE.sub(lambda match: _escape(match.group()), text)
