"""Local (and shared POSIX) filesystem backend: os-level I/O, real fsync of files and directories.

The root is resolved once, when the backend is opened, and held open as a directory descriptor
until :meth:`LocalBackend.close` (:mod:`gymckpt.store._dirfd`); every path below it is reached one
component at a time from descriptors (``openat`` with ``O_NOFOLLOW``), so nothing below the root
is followed: a symlink, FIFO, socket or device where a directory or a file of state belongs is
refused with :class:`~gymckpt.errors.NotRegularFile` before anything is read or written through
it, and no read or write leaves the root, even when a directory is swapped for a symlink while a
commit runs. The root's own path may go through a symlink (a mount elsewhere): it is followed
once, when the backend is opened.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING

from gymckpt.errors import ManifestConflict, NotRegularFile, StorageError, UnsupportedStorage, UnusableDirectory
from gymckpt.store._dirfd import RootDirectory, not_regular, open_directory_at, os_errors, translate
from gymckpt.store.backend import BlobSink, EntryKind, StorageBackend, join, safe_relative_path
from gymckpt.store.capabilities import (
    ALLOW_NO_LINK_ENV,
    LINK_CAPABILITY,
    LinkSupport,
    allow_no_link_from_environment,
    find_writeback,
    link_unsupported,
    probe_link_at,
    takes_appends,
)
from gymckpt.store.layout import TEMP_PREFIX

if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import BinaryIO

__all__ = ["TEMP_PREFIX", "LocalBackend"]

#: O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused right after)
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
#: a records file's temporary file is read back too: what the server's workers appended to it is checked
_SINK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW


def _write_durable(directory: int, name: str, relative: str, data: bytes) -> None:
    """Create ``name`` (exclusively) in ``directory`` with ``data``, fsynced; errors name ``relative``."""
    with os_errors(relative, "write"):
        fd = os.open(name, _CREATE_FLAGS, 0o644, dir_fd=directory)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_all(fd: int, data: bytes | memoryview) -> int:
    """Write all of ``data``; return how many bytes that was."""
    view = memoryview(data).cast("B")
    size = len(view)
    while view:
        written = os.write(fd, view)
        view = view[written:]
    return size


_START_WRITEBACK = find_writeback()


def _close_all(fds: list[int]) -> None:
    for fd in reversed(fds):
        with suppress(OSError):
            os.close(fd)


class _LocalSink(BlobSink):
    def __init__(self, backend: LocalBackend, directory: str) -> None:
        self._directory = safe_relative_path(directory)
        self._name = f"{TEMP_PREFIX}{secrets.token_hex(8)}.part"
        self.temp_path = join(self._directory, self._name)
        self._takes_appends = takes_appends(backend.root)
        self._dir_fd: int | None = backend.open_directory(self._directory, create=True)
        self._fd: int | None = None
        self._published = False
        #: bytes written so far: where the next chunk starts
        self._offset = 0
        try:
            with os_errors(self._directory, "create a temporary file in"):
                self._fd = os.open(self._name, _SINK_FLAGS, 0o644, dir_fd=self._dir_fd)
        except BaseException:
            self._close_directory()
            raise
        try:
            # before the first byte: on a filesystem without link() the manifest could never be published
            backend.require_link(self._dir_fd, self._name, self._directory)
        except BaseException:
            self.abort()
            raise

    def _close_directory(self) -> None:
        fd, self._dir_fd = self._dir_fd, None
        if fd is not None:
            with suppress(OSError):
                os.close(fd)

    def write(self, chunk: bytes | memoryview) -> None:
        assert self._fd is not None, "write after finish or abort"
        with os_errors(self.temp_path, "write"):
            size = _write_all(self._fd, chunk)
        if _START_WRITEBACK is not None:
            _START_WRITEBACK(self._fd, self._offset, size)  # a head start for finish's fsync; its result is not needed
        self._offset += size

    def append_target(self) -> str | None:
        """This process's ``/proc`` entry of the temporary file's descriptor, where Linux has it: the
        same file whatever happens to its directory meanwhile, reachable by this host's processes only."""
        if self._fd is None:
            return None
        target = f"/proc/{os.getpid()}/fd/{self._fd}"
        return target if self._takes_appends and os.path.exists(target) else None

    def adopt_appended(self, size: int, producer: str = "another process") -> None:
        assert self._fd is not None, "adopt_appended after finish or abort"
        with os_errors(self.temp_path, "stat"):
            length = os.fstat(self._fd).st_size
        if size < 0 or length != self._offset + size:
            raise StorageError(
                f"{self.temp_path}: {producer} appended {length - self._offset} bytes, not the {size} named"
            )
        with os_errors(self.temp_path, "seek"):
            os.lseek(self._fd, 0, os.SEEK_END)
        if _START_WRITEBACK is not None and size:
            _START_WRITEBACK(self._fd, self._offset, size)
        self._offset = length

    def read_appended(self, offset: int, size: int) -> bytes:
        assert self._fd is not None, "read_appended after finish or abort"
        with os_errors(self.temp_path, "read"):
            return os.pread(self._fd, size, offset)

    def finish(self) -> None:
        assert self._fd is not None, "finish twice or after abort"
        fd, self._fd = self._fd, None
        with os_errors(self.temp_path, "fsync"):  # a failing close (EIO, ENXIO) is a StorageError too
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def publish(self, name: str) -> None:
        assert self._dir_fd is not None, "publish after abort"
        with os_errors(join(self._directory, name), "rename into place"):
            os.rename(self._name, name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        self._published = True
        self._close_directory()

    def abort(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with suppress(OSError):  # a dead mount (ENOTCONN): the error that led here is the one to raise
                os.close(fd)
        if not self._published and self._dir_fd is not None:
            try:
                os.unlink(self._name, dir_fd=self._dir_fd)
            except OSError:
                pass  # already gone, or the storage failed: verify reports the leftover
        self._close_directory()


class LocalBackend(StorageBackend):
    """Files under a local or shared POSIX directory, made durable with fsync."""

    def __init__(self, root: str, *, allow_no_link: bool | None = None, resolved: bool = False) -> None:
        """Resolve ``root`` and open it (or its deepest existing ancestor, until a write creates it), once.

        ``allow_no_link``: on a filesystem without ``link()``, create manifests with ``O_EXCL``
        instead of refusing it (None: the environment variable ``GYMCKPT_ALLOW_NO_LINK``
        decides); see :meth:`create_if_absent` for what that gives up. ``resolved``: ``root`` is
        an absolute path already resolved (what an ``allowed_roots`` check compared), so a
        symlink anywhere in it is refused rather than followed.
        """
        self.url = root
        self.allow_no_link = allow_no_link_from_environment() if allow_no_link is None else allow_no_link
        self._root = RootDirectory(root, resolved=resolved)
        #: the resolved absolute path of the root, as opened
        self.root = self._root.path
        #: what link() does on each filesystem (``st_dev``) under the root, asked once per filesystem
        self._links = LinkSupport()

    @property
    def supports_directory_fsync(self) -> bool:
        return True

    @property
    def supports_conditional_create(self) -> bool:
        """True until a write finds a filesystem under the root without ``link()`` (see :meth:`require_link`)."""
        return not self._links.any_refused

    def close(self) -> None:
        """Release the root's descriptor; the backend cannot be used afterwards."""
        self._root.close()

    def real_path(self, path: str) -> str:
        """The OS path of a store-relative path (which never escapes the root)."""
        relative = safe_relative_path(path)
        return os.path.join(self.root, relative) if relative else self.root

    # --- descriptors: every component below the root opened without following symlinks

    def _chain(self, relative: str, *, create: bool) -> list[int]:
        """Descriptors of the root and of each directory down to ``relative``; the caller closes them."""
        fds: list[int] = [self._root.open(create=create)]
        try:
            walked = ""
            for name in relative.split("/") if relative else ():
                walked = join(walked, name)
                if create:
                    try:
                        os.mkdir(name, 0o755, dir_fd=fds[-1])
                    except FileExistsError:
                        pass
                    except OSError as exc:
                        raise translate(exc, walked, "create the directory") from exc
                fds.append(open_directory_at(fds[-1], name, walked))
            return fds
        except BaseException:
            _close_all(fds)
            raise

    def open_directory(self, path: str, *, create: bool = False) -> int:
        """A descriptor of the directory ``path`` (created with its parents when ``create``)."""
        fds = self._chain(safe_relative_path(path), create=create)
        leaf = fds.pop()
        _close_all(fds)
        return leaf

    @contextmanager
    def _parent(self, path: str, *, create: bool = False) -> Iterator[tuple[int, str, str]]:
        """``(directory descriptor, file name, relative path)`` of a file's directory."""
        relative = safe_relative_path(path)
        directory, _, name = relative.rpartition("/")
        if not name:
            raise FileNotFoundError(errno.ENOENT, "the store's root is not a file", path)
        fd = self.open_directory(directory, create=create)
        try:
            yield fd, name, relative
        finally:
            os.close(fd)

    def _open_file(self, path: str) -> int:
        """A read descriptor of the regular file ``path``; anything else is refused unopened."""
        with self._parent(path) as (directory, name, relative):
            try:
                fd = os.open(name, _READ_FLAGS, dir_fd=directory)
            except FileNotFoundError:
                raise
            except OSError as exc:
                mode = stat.S_IFLNK if exc.errno == errno.ELOOP else stat.S_IFREG
                if mode == stat.S_IFREG:  # a socket (ENXIO) or a device that refuses: say what it is
                    with suppress(OSError):
                        mode = os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode
                if not stat.S_ISREG(mode):
                    raise not_regular(relative, mode, "a regular file") from exc
                raise translate(exc, relative, "open") from exc
        try:
            mode = os.fstat(fd).st_mode
        except OSError as exc:
            os.close(fd)
            raise translate(exc, relative, "stat") from exc
        if stat.S_ISREG(mode):
            return fd
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise FileNotFoundError(errno.EISDIR, f"{relative} is a directory, not a file", relative)
        raise not_regular(relative, mode, "a regular file")

    # --- the interface

    def open_sink(self, directory: str) -> BlobSink:
        return _LocalSink(self, directory)

    def open_read(self, path: str) -> BinaryIO:
        return open(self._open_file(path), "rb", buffering=0)

    def read_bytes(self, path: str) -> bytes:
        with os_errors(path, "read"), self.open_read(path) as stream:
            return stream.read()

    def size(self, path: str) -> int:
        fd = self._open_file(path)
        try:
            with os_errors(path, "stat"):
                return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        """True when a regular file is at ``path`` (a symlink or special file is not one)."""
        try:
            os.close(self._open_file(path))
        except (FileNotFoundError, NotRegularFile, UnusableDirectory):
            return False
        return True

    def list_dir(self, path: str) -> list[str]:
        try:
            fd = self.open_directory(path)
        except FileNotFoundError:
            return []
        except UnusableDirectory as exc:
            if isinstance(exc.__cause__, NotADirectoryError):
                return []
            raise
        try:
            with os_errors(path or ".", "list"):
                entries = list(os.scandir(fd))
        finally:
            os.close(fd)
        return sorted(entry.name + "/" if entry.is_dir(follow_symlinks=False) else entry.name for entry in entries)

    def walk_entries(self, path: str = "") -> Iterator[tuple[str, EntryKind]]:
        """Every entry under ``path`` but real directories (descended), symlinks never followed."""
        try:
            fd = self.open_directory(path)
        except FileNotFoundError:
            return
        except NotRegularFile:
            yield safe_relative_path(path), EntryKind.SYMLINK
            return
        yield from self._walk_at(fd, safe_relative_path(path))

    def _walk_at(self, fd: int, prefix: str) -> Iterator[tuple[str, EntryKind]]:
        try:
            with os_errors(prefix or ".", "list"):
                entries = sorted(os.scandir(fd), key=lambda entry: entry.name)
            for entry in entries:
                child = join(prefix, entry.name)
                if entry.is_dir(follow_symlinks=False):
                    try:
                        below = open_directory_at(fd, entry.name, child)
                    except FileNotFoundError:
                        continue  # removed while we looked
                    yield from self._walk_at(below, child)
                elif entry.is_symlink():
                    yield child, EntryKind.SYMLINK
                elif entry.is_file(follow_symlinks=False):
                    yield child, EntryKind.FILE
                else:
                    yield child, EntryKind.SPECIAL
        finally:
            os.close(fd)

    def walk_files(self, path: str = "") -> Iterator[str]:
        for child, kind in self.walk_entries(path):
            if kind is EntryKind.FILE:
                yield child

    def delete(self, path: str) -> None:
        try:
            with self._parent(path) as (directory, name, relative):
                try:
                    os.unlink(name, dir_fd=directory)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    raise translate(exc, relative, "delete") from exc
        except FileNotFoundError:
            pass

    def sync_directories(self, path: str, up_to: str = "") -> None:
        relative = safe_relative_path(path)
        stop = safe_relative_path(up_to)
        depth = len(stop.split("/")) if stop else 0
        fds = self._chain(relative, create=False)
        try:
            levels = relative.split("/") if relative else []
            for level in range(len(fds) - 1, depth - 1, -1):
                where = "/".join(levels[:level]) or "."
                with os_errors(where, "fsync the directory"):
                    os.fsync(fds[level])
        finally:
            _close_all(fds)

    def replace(self, path: str, data: bytes) -> None:
        """A temporary file written and fsynced, renamed over ``path``, then the directory fsynced."""
        with self._parent(path, create=True) as (directory, name, relative):
            temp = f"{TEMP_PREFIX}{secrets.token_hex(8)}.part"
            try:
                _write_durable(directory, temp, relative, data)
                with os_errors(relative, "write"):
                    os.replace(temp, name, src_dir_fd=directory, dst_dir_fd=directory)
            except BaseException:
                with suppress(OSError):
                    os.unlink(temp, dir_fd=directory)
                raise
            with os_errors(relative.rpartition("/")[0] or ".", "fsync the directory"):
                os.fsync(directory)

    def _remove_empty_directories(self, path: str) -> None:
        relative = safe_relative_path(path)
        directories = [relative]
        pending = [relative]
        while pending:
            current = pending.pop()
            for name in self.list_dir(current):
                if name.endswith("/"):
                    child = join(current, name.rstrip("/"))
                    directories.append(child)
                    pending.append(child)
        for directory in sorted(directories, key=lambda item: item.count("/"), reverse=True):
            parent, _, name = directory.rpartition("/")
            try:
                fd = self.open_directory(parent)
            except FileNotFoundError:
                continue
            try:
                with suppress(FileNotFoundError, OSError):
                    os.rmdir(name, dir_fd=fd)
                with suppress(OSError):
                    os.fsync(fd)
            finally:
                os.close(fd)

    def create_if_absent(self, path: str, data: bytes) -> bool:
        """A temporary file written and fsynced, ``link()``ed to ``path`` only if absent, then the directory fsynced.

        ``link()`` is decided where the names live (a shared filesystem's server: MooseFS's
        master), so of two hosts racing for one name exactly one wins, and the name never
        shows a partial file. A filesystem without ``link()`` (s3fs, vfat) is refused with
        :class:`~gymckpt.errors.UnsupportedStorage` naming the path and the missing
        capability, unless ``allow_no_link``: then :meth:`_create_exclusive` creates the name
        itself with ``O_EXCL``.
        """
        with self._parent(path, create=True) as (directory, name, relative):
            refused = self._known_refusal(directory)
            if refused is not None:
                created = self._refuse_or_create_exclusive(directory, name, relative, data, refused)
            else:
                created = self._create_by_link(directory, name, relative, data)
            if not created:
                existing = self._read_taken(relative)
                if existing != data:
                    raise ManifestConflict(f"{relative} already exists with other content", path=relative)
            try:
                with os_errors(relative.rpartition("/")[0] or ".", "fsync the directory"):
                    os.fsync(directory)
            except StorageError:
                if created:
                    # the caller learns the create failed, so the file must not stay: a retry creates it again
                    with suppress(OSError):
                        os.unlink(name, dir_fd=directory)
                raise
            return created

    def _known_refusal(self, directory: int) -> OSError | None:
        """The link() refusal met earlier on ``directory``'s filesystem, if any."""
        if not self._links.any_refused:
            return None
        try:
            return self._links.refusal(os.fstat(directory).st_dev)
        except OSError:
            return None  # the create itself reports what is wrong with the storage

    def require_link(self, directory: int, name: str, relative: str) -> None:
        """Refuse, unless opted in, a filesystem without ``link()`` before a commit writes there.

        ``name`` is a file of ``directory`` (a descriptor; ``relative`` its store-relative path)
        that the probe links to a second temporary name and unlinks again: the first write on a
        filesystem asks, later ones use the answer kept per ``st_dev`` (:class:`LinkSupport`).
        """
        with os_errors(relative or ".", "stat the directory"):
            device = os.fstat(directory).st_dev
        if self._links.decided(device):
            refused = self._links.refusal(device)
        else:
            with os_errors(join(relative, name), "link() a temporary file in"):
                refused = probe_link_at(directory, name)
            self._links.record(device, refused)
        if refused is not None and not self.allow_no_link:
            raise self._no_link(f"cannot write in {relative or '.'}", relative, relative, refused) from refused

    def _no_link(self, what: str, path: str, directory: str, refused: OSError) -> UnsupportedStorage:
        where = self.real_path(directory)
        return UnsupportedStorage(
            f"{what}: the filesystem of {where} refuses link() ({os.strerror(refused.errno or 0)}), "
            f"so it lacks {LINK_CAPABILITY}, which keeps racing writers of one manifest from overwriting each "
            f"other and readers from seeing it half written; set {ALLOW_NO_LINK_ENV}=1 (or pass "
            "LocalBackend(allow_no_link=True)) to create manifests there with O_EXCL instead",
            path=path,
            errno=refused.errno,
        )

    def _read_taken(self, relative: str) -> bytes:
        """The bytes of a name the filesystem just refused as taken."""
        try:
            return self.read_bytes(relative)
        except FileNotFoundError as exc:
            # seen on a MooseFS mount with mfsnegentrycacheto > 0: the kernel still holds "absent" for the name
            raise StorageError(
                f"cannot create {relative}: the filesystem refused the name as taken, then found no file there "
                "(a client cache of absent names, such as MooseFS's mfsnegentrycacheto > 0, or a concurrent delete)",
                path=relative,
                errno=errno.ENOENT,
            ) from exc

    def _create_by_link(self, directory: int, name: str, relative: str, data: bytes) -> bool:
        """True when the link created ``name``, False when a file had it; a filesystem without link() goes to
        :meth:`_refuse_or_create_exclusive`."""
        temp = f"{TEMP_PREFIX}{secrets.token_hex(8)}.part"
        refused: OSError | None = None
        try:
            _write_durable(directory, temp, relative, data)
            try:
                os.link(temp, name, src_dir_fd=directory, dst_dir_fd=directory, follow_symlinks=False)
                created = True
            except FileExistsError:
                created = False
            except OSError as exc:
                if not link_unsupported(exc):
                    raise translate(exc, relative, "create") from exc
                refused = exc
        finally:
            try:
                os.unlink(temp, dir_fd=directory)
            except OSError:
                pass  # verify reports a leftover temporary file
        if refused is None:
            return created
        return self._refuse_or_create_exclusive(directory, name, relative, data, refused)

    def _refuse_or_create_exclusive(
        self, directory: int, name: str, relative: str, data: bytes, refused: OSError
    ) -> bool:
        """``link()`` was refused: remember that filesystem, then refuse it, or (opted in) create with O_EXCL."""
        with suppress(OSError):
            self._links.record(os.fstat(directory).st_dev, refused)
        if not self.allow_no_link:
            raise self._no_link(
                f"cannot create {relative}", relative, relative.rpartition("/")[0], refused
            ) from refused
        return self._create_exclusive(directory, name, relative, data)

    def _create_exclusive(self, directory: int, name: str, relative: str, data: bytes) -> bool:
        """``name`` created with ``O_EXCL`` and written in place: the fallback where there is no ``link()``.

        Exclusive only as far as the filesystem's own create is: within one mount the kernel holds
        the directory while it checks and creates, but s3fs checks for the object and then uploads
        without a condition, so two hosts' mounts can both "create" it and the last upload wins.
        And the name exists before its bytes do: a reader can meet it empty or short, and a crash
        before the fsync leaves it so, which verify reports and which makes a retry a
        ManifestConflict until the file is removed.
        """
        try:
            fd = os.open(name, _CREATE_FLAGS, 0o644, dir_fd=directory)
        except FileExistsError:
            return False
        except OSError as exc:
            raise translate(exc, relative, "create") from exc
        try:
            with os_errors(relative, "write"):
                try:
                    _write_all(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except BaseException:
            with suppress(OSError):
                os.unlink(name, dir_fd=directory)  # ours and incomplete: a retry creates it again
            raise
        return True
