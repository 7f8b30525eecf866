"""A participant's manifest: what its records file holds, published last and never replaced."""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Any

from gymckpt._version import __version__
from gymckpt.errors import (
    DuplicateEpisode,
    ManifestFieldInvalid,
    ManifestNotJSON,
    ManifestNotObject,
    ParticipantMismatch,
    RecordsNameInvalid,
    RecordsPathEscapes,
    UnsupportedSchemaVersion,
)
from gymckpt.store.backend import join
from gymckpt.store.codec import decode_document, encode_document
from gymckpt.store.layout import (
    MANIFEST_NAME,
    NAME_PATTERN,
    RECORDS_NAME_PATTERN,
    check_name,
    is_valid_name,
    participant_directory,
    records_name,
)

__all__ = [
    "MANIFEST_NAME",
    "NAME_PATTERN",
    "RECORDS_NAME_PATTERN",
    "SCHEMA_VERSION",
    "Manifest",
    "check_name",
    "participant_directory",
    "records_name",
]

SCHEMA_VERSION = 1

_REQUIRED: dict[str, type] = {
    "schema_version": int,
    "kind": str,
    "instance": str,
    "checkpoint_id": str,
    "records_file": str,
    "records_sha256": str,
    "record_count": int,
    "records_bytes": int,
    "episode_ids": list,
    "writer": str,
}
RESERVED_FIELDS = frozenset(_REQUIRED)


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest and the exact bytes it was read from or written as."""

    kind: str
    instance: str
    checkpoint_id: str
    records_file: str
    records_sha256: str
    record_count: int
    records_bytes: int
    episode_ids: tuple[str, ...]
    writer: str
    extra: dict[str, Any] = field(default_factory=dict)
    #: store-relative path of the manifest file
    path: str = ""
    raw: bytes = b""

    @property
    def sha256(self) -> str:
        """sha256 of the manifest's bytes, as ``checkpoint.json`` lists it."""
        return hashlib.sha256(self.raw).hexdigest()

    @property
    def directory(self) -> str:
        """The participant directory (store-relative)."""
        return self.path.rpartition("/")[0]

    @property
    def records_path(self) -> str:
        """Store-relative path of the records file."""
        return join(self.directory, self.records_file)

    @property
    def participant(self) -> str:
        """``kind/instance``, how errors and findings name the participant."""
        return f"{self.kind}/{self.instance}"

    def to_document(self) -> dict[str, Any]:
        """The manifest as the dict it is written from (fixed fields, extras, writer)."""
        document: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "kind": self.kind,
            "instance": self.instance,
            "checkpoint_id": self.checkpoint_id,
            "records_file": self.records_file,
            "records_sha256": self.records_sha256,
            "record_count": self.record_count,
            "records_bytes": self.records_bytes,
            "episode_ids": list(self.episode_ids),
        }
        document.update(self.extra)
        document["writer"] = self.writer
        return document

    @classmethod
    def build(
        cls,
        *,
        directory: str,
        kind: str,
        instance: str,
        checkpoint_id: str,
        records_sha256: str,
        record_count: int,
        records_bytes: int,
        episode_ids: list[str],
        extra: dict[str, Any] | None,
    ) -> Manifest:
        """A new manifest with its bytes; the same arguments always give the same bytes."""
        extra = dict(extra or {})
        clashing = sorted(RESERVED_FIELDS.intersection(extra))
        if clashing:
            raise ValueError(f"extra manifest fields may not use reserved names: {clashing}")
        manifest = cls(
            kind=kind,
            instance=instance,
            checkpoint_id=checkpoint_id,
            records_file=records_name(records_sha256),
            records_sha256=records_sha256,
            record_count=record_count,
            records_bytes=records_bytes,
            episode_ids=tuple(sorted(episode_ids)),
            writer=f"gymckpt {__version__}",
            extra=extra,
            path=join(directory, MANIFEST_NAME),
        )
        return _with_raw(manifest, encode_document(manifest.to_document()))

    @classmethod
    def parse(cls, raw: bytes, *, path: str, kind: str | None = None, instance: str | None = None) -> Manifest:
        """Validate manifest bytes read from ``path``; raise a typed InvalidCheckpointState."""
        directory = path.rpartition("/")[0]
        expected_kind, expected_instance = directory.split("/")[-2:] if directory.count("/") >= 1 else ("", "")
        kind = kind if kind is not None else expected_kind
        instance = instance if instance is not None else expected_instance
        where = {"path": path, "participant": f"{kind}/{instance}"}
        try:
            document = decode_document(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestNotJSON(f"manifest is not JSON: {exc}", **where) from exc
        if type(document) is not dict:
            raise ManifestNotObject(f"manifest is a JSON {type(document).__name__}, not an object", **where)
        version = document.get("schema_version")
        if version is None:
            raise ManifestFieldInvalid("manifest has no schema_version", **where)
        if type(version) is not int or version != SCHEMA_VERSION:
            raise UnsupportedSchemaVersion(
                f"manifest schema_version is {version!r}; this gymckpt reads {SCHEMA_VERSION}", **where
            )
        for name, expected in _REQUIRED.items():
            if name not in document:
                raise ManifestFieldInvalid(f"manifest has no {name}", **where)
            value = document[name]
            if type(value) is not expected:
                raise ManifestFieldInvalid(
                    f"manifest field {name} is a {type(value).__name__}, not {expected.__name__}", **where
                )
        for name in ("record_count", "records_bytes"):
            if document[name] < 0:
                raise ManifestFieldInvalid(f"manifest field {name} is negative", **where)
        episode_ids = document["episode_ids"]
        if not all(type(item) is str and item for item in episode_ids):
            raise ManifestFieldInvalid("manifest episode_ids holds a value that is not a non-empty string", **where)
        for earlier, later in itertools.pairwise(episode_ids):
            if earlier == later:
                raise DuplicateEpisode(f"manifest lists episode {earlier!r} twice", **where)
            if earlier > later:
                raise ManifestFieldInvalid(
                    f"manifest episode_ids are not sorted ({earlier!r} before {later!r})", **where
                )
        if not is_valid_name(document["checkpoint_id"]):
            raise ManifestFieldInvalid(
                f"manifest checkpoint_id {document['checkpoint_id']!r} is not a valid id", **where
            )
        if (document["kind"], document["instance"]) != (kind, instance):
            raise ParticipantMismatch(
                f"manifest names {document['kind']}/{document['instance']}, but lies in the directory of {kind}/{instance}",
                **where,
            )
        records_file = document["records_file"]
        if "/" in records_file or "\\" in records_file or records_file in ("", ".", ".."):
            raise RecordsPathEscapes(
                f"records_file {records_file!r} is not a file in the participant directory", **where
            )
        if not RECORDS_NAME_PATTERN.fullmatch(records_file):
            raise RecordsNameInvalid(
                f"records_file {records_file!r} does not match {RECORDS_NAME_PATTERN.pattern}", **where
            )
        if records_file != records_name(document["records_sha256"]):
            raise RecordsNameInvalid(
                f"records_file {records_file!r} is not named after records_sha256 {document['records_sha256']!r}",
                **where,
            )
        extra = {key: value for key, value in document.items() if key not in RESERVED_FIELDS}
        manifest = cls(
            kind=kind,
            instance=instance,
            checkpoint_id=document["checkpoint_id"],
            records_file=records_file,
            records_sha256=document["records_sha256"],
            record_count=document["record_count"],
            records_bytes=document["records_bytes"],
            episode_ids=tuple(document["episode_ids"]),
            writer=document["writer"],
            extra=extra,
            path=path,
        )
        return _with_raw(manifest, raw)


def _with_raw(manifest: Manifest, raw: bytes) -> Manifest:
    object.__setattr__(manifest, "raw", raw)
    return manifest
