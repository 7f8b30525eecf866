"""S3 backend through s3fs: what S3 does differently from the generic fsspec backend.

A records file streams as a multipart upload, in parts of ``block_size`` bytes with at most
``upload_concurrency`` parts in flight, to a temporary object
``<participant dir>/.gymckpt-tmp-<hex>.part``. Only the complete object is copied
server-side to ``records-<sha256>.jsonl`` (a copy appears whole or not at all) and the
temporary object deleted, so no object ever appears under a digest name before its
content is complete. A records file of at most ``single_put_bytes`` never leaves memory
before publication, which PUTs it under its digest name in one request (all or
nothing), saving the upload-then-copy of larger files. A failed or stopped write aborts
its multipart upload and deletes its temporary object. Manifests and ``checkpoint.json``
are created with ``If-None-Match: *``; a ``412`` (also on the retry of a request whose
first attempt succeeded unseen) and a request whose outcome is unknown are resolved by
reading the object back and comparing bytes. Object storage has no directory fsync, and
this backend says so.

Errors are translated in one place (:meth:`S3Backend._translate`): a missing object is
``FileNotFoundError``; rejected or missing credentials, a missing bucket on reads and
any other failure are :class:`~gymckpt.errors.StorageError`; a missing bucket or denied
access on writes is :class:`~gymckpt.errors.UnusableDirectory`.

Storage options this backend reads itself, besides the generic backend's (strings, as
``gymckpt -o KEY=VALUE`` passes them, are accepted too); every other option goes to s3fs
(``key``, ``secret``, ``token``, ``client_kwargs``, ``config_kwargs``, …):

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

Lifetime: as the generic backend's, and :meth:`S3Backend.close` closes the S3 client. The
botocore session behind the clients is one per process (:func:`shared_session`, unless the
options pass a ``session``), so S3's service model is parsed once, not by every commit; a
server that checkpoints to S3 loads it at startup (:func:`gymckpt.store.warm.warm_storage`).
Incomplete multipart uploads are invisible to listings and to ``gymckpt verify``; a
process killed mid-upload leaves one behind, so give buckets a lifecycle rule
``AbortIncompleteMultipartUpload``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, ClassVar

from fsspec.asyn import sync

from gymckpt.errors import StorageError, UnsupportedStorage, UnusableDirectory
from gymckpt.store._fsspec import (
    FsspecBackend,
    describe_failure,
    temporary_path,
    translate_failure,
)
from gymckpt.store._s3_bodies import BufferBody, ObjectReader, rewind_bodies
from gymckpt.store.backend import BlobSink, join, safe_relative_path

if TYPE_CHECKING:
    from concurrent.futures import Future
    from typing import BinaryIO

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_UPLOAD_CONCURRENCY",
    "MIN_BLOCK_SIZE",
    "S3_ONLY_OPTIONS",
    "S3Backend",
    "shared_session",
    "warm_s3",
]

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16 << 20
MIN_BLOCK_SIZE = 5 << 20
DEFAULT_UPLOAD_CONCURRENCY = 2
DEFAULT_SINGLE_PUT_BYTES = 64 << 20
#: larger objects need a multipart copy (UploadPartCopy), which s3fs's copy does
_MAX_SINGLE_COPY = 5 << 30
#: conditional writes answered 409 ConditionalRequestConflict are retried this often
_CONFLICT_ATTEMPTS = 5

_PROTOCOLS = frozenset({"s3", "s3a"})
#: options only this backend understands; another URL refuses them rather than ignore them
S3_ONLY_OPTIONS = frozenset({"block_size", "upload_concurrency", "single_put_bytes", "retries"})
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


def _botocore_errors() -> tuple[type[BaseException], ...]:
    """botocore's exception types, which s3fs lets through untranslated."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:  # pragma: no cover - botocore comes with s3fs
        return ()
    return (BotoCoreError, ClientError)


def _s3_error_code(exc: BaseException) -> str:
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


#: this process's shared session, by process id (a forked child makes its own)
_SHARED_SESSIONS: dict[int, Any] = {}
_SHARED_SESSION_LOCK = threading.Lock()


