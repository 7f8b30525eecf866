"""Object-storage backend: S3 through s3fs, or any other fsspec filesystem (S6).

On S3 a records file streams as a multipart upload, in parts of ``block_size`` bytes with
at most ``upload_concurrency`` parts in flight, to a temporary object
``<participant dir>/.gymckpt-tmp-<hex>.part``. Only the complete object is copied
server-side to ``records-<sha256>.jsonl`` (a copy appears whole or not at all) and the
temporary object deleted, so no object ever appears under a digest name before its
content is complete. A records file of at most ``single_put_bytes`` never leaves memory
before publication, which PUTs it under its digest name in one request (all or
nothing), saving the upload-then-copy of larger files. A
failed or stopped write aborts its multipart upload and deletes its temporary object.
Manifests and ``checkpoint.json`` are created with ``If-None-Match: *``; a ``412``
(also on the retry of a request whose first attempt succeeded unseen) and a request
whose outcome is unknown are resolved by reading the object back and comparing bytes.
Object storage has no directory fsync, and this backend says so.

Errors are translated in one place (:func:`_translate`): a missing object is
``FileNotFoundError``; rejected or missing credentials, a missing bucket on reads and
any other failure are :class:`~gymckpt.errors.StorageError`; a missing bucket or denied
access on writes is :class:`~gymckpt.errors.UnusableDirectory`.

Storage options this backend reads itself (strings, as ``gymckpt -o KEY=VALUE`` passes
them, are accepted too); every other option goes to the fsspec filesystem (for s3fs:
``key``, ``secret``, ``token``, ``client_kwargs``, ``config_kwargs``, …):

``endpoint_url``
    S3-compatible endpoint; defaults to ``AWS_ENDPOINT_URL_S3``, then ``AWS_ENDPOINT_URL``.
``region``
    Region name (else ``AWS_DEFAULT_REGION`` or the botocore default).
``block_size``
    Multipart part size in bytes, default 16 MiB, at least 5 MiB (S3's minimum part).
    Memory per write is about ``(upload_concurrency + 1) * block_size``.
``upload_concurrency``
    Parts uploaded at once per write, default 2.
``single_put_bytes``
    Records files up to this size are held in memory and written with one PUT under
    their digest name (no temporary object, no server-side copy); default 64 MiB,
    never less than ``block_size``. Memory per write is at most this plus the above.
``retries``
    Attempts per request: s3fs's retry loop and botocore's ``total_max_attempts``
    (standard mode) both get it. Default: theirs (s3fs 5, botocore's configured mode).
``unsafe_allow_non_atomic_create``
    Open a filesystem that cannot create a file only if absent; two racing writers can
    then both "win" (see :meth:`FsspecBackend.create_if_absent`). Off by default.

Lifetime: the backend creates its own filesystem instance (``skip_instance_cache=True``,
listings cache off), shared with nobody, and closes its connections in :meth:`close`.
Incomplete multipart uploads are invisible to listings and to ``gymckpt verify``; a
process killed mid-upload leaves one behind, so give buckets a lifecycle rule
``AbortIncompleteMultipartUpload``.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import io
import logging
import os
import secrets
import time
from collections import deque
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.asyn import sync

from gymckpt.errors import GymckptError, ManifestConflict, StorageError, UnsupportedStorage, UnusableDirectory
from gymckpt.store._local import TEMP_PREFIX
from gymckpt.store.backend import BlobSink, StorageBackend, join, safe_relative_path

if TYPE_CHECKING:
    from collections.abc import Iterator
    from concurrent.futures import Future
    from typing import BinaryIO

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_UPLOAD_CONCURRENCY", "MIN_BLOCK_SIZE", "FsspecBackend"]

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16 << 20
MIN_BLOCK_SIZE = 5 << 20
DEFAULT_UPLOAD_CONCURRENCY = 2
DEFAULT_SINGLE_PUT_BYTES = 64 << 20
#: larger objects need a multipart copy (UploadPartCopy), which s3fs's copy does
_MAX_SINGLE_COPY = 5 << 30
#: conditional writes answered 409 ConditionalRequestConflict are retried this often
_CONFLICT_ATTEMPTS = 5

_S3_PROTOCOLS = frozenset({"s3", "s3a"})
_CREDENTIAL_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AuthorizationHeaderMalformed",
        "InvalidClientTokenId",
    }
)
_CREDENTIAL_EXCEPTIONS = frozenset({"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"})
_DENIED_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "403"})
_OWN_OPTIONS = frozenset(
    {"block_size", "upload_concurrency", "single_put_bytes", "retries", "region", "unsafe_allow_non_atomic_create"}
)
_INT_OPTIONS = ("block_size", "upload_concurrency", "single_put_bytes", "retries", "max_concurrency")
_BOOL_OPTIONS = ("unsafe_allow_non_atomic_create", "anon", "use_ssl", "requester_pays", "version_aware")


def _backend_errors() -> tuple[type[BaseException], ...]:
    """The exception types object storage raises besides OSError."""
    found: list[type[BaseException]] = [OSError]
    try:
        from botocore.exceptions import BotoCoreError, ClientError

        found += [BotoCoreError, ClientError]
    except ImportError:  # pragma: no cover - botocore comes with s3fs
        pass
    try:
        import aiohttp

        found.append(aiohttp.ClientError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(found)


_BACKEND_ERRORS = _backend_errors()


def _error_code(exc: BaseException) -> str:
    """The S3 error code (``NoSuchBucket``, ``AccessDenied``…) behind ``exc``, if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            if code:
                return str(code)
        current = current.__cause__ or current.__context__
    return ""


