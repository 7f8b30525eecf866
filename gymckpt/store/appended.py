"""The records writer's side of lines another process appended to the records file itself.

A server's workers append their encoded lines to their coordinator's local records file
(:class:`~gymckpt.store.encoded.AppendedLines`), all at once: each write holds whole lines, and
the producer says which ids the file now holds in which order
(:class:`~gymckpt.store.encoded.AppendedRegion`). :func:`take_appended` then reads them back a
piece at a time, checks each piece's lines as a run (one per named id, each led by it, none seen
before) and hashes them in file order, so the manifest says what the file holds, whoever wrote it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from gymckpt.errors import InvalidRecord
from gymckpt.store.encoded import AppendedRegion, EncodedRun, note_run

if TYPE_CHECKING:
    import hashlib
    from collections.abc import Iterable, Iterator

    from gymckpt.store.backend import BlobSink
    from gymckpt.store.encoded import AppendedLines, AppendedPiece

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
) -> tuple[int, int, Iterable[EncodedRun]] | None:
    """Have ``lines``' producer append them at ``target`` (the writer idle), then read them back a
    piece at a time: each piece's lines checked as a run's (:func:`~gymckpt.store.encoded.note_run`)
    and hashed in order. The bytes appended, the longest line and the runs of the lines not
    appended (to write after them); None when the producer appended nothing because it could not
    open ``target``."""
    start = writer.size
    appended = lines.append_to(target)
    if appended is None:
        return None
    if isinstance(appended, AppendedRegion):
        size = appended.size
        sink.adopt_appended(size, lines.producer)
        named = set(lines.episode_ids)
        longest = _take_pieces(sink, appended.pieces, start, writer, (seen, episode_ids), longest, named)
        appended_count = sum(len(piece.episode_ids) for piece in appended.pieces)
        rest = _the_rest(appended.rest, named, len(named) - appended_count, lines.producer)
    else:
        size, rest = appended, ()
        sink.adopt_appended(size, lines.producer)
        longest = _take_lines(sink, lines, start, size, writer, (seen, episode_ids), longest)
    writer.size += size
    return size, longest, rest


def _take_lines(
    sink: BlobSink,
    lines: AppendedLines,
    start: int,
    size: int,
    writer: Writer,
    taken_ids: tuple[set[str], list[str]],
    longest: int,
) -> int:
    """Read back the ``size`` bytes one producer appended at ``start``, in pieces of whole lines."""
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
        longest = _note(EncodedRun(names[taken : taken + count], piece), lines.producer, writer, taken_ids, longest)
        taken += count
        offset += len(piece)
    if taken != len(names):
        raise InvalidRecord(f"{lines.producer} appended {taken} lines for the {len(names)} records named")
    return longest


def _take_pieces(
    sink: BlobSink,
    pieces: list[AppendedPiece],
    start: int,
    writer: Writer,
    taken_ids: tuple[set[str], list[str]],
    longest: int,
    named: set[str],
) -> int:
    """Read back the pieces several producers appended at once: they must follow each other from
    ``start`` on, each holding exactly the lines it names, all of them among ``named``."""
    offset = start
    for piece in pieces:
        if piece.offset != offset:
            raise InvalidRecord(
                f"{piece.producer} named {piece.length} bytes at byte {piece.offset} of the records file, "
                f"where the appended lines go on at byte {offset}"
            )
        _refuse_strays(piece.episode_ids, named, f"{piece.producer} appended")
        data = sink.read_appended(piece.offset, piece.length)
        if len(data) != piece.length:
            raise InvalidRecord(
                f"the lines {piece.producer} appended end after {len(data)} of the {piece.length} bytes named"
            )
        longest = _note(EncodedRun(piece.episode_ids, data), piece.producer, writer, taken_ids, longest)
        offset += piece.length
    return longest


def _the_rest(rest: Iterable[EncodedRun], named: set[str], missing: int, producer: str) -> Iterator[EncodedRun]:
    """The runs of the lines that were not appended: exactly the ``missing`` ones of ``named`` (each
    written once: the writer refuses an id seen before)."""
    given = 0
    for run in rest:
        _refuse_strays(run.episode_ids, named, f"{producer} handed over")
        given += len(run.episode_ids)
        yield run
    if given != missing:
        raise InvalidRecord(
            f"{producer} appended or handed over {len(named) - missing + given} lines for the {len(named)} records named"
        )


def _refuse_strays(episode_ids: Iterable[str], named: set[str], who_did: str) -> None:
    """Refuse lines of an id that is none of ``named``, naming the first (``who_did``: "worker 1 appended")."""
    if not named.issuperset(episode_ids):
        stray = next(episode_id for episode_id in episode_ids if episode_id not in named)
        raise InvalidRecord(f"{who_did} a line of {stray!r}, which is none of the records named")


def _note(run: EncodedRun, producer: str, writer: Writer, taken_ids: tuple[set[str], list[str]], longest: int) -> int:
    """Check ``run`` (read back) as its producer's lines, then hash it: the writer is idle meanwhile."""
    try:
        longest = note_run(run, *taken_ids, longest)
    except InvalidRecord as exc:
        raise InvalidRecord(f"in the lines {producer} appended: {exc}") from exc
    writer.hasher.update(run.lines)
    return longest
