"""The local sink starts each chunk's writeback as it writes it (Linux's sync_file_range), and still fsyncs.

sync_file_range is only a head start for the final fsync, which stays what makes a records
file durable: these tests watch the real calls (wrapped, never replaced) on real files.
"""

from __future__ import annotations

import itertools
import os
import sys
from typing import Any

import pytest

from gymckpt.store import CheckpointStore
from gymckpt.store import _local as local_module
from gymckpt.store._local import LocalBackend
from gymckpt.store.capabilities import find_writeback
from gymckpt.testing.values import assert_identical, sample_records

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")


@linux_only
def test_sync_file_range_is_found_on_linux_and_works_on_a_real_file(tmp_path) -> None:
    start = find_writeback()
    assert start is not None
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"x" * 10_000)
        assert start(fd, 0, 10_000) == 0
        assert start(-1, 0, 1) == -1  # a bad descriptor is an error it reports, not raises
    finally:
        os.close(fd)


def _watch(monkeypatch: pytest.MonkeyPatch, *, result: int | None = None) -> list[tuple[Any, ...]]:
    """Record every writeback start and every fsync, in order; the real calls still run."""
    events: list[tuple[Any, ...]] = []
    real_start = local_module._START_WRITEBACK
    real_fsync = os.fsync

    def start(fd: int, offset: int, count: int) -> object:
        events.append(("writeback", fd, offset, count))
        done = real_start(fd, offset, count) if real_start is not None else 0
        return done if result is None else result

    def fsync(fd: int) -> None:
        events.append(("fsync", fd))
        real_fsync(fd)

    monkeypatch.setattr(local_module, "_START_WRITEBACK", start)
    monkeypatch.setattr(os, "fsync", fsync)
    return events


def _commit(tmp_path, chunk_size: int) -> tuple[CheckpointStore, Any, list[dict[str, Any]]]:
    store = CheckpointStore(LocalBackend(str(tmp_path / "store")), chunk_size=chunk_size)
    records = sample_records(60, payload=2000)
    manifest = store.write_participant("ck", kind="agent", instance="a0", checkpoint_id="c", records=records)
    return store, manifest, records


def test_every_chunk_is_handed_to_writeback_in_order_then_the_file_is_fsynced(tmp_path, monkeypatch) -> None:
    events = _watch(monkeypatch)
    store, manifest, records = _commit(tmp_path, chunk_size=8192)
    ranges = [event for event in events if event[0] == "writeback"]
    assert len(ranges) > 5, "several chunks, each started"
    fd = ranges[0][1]
    assert {event[1] for event in ranges} == {fd}, "one records file"
    # contiguous, from the start of the file to its end
    offsets = [(offset, count) for _, _, offset, count in ranges]
    assert offsets[0][0] == 0
    assert all(later[0] == earlier[0] + earlier[1] for earlier, later in itertools.pairwise(offsets))
    assert offsets[-1][0] + offsets[-1][1] == manifest.records_bytes
    # the records file's own fsync comes after its last chunk's writeback
    last_writeback = events.index(ranges[-1])
    assert ("fsync", fd) in events[last_writeback + 1 :]
    restored = list(store.read_participant("ck", kind="agent", instance="a0"))
    for expected, actual in zip(records, restored, strict=True):
        assert_identical(expected, actual)


def test_a_writeback_that_fails_changes_nothing(tmp_path, monkeypatch) -> None:
    """sync_file_range refused (a filesystem without it): the commit goes on, fsynced as ever."""
    events = _watch(monkeypatch, result=-1)
    store, manifest, records = _commit(tmp_path, chunk_size=8192)
    assert any(event[0] == "writeback" for event in events)
    writeback_fd = next(event[1] for event in events if event[0] == "writeback")
    assert ("fsync", writeback_fd) in events
    assert manifest.record_count == len(records)
    assert len(list(store.read_participant("ck", kind="agent", instance="a0"))) == len(records)


def test_without_writeback_the_sink_writes_and_fsyncs_as_before(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(local_module, "_START_WRITEBACK", None)
    store, manifest, records = _commit(tmp_path, chunk_size=8192)
    restored = list(store.read_participant("ck", kind="agent", instance="a0"))
    assert manifest.record_count == len(restored) == len(records)
