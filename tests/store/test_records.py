"""Streaming records files (gymckpt.store.records): write_records / read_records and the store
paths built on them: chunking, scope, damage detection, bounded memory, threads and errors."""

from __future__ import annotations

import gc
import hashlib
import io
import os
import threading
import tracemalloc
from typing import TYPE_CHECKING, Any

import pytest

import gymckpt.store.records as records_module
from gymckpt import errors
from gymckpt.store import CheckpointStore
from gymckpt.store._local import TEMP_PREFIX, LocalBackend
from gymckpt.store._memory import MemoryBackend, clear_memory_stores
from gymckpt.store.backend import BlobSink
from gymckpt.store.codec import decode_line, decode_record, encode_record
from gymckpt.store.records import DEFAULT_CHUNK_SIZE, RecordsCheck, RecordsSummary, read_records, write_records
from gymckpt.testing.values import assert_identical, sample_records

from ..support import REPO

if TYPE_CHECKING:
    from collections.abc import Iterator

READER_THREAD = "gymckpt-records-reader"
WRITER_THREAD = "gymckpt-records-writer"


# --- helpers


def dataset() -> list[dict[str, Any]]:
    """Records with the hard values plus lines much longer than the small chunk sizes."""
    records = sample_records(12, payload=40)
    records.append({"episode_id": "long-ascii", "text": "x" * 3000, "n": 1})
    records.append({"episode_id": 'long-unicode "quoted" é', "text": "é🙂\n" * 700, "nan": float("nan")})
    records.append({"episode_id": "big-int", "v": [2**64, -(2**63) - 1, -0.0, float("-inf")]})
    return records


@pytest.fixture
def memory() -> Iterator[MemoryBackend]:
    clear_memory_stores()
    yield MemoryBackend("memory://records-tests")
    clear_memory_stores()


def write_to(
    backend: MemoryBackend, records: Any, *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[bytes, RecordsSummary]:
    sink = backend.open_sink("d")
    summary = write_records(sink, records, chunk_size=chunk_size)
    sink.finish()
    sink.publish("records.jsonl")
    return backend.read_bytes("d/records.jsonl"), summary


def check_for(summary: RecordsSummary) -> RecordsCheck:
    return RecordsCheck(
        path="d/records.jsonl",
        participant="agent/a0",
        manifest_path="d/manifest.json",
        sha256=summary.sha256,
        size=summary.size,
        count=summary.count,
        episode_ids=tuple(sorted(summary.episode_ids)),
    )


def live_threads(name: str) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == name and thread.is_alive()]


def files_under(root: str) -> list[str]:
    found = []
    for directory, _, names in os.walk(root):
        found.extend(os.path.relpath(os.path.join(directory, name), root) for name in names)
    return sorted(found)


# --- round trips across chunk sizes


CHUNK_SIZES = [1, 7, 64, 4096, DEFAULT_CHUNK_SIZE]


@pytest.mark.parametrize(
    ("write_chunk", "read_chunk"),
    [*((size, size) for size in CHUNK_SIZES), (1, 4096), (DEFAULT_CHUNK_SIZE, 7), (64, 1)],
)
def test_records_round_trip_across_chunk_sizes(memory: MemoryBackend, write_chunk: int, read_chunk: int) -> None:
    records = dataset()
    data, summary = write_to(memory, iter(records), chunk_size=write_chunk)

    assert data == b"".join(encode_record(record)[1] for record in records)
    assert summary.sha256 == hashlib.sha256(data).hexdigest()
    assert summary.size == len(data)
    assert summary.count == len(records) == data.count(b"\n")
    assert summary.episode_ids == [record["episode_id"] for record in records]
    assert max(len(line) for line in data.split(b"\n")) > 64 * 40  # lines span many small chunks

    restored = list(read_records(io.BytesIO(data), check_for(summary), chunk_size=read_chunk))
    assert len(restored) == len(records)
    for expected, actual in zip(records, restored, strict=True):
        assert_identical(expected, actual)


def test_no_records_give_an_empty_file_that_reads_back_empty(memory: MemoryBackend) -> None:
    data, summary = write_to(memory, iter(()))
    assert data == b""
    assert (summary.sha256, summary.size, summary.count, summary.episode_ids) == (
        hashlib.sha256(b"").hexdigest(),
        0,
        0,
        [],
    )
    assert list(read_records(io.BytesIO(data), check_for(summary))) == []


