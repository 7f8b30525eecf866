"""``<checkpoint_dir>/gym/checkpoint.json``: the index coordination publishes last, create-only.

gymckpt's own addition: the reference stack publishes none (its controller writes
``collection.json`` beside ``gym/``). An index may list participants of either manifest
format; each is listed by the sha256 of its manifest's bytes.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gymckpt._version import __version__
from gymckpt.errors import (
    CheckpointIdMismatch,
    CheckpointIndexInvalid,
    IndexDigestMismatch,
    IndexParticipantMissing,
    IndexParticipantUnlisted,
    InvalidCheckpointState,
)
from gymckpt.store.backend import join, read_limited
from gymckpt.store.bounds import read_document_bytes
from gymckpt.store.codec import decode_document, encode_document
from gymckpt.store.layout import (
    INDEX_NAME,
    MANIFEST_NAME,
    MAX_INDEX_BYTES,
    MAX_MANIFEST_BYTES,
    check_readable_name,
    index_path,
    is_valid_name,
)
from gymckpt.store.manifest import SCHEMA_VERSION
from gymckpt.store.participant import read_manifest_file

if TYPE_CHECKING:
    from collections.abc import Collection, Iterable, Mapping

    from gymckpt.store.backend import StorageBackend
    from gymckpt.store.manifest import Manifest

__all__ = [
    "INDEX_NAME",
    "CheckpointIndex",
    "IndexEntry",
    "index_path",
    "index_problems",
    "publish_checkpoint",
    "read_index",
    "read_index_file",
]

_SHA256 = re.compile(r"[0-9a-f]{64}")
_RESERVED = frozenset({"schema_version", "checkpoint_id", "participants", "writer"})


@dataclass(frozen=True)
class IndexEntry:
    """One participant as the index lists it."""

    kind: str
    instance: str
    manifest_sha256: str

    @property
    def manifest(self) -> str:
        """Manifest path relative to the checkpoint directory."""
        return f"gym/{self.kind}/{self.instance}/{MANIFEST_NAME}"

    @property
    def participant(self) -> str:
        return f"{self.kind}/{self.instance}"


@dataclass(frozen=True)
class CheckpointIndex:
    """A parsed ``checkpoint.json``."""

    checkpoint_id: str
    participants: tuple[IndexEntry, ...]
    extra: dict[str, Any]
    document: dict[str, Any]


def _document(checkpoint_id: str, entries: list[IndexEntry], extra: dict[str, Any] | None) -> dict[str, Any]:
    extra = dict(extra or {})
    clashing = sorted(_RESERVED.intersection(extra))
    if clashing:
        raise ValueError(f"extra checkpoint fields may not use reserved names: {clashing}")
    document: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "checkpoint_id": checkpoint_id,
        "participants": [
            {
                "kind": entry.kind,
                "instance": entry.instance,
                "manifest": entry.manifest,
                "manifest_sha256": entry.manifest_sha256,
            }
            for entry in entries
        ],
    }
    document.update(extra)
    document["writer"] = f"gymckpt {__version__}"
    return document


def publish_checkpoint(
    backend: StorageBackend,
    checkpoint_dir: str,
    manifests: Iterable[Manifest],
    *,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Create ``gym/checkpoint.json`` listing ``manifests``; return the published document.

    Every manifest is read back and must still hash as committed; all must share one
    checkpoint id. An identical index already published is success (a retry); a
    different one is :class:`~gymckpt.errors.ManifestConflict`.
    """
    manifests = list(manifests)
    if not manifests:
        raise ValueError("publish needs at least one committed manifest")
    checkpoint_ids = {manifest.checkpoint_id for manifest in manifests}
    if len(checkpoint_ids) != 1:
        raise ValueError(f"manifests of different checkpoints cannot be published together: {sorted(checkpoint_ids)}")
    entries: dict[tuple[str, str], IndexEntry] = {}
    for manifest in manifests:
        path = join(checkpoint_dir, "gym", manifest.kind, manifest.instance, MANIFEST_NAME)
        if path != manifest.path:
            raise ValueError(f"manifest {manifest.path} does not belong to checkpoint directory {checkpoint_dir!r}")
        stored = hashlib.sha256(read_limited(backend, path, MAX_MANIFEST_BYTES)).hexdigest()
        if stored != manifest.sha256:
            raise CheckpointIndexInvalid(
                "the published manifest differs from the one committed", path=path, participant=manifest.participant
            )
        key = (manifest.kind, manifest.instance)
        if key in entries:
            raise ValueError(f"participant {manifest.participant} listed twice")
        entries[key] = IndexEntry(manifest.kind, manifest.instance, stored)
    document = _document(checkpoint_ids.pop(), [entries[key] for key in sorted(entries)], extra)
    backend.sync_directories(join(checkpoint_dir, "gym"))
    backend.create_if_absent(index_path(checkpoint_dir), encode_document(document))
    return document


def read_index(backend: StorageBackend, checkpoint_dir: str, *, check_manifests: bool = True) -> CheckpointIndex:
    """Read and validate ``gym/checkpoint.json`` (FileNotFoundError when unpublished).

    With ``check_manifests``, every listed manifest must exist, hash as listed and name
    the index's checkpoint id (the first disagreement is raised, typed).
    """
    path = index_path(checkpoint_dir)
    index = read_index_file(backend, path)
    if check_manifests:
        manifests: dict[tuple[str, str], Manifest] = {}
        for entry in index.participants:
            try:
                manifests[(entry.kind, entry.instance)] = read_manifest_file(
                    backend, join(checkpoint_dir, entry.manifest), kind=entry.kind, instance=entry.instance
                )
            except FileNotFoundError as exc:
                if isinstance(exc, InvalidCheckpointState):
                    raise
        problems = index_problems(index, checkpoint_dir, manifests, check_unlisted=False)
        if problems:
            raise problems[0]
    return index


