"""In-memory backend for tests: ``memory://name`` stores share content within a process."""

from __future__ import annotations

import io
import threading
from typing import TYPE_CHECKING

from gymckpt.errors import ManifestConflict
from gymckpt.store.backend import BlobSink, StorageBackend, join, safe_relative_path

if TYPE_CHECKING:
    from typing import BinaryIO

__all__ = ["MemoryBackend", "clear_memory_stores"]

#: name -> (files, lock): every backend opened on one name shares both, so create_if_absent has one winner
_STORES: dict[str, tuple[dict[str, bytes], threading.Lock]] = {}
_STORES_LOCK = threading.Lock()


def clear_memory_stores() -> None:
    """Forget every ``memory://`` store of this process."""
    with _STORES_LOCK:
        _STORES.clear()


class _MemorySink(BlobSink):
    def __init__(self, backend: MemoryBackend, directory: str) -> None:
        self._backend = backend
        self._directory = safe_relative_path(directory)
        self._parts: list[bytes] = []
        self._content: bytes | None = None

    def write(self, chunk: bytes | memoryview) -> None:
        self._parts.append(bytes(chunk))

    def finish(self) -> None:
        self._content = b"".join(self._parts)
        self._parts = []

    def publish(self, name: str) -> None:
        assert self._content is not None, "publish before finish"
        with self._backend.lock:
            self._backend.files[join(self._directory, name)] = self._content

    def abort(self) -> None:
        self._parts = []
        self._content = None


class MemoryBackend(StorageBackend):
    """A dict of path to bytes; directories are implied by the paths under them."""

    def __init__(self, url: str) -> None:
        self.url = url
        name = url.removeprefix("memory://").strip("/")
        with _STORES_LOCK:
            self.files, self.lock = _STORES.setdefault(name, ({}, threading.Lock()))

    @property
    def supports_directory_fsync(self) -> bool:
        return False

    @property
    def supports_conditional_create(self) -> bool:
        return True

    def open_sink(self, directory: str) -> BlobSink:
        return _MemorySink(self, directory)

    def open_read(self, path: str) -> BinaryIO:
        return io.BytesIO(self.read_bytes(path))

    def read_bytes(self, path: str) -> bytes:
        try:
            return self.files[safe_relative_path(path)]
        except KeyError:
            raise FileNotFoundError(path) from None

    def size(self, path: str) -> int:
        return len(self.read_bytes(path))

    def exists(self, path: str) -> bool:
        return safe_relative_path(path) in self.files

    def list_dir(self, path: str) -> list[str]:
        prefix = safe_relative_path(path)
        prefix = prefix + "/" if prefix else ""
        names = set()
        with self.lock:
            for key in self.files:
                if key.startswith(prefix):
                    head, slash, _ = key[len(prefix) :].partition("/")
                    names.add(head + slash)
        return sorted(names)

    def delete(self, path: str) -> None:
        with self.lock:
            self.files.pop(safe_relative_path(path), None)

    def sync_directories(self, path: str, up_to: str = "") -> None:
        safe_relative_path(path)

    def replace(self, path: str, data: bytes) -> None:
        key = safe_relative_path(path)
        with self.lock:
            self.files[key] = bytes(data)

    def create_if_absent(self, path: str, data: bytes) -> bool:
        key = safe_relative_path(path)
        with self.lock:
            existing = self.files.get(key)
            if existing is None:
                self.files[key] = bytes(data)
                return True
        if existing != data:
            raise ManifestConflict(f"{path} already exists with other content", path=path)
        return False