@pytest.mark.parametrize("store_kind", ["local", "memory"])
def test_store_round_trip_with_small_chunks(tmp_path, store_kind: str) -> None:
    clear_memory_stores()
    backend = LocalBackend(str(tmp_path)) if store_kind == "local" else MemoryBackend("memory://round-trip")
    store = CheckpointStore(backend, chunk_size=7)
    records = dataset()
    store.write_participant("ck", kind="agent", instance="a0", checkpoint_id="c", records=iter(records))
    restored = list(store.read_participant("ck", kind="agent", instance="a0"))
    assert len(restored) == len(records)
    for expected, actual in zip(records, restored, strict=True):
        assert_identical(expected, actual)


# --- scope


@pytest.mark.parametrize("chunk_size", [7, 64, DEFAULT_CHUNK_SIZE])
def test_scope_selects_only_those_ids_and_decodes_only_them(
    memory: MemoryBackend, monkeypatch: pytest.MonkeyPatch, chunk_size: int
) -> None:
    records = dataset()
    data, summary = write_to(memory, iter(records), chunk_size=chunk_size)
    decoded: list[str] = []

    def counting_decode_record(line: bytes | memoryview, episode_id: str) -> dict[str, Any]:
        record = decode_record(line, episode_id)
        decoded.append(record["episode_id"])
        return record

    monkeypatch.setattr(records_module, "decode_record", counting_decode_record)
    scope = {"r3", 'long-unicode "quoted" é', "big-int", "not-in-the-file"}
    selected = list(read_records(io.BytesIO(data), check_for(summary), scope=scope, chunk_size=chunk_size))

    wanted = [record for record in records if record["episode_id"] in scope]
    assert [record["episode_id"] for record in selected] == [record["episode_id"] for record in wanted]
    for expected, actual in zip(wanted, selected, strict=True):
        assert_identical(expected, actual)
    assert sorted(decoded) == sorted(record["episode_id"] for record in wanted)  # nothing out of scope decoded

    decoded.clear()
    assert list(read_records(io.BytesIO(data), check_for(summary), scope=())) == []
    assert decoded == []
    assert list(read_records(io.BytesIO(data), check_for(summary), scope=(), decode_all=True)) == []
    assert len(decoded) == len(records)


def test_store_scope_selects_only_those_ids(tmp_path) -> None:
    store = CheckpointStore(LocalBackend(str(tmp_path)), chunk_size=64)
    records = sample_records(40)
    store.write_participant("ck", kind="agent", instance="a0", checkpoint_id="c", records=iter(records))
    scoped = list(store.read_participant("ck", kind="agent", instance="a0", scope=["r7", "r3", "r39", "zz"]))
    assert [record["episode_id"] for record in scoped] == ["r3", "r7", "r39"]  # file order
    for expected, actual in zip([records[3], records[7], records[39]], scoped, strict=True):
        assert_identical(expected, actual)


@pytest.mark.parametrize("chunk_size", [7, 4096])
def test_a_flipped_byte_in_an_out_of_scope_line_is_still_detected(memory: MemoryBackend, chunk_size: int) -> None:
    records = dataset()
    data, summary = write_to(memory, iter(records), chunk_size=chunk_size)
    lines = data.split(b"\n")
    target = next(index for index, record in enumerate(records) if record["episode_id"] == "long-ascii")
    assert lines[target].count(b"xxxx") > 0
    lines[target] = lines[target].replace(b"xxxx", b"xxyx", 1)  # same size, still valid JSON
    damaged = b"\n".join(lines)
    assert len(damaged) == len(data) and damaged != data

    seen: list[str] = []
    with pytest.raises(errors.RecordsDigestMismatch) as raised:
        for record in read_records(io.BytesIO(damaged), check_for(summary), scope={"r1", "r2"}, chunk_size=chunk_size):
            seen.append(record["episode_id"])
    assert seen == ["r1", "r2"]  # the scoped records came, the damage is raised before the iterator ends
    assert raised.value.path == "d/records.jsonl"
    assert raised.value.participant == "agent/a0"


def test_an_undecodable_out_of_scope_line_is_found_when_decoding_all(memory: MemoryBackend) -> None:
    """A buggy writer's line (its digest consistent) is caught by decode_all, which verify uses."""
    bad = b'{"episode_id":"bad", not json}\n'
    good = encode_record({"episode_id": "good", "v": 1})[1]
    data = good + bad
    check = RecordsCheck(
        path="d/records.jsonl",
        participant="agent/a0",
        manifest_path="d/manifest.json",
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        count=2,
        episode_ids=("bad", "good"),
    )
    with pytest.raises(errors.RecordUndecodable) as raised:
        list(read_records(io.BytesIO(data), check, scope=(), decode_all=True))
    assert "line 2" in str(raised.value)


