"""Backend for any fsspec filesystem; what is particular to S3 is in :mod:`gymckpt.store._s3`.

A records file is written to a temporary file ``<participant dir>/.gymckpt-tmp-<hex>.part``
and moved to its digest name on publication; a failed or stopped write deletes it. These
filesystems cannot create a file only if it is absent, so one is refused unless the caller
accepts exists-then-write (``unsafe_allow_non_atomic_create``). There is no directory
fsync here, and this backend says so.

Errors are translated in one place per backend (:meth:`FsspecBackend._translate`): a
missing file is ``FileNotFoundError``; denied access on writes is
:class:`~gymckpt.errors.UnusableDirectory`; denied access on reads and any other failure
are :class:`~gymckpt.errors.StorageError`.

Storage options are passed to the fsspec filesystem, except the one this backend reads
itself (strings, as ``gymckpt -o KEY=VALUE`` passes them, are accepted too). A chained URL,
an option that no ``__init__`` of the filesystem class names, and an S3-only option are
refused at open rather than ignored:

``unsafe_allow_non_atomic_create``
    Open a filesystem that cannot create a file only if absent; two racing writers can
    then both "win" (see :meth:`FsspecBackend.create_if_absent`). Off by default.

Lifetime: the backend creates its own filesystem instance (``skip_instance_cache=True``,
listings cache off), shared with nobody, and closes its connections in :meth:`close`.
``FsspecBackend("s3://…")`` gives an :class:`~gymckpt.store._s3.S3Backend`.
"""

from __future__ import annotations

import errno
import inspect
import logging
import secrets
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import fsspec

from gymckpt.errors import GymckptError, ManifestConflict, StorageError, UnsupportedStorage, UnusableDirectory
from gymckpt.store.backend import BlobSink, StorageBackend, join, safe_relative_path
from gymckpt.store.layout import TEMP_PREFIX

if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import BinaryIO

__all__ = ["FsspecBackend"]

logger = logging.getLogger(__name__)

#: options fsspec's base class and its instance cache consume themselves
_FSSPEC_BASE_OPTIONS = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"})


def _native_errors() -> tuple[type[BaseException], ...]:
    """The exception types fsspec filesystems raise besides OSError."""
    found: list[type[BaseException]] = [OSError]
    try:
        import aiohttp

        found.append(aiohttp.ClientError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(found)


def describe_failure(exc: BaseException, path: str, action: str) -> str:
    """``cannot <action> <path>: <reason>``, the detail of every translated error."""
    return f"cannot {action} {path}: {str(exc) or type(exc).__name__}"


def translate_failure(
    exc: BaseException, path: str, action: str, *, writing: bool, missing: bool = False, denied: bool = False
) -> BaseException:
    """A filesystem error as FileNotFoundError or a gymckpt error.

    ``missing`` and ``denied`` say what a backend learnt from the error beyond its type
    (an S3 error code).
    """
    detail = describe_failure(exc, path, action)
    if missing or isinstance(exc, FileNotFoundError):
        return FileNotFoundError(errno.ENOENT, f"{path} does not exist", path)
    if denied or isinstance(exc, PermissionError):
        if writing:
            return UnusableDirectory(f"{detail} (access denied)", path=path)
        return StorageError(f"{detail} (access denied)", path=path, errno=errno.EACCES)
    return StorageError(detail, path=path, errno=getattr(exc, "errno", None) or errno.EIO)


def temporary_path(directory: str) -> str:
    """A fresh ``.gymckpt-tmp-<hex>.part`` path in ``directory`` for a sink's unpublished bytes."""
    return join(directory, f"{TEMP_PREFIX}{secrets.token_hex(8)}.part")


def _addressable(relative: str) -> bool:
    """True when a listed key maps back to itself through :func:`safe_relative_path`."""
    try:
        return safe_relative_path(relative) == relative
    except GymckptError:
        return False


def _protocol(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else ""


def _check_options(url: str, options: dict[str, Any], own: frozenset[str]) -> None:
    """Refuse what fsspec would only fail on at the first request, or silently ignore.

    A chained URL (``s3://b/x::memory://y``) and an option that no ``__init__`` of the
    filesystem class names are refused here, at open, as :class:`UnsupportedStorage`.
    """
    if "::" in url:
        raise UnsupportedStorage(f"{url!r} is a chained fsspec URL: name one filesystem (e.g. s3://bucket/prefix)")
    try:
        cls = fsspec.get_filesystem_class(_protocol(url) or "file")
    except (ImportError, ValueError) as exc:
        raise UnsupportedStorage(
            f"cannot open {url!r}: {exc} (for s3://: pip install -e '.[s3]' in the gymckpt clone)"
        ) from exc
    known = set(_FSSPEC_BASE_OPTIONS)
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):  # pragma: no cover - a C-level __init__
            continue
        known.update(
            parameter.name
            for parameter in parameters
            if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY) and parameter.name != "self"
        )
    unknown = sorted(set(options) - known)
    if unknown:
        raise UnsupportedStorage(
            f"storage options {unknown} are not options of {cls.__name__} for {url!r}; gymckpt's own: {sorted(own)}"
        )


