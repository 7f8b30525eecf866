"""Checkpoints in the reference stack's on-disk format, byte for byte, to test that gymckpt reads them.

Written from the documented shapes (docs/wire.md, "On-disk format"), not from the
reference's code:

- ``<checkpoint_dir>/gym/<kind>/<instance>/records-<sha256 of the file>.jsonl`` (or the
  legacy ``records.jsonl``): one ``json.dumps(record)`` line per record, so ``", "`` and
  ``": "`` separators, ASCII with ``\\uXXXX`` escapes, ``NaN``/``Infinity`` literals, the
  record's key order, and ``episode_id`` as an object ``{"rollout_id": str, "attempt": int}``.
- ``manifest.json``: ``json.dumps(manifest, sort_keys=True, indent=1)`` with no trailing
  newline; fields ``schema_version`` (1), ``kind``, ``instance``, ``checkpoint_id``,
  ``records_file``, ``records_sha256``, ``record_count``, and the participant's extras
  spread at the top level. No ``records_bytes``, ``episode_ids`` or ``writer``.
- no ``gym/checkpoint.json``: the reference's controller writes ``collection.json`` beside
  ``gym/`` (:func:`write_reference_collection`) and ``LATEST`` at its root.
- temporary files from ``mkstemp``: ``.records.jsonl.<random>`` and ``.manifest.json.<random>``
  (:func:`write_reference_leftovers`).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gymckpt.identity import episode_object

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "LEGACY_RECORDS_NAME",
    "REFERENCE_MANIFEST_FIELDS",
    "reference_manifest_bytes",
    "reference_participant_directory",
    "reference_record_line",
    "write_reference_collection",
    "write_reference_leftovers",
    "write_reference_participant",
    "write_reference_records_bytes",
]

LEGACY_RECORDS_NAME = "records.jsonl"
#: the manifest fields the reference writes (extras come beside them)
REFERENCE_MANIFEST_FIELDS = (
    "schema_version",
    "kind",
    "instance",
    "checkpoint_id",
    "records_file",
    "records_sha256",
    "record_count",
)


def reference_record_line(record: dict[str, Any]) -> bytes:
    """One records line as the reference writes it: ``json.dumps(record) + "\\n"``.

    The record's ``episode_id`` is written as given: pass the object form
    (:func:`write_reference_participant` converts capture keys).
    """
    return (json.dumps(record) + "\n").encode("ascii")


def reference_manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """A manifest's bytes as the reference writes them: sorted keys, ``indent=1``, no trailing newline."""
    return json.dumps(manifest, sort_keys=True, indent=1).encode("ascii")


def reference_participant_directory(checkpoint_dir: str | Path, kind: str, instance: str) -> Path:
    """``<checkpoint_dir>/gym/<kind>/<instance>``."""
    return Path(checkpoint_dir) / "gym" / kind / instance


def _with_episode_object(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with a capture-key ``episode_id`` turned into the object form, in its place."""
    episode_id = record.get("episode_id")
    if not isinstance(episode_id, str):
        return record
    return {key: episode_object(episode_id) if key == "episode_id" else value for key, value in record.items()}


def write_reference_participant(
    checkpoint_dir: str | Path,
    *,
    kind: str,
    instance: str,
    checkpoint_id: str,
    records: list[dict[str, Any]],
    extras: dict[str, Any] | None = None,
    legacy_name: bool = False,
) -> dict[str, Any]:
    """Write one participant's records file and manifest in the reference's format; return the manifest.

    Records whose ``episode_id`` is a capture key get the object form; objects are written
    as given (so tests can write damaged ones). With ``legacy_name`` the records file is
    ``records.jsonl`` instead of ``records-<sha256>.jsonl``.
    """
    data = b"".join(reference_record_line(_with_episode_object(record)) for record in records)
    return write_reference_records_bytes(
        checkpoint_dir,
        kind=kind,
        instance=instance,
        checkpoint_id=checkpoint_id,
        data=data,
        record_count=len(records),
        extras=extras,
        legacy_name=legacy_name,
    )


def write_reference_records_bytes(
    checkpoint_dir: str | Path,
    *,
    kind: str,
    instance: str,
    checkpoint_id: str,
    data: bytes,
    record_count: int | None = None,
    extras: dict[str, Any] | None = None,
    legacy_name: bool = False,
) -> dict[str, Any]:
    """Write ``data`` as a participant's records file with a reference manifest that agrees with it.

    For tests that need lines no writer would produce (damaged ones): the digest is the
    digest of ``data``, the count ``record_count`` or the number of lines in ``data``.
    Returns the manifest.
    """
    extras = dict(extras or {})
    clashing = sorted(set(REFERENCE_MANIFEST_FIELDS).intersection(extras))
    if clashing:
        raise ValueError(f"extras may not use the manifest's own field names: {clashing}")
    digest = hashlib.sha256(data).hexdigest()
    records_file = LEGACY_RECORDS_NAME if legacy_name else f"records-{digest}.jsonl"
    manifest: dict[str, Any] = {
        "schema_version": 1,
        "kind": kind,
        "instance": instance,
        "checkpoint_id": checkpoint_id,
        "records_file": records_file,
        "records_sha256": digest,
        "record_count": len(data.splitlines()) if record_count is None else record_count,
        **extras,
    }
    directory = reference_participant_directory(checkpoint_dir, kind, instance)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / records_file).write_bytes(data)
    (directory / "manifest.json").write_bytes(reference_manifest_bytes(manifest))
    return manifest


def write_reference_leftovers(checkpoint_dir: str | Path, *, kind: str, instance: str) -> list[Path]:
    """Leave the reference's two temporary files in a participant directory, as a crash mid-write would."""
    directory = reference_participant_directory(checkpoint_dir, kind, instance)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for prefix, content in ((".records.jsonl.", b'{"episode_id": {"rollout_id": "r"'), (".manifest.json.", b"{")):
        descriptor, name = tempfile.mkstemp(dir=directory, prefix=prefix)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(content)
        paths.append(Path(name))
    return paths


def write_reference_collection(
    root: str | Path,
    checkpoint_id: str,
    *,
    continued: Sequence[str] = (),
    run_id: str = "0" * 32,
    created_at: float = 1.0,
) -> Path:
    """The reference controller's publication: ``<root>/<checkpoint_id>/collection.json``, then ``<root>/LATEST``.

    ``continued`` holds capture keys; they are written as ``{"rollout_id", "attempt"}`` rows.
    Returns the checkpoint directory.
    """
    checkpoint_dir = Path(root) / checkpoint_id
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    document = {
        "checkpoint_id": checkpoint_id,
        "run_id": run_id,
        "created_at": created_at,
        "continued": [episode_object(key) for key in continued],
        "restarted": [],
    }
    (checkpoint_dir / "collection.json").write_bytes(json.dumps(document, separators=(",", ":")).encode())
    (Path(root) / "LATEST").write_bytes(checkpoint_id.encode())
    return checkpoint_dir