# --- invalid input aborts the commit


@pytest.mark.parametrize("store_kind", ["local", "memory"])
def test_a_duplicate_episode_id_is_invalid_and_nothing_is_published(tmp_path, store_kind: str) -> None:
    clear_memory_stores()
    backend = LocalBackend(str(tmp_path / "store")) if store_kind == "local" else MemoryBackend("memory://dup")
    store = CheckpointStore(backend, chunk_size=64)
    records = [*sample_records(5), {"episode_id": "r2", "again": True}, *sample_records(3, prefix="s")]
    with pytest.raises(errors.InvalidRecord) as raised:
        store.write_participant("ck", kind="agent", instance="a0", checkpoint_id="c", records=iter(records))
    assert "r2" in str(raised.value)
    assert list(backend.walk_files("")) == []
    with pytest.raises(errors.ParticipantNotFound):
        store.read_manifest("ck", kind="agent", instance="a0")
    assert live_threads(WRITER_THREAD) == []


def test_an_error_raised_by_the_records_generator_aborts_the_commit(tmp_path) -> None:
    root = tmp_path / "store"
    store = CheckpointStore(LocalBackend(str(root)), chunk_size=256)

    class GeneratorBroke(RuntimeError):
        pass

    produced = []

    def records() -> Iterator[dict[str, Any]]:
        for record in sample_records(200):
            if len(produced) == 120:
                raise GeneratorBroke("the environment server died mid-capture")
            produced.append(record["episode_id"])
            yield record

    with pytest.raises(GeneratorBroke):
        store.write_participant("ck", kind="environment", instance="e0", checkpoint_id="c", records=records())
    assert len(produced) == 120
    leftovers = files_under(str(root))
    assert not [path for path in leftovers if os.path.basename(path).startswith(TEMP_PREFIX)], leftovers
    assert not [path for path in leftovers if path.endswith("manifest.json")], leftovers
    assert leftovers == []
    assert live_threads(WRITER_THREAD) == []


# --- the writer thread's errors


class SinkBroke(OSError):
    pass


class BreakingSink(BlobSink):
    """A sink whose ``write`` raises on its ``fail_on``-th call (counting from 1)."""

    def __init__(self, fail_on: int = 3, inner: BlobSink | None = None) -> None:
        self.fail_on = fail_on
        self.inner = inner
        self.calls = 0
        self.written: list[bytes] = []
        self.aborted = False
        self.error = SinkBroke(28, "No space left on device")

    def write(self, chunk: bytes | memoryview) -> None:
        self.calls += 1
        if self.calls == self.fail_on:
            raise self.error
        self.written.append(bytes(chunk))
        if self.inner is not None:
            self.inner.write(chunk)

    def finish(self) -> None:
        if self.inner is not None:
            self.inner.finish()

    def publish(self, name: str) -> None:
        if self.inner is not None:
            self.inner.publish(name)

    def abort(self) -> None:
        self.aborted = True
        if self.inner is not None:
            self.inner.abort()


def test_a_sink_error_surfaces_as_that_error_without_deadlock() -> None:
    sink = BreakingSink(fail_on=3)
    consumed: list[str] = []
    outcome: dict[str, object] = {}

    def records() -> Iterator[dict[str, Any]]:
        for index in range(5000):
            consumed.append(f"e{index}")
            yield {"episode_id": f"e{index}", "payload": "p" * 50}

    def produce() -> None:
        try:
            outcome["summary"] = write_records(sink, records(), chunk_size=1)  # one record per batch
        except BaseException as exc:
            outcome["error"] = exc

    producer = threading.Thread(target=produce, name="test-producer")
    producer.start()
    producer.join(timeout=60)
    assert not producer.is_alive(), "write_records deadlocked after the sink failed"
    assert outcome.get("error") is sink.error
    assert "summary" not in outcome
    # the producer stops soon: at most the failed batch, the queued ones and the one in hand
    assert len(consumed) <= 3 + records_module._QUEUE_DEPTH + 2, len(consumed)
    assert len(sink.written) == 2
    assert live_threads(WRITER_THREAD) == []


def test_a_sink_error_on_the_last_batch_surfaces_too() -> None:
    sink = BreakingSink(fail_on=1)
    with pytest.raises(SinkBroke) as raised:
        write_records(sink, iter(sample_records(3)))  # everything fits in the one final batch
    assert raised.value is sink.error
    assert live_threads(WRITER_THREAD) == []


