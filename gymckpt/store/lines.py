"""A records stream split into lines, none held longer than the manifest allows.

The read side of :mod:`gymckpt.store.records`: :func:`lines_of` groups a chunk's lines for
the Python loop, :func:`decode_every_line` decodes runs of fast lines in one C call
(``_exact.decode_lines``). Both let a line go as soon as it passes its limit (the manifest's
``max_record_bytes``, see :mod:`gymckpt.store.bounds`), so a file with no newline (a crash
that left zeros) costs a few chunks, not its size; the stream is still read to its end by
the caller, which hashes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gymckpt.errors import RecordTooLong, RecordUndecodable
from gymckpt.store import codec
from gymckpt.store.codec import decode_line_and_id

if TYPE_CHECKING:
    from collections.abc import Callable, Generator, Iterable, Iterator

__all__ = ["TOO_LONG", "LineDamage", "counted", "decode_every_line", "lines_of", "too_long"]

#: damage found in a line: its error and what to say
LineDamage = tuple[type[RecordUndecodable], str]

#: what :func:`lines_of` yields in place of a line longer than its limit, which it did not hold
TOO_LONG: Any = object()


def too_long(line_number: int, limit: int) -> LineDamage:
    """The damage of line ``line_number``, longer than ``limit`` bytes with its newline."""
    return RecordTooLong, f"line {line_number} is longer than {limit} bytes, the most its manifest allows a line"


def counted(chunks: Iterator[bytes], progress: Callable[[int], None]) -> Iterator[bytes]:
    """``chunks``, each told to ``progress`` by its size first."""
    for chunk in chunks:
        progress(len(chunk))
        yield chunk


class _SpanningLine:
    """The line the chunks before began: its parts, held only while they fit in ``limit`` bytes."""

    __slots__ = ("held", "limit", "parts", "size")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: list[bytes] = []
        self.size = 0
        self.held = False

    def begin(self, tail: bytes, *, hold: bool = True) -> None:
        """A chunk ended in the middle of a line: ``tail`` is its start."""
        self.size = len(tail)
        self.held = hold and self.size < self.limit
        self.parts = [tail] if self.held else []

    def extend(self, chunk: bytes) -> None:
        """A whole chunk without a newline, inside the line."""
        self.size += len(chunk)
        if self.held:
            if self.size >= self.limit:
                self.held, self.parts = False, []
            else:
                self.parts.append(chunk)

    def end(self, head: bytes | None = None) -> bytes | None:
        """The whole line, ``head`` (up to its newline) added; None when it was too long to hold."""
        if head is not None:
            self.size += len(head)
            self.parts.append(head)
        line = b"".join(self.parts) if self.held and self.size < self.limit else None
        self.held, self.parts = False, []
        return line


def lines_of(chunks: Iterable[bytes], limit: int) -> Iterator[list[Any]]:
    """Group the lines of a byte stream per chunk; a line spanning chunks is joined once.

    A line that takes more than ``limit`` bytes with its newline is let go as soon as that
    shows, and :data:`TOO_LONG` stands in its place.
    """
    spanning = _SpanningLine(limit)
    open_line = False
    for chunk in chunks:
        view = memoryview(chunk)
        lines: list[Any] = []
        start = 0
        if open_line:
            end = chunk.find(b"\n")
            if end < 0:
                spanning.extend(chunk)
                continue
            line = spanning.end(chunk[:end])
            lines.append(TOO_LONG if line is None else line)
            open_line = False
            start = end + 1
        while (end := chunk.find(b"\n", start)) >= 0:
            lines.append(view[start:end] if end - start < limit else TOO_LONG)
            start = end + 1
        if start < len(chunk):
            open_line = True
            spanning.begin(chunk[start:])
        yield lines
    if open_line:  # a last line without its newline: the size or digest check reports it
        line = spanning.end()
        yield [TOO_LONG if line is None else line]


#: bytes of lines one call of the C line loop decodes: its records are held until they are yielded
_DECODE_BATCH = 256 << 10


def _decode_left(
    line: bytes | memoryview, line_number: int, episode_ids: list[str]
) -> tuple[dict[str, Any] | None, LineDamage | None]:
    """A line the C loop left (an exact or damaged one), decoded by the Python code.

    ``(record, None)``, its id appended to ``episode_ids``; or ``(None, damage)`` when it is damaged.
    """
    try:
        episode_id, record = decode_line_and_id(line)
    except RecordUndecodable as exc:
        return None, (type(exc), f"line {line_number}: {exc.reason}")
    episode_ids.append(episode_id)
    return record, None


def decode_every_line(
    chunks: Iterable[bytes], episode_ids: list[str], limit: int
) -> Generator[dict[str, Any], None, tuple[int, LineDamage | None]]:
    """Yield every line's record, runs of fast lines decoded in one C call (``_exact.decode_lines``).

    The ids go to ``episode_ids`` in file order. Returns how many lines there were and,
    when one could not be decoded or was longer than ``limit`` (newline included), which and
    why; the lines after it are counted, not decoded, and no line is held from then on.
    """
    decode_lines = codec._decode_fast_lines
    assert decode_lines is not None
    line_number = 0
    damage: LineDamage | None = None
    record: dict[str, Any] | None = None
    spanning = _SpanningLine(limit)  # held while it fits and nothing is damaged
    open_line = False
    for read in chunks:
        chunk = read if type(read) is bytes else bytes(read)
        start = 0
        if open_line:  # the line the chunks before began
            end = chunk.find(b"\n")
            if end < 0:
                spanning.extend(chunk)
                continue
            line_number += 1
            line = spanning.end(chunk[:end])
            if damage is None:
                if line is not None:
                    record, damage = _decode_left(line, line_number, episode_ids)
                    if record is not None:
                        yield record
                else:
                    damage = too_long(line_number, limit)
            open_line = False
            start = end + 1
        while damage is None:
            records, position = decode_lines(chunk, start, _DECODE_BATCH, episode_ids, limit)
            if records:
                line_number += len(records)
                start = position
                yield from records
                continue
            end = chunk.find(b"\n", start)  # a line the C loop left to this code, or none left
            if end < 0:
                break
            line_number += 1
            if end - start >= limit:
                damage = too_long(line_number, limit)
            else:
                with memoryview(chunk) as view:
                    record, damage = _decode_left(view[start:end], line_number, episode_ids)
                if record is not None:
                    yield record
            start = end + 1
        if damage is not None:  # count the rest
            line_number += chunk.count(b"\n", start)
            start = chunk.rfind(b"\n", start) + 1 or start
        if start < len(chunk):
            open_line = True
            spanning.begin(chunk[start:], hold=damage is None)
    if open_line:  # a last line without its newline: decoded as before, the caller reports the missing newline
        line_number += 1
        line = spanning.end()
        if damage is None:
            if line is not None:
                record, damage = _decode_left(line, line_number, episode_ids)
                if record is not None:
                    yield record
            else:
                damage = too_long(line_number, limit)
    return line_number, damage
