"""The corruption table of the backend suite: one damage each, the typed error and the one finding it must give."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from gymckpt import errors
from gymckpt.store.layout import MANIFEST_NAME

if TYPE_CHECKING:
    from collections.abc import Callable

    from gymckpt.testing.backend_suite import BackendTests

__all__ = ["CORRUPTIONS"]


def _edit_manifest(change: Callable[[dict[str, Any]], None]) -> Callable[[BackendTests, Any, dict[str, str]], str]:
    def damage(suite: BackendTests, backend: Any, paths: dict[str, str]) -> str:
        document = json.loads(suite.raw_read(backend, paths["manifest"]))
        change(document)
        suite.raw_write(backend, paths["manifest"], json.dumps(document, indent=2).encode())
        return paths["manifest"]

    return damage


def _raw_manifest(data: bytes) -> Callable[[BackendTests, Any, dict[str, str]], str]:
    def damage(suite: BackendTests, backend: Any, paths: dict[str, str]) -> str:
        suite.raw_write(backend, paths["manifest"], data)
        return paths["manifest"]

    return damage


def _edit_records(change: Callable[[bytes], bytes]) -> Callable[[BackendTests, Any, dict[str, str]], str]:
    def damage(suite: BackendTests, backend: Any, paths: dict[str, str]) -> str:
        suite.raw_write(backend, paths["records"], change(suite.raw_read(backend, paths["records"])))
        return paths["records"]

    return damage


def _flip_byte(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1 :]


def _missing_records(suite: BackendTests, backend: Any, paths: dict[str, str]) -> str:
    suite.raw_delete(backend, paths["records"])
    return paths["records"]


def _consistent_bad_line(suite: BackendTests, backend: Any, paths: dict[str, str]) -> str:
    """A buggy writer: a line that is not JSON, with a manifest whose digest, size and name match."""
    lines = suite.raw_read(backend, paths["records"]).split(b"\n")
    lines[1] = b'{"episode_id":"r1", not json'
    data = b"\n".join(lines)
    digest = hashlib.sha256(data).hexdigest()
    directory = paths["manifest"].rpartition("/")[0]
    new_records = f"{directory}/records-{digest}.jsonl"
    suite.raw_delete(backend, paths["records"])
    suite.raw_write(backend, new_records, data)
    document = json.loads(suite.raw_read(backend, paths["manifest"]))
    document.update(records_file=f"records-{digest}.jsonl", records_sha256=digest, records_bytes=len(data))
    suite.raw_write(backend, paths["manifest"], json.dumps(document, indent=2).encode())
    return new_records


def _index_names_missing(suite: BackendTests, backend: Any, paths: dict[str, str]) -> str:
    document = json.loads(suite.raw_read(backend, paths["index"]))
    document["participants"].append(
        {
            "kind": "resources",
            "instance": "ghost",
            "manifest": f"gym/resources/ghost/{MANIFEST_NAME}",
            "manifest_sha256": "0" * 64,
        }
    )
    suite.raw_write(backend, paths["index"], json.dumps(document, indent=2).encode())
    return paths["index"].rpartition("/")[0] + f"/resources/ghost/{MANIFEST_NAME}"


def _index_digest(suite: BackendTests, backend: Any, paths: dict[str, str]) -> str:
    document = json.loads(suite.raw_read(backend, paths["index"]))
    entry = document["participants"][0]
    entry["manifest_sha256"] = "f" * 64
    suite.raw_write(backend, paths["index"], json.dumps(document, indent=2).encode())
    return paths["index"].rpartition("/gym/")[0] + "/" + entry["manifest"]


#: name -> (damage, typed error from reading, verify finding code)
CORRUPTIONS: dict[str, tuple[Callable[..., str], type[errors.InvalidCheckpointState], str]] = {
    "manifest_not_json": (_raw_manifest(b'{"schema_version": 1,'), errors.ManifestNotJSON, "manifest_not_json"),
    "manifest_json_array": (_raw_manifest(b"[1, 2, 3]\n"), errors.ManifestNotObject, "manifest_not_object"),
    "field_missing": (
        _edit_manifest(lambda doc: doc.pop("records_sha256")),
        errors.ManifestFieldInvalid,
        "manifest_field_invalid",
    ),
    "schema_version_2": (
        _edit_manifest(lambda doc: doc.update(schema_version=2)),
        errors.UnsupportedSchemaVersion,
        "unsupported_schema_version",
    ),
    "kind_mismatch": (
        _edit_manifest(lambda doc: doc.update(kind="model")),
        errors.ParticipantMismatch,
        "participant_mismatch",
    ),
    "instance_mismatch": (
        _edit_manifest(lambda doc: doc.update(instance="other")),
        errors.ParticipantMismatch,
        "participant_mismatch",
    ),
    "records_file_escapes": (
        _edit_manifest(lambda doc: doc.update(records_file="../x")),
        errors.RecordsPathEscapes,
        "records_path_escapes",
    ),
    "records_name_pattern": (
        _edit_manifest(lambda doc: doc.update(records_file="records-xyz.jsonl")),
        errors.RecordsNameInvalid,
        "records_name_invalid",
    ),
    "records_missing": (_missing_records, errors.RecordsMissing, "records_missing"),
    "byte_flipped": (_edit_records(_flip_byte), errors.RecordsDigestMismatch, "records_digest_mismatch"),
    "truncated_one_byte": (_edit_records(lambda data: data[:-1]), errors.RecordsSizeMismatch, "records_size_mismatch"),
    "line_appended": (
        _edit_records(lambda data: data + b'{"episode_id":"extra"}\n'),
        errors.RecordsSizeMismatch,
        "records_size_mismatch",
    ),
    "line_not_json": (_consistent_bad_line, errors.RecordUndecodable, "record_undecodable"),
    "record_count_wrong": (
        _edit_manifest(lambda doc: doc.update(record_count=doc["record_count"] + 1)),
        errors.RecordCountMismatch,
        "record_count_mismatch",
    ),
    "episode_ids_wrong": (
        _edit_manifest(lambda doc: doc.update(episode_ids=sorted([*doc["episode_ids"][1:], "zz-other"]))),
        errors.EpisodeIdsMismatch,
        "episode_ids_mismatch",
    ),
    "index_names_missing_participant": (
        _index_names_missing,
        errors.CheckpointIndexInvalid,
        "index_participant_missing",
    ),
    "index_digest_mismatch": (_index_digest, errors.CheckpointIndexInvalid, "index_digest_mismatch"),
}
