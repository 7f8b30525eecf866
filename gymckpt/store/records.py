"""Streaming records files: encode, hash and write one record at a time; read back the same way.

Writing runs two stages: the caller's thread encodes records (it holds the GIL) while a
worker thread hashes and writes full chunks (hashlib and file I/O release the GIL), so
both cores work. The chunks are a few buffers used over and over: a sink's ``write``
must copy what it keeps of one (every backend's does). Reading mirrors it: a worker
thread reads and hashes chunks while the caller's thread splits lines and decodes only
the records in scope. Memory stays bounded by a few chunks plus the largest record: the
writer measures its longest line (the manifest's ``max_record_bytes``) and a reader holds
no line longer than its :attr:`RecordsCheck.line_limit` (:mod:`gymckpt.store.bounds`),
whatever the bytes on disk. Lines a server's worker appends to a local records file itself
(:class:`~gymckpt.store.encoded.AppendedLines`) are read back, checked and hashed in their
place in the file (:mod:`gymckpt.store.appended`).
"""

from __future__ import annotations

import hashlib
import itertools
import queue
import threading
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gymckpt.errors import (
    DuplicateEpisode,
    EpisodeIdsMismatch,
    InvalidRecord,
    RecordCountMismatch,
    RecordsDigestMismatch,
    RecordsSizeMismatch,
    RecordUndecodable,
    WriteStopped,
)
from gymckpt.gc_pause import paused_gc
from gymckpt.store import codec
from gymckpt.store.appended import take_appended
from gymckpt.store.bounds import MAX_LINE_BYTES
from gymckpt.store.codec import (
    decode_line_and_id,
    decode_record,
    decode_reference_record,
    encode_record,
    episode_id_of_line,
    reference_episode_id_of_line,
)
from gymckpt.store.encoded import AppendedLines, EncodedRecord, EncodedRun, PreEncoded, check_encoded, check_run
from gymckpt.store.handoffs import quick_handoffs
from gymckpt.store.lines import TOO_LONG, counted, decode_every_line, lines_of, too_long

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterable, Iterator
    from typing import BinaryIO

    from gymckpt.errors import InvalidCheckpointState
    from gymckpt.store.backend import BlobSink
    from gymckpt.store.lines import LineDamage
    from gymckpt.store.spans import LineSpan

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "RecordsCheck",
    "RecordsSummary",
    "WriteStop",
    "paused_gc",
    "read_lines",
    "read_records",
    "write_records",
]

DEFAULT_CHUNK_SIZE = 4 << 20
#: the read limit of a records file whose manifest claims no size
_UNBOUNDED = 1 << 62
_QUEUE_DEPTH = 4
#: buffers a write fills in turn: one being filled, _QUEUE_DEPTH waiting, one being written
_BUFFERS = _QUEUE_DEPTH + 2
#: a records file is large once this many bytes, and at least 16 chunks, are written: from there
#: on it is written in _LARGE_BUFFERS chunks as large as the _BUFFERS together (the same memory
#: in fewer writes: each chunk costs the writing thread a few waits for the GIL the encoding
#: thread holds; small files keep their chunks, which measured faster for them)
_LARGE_FILE = 64 << 20
_LARGE_BUFFERS = 2
#: a write's first chunk: later ones grow with what was written (an eighth of it, up to the chunk
#: size), so the buffers a write keeps stay below the file's own size (six buffers: three quarters
#: of it at most) instead of costing ``_BUFFERS`` full chunks even for a file of a few megabytes
_FIRST_CHUNK = 256 << 10
_CHUNK_GROWTH = 8
#: the largest chunk a read hands on: decoding is the slower side, so the read-ahead queue stays
#: full, and its chunks are what a restore holds beyond its records (reading a 36 MB file: about
#: 9 MiB at 4 MiB chunks, 3 MiB at 1 MiB ones, as fast: ``make bench``'s restore figures)
_READ_CHUNK = 1 << 20
_END = object()


class WriteStop:
    """The stop flag and lock of one write.

    The writer checks :attr:`stopped` before each record; its last check, the rename of
    the records file and the creation of the manifest run under :meth:`held`. Once
    :meth:`stop` has returned, no manifest of that write can appear.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` was called."""
        return self._stopped

    def stop(self) -> None:
        """Stop the write; waits while it is publishing, so it returns only after."""
        with self._lock:
            self._stopped = True

    def held(self) -> threading.Lock:
        """The lock publication runs under."""
        return self._lock

    def check(self) -> None:
        """Raise :class:`WriteStopped` if the write was stopped."""
        if self._stopped:
            raise WriteStopped("the write was stopped before it published")


