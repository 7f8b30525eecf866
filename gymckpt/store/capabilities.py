"""What a local or shared POSIX filesystem can do for the store, asked of the filesystem itself.

The local backend creates a manifest only if it is absent by ``link()``: a temporary file,
written and fsynced in full, gets the final name only if no file has it, in one step that a
shared filesystem's server decides (MooseFS's master, an NFS server), so two hosts racing
for one manifest cannot both win and no reader sees it half written. Some mounts have no
``link()`` at all (s3fs and other object-store FUSE mounts, vfat): :func:`link_unsupported`
recognises that refusal, and :class:`LinkSupport` is what a backend knows of each filesystem
(``st_dev``) it writes to. The local backend asks once per filesystem, before the first byte of a
commit lands there: it ``link()``s the commit's own temporary file, still empty, to a second
temporary name and removes that name (:func:`probe_link_at`), so a mount without ``link()`` is
refused before any records file is written, and the answer is kept for the backend's lifetime.
:func:`probe_link` asks a directory by path (a diagnostic; it creates its own empty file).

Such a mount is refused with :class:`~gymckpt.errors.UnsupportedStorage` unless the user
opts in (``LocalBackend(root, allow_no_link=True)`` or ``GYMCKPT_ALLOW_NO_LINK=1``); the
backend then creates the manifest's name with ``O_EXCL`` and writes it in place, which the
local backend's ``create_if_absent`` documents.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import threading
from contextlib import suppress
from functools import lru_cache
from typing import TYPE_CHECKING

from gymckpt.store.layout import TEMP_PREFIX

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "ALLOW_NO_LINK_ENV",
    "APPENDING_FILESYSTEMS",
    "LINK_CAPABILITY",
    "NO_LINK_ERRNOS",
    "LinkSupport",
    "allow_no_link_from_environment",
    "filesystem_type",
    "find_writeback",
    "link_unsupported",
    "probe_link",
    "probe_link_at",
    "takes_appends",
]

#: the capability a filesystem without link() lacks, as error messages name it
LINK_CAPABILITY = "link-based create-if-absent"
#: set to 1 (true, yes, on) to accept filesystems without link(): manifests are created with O_EXCL
ALLOW_NO_LINK_ENV = "GYMCKPT_ALLOW_NO_LINK"
#: what link() of a fresh file of one's own to a free name fails with where the filesystem has no hard links:
#: EPERM (vfat, some FUSE filesystems), EOPNOTSUPP/ENOTSUP (s3fs), ENOSYS (FUSE without a link handler)
NO_LINK_ERRNOS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def link_unsupported(exc: OSError) -> bool:
    """True when ``exc`` (raised by ``link()`` of a file the caller just created) means no hard links here."""
    return exc.errno in NO_LINK_ERRNOS


def allow_no_link_from_environment() -> bool:
    """The opt-in :data:`ALLOW_NO_LINK_ENV` (unset: False); another value is a ``ValueError``."""
    value = os.environ.get(ALLOW_NO_LINK_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{ALLOW_NO_LINK_ENV} must be 1 or 0 (true/false, yes/no, on/off), got {value!r}")


def probe_link(directory: str) -> bool | None:
    """Whether ``link()`` works in ``directory``: True, False (the filesystem refuses it), or None
    when it cannot tell (the directory is missing or not writable).

    Creates two empty temporary files (:data:`~gymckpt.store.layout.TEMP_PREFIX`) and removes them.
    """
    token = secrets.token_hex(8)
    source = os.path.join(directory, f"{TEMP_PREFIX}{token}.probe")
    target = os.path.join(directory, f"{TEMP_PREFIX}{token}.probe-link")
    try:
        fd = os.open(source, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError:
        return None
    os.close(fd)
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError as exc:
        return False if link_unsupported(exc) else None
    else:
        return True
    finally:
        for leftover in (target, source):
            with suppress(OSError):
                os.unlink(leftover)


def probe_link_at(directory: int, name: str) -> OSError | None:
    """``link()`` the file ``name`` of ``directory`` (a descriptor) to a fresh temporary name, then remove
    that name: None when the filesystem links, its refusal when it has no ``link()``.

    Any other error (EIO, ENOSPC) is raised: the storage failed, and nothing is decided.
    """
    target = f"{TEMP_PREFIX}{secrets.token_hex(8)}.link-probe"
    try:
        os.link(name, target, src_dir_fd=directory, dst_dir_fd=directory, follow_symlinks=False)
    except OSError as exc:
        if link_unsupported(exc):
            return exc
        raise
    with suppress(OSError):  # a name left behind is a leftover temporary file, which verify reports
        os.unlink(target, dir_fd=directory)
    return None


class LinkSupport:
    """Whether ``link()`` works on each filesystem (``st_dev``) one backend met: decided once, then kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._linking: set[int] = set()
        self._refused: dict[int, OSError] = {}

    def decided(self, device: int) -> bool:
        """True when ``device``'s answer is known."""
        with self._lock:
            return device in self._linking or device in self._refused

    def refusal(self, device: int) -> OSError | None:
        """The ``link()`` refusal met on ``device``, if one was."""
        with self._lock:
            return self._refused.get(device)

    def record(self, device: int, refused: OSError | None) -> None:
        """Keep what ``link()`` did on ``device``: worked (None) or was refused (its error)."""
        with self._lock:
            if refused is None:
                self._linking.add(device)
            else:
                self._refused[device] = refused

    @property
    def any_refused(self) -> bool:
        """True once some filesystem under the backend refused ``link()``."""
        with self._lock:
            return bool(self._refused)