def test_a_sink_error_aborts_the_commit_and_publishes_nothing(memory: MemoryBackend) -> None:
    class BreakingBackend(MemoryBackend):
        def __init__(self, url: str) -> None:
            super().__init__(url)
            self.sinks: list[BreakingSink] = []

        def open_sink(self, directory: str) -> BlobSink:
            sink = BreakingSink(fail_on=3, inner=super().open_sink(directory))
            self.sinks.append(sink)
            return sink

    backend = BreakingBackend("memory://records-tests")
    store = CheckpointStore(backend, chunk_size=64)
    with pytest.raises(SinkBroke):
        store.write_participant("ck", kind="agent", instance="a0", checkpoint_id="c", records=iter(sample_records(50)))
    assert [sink.aborted for sink in backend.sinks] == [True]
    assert list(backend.walk_files("")) == []


# --- threads end when the consumer stops early


def _committed(tmp_path, count: int = 300) -> CheckpointStore:
    store = CheckpointStore(LocalBackend(str(tmp_path)), chunk_size=64)  # many chunks: the reader stays ahead
    store.write_participant("ck", kind="agent", instance="a0", checkpoint_id="c", records=iter(sample_records(count)))
    return store


def test_closing_an_unfinished_reader_ends_its_thread(tmp_path) -> None:
    store = _committed(tmp_path)
    before = set(live_threads(READER_THREAD))
    iterator = store.read_participant("ck", kind="agent", instance="a0")
    first = next(iterator)
    assert first["episode_id"] == "r0"
    readers = [thread for thread in live_threads(READER_THREAD) if thread not in before]
    assert len(readers) == 1  # blocked on its full queue, far from the end of the file
    iterator.close()
    readers[0].join(timeout=10)
    assert not readers[0].is_alive()
    assert set(live_threads(READER_THREAD)) <= before
    assert gc.isenabled()


def test_breaking_out_of_a_for_loop_ends_the_reader_thread(tmp_path) -> None:
    store = _committed(tmp_path)
    before = set(live_threads(READER_THREAD))
    readers: list[threading.Thread] = []
    taken = []
    for record in store.read_participant("ck", kind="agent", instance="a0", scope=None):
        taken.append(record["episode_id"])
        readers = [thread for thread in live_threads(READER_THREAD) if thread not in before]
        if len(taken) == 5:
            break
    assert taken == ["r0", "r1", "r2", "r3", "r4"]
    assert len(readers) == 1
    readers[0].join(timeout=10)  # the abandoned generator was closed when the loop dropped it
    assert not readers[0].is_alive()
    assert set(live_threads(READER_THREAD)) <= before
    assert gc.isenabled()


_GENERATIONS_PROGRAM = """
import gc, sys, weakref
from gymckpt.store import open_store
from gymckpt.testing.values import sample_records

class Node:
    pass

store = open_store(sys.argv[1])
store.write_participant("ck", kind="agent", instance="a0", checkpoint_id="c", records=iter(sample_records(3000)))
if sys.argv[2] == "frozen":
    kept = [[index] for index in range(1000)]
    gc.freeze()
frozen = gc.get_freeze_count()
records, garbage = [], None
for record in store.read_participant("ck", kind="agent", instance="a0"):
    records.append(record)
    if garbage is None:  # a reference cycle dropped while the GC is paused
        node = Node()
        node.self = node
        garbage = weakref.ref(node)
        del node
oldest = {id(item) for item in gc.get_objects(generation=2)}
print(sum(id(record) in oldest for record in records), len(records), gc.isenabled(), gc.get_freeze_count() - frozen)
gc.collect()
print(garbage() is None)
"""


@pytest.mark.parametrize("application", ["plain", "frozen"])
def test_a_large_read_moves_its_records_to_the_oldest_generation_unless_the_application_froze_objects(
    tmp_path, application: str
) -> None:
    """Many records read: the GC resumes with them in its oldest generation, not collected on the way.

    An application that froze objects keeps them frozen (the records then go the usual way),
    and a cycle dropped during the read is still collected.
    """
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _GENERATIONS_PROGRAM, str(tmp_path / "store"), application],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))},
    )
    assert done.returncode == 0, done.stderr
    promoted, count, enabled, newly_frozen = done.stdout.split("\n")[0].split()
    assert (int(count), enabled, int(newly_frozen)) == (3000, "True", 0)
    assert int(promoted) == (3000 if application == "plain" else 0)
    assert done.stdout.split("\n")[1] == "True"


