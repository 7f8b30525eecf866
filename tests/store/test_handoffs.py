"""While records are written the GIL switch interval is short; afterwards it is what it was."""

from __future__ import annotations

import sys
import threading

import pytest

from gymckpt.store.handoffs import SWITCH_INTERVAL, quick_handoffs
from gymckpt.store.records import write_records
from gymckpt.testing.values import sample_records

from .test_records_chunks import ChunkSink


@pytest.fixture(autouse=True)
def default_interval():
    """Each test starts at the interpreter's default and leaves it so."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


class IntervalSink(ChunkSink):
    """Notes the switch interval each chunk was written under (in the writer thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.intervals: list[float] = []

    def write(self, chunk: bytes | memoryview) -> None:
        self.intervals.append(sys.getswitchinterval())
        super().write(chunk)


def test_chunks_are_written_under_the_short_interval_and_the_old_one_comes_back() -> None:
    sink = IntervalSink()
    summary = write_records(sink, sample_records(200, payload=300), chunk_size=4096)
    assert summary.count == 200
    assert len(sink.intervals) > 5
    assert set(sink.intervals) == {SWITCH_INTERVAL}
    assert sys.getswitchinterval() == 0.005


def test_a_failing_write_puts_the_interval_back_too() -> None:
    with pytest.raises(Exception, match="appears twice"):
        write_records(IntervalSink(), [*sample_records(3), *sample_records(1)], chunk_size=64)
    assert sys.getswitchinterval() == 0.005


def test_overlapping_writes_restore_it_when_the_last_one_ends() -> None:
    first_in = threading.Event()
    release = threading.Event()

    def long_write() -> None:
        with quick_handoffs():
            first_in.set()
            release.wait(30)

    thread = threading.Thread(target=long_write)
    thread.start()
    assert first_in.wait(30)
    with quick_handoffs():
        assert sys.getswitchinterval() == SWITCH_INTERVAL
    assert sys.getswitchinterval() == SWITCH_INTERVAL, "the other write still runs"
    release.set()
    thread.join(30)
    assert sys.getswitchinterval() == 0.005


def test_an_interval_set_meanwhile_or_already_shorter_is_left_alone() -> None:
    with quick_handoffs():
        sys.setswitchinterval(0.002)  # the application decided otherwise during the write
    assert sys.getswitchinterval() == 0.002
    sys.setswitchinterval(0.0001)
    shorter = sys.getswitchinterval()  # kept in microseconds: read back as the interpreter has it
    with quick_handoffs():
        assert sys.getswitchinterval() == shorter
    assert sys.getswitchinterval() == shorter
