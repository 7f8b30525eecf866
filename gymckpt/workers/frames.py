"""Frames on a worker socket: a 4-byte big-endian unsigned length, then a UTF-8 JSON body.

JSON is exact both ways: NaN, ±Infinity, -0.0, integers beyond 64 bits (up to the
interpreter's 4,300 digits) and lone surrogates come back as they went. A value JSON cannot
give back as it was is refused by the sender (:class:`FrameError`): a type that is not JSON,
a key that is not a string, a string holding a surrogate pair as two code points (it would
read back as one character), nesting deeper than :data:`MAX_DEPTH` or a value that contains
itself. Tuples go as arrays.

Two encoders, picked per body:

- fast: orjson, for a body of exact JSON types whose floats are all finite (one walk finds
  NaN and the infinities, which orjson would write as ``null``); orjson itself refuses
  integers beyond 64 bits, surrogates and more than 254 levels, which then go the exact way.
- exact: the standard library (``separators=(",", ":")``, ``allow_nan``, ASCII escapes).
  Its body starts with one space, which JSON allows, and the reader picks its decoder from
  that first byte: orjson would read an integer beyond 64 bits back as a float, and finding
  one by scanning the digits of a whole body costs half as much as decoding it.

Why: records travel as already-encoded lines, i.e. long strings, which the walk passes at
once. Measured on 10,000 record lines as strings (18.6 MB, non-ASCII text, escaped quotes):
the fast path encodes them in 6 ms walk included, the standard library in 120-190 ms;
decoding takes 80-100 ms either way, and the fast body keeps UTF-8 (19.3 MB, where ASCII
escapes make 21.0 MB). Only gymckpt writes and reads these frames (an unmarked body is read
by orjson).

A request may carry bytes beside its JSON (:func:`encode_frame`'s ``blob``: records lines,
which as JSON strings would be escaped by the sender and unescaped by the reader). Its body
is :data:`BLOB_MARK`, the JSON part's length (4 bytes, big-endian), the JSON part, then the
bytes; the reader hands them over as the ``"blob"`` member of the message's ``body`` object.
Moving a model's 44 MB of lines that way instead of as strings saved about 0.1 s of the
coordinator's CPU per commit.

A body over :data:`MAX_FRAME_BYTES` (1 GiB) is refused by the sender (:class:`FrameTooLarge`)
and by the reader, from the length prefix alone, before it reads or allocates the body; the
limit only catches a corrupt prefix. A reader that raised :class:`FrameError` has lost its
place in the stream: the connection is then broken. :class:`ChannelClosed` is the stream
ending, between frames or in the middle of one.
"""

from __future__ import annotations

import asyncio
import json
import re
import struct
from typing import Any

import orjson

from gymckpt.errors import GymckptError

__all__ = [
    "BLOB_KEY",
    "BLOB_MARK",
    "HEADER",
    "MAX_DEPTH",
    "MAX_FRAME_BYTES",
    "ChannelClosed",
    "FrameError",
    "FrameTooLarge",
    "decode_body",
    "decode_message",
    "encode_body",
    "encode_frame",
    "read_frame",
    "write_frame",
]

#: the largest frame body, in bytes; only a corrupt length prefix comes near it
MAX_FRAME_BYTES = 1 << 30
#: the length prefix: 4 bytes, big-endian, unsigned
HEADER = struct.Struct(">I")
#: deepest nesting a body may have (records travel as strings, so messages stay shallow)
MAX_DEPTH = 512
#: the first byte of a body the exact (standard library) encoder wrote
EXACT_MARK = b" "
#: the first byte of a body that carries bytes beside its JSON (never the first byte of JSON)
BLOB_MARK = b"\x01"
#: the key of a request's ``body`` that holds the bytes a blob frame carried
BLOB_KEY = "blob"
#: the deepest nesting orjson writes (it refuses deeper values itself)
_ORJSON_DEPTH = 254
_ORJSON_OPTIONS = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_SUBCLASS
_SURROGATE_PAIR = re.compile("[\ud800-\udbff][\udc00-\udfff]")
_LEAVES = (str, int, bool, type(None))


class FrameError(GymckptError, ValueError):
    """A frame that cannot be sent or read: over the limit, empty, or a body that is not exact JSON."""


class FrameTooLarge(FrameError):
    """A frame body (or a length prefix) over :data:`MAX_FRAME_BYTES`."""


class ChannelClosed(GymckptError, ConnectionError):
    """The stream ended: at a frame boundary, or in the middle of a frame (``partial``)."""

    def __init__(self, detail: str, *, partial: bool = False) -> None:
        GymckptError.__init__(self, detail)
        self.partial = partial

    def __str__(self) -> str:
        return self.detail


def _refuse(value: object) -> object:
    raise TypeError(f"{type(value).__name__} is not JSON")


def _orjson_exact(value: object) -> bool:
    """True when orjson writes ``value`` as it is: exact JSON types only, finite floats, ≤254 levels."""
    stack: list[tuple[object, int]] = [([value], 0)]
    while stack:
        node, depth = stack.pop()
        if depth > _ORJSON_DEPTH:
            return False
        for child in node.values() if type(node) is dict else node:  # type: ignore[attr-defined]
            kind = type(child)
            if kind is str or kind is int or kind is bool or child is None:
                continue
            if kind is dict or kind is list or kind is tuple:
                stack.append((child, depth + 1))
            elif kind is not float or child - child != 0.0:  # type: ignore[operator]
                return False  # NaN, an infinity, or a type orjson would convert
    return True


def _short(path: str) -> str:
    return path if len(path) <= 120 else f"{path[:60]}…{path[-60:]}"


