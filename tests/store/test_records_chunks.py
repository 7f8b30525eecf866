"""How write_records hands its chunks to a sink: a few buffers used over and over, larger chunks for large files;
and how read_records asks its stream for them: never more than the read chunk at a time.

The sink here keeps each chunk's buffer object (not a copy of it) to tell them apart, and
hashes what it was given: the file must be exactly the records' lines, whatever the chunking.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

import pytest

import gymckpt.store.records as records_module
from gymckpt.store.backend import BlobSink
from gymckpt.store.codec import encode_record
from gymckpt.store.records import read_records, write_records
from gymckpt.testing.values import sample_records
from tests.store.test_records import check_for


class ChunkSink(BlobSink):
    """Hashes the chunks it is given and notes their sizes and the buffers they were in."""

    def __init__(self) -> None:
        self.hasher = hashlib.sha256()
        self.sizes: list[int] = []
        self.buffers: list[object] = []
        self.copies: list[bytes] = []

    def write(self, chunk: bytes | memoryview) -> None:
        view = memoryview(chunk)
        self.sizes.append(view.nbytes)
        self.buffers.append(view.obj)
        self.hasher.update(view)
        self.copies.append(bytes(view[:16]))  # the start of each chunk, as it was when written

    def finish(self) -> None:
        pass

    def publish(self, name: str) -> None:
        pass

    def abort(self) -> None:
        pass


def _records(count: int, payload: int) -> list[dict[str, Any]]:
    return sample_records(count, payload=payload)


def _expected(records: list[dict[str, Any]]) -> tuple[str, list[bytes]]:
    lines = [encode_record(record)[1] for record in records]
    return hashlib.sha256(b"".join(lines)).hexdigest(), lines


def test_chunks_are_whole_lines_of_at_least_the_chunk_size_in_a_few_reused_buffers() -> None:
    records = _records(400, payload=700)
    sink = ChunkSink()
    summary = write_records(sink, records, chunk_size=4096)
    digest, lines = _expected(records)
    assert summary.sha256 == digest == sink.hasher.hexdigest()
    assert summary.size == sum(sink.sizes) == sum(map(len, lines))
    largest = max(map(len, lines))
    assert all(4096 <= size < 4096 + largest for size in sink.sizes[:-1])
    assert len(sink.sizes) > 3 * records_module._BUFFERS, "enough chunks for the buffers to come round again"
    distinct = {id(buffer) for buffer in sink.buffers}
    assert len(distinct) <= records_module._BUFFERS
    # each chunk starts with a line: the buffers were refilled from their start
    starts = {line[:16] for line in lines}
    assert all(start in starts for start in sink.copies)


def test_a_large_file_goes_on_in_larger_chunks_in_the_same_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records_module, "_LARGE_FILE", 64 * 1024)
    records = _records(600, payload=900)
    sink = ChunkSink()
    chunk = 1024
    summary = write_records(sink, records, chunk_size=chunk)
    digest, lines = _expected(records)
    assert summary.sha256 == digest == sink.hasher.hexdigest()
    assert summary.count == len(records)
    large = chunk * records_module._BUFFERS // records_module._LARGE_BUFFERS
    # small chunks until 64 KiB were handed over, larger ones after
    handed, switched_at = 0, None
    for index, size in enumerate(sink.sizes):
        if handed >= 64 * 1024:
            switched_at = index
            break
        handed += size
    assert switched_at is not None and switched_at >= 16
    largest = max(map(len, lines))
    assert all(chunk <= size < chunk + largest for size in sink.sizes[: switched_at - 1])
    assert all(size >= large for size in sink.sizes[switched_at:-1])
    assert len(sink.sizes) - switched_at > 10
    # after the switch, no more than _LARGE_BUFFERS buffers take turns (the others were let go)
    late = {id(buffer) for buffer in sink.buffers[switched_at + records_module._BUFFERS :]}
    assert len(late) <= records_module._LARGE_BUFFERS


def test_small_files_keep_their_chunk_size() -> None:
    records = _records(200, payload=300)
    sink = ChunkSink()
    write_records(sink, records, chunk_size=2048)
    largest = max(len(encode_record(record)[1]) for record in records)
    assert all(2048 <= size < 2048 + largest for size in sink.sizes[:-1])


def test_chunks_grow_with_the_file_from_a_small_first_one() -> None:
    """At the default chunk size a file of a few megabytes is not held in a few whole-file chunks: its
    first chunk is small and each later one an eighth of what was written, so the buffers stay below it."""
    records = _records(3_000, payload=1_000)
    sink = ChunkSink()
    summary = write_records(sink, records)
    digest, lines = _expected(records)
    assert summary.sha256 == digest == sink.hasher.hexdigest()
    assert summary.size == sum(sink.sizes) == sum(map(len, lines))
    largest = max(map(len, lines))
    assert sink.sizes[0] < records_module._FIRST_CHUNK + largest
    handed = 0
    for size in sink.sizes[:-1]:
        target = min(records_module.DEFAULT_CHUNK_SIZE, max(records_module._FIRST_CHUNK, handed // 8))
        assert target <= size < target + largest, (handed, size)
        handed += size
    assert len(sink.sizes) > 8
    # every buffer the write may keep, each as large as its largest chunk: still less than the file
    assert records_module._BUFFERS * max(sink.sizes) < summary.size


MIB = 1 << 20


class KeepingSink(ChunkSink):
    """A sink that keeps the chunks it is given, as the S3 backend's does for a file sent in one PUT."""

    keeps_chunks = True

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[memoryview] = []

    def write(self, chunk: bytes | memoryview) -> None:
        super().write(chunk)
        self.kept.append(memoryview(chunk))


