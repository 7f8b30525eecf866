"""One participant's commit and restore: records first, then the manifest, create-only."""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, TypeVar

from gymckpt.errors import (
    FileTooLarge,
    GymckptError,
    InvalidCheckpointState,
    ManifestConflict,
    NotRegularFile,
    ParticipantNotFound,
    RecordsMissing,
    RecordsSizeMismatch,
    StorageError,
)
from gymckpt.store.bounds import check_document_cost, line_limit, read_document_bytes
from gymckpt.store.layout import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    check_name,
    check_readable_name,
    participant_directory,
)
from gymckpt.store.manifest import Manifest
from gymckpt.store.records import (
    DEFAULT_CHUNK_SIZE,
    RecordsCheck,
    WriteStop,
    read_lines,
    read_records,
    write_records,
)
from gymckpt.store.spans import read_spans

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterable, Iterator
    from typing import BinaryIO

    from gymckpt.store.backend import StorageBackend
    from gymckpt.store.encoded import PreEncoded
    from gymckpt.store.spans import LineSpan, Span

T = TypeVar("T")

__all__ = [
    "commit_participant",
    "expected_records",
    "iter_manifest_lines",
    "iter_manifest_records",
    "iter_manifest_spans",
    "load_manifest",
    "read_manifest_file",
    "restore_participant",
]


