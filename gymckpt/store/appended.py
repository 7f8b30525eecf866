"""The records writer's side of lines another process appended to the records file itself.

A server's worker appends its encoded lines to its coordinator's local records file
(:class:`~gymckpt.store.encoded.AppendedLines`); :func:`take_appended` then reads them back a
piece at a time, checks each piece's lines as a run (one per named id, each led by it, none seen
before) and hashes them in file order, so the manifest says what the file holds, whoever wrote it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from gymckpt.errors import InvalidRecord
from gymckpt.store.encoded import EncodedRun, note_run

if TYPE_CHECKING:
    import hashlib

    from gymckpt.store.backend import BlobSink
    from gymckpt.store.encoded import AppendedLines

__all__ = ["READ_BACK", "take_appended"]

#: how much of the appended lines is read back at a time (more for a line longer than that)
READ_BACK = 4 << 20


class Writer(Protocol):
    """The records writer's running digest and size (idle while lines are appended and read back)."""

    hasher: hashlib._Hash
    size: int


def take_appended(
    sink: BlobSink,
    lines: AppendedLines,
    target: str,
    writer: Writer,
    seen: set[str],
    episode_ids: list[str],
    longest: int,
) -> tuple[int, int] | None:
    """Have ``lines``' producer append them at ``target`` (the writer idle), then read them back a
    piece at a time: each piece's lines checked as a run's (:func:`~gymckpt.store.encoded.note_run`)
    and hashed in order. The bytes appended and the longest line; None when the producer appended
    nothing because it could not open ``target``."""
    start = writer.size
    size = lines.append_to(target)
    if size is None:
        return None
    sink.adopt_appended(size, lines.producer)
    names, taken, offset = lines.episode_ids, 0, 0
    while offset < size:
        length = min(READ_BACK, size - offset)
        while True:  # whole lines: a line longer than the piece makes the piece longer
            piece = sink.read_appended(start + offset, length)
            end = piece.rfind(b"\n") + 1
            if end or len(piece) < length or length >= size - offset:
                break
            length = min(2 * length, size - offset)
        if not piece:
            raise InvalidRecord(f"the lines {lines.producer} appended end after {offset} of the {size} bytes named")
        piece = piece[: end or len(piece)]
        count = piece.count(b"\n")
        try:
            longest = note_run(EncodedRun(names[taken : taken + count], piece), seen, episode_ids, longest)
        except InvalidRecord as exc:
            raise InvalidRecord(f"in the lines {lines.producer} appended: {exc}") from exc
        writer.hasher.update(piece)  # the writer is idle: nothing else is hashed meanwhile
        taken += count
        offset += len(piece)
    if taken != len(names):
        raise InvalidRecord(f"{lines.producer} appended {taken} lines for the {len(names)} records named")
    writer.size += size
    return size, longest
