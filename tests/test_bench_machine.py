"""benchmarks.machine.write_fsync_seconds: the machine's own write and fsync of a commit's bytes, beside it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks import machine, primitives


@pytest.mark.parametrize("size", [0, 1, (4 << 20) - 1, (4 << 20) + 12_345])
def test_it_writes_exactly_the_bytes_fsyncs_them_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:  # the real fsync, after noting how long the file was then
        synced.append(os.fstat(fd).st_size)
        real_fsync(fd)

    monkeypatch.setattr(primitives.os, "fsync", fsync)
    seconds = machine.write_fsync_seconds(tmp_path, size)
    assert synced == [size]
    assert seconds > 0
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_still_removes_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(path: str, lines: list[bytes]) -> None:  # the file made and partly written, then the disk full
        with open(path, "wb") as stream:
            stream.write(lines[0][:100])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(primitives, "write_fsync", full)
    with pytest.raises(OSError, match="No space left"):
        machine.write_fsync_seconds(tmp_path, 1 << 20)
    assert list(tmp_path.iterdir()) == []
