"""A participant's manifest: what its records file holds, published last and never replaced.

Two formats are read; gymckpt writes only its own.

- **gymckpt** (:data:`GYMCKPT_FORMAT`): the reference's fields plus ``records_bytes``,
  ``episode_ids`` (sorted) and ``writer``. Every check applies: the records file is named
  ``records-<records_sha256>.jsonl``, its size and episode ids match. Since Hardening II it
  also holds ``max_record_bytes``, the size of its longest records line (newline included),
  which bounds what a reader holds of one line (:mod:`gymckpt.store.bounds`); manifests of
  earlier versions lack it and are read with the documented cap instead.
- **reference** (:data:`REFERENCE_FORMAT`): written by the reference stack, without those
  three fields; any JSON object encoding (it writes sorted keys, ``indent=1``, no trailing
  newline). Its records file may also carry the legacy name ``records.jsonl``, and its
  records name their episode with an ``{"rollout_id", "attempt"}`` object. Digest, count,
  one line per episode and the names are checked; size and episode ids cannot be.

A manifest holding some but not all of ``records_bytes``, ``episode_ids`` and ``writer``
is neither: gymckpt writes all three and the reference none, so it is damage
(:class:`~gymckpt.errors.ManifestFieldInvalid`). So is a reference participant extra field
that happens to use one of those names, or ``max_record_bytes``.

Manifests are decoded under a budget and refused with a key twice in one object
(:func:`~gymckpt.store.codec.decode_document`).

Both formats require ``schema_version`` 1, the kind and instance of the directory, and a
``checkpoint_id`` matching the checkpoint-id rule (the reference's control plane enforces
the same rule on every id it commits).
"""

from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import dataclass, field
from typing import Any

from gymckpt._version import __version__
from gymckpt.errors import (
    DuplicateEpisode,
    InvalidCheckpointState,
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
    ANY_RECORDS_NAME_PATTERN,
    MANIFEST_NAME,
    NAME_PATTERN,
    RECORDS_NAME_PATTERN,
    check_name,
    is_valid_name,
    participant_directory,
    records_name,
)

__all__ = [
    "GYMCKPT_FORMAT",
    "GYMCKPT_ONLY_FIELDS",
    "MANIFEST_NAME",
    "NAME_PATTERN",
    "RECORDS_NAME_PATTERN",
    "REFERENCE_FORMAT",
    "SCHEMA_VERSION",
    "Manifest",
    "check_name",
    "participant_directory",
    "records_name",
]

SCHEMA_VERSION = 1
#: the format gymckpt writes
GYMCKPT_FORMAT = "gymckpt"
#: the reference stack's format, read only
REFERENCE_FORMAT = "reference"

