"""Lines of a records file read back by their byte spans, after the whole file was verified.

A server's coordinator reads and verifies a records file whole (:func:`~gymckpt.store.records.read_lines`,
which names each line's span); each of its workers then reads only the lines of its share
(:func:`read_spans`), so no worker reads, hashes and splits the whole file again. The file is
immutable (named by its digest, never replaced) and was verified moments before by the
coordinator of the same restore, so a span is not hashed again: its CRC-32, taken by that
verified read, is checked instead (about a third of SHA-256's cost, over the worker's lines
alone), so a worker keeps exactly the bytes the coordinator verified. A span is also checked as
a line: inside the manifest's size, no longer than its line limit, ending with its only newline,
and led by the episode id it is said to hold; its JSON is the decoder's to check, as for
:func:`~gymckpt.store.records.read_lines`.

Spans are read in file order; spans less than :data:`SPAN_GAP` apart are read in one call (the
gap is read and dropped), up to :data:`SPAN_READ` bytes at a time. A stream that cannot seek
(an object store's body) is read forward, its gaps dropped.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

from gymckpt.errors import RecordsDigestMismatch, RecordTooLong, RecordUndecodable
from gymckpt.store.codec import episode_id_of_line

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator
    from typing import BinaryIO

    from gymckpt.store.records import RecordsCheck

__all__ = ["SPAN_GAP", "SPAN_READ", "LineSpan", "Span", "read_spans"]

#: ``(offset, length, crc32)`` of one line in its records file: its length with the newline, its CRC-32 without
LineSpan = tuple[int, int, int]
#: a line's :data:`LineSpan` with the episode id it holds first
Span = tuple[str, int, int, int]

#: spans closer than this are read in one call, the bytes between them dropped
SPAN_GAP = 64 << 10
_NEWLINE = ord("\n")
#: the most one read takes (a span longer than this is read alone, whole)
SPAN_READ = 1 << 20


def read_spans(stream: BinaryIO, expected: RecordsCheck, spans: Iterable[Span]) -> Iterator[tuple[str, bytes]]:
    """Yield ``(episode_id, line)`` (no newline) of each :data:`Span`, in file order.

    Raises a typed :class:`~gymckpt.errors.InvalidCheckpointState` naming the file for a span
    outside the file, overlapping another, longer than the line limit, whose bytes are not one
    line led by its episode id, or whose CRC-32 differs (:class:`~gymckpt.errors.RecordsDigestMismatch`).
    """
    ordered = _checked(sorted(spans, key=lambda span: span[1]), expected)
    position = 0
    for run in _runs(ordered):
        start = run[0][1]
        end = run[-1][1] + run[-1][2]
        data = _read_at(stream, position, start, end - start, expected)
        position = end
        view = memoryview(data)
        for episode_id, offset, length, crc in run:
            at = offset - start
            body = view[at : at + length - 1]  # the line without its newline: copied once, when yielded
            if zlib.crc32(body) != crc:
                raise expected.fail(
                    RecordsDigestMismatch, f"{_where(episode_id, offset, length)} changed since the file was verified"
                )
            if data[at + length - 1] != _NEWLINE or data.find(b"\n", at, at + length - 1) >= 0:
                raise expected.fail(RecordUndecodable, f"{_where(episode_id, offset, length)} are not one line")
            try:
                found = episode_id_of_line(body)
            except RecordUndecodable as exc:
                raise expected.fail(RecordUndecodable, f"{_where(episode_id, offset, length)}: {exc.reason}") from None
            if found != episode_id:
                raise expected.fail(
                    RecordUndecodable, f"{_where(episode_id, offset, length)} hold the line of {found!r}"
                )
            yield episode_id, bytes(body)
        del view, data


def _where(episode_id: str, offset: int, length: int) -> str:
    return f"bytes {offset}-{offset + length} (the line of {episode_id!r})"


def _checked(ordered: list[Span], expected: RecordsCheck) -> list[Span]:
    """The spans, refused where one is outside the file, too long, or overlaps the one before."""
    size = expected.size
    previous_end = 0
    for episode_id, offset, length, _ in ordered:
        if length > expected.line_limit:
            raise expected.fail(
                RecordTooLong,
                f"the line of {episode_id!r} is said to take {length} bytes, more than the "
                f"{expected.line_limit} its manifest allows",
            )
        if offset < previous_end or length < 1 or (size is not None and offset + length > size):
            raise expected.fail(
                RecordUndecodable,
                f"the line of {episode_id!r} is said to be at bytes {offset}-{offset + length}, "
                f"outside the file's {size} bytes or over the line before",
            )
        previous_end = offset + length
    return ordered


def _runs(ordered: list[Span]) -> Iterator[list[Span]]:
    """The spans in groups read with one call each: closer than :data:`SPAN_GAP`, at most :data:`SPAN_READ`."""
    run: list[Span] = []
    for span in ordered:
        if run:
            start = run[0][1]
            last_end = run[-1][1] + run[-1][2]
            if span[1] - last_end >= SPAN_GAP or span[1] + span[2] - start > SPAN_READ:
                yield run
                run = []
        run.append(span)
    if run:
        yield run


def _read_at(stream: BinaryIO, position: int, offset: int, length: int, expected: RecordsCheck) -> bytes:
    """``length`` bytes at ``offset``: sought where the stream can seek, else read forward from ``position``."""
    if stream.seekable():
        stream.seek(offset)
    else:
        _skip(stream, offset - position)
    data = _read_exactly(stream, length)
    if len(data) != length:
        raise expected.fail(
            RecordUndecodable, f"the file ends before byte {offset + length}, where a line was said to end"
        )
    return data


def _read_exactly(stream: BinaryIO, length: int) -> bytes:
    parts = []
    left = length
    while left > 0:
        part = stream.read(left)
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _skip(stream: BinaryIO, count: int) -> None:
    while count > 0:
        part = stream.read(min(count, SPAN_READ))
        if not part:
            return
        count -= len(part)
