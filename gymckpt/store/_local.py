"""Local (and shared POSIX) filesystem backend: os-level I/O, real fsync of files and directories."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from contextlib import contextmanager
from typing import TYPE_CHECKING

from gymckpt.errors import ManifestConflict, StorageError, UnusableDirectory
from gymckpt.store.backend import BlobSink, StorageBackend, join, safe_relative_path

if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import BinaryIO

__all__ = ["LocalBackend", "TEMP_PREFIX"]

#: every temporary file this backend writes starts with this; verify reports leftovers
TEMP_PREFIX = ".gymckpt-tmp-"

_DIRECTORY_ERRNOS = {
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.ENOTDIR,
    errno.EEXIST,
    errno.EISDIR,
    errno.ENAMETOOLONG,
}


def _translate(exc: OSError, path: str, action: str) -> Exception:
    """The one place an OS error becomes a gymckpt error."""
    if isinstance(exc, FileNotFoundError):
        return exc
    detail = f"cannot {action} {path}: {os.strerror(exc.errno) if exc.errno else exc}"
    if exc.errno in _DIRECTORY_ERRNOS:
        return UnusableDirectory(detail, path=path)
    return StorageError(detail, path=path, errno=exc.errno)


@contextmanager
def _os_errors(path: str, action: str) -> Iterator[None]:
    try:
        yield
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _translate(exc, path, action) from exc


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class _LocalSink(BlobSink):
    def __init__(self, backend: LocalBackend, directory: str) -> None:
        self._backend = backend
        self._directory = directory
        self._real_directory = backend.real_path(directory)
        self.temp_path = os.path.join(self._real_directory, f"{TEMP_PREFIX}{secrets.token_hex(8)}.part")
        with _os_errors(directory, "create the directory"):
            os.makedirs(self._real_directory, exist_ok=True)
        with _os_errors(directory, "create a temporary file in"):
            self._fd: int | None = os.open(self.temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self._published = False

    def write(self, chunk: bytes | memoryview) -> None:
        assert self._fd is not None, "write after finish or abort"
        with _os_errors(self.temp_path, "write"):
            _write_all(self._fd, chunk)

    def finish(self) -> None:
        assert self._fd is not None, "finish twice or after abort"
        fd, self._fd = self._fd, None
        try:
            with _os_errors(self.temp_path, "fsync"):
                os.fsync(fd)
        finally:
            os.close(fd)

    def publish(self, name: str) -> None:
        with _os_errors(join(self._directory, name), "rename into place"):
            os.rename(self.temp_path, os.path.join(self._real_directory, name))
        self._published = True

    def abort(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        if not self._published:
            try:
                os.unlink(self.temp_path)
            except OSError:
                pass  # already gone, or the storage failed: verify reports the leftover


class LocalBackend(StorageBackend):
    """Files under a local or shared POSIX directory, made durable with fsync."""

    def __init__(self, root: str) -> None:
        self.url = root
        self.root = os.path.abspath(root)

    @property
    def supports_directory_fsync(self) -> bool:
        return True

    @property
    def supports_conditional_create(self) -> bool:
        return True

    def real_path(self, path: str) -> str:
        """The OS path of a store-relative path (which never escapes the root)."""
        relative = safe_relative_path(path)
        return os.path.join(self.root, relative) if relative else self.root

    def open_sink(self, directory: str) -> BlobSink:
        return _LocalSink(self, directory)

    def open_read(self, path: str) -> BinaryIO:
        real = self.real_path(path)
        with _os_errors(path, "open"):
            return open(real, "rb", buffering=0)

    def read_bytes(self, path: str) -> bytes:
        with _os_errors(path, "read"), open(self.real_path(path), "rb") as stream:
            return stream.read()

    def size(self, path: str) -> int:
        with _os_errors(path, "stat"):
            return os.stat(self.real_path(path)).st_size

    def exists(self, path: str) -> bool:
        return os.path.isfile(self.real_path(path))

    def list_dir(self, path: str) -> list[str]:
        real = self.real_path(path)
        try:
            entries = list(os.scandir(real))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise _translate(exc, path, "list") from exc
        return sorted(entry.name + "/" if entry.is_dir(follow_symlinks=False) else entry.name for entry in entries)

    def delete(self, path: str) -> None:
        try:
            os.unlink(self.real_path(path))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _translate(exc, path, "delete") from exc

    def sync_directories(self, path: str, up_to: str = "") -> None:
        relative = safe_relative_path(path)
        stop = safe_relative_path(up_to)
        while True:
            with _os_errors(relative or ".", "fsync the directory"):
                _fsync_directory(self.real_path(relative))
            if relative == stop or not relative:
                return
            relative = relative.rpartition("/")[0]

    def create_if_absent(self, path: str, data: bytes) -> bool:
        directory, _, name = safe_relative_path(path).rpartition("/")
        real_directory = self.real_path(directory)
        with _os_errors(directory, "create the directory"):
            os.makedirs(real_directory, exist_ok=True)
        temp = os.path.join(real_directory, f"{TEMP_PREFIX}{secrets.token_hex(8)}.part")
        target = os.path.join(real_directory, name)
        try:
            with _os_errors(path, "write"):
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                try:
                    _write_all(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            try:
                os.link(temp, target)
                created = True
            except FileExistsError:
                created = False
            except OSError as exc:
                raise _translate(exc, path, "create") from exc
        finally:
            try:
                os.unlink(temp)
            except OSError:
                pass  # verify reports a leftover temporary file
        if not created:
            existing = self.read_bytes(path)
            if existing != data:
                raise ManifestConflict(f"{path} already exists with other content", path=path)
        try:
            with _os_errors(directory, "fsync the directory"):
                _fsync_directory(real_directory)
        except StorageError:
            if created:
                # the caller learns the create failed, so the file must not stay: a retry creates it again
                with contextlib.suppress(OSError):
                    os.unlink(target)
            raise
        return created