#: the fields of both formats, in the order gymckpt writes them
_COMMON: dict[str, type] = {
    "schema_version": int,
    "kind": str,
    "instance": str,
    "checkpoint_id": str,
    "records_file": str,
    "records_sha256": str,
    "record_count": int,
}
#: gymckpt's own fields: all present (gymckpt format) or none (reference format)
_GYMCKPT_ONLY: dict[str, type] = {"records_bytes": int, "episode_ids": list, "writer": str}
GYMCKPT_ONLY_FIELDS = tuple(_GYMCKPT_ONLY)
#: gymckpt's fields that its earlier versions did not write: optional in the gymckpt format, absent from the reference's
_GYMCKPT_LATER: dict[str, type] = {"max_record_bytes": int}
RESERVED_FIELDS = frozenset(_COMMON) | frozenset(_GYMCKPT_ONLY) | frozenset(_GYMCKPT_LATER)
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest and the exact bytes it was read from or written as.

    ``records_bytes``, ``episode_ids`` and ``writer`` are None in a reference-format
    manifest (:attr:`format`).
    """

    kind: str
    instance: str
    checkpoint_id: str
    records_file: str
    records_sha256: str
    record_count: int
    records_bytes: int | None = None
    episode_ids: tuple[str, ...] | None = None
    writer: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: the longest records line in bytes, newline included (None: a reference manifest, or an earlier gymckpt's)
    max_record_bytes: int | None = None
    #: store-relative path of the manifest file
    path: str = ""
    raw: bytes = b""
    #: the top-level keys in the order the document holds them (empty: gymckpt's order)
    key_order: tuple[str, ...] = field(default=(), repr=False)

    @property
    def format(self) -> str:
        """:data:`GYMCKPT_FORMAT` or :data:`REFERENCE_FORMAT` (a manifest without gymckpt's own fields)."""
        return GYMCKPT_FORMAT if self.writer is not None else REFERENCE_FORMAT

    @property
    def is_reference(self) -> bool:
        """True for a manifest in the reference's format."""
        return self.writer is None

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
        """The manifest object as stored: its fields and extras, in the stored key order.

        A reference-format manifest has no ``records_bytes``, ``episode_ids`` or ``writer``
        here either. Extras are the stored values themselves, not copies.
        """
        values: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "kind": self.kind,
            "instance": self.instance,
            "checkpoint_id": self.checkpoint_id,
            "records_file": self.records_file,
            "records_sha256": self.records_sha256,
            "record_count": self.record_count,
        }
        if not self.is_reference:
            values["records_bytes"] = self.records_bytes
            if self.max_record_bytes is not None:
                values["max_record_bytes"] = self.max_record_bytes
            values["episode_ids"] = list(self.episode_ids or ())
        values.update(self.extra)
        if not self.is_reference:
            values["writer"] = self.writer
        order = self.key_order or tuple(values)
        return {key: values[key] for key in order}

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
        max_record_bytes: int | None = None,
    ) -> Manifest:
        """A new manifest with its bytes; the same arguments always give the same bytes.

        ``max_record_bytes`` is the longest records line (newline included) as the writer
        measured it; None writes a manifest without it, as gymckpt before Hardening II did.
        """
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
            max_record_bytes=max_record_bytes,
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
            document = decode_document(raw, what="manifest", **where)
        except InvalidCheckpointState:
            raise  # over the parse budget, or a key twice: named already
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
        reference = _is_reference(document, where)
        _check_types(document, _COMMON if reference else _COMMON | _GYMCKPT_ONLY, where)
        if not reference:
            _check_episode_ids(document["episode_ids"], where)
            _check_max_record_bytes(document, where)
        if not is_valid_name(document["checkpoint_id"]):
            raise ManifestFieldInvalid(
                f"manifest checkpoint_id {document['checkpoint_id']!r} is not a valid id", **where
            )
        if (document["kind"], document["instance"]) != (kind, instance):
            raise ParticipantMismatch(
                f"manifest names {document['kind']}/{document['instance']}, but lies in the directory of {kind}/{instance}",
                **where,
            )
        _check_records_file(document["records_file"], document["records_sha256"], reference=reference, where=where)
        extra = {key: value for key, value in document.items() if key not in RESERVED_FIELDS}
        manifest = cls(
            kind=kind,
            instance=instance,
            checkpoint_id=document["checkpoint_id"],
            records_file=document["records_file"],
            records_sha256=document["records_sha256"],
            record_count=document["record_count"],
            records_bytes=None if reference else document["records_bytes"],
            episode_ids=None if reference else tuple(document["episode_ids"]),
            writer=None if reference else document["writer"],
            extra=extra,
            max_record_bytes=None if reference else document.get("max_record_bytes"),
            path=path,
            key_order=tuple(document),
        )
        return _with_raw(manifest, raw)


