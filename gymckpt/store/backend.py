"""The small interface every storage backend implements.

Paths are relative to the backend's root, ``/``-separated, and never escape it
(:func:`safe_relative_path`). A backend states what it can do as properties instead of
pretending: object storage has no directory fsync, and a store that cannot create a
file only if it is absent cannot publish a manifest safely. Where a capability can only be
learnt from the storage itself (a local mount without ``link()``), the backend asks before a
commit writes its first byte there and keeps the answer: :meth:`StorageBackend.open_sink`
refuses such a directory with :class:`~gymckpt.errors.UnsupportedStorage`, and
``supports_conditional_create`` turns False from then on.

Only regular files are state: a backend that can meet symlinks, FIFOs or devices (the
local one) never follows or opens them, refuses them with
:class:`~gymckpt.errors.NotRegularFile`, and lists them in :meth:`StorageBackend.walk_entries`.

Note for implementers: :meth:`StorageBackend.walk_files`, :meth:`StorageBackend.walk_entries`
and :meth:`StorageBackend.size` have slow-but-correct defaults built on the other methods;
override them where the storage can answer directly.
"""

from __future__ import annotations

import posixpath
from abc import ABC, abstractmethod
from enum import StrEnum
from typing import TYPE_CHECKING

from gymckpt.errors import RecordsPathEscapes

if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import BinaryIO

__all__ = ["BlobSink", "EntryKind", "StorageBackend", "join", "read_limited", "safe_relative_path"]


class EntryKind(StrEnum):
    """What a listed entry is; real directories are descended, never listed."""

    FILE = "file"
    SYMLINK = "symlink"
    #: a FIFO, socket or device
    SPECIAL = "special"


def safe_relative_path(path: str) -> str:
    """Normalize a store-relative path; refuse one that is absolute or climbs out with ``..``."""
    if "\\" in path or "\x00" in path:
        raise RecordsPathEscapes(f"path {path!r} holds a backslash or NUL")
    normalized = posixpath.normpath(path) if path else "."
    if normalized.startswith("/") or normalized == ".." or normalized.startswith("../"):
        raise RecordsPathEscapes(f"path {path!r} leaves the store's root")
    return "" if normalized == "." else normalized


def join(*parts: str) -> str:
    """Join store-relative path parts, skipping empty ones."""
    return "/".join(part.strip("/") for part in parts if part and part.strip("/"))