def read_index_file(backend: StorageBackend, path: str) -> CheckpointIndex:
    """Read and validate the index at ``path``: one over :data:`MAX_INDEX_BYTES` is refused unread
    (:class:`~gymckpt.errors.FileTooLarge`, from its size), and no read takes more than that and a byte."""
    return parse_index(read_document_bytes(backend, path, MAX_INDEX_BYTES, what="checkpoint.json"), path=path)


def index_problems(
    index: CheckpointIndex,
    checkpoint_dir: str,
    manifests: Mapping[tuple[str, str], Manifest],
    *,
    damaged: Collection[tuple[str, str]] = (),
    check_unlisted: bool = True,
) -> list[CheckpointIndexInvalid]:
    """Every way ``index`` disagrees with the intact ``manifests`` of its checkpoint directory.

    Participants in ``damaged`` are skipped (their damage is reported already). A manifest
    is compared by id only where its digest matches: one damage, one problem.
    """
    path = index_path(checkpoint_dir)
    listed = {(entry.kind, entry.instance): entry for entry in index.participants}
    problems: list[CheckpointIndexInvalid] = []
    agreeing: list[Manifest] = []
    for key, entry in sorted(listed.items()):
        if key in damaged:
            continue
        manifest = manifests.get(key)
        if manifest is None:
            problems.append(
                IndexParticipantMissing(
                    "checkpoint.json lists a participant whose manifest is missing",
                    path=join(checkpoint_dir, entry.manifest),
                    participant=entry.participant,
                )
            )
        elif manifest.sha256 != entry.manifest_sha256:
            problems.append(
                IndexDigestMismatch(
                    f"manifest hashes to {manifest.sha256}, checkpoint.json says {entry.manifest_sha256}",
                    path=manifest.path,
                    participant=entry.participant,
                )
            )
        else:
            agreeing.append(manifest)
    if check_unlisted:
        for key in sorted(set(manifests) - set(listed) - set(damaged)):
            problems.append(
                IndexParticipantUnlisted(
                    "a committed participant that checkpoint.json does not list",
                    path=manifests[key].path,
                    participant=manifests[key].participant,
                )
            )
    other = [manifest for manifest in agreeing if manifest.checkpoint_id != index.checkpoint_id]
    if other and len(other) == len(agreeing) and len({manifest.checkpoint_id for manifest in other}) == 1:
        problems.append(
            CheckpointIdMismatch(
                f"checkpoint.json names checkpoint_id {index.checkpoint_id!r}, its manifests {other[0].checkpoint_id!r}",
                path=path,
            )
        )
    else:
        problems.extend(
            CheckpointIdMismatch(
                f"manifest names checkpoint_id {manifest.checkpoint_id!r}, checkpoint.json {index.checkpoint_id!r}",
                path=manifest.path,
                participant=manifest.participant,
            )
            for manifest in other
        )
    return problems


def parse_index(raw: bytes, *, path: str) -> CheckpointIndex:
    """Validate index bytes; raise :class:`CheckpointIndexInvalid` naming what is wrong."""

    def invalid(detail: str) -> CheckpointIndexInvalid:
        return CheckpointIndexInvalid(detail, path=path)

    try:
        document = decode_document(raw, path=path, what="checkpoint.json")
    except InvalidCheckpointState:
        raise  # over the parse budget, or a key twice: named already
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"checkpoint.json is not JSON: {exc}") from exc
    if type(document) is not dict:
        raise invalid("checkpoint.json is not a JSON object")
    if document.get("schema_version") != SCHEMA_VERSION or type(document.get("schema_version")) is not int:
        raise invalid(
            f"checkpoint.json schema_version is {document.get('schema_version')!r}, expected {SCHEMA_VERSION}"
        )
    checkpoint_id = document.get("checkpoint_id")
    if not is_valid_name(checkpoint_id):
        raise invalid(f"checkpoint.json checkpoint_id {checkpoint_id!r} is not a valid id")
    listed = document.get("participants")
    if type(listed) is not list:
        raise invalid("checkpoint.json has no participants list")
    entries = []
    for item in listed:
        if type(item) is not dict:
            raise invalid("a participants entry is not an object")
        try:
            kind = check_readable_name("kind", item.get("kind"))
            instance = check_readable_name("instance", item.get("instance"))
        except ValueError as exc:
            raise invalid(str(exc)) from exc
        digest = item.get("manifest_sha256")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise invalid(f"participant {kind}/{instance} has no valid manifest_sha256")
        entry = IndexEntry(kind, instance, digest)
        if any((seen.kind, seen.instance) == (kind, instance) for seen in entries):
            raise invalid(f"checkpoint.json lists participant {kind}/{instance} twice")
        if item.get("manifest") != entry.manifest:
            raise invalid(
                f"participant {kind}/{instance} names manifest {item.get('manifest')!r}, expected {entry.manifest!r}"
            )
        entries.append(entry)
    extra = {key: value for key, value in document.items() if key not in _RESERVED}
    return CheckpointIndex(checkpoint_id, tuple(entries), extra, document)
