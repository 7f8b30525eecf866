"""The public face of the store: :func:`open_store` and :class:`CheckpointStore`."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from gymckpt.errors import UnsupportedStorage
from gymckpt.store._local import LocalBackend
from gymckpt.store._memory import MemoryBackend
from gymckpt.store.participant import (
    commit_participant,
    iter_manifest_lines,
    iter_manifest_records,
    iter_manifest_spans,
    load_manifest,
    restore_participant,
)
from gymckpt.store.publication import publish_checkpoint, read_index
from gymckpt.store.records import DEFAULT_CHUNK_SIZE

if TYPE_CHECKING:
    from collections.abc import Collection, Iterable, Iterator

    from gymckpt.store.backend import StorageBackend
    from gymckpt.store.encoded import PreEncoded
    from gymckpt.store.manifest import Manifest
    from gymckpt.store.publication import CheckpointIndex
    from gymckpt.store.records import WriteStop
    from gymckpt.store.spans import LineSpan, Span

__all__ = ["CheckpointStore", "backend_for_url", "open_store"]


def backend_for_url(url: str, **storage_options: Any) -> StorageBackend:
    """Choose the backend for ``url``: a path or ``file://`` → local, ``memory://`` → memory,
    ``s3://`` or ``s3a://`` → the S3 backend, any other fsspec URL → the fsspec backend, with
    ``storage_options`` passed through."""
    url = os.fspath(url)
    if url.startswith("memory://") or "://" not in url or url.startswith("file://"):
        if storage_options:
            raise UnsupportedStorage(
                f"storage options {sorted(storage_options)} would be ignored by {url!r}: "
                "they apply to object storage URLs only"
            )
        if url.startswith("memory://"):
            return MemoryBackend(url)
        return LocalBackend(url.removeprefix("file://"))
    try:
        from gymckpt.store._fsspec import FsspecBackend
        from gymckpt.store._s3 import S3Backend
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise UnsupportedStorage(
            f"{url!r} needs the object-storage backend: pip install -e '.[s3]' in the gymckpt clone ({exc})"
        ) from exc
    if S3Backend.handles(url):
        return S3Backend(url, **storage_options)
    return FsspecBackend(url, **storage_options)


def open_store(url: str, **storage_options: Any) -> CheckpointStore:
    """Open the checkpoint store at ``url`` (a path, ``file://``, ``memory://`` or ``s3://`` URL).

    Parameters
    ----------
    url:
        Root of the store; checkpoint directories are given relative to it.
    storage_options:
        Passed to the object-storage filesystem (``endpoint_url``, ``key``, ``secret``, …).
        Refused for local and memory stores, which would ignore them.
    """
    return CheckpointStore(backend_for_url(url, **storage_options))


class CheckpointStore:
    """Writes and reads participants' records and manifests, and publishes checkpoints."""

    def __init__(self, backend: StorageBackend, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        self.backend = backend
        self.chunk_size = chunk_size

    @property
    def url(self) -> str:
        """The URL or path the store was opened with."""
        return self.backend.url

    def write_participant(
        self,
        checkpoint_dir: str,
        *,
        kind: str,
        instance: str,
        checkpoint_id: str,
        records: Iterable[dict[str, Any] | PreEncoded],
        extra: dict[str, Any] | None = None,
        stop: WriteStop | None = None,
    ) -> Manifest:
        """Commit one participant: stream ``records``, then create its manifest.

        Parameters
        ----------
        checkpoint_dir:
            Checkpoint directory relative to the store's root.
        records:
            Dicts whose first key is ``"episode_id"`` (a capture key, unique per participant),
            or :class:`~gymckpt.store.codec.EncodedRecord` lines encoded once elsewhere (a
            worker's), written as they are.
        extra:
            Additional manifest fields (JSON).
        stop:
            A :class:`~gymckpt.store.records.WriteStop`; once ``stop.stop()`` returned, no
            manifest of this write appears.

        Raises
        ------
        NotJSONError, InvalidRecord
            A record holds a value JSON cannot hold, or is malformed.
        ManifestConflict
            A different manifest is already published for this participant.
        WriteStopped, StorageError, UnusableDirectory
        """
        return commit_participant(
            self.backend,
            checkpoint_dir,
            kind=kind,
            instance=instance,
            checkpoint_id=checkpoint_id,
            records=records,
            extra=extra,
            stop=stop,
            chunk_size=self.chunk_size,
        )

    def read_participant(
        self,
        checkpoint_dir: str,
        *,
        kind: str,
        instance: str,
        scope: Collection[str] | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Stream one participant's records in ``scope`` (all when None), verifying the file.

        Reads gymckpt's format and the reference stack's (see :mod:`gymckpt.store.manifest`);
        either way a record's ``episode_id`` is its capture key (``r``, ``r-aN``), and
        ``scope`` holds capture keys. The manifest is validated before this returns. The iterator raises a typed
        :class:`~gymckpt.errors.InvalidCheckpointState` on damage, at the latest before
        it ends, so act on the records only once the iteration finished.
        """
        return restore_participant(
            self.backend, checkpoint_dir, kind=kind, instance=instance, scope=scope, chunk_size=self.chunk_size
        )

    def read_manifest(self, checkpoint_dir: str, *, kind: str, instance: str) -> Manifest:
        """One participant's validated manifest, in gymckpt's format or the reference's (:attr:`Manifest.format`).

        Kind and instance may be up to 255 characters when reading (the reference sets no
        limit); gymckpt writes at most 128.
        """
        return load_manifest(self.backend, checkpoint_dir, kind=kind, instance=instance)

    def read_records(self, manifest: Manifest, *, scope: Collection[str] | None = None) -> Iterator[dict[str, Any]]:
        """Stream the records in ``scope`` of a manifest :meth:`read_manifest` returned, verifying the file.

        :meth:`read_participant` is this after :meth:`read_manifest`; typed damage is raised
        before the iterator ends, as there.
        """
        scope_set = None if scope is None else frozenset(scope)
        return iter_manifest_records(self.backend, manifest, scope=scope_set, chunk_size=self.chunk_size)

    def read_lines(
        self,
        manifest: Manifest,
        *,
        scope: Collection[str] | None = None,
        spans: dict[str, LineSpan] | None = None,
    ) -> Iterator[tuple[str, bytes]]:
        """Stream ``(episode_id, line)`` of the lines in ``scope``, undecoded, verifying the whole file as
        :meth:`read_records` does (gymckpt's own format only: check ``manifest.is_reference`` first);
        ``spans`` gets each yielded line's ``(offset, length, crc32)``, for :meth:`read_spans`."""
        scope_set = None if scope is None else frozenset(scope)
        return iter_manifest_lines(self.backend, manifest, scope=scope_set, chunk_size=self.chunk_size, spans=spans)

    def read_spans(self, manifest: Manifest, spans: Iterable[Span]) -> Iterator[tuple[str, bytes]]:
        """``(episode_id, line)`` at each ``(episode_id, offset, length, crc32)`` span, in file order: lines of
        a file :meth:`read_lines` verified whole in this restore, each checked as a line and against the
        CRC-32 that read took, not hashed again (:func:`~gymckpt.store.spans.read_spans`)."""
        return iter_manifest_spans(self.backend, manifest, spans)

    def publish(
        self, checkpoint_dir: str, manifests: Iterable[Manifest], *, extra: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Create ``gym/checkpoint.json`` (create-only) listing ``manifests``; return it."""
        return publish_checkpoint(self.backend, checkpoint_dir, manifests, extra=extra)

    def read_index(self, checkpoint_dir: str) -> CheckpointIndex:
        """The published ``gym/checkpoint.json`` of ``checkpoint_dir``."""
        return read_index(self.backend, checkpoint_dir)

    def close(self) -> None:
        """Release the backend's resources."""
        self.backend.close()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