def _is_reference(document: dict[str, Any], where: dict[str, str]) -> bool:
    """True for a reference-format manifest (none of gymckpt's own fields); refuse one with some of them."""
    present = [name for name in _GYMCKPT_ONLY if name in document]
    if not present:
        later = [name for name in _GYMCKPT_LATER if name in document]
        if later:
            raise ManifestFieldInvalid(
                f"manifest has {', '.join(later)} but none of {', '.join(_GYMCKPT_ONLY)}: a reference manifest has "
                "no gymckpt field, so this one is neither",
                **where,
            )
        return True
    if len(present) < len(_GYMCKPT_ONLY):
        missing = [name for name in _GYMCKPT_ONLY if name not in document]
        raise ManifestFieldInvalid(
            f"manifest has {', '.join(present)} but no {', '.join(missing)}: a gymckpt manifest has all of "
            f"{', '.join(_GYMCKPT_ONLY)} and a reference manifest none, so this one is neither",
            **where,
        )
    return False


def _check_types(document: dict[str, Any], required: dict[str, type], where: dict[str, str]) -> None:
    for name, expected in required.items():
        if name not in document:
            raise ManifestFieldInvalid(f"manifest has no {name}", **where)
        value = document[name]
        if type(value) is not expected:
            raise ManifestFieldInvalid(
                f"manifest field {name} is a {type(value).__name__}, not {expected.__name__}", **where
            )
    for name in ("record_count", "records_bytes"):
        if name in required and document[name] < 0:
            raise ManifestFieldInvalid(f"manifest field {name} is negative", **where)


def _check_max_record_bytes(document: dict[str, Any], where: dict[str, str]) -> None:
    """The longest line a gymckpt manifest claims, where it claims one: an int within its records file."""
    if "max_record_bytes" not in document:
        return  # written before Hardening II: readers fall back to the documented cap
    value = document["max_record_bytes"]
    if type(value) is not int:
        raise ManifestFieldInvalid(f"manifest field max_record_bytes is a {type(value).__name__}, not int", **where)
    if not 0 <= value <= document["records_bytes"]:
        raise ManifestFieldInvalid(
            f"manifest field max_record_bytes {value} is not between 0 and records_bytes {document['records_bytes']}",
            **where,
        )


def _check_episode_ids(episode_ids: list[Any], where: dict[str, str]) -> None:
    if not all(type(item) is str and item for item in episode_ids):
        raise ManifestFieldInvalid("manifest episode_ids holds a value that is not a non-empty string", **where)
    for earlier, later in itertools.pairwise(episode_ids):
        if earlier == later:
            raise DuplicateEpisode(f"manifest lists episode {earlier!r} twice", **where)
        if earlier > later:
            raise ManifestFieldInvalid(f"manifest episode_ids are not sorted ({earlier!r} before {later!r})", **where)


def _check_records_file(records_file: str, sha256: str, *, reference: bool, where: dict[str, str]) -> None:
    """The records name: a file of the participant directory, named after its digest.

    A reference manifest may name the legacy ``records.jsonl``; a digest in the name must
    still be ``records_sha256`` (both writers name the file after it).
    """
    if "/" in records_file or "\\" in records_file or records_file in ("", ".", ".."):
        raise RecordsPathEscapes(f"records_file {records_file!r} is not a file in the participant directory", **where)
    pattern = ANY_RECORDS_NAME_PATTERN if reference else RECORDS_NAME_PATTERN
    match = pattern.fullmatch(records_file)
    if match is None:
        raise RecordsNameInvalid(f"records_file {records_file!r} does not match {pattern.pattern}", **where)
    named = match.group(1)
    if named is not None and named != sha256:
        raise RecordsNameInvalid(f"records_file {records_file!r} is not named after records_sha256 {sha256!r}", **where)
    if named is None and not _SHA256.fullmatch(sha256):
        raise ManifestFieldInvalid(f"manifest records_sha256 {sha256!r} is not a sha256 hex digest", **where)


def _with_raw(manifest: Manifest, raw: bytes) -> Manifest:
    object.__setattr__(manifest, "raw", raw)
    return manifest