#: filesystems whose files another process of this host may append to while the store holds them
#: open: its bytes are at once in the size and the reads of every descriptor (one page cache). A
#: FUSE or network mount (MooseFS, NFS) may cache a file's size per descriptor: its records then
#: reach the writer through it
APPENDING_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "f2fs", "zfs", "overlay"})


#: how mountinfo writes a space, a tab, a newline or a backslash in a mount point
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def filesystem_type(path: str, mountinfo: str | None = None) -> str | None:
    """The type of the filesystem ``path`` (absolute, resolved) is on, from ``/proc/self/mountinfo``
    (or the text given); None where there is none to read."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as file:
                mountinfo = file.read()
        except OSError:
            return None
    found, longest = None, -1
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if "-" not in fields[6:] or len(fields) < 5:
            continue
        point = _OCTAL_ESCAPE.sub(lambda escape: chr(int(escape.group(1), 8)), fields[4])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= longest:  # the deepest mount; a later one over the same point hides it
            found, longest = fields[fields.index("-", 6) + 1], len(point)
    return found


@lru_cache(maxsize=64)
def takes_appends(path: str) -> bool:
    """Whether records files under ``path`` may be appended to by the server's other processes
    (the filesystem is one of :data:`APPENDING_FILESYSTEMS`); asked once per path."""
    return filesystem_type(path) in APPENDING_FILESYSTEMS


#: sync_file_range(2)'s flag that starts the writeback of a range and returns without waiting for it
_SYNC_FILE_RANGE_WRITE = 2


def find_writeback() -> Callable[[int, int, int], object] | None:
    """``start(fd, offset, count)``: Linux's ``sync_file_range(..., SYNC_FILE_RANGE_WRITE)`` (from ``os``
    where it has it, else from libc through ctypes); None elsewhere.

    A sink starts the writeback of each chunk it wrote while the next one is being encoded,
    so the final fsync finds little left to write. Only a head start: the fsync is still what
    makes the file durable, and an error here (a filesystem that does not support it) is ignored.
    """
    if hasattr(os, "sync_file_range"):  # not in CPython's os up to 3.13
        return lambda fd, offset, count: os.sync_file_range(fd, offset, count, _SYNC_FILE_RANGE_WRITE)  # type: ignore[attr-defined]
    if os.uname().sysname != "Linux":
        return None
    try:
        import ctypes

        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (ImportError, OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    function.restype = ctypes.c_int
    return lambda fd, offset, count: function(fd, offset, count, _SYNC_FILE_RANGE_WRITE)