def _exception_names(exc: BaseException) -> set[str]:
    """Class names of ``exc`` and of the exceptions it was raised from."""
    names: set[str] = set()
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        names.add(type(current).__name__)
        current = current.__cause__ or current.__context__
    return names


def _translate(exc: BaseException, path: str, action: str, *, writing: bool) -> BaseException:
    """The one place an object-storage error becomes a gymckpt error (or FileNotFoundError)."""
    code = _error_code(exc)
    reason = str(exc) or type(exc).__name__
    detail = f"cannot {action} {path}: {reason}"
    if code in _CREDENTIAL_CODES or _exception_names(exc) & _CREDENTIAL_EXCEPTIONS:
        return StorageError(f"{detail} (credentials missing or rejected)", path=path, errno=errno.EACCES)
    if code == "NoSuchBucket":
        if writing:
            return UnusableDirectory(f"{detail} (the bucket does not exist)", path=path)
        return StorageError(f"{detail} (the bucket does not exist)", path=path, errno=errno.ENOENT)
    if code == "NoSuchUpload":
        return StorageError(f"{detail} (the multipart upload vanished)", path=path, errno=errno.EIO)
    if isinstance(exc, FileNotFoundError) or code in {"NoSuchKey", "404"}:
        return FileNotFoundError(errno.ENOENT, f"{path} does not exist", path)
    if isinstance(exc, PermissionError) or code in _DENIED_CODES:
        if writing:
            return UnusableDirectory(f"{detail} (access denied)", path=path)
        return StorageError(f"{detail} (access denied)", path=path, errno=errno.EACCES)
    return StorageError(detail, path=path, errno=getattr(exc, "errno", None) or errno.EIO)


@contextmanager
def _storage_errors(path: str, action: str, *, writing: bool = False) -> Iterator[None]:
    """Translate what the storage raises inside the block (typed gymckpt errors pass through)."""
    try:
        yield
    except (GymckptError, FileExistsError):
        raise  # FileExistsError: create_if_absent resolves it by reading the object back
    except _BACKEND_ERRORS as exc:
        raise _translate(exc, path, action, writing=writing) from exc


def _addressable(relative: str) -> bool:
    """True when a listed key maps back to itself through :func:`safe_relative_path`."""
    try:
        return safe_relative_path(relative) == relative
    except GymckptError:
        return False