def test_a_finished_read_leaves_no_thread(tmp_path) -> None:
    store = _committed(tmp_path, count=50)
    before = set(live_threads(READER_THREAD)) | set(live_threads(WRITER_THREAD))
    assert len(list(store.read_participant("ck", kind="agent", instance="a0"))) == 50
    assert set(live_threads(READER_THREAD)) | set(live_threads(WRITER_THREAD)) <= before


# --- memory stays bounded


RECORD_CHARS = 1_000_000
RECORD_COUNT = 200
CHUNK = 1 << 20
MARGIN = 4 << 20  # interpreter noise: frames, small objects, the manifest, file buffers


def big_records(count: int = RECORD_COUNT) -> Iterator[dict[str, Any]]:
    for index in range(count):
        yield {"episode_id": f"ep-{index:04d}", "blob": chr(0x61 + index % 26) * RECORD_CHARS}


def traced_peak(action: Any) -> int:
    """Peak traced bytes above what was traced when ``action`` started (tracemalloc running)."""
    start = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    action()
    return tracemalloc.get_traced_memory()[1] - start


def pipeline_bound(line_size: int, codec_cost: int) -> int:
    """What the two-stage pipeline may hold, independent of the record count.

    _QUEUE_DEPTH batches queued between the threads, the batch each thread has in hand plus one
    copy of it (the writer's ``b"".join``; the reader's next ``read``), each batch at most
    CHUNK plus one line (it is flushed once it reaches CHUNK); on top of that the record being
    handled, one more line (a line being joined or copied) and what the codec itself needs to
    encode or decode one record, measured in isolation (orjson reserves several times a long
    string's size while it works) rather than assumed.
    """
    slots = records_module._QUEUE_DEPTH + 3
    return slots * (CHUNK + line_size) + RECORD_CHARS + line_size + codec_cost + MARGIN


def _codec_costs() -> tuple[int, int, int]:
    sample = next(big_records(1))
    _, line = encode_record(sample)  # warm up
    held: dict[str, Any] = {}
    encode_cost = traced_peak(lambda: held.update(line=encode_record(sample)[1]))
    held.clear()
    decode_cost = traced_peak(lambda: held.update(record=decode_line(line)))
    return len(line), encode_cost, decode_cost


@pytest.mark.slow
def test_writing_holds_a_few_chunks_not_the_records(tmp_path, tracing: None) -> None:
    line_size, encode_cost, _ = _codec_costs()
    store = CheckpointStore(LocalBackend(str(tmp_path)), chunk_size=CHUNK)
    manifests = []
    peak = traced_peak(
        lambda: manifests.append(
            store.write_participant("ck", kind="agent", instance="a0", checkpoint_id="c", records=big_records())
        )
    )
    assert manifests[0].record_count == RECORD_COUNT
    assert manifests[0].records_bytes == RECORD_COUNT * line_size
    bound = pipeline_bound(line_size, encode_cost)
    assert peak < bound, (
        f"writing {RECORD_COUNT} records of {line_size:,} bytes peaked at {peak:,} traced bytes; "
        f"bound {bound:,} ({records_module._QUEUE_DEPTH + 3} x (chunk + line) + record + one encode "
        f"({encode_cost:,}) + margin)"
    )


@pytest.mark.slow
def test_reading_holds_a_few_chunks_not_the_records(tmp_path, tracing: None) -> None:
    line_size, _, decode_cost = _codec_costs()
    store = CheckpointStore(LocalBackend(str(tmp_path)), chunk_size=CHUNK)
    tracemalloc.stop()
    store.write_participant("ck", kind="agent", instance="a0", checkpoint_id="c", records=big_records())
    tracemalloc.start()
    seen = []

    def read_and_discard() -> None:
        for record in store.read_participant("ck", kind="agent", instance="a0"):
            seen.append(len(record["blob"]))

    peak = traced_peak(read_and_discard)
    assert seen == [RECORD_CHARS] * RECORD_COUNT
    bound = pipeline_bound(line_size, decode_cost)
    assert peak < bound, (
        f"reading {RECORD_COUNT} records of {line_size:,} bytes peaked at {peak:,} traced bytes; "
        f"bound {bound:,} ({records_module._QUEUE_DEPTH + 3} x (chunk + line) + record + one decode "
        f"({decode_cost:,}) + margin)"
    )