class FsspecBackend(StorageBackend):
    """Checkpoint files on any fsspec filesystem; an ``s3://`` URL makes an :class:`~gymckpt.store._s3.S3Backend`.

    Parameters
    ----------
    url:
        An fsspec URL (``s3://bucket/prefix``, ``local:///srv/ckpt``…); the store's root.
    storage_options:
        See the module docstring: ``unsafe_allow_non_atomic_create``; the rest goes to the
        filesystem.

    Raises
    ------
    UnsupportedStorage
        The filesystem cannot create a file only if it is absent (and the unsafe mode was
        not chosen), or an option is invalid.
    """

    #: storage options the backend reads itself, never passed to the filesystem
    own_options: ClassVar[frozenset[str]] = frozenset({"unsafe_allow_non_atomic_create"})
    #: options that may come as strings (``-o KEY=VALUE``) and are converted to int or bool
    int_options: ClassVar[tuple[str, ...]] = ("max_concurrency",)
    bool_options: ClassVar[tuple[str, ...]] = (
        "unsafe_allow_non_atomic_create",
        "anon",
        "use_ssl",
        "requester_pays",
        "version_aware",
    )
    #: what the filesystem raises that :meth:`_translate` turns into gymckpt errors
    native_errors: ClassVar[tuple[type[BaseException], ...]] = _native_errors()

    def __new__(cls, url: str, **storage_options: Any) -> FsspecBackend:
        """Give an S3Backend for ``s3://`` and ``s3a://`` URLs, as :func:`backend_for_url` does."""
        from gymckpt.store._s3 import S3Backend  # a subclass of this class

        chosen = S3Backend if cls is FsspecBackend and S3Backend.handles(url) else cls
        return super().__new__(chosen)

    def __init__(self, url: str, **storage_options: Any) -> None:
        self.url = url
        options = self._coerce_options(storage_options)
        self.unsafe_non_atomic_create = bool(options.pop("unsafe_allow_non_atomic_create", False))
        options = self._filesystem_options(options)
        _check_options(url, options, self.own_options)
        options["skip_instance_cache"] = True  # this backend owns its filesystem; fsspec shares cached ones
        options["use_listings_cache"] = False  # listings must never come from a stale cache
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **options)
        except ImportError as exc:
            raise UnsupportedStorage(
                f"{url!r} needs the filesystem's package: pip install -e '.[s3]' in the gymckpt clone ({exc})"
            ) from exc
        except (ValueError, TypeError) as exc:
            raise UnsupportedStorage(f"cannot open {url!r}: {exc}") from exc
        self.root = root.rstrip("/")
        if not self.root:
            raise UnsupportedStorage(f"{url!r} names no bucket or directory")
        if not self.supports_conditional_create and not self.unsafe_non_atomic_create:
            self._release()
            raise UnsupportedStorage(
                f"{url!r}: this filesystem has no conditional create (create a file only if it is absent, "
                "atomically), which safe manifest publication needs; pass the storage option "
                "unsafe_allow_non_atomic_create=True to accept that racing writers may overwrite each other"
            )

    # --- options

    def _coerce_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Options as typed values; ``-o block_size=8388608`` on the command line gives strings."""
        coerced = dict(options)
        for name in self.int_options:
            if isinstance(coerced.get(name), str):
                try:
                    coerced[name] = int(coerced[name])
                except ValueError:
                    raise UnsupportedStorage(
                        f"storage option {name} must be an integer, got {coerced[name]!r}"
                    ) from None
        for name in self.bool_options:
            value = coerced.get(name)
            if isinstance(value, str):
                lowered = value.strip().lower()
                if lowered not in {"1", "0", "true", "false", "yes", "no", "on", "off"}:
                    raise UnsupportedStorage(f"storage option {name} must be true or false, got {value!r}")
                coerced[name] = lowered in {"1", "true", "yes", "on"}
        return coerced

    def _filesystem_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Take this backend's own options out of ``options``; what is left goes to the filesystem."""
        from gymckpt.store._s3 import S3_ONLY_OPTIONS

        ignored = sorted(S3_ONLY_OPTIONS.intersection(options))
        if ignored:
            raise UnsupportedStorage(
                f"storage options {ignored} apply to s3:// URLs only; {self.url!r} would ignore them"
            )
        return options

    # --- capabilities

    @property
    def supports_directory_fsync(self) -> bool:
        return False

    @property
    def supports_conditional_create(self) -> bool:
        """False: exists-then-write (the S3 backend creates with ``If-None-Match: *``)."""
        return False

    # --- errors

    @contextmanager
    def storage_errors(self, path: str, action: str, *, writing: bool = False) -> Iterator[None]:
        """Translate what the storage raises inside the block (typed gymckpt errors pass through)."""
        try:
            yield
        except (GymckptError, FileExistsError):
            raise  # FileExistsError: create_if_absent resolves it by reading the file back
        except self.native_errors as exc:
            raise self._translate(exc, path, action, writing=writing) from exc

    def _translate(self, exc: BaseException, path: str, action: str, *, writing: bool) -> BaseException:
        """The one place this backend's storage errors become gymckpt errors (or FileNotFoundError)."""
        return translate_failure(exc, path, action, writing=writing)

    # --- paths

    def full_path(self, path: str) -> str:
        """The filesystem path (``bucket/prefix/...``) of a store-relative path."""
        relative = safe_relative_path(path)
        return f"{self.root}/{relative}" if relative else self.root

    # --- writing

    def open_sink(self, directory: str) -> BlobSink:
        return _FileSink(self, directory)

    def create_if_absent(self, path: str, data: bytes) -> bool:
        """Create ``path`` with ``data`` unless it exists: exists-then-write.

        This filesystem has no conditional create (the ``unsafe_allow_non_atomic_create``
        mode): two racing writers can both write, and the last one wins. Never use that
        mode with more than one writer per participant. Identical bytes already there are
        a retry (False); other bytes are :class:`ManifestConflict`.
        """
        safe_relative_path(path)
        data = bytes(data)
        if self.exists(path):
            return self._resolve_existing(path, data)
        full = self.full_path(path)
        with self.storage_errors(path, "write", writing=True):
            self.fs.makedirs(full.rpartition("/")[0], exist_ok=True)
            self.fs.pipe_file(full, data)
        return True

    def replace(self, path: str, data: bytes) -> None:
        """One whole-object write (an object store's PUT replaces atomically)."""
        safe_relative_path(path)
        full = self.full_path(path)
        with self.storage_errors(path, "write", writing=True):
            self.fs.makedirs(full.rpartition("/")[0], exist_ok=True)
            self.fs.pipe_file(full, bytes(data))

    def _resolve_existing(self, path: str, data: bytes) -> bool:
        try:
            existing = self.read_bytes(path)
        except FileNotFoundError as exc:
            raise StorageError(f"{path} existed a moment ago and is gone: deleted concurrently", path=path) from exc
        return self._compare(path, existing, data)

    @staticmethod
    def _compare(path: str, existing: bytes, data: bytes) -> bool:
        if existing != data:
            raise ManifestConflict(f"{path} already exists with other content", path=path)
        return False

    def delete(self, path: str) -> None:
        with self.storage_errors(path, "delete", writing=True):
            try:
                self.fs.rm_file(self.full_path(path))
            except FileNotFoundError:
                pass

    def sync_directories(self, path: str, up_to: str = "") -> None:
        """A no-op: object storage has no directory entries to make durable."""
        safe_relative_path(path)
        safe_relative_path(up_to)

    # --- reading

    def open_read(self, path: str) -> BinaryIO:
        with self.storage_errors(path, "open"):
            return self.fs.open(self.full_path(path), "rb")

    def read_bytes(self, path: str) -> bytes:
        with self.open_read(path) as stream:
            return stream.read()

    def size(self, path: str) -> int:
        full = self.full_path(path)
        self.fs.invalidate_cache(full)
        with self.storage_errors(path, "stat"):
            info = self.fs.info(full)
        if info.get("type") != "file":
            raise FileNotFoundError(errno.ENOENT, f"{path} is not a file", path)
        return int(info["size"])

    def exists(self, path: str) -> bool:
        try:
            self.size(path)
        except FileNotFoundError:
            return False
        return True

    def list_dir(self, path: str) -> list[str]:
        full = self.full_path(path)
        self.fs.invalidate_cache(full)
        try:
            with self.storage_errors(path or ".", "list"):
                entries = self.fs.ls(full, detail=True, refresh=True)
        except FileNotFoundError:
            return []
        names: set[str] = set()
        for entry in entries:
            name = entry["name"].rstrip("/")
            if not name.startswith(full + "/"):
                continue  # the path itself (a file), or a placeholder
            child = name[len(full) + 1 :]
            if not child or "/" in child or child in {".", ".."}:
                continue
            names.add(child + "/" if entry.get("type") == "directory" else child)
        return sorted(names)

    def walk_keys(self, path: str = "") -> Iterator[tuple[str, bool]]:
        """Every object key under ``path`` from one recursive listing (no per-directory requests), sorted,
        relative to the root as listed, and whether a store-relative path names it.

        A key with an empty, ``.`` or ``..`` segment (``a//b``, ``a/./b``, ``a/../b``), a backslash
        or a NUL is one no path reaches (:func:`safe_relative_path` makes another of it): False.
        ``verify`` reports those; every other reader skips them. A directory placeholder (a key
        ending in one ``/`` that names a directory) is not a file and is not listed.
        """
        full = self.full_path(path)
        self.fs.invalidate_cache(full)
        try:
            with self.storage_errors(path or ".", "list"):
                found = self.fs.find(full, detail=False)
        except FileNotFoundError:
            return
        below = safe_relative_path(path)
        prefix = self.root + "/"
        for name in sorted(found):
            if not name.startswith(prefix):
                continue  # the root itself
            relative = name[len(prefix) :]
            if not relative or (below and not relative.startswith(below + "/")):
                continue
            placeholder = relative.endswith("/")
            stem = relative[:-1] if placeholder else relative
            if stem and _addressable(stem):
                if not placeholder:
                    yield relative, True
                continue
            yield relative, False

    def walk_files(self, path: str = "") -> Iterator[str]:
        """Every file under ``path`` that a path names (:meth:`walk_keys`); the other keys are logged, never read."""
        for key, addressable in self.walk_keys(path):
            if addressable:
                yield key
            else:
                # %r: a key is data, and may hold control characters
                logger.warning("skipping %r: a key with empty, '.' or '..' segments cannot be read back", key)

    # --- lifetime

    def close(self) -> None:
        """Close the connections of this backend's own filesystem instance."""
        self._release()

    def _release(self) -> None:
        """Close what the filesystem holds open; nothing for a filesystem without connections of its own."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class _FileSink(BlobSink):
    """A records file on a filesystem without multipart uploads: temporary file, then move."""

    def __init__(self, backend: FsspecBackend, directory: str) -> None:
        self._backend = backend
        self._fs = backend.fs
        self._directory = safe_relative_path(directory)
        self.temp_path = temporary_path(self._directory)
        full = backend.full_path(self.temp_path)
        with backend.storage_errors(self.temp_path, "create", writing=True):
            self._fs.makedirs(backend.full_path(self._directory), exist_ok=True)
            self._file: Any = self._fs.open(full, "wb")
        self._state = "writing"

    def write(self, chunk: bytes | memoryview) -> None:
        with self._backend.storage_errors(self.temp_path, "write", writing=True):
            self._file.write(chunk)

    def finish(self) -> None:
        with self._backend.storage_errors(self.temp_path, "write", writing=True):
            self._file.close()
        self._state = "finished"

    def publish(self, name: str) -> None:
        target = join(self._directory, name)
        with self._backend.storage_errors(target, "move into place", writing=True):
            self._fs.mv(self._backend.full_path(self.temp_path), self._backend.full_path(target))
        self._state = "published"

    def abort(self) -> None:
        if self._state in {"published", "aborted"}:
            return
        self._state = "aborted"
        try:
            self._file.close()  # a partial temporary file is harmless: only its name is written
        except Exception:
            pass
        try:
            self._backend.delete(self.temp_path)
        except (StorageError, OSError) as exc:
            logger.warning("could not delete %s: %s", self.temp_path, exc)