def _check_exact(value: object) -> None:
    """Raise :class:`FrameError` for the first part of ``value`` the exact encoder would not give back as it is."""
    stack: list[tuple[object, str, int]] = [(value, "$", 0)]
    while stack:
        node, path, depth = stack.pop()
        kind = type(node)
        if kind is dict or kind is list or kind is tuple:
            if depth >= MAX_DEPTH:
                raise FrameError(f"value at {_short(path)} nests deeper than {MAX_DEPTH} levels (or contains itself)")
            if kind is dict:
                for key, child in node.items():  # type: ignore[attr-defined]
                    if type(key) is not str:
                        raise FrameError(f"key {key!r} at {_short(path)} is a {type(key).__name__}, not a string")
                    if _SURROGATE_PAIR.search(key):
                        raise FrameError(f"key at {_short(path)} holds a surrogate pair JSON would merge")
                    stack.append((child, f"{path}.{key}", depth + 1))
            else:
                stack.extend((child, f"{path}[{index}]", depth + 1) for index, child in enumerate(node))  # type: ignore[arg-type]
        elif kind is str:
            if _SURROGATE_PAIR.search(node):  # type: ignore[arg-type]
                raise FrameError(f"string at {_short(path)} holds a surrogate pair JSON would merge into one character")
        elif not (kind is float or kind in _LEAVES):
            raise FrameError(f"value at {_short(path)} is a {kind.__name__}, not JSON")


def _exact_body(value: object) -> bytes:
    _check_exact(value)
    try:
        text = json.dumps(value, separators=(",", ":"), allow_nan=True, ensure_ascii=True)
    except (ValueError, RecursionError) as exc:  # an integer over the digit limit, the C encoder's recursion
        raise FrameError(f"body cannot be written as JSON: {exc}") from exc
    return EXACT_MARK + text.encode("ascii")


def encode_body(value: object) -> bytes:
    """The JSON body of ``value``, exact (see the module docstring); :class:`FrameError` if it cannot be."""
    if _orjson_exact(value):
        try:
            return orjson.dumps(value, default=_refuse, option=_ORJSON_OPTIONS)
        except TypeError:
            pass  # an integer beyond 64 bits or a surrogate: the exact encoder takes it
    return _exact_body(value)


def decode_body(data: bytes) -> Any:
    """The value of a body :func:`encode_body` wrote; :class:`FrameError` for an empty or undecodable one."""
    if not data:
        raise FrameError("empty frame body")
    try:
        if data[:1] == EXACT_MARK:
            return json.loads(data.decode("utf-8"))
        return orjson.loads(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise FrameError(f"frame body is not JSON: {exc}") from exc


def encode_frame(value: object, blob: bytes | None = None) -> bytes:
    """The whole frame of ``value``: length prefix and body; :class:`FrameTooLarge` over the limit.

    ``blob``: bytes sent as they are beside ``value``, a message whose ``body`` is an object
    without a ``"blob"`` member (the reader puts them there).
    """
    if blob is None:
        body = encode_body(value)
        size = len(body)
        parts: tuple[bytes, ...] = (body,)
    else:
        inner = value.get("body") if isinstance(value, dict) else None
        if not isinstance(inner, dict) or BLOB_KEY in inner:
            raise FrameError(f"bytes travel beside a message whose body is an object without {BLOB_KEY!r}")
        body = encode_body(value)
        size = len(BLOB_MARK) + HEADER.size + len(body) + len(blob)
        parts = (BLOB_MARK, HEADER.pack(len(body)), body, blob)
    if size > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"frame body of {size} bytes is over the limit of {MAX_FRAME_BYTES}")
    return b"".join((HEADER.pack(size), *parts))


def decode_message(data: bytes) -> Any:
    """The value of a frame body, a blob frame's bytes put into its message's ``body`` (see the module docstring)."""
    if data[:1] != BLOB_MARK:
        return decode_body(data)
    start = len(BLOB_MARK) + HEADER.size
    if len(data) < start:
        raise FrameError("blob frame shorter than its JSON part's length")
    (length,) = HEADER.unpack(data[len(BLOB_MARK) : start])
    if start + length > len(data):
        raise FrameError(f"blob frame's JSON part of {length} bytes runs past the frame")
    value = decode_body(data[start : start + length])
    inner = value.get("body") if isinstance(value, dict) else None
    if not isinstance(inner, dict) or BLOB_KEY in inner:
        raise FrameError(f"blob frame whose message body is not an object without {BLOB_KEY!r}")
    inner[BLOB_KEY] = data[start + length :]
    return value


def _where(partial: bool) -> str:
    return "in the middle of a frame" if partial else "between frames"


async def _read_exactly(reader: asyncio.StreamReader, size: int, what: str, *, started: bool) -> bytes:
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        partial = started or bool(exc.partial)
        got = f"{len(exc.partial)} of {size} bytes of the {what}"
        raise ChannelClosed(f"the stream ended {_where(partial)} ({got})", partial=partial) from exc
    except ConnectionError as exc:
        raise ChannelClosed(f"the connection was lost {_where(started)}: {exc}", partial=started) from exc


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """Read one whole frame and return its value.

    Raises :class:`ChannelClosed` when the stream ends (``partial`` if inside a frame),
    :class:`FrameTooLarge` for a length prefix over the limit (the body is not read), and
    :class:`FrameError` for an empty or undecodable body.
    """
    header = await _read_exactly(reader, HEADER.size, "length prefix", started=False)
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"length prefix of {length} bytes is over the limit of {MAX_FRAME_BYTES}")
    if length == 0:
        raise FrameError("empty frame body")
    return decode_message(await _read_exactly(reader, length, "body", started=True))


async def write_frame(writer: asyncio.StreamWriter, value: object) -> None:
    """Write the frame of ``value`` in one piece and wait for the stream to drain."""
    writer.write(encode_frame(value))
    await writer.drain()
