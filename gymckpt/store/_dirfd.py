"""Directory descriptors under a local store's root: the root resolved and opened once, every path
below it reached from open descriptors, never through a symlink.

The root's path is resolved once, when the backend is opened (symlinks in it followed, as for a
mount reached through a link, unless the caller already resolved it), then opened component by
component with ``O_NOFOLLOW`` and kept open for the backend's lifetime. Every later operation
starts from that descriptor, so a directory swapped for a symlink after the root was resolved
(after an ``allowed_roots`` check, say) cannot lead a read or a write elsewhere. A root that was
moved, removed or replaced while the backend is open is refused with a typed error instead of
being followed to wherever its path now leads.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import weakref
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING

from gymckpt.errors import NotRegularFile, StorageError, UnusableDirectory

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "DIRECTORY_FLAGS",
    "RootDirectory",
    "not_regular",
    "open_directory_at",
    "os_errors",
    "translate",
]

_DIRECTORY_ERRNOS = {
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.ENOTDIR,
    errno.EEXIST,
    errno.EISDIR,
    errno.ENAMETOOLONG,
}
#: a directory whose entries are read, created or fsynced
DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW
#: the root and its ancestors are held only to walk from (O_PATH: no read permission needed, as for a path)
_ANCHOR_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW


def translate(exc: OSError, path: str, action: str) -> Exception:
    """The one place an OS error becomes a gymckpt error."""
    if isinstance(exc, FileNotFoundError):
        return exc
    detail = f"cannot {action} {path}: {os.strerror(exc.errno) if exc.errno else exc}"
    if exc.errno in _DIRECTORY_ERRNOS:
        return UnusableDirectory(detail, path=path)
    return StorageError(detail, path=path, errno=exc.errno)


@contextmanager
def os_errors(path: str, action: str) -> Iterator[None]:
    """Translate the OS errors of the block (a missing file and typed refusals pass through)."""
    try:
        yield
    except (FileNotFoundError, NotRegularFile):
        raise
    except OSError as exc:
        raise translate(exc, path, action) from exc


def _describe(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "a regular file"


def not_regular(path: str, mode: int, wanted: str) -> NotRegularFile:
    """The refusal of ``path``, which is not ``wanted`` but what ``mode`` says."""
    return NotRegularFile(
        f"{path} is {_describe(mode)}, not {wanted}: only regular files in real directories are state, "
        "and gymckpt never follows or opens anything else",
        path=path,
    )


def open_directory_at(parent: int, name: str, path: str, flags: int = DIRECTORY_FLAGS) -> int:
    """A descriptor of the directory ``name`` in ``parent``; a symlink or special file there is refused."""
    try:
        return os.open(name, flags, dir_fd=parent)
    except FileNotFoundError:
        raise
    except OSError as exc:
        mode = stat.S_IFREG
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            with suppress(OSError):
                mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(path, mode, "a directory") from exc
        raise translate(exc, path, "open the directory") from exc


def _close_held(held: list[int]) -> None:
    """Close the descriptor a :class:`RootDirectory` holds (also its finalizer, so it never leaks)."""
    while held:
        with suppress(OSError):
            os.close(held.pop())


class RootDirectory:
    """A store's root: its path resolved once, a descriptor of it (or, until it exists, of its
    deepest existing ancestor) held until :meth:`close`."""

    def __init__(self, root: str, *, resolved: bool = False) -> None:
        """``resolved``: ``root`` is already a resolved absolute path (an ``allowed_roots`` check's), so
        a symlink anywhere in it is refused instead of followed; otherwise symlinks in ``root`` are
        followed here, once."""
        if resolved and not os.path.isabs(root):
            raise ValueError(f"a resolved root must be an absolute path, got {root!r}")
        #: the resolved absolute path of the root; nothing below it is ever followed
        self.path = os.path.normpath(root) if resolved else os.path.realpath(root)
        self._lock = threading.Lock()
        #: the descriptor held: the root's once it exists, else its deepest existing ancestor's
        self._held: list[int] = []
        self._finalizer = weakref.finalize(self, _close_held, self._held)
        #: the names from the held directory down to the root, still to open (or create)
        self._missing: list[str] = []
        self._held_path = "/"
        self._identity = (0, 0)
        self._closed = False
        self._open_from_top()

    def _open_from_top(self) -> None:
        """Open ``/`` then each component of the path without following symlinks, as far as they exist.

        What cannot be opened now (absent, a symlink, not permitted) is walked again, and then
        refused or created, by the operation that needs it.
        """
        names = [name for name in self.path.split("/") if name]
        fd = os.open("/", _ANCHOR_FLAGS)
        opened = 0
        try:
            for name in names:
                try:
                    child = os.open(name, _ANCHOR_FLAGS, dir_fd=fd)
                except OSError:
                    break
                os.close(fd)
                fd = child
                opened += 1
            identity = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        self._held.append(fd)
        self._held_path = "/" + "/".join(names[:opened])
        self._identity = (identity.st_dev, identity.st_ino)
        self._missing = names[opened:]

    def open(self, *, create: bool) -> int:
        """A new descriptor of the root (the caller closes it), created with its missing parents when ``create``.

        Raises ``FileNotFoundError`` when the root does not exist (or was removed while open)
        and not ``create``; :class:`~gymckpt.errors.NotRegularFile` when its path now goes
        through a symlink; :class:`~gymckpt.errors.UnusableDirectory` when it was moved or replaced.
        """
        with self._lock:  # the held descriptor is never closed (and its number reused) while in use here
            if self._closed:
                raise StorageError(f"the store at {self.path} is closed", path="")
            self._check_unmoved(create=create)
            if self._missing:
                self._open_missing(create=create)
            with os_errors("", f"open the store's root {self.path}"):
                return os.open(".", DIRECTORY_FLAGS, dir_fd=self._held[0])

    def _open_missing(self, *, create: bool) -> None:
        """Walk (creating when ``create``) from the held ancestor down to the root; hold each step."""
        while self._missing:
            name = self._missing[0]
            path = os.path.join(self._held_path, name)
            if create:
                try:
                    os.mkdir(name, 0o755, dir_fd=self._held[0])
                except FileExistsError:
                    pass
                except OSError as exc:
                    raise translate(exc, "", f"create the store's root {self.path}: at {path}") from exc
            child = open_directory_at(self._held[0], name, path, _ANCHOR_FLAGS)
            try:
                identity = os.fstat(child)
            except OSError as exc:
                os.close(child)
                raise translate(exc, "", f"stat {path}") from exc
            _close_held(self._held)
            self._held.append(child)
            self._held_path = path
            self._identity = (identity.st_dev, identity.st_ino)
            self._missing.pop(0)

    def _check_unmoved(self, *, create: bool) -> None:
        """Refuse a held directory whose path now leads elsewhere (or nowhere): it was moved or replaced."""
        try:
            found = os.stat(self._held_path)
        except OSError:
            found = None
        if found is not None and (found.st_dev, found.st_ino) == self._identity:
            return
        # only when something changed: find which component of the path is now a symlink, if one is
        walked = ""
        for name in [name for name in self._held_path.split("/") if name]:
            walked = f"{walked}/{name}"
            try:
                mode = os.lstat(walked).st_mode
            except FileNotFoundError:
                if create:
                    raise UnusableDirectory(
                        f"the store's root {self.path} was removed while the store was open: {walked} is gone, "
                        "and it is not created again (its path may lead elsewhere now); open the store again",
                        path="",
                    ) from None
                raise FileNotFoundError(
                    errno.ENOENT, f"the store's root {self.path} was removed while the store was open", walked
                ) from None
            except OSError:
                break
            if stat.S_ISLNK(mode):
                raise NotRegularFile(
                    f"{walked} is a symbolic link now: the store's root {self.path} was replaced while the store "
                    "was open, and gymckpt never follows it",
                    path="",
                )
        raise UnusableDirectory(
            f"the store's root {self.path} was moved or replaced while the store was open: its path leads to "
            "another directory now, which gymckpt does not use; open the store again",
            path="",
        )

    def close(self) -> None:
        """Release the held descriptor; the root cannot be used afterwards."""
        with self._lock:
            self._closed = True
            self._finalizer.detach()
            _close_held(self._held)
