"""Records between a server's coordinator and its workers in bounded chunks (commit's gather, restore's scatter).

Commit: a worker's ``export`` reply names its records (``[episode_id, owner]``, no state),
so the coordinator can gather (:mod:`gymckpt.workers.gather`) before any line moves. The
store's writer then iterates :class:`GatheredLines` on its own thread: one
:class:`WorkersLines` for all the workers. Where the store's sink is a local file, the workers
append their kept records to it themselves, all at once (``send_records`` with ``append_to``,
:func:`append_export`: each write whole lines, and where it landed named), and the writer reads
them back to check and hash them. Otherwise a worker after the other encodes them (each once,
:func:`gymckpt.store.codec.encode_record`, each line copied into its chunk at once) into chunks
of about :data:`CHUNK_BYTES` (:func:`encode_export_chunk`) and sends each as ``export_chunk``,
its lines as bytes beside the ids, which reach the writer as one run
(:class:`~gymckpt.store.encoded.EncodedRun`); a chunk is answered as it arrives while few wait
for the writer, else once the writer takes it (:class:`LinePipe`): the coordinator holds a few
chunks, never the records, and a worker holds one chunk beside its live state.

Restore: each worker reads its share from the records file itself (``install_share``), or the
coordinator sends it as it reads the file (``install_chunk``, :mod:`gymckpt.workers.scatter`).
A worker decodes each line and keeps the records of the current stream (:class:`InstallStaging`)
until ``install`` names the stream and the count, then installs them all at once (all or none). A stream that is not completed
(a failed restore) is dropped by the next stream or by reopening admission.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import re
import stat
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, NamedTuple

from gymckpt.errors import CoordinatorUnavailable, InvalidCheckpointState, InvalidPhase, InvalidRequest
from gymckpt.gc_pause import pause_gc
from gymckpt.store.codec import decode_line, encode_record
from gymckpt.store.encoded import (
    AppendedLines,
    AppendedPiece,
    AppendedRegion,
    EncodedRecord,
    EncodedRecords,
    EncodedRun,
)
from gymckpt.workers.gather import ExportedRecord
from gymckpt.workers.placement import is_routing_id, is_whole_episode

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Set

__all__ = [
    "CHUNK_BYTES",
    "GatheredLines",
    "LinePipe",
    "PIPE_WINDOW",
    "LineRef",
    "WorkersLines",
    "append_export",
    "appended_pieces",
    "InstallStaging",
    "encode_export_chunk",
    "exported_run",
    "exported_refs",
    "owner_of",
]

logger = logging.getLogger(__name__)

#: about how many bytes of encoded lines one chunk carries (a record longer than that goes alone)
CHUNK_BYTES = 512 << 10

Line = list[Any]


def owner_of(kind: str, record: dict[str, Any], owner: str | None) -> str | None:
    """The owner a worker stamps on ``record``: its routing id for a session record, else None."""
    return None if is_whole_episode(kind, record) else owner


def encode_export_chunk(
    records: list[dict[str, Any]],
    start: int,
    kind: str,
    owner: str | None,
    limit: int = CHUNK_BYTES,
    skip: Set[int] = frozenset(),
) -> tuple[list[str], bytes, int]:
    """Records from ``start`` on (but those at a position in ``skip``), each encoded once, until
    about ``limit`` bytes: the chunk's episode ids, its lines (each ending with its newline)
    joined, and the next start.

    The lines travel as bytes beside the ids (a blob frame, :mod:`gymckpt.workers.frames`);
    ``owner`` is set on session records, in their line (the export reply named it already).
    """
    episode_ids: list[str] = []
    # each line is copied into the chunk at once: orjson's output keeps its whole buffer while it lives
    # (gymckpt.store.encoded.exact_size): a list of a chunk's small lines took fifty times the chunk
    chunk = bytearray()
    index = start
    while index < len(records) and len(chunk) < limit:
        if index in skip:
            index += 1
            continue
        record = records[index]
        session_owner = owner_of(kind, record, owner)
        stamped = record if session_owner is None else {**record, "owner": session_owner}
        episode_id, line = encode_record(stamped)
        chunk += line
        del line
        episode_ids.append(episode_id)
        index += 1
    return episode_ids, bytes(chunk), index


def exported_run(episode_ids: object, blob: object, who: str) -> EncodedRun:
    """A chunk's episode ids and their lines as one run for the store's writer, which checks that
    there is one line per id, led by it, as it copies the run (refused here: not a list of ids and
    bytes, or lines that do not end with a newline)."""
    if not isinstance(episode_ids, list) or not isinstance(blob, bytes):
        raise InvalidCheckpointState(f"{who} sent an export chunk without its episode ids and their lines")
    if not all(type(episode_id) is str for episode_id in episode_ids):
        raise InvalidCheckpointState(f"{who} sent an export chunk whose episode ids are not all strings")
    if bool(blob) != bool(episode_ids) or (blob and not blob.endswith(b"\n")):
        raise InvalidCheckpointState(
            f"{who} sent an export chunk of {len(episode_ids)} records whose lines do not end with a newline"
        )
    return EncodedRun(episode_ids, blob)


def appended_pieces(pieces: object, who: str) -> list[tuple[int, int, int]]:
    """A worker's ``send_records`` reply naming where its writes landed: ``[offset, length, count]``
    each, non-negative integers with at least one byte and one line, in increasing file order (the
    store's writer then checks that every piece holds the lines it names)."""
    if not isinstance(pieces, list):
        raise InvalidCheckpointState(f"{who} appended its records without naming where they are")
    checked: list[tuple[int, int, int]] = []
    end = 0
    for piece in pieces:
        if (
            not isinstance(piece, list)
            or len(piece) != 3
            or not all(type(number) is int for number in piece)
            or piece[0] < end
            or piece[1] < 1
            or piece[2] < 1
        ):
            raise InvalidCheckpointState(f"{who} named an appended piece as {piece!r:.80}, not [offset, length, count]")
        offset, length, count = piece
        checked.append((offset, length, count))
        end = offset + length
    return checked


class LineRef(NamedTuple):
    """A worker's exported record before its line moves: its id, the worker and its position there."""

    episode_id: str
    worker: int
    position: int


def exported_refs(reply: object, index: int, who: str) -> list[ExportedRecord]:
    """An ``export`` reply's ``[episode_id, owner]`` pairs as records to gather (refused: not such pairs)."""
    pairs = reply.get("records") if isinstance(reply, dict) else None
    if not isinstance(pairs, list):
        raise InvalidCheckpointState(f"{who} replied to export without a records list")
    refs = []
    for position, item in enumerate(pairs):
        if not (
            isinstance(item, list)
            and len(item) == 2
            and isinstance(item[0], str)
            and (item[1] is None or is_routing_id(item[1]))
        ):
            raise InvalidCheckpointState(f"{who} exported a record that is not an [episode_id, owner] pair")
        refs.append(ExportedRecord(LineRef(item[0], index, position), owner=item[1]))  # type: ignore[arg-type]
    return refs


_END = object()


#: chunks a pipe answers as they arrive while no more than this many wait for the writer
PIPE_WINDOW = 2


class LinePipe:
    """One worker's chunks, from the event loop to the writing thread.

    A chunk is answered as it arrives while at most :data:`PIPE_WINDOW` chunks wait for the
    writer (the worker encodes its next chunk meanwhile), else once the writer takes it: the
    coordinator holds at most ``PIPE_WINDOW + 1`` chunks of a worker besides the one being written.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.received = 0
        self._items: queue.Queue[Any] = queue.Queue()
        self._closed = False

    async def put(self, run: EncodedRun) -> None:
        """Hand a chunk over (on the loop); returns once the writer took it."""
        if self._closed:
            raise InvalidPhase("the write these records were for has ended")
        taken = self.loop.create_future()
        self.received += len(run.episode_ids)
        self._items.put((run, taken))
        if self._closed:  # closed meanwhile, perhaps before this chunk was queued: nobody takes it
            _refuse(taken)
        elif self._items.qsize() <= PIPE_WINDOW:
            _answer(taken)
        await taken

    def finish(self, failure: BaseException | None) -> None:
        """The stream ended (on the loop): the writer gets ``failure``, or the end."""
        self._items.put((_END, failure))

    def close(self) -> None:
        """The writer stops reading (on its thread): every chunk still waiting is refused."""
        self._closed = True
        while True:
            try:
                _, taken = self._items.get_nowait()
            except queue.Empty:
                return
            if isinstance(taken, asyncio.Future):
                self.loop.call_soon_threadsafe(_refuse, taken)

    def take(self, alive: Callable[[], bool]) -> EncodedRun | None:
        """The next chunk (on the writer's thread), None at the end; raises the stream's failure."""
        while True:
            try:
                item, other = self._items.get(timeout=1.0)
            except queue.Empty:
                if not alive():
                    raise CoordinatorUnavailable("the coordinator's event loop ended during a write") from None
                continue
            if item is _END:
                if other is not None:
                    raise other
                return None
            self.loop.call_soon_threadsafe(_answer, other)
            return item  # type: ignore[no-any-return]


def _answer(taken: asyncio.Future[None]) -> None:
    if not taken.done():
        taken.set_result(None)


def _refuse(taken: asyncio.Future[None]) -> None:
    if not taken.done():
        taken.set_exception(InvalidPhase("the write these records were for has ended"))


#: ``fetch(index, skip, pipe)``: ask worker ``index`` for its kept lines (all but the positions in
#: ``skip``) into ``pipe``, and finish the pipe; run on the coordinator's loop
Fetch = Callable[[int, list[int], LinePipe], Coroutine[Any, Any, None]]
#: ``append(index, skip, target)``: have worker ``index`` append the same lines to the file at
#: ``target``; the pieces it appended, in its order (``(offset, length, count)`` of each write:
#: where in the file it landed, its bytes and its lines), or None when it could not open the file
#: (nothing appended)
Append = Callable[[int, list[int], str], Coroutine[Any, Any, "list[tuple[int, int, int]] | None"]]


class GatheredLines(EncodedRecords):
    """A commit's records across workers, read from each worker in turn as the store writes them.

    ``plan`` is, in gathering order, each worker's index, the positions it leaves out and the
    ids of the records it sends; ``held`` the coordinator's records, written last.
    """

    def __init__(
        self,
        plan: list[tuple[int, list[int], list[str]]],
        held: list[EncodedRecord],
        fetch: Fetch,
        loop: asyncio.AbstractEventLoop,
        append: Append | None = None,
    ) -> None:
        super().__init__([key for _, _, keys in plan for key in keys] + [record.episode_id for record in held])
        self.plan = plan
        self.held = held
        self.fetch = fetch
        self.append = append
        self.loop = loop

    def __iter__(self) -> Iterator[EncodedRecord | WorkersLines]:
        """The lines, in gathering order: iterate on another thread than the coordinator's loop (the store's writer)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            raise RuntimeError("a commit's gathered lines are read on a thread of their own, not on the event loop")
        sending = [(index, skip, keys) for index, skip, keys in self.plan if keys]
        if sending:
            yield WorkersLines(self, sending)
        yield from self.held

    def worker_runs(self, index: int, skip: list[int], keys: list[str]) -> Iterator[EncodedRun]:
        """Worker ``index``'s kept lines (all but ``skip``) as the runs of its chunks, each checked against ``keys``."""
        pipe = LinePipe(self.loop)
        running = asyncio.run_coroutine_threadsafe(self.fetch(index, skip, pipe), self.loop)
        position = 0
        try:
            while (run := pipe.take(lambda: not self.loop.is_closed())) is not None:
                count = len(run.episode_ids)
                named = keys[position : position + count]
                if run.episode_ids != named:
                    raise InvalidCheckpointState(f"worker {index} sent {_first_other(run.episode_ids, named)}")
                position += count
                yield run
                del run
            if position != len(keys):
                raise InvalidCheckpointState(f"worker {index} sent {position} of the {len(keys)} records it exported")
            running.result()
        finally:
            pipe.close()
            if not running.done():
                running.cancel()


class WorkersLines(AppendedLines):
    """Every worker's kept lines. Where the store's sink allows it (a local file), the workers append
    them to the records file themselves, all at once, each write whole lines: each worker names where
    its writes landed, and the writer reads them back in file order. Else (and for a worker that
    cannot open the file) a worker after the other sends them to the coordinator in chunks (runs)."""

    def __init__(self, gathered: GatheredLines, plan: list[tuple[int, list[int], list[str]]]) -> None:
        super().__init__([key for _, _, keys in plan for key in keys], _workers_named(index for index, _, _ in plan))
        self.gathered, self.plan = gathered, plan

    def append_to(self, target: str) -> AppendedRegion | None:
        loop, append = self.gathered.loop, self.gathered.append
        if append is None:
            return None

        async def every_worker() -> list[Any]:
            # every append runs to its end before a failure is raised: none writes on after the write failed
            return await asyncio.gather(
                *(append(index, skip, target) for index, skip, _ in self.plan), return_exceptions=True
            )

        running = asyncio.run_coroutine_threadsafe(every_worker(), loop)
        while True:
            try:
                outcomes = running.result(timeout=1.0)
                break
            except TimeoutError:
                if loop.is_closed():
                    running.cancel()
                    raise CoordinatorUnavailable("the coordinator's event loop ended during a write") from None
        failure = next((outcome for outcome in outcomes if isinstance(outcome, BaseException)), None)
        if failure is not None:
            raise failure
        pieces: list[AppendedPiece] = []
        left = []
        for (index, skip, keys), written in zip(self.plan, outcomes, strict=True):
            if written is None:
                left.append((index, skip, keys))
            else:
                pieces.extend(_worker_pieces(index, keys, written))
        if not pieces:
            return None  # no worker could open the file: every line comes as runs
        pieces.sort(key=lambda piece: piece.offset)
        rest = (run for index, skip, keys in left for run in self.gathered.worker_runs(index, skip, keys))
        return AppendedRegion(pieces, rest)

    def runs(self) -> Iterator[EncodedRun]:
        for index, skip, keys in self.plan:
            yield from self.gathered.worker_runs(index, skip, keys)


def _workers_named(indexes: Iterable[int]) -> str:
    named = [str(index) for index in indexes]
    return f"worker {named[0]}" if len(named) == 1 else f"workers {', '.join(named[:-1])} and {named[-1]}"


def _worker_pieces(index: int, keys: list[str], written: list[tuple[int, int, int]]) -> list[AppendedPiece]:
    """Worker ``index``'s writes as pieces of the records file, its ``keys`` in its order: every key once."""
    pieces, taken, producer = [], 0, f"worker {index}"
    for offset, length, count in written:
        pieces.append(AppendedPiece(offset, length, keys[taken : taken + count], producer))
        taken += count
    if taken != len(keys):
        raise InvalidCheckpointState(f"{producer} appended {taken} lines for the {len(keys)} records it exported")
    return pieces


#: where a worker appends its lines: its coordinator's descriptor of the records file, through /proc
_APPEND_TARGET = re.compile(r"/proc/[0-9]+/fd/[0-9]+")


def append_export(
    records: list[dict[str, Any]],
    kind: str,
    owner: str | None,
    skip: Set[int],
    target: object,
    limit: int = CHUNK_BYTES,
) -> list[tuple[int, int, int]] | None:
    """A worker's side of :meth:`WorkersLines.append_to`: its records (but those at a position in
    ``skip``) encoded a chunk at a time (:func:`encode_export_chunk`) and appended to the file at
    ``target``, each chunk in one write (other workers append theirs meanwhile). Where each write
    landed: ``(offset, length, count)`` (its first byte in the file, its bytes, its lines), in
    order; None when ``target`` cannot be opened here (nothing appended: the coordinator asks for
    chunks instead). ``target`` must be a ``/proc`` descriptor entry of a regular file
    (:class:`InvalidRequest` otherwise); a write the kernel cut short fails the append
    (:class:`InvalidCheckpointState`: another worker's lines may follow its first part)."""
    if not isinstance(target, str) or not _APPEND_TARGET.fullmatch(target):
        raise InvalidRequest(f"records are appended to a records file of this server's coordinator, not to {target!r}")
    try:
        fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    except OSError as exc:
        logger.info("%s worker cannot open %s to append its records (%s): they go in chunks", kind, target, exc)
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidRequest(f"{target} is not a regular file: no records are appended to it")
        written: list[tuple[int, int, int]] = []
        start = 0
        while start < len(records):
            episode_ids, lines, start = encode_export_chunk(records, start, kind, owner, limit, skip)
            if not lines:
                continue
            # O_APPEND: the kernel moves to the end and writes the whole buffer as one step, so no other
            # worker's bytes land inside it; the descriptor's offset is then the end of this write
            size = os.write(fd, lines)
            if size != len(lines):
                raise InvalidCheckpointState(
                    f"the {kind} worker's append of {len(lines)} bytes to the records file wrote {size} (disk full?)"
                )
            written.append((os.lseek(fd, 0, os.SEEK_CUR) - size, size, len(episode_ids)))
            del lines
        return written
    finally:
        os.close(fd)


def _first_other(sent: list[str], named: list[str]) -> str:
    """Where a chunk's ids first differ from those its export named, in words."""
    at = next((i for i, (one, other) in enumerate(zip(sent, named, strict=False)) if one != other), len(named))
    wanted = repr(named[at]) if at < len(named) else "no more records"
    return f"the line of {sent[at]!r} where its export named {wanted}"


class InstallStaging:
    """A worker's records of the current install stream, decoded as their chunks arrive, by position in its share.

    The cyclic collector is paused from a stream's first chunk until the stream is finished or
    dropped (:func:`~gymckpt.gc_pause.pause_gc`): between chunks it would otherwise traverse the
    growing share again and again, only to find it alive (half the decoding time of an agent's
    sessions).
    """

    def __init__(self) -> None:
        self.stream: int | None = None
        self.records: dict[int, dict[str, Any]] = {}
        self._release_gc: Callable[[], None] | None = None

    def take(self, body: object) -> None:
        """One ``install_chunk`` (``[position, line]`` pairs): a new stream drops what an earlier, unfinished one left."""
        stream = body.get("stream") if isinstance(body, dict) else None
        pairs = body.get("records") if isinstance(body, dict) else None
        if type(stream) is not int or not isinstance(pairs, list):
            raise InvalidRequest("an install chunk needs an integer stream and a records list")
        if stream != self.stream:
            self.begin(stream)
        for pair in pairs:
            if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is int and isinstance(pair[1], str)):
                raise InvalidRequest("an install chunk's records are [position, line] pairs")
            self.records[pair[0]] = decode_line(pair[1].encode("utf-8"))

    def begin(self, stream: int) -> None:
        """Receive ``stream`` from now on (what an earlier, unfinished one left is dropped); the collector pauses."""
        self.drop()
        self.stream = stream
        self._release_gc = pause_gc()

    def take_share(self, stream: int, records: dict[int, dict[str, Any]]) -> None:
        """The records of ``stream`` the worker read itself (``install_share``), by position in its share;
        refused when another stream began meanwhile."""
        if stream != self.stream:
            raise InvalidPhase(f"install stream {stream} was dropped while this worker read its share")
        self.records.update(records)

    def finish(self, stream: object, count: object) -> list[dict[str, Any]]:
        """The records of ``stream`` in share order (positions 0 … ``count`` - 1); the staging is empty afterwards."""
        records = self.records if stream == self.stream else {}
        self.drop()
        if type(count) is not int or sorted(records) != list(range(count)):
            raise InvalidCheckpointState(
                f"the install of stream {stream!r} names {count!r} records, but {len(records)} arrived"
            )
        return [records[position] for position in range(count)]

    def drop(self) -> None:
        """Forget the staged records (an unfinished stream) and let the collector run again."""
        self.stream = None
        self.records = {}
        release, self._release_gc = self._release_gc, None
        if release is not None:
            release()