def _coerce_options(options: dict[str, Any]) -> dict[str, Any]:
    """Options as typed values; ``-o block_size=8388608`` on the command line gives strings."""
    coerced = dict(options)
    for name in _INT_OPTIONS:
        if isinstance(coerced.get(name), str):
            try:
                coerced[name] = int(coerced[name])
            except ValueError:
                raise UnsupportedStorage(f"storage option {name} must be an integer, got {coerced[name]!r}") from None
    for name in _BOOL_OPTIONS:
        value = coerced.get(name)
        if isinstance(value, str):
            lowered = value.strip().lower()
            if lowered not in {"1", "0", "true", "false", "yes", "no", "on", "off"}:
                raise UnsupportedStorage(f"storage option {name} must be true or false, got {value!r}")
            coerced[name] = lowered in {"1", "true", "yes", "on"}
    return coerced


def _s3_options(options: dict[str, Any], retries: int | None) -> dict[str, Any]:
    """Map our S3 options to s3fs's: endpoint from AWS_* variables, region, retries."""
    options = dict(options)
    endpoint = (
        options.pop("endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    )
    if endpoint:
        options["endpoint_url"] = endpoint
    region = options.pop("region", None) or options.pop("region_name", None)
    if region:
        options["client_kwargs"] = {**(options.get("client_kwargs") or {}), "region_name": region}
    if retries is not None:
        if retries < 1:
            raise UnsupportedStorage(f"storage option retries must be at least 1, got {retries}")
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": retries, "mode": "standard"})
        options["config_kwargs"] = config
    return options


#: options fsspec's base class and its instance cache consume themselves
_FSSPEC_BASE_OPTIONS = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"})


def _check_options(url: str, protocol: str, options: dict[str, Any]) -> None:
    """Refuse what fsspec would only fail on at the first request, or silently ignore.

    A chained URL (``s3://b/x::memory://y``) and an option that no ``__init__`` of the
    filesystem class names are refused here, at open, as :class:`UnsupportedStorage`.
    """
    if "::" in url:
        raise UnsupportedStorage(f"{url!r} is a chained fsspec URL: name one filesystem (e.g. s3://bucket/prefix)")
    try:
        cls = fsspec.get_filesystem_class(protocol or "file")
    except (ImportError, ValueError) as exc:
        raise UnsupportedStorage(f"cannot open {url!r}: {exc} (for s3://: pip install 'gymckpt[s3]')") from exc
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
            f"storage options {unknown} are not options of {cls.__name__} for {url!r}; "
            f"gymckpt's own: {sorted(_OWN_OPTIONS)}"
        )


class FsspecBackend(StorageBackend):
    """Checkpoint files on object storage (S3 via s3fs) or any fsspec filesystem.

    Parameters
    ----------
    url:
        ``s3://bucket/prefix`` (or another fsspec URL); the store's root.
    storage_options:
        See the module docstring: ``endpoint_url``, ``key``, ``secret``, ``region``,
        ``block_size``, ``upload_concurrency``, ``retries``, ``unsafe_allow_non_atomic_create``;
        the rest goes to the filesystem.

    Raises
    ------
    UnsupportedStorage
        The filesystem cannot create a file only if it is absent (and the unsafe mode was
        not chosen), or an option is invalid.
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        self.url = url
        options = _coerce_options(storage_options)
        self.block_size = int(options.pop("block_size", DEFAULT_BLOCK_SIZE))
        self.upload_concurrency = int(options.pop("upload_concurrency", DEFAULT_UPLOAD_CONCURRENCY))
        self.single_put_bytes = max(int(options.pop("single_put_bytes", DEFAULT_SINGLE_PUT_BYTES)), self.block_size)
        retries: int | None = options.pop("retries", None)
        self.unsafe_non_atomic_create = bool(options.pop("unsafe_allow_non_atomic_create", False))
        if self.upload_concurrency < 1:
            raise UnsupportedStorage(f"upload_concurrency must be at least 1, got {self.upload_concurrency}")
        protocol = url.split("://", 1)[0].lower() if "://" in url else ""
        self.is_s3 = protocol in _S3_PROTOCOLS
        if self.is_s3:
            options = _s3_options(options, retries)
            if self.block_size < MIN_BLOCK_SIZE:
                raise UnsupportedStorage(
                    f"block_size {self.block_size} is below S3's minimum part size of {MIN_BLOCK_SIZE} bytes"
                )
        else:
            ignored = sorted(
                {"block_size", "upload_concurrency", "single_put_bytes", "retries"}.intersection(storage_options)
            )
            if ignored:
                raise UnsupportedStorage(
                    f"storage options {ignored} apply to s3:// URLs only; {url!r} would ignore them"
                )
        _check_options(url, protocol, options)
        options["skip_instance_cache"] = True  # this backend owns its filesystem; fsspec shares cached ones
        options["use_listings_cache"] = False  # listings must never come from a stale cache
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **options)
        except ImportError as exc:
            raise UnsupportedStorage(
                f"{url!r} needs the filesystem's package: pip install 'gymckpt[s3]' ({exc})"
            ) from exc
        except (ValueError, TypeError) as exc:
            raise UnsupportedStorage(f"cannot open {url!r}: {exc}") from exc
        if retries is not None and self.is_s3:
            self.fs.retries = retries
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

    # --- capabilities

    @property
    def supports_directory_fsync(self) -> bool:
        return False

    @property
    def supports_conditional_create(self) -> bool:
        """True on S3 (``If-None-Match: *``); False elsewhere (exists-then-write)."""
        return self.is_s3

    # --- paths

    def full_path(self, path: str) -> str:
        """The filesystem path (``bucket/prefix/...``) of a store-relative path."""
        relative = safe_relative_path(path)
        return f"{self.root}/{relative}" if relative else self.root

    def bucket_key(self, path: str) -> tuple[str, str]:
        """Bucket and key of a store-relative path (S3 only)."""
        bucket, key, _ = self.fs.split_path(self.full_path(path))
        return bucket, key

    def _relative(self, full: str) -> str | None:
        full = full.rstrip("/")
        prefix = self.root + "/"
        return full[len(prefix) :] if full.startswith(prefix) else None

    # --- writing

    def open_sink(self, directory: str) -> BlobSink:
        if self.is_s3:
            return _MultipartSink(self, directory)
        return _FileSink(self, directory)

    def create_if_absent(self, path: str, data: bytes) -> bool:
        """Create ``path`` with ``data`` unless it exists; on S3 with ``If-None-Match: *``.

        A 412 (the object exists, possibly because a retried request's first attempt
        succeeded) and a transport failure alike are resolved by reading the object:
        the same bytes are success (False), other bytes :class:`ManifestConflict`.

        Without conditional create (the ``unsafe_allow_non_atomic_create`` mode) this is
        exists-then-write: two racing writers can both write, and the last one wins.
        Never use that mode with more than one writer per participant.
        """
        safe_relative_path(path)
        data = bytes(data)
        if not self.supports_conditional_create:
            if self.exists(path):
                return self._resolve_existing(path, data)
            full = self.full_path(path)
            with _storage_errors(path, "write", writing=True):
                self.fs.makedirs(full.rpartition("/")[0], exist_ok=True)
                self.fs.pipe_file(full, data)
            return True
        bucket, key = self.bucket_key(path)
        for attempt in range(_CONFLICT_ATTEMPTS):
            try:
                with _storage_errors(path, "create", writing=True):
                    self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
                return True
            except FileExistsError:
                return self._resolve_existing(path, data)
            except StorageError as exc:
                if _error_code(exc) in {"ConditionalRequestConflict", "409"} and attempt + 1 < _CONFLICT_ATTEMPTS:
                    time.sleep(0.05 * 2**attempt)  # another conditional write on this key is in flight
                    continue
                # the outcome is unknown (the request may have been applied): look
                try:
                    existing: bytes | None = self.read_bytes(path)
                except (FileNotFoundError, StorageError):
                    existing = None
                if existing is None:
                    raise
                return self._compare(path, existing, data)
        raise AssertionError("unreachable")  # pragma: no cover

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
        with _storage_errors(path, "delete", writing=True):
            if self.is_s3:
                bucket, key = self.bucket_key(path)
                self.fs.call_s3("delete_object", Bucket=bucket, Key=key)
                return
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
        if not self.is_s3:
            with _storage_errors(path, "open"):
                return self.fs.open(self.full_path(path), "rb")
        bucket, key = self.bucket_key(path)
        with _storage_errors(path, "open"):
            response = self.fs.call_s3("get_object", Bucket=bucket, Key=key)
        return _ObjectReader(self, path, response["Body"])  # type: ignore[return-value]

    def read_bytes(self, path: str) -> bytes:
        with self.open_read(path) as stream:
            return stream.read()

    def size(self, path: str) -> int:
        if self.is_s3:
            bucket, key = self.bucket_key(path)
            with _storage_errors(path, "stat"):
                return int(self.fs.call_s3("head_object", Bucket=bucket, Key=key)["ContentLength"])
        full = self.full_path(path)
        self.fs.invalidate_cache(full)
        with _storage_errors(path, "stat"):
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
            with _storage_errors(path or ".", "list"):
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

    def walk_files(self, path: str = "") -> Iterator[str]:
        """Every file under ``path`` from one recursive listing (no per-directory requests)."""
        full = self.full_path(path)
        self.fs.invalidate_cache(full)
        try:
            with _storage_errors(path or ".", "list"):
                found = self.fs.find(full, detail=False)
        except FileNotFoundError:
            return
        below = safe_relative_path(path)
        for name in sorted(found):
            if name.endswith("/"):
                continue  # a directory placeholder object
            relative = self._relative(name)
            if not relative or (below and not relative.startswith(below + "/")):
                continue
            if not _addressable(relative):
                logger.warning("skipping %s: a key with empty, '.' or '..' segments cannot be read back", name)
                continue
            yield relative

    # --- lifetime

    def close(self) -> None:
        """Close the connections of this backend's own filesystem instance."""
        self._release()

    def _release(self) -> None:
        fs = getattr(self, "fs", None)
        creator = getattr(fs, "_s3creator", None)
        if fs is None or creator is None or getattr(fs, "_s3", None) is None:
            return
        try:
            sync(fs.loop, creator.__aexit__, None, None, None, timeout=5)
        except Exception as exc:  # closing must never fail a caller
            logger.debug("closing the S3 client failed: %s", exc)
        fs._s3 = None

    def __repr__(self) -> str:
        return f"FsspecBackend({self.url!r})"


class _MultipartSink(BlobSink):
    """A records file streamed to a temporary S3 object, copied to its digest name on publish."""

    def __init__(self, backend: FsspecBackend, directory: str) -> None:
        self._backend = backend
        self._fs = backend.fs
        self._directory = safe_relative_path(directory)
        self.temp_path = join(self._directory, f"{TEMP_PREFIX}{secrets.token_hex(8)}.part")
        self._bucket, self._key = backend.bucket_key(self.temp_path)
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._submitted = 0
        self._parts: list[dict[str, Any]] = []
        self._inflight: deque[tuple[int, Future[Any]]] = deque()
        self._size = 0
        self._object_may_exist = False
        self._stray_uploads_possible = False
        self._state = "writing"

    def write(self, chunk: bytes | memoryview) -> None:
        assert self._state == "writing", f"write after {self._state}"
        self._buffer += chunk
        self._size += len(chunk)
        if self._upload_id is None and len(self._buffer) <= self._backend.single_put_bytes:
            return  # may still fit one PUT under the digest name
        block = self._backend.block_size
        while len(self._buffer) >= block:
            part = bytes(memoryview(self._buffer)[:block])
            del self._buffer[:block]
            self._send(part)

    def _send(self, part: bytes) -> None:
        if self._upload_id is None:
            # a create whose answer was lost and retried leaves an upload we never hear of
            self._stray_uploads_possible = True
            with _storage_errors(self.temp_path, "start a multipart upload of", writing=True):
                response = self._fs.call_s3("create_multipart_upload", Bucket=self._bucket, Key=self._key)
            self._upload_id = response["UploadId"]
            self._stray_uploads_possible = response.get("ResponseMetadata", {}).get("RetryAttempts", 0) > 0
        self._submitted += 1
        coroutine = self._fs._call_s3(
            "upload_part",
            Bucket=self._bucket,
            Key=self._key,
            UploadId=self._upload_id,
            PartNumber=self._submitted,
            Body=part,
        )
        self._inflight.append((self._submitted, asyncio.run_coroutine_threadsafe(coroutine, self._fs.loop)))
        while len(self._inflight) > self._backend.upload_concurrency:
            self._settle_oldest()

    def _settle_oldest(self) -> None:
        number, future = self._inflight.popleft()
        with _storage_errors(self.temp_path, f"upload part {number} of", writing=True):
            response = future.result()
        self._parts.append({"PartNumber": number, "ETag": response["ETag"]})

    def finish(self) -> None:
        assert self._state == "writing", f"finish after {self._state}"
        if self._upload_id is None:
            # small enough for one PUT: publish() writes it under its final name in one atomic request
            self._state = "finished"
            return
        if self._buffer:
            self._send(bytes(self._buffer))
        while self._inflight:
            self._settle_oldest()
        self._object_may_exist = True
        try:
            with _storage_errors(self.temp_path, "complete the multipart upload of", writing=True):
                self._fs.call_s3(
                    "complete_multipart_upload",
                    Bucket=self._bucket,
                    Key=self._key,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": self._parts},
                )
        except StorageError:
            # a retried complete whose first attempt succeeded answers NoSuchUpload on
            # S3: the temporary key is unique to this sink, so a whole object there is ours
            if not self._lands_whole(self.temp_path):
                raise
        self._upload_id = None
        if self._stray_uploads_possible:
            self._abort_stray_uploads()
        self._buffer = bytearray()
        self._state = "finished"

    def _lands_whole(self, path: str) -> bool:
        """True when an object of exactly the written size is at ``path``."""
        try:
            return self._backend.size(path) == self._size
        except (FileNotFoundError, StorageError):
            return False

    def publish(self, name: str) -> None:
        assert self._state == "finished", f"publish after {self._state}"
        target = join(self._directory, name)
        bucket, key = self._backend.bucket_key(target)
        try:
            if not self._object_may_exist:  # a single part, still in memory: one PUT, all or nothing
                with _storage_errors(target, "write", writing=True):
                    self._fs.call_s3("put_object", Bucket=bucket, Key=key, Body=bytes(self._buffer))
            else:
                with _storage_errors(target, "copy into place", writing=True):
                    if self._size < _MAX_SINGLE_COPY:
                        self._fs.call_s3(
                            "copy_object", Bucket=bucket, Key=key, CopySource={"Bucket": self._bucket, "Key": self._key}
                        )
                    else:
                        self._fs.copy(self._backend.full_path(self.temp_path), self._backend.full_path(target))
        except StorageError:
            # the request may have been applied with its answer lost: the digest names the
            # content, and a PUT or copy lands whole, so an object of our size there is ours
            if not self._lands_whole(target):
                raise
        self._buffer = bytearray()
        self._state = "published"
        if not self._object_may_exist:
            return
        try:
            self._backend.delete(self.temp_path)
        except (StorageError, OSError) as exc:  # published: a leftover temporary object is only a warning
            logger.warning("could not delete %s after publishing %s: %s", self.temp_path, target, exc)

    def abort(self) -> None:
        if self._state in {"published", "aborted"}:
            return
        self._state = "aborted"
        self._buffer = bytearray()
        while self._inflight:  # let parts in flight land, or an abort can leave them stored
            _, future = self._inflight.popleft()
            try:
                future.result(timeout=120)
            except Exception:
                pass
        if self._upload_id is not None:
            try:
                with _storage_errors(self.temp_path, "abort the multipart upload of", writing=True):
                    self._fs.call_s3(
                        "abort_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=self._upload_id
                    )
            except (StorageError, OSError) as exc:
                if _error_code(exc) != "NoSuchUpload":
                    logger.warning("could not abort the multipart upload of %s: %s", self.temp_path, exc)
            self._upload_id = None
        if self._stray_uploads_possible:
            self._abort_stray_uploads()
        if self._object_may_exist:
            try:
                self._backend.delete(self.temp_path)
            except (StorageError, OSError) as exc:  # verify reports the leftover
                logger.warning("could not delete %s: %s", self.temp_path, exc)

    def _abort_stray_uploads(self) -> None:
        """Abort every upload still open on this sink's temporary key (unique to it)."""
        try:
            with _storage_errors(self.temp_path, "list the multipart uploads of", writing=True):
                listing = self._fs.call_s3("list_multipart_uploads", Bucket=self._bucket, Prefix=self._key)
            for upload in listing.get("Uploads", []):
                if upload.get("Key") == self._key:
                    with _storage_errors(self.temp_path, "abort the multipart upload of", writing=True):
                        self._fs.call_s3(
                            "abort_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=upload["UploadId"]
                        )
            self._stray_uploads_possible = False
        except (StorageError, OSError) as exc:
            logger.warning("could not abort the stray multipart uploads of %s: %s", self.temp_path, exc)


class _FileSink(BlobSink):
    """A records file on a filesystem without multipart uploads: temporary file, then move."""

    def __init__(self, backend: FsspecBackend, directory: str) -> None:
        self._backend = backend
        self._fs = backend.fs
        self._directory = safe_relative_path(directory)
        self.temp_path = join(self._directory, f"{TEMP_PREFIX}{secrets.token_hex(8)}.part")
        full = backend.full_path(self.temp_path)
        with _storage_errors(self.temp_path, "create", writing=True):
            self._fs.makedirs(backend.full_path(self._directory), exist_ok=True)
            self._file: Any = self._fs.open(full, "wb")
        self._state = "writing"

    def write(self, chunk: bytes | memoryview) -> None:
        with _storage_errors(self.temp_path, "write", writing=True):
            self._file.write(chunk)

    def finish(self) -> None:
        with _storage_errors(self.temp_path, "write", writing=True):
            self._file.close()
        self._state = "finished"

    def publish(self, name: str) -> None:
        target = join(self._directory, name)
        with _storage_errors(target, "move into place", writing=True):
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


class _ObjectReader(io.RawIOBase):
    """One streamed GET of an S3 object, read in the sizes the caller asks for."""

    def __init__(self, backend: FsspecBackend, path: str, body: Any) -> None:
        super().__init__()
        self._loop = backend.fs.loop
        self._path = path
        self._body = body

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        if self._body is None:
            raise ValueError("read from a closed stream")
        with _storage_errors(self._path, "read"):
            return sync(self._loop, self._read, -1 if size is None else size)

    async def _read(self, size: int) -> bytes:
        if size < 0:
            return await self._body.read()
        pieces: list[bytes] = []
        wanted = size
        while wanted > 0:
            piece = await self._body.read(wanted)
            if not piece:
                break
            pieces.append(piece)
            wanted -= len(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        body, self._body = self._body, None
        if body is not None:

            async def close_body() -> None:
                body.close()

            try:
                sync(self._loop, close_body, timeout=5)
            except Exception:
                pass
        super().close()
