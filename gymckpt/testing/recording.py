"""Watching what the layer under test touches: a recording backend, and inotify over a directory."""

from __future__ import annotations

import ctypes
import io
import os
import struct
import threading
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from gymckpt.store.backend import StorageBackend

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import BinaryIO

    from gymckpt.store.backend import BlobSink, EntryKind

__all__ = ["OutsideWatch", "RecordingBackend"]


class _CountingStream(io.RawIOBase):
    """A read stream that adds what it hands out to its backend's count."""

    def __init__(self, inner: BinaryIO, count: Callable[[int], None]) -> None:
        super().__init__()
        self._inner = inner
        self._count = count

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        data = self._inner.read(-1 if size is None else size)
        self._count(len(data))
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._inner.close()
        super().close()


class RecordingBackend(StorageBackend):
    """Passes every call to ``inner`` and records what was read, listed and written, and how much.

    ``size_override`` makes :meth:`size` report other sizes (a file that grows after it was measured).
    """

    def __init__(self, inner: StorageBackend, size_override: dict[str, int] | None = None) -> None:
        self.inner = inner
        self.url = inner.url
        self.size_override = dict(size_override or {})
        self.reads: list[str] = []
        self.writes: list[str] = []
        #: the most bytes a single read of each path took
        self.bytes_read: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    @property
    def supports_directory_fsync(self) -> bool:
        return self.inner.supports_directory_fsync

    @property
    def supports_conditional_create(self) -> bool:
        return self.inner.supports_conditional_create

    def _read(self, path: str) -> None:
        with self._lock:
            self.reads.append(path)

    def _count(self, path: str) -> Callable[[int], None]:
        """Counts one stream; ``bytes_read`` keeps the most any one read of ``path`` took."""
        taken = 0

        def count(size: int) -> None:
            nonlocal taken
            taken += size
            with self._lock:
                self.bytes_read[path] = max(self.bytes_read[path], taken)

        return count

    def open_sink(self, directory: str) -> BlobSink:
        self.writes.append(directory)
        return self.inner.open_sink(directory)

    def open_read(self, path: str) -> BinaryIO:
        self._read(path)
        return _CountingStream(self.inner.open_read(path), self._count(path))  # type: ignore[return-value]

    def read_bytes(self, path: str) -> bytes:
        with self.open_read(path) as stream:
            return stream.read()

    def create_if_absent(self, path: str, data: bytes) -> bool:
        self.writes.append(path)
        return self.inner.create_if_absent(path, data)

    def replace(self, path: str, data: bytes) -> None:
        self.writes.append(path)
        self.inner.replace(path, data)

    def exists(self, path: str) -> bool:
        self._read(path)
        return self.inner.exists(path)

    def list_dir(self, path: str) -> list[str]:
        self._read(path)
        return self.inner.list_dir(path)

    def delete(self, path: str) -> None:
        self.writes.append(path)
        self.inner.delete(path)

    def sync_directories(self, path: str, up_to: str = "") -> None:
        self.writes.append(path)
        self.inner.sync_directories(path, up_to)

    def size(self, path: str) -> int:
        self._read(path)
        if path in self.size_override:
            return self.size_override[path]
        return self.inner.size(path)

    def walk_files(self, path: str = "") -> Iterator[str]:
        self._read(path)
        return self.inner.walk_files(path)

    def walk_entries(self, path: str = "") -> Iterator[tuple[str, EntryKind]]:
        self._read(path)
        return self.inner.walk_entries(path)


class OutsideWatch:
    """Linux inotify over a directory tree: whatever opens, reads, writes or creates there is seen.

    The kernel queues an event when the call is made, so reading them afterwards needs no wait.
    """

    _MASK = 0x1 | 0x2 | 0x4 | 0x20 | 0x40 | 0x80 | 0x100 | 0x200  # access modify attrib open moved create delete

    def __init__(self, root: str) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self.watches: dict[int, str] = {}
        directories = [directory for directory, _, _ in os.walk(root)]  # listed before watching: not an event
        for directory in directories:
            descriptor = self._libc.inotify_add_watch(self.fd, os.fsencode(directory), self._MASK)
            if descriptor < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {directory} failed")
            self.watches[descriptor] = directory

    def events(self) -> list[tuple[str, int]]:
        """``(path, mask)`` of everything that happened since the last call."""
        found: list[tuple[str, int]] = []
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return found
            offset = 0
            while offset < len(data):
                descriptor, mask, _, length = struct.unpack_from("iIII", data, offset)
                name = data[offset + 16 : offset + 16 + length].rstrip(b"\0").decode()
                found.append((os.path.join(self.watches.get(descriptor, "?"), name), mask))
                offset += 16 + length

    def close(self) -> None:
        os.close(self.fd)
