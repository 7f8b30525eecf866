"""The machine's primitives on the records' bytes: the floor gymckpt is compared with.

A commit's primitive sum is orjson encode + sha256 + write/fsync; a restore's is
read + sha256 + orjson decode keeping the decoded objects. Each step is timed alone,
one after the other, on the same bytes.

The primitives are the fast path only: the one record holding an integer beyond 64
bits (which orjson refuses) is encoded with ``json.dumps``, and orjson reads NaN back
as ``null`` and that integer as a float. They are a speed floor, not a codec.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "COMMIT_STEPS",
    "RESTORE_STEPS",
    "WRITE_BUFFER",
    "Encoded",
    "decode_lines",
    "encode_records",
    "evict_from_page_cache",
    "read_file",
    "sha256_bytes",
    "sha256_lines",
    "timed",
    "write_fsync",
]

#: buffer of the primitive write: the chunk size gymckpt writes with
WRITE_BUFFER = 4 << 20
COMMIT_STEPS = ("encode", "sha256_commit", "write_fsync")
RESTORE_STEPS = ("read", "sha256_restore", "decode")

T = TypeVar("T")


def timed(function: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[float, T]:
    """``(seconds, result)`` of one call, by the monotonic performance counter."""
    start = time.perf_counter()
    result = function(*args, **kwargs)
    return time.perf_counter() - start, result


@dataclass
class Encoded:
    """The encoded lines of a workload (each ends with a newline)."""

    lines: list[bytes]

    @property
    def size(self) -> int:
        return sum(map(len, self.lines))

    @property
    def largest(self) -> int:
        return max(map(len, self.lines), default=0)


def encode_records(records: list[dict[str, Any]]) -> Encoded:
    """orjson.dumps per record (json.dumps for the rare record orjson refuses)."""
    lines: list[bytes] = []
    append = lines.append
    dumps = orjson.dumps
    newline = orjson.OPT_APPEND_NEWLINE
    for record in records:
        try:
            append(dumps(record, option=newline))
        except TypeError:  # an integer beyond 64 bits
            append(json.dumps(record).encode() + b"\n")
    return Encoded(lines)


def sha256_lines(lines: list[bytes]) -> str:
    """sha256 over the encoded lines, fed one line at a time."""
    hasher = hashlib.sha256()
    update = hasher.update
    for line in lines:
        update(line)
    return hasher.hexdigest()


def write_fsync(path: str, lines: list[bytes]) -> None:
    """Write the lines to a new file through a chunk-sized buffer, then fsync it."""
    with open(path, "wb", buffering=WRITE_BUFFER) as stream:
        stream.writelines(lines)
        stream.flush()
        os.fsync(stream.fileno())


def read_file(path: str) -> bytes:
    """Read a whole file (one read of its size)."""
    with open(path, "rb", buffering=0) as stream:
        return stream.readall()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode_lines(data: bytes) -> list[Any]:
    """orjson.loads per line, keeping the decoded objects in a list (GC left enabled)."""
    loads = orjson.loads
    lines = data.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    return [loads(line) for line in lines]


def evict_from_page_cache(path: str) -> None:
    """Drop one (fsynced) file's pages from the page cache, for cold reads (``--cold``)."""
    if not hasattr(os, "posix_fadvise"):  # pragma: no cover - not Linux
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
