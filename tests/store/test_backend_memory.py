"""The shipped backend suite against the in-memory backend."""

from __future__ import annotations

import pytest

from gymckpt.store._memory import MemoryBackend, clear_memory_stores
from gymckpt.testing.backend_suite import BackendTests


class TestMemoryBackend(BackendTests):
    expects_directory_fsync = False

    @pytest.fixture
    def backend(self) -> MemoryBackend:
        clear_memory_stores()
        return MemoryBackend("memory://suite")

    def raw_read(self, backend: MemoryBackend, path: str) -> bytes:
        return backend.files[path]

    def raw_write(self, backend: MemoryBackend, path: str, data: bytes) -> None:
        backend.files[path] = data

    def raw_delete(self, backend: MemoryBackend, path: str) -> None:
        del backend.files[path]

    def raw_files(self, backend: MemoryBackend, prefix: str = "") -> list[str]:
        return sorted(path for path in backend.files if path.startswith(prefix))
