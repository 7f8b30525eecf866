"""Records encoded elsewhere (a server's workers, a held copy), handed to the store's writer as bytes.

- :class:`EncodedRecord`: one line, as :func:`~gymckpt.store.codec.encode_record` wrote it.
- :class:`EncodedRun`: consecutive lines in one bytes object with their ids in order (a
  worker's export chunk as it arrived): the writer checks each line's leading id and copies
  the run at once, with no object per line.
- :class:`AppendedLines`: lines whose producer (a worker process of this host) appends them to the
  records file itself where the sink allows it (:meth:`~gymckpt.store.backend.BlobSink.append_target`),
  else hands them over as runs; the writer reads appended lines back to check and hash them.
  Several producers appending at once say where their lines landed (:class:`AppendedRegion`).
- :class:`EncodedRecords`: such records named before any line is read, yielded as they arrive.

The writer neither decodes nor encodes them again: it checks that each line is one line led
by its id (:func:`check_encoded`, :func:`check_run`; the records loop of the C accelerator does
the same look where it is built).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from gymckpt.errors import InvalidRecord, RecordUndecodable
from gymckpt.store import _walks
from gymckpt.store.codec import encode_record, episode_id_of_line

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

__all__ = [
    "AppendedLines",
    "AppendedPiece",
    "AppendedRegion",
    "PreEncoded",
    "EncodedRecord",
    "EncodedRecords",
    "EncodedRun",
    "check_encoded",
    "check_run",
    "note_run",
    "each_line",
    "encoded",
    "exact_size",
]


class EncodedRecord(NamedTuple):
    """A record already encoded by :func:`~gymckpt.store.codec.encode_record` (e.g. in another process, a worker).

    The store writes its line as it is: it is neither checked nor encoded again. Build one
    only from :func:`encode_record`'s result; :func:`encoded` does.
    """

    episode_id: str
    line: bytes


class EncodedRun(NamedTuple):
    """Consecutive encoded lines (each ending with its newline) and the id leading each, in order."""

    episode_ids: list[str]
    lines: bytes


class AppendedPiece(NamedTuple):
    """One write of lines that several processes appended at once: where in the file it landed (a
    byte offset), its length, the ids of its lines in order, and who wrote it (as errors name it)."""

    offset: int
    length: int
    episode_ids: list[str]
    producer: str


class AppendedRegion(NamedTuple):
    """What :meth:`AppendedLines.append_to` appended when several processes appended at once.

    ``pieces``, in file order, must tile the bytes appended exactly; ``rest`` hands over the lines
    that were not appended (a process that could not open the file) as runs, written after the
    pieces. Together they must hold each of :attr:`AppendedLines.episode_ids` once, and nothing else.
    """

    pieces: list[AppendedPiece]
    rest: Iterable[EncodedRun] = ()

    @property
    def size(self) -> int:
        """The bytes appended."""
        return sum(piece.length for piece in self.pieces)


class AppendedLines:
    """The lines of :attr:`episode_ids` from a producer that can append them to a file itself (in that
    order, or in the order its :class:`AppendedRegion` names)."""

    def __init__(self, episode_ids: list[str], producer: str = "another process") -> None:
        self.episode_ids = episode_ids
        #: who appends them, as errors name it
        self.producer = producer

    def append_to(self, target: str) -> int | AppendedRegion | None:
        """Have the producer append every line at the end of the file at ``target``: the bytes it
        appended (its lines in the order of :attr:`episode_ids`), or an :class:`AppendedRegion`
        (several processes appended theirs at once), or None when it could not open ``target`` and
        appended nothing (the writer then takes :meth:`runs`). Blocking: called on the writer's
        thread while nothing else writes the file; a :class:`~gymckpt.store.records.WriteStop` is
        seen once it returns."""
        raise NotImplementedError

    def runs(self) -> Iterator[EncodedRun]:
        """The same lines handed over as runs, for a sink that takes no appends."""
        raise NotImplementedError


#: what a records writer takes besides record dicts
PreEncoded = EncodedRecord | EncodedRun | AppendedLines


class EncodedRecords:
    """Pre-encoded records a writer takes as they arrive (e.g. from a server's workers), never all at once.

    :attr:`episode_ids` names them in order before any line is read; each iteration yields
    their :class:`EncodedRecord` (or :class:`EncodedRun`) from the first on, anew (a retried
    write reads them again). A caller that would otherwise list exported records keeps such
    an object as it is.
    """

    def __init__(self, episode_ids: list[str]) -> None:
        self.episode_ids = episode_ids

    def __len__(self) -> int:
        return len(self.episode_ids)

    def __iter__(self) -> Iterator[PreEncoded]:
        raise NotImplementedError


#: the accelerator's look at a run already written (see :func:`note_run`); None without it
_note_run: Any = None
if _walks.ACCELERATOR is not None and hasattr(_walks.ACCELERATOR, "configure_encoded"):  # one built before it had it
    try:  # append_lines takes their lines as check_encoded and check_run would
        _walks.ACCELERATOR.configure_encoded(EncodedRecord, EncodedRun)
        _note_run = getattr(_walks.ACCELERATOR, "note_run", None)
    except TypeError:  # one built before runs: their lines go through check_run
        _walks.ACCELERATOR.configure_encoded(EncodedRecord)


def exact_size(data: bytes) -> bytes:
    """An exact-size copy of ``data``, for an orjson output kept alive (a held record, a request body in flight).

    orjson's output keeps the buffer it wrote into: at least 4 KiB, and about twelve times the
    length of a long string (its worst-case escaping). Kept by the thousand, such bytes take
    two to fifty times their length in resident memory; the copy takes their length.
    """
    return memoryview(data).tobytes()


def encoded(record: dict[str, Any]) -> EncodedRecord:
    """``record`` encoded once, to be handed to the store (or over a socket) as it is; its line takes
    its own length in memory (:func:`exact_size`), however long it is kept."""
    episode_id, line = encode_record(record)
    return EncodedRecord(episode_id, exact_size(line))


def _check_leading(episode_id: str, line: bytes) -> None:
    try:
        leading = episode_id_of_line(line)
    except RecordUndecodable as exc:
        raise InvalidRecord(f"the encoded record of {episode_id!r} does not start with its episode_id") from exc
    if leading != episode_id:
        raise InvalidRecord(f"the encoded record of {episode_id!r} starts with episode_id {leading!r}")


def check_encoded(record: EncodedRecord) -> tuple[str, bytes]:
    """``(episode_id, line)`` of a pre-encoded record after a cheap look: one line, its leading id."""
    episode_id, line = record
    if type(line) is not bytes or not line.endswith(b"\n") or line.count(b"\n") != 1:
        raise InvalidRecord(f"the encoded record of {episode_id!r} is not one line ending with a newline")
    _check_leading(episode_id, line)
    return episode_id, line


def check_run(run: EncodedRun) -> list[tuple[str, bytes]]:
    """``(episode_id, line)`` of each line of a run after the same look as :func:`check_encoded`:
    as many lines as ids, each led by its own; :class:`InvalidRecord` names the first that is not."""
    episode_ids, lines = run
    if type(lines) is not bytes or not isinstance(episode_ids, list):
        raise InvalidRecord("a run of encoded records is not a list of ids and the bytes of their lines")
    pairs = []
    start = 0
    for episode_id in episode_ids:
        end = lines.find(b"\n", start) + 1
        if end == 0:
            raise InvalidRecord(f"a run of encoded records ends before the line of {episode_id!r}")
        line = lines[start:end]
        _check_leading(episode_id, line)
        pairs.append((episode_id, line))
        start = end
    if start != len(lines):
        raise InvalidRecord(f"a run of {len(episode_ids)} encoded records holds more lines than it names")
    return pairs


def note_run(run: EncodedRun, seen: set[str], episode_ids: list[str], longest: int) -> int:
    """Take the lines of ``run``, already written, as a records file's: their ids into ``seen`` and
    ``episode_ids`` (:class:`InvalidRecord` for one seen before, or a line :func:`check_run` refuses);
    the larger of ``longest`` and the run's longest line."""
    if _note_run is not None:
        noted = _note_run(run, seen, episode_ids, longest)
        if noted is not None:
            return noted  # type: ignore[no-any-return]
    for episode_id, line in check_run(run):
        if episode_id in seen:
            raise InvalidRecord(f"episode {episode_id!r} appears twice in one participant's records")
        seen.add(episode_id)
        episode_ids.append(episode_id)
        longest = max(longest, len(line))
    return longest


def each_line(records: Iterable[PreEncoded]) -> Iterator[tuple[str, bytes]]:
    """``(episode_id, line)`` of each pre-encoded record, a run's lines one by one (checked as the writer would)."""
    for record in records:
        if isinstance(record, AppendedLines):
            yield from each_line(record.runs())
        elif type(record) is EncodedRun:
            yield from check_run(record)
        else:
            yield check_encoded(record)  # type: ignore[arg-type]