def shared_session() -> Any:
    """This process's aiobotocore session, shared by the S3 backends whose options set nothing of a session's.

    botocore parses S3's service model once per session: a client of a fresh session costs
    0.05-0.15 s of CPU, of a session that made one before 4 ms. Clients are made on fsspec's one
    I/O thread, and each backend still makes and closes its own.
    """
    with _SHARED_SESSION_LOCK:
        session = _SHARED_SESSIONS.get(os.getpid())
        if session is None:
            import aiobotocore.session

            _SHARED_SESSIONS.clear()
            session = _SHARED_SESSIONS[os.getpid()] = aiobotocore.session.AioSession()
        return session


def warm_s3() -> None:
    """Import the S3 stack and make (and close) one client of :func:`shared_session`, on fsspec's I/O
    thread as every backend's: what a server that checkpoints to S3 does at startup rather than in its
    first commit (about 0.3 s of CPU, 25 MiB). Nothing is contacted; the credentials are placeholders."""
    import s3fs  # noqa: F401  # imported for its cost, here rather than in a commit
    from fsspec.asyn import get_loop

    async def make_client() -> None:
        async with shared_session().create_client(
            "s3", region_name="us-east-1", aws_access_key_id="warm", aws_secret_access_key="warm"
        ):
            pass

    sync(get_loop(), make_client, timeout=60)


def _s3fs_options(options: dict[str, Any], retries: int | None) -> dict[str, Any]:
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


class S3Backend(FsspecBackend):
    """Checkpoint files on S3 or an S3-compatible store, through s3fs.

    Parameters
    ----------
    url:
        ``s3://bucket/prefix`` (or ``s3a://``); the store's root.
    storage_options:
        See the module docstring: ``endpoint_url``, ``key``, ``secret``, ``region``,
        ``block_size``, ``upload_concurrency``, ``single_put_bytes``, ``retries``; the
        rest goes to s3fs.

    Raises
    ------
    UnsupportedStorage
        An option is invalid.
    """

    own_options: ClassVar[frozenset[str]] = FsspecBackend.own_options | S3_ONLY_OPTIONS | {"region"}
    int_options: ClassVar[tuple[str, ...]] = (
        "block_size",
        "upload_concurrency",
        "single_put_bytes",
        "retries",
        *FsspecBackend.int_options,
    )
    native_errors: ClassVar[tuple[type[BaseException], ...]] = (*FsspecBackend.native_errors, *_botocore_errors())

    block_size: int
    upload_concurrency: int
    single_put_bytes: int
    _retries: int | None

    @staticmethod
    def handles(url: str) -> bool:
        """True for the URLs this backend serves: ``s3://`` and ``s3a://``."""
        return "://" in url and url.split("://", 1)[0].lower() in _PROTOCOLS

    def __init__(self, url: str, **storage_options: Any) -> None:
        super().__init__(url, **storage_options)
        if self._retries is not None:
            self.fs.retries = self._retries

    def _filesystem_options(self, options: dict[str, Any]) -> dict[str, Any]:
        self.block_size = int(options.pop("block_size", DEFAULT_BLOCK_SIZE))
        self.upload_concurrency = int(options.pop("upload_concurrency", DEFAULT_UPLOAD_CONCURRENCY))
        self.single_put_bytes = max(int(options.pop("single_put_bytes", DEFAULT_SINGLE_PUT_BYTES)), self.block_size)
        self._retries = options.pop("retries", None)
        if self.upload_concurrency < 1:
            raise UnsupportedStorage(f"upload_concurrency must be at least 1, got {self.upload_concurrency}")
        options = _s3fs_options(options, self._retries)
        if options.get("session") is None:  # the caller's own session wins (only S3FileSystem's options pass)
            options["session"] = shared_session()
        if self.block_size < MIN_BLOCK_SIZE:
            raise UnsupportedStorage(
                f"block_size {self.block_size} is below S3's minimum part size of {MIN_BLOCK_SIZE} bytes"
            )
        return options

    @property
    def supports_conditional_create(self) -> bool:
        """True: S3 creates an object only if absent with ``If-None-Match: *``."""
        return True

    def _translate(self, exc: BaseException, path: str, action: str, *, writing: bool) -> BaseException:
        code = _s3_error_code(exc)
        detail = describe_failure(exc, path, action)
        if code in _CREDENTIAL_CODES or _exception_names(exc) & _CREDENTIAL_EXCEPTIONS:
            return StorageError(f"{detail} (credentials missing or rejected)", path=path, errno=errno.EACCES)
        if code == "NoSuchBucket":
            if writing:
                return UnusableDirectory(f"{detail} (the bucket does not exist)", path=path)
            return StorageError(f"{detail} (the bucket does not exist)", path=path, errno=errno.ENOENT)
        if code == "NoSuchUpload":
            return StorageError(f"{detail} (the multipart upload vanished)", path=path, errno=errno.EIO)
        return translate_failure(
            exc, path, action, writing=writing, missing=code in {"NoSuchKey", "404"}, denied=code in _DENIED_CODES
        )

    def bucket_key(self, path: str) -> tuple[str, str]:
        """Bucket and key of a store-relative path."""
        bucket, key, _ = self.fs.split_path(self.full_path(path))
        return bucket, key

    # --- writing

    def open_sink(self, directory: str) -> BlobSink:
        return _MultipartSink(self, directory)

    def create_if_absent(self, path: str, data: bytes) -> bool:
        """Create ``path`` with ``data`` unless it exists, with ``If-None-Match: *``.

        A 412 (the object exists, possibly because a retried request's first attempt
        succeeded) and a transport failure alike are resolved by reading the object:
        the same bytes are success (False), other bytes :class:`ManifestConflict`. A 409
        (another conditional write on the key is in flight) is retried.
        """
        full = self.full_path(path)
        data = bytes(data)
        for attempt in range(_CONFLICT_ATTEMPTS):
            try:
                with self.storage_errors(path, "create", writing=True):
                    # s3fs (2026.9) sends this as one PUT with If-None-Match: * through its retried
                    # call and raises FileExistsError on the 412, which is all this needs
                    self.fs.pipe_file(full, data, mode="create")
                return True
            except FileExistsError:
                return self._resolve_existing(path, data)
            except StorageError as exc:
                if _s3_error_code(exc) in {"ConditionalRequestConflict", "409"} and attempt + 1 < _CONFLICT_ATTEMPTS:
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

    def delete(self, path: str) -> None:
        with self.storage_errors(path, "delete", writing=True):
            bucket, key = self.bucket_key(path)
            self.fs.call_s3("delete_object", Bucket=bucket, Key=key)

    def delete_key(self, key: str) -> None:
        """Delete the object ``key`` (relative to the root) exactly as :meth:`walk_keys` listed it.

        No path normalization: for a key no path names (``ck/gym/../x``) this deletes that object,
        never the one its normalized path would name. A prune uses it for such keys.
        """
        bucket, _, prefix = self.root.partition("/")
        with self.storage_errors(key, "delete", writing=True):
            self.fs.call_s3("delete_object", Bucket=bucket, Key=f"{prefix}/{key}" if prefix else key)

    # --- reading

    def open_read(self, path: str) -> BinaryIO:
        bucket, key = self.bucket_key(path)
        with self.storage_errors(path, "open"):
            response = self.fs.call_s3("get_object", Bucket=bucket, Key=key)
        return ObjectReader(self, path, response["Body"])  # type: ignore[return-value]

    def size(self, path: str) -> int:
        bucket, key = self.bucket_key(path)
        with self.storage_errors(path, "stat"):
            return int(self.fs.call_s3("head_object", Bucket=bucket, Key=key)["ContentLength"])

    # --- lifetime

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