def read_limited(backend: StorageBackend, path: str, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of ``path``: more than ``limit`` tells the caller the file is too large."""
    parts: list[bytes] = []
    wanted = limit + 1
    with backend.open_read(path) as stream:
        while wanted > 0 and (chunk := stream.read(min(wanted, 1 << 20))):
            parts.append(chunk)
            wanted -= len(chunk)
    return b"".join(parts)


class BlobSink(ABC):
    """A file being written to a temporary place; it becomes visible only by :meth:`publish`."""

    #: True for a sink that would rather keep the chunks it is given than copy them: the records
    #: writer then fills a new buffer for each chunk and hands it over with :meth:`adopt`
    keeps_chunks: bool = False

    @abstractmethod
    def write(self, chunk: bytes | memoryview) -> None:
        """Append ``chunk``; may run on a worker thread, never concurrently with itself.

        ``chunk`` is valid only during the call: the records writer fills the same buffer again
        once ``write`` returns, so a sink copies whatever it keeps of it (bytes, a buffer's ``+=``).
        """

    def adopt(self, chunk: memoryview) -> None:
        """Append ``chunk``, whose buffer the caller hands over and never changes again: a sink that
        :attr:`keeps_chunks` keeps it as it is. Only ever called for such a sink; by default
        :meth:`write` (so a wrapper that forwards only ``write`` stays correct)."""
        self.write(chunk)

    def append_target(self) -> str | None:
        """A path another process of this host may open to append to this sink's file
        (``O_WRONLY | O_APPEND``), or None (the default): every byte then goes through :meth:`write`.

        After such an append the caller hands the sink the count (:meth:`adopt_appended`)
        before it writes again, and reads the bytes back (:meth:`read_appended`) to check and hash them.
        """
        return None

    def adopt_appended(self, size: int, producer: str = "another process") -> None:
        """Take the ``size`` bytes ``producer`` appended at the end as written; raises
        :class:`~gymckpt.errors.StorageError` when the file did not grow by exactly that much."""
        raise NotImplementedError(f"{type(self).__name__} takes no appends from other processes")

    def read_appended(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes of the file from ``offset`` (what :meth:`adopt_appended` took)."""
        raise NotImplementedError(f"{type(self).__name__} takes no appends from other processes")

    @abstractmethod
    def finish(self) -> None:
        """Make the written bytes durable (flush and fsync, or complete the upload)."""

    @abstractmethod
    def publish(self, name: str) -> None:
        """Make the finished content visible as ``name`` in the sink's directory, atomically.

        Replacing an existing file of that name is allowed: callers only publish under
        names derived from the content's digest.
        """

    @abstractmethod
    def abort(self) -> None:
        """Discard everything written; idempotent, and a no-op after :meth:`publish`."""


class StorageBackend(ABC):
    """Where checkpoint files live: a local directory, memory, or an fsspec filesystem."""

    #: the URL or path this backend was opened with
    url: str

    @property
    @abstractmethod
    def supports_directory_fsync(self) -> bool:
        """True when :meth:`sync_directories` makes directory entries durable."""

    @property
    @abstractmethod
    def supports_conditional_create(self) -> bool:
        """True when :meth:`create_if_absent` is atomic against concurrent writers."""

    @abstractmethod
    def open_sink(self, directory: str) -> BlobSink:
        """Start a streamed write in ``directory`` (created as needed).

        Raises :class:`~gymckpt.errors.UnsupportedStorage`, before anything is written, when the
        directory's storage lacks a capability publishing there needs.
        """

    @abstractmethod
    def open_read(self, path: str) -> BinaryIO:
        """Open ``path`` for streamed reading; raises ``FileNotFoundError`` if absent."""

    @abstractmethod
    def read_bytes(self, path: str) -> bytes:
        """Return a small file's bytes; raises ``FileNotFoundError`` if absent."""

    @abstractmethod
    def create_if_absent(self, path: str, data: bytes) -> bool:
        """Create ``path`` with ``data`` only if it does not exist, durably.

        Returns True when this call created it and False when identical bytes were
        already there (a retry). Raises :class:`~gymckpt.errors.ManifestConflict` when
        different bytes are there.
        """

    @abstractmethod
    def replace(self, path: str, data: bytes) -> None:
        """Write ``path`` with ``data`` whether or not it exists, atomically and durably.

        A reader sees the old bytes or the new ones, never a mix. Only for small mutable
        pointers (a collector's ``LATEST``): checkpoint files are created once, never replaced.
        """

    @abstractmethod
    def exists(self, path: str) -> bool:
        """True when a file exists at ``path``."""

    @abstractmethod
    def list_dir(self, path: str) -> list[str]:
        """Names directly under ``path``; sub-directories end with ``/``. Empty if absent."""

    @abstractmethod
    def delete(self, path: str) -> None:
        """Delete the file at ``path``; a missing file is not an error."""

    @abstractmethod
    def sync_directories(self, path: str, up_to: str = "") -> None:
        """Make the entries of ``path`` and each parent up to ``up_to`` durable."""

    def size(self, path: str) -> int:
        """Size of the file at ``path`` in bytes (default: reads it through)."""
        total = 0
        with self.open_read(path) as stream:
            while chunk := stream.read(1 << 20):
                total += len(chunk)
        return total

    def delete_tree(self, path: str) -> int:
        """Delete every file under the directory ``path``, then the directories left empty; how many files.

        A missing directory is not an error. The store's root is refused (``ValueError``).
        """
        if not safe_relative_path(path):
            raise ValueError("delete_tree refuses the store's root")
        removed = 0
        for child, _ in list(self.walk_entries(path)):
            self.delete(child)
            removed += 1
        self._remove_empty_directories(path)
        return removed

    def _remove_empty_directories(self, path: str) -> None:
        """Remove the directories under ``path`` and ``path`` itself once empty (none on object storage)."""

    def walk_files(self, path: str = "") -> Iterator[str]:
        """Every file under ``path``, as store-relative paths (default: recursive list_dir)."""
        pending = [path]
        while pending:
            directory = pending.pop()
            for name in sorted(self.list_dir(directory), reverse=True):
                child = join(directory, name)
                if name.endswith("/"):
                    pending.append(child)
                else:
                    yield child

    def walk_entries(self, path: str = "") -> Iterator[tuple[str, EntryKind]]:
        """Every entry under ``path`` that is not a real directory, with its kind.

        Default: every path of :meth:`walk_files` is a regular file (object storage has no
        symlinks); a backend that can meet symlinks or special files overrides this.
        """
        for child in self.walk_files(path):
            yield child, EntryKind.FILE

    def close(self) -> None:
        """Release what the backend holds (connections, an owned filesystem, the local root's descriptor)."""