def commit_participant(
    backend: StorageBackend,
    checkpoint_dir: str,
    *,
    kind: str,
    instance: str,
    checkpoint_id: str,
    records: Iterable[dict[str, Any] | PreEncoded],
    extra: dict[str, Any] | None = None,
    stop: WriteStop | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Manifest:
    """Stream ``records`` to ``records-<sha256>.jsonl``, make it durable, then create the manifest.

    An identical manifest already published (a retry) is success; a different one is
    :class:`ManifestConflict`, and this write's records file is removed unless the
    published manifest names it.
    """
    check_name("kind", kind)
    check_name("instance", instance)
    check_name("checkpoint_id", checkpoint_id)
    directory = participant_directory(checkpoint_dir, kind, instance)
    sink = backend.open_sink(directory)
    published = False
    try:
        summary = write_records(sink, records, stop=stop, chunk_size=chunk_size)
        sink.finish()
        manifest = Manifest.build(
            directory=directory,
            kind=kind,
            instance=instance,
            checkpoint_id=checkpoint_id,
            records_sha256=summary.sha256,
            record_count=summary.count,
            records_bytes=summary.size,
            episode_ids=summary.episode_ids,
            extra=extra,
            max_record_bytes=summary.max_record_bytes,
        )
        _check_readable(manifest)
        with stop.held() if stop is not None else nullcontext():
            if stop is not None:
                stop.check()
            sink.publish(manifest.records_file)
            published = True
            backend.sync_directories(directory)
            try:
                backend.create_if_absent(manifest.path, manifest.raw)
            except ManifestConflict:
                _remove_losing_records(backend, manifest)
                raise
        return manifest
    finally:
        if not published:
            sink.abort()


def _check_readable(manifest: Manifest) -> None:
    """Refuse, before it is published, a manifest every reader would refuse: a checkpoint nobody can restore."""
    where = {"path": manifest.path, "participant": manifest.participant}
    if len(manifest.raw) > MAX_MANIFEST_BYTES:
        raise FileTooLarge(
            f"the manifest would be {len(manifest.raw)} bytes, over the {MAX_MANIFEST_BYTES >> 20} MiB readers "
            "accept: not published (fewer episodes per participant, or smaller extras)",
            **where,
        )
    check_document_cost(manifest.raw, what="the manifest (not published: readers would refuse it)", **where)


def _remove_losing_records(backend: StorageBackend, ours: Manifest) -> None:
    try:
        winner = read_manifest_file(backend, ours.path, kind=ours.kind, instance=ours.instance)
    except (InvalidCheckpointState, OSError):
        return  # the published manifest is unreadable: leave both for verify to report
    if winner.records_file != ours.records_file:
        backend.delete(ours.records_path)


def read_manifest_file(backend: StorageBackend, path: str, *, kind: str, instance: str) -> Manifest:
    """Read and validate the manifest at ``path``.

    One over :data:`MAX_MANIFEST_BYTES` is refused unread (:class:`~gymckpt.errors.FileTooLarge`,
    from its size), no read takes more than that and a byte, and decoding runs under the parse
    budget (:mod:`gymckpt.store.bounds`). Raises ``FileNotFoundError`` when there is none, and
    a typed :class:`~gymckpt.errors.InvalidCheckpointState` on any damage.
    """
    participant = f"{kind}/{instance}"
    raw = read_document_bytes(backend, path, MAX_MANIFEST_BYTES, participant=participant, what="manifest")
    return Manifest.parse(raw, path=path, kind=kind, instance=instance)


def load_manifest(backend: StorageBackend, checkpoint_dir: str, *, kind: str, instance: str) -> Manifest:
    """Read and validate one participant's manifest, in either format (typed errors on any damage).

    Kind and instance may be as long as a reference checkpoint's (:func:`check_readable_name`).
    """
    directory = participant_directory(
        checkpoint_dir, check_readable_name("kind", kind), check_readable_name("instance", instance)
    )
    path = f"{directory}/{MANIFEST_NAME}"
    try:
        return read_manifest_file(backend, path, kind=kind, instance=instance)
    except FileNotFoundError as exc:
        if isinstance(exc, InvalidCheckpointState):
            raise
        raise ParticipantNotFound(
            "no manifest: this participant was not committed", path=path, participant=f"{kind}/{instance}"
        ) from exc


def expected_records(manifest: Manifest) -> RecordsCheck:
    """What the manifest says its records file holds."""
    return RecordsCheck(
        path=manifest.records_path,
        participant=manifest.participant,
        manifest_path=manifest.path,
        sha256=manifest.records_sha256,
        size=manifest.records_bytes,
        count=manifest.record_count,
        episode_ids=manifest.episode_ids,
        reference=manifest.is_reference,
        line_limit=line_limit(manifest.max_record_bytes, manifest.records_bytes),
    )


def iter_manifest_records(
    backend: StorageBackend,
    manifest: Manifest,
    *,
    scope: Collection[str] | None = None,
    decode_all: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    progress: Callable[[int], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """Stream a manifest's records, verifying the whole file (see :func:`read_records`).

    Records of a reference-format manifest come with their ``episode_id`` as a capture key.
    """
    yield from _manifest_stream(
        backend,
        manifest,
        lambda stream, expected: read_records(
            stream, expected, scope=scope, decode_all=decode_all, chunk_size=chunk_size, progress=progress
        ),
    )


def iter_manifest_lines(
    backend: StorageBackend,
    manifest: Manifest,
    *,
    scope: Collection[str] | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    spans: dict[str, LineSpan] | None = None,
) -> Iterator[tuple[str, bytes]]:
    """Stream a manifest's lines in ``scope`` undecoded, as ``(episode_id, line)``, verifying the whole
    file (see :func:`~gymckpt.store.records.read_lines`; gymckpt's own format only)."""
    yield from _manifest_stream(
        backend,
        manifest,
        lambda stream, expected: read_lines(stream, expected, scope=scope, chunk_size=chunk_size, spans=spans),
    )


def iter_manifest_spans(
    backend: StorageBackend, manifest: Manifest, spans: Iterable[Span]
) -> Iterator[tuple[str, bytes]]:
    """The lines at ``(episode_id, offset, length, crc32)`` spans of a manifest's records file that was
    verified whole before (see :func:`~gymckpt.store.spans.read_spans`; gymckpt's own format only)."""
    if manifest.is_reference:
        raise ValueError("spans are of gymckpt's own records format")
    yield from _manifest_stream(backend, manifest, lambda stream, expected: read_spans(stream, expected, spans))


def _manifest_stream(
    backend: StorageBackend, manifest: Manifest, read: Callable[[BinaryIO, RecordsCheck], Iterator[T]]
) -> Iterator[T]:
    """``read(stream, expected)`` over the manifest's records file; a missing, irregular or
    unreadable file is a typed error naming it."""
    expected = expected_records(manifest)
    try:
        if manifest.records_bytes is not None:
            size = backend.size(manifest.records_path)
            if size != manifest.records_bytes:
                raise expected.fail(
                    RecordsSizeMismatch, f"records file has {size} bytes, manifest says {manifest.records_bytes}"
                )
        stream = backend.open_read(manifest.records_path)
    except NotRegularFile as exc:
        raise expected.fail(NotRegularFile, exc.reason) from exc
    except FileNotFoundError as exc:
        if isinstance(exc, InvalidCheckpointState):
            raise
        raise expected.fail(RecordsMissing, "records file is missing") from exc
    with stream:
        try:
            yield from read(stream, expected)
        except GymckptError:
            raise
        except OSError as exc:
            raise StorageError(f"cannot read {manifest.records_path}: {exc}", path=manifest.records_path) from exc


def restore_participant(
    backend: StorageBackend,
    checkpoint_dir: str,
    *,
    kind: str,
    instance: str,
    scope: Collection[str] | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Iterator[dict[str, Any]]:
    """Load the manifest now (raising on damage), then stream the records in ``scope``.

    The returned iterator verifies the whole records file and raises a typed
    :class:`~gymckpt.errors.InvalidCheckpointState` before it ends if it is damaged.
    """
    manifest = load_manifest(backend, checkpoint_dir, kind=kind, instance=instance)
    scope_set = None if scope is None else frozenset(scope)
    return iter_manifest_records(backend, manifest, scope=scope_set, chunk_size=chunk_size)