class _MultipartSink(BlobSink):
    """A records file streamed to a temporary S3 object, copied to its digest name on publish.

    It keeps the chunks the records writer hands over (:attr:`~gymckpt.store.backend.BlobSink.keeps_chunks`,
    :meth:`adopt`): a file that fits one PUT is sent from them as they are, never gathered into
    one more buffer. What :meth:`write` is given, it copies.
    """

    keeps_chunks = True

    def __init__(self, backend: S3Backend, directory: str) -> None:
        self._backend = backend
        self._fs = backend.fs
        self._directory = safe_relative_path(directory)
        self.temp_path = temporary_path(self._directory)
        self._bucket, self._key = backend.bucket_key(self.temp_path)
        #: written, not yet sent: the chunks as given (a part is cut from the front of them)
        self._pieces: deque[memoryview] = deque()
        self._pending = 0
        self._upload_id: str | None = None
        self._submitted = 0
        self._parts: list[dict[str, Any]] = []
        self._inflight: deque[tuple[int, Future[Any]]] = deque()
        self._size = 0
        self._object_may_exist = False
        self._stray_uploads_possible = False
        self._state = "writing"

    def write(self, chunk: bytes | memoryview) -> None:
        self.adopt(memoryview(bytes(chunk)))  # the caller may change its buffer once this returns

    def adopt(self, chunk: memoryview) -> None:
        assert self._state == "writing", f"write after {self._state}"
        piece = chunk.cast("B") if chunk.format != "B" or chunk.ndim != 1 else chunk
        if not piece.nbytes:
            return
        self._pieces.append(piece)
        self._pending += piece.nbytes
        self._size += piece.nbytes
        if self._upload_id is None and self._pending <= self._backend.single_put_bytes:
            return  # may still fit one PUT under the digest name
        block = self._backend.block_size
        while self._pending >= block:
            self._send(self._take(block))

    def _take(self, size: int) -> bytes:
        """The first ``size`` bytes not sent yet, as one part (the pieces they came from are let go)."""
        taken: list[memoryview] = []
        wanted = size
        while wanted:
            piece = self._pieces.popleft()
            if piece.nbytes > wanted:
                self._pieces.appendleft(piece[wanted:])
                piece = piece[:wanted]
            taken.append(piece)
            wanted -= piece.nbytes
        self._pending -= size
        return b"".join(taken)

    def _send(self, part: bytes) -> None:
        if self._upload_id is None:
            # a create whose answer was lost and retried leaves an upload we never hear of
            self._stray_uploads_possible = True
            with self._backend.storage_errors(self.temp_path, "start a multipart upload of", writing=True):
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
            Body=self._body(part),
        )
        self._inflight.append((self._submitted, asyncio.run_coroutine_threadsafe(coroutine, self._fs.loop)))
        while len(self._inflight) > self._backend.upload_concurrency:
            self._settle_oldest()

    def _body(self, data: bytes | list[memoryview]) -> BufferBody:
        """``data`` (a part, or the chunks in order) as a request body read in place; each call of the
        client reads it from its start."""
        rewind_bodies(self._fs.s3)
        return BufferBody(data)

    def _drop_pieces(self) -> None:
        self._pieces.clear()
        self._pending = 0

    def _settle_oldest(self) -> None:
        number, future = self._inflight.popleft()
        with self._backend.storage_errors(self.temp_path, f"upload part {number} of", writing=True):
            response = future.result()
        self._parts.append({"PartNumber": number, "ETag": response["ETag"]})

    def finish(self) -> None:
        assert self._state == "writing", f"finish after {self._state}"
        if self._upload_id is None:
            # small enough for one PUT: publish() writes it under its final name in one atomic request
            self._state = "finished"
            return
        if self._pending:
            self._send(self._take(self._pending))
        while self._inflight:
            self._settle_oldest()
        self._object_may_exist = True
        try:
            with self._backend.storage_errors(self.temp_path, "complete the multipart upload of", writing=True):
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
                with self._backend.storage_errors(target, "write", writing=True):
                    # one put_object of at most single_put_bytes, read from the chunks in place
                    self._fs.call_s3("put_object", Bucket=bucket, Key=key, Body=self._body(list(self._pieces)))
                    self._fs.invalidate_cache(self._backend.full_path(target))
            else:
                with self._backend.storage_errors(target, "copy into place", writing=True):
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
        self._drop_pieces()
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
        self._drop_pieces()
        while self._inflight:  # let parts in flight land, or an abort can leave them stored
            _, future = self._inflight.popleft()
            try:
                future.result(timeout=120)
            except Exception:
                pass
        if self._upload_id is not None:
            try:
                with self._backend.storage_errors(self.temp_path, "abort the multipart upload of", writing=True):
                    self._fs.call_s3(
                        "abort_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=self._upload_id
                    )
            except (StorageError, OSError) as exc:
                if _s3_error_code(exc) != "NoSuchUpload":
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
            with self._backend.storage_errors(self.temp_path, "list the multipart uploads of", writing=True):
                listing = self._fs.call_s3("list_multipart_uploads", Bucket=self._bucket, Prefix=self._key)
            for upload in listing.get("Uploads", []):
                if upload.get("Key") == self._key:
                    with self._backend.storage_errors(self.temp_path, "abort the multipart upload of", writing=True):
                        self._fs.call_s3(
                            "abort_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=upload["UploadId"]
                        )
            self._stray_uploads_possible = False
        except (StorageError, OSError) as exc:
            logger.warning("could not abort the stray multipart uploads of %s: %s", self.temp_path, exc)
