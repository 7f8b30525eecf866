"""The shipped backend suite against the local filesystem backend."""

from __future__ import annotations

import os

import pytest

from gymckpt.store._local import LocalBackend
from gymckpt.testing.backend_suite import BackendTests


class TestLocalBackend(BackendTests):
    supports_special_files = True

    @pytest.fixture
    def backend(self, tmp_path) -> LocalBackend:
        (tmp_path / "outside").mkdir()
        return LocalBackend(str(tmp_path / "root"))

    def outside_directory(self, backend: LocalBackend) -> str:
        return os.path.join(os.path.dirname(backend.root), "outside")

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


def test_the_outside_watch_sees_what_follows_a_symlink(tmp_path) -> None:
    """The attack table's watch can fail: reading through a symlink that leaves the root is seen."""
    from gymckpt.testing.recording import OutsideWatch

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"x")
    (tmp_path / "link").symlink_to(outside / "secret")
    watch = OutsideWatch(str(outside))
    try:
        assert watch.events() == []
        assert (tmp_path / "link").read_bytes() == b"x"
        touched = {path for path, _ in watch.events()}
        assert str(outside / "secret") in touched
    finally:
        watch.close()