def test_a_sink_that_keeps_its_chunks_gets_each_in_a_buffer_never_filled_again() -> None:
    records = _records(3_000, payload=1_000)
    sink = KeepingSink()
    summary = write_records(sink, records)
    digest, lines = _expected(records)
    assert summary.sha256 == digest == sink.hasher.hexdigest()
    assert len(sink.kept) > records_module._BUFFERS  # more chunks than a write's buffers: none was reused
    assert len({id(buffer) for buffer in sink.buffers}) == len(sink.kept)
    # what the sink holds after the write is still exactly the file, chunk by chunk
    assert [bytes(view[:16]) for view in sink.kept] == sink.copies
    assert b"".join(sink.kept) == b"".join(lines)


class WrappingSink:
    """A sink of its own shape, not a BlobSink (as a test's or a user's wrapper may be): it copies."""

    def __init__(self) -> None:
        self.inner = ChunkSink()
        self.data = bytearray()

    def write(self, chunk: bytes | memoryview) -> None:
        self.inner.write(chunk)
        self.data += chunk


def test_a_sink_that_is_no_blob_sink_gets_the_reused_buffers_and_the_whole_file() -> None:
    records = _records(3_000, payload=1_000)
    sink = WrappingSink()
    summary = write_records(sink, records)  # type: ignore[arg-type]
    digest, lines = _expected(records)
    assert summary.sha256 == digest == sink.inner.hasher.hexdigest()
    assert bytes(sink.data) == b"".join(lines)
    assert len({id(buffer) for buffer in sink.inner.buffers}) <= records_module._BUFFERS


class CountingStream(io.BytesIO):
    """A records file in memory that notes how much each read asked for."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.asked: list[int] = []

    def read(self, size: int | None = -1) -> bytes:
        self.asked.append(-1 if size is None else size)
        return super().read(size)


def test_reads_ask_for_no_more_than_the_read_chunk_whatever_the_chunk_size() -> None:
    """The read-ahead queue is always full (decoding is the slower side): its chunks are what a
    restore holds beyond its records, so they stay small even where writes use large ones."""
    records = _records(3_000, payload=1_000)
    sink = ChunkSink()
    summary = write_records(sink, records)
    digest, lines = _expected(records)
    data = b"".join(lines)
    assert len(data) > 2 * MIB
    stream = CountingStream(data)
    assert summary.sha256 == digest
    read = list(read_records(stream, check_for(summary), chunk_size=16 << 20))
    assert [encode_record(record)[1] for record in read] == lines
    # a mebibyte a read at most (the queue ahead of the decoder holds a few), however large chunk_size is
    assert max(stream.asked) <= MIB
    assert len(stream.asked) >= len(data) // MIB
