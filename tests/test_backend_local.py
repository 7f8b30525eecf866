"""The shipped backend suite against the local filesystem backend."""

from __future__ import annotations

import os

import pytest

from gymckpt.store._local import LocalBackend
from gymckpt.store.testing import BackendTests


class TestLocalBackend(BackendTests):
    @pytest.fixture
    def backend(self, tmp_path) -> LocalBackend:
        return LocalBackend(str(tmp_path / "root"))

    def raw_read(self, backend: LocalBackend, path: str) -> bytes:
        with open(os.path.join(backend.root, path), "rb") as stream:
            return stream.read()

    def raw_write(self, backend: LocalBackend, path: str, data: bytes) -> None:
        real = os.path.join(backend.root, path)
        os.makedirs(os.path.dirname(real), exist_ok=True)
        with open(real, "wb") as stream:
            stream.write(data)

    def raw_delete(self, backend: LocalBackend, path: str) -> None:
        os.unlink(os.path.join(backend.root, path))

    def raw_files(self, backend: LocalBackend, prefix: str = "") -> list[str]:
        found = []
        for directory, _, names in os.walk(os.path.join(backend.root, prefix)):
            for name in names:
                found.append(os.path.relpath(os.path.join(directory, name), backend.root))
        return sorted(found)