@dataclass
class RecordsSummary:
    """What a written records file holds."""

    sha256: str
    size: int
    count: int
    episode_ids: list[str] = field(default_factory=list)
    #: the longest line in bytes, newline included (the manifest's ``max_record_bytes``)
    max_record_bytes: int = 0


class _ChunkWriter(threading.Thread):
    """Hashes and writes chunks handed over by the encoding thread, then hands their buffers back
    (to a sink that :attr:`~gymckpt.store.backend.BlobSink.keeps_chunks`: adopts each chunk, and
    a new empty buffer comes back instead)."""

    def __init__(self, sink: BlobSink) -> None:
        super().__init__(name="gymckpt-records-writer", daemon=True)
        self.sink = sink
        #: a sink of another shape than BlobSink (a wrapper) keeps nothing unless it says so
        self.keeps_chunks = bool(getattr(sink, "keeps_chunks", False))
        self.hasher = hashlib.sha256()
        self.size = 0
        self.error: BaseException | None = None
        self.inbox: queue.Queue[object] = queue.Queue()
        #: buffers written and free to fill again
        self.free: queue.Queue[bytearray] = queue.Queue()
        #: how many buffers there may be, and how many there are
        self.buffer_limit = _BUFFERS
        self.buffers = 0

    def run(self) -> None:
        while (handed := self.inbox.get()) is not _END:
            if isinstance(handed, threading.Event):  # drain(): everything handed before is written
                handed.set()
                continue
            buffer, length = handed  # type: ignore[misc]
            if self.error is None:  # else keep draining so the producer never waits on a dead writer
                try:
                    if self.keeps_chunks:  # the sink holds on to the chunk: its buffer is never filled again
                        chunk = memoryview(buffer)[:length]
                        self.hasher.update(chunk)
                        self.sink.adopt(chunk)
                        buffer = bytearray()
                    else:
                        with memoryview(buffer) as whole, whole[:length] as chunk:
                            self.hasher.update(chunk)
                            self.sink.write(chunk)
                    self.size += length
                except BaseException as exc:
                    self.error = exc
                    buffer = bytearray()  # the error's traceback may still hold a view of the old one
            self.free.put(buffer)

    def drain(self) -> None:
        """Return once every chunk handed over so far is written (or the writer failed)."""
        drained = threading.Event()
        self.inbox.put(drained)
        drained.wait()

    def empty_buffer(self) -> bytearray:
        """A buffer to fill: a new one while there are fewer than the limit, else the next one
        written (the ones beyond a lowered limit are let go as they come back)."""
        while True:
            if self.buffers < self.buffer_limit and self.free.empty():
                self.buffers += 1
                return bytearray()
            buffer = self.free.get()  # every other buffer is queued or being written: it comes back
            if self.buffers <= self.buffer_limit:
                return buffer
            self.buffers -= 1


