"""What a restore may read: exactly the manifest its checkpoint published (SPEC C10).

``gym/checkpoint.json`` lists each participant's manifest by the sha256 of its bytes. A
restore body may carry that digest and the index's checkpoint id (gymckpt's Coordinator
reads them from the index: :func:`read_published`, :func:`restore_bodies`); the server
compares the manifest it reads with them before it reads any record
(:func:`expected_manifest`), so a participant directory replaced after publication (by
another checkpoint's files, say) is refused, typed, and nothing is installed. A body without a
digest (the reference's controller sends none) makes the server read the index itself
where one exists. A directory without an index (committed but never published, or
published by the reference's controller, whose ``collection.json`` lists no digests) is
read as it is, as before: a server alone cannot tell which manifest was meant.

A server that checks lists :data:`RESTORE_CHECKS` in its status (``restore_checks``); a
controller sends the fields only to such servers, since the reference's servers refuse
unknown body fields; for those, the Coordinator's own check of every listed manifest
(:func:`read_published`) is the only one, a moment before the server reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from gymckpt.errors import (
    CheckpointIdMismatch,
    CheckpointUnpublished,
    CoordinationError,
    IndexDigestMismatch,
    IndexParticipantUnlisted,
    InvalidCheckpointState,
)
from gymckpt.store.layout import index_path
from gymckpt.store.publication import read_index

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping

    from gymckpt.store import CheckpointIndex, CheckpointStore
    from gymckpt.store.manifest import Manifest

__all__ = ["RESTORE_CHECKS", "ExpectedManifest", "expected_manifest", "read_published", "restore_bodies"]

#: the optional restore-body fields a gymckpt server checks, as its status lists them
RESTORE_CHECKS = ("manifest_sha256", "source_checkpoint_id")
_INDEX = "gym/checkpoint.json"


@dataclass(frozen=True)
class ExpectedManifest:
    """The manifest one participant's restore may read: its digest and checkpoint id, where each came from."""

    manifest_sha256: str | None
    checkpoint_id: str | None
    #: where the digest came from (the restore request, or the index): named in the refusal
    origin: str

    def check(self, manifest: Manifest) -> None:
        """Refuse ``manifest`` when it is not the one expected (IndexDigestMismatch, CheckpointIdMismatch)."""
        if self.manifest_sha256 is not None:
            digest = manifest.sha256  # the stored bytes' digest, as the index lists it
            if digest != self.manifest_sha256:
                raise IndexDigestMismatch(
                    f"manifest hashes to {digest}, {self.origin} expects {self.manifest_sha256}: "
                    "it is not the manifest that was published; nothing was restored",
                    path=manifest.path,
                    participant=manifest.participant,
                )
        if self.checkpoint_id is not None and manifest.checkpoint_id != self.checkpoint_id:
            raise CheckpointIdMismatch(
                f"manifest names checkpoint_id {manifest.checkpoint_id!r}, {self.origin} expects "
                f"{self.checkpoint_id!r}; nothing was restored",
                path=manifest.path,
                participant=manifest.participant,
            )


def expected_manifest(
    store: CheckpointStore,
    kind: str,
    instance: str,
    *,
    manifest_sha256: str | None = None,
    checkpoint_id: str | None = None,
) -> ExpectedManifest | None:
    """A server's expectation for its own manifest: from the request, else from the index; None without either.

    Without a digest in the request, ``gym/checkpoint.json`` is read (the index alone, not the
    other participants' manifests); one that does not list this participant is
    :class:`~gymckpt.errors.IndexParticipantUnlisted`, one naming another id than the
    request's :class:`~gymckpt.errors.CheckpointIdMismatch`. Blocking: call it off the loop.
    """
    participant = f"{kind}/{instance}"
    if manifest_sha256 is not None:
        return ExpectedManifest(manifest_sha256, checkpoint_id, "the restore request")
    try:
        index = read_index(store.backend, "", check_manifests=False)
    except FileNotFoundError as exc:
        if isinstance(exc, InvalidCheckpointState):
            raise
        # no index: unpublished, or the reference's publication; only the request's id is checked
        return None if checkpoint_id is None else ExpectedManifest(None, checkpoint_id, "the restore request")
    if checkpoint_id is not None and checkpoint_id != index.checkpoint_id:
        raise CheckpointIdMismatch(
            f"the restore request names checkpoint_id {checkpoint_id!r}, {_INDEX} {index.checkpoint_id!r}",
            path=index_path(""),
            participant=participant,
        )
    entry = next((entry for entry in index.participants if (entry.kind, entry.instance) == (kind, instance)), None)
    if entry is None:
        raise IndexParticipantUnlisted(
            f"{_INDEX} does not list {participant}: a restore takes only what was published",
            path=index_path(""),
            participant=participant,
        )
    return ExpectedManifest(entry.manifest_sha256, index.checkpoint_id, _INDEX)


def read_published(store: CheckpointStore) -> CheckpointIndex:
    """The controller's side: the store's ``gym/checkpoint.json``, every manifest it lists checked against it.

    No index is :class:`~gymckpt.errors.CheckpointUnpublished`; a listed manifest that is
    missing, hashes otherwise or names another id raises its typed error (the first one).
    Blocking: call it off the loop.
    """
    try:
        return store.read_index("")
    except FileNotFoundError as exc:
        if isinstance(exc, InvalidCheckpointState):
            raise
        raise CheckpointUnpublished(
            "not found: the Coordinator restores only a published checkpoint (Coordinator.publish writes it)",
            path=f"{store.url.rstrip('/')}/{index_path('')}",
        ) from exc


def restore_bodies(
    participants: Mapping[str, tuple[str, str]], checking: Collection[str], index: CheckpointIndex, encoded: bytes
) -> dict[str, bytes]:
    """The controller's side: each server's restore body, by URL.

    ``participants`` maps each server to its (kind, instance); ``encoded`` is the body all
    share, encoded once. A server in ``checking`` (its status lists :data:`RESTORE_CHECKS`)
    gets its manifest's digest and the index's checkpoint id appended; another (a reference
    server, which refuses unknown fields) gets the shared body. A participant the index does
    not list is :class:`~gymckpt.errors.IndexParticipantUnlisted`, every one of them raised
    as one :class:`~gymckpt.errors.CoordinationError` before any server is called.
    """
    digests = {(entry.kind, entry.instance): entry.manifest_sha256 for entry in index.participants}
    bodies: dict[str, bytes] = {}
    unlisted: dict[str, BaseException] = {}
    for url, (kind, instance) in participants.items():
        digest = digests.get((kind, instance))
        if digest is None:
            refused = IndexParticipantUnlisted(
                f"{_INDEX} does not list this participant: a restore takes only what was published",
                participant=f"{kind}/{instance}",
            )
            refused.server = url  # type: ignore[attr-defined]
            unlisted[url] = refused
        elif url in checking:
            fields = {"manifest_sha256": digest, "source_checkpoint_id": index.checkpoint_id}
            bodies[url] = encoded[:-1] + b"," + orjson.dumps(fields)[1:]  # ``encoded`` is a non-empty JSON object
        else:
            bodies[url] = encoded
    if unlisted:
        raise CoordinationError("restore", unlisted)
    return bodies