def write_records(
    sink: BlobSink,
    records: Iterable[dict[str, Any] | PreEncoded],
    *,
    stop: WriteStop | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> RecordsSummary:
    """Encode ``records`` into ``sink`` one at a time; return digest, size, count and ids.

    Chunks of whole lines go to ``sink.write``: the first of ``_FIRST_CHUNK`` (256 KiB), each later
    one an eighth of the bytes written so far, up to ``chunk_size``; a large file's later chunks
    are larger still (``_LARGE_FILE``), in the same memory. Raises
    :class:`InvalidRecord` (no leading episode_id, a duplicate id),
    :class:`~gymckpt.errors.NotJSONError`, :class:`WriteStopped`, or the sink's
    storage error. The sink is left for the caller to finish or abort.
    """
    with quick_handoffs():  # the writer thread gets the GIL back sooner each time it returns from hashlib or a write
        return _write_chunks(sink, records, stop, chunk_size)


def _write_chunks(
    sink: BlobSink,
    records: Iterable[dict[str, Any] | PreEncoded],
    stop: WriteStop | None,
    chunk_size: int,
) -> RecordsSummary:
    """write_records' loops: the caller's thread encodes, a :class:`_ChunkWriter` hashes and writes."""
    writer = _ChunkWriter(sink)
    writer.start()
    fast_encode = codec._encode_line  # encode_record's common case in one C call, where built
    append_lines = codec._append_lines  # and this loop's, for a run of such records
    seen: set[str] = set()
    episode_ids: list[str] = []
    longest = 0
    # lines are copied into the chunk at once: orjson's output of a long string keeps a
    # worst-case allocation of several times its length for as long as the bytes live
    batch = writer.empty_buffer()
    filled = 0
    target = min(chunk_size, _FIRST_CHUNK)
    handed = 0
    pending = iter(records)
    try:
        while True:
            if stop is not None and stop.stopped:
                stop.check()
            if append_lines is not None:
                filled, ended, record, longest = append_lines(
                    pending, batch, filled, target, seen, episode_ids, longest
                )
                if ended:
                    break
                left_to_python = filled < target  # else the chunk is full
            else:
                record = next(pending, _END)
                if record is _END:
                    break
                left_to_python = True
            if left_to_python and isinstance(record, AppendedLines):
                appends = getattr(sink, "append_target", None)  # a wrapper of another shape: none
                appended_to = appends() if appends is not None else None
                if appended_to is None:  # this sink takes no appends: the same lines come as runs
                    pending = itertools.chain(record.runs(), pending)
                    continue
                if filled:  # the file ends with everything before these lines, written
                    writer.inbox.put((batch, filled))
                    handed += filled
                    batch, filled = writer.empty_buffer(), 0
                writer.drain()
                if writer.error is not None:
                    break
                taken = take_appended(sink, record, appended_to, writer, seen, episode_ids, longest)
                if taken is None:  # the producer could not append here: its lines come as runs
                    pending = itertools.chain(record.runs(), pending)
                    continue
                size, longest, rest = taken
                handed += size
                pending = itertools.chain(rest, pending)  # lines a producer could not append: runs, after
                del record, rest
                continue
            if left_to_python:
                lines: list[tuple[str, bytes]] | tuple[tuple[str, bytes]]
                if type(record) is EncodedRun:
                    lines = check_run(record)  # a worker's chunk: its lines one by one
                else:
                    encoded = None if fast_encode is None else fast_encode(record)
                    if encoded is None:
                        encoded = check_encoded(record) if type(record) is EncodedRecord else encode_record(record)
                    lines = (encoded,)
                    del encoded  # the line is let go once copied (below), not when the next record is encoded
                for episode_id, line in lines:
                    if episode_id in seen:
                        raise InvalidRecord(f"episode {episode_id!r} appears twice in one participant's records")
                    seen.add(episode_id)
                    episode_ids.append(episode_id)
                    longest = max(longest, len(line))
                    end = filled + len(line)
                    if end <= len(batch):
                        batch[filled:end] = line  # in place: a buffer used before keeps its size
                    else:
                        del batch[filled:]
                        batch += line
                    filled = end
                    del line
                del lines
            if filled >= target:
                if writer.error is not None:
                    break
                writer.inbox.put((batch, filled))
                handed += filled
                if target < chunk_size:
                    target = min(chunk_size, max(target, handed // _CHUNK_GROWTH))
                elif target == chunk_size and handed >= max(_LARGE_FILE, 16 * chunk_size):
                    target = chunk_size * _BUFFERS // _LARGE_BUFFERS  # a large file: see _LARGE_FILE
                    writer.buffer_limit = _LARGE_BUFFERS
                batch = writer.empty_buffer()
                filled = 0
        if filled and writer.error is None:
            writer.inbox.put((batch, filled))
    finally:
        writer.inbox.put(_END)
        writer.join()
    if writer.error is not None:
        raise writer.error
    return RecordsSummary(writer.hasher.hexdigest(), writer.size, len(episode_ids), episode_ids, longest)


class _ChunkReader(threading.Thread):
    """Reads and hashes chunks (of ``chunk_size``, at most :data:`_READ_CHUNK`) ahead of the decoding thread."""

    def __init__(self, stream: BinaryIO, chunk_size: int, limit: int) -> None:
        super().__init__(name="gymckpt-records-reader", daemon=True)
        self.stream = stream
        self.chunk_size = min(chunk_size, _READ_CHUNK)
        #: bytes still to read at most: a file longer than its manifest claims is read no further
        self.remaining = limit
        self.last_byte = b""
        self.hasher = hashlib.sha256()
        self.size = 0
        self.error: BaseException | None = None
        self.outbox: queue.Queue[object] = queue.Queue(maxsize=_QUEUE_DEPTH)
        self.cancelled = False

    def run(self) -> None:
        try:
            while not self.cancelled and self.remaining > 0:
                chunk = self.stream.read(min(self.chunk_size, self.remaining))
                if not chunk:
                    break
                self.remaining -= len(chunk)
                self.last_byte = chunk[-1:]
                self.size += len(chunk)
                self.outbox.put(chunk)  # handed on first: the decoding thread starts while this one hashes
                self.hasher.update(chunk)
        except BaseException as exc:
            self.error = exc
        finally:
            self.outbox.put(_END)

    def chunks(self) -> Iterator[bytes]:
        while (chunk := self.outbox.get()) is not _END:
            yield chunk  # type: ignore[misc]
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        self.cancelled = True
        while self.is_alive():
            try:
                self.outbox.get(timeout=0.1)
            except queue.Empty:
                pass


@dataclass
class RecordsCheck:
    """What a records file is expected to hold (from its manifest), and who is reading it.

    A reference-format manifest claims no size and no episode ids (None: not checked), and
    its lines name episodes by object (``reference``: read them, as capture keys).
    """

    path: str
    participant: str
    #: the manifest whose claims the file is checked against (named when they contradict themselves)
    manifest_path: str
    sha256: str
    size: int | None
    count: int
    episode_ids: tuple[str, ...] | None
    #: the file is in the reference's format: its lines are read by the reference decoder
    reference: bool = False
    #: the longest line held, newline included (:func:`gymckpt.store.bounds.line_limit`); a longer one is damage
    line_limit: int = MAX_LINE_BYTES

    def fail(
        self, error: type[InvalidCheckpointState], detail: str, *, in_manifest: bool = False
    ) -> InvalidCheckpointState:
        return error(detail, path=self.manifest_path if in_manifest else self.path, participant=self.participant)


def read_records(
    stream: BinaryIO,
    expected: RecordsCheck,
    *,
    scope: Collection[str] | None = None,
    decode_all: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    progress: Callable[[int], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield the records in ``scope`` (all when None) while verifying the whole file.

    The digest, line count, one line per episode, and the size and episode ids where
    ``expected`` claims them, are checked after the last line, before the iterator ends; damage raises a typed
    :class:`~gymckpt.errors.InvalidCheckpointState`, so a consumer must not act on
    records before the iteration finished. Out-of-scope lines are hashed and counted
    but not decoded unless ``decode_all``. While the iterator is open the cyclic GC is
    paused (:func:`paused_gc`); it resumes when the iterator ends, is closed or dropped.

    No line longer than ``expected.line_limit`` is held: it is damage
    (:class:`~gymckpt.errors.RecordTooLong`), and the file is still read and hashed to its
    end. Damage of the file as a whole wins over damage of its lines: the size, then the
    digest, then the first damaged line (too long, undecodable, a key twice, no final
    newline), then an episode on two lines, the count and the episode ids. A file of zeros
    (what a crash can leave) is so a digest mismatch, not a line too long.
    """
    # a file longer than its manifest claims is read one byte further, no more; without a claim, to its end
    reader = _ChunkReader(stream, chunk_size, _UNBOUNDED if expected.size is None else expected.size + 1)
    reader.start()
    # chosen once per file: gymckpt's own lines never pay for the reference's
    episode_of, decode = (
        (reference_episode_id_of_line, decode_reference_record)
        if expected.reference
        else (episode_id_of_line, decode_record)
    )
    # every line of gymckpt's own format decoded: each id is read from its record, no line is read twice
    whole = scope is None and not expected.reference
    limit = expected.line_limit
    episode_ids: list[str] = []
    damage: LineDamage | None = None
    line_number = 0
    chunks = reader.chunks() if progress is None else counted(reader.chunks(), progress)
    try:
        with paused_gc():
            if whole and codec._decode_fast_lines is not None:
                line_number, damage = yield from decode_every_line(chunks, episode_ids, limit)
            else:
                for lines in lines_of(chunks, limit):
                    for line in lines:
                        line_number += 1
                        if damage is not None:
                            continue
                        if line is TOO_LONG:
                            damage = too_long(line_number, limit)
                            continue
                        try:
                            if whole:
                                episode_id, record = decode_line_and_id(line)  # its fast case in C where built
                                episode_ids.append(episode_id)
                                yield record
                                continue
                            episode_id = episode_of(line)
                            episode_ids.append(episode_id)
                            if scope is None or episode_id in scope:
                                yield decode(line, episode_id)
                            elif decode_all:
                                decode(line, episode_id)
                        except RecordUndecodable as exc:
                            damage = type(exc), f"line {line_number}: {exc.reason}"
    finally:
        reader.cancel()
        reader.join()
    _check_whole(reader, expected, line_number, damage, episode_ids)


def _check_whole(
    reader: _ChunkReader,
    expected: RecordsCheck,
    line_number: int,
    damage: LineDamage | None,
    episode_ids: list[str],
) -> None:
    """The checks after the last line: size, digest, damaged lines, repeated episodes, count and ids."""
    if expected.size is not None and reader.size != expected.size:
        more = "more than " if reader.size > expected.size else ""
        raise expected.fail(
            RecordsSizeMismatch,
            f"records file has {more}{reader.size - (1 if more else 0)} bytes, manifest says {expected.size}",
        )
    digest = reader.hasher.hexdigest()
    if digest != expected.sha256:
        raise expected.fail(RecordsDigestMismatch, f"records file hashes to {digest}, manifest says {expected.sha256}")
    if damage is None and reader.size and reader.last_byte != b"\n":
        damage = RecordUndecodable, f"line {line_number}: the last line ends without a newline"
    if damage is not None:
        raise expected.fail(*damage)
    episode_ids.sort()
    repeated = next((earlier for earlier, later in itertools.pairwise(episode_ids) if earlier == later), None)
    if repeated is not None:
        raise expected.fail(DuplicateEpisode, f"episode {repeated!r} has more than one line")
    if line_number != expected.count:
        raise expected.fail(
            RecordCountMismatch,
            f"records file has {line_number} records, manifest says {expected.count}",
            in_manifest=True,
        )
    if expected.episode_ids is not None and tuple(episode_ids) != expected.episode_ids:
        extra = sorted(set(episode_ids) - set(expected.episode_ids))[:5]
        missing = sorted(set(expected.episode_ids) - set(episode_ids))[:5]
        raise expected.fail(
            EpisodeIdsMismatch,
            f"records hold episodes the manifest does not list ({extra}), miss listed ones ({missing}) or repeat one",
            in_manifest=True,
        )


def read_lines(
    stream: BinaryIO,
    expected: RecordsCheck,
    *,
    scope: Collection[str] | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    spans: dict[str, LineSpan] | None = None,
) -> Iterator[tuple[str, bytes]]:
    """Yield ``(episode_id, line)`` for the lines in ``scope`` (all when None), undecoded, while verifying
    the whole file as :func:`read_records` does; ``spans``, where given, gets each yielded line's
    ``(offset, length, crc32)`` in the file, its newline included in the length, not in the CRC-32
    (for :func:`~gymckpt.store.spans.read_spans`).

    For a reader that hands lines on as they are (a server's coordinator sending each worker
    its share): no record is decoded here. Each line is ``bytes`` without its newline; only its
    leading episode id is read. The digest, size, count, one line per episode, the episode ids and
    the line limit are checked after the last line, before the iterator ends, with the same typed
    errors, so a consumer must not act on the lines before the iteration finished. What lies
    past a line's episode id is the decoder's to check (:func:`~gymckpt.store.codec.decode_line`
    raises :class:`~gymckpt.errors.RecordUndecodable`). Only gymckpt's own format: a
    reference-format file (``expected.reference``) is refused with ``ValueError`` (read it with
    :func:`read_records`).
    """
    if expected.reference:
        raise ValueError("read_lines reads gymckpt's own records format; read a reference checkpoint with read_records")
    reader = _ChunkReader(stream, chunk_size, _UNBOUNDED if expected.size is None else expected.size + 1)
    reader.start()
    limit = expected.line_limit
    episode_ids: list[str] = []
    damage: LineDamage | None = None
    line_number = 0
    offset = 0  # of the next line; past damage it is no longer known, and the read fails at its end
    try:
        for lines in lines_of(reader.chunks(), limit):
            for line in lines:
                line_number += 1
                if damage is not None:
                    continue
                if line is TOO_LONG:
                    damage = too_long(line_number, limit)
                    continue
                try:
                    episode_id = episode_id_of_line(line)
                except RecordUndecodable as exc:
                    damage = type(exc), f"line {line_number}: {exc.reason}"
                    continue
                episode_ids.append(episode_id)
                length = len(line) + 1
                if scope is None or episode_id in scope:
                    if spans is not None:
                        spans[episode_id] = (offset, length, zlib.crc32(line))
                    yield episode_id, bytes(line)
                offset += length
    finally:
        reader.cancel()
        reader.join()
    _check_whole(reader, expected, line_number, damage, episode_ids)
