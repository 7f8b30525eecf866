"""Offline verification of checkpoint directories (``gymckpt verify``), restic-``check`` style.

Findings are typed values with a severity, collected phase by phase and never stopped
at the first. One damage gives one error: a participant whose manifest or records are
already reported damaged is not reported again by the checkpoint index check.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from gymckpt.errors import (
    CheckpointIndexInvalid,
    GymckptError,
    InvalidCheckpointState,
    RecordsMissing,
    RecordsSizeMismatch,
)
from gymckpt.store._local import TEMP_PREFIX
from gymckpt.store.backend import join
from gymckpt.store.checkpoint_store import backend_for_url
from gymckpt.store.manifest import MANIFEST_NAME, RECORDS_NAME_PATTERN, Manifest
from gymckpt.store.participant import expected_records, iter_manifest_records
from gymckpt.store.publication import INDEX_NAME, parse_index

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from gymckpt.store.backend import StorageBackend

__all__ = ["Finding", "NoCheckpointFound", "Severity", "VerifyReport", "scan_checkpoints", "verify", "verify_backend"]


class Severity(StrEnum):
    ERROR = "error"
    WARNING = "warning"


class NoCheckpointFound(GymckptError, FileNotFoundError):
    """Nothing under the URL looks like a checkpoint (no ``gym/`` directory)."""

    code = "checkpoint_not_found"
    status = 404


@dataclass(frozen=True)
class Finding:
    """One problem found: ``code`` names its type (the same names as the typed errors)."""

    code: str
    severity: Severity
    checkpoint: str
    path: str
    detail: str
    participant: str = ""
    #: what to run or do to clean it up, where something can be done
    fix: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {key: str(value) for key, value in asdict(self).items()}


@dataclass
class ParticipantSummary:
    """What one participant holds, for ``inspect`` and the report."""

    checkpoint: str
    kind: str
    instance: str
    manifest: Manifest | None = None

    @property
    def participant(self) -> str:
        return f"{self.kind}/{self.instance}"


@dataclass
class VerifyReport:
    """Everything ``verify`` found, with totals."""

    url: str
    quick: bool
    checkpoints: list[str] = field(default_factory=list)
    participants: list[ParticipantSummary] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    records_checked: int = 0
    bytes_checked: int = 0

    @property
    def errors(self) -> list[Finding]:
        return [finding for finding in self.findings if finding.severity is Severity.ERROR]

    @property
    def warnings(self) -> list[Finding]:
        return [finding for finding in self.findings if finding.severity is Severity.WARNING]

    @property
    def ok(self) -> bool:
        """True when no error was found (warnings are harmless leftovers)."""
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "ok": self.ok,
            "quick": self.quick,
            "checkpoints": self.checkpoints,
            "participants": len(self.participants),
            "records_checked": self.records_checked,
            "bytes_checked": self.bytes_checked,
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "findings": [finding.to_dict() for finding in self.findings],
        }


@dataclass
class _CheckpointFiles:
    index: str | None = None
    participants: dict[tuple[str, str], list[str]] = field(default_factory=lambda: defaultdict(list))
    stray: list[str] = field(default_factory=list)


def scan_checkpoints(paths: Iterable[str]) -> dict[str, _CheckpointFiles]:
    """Group store-relative file paths by checkpoint directory (the parent of ``gym/``)."""
    found: dict[str, _CheckpointFiles] = defaultdict(_CheckpointFiles)
    for path in paths:
        parts = path.split("/")
        if len(parts) >= 2 and parts[-2] == "gym":
            checkpoint = "/".join(parts[:-2])
            if parts[-1] == INDEX_NAME:
                found[checkpoint].index = path
            else:
                found[checkpoint].stray.append(path)
        elif len(parts) >= 4 and parts[-4] == "gym":
            found["/".join(parts[:-4])].participants[(parts[-3], parts[-2])].append(path)
    return dict(sorted(found.items()))


def verify(
    url: str, *, quick: bool = False, progress: Callable[[int, int], None] | None = None, **storage_options: Any
) -> VerifyReport:
    """Check one checkpoint directory, or every checkpoint under a root, offline.

    ``progress(advance, total)`` is called as records bytes are checked. Raises
    :class:`NoCheckpointFound` when nothing under ``url`` is a checkpoint and
    :class:`~gymckpt.errors.StorageError` when the storage cannot be listed.
    """
    backend = backend_for_url(url, **storage_options)
    try:
        return verify_backend(backend, quick=quick, progress=progress)
    finally:
        backend.close()


def verify_backend(
    backend: StorageBackend, *, quick: bool = False, progress: Callable[[int, int], None] | None = None
) -> VerifyReport:
    """:func:`verify` on an open backend."""
    report = VerifyReport(url=backend.url, quick=quick)
    checkpoints = scan_checkpoints(backend.walk_files(""))
    if not checkpoints:
        raise NoCheckpointFound(f"no checkpoint (no gym/ directory) under {backend.url}")
    report.checkpoints = list(checkpoints)
    manifests: dict[str, dict[tuple[str, str], Manifest]] = {}
    damaged: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for checkpoint, files in checkpoints.items():
        manifests[checkpoint] = {}
        for path in files.stray:
            report.findings.append(_leftover(checkpoint, path, "") or _unexpected(checkpoint, path, ""))
        for (kind, instance), paths in sorted(files.participants.items()):
            summary = ParticipantSummary(checkpoint, kind, instance)
            report.participants.append(summary)
            manifest, manifest_damaged = _check_manifest(backend, report, checkpoint, kind, instance, paths)
            if manifest_damaged:
                damaged[checkpoint].add((kind, instance))
            if manifest is None:
                continue
            summary.manifest = manifest
            manifests[checkpoint][(kind, instance)] = manifest
    total = sum(m.records_bytes for per in manifests.values() for m in per.values())
    for checkpoint, per_checkpoint in manifests.items():
        for key, manifest in per_checkpoint.items():
            if not _check_records(backend, report, checkpoint, manifest, quick=quick, total=total, progress=progress):
                damaged[checkpoint].add(key)
    for checkpoint, files in checkpoints.items():
        _check_index(backend, report, checkpoint, files, manifests[checkpoint], damaged[checkpoint])
    return report


def _leftover(checkpoint: str, path: str, participant: str) -> Finding | None:
    name = path.rpartition("/")[2]
    if not name.startswith(TEMP_PREFIX):
        return None
    return Finding(
        "leftover_temporary_file",
        Severity.WARNING,
        checkpoint,
        path,
        "a temporary file of a write that did not finish",
        participant,
        fix=f"delete {path}",
    )


def _unexpected(checkpoint: str, path: str, participant: str) -> Finding:
    return Finding("unexpected_file", Severity.WARNING, checkpoint, path, "a file gymckpt did not write", participant)


def _check_manifest(
    backend: StorageBackend, report: VerifyReport, checkpoint: str, kind: str, instance: str, paths: list[str]
) -> tuple[Manifest | None, bool]:
    """Check a participant directory's manifest and other files; return (manifest, damaged)."""
    participant = f"{kind}/{instance}"
    manifest_path = join(checkpoint, "gym", kind, instance, MANIFEST_NAME)
    manifest: Manifest | None = None
    has_manifest = manifest_path in paths
    if has_manifest:
        try:
            manifest = Manifest.parse(
                backend.read_bytes(manifest_path), path=manifest_path, kind=kind, instance=instance
            )
        except InvalidCheckpointState as exc:
            report.findings.append(_from_error(checkpoint, exc, participant))
        except FileNotFoundError:
            has_manifest = False  # deleted while we looked
    if not has_manifest:
        report.findings.append(
            Finding(
                "unfinished_commit",
                Severity.WARNING,
                checkpoint,
                join(checkpoint, "gym", kind, instance),
                "participant directory without a manifest: a commit that did not finish",
                participant,
            )
        )
    for path in sorted(paths):
        if path == manifest_path:
            continue
        name = path.rpartition("/")[2]
        leftover = _leftover(checkpoint, path, participant)
        if leftover is not None:
            report.findings.append(leftover)
        elif not RECORDS_NAME_PATTERN.match(name):
            report.findings.append(_unexpected(checkpoint, path, participant))
        elif has_manifest and manifest is None:
            continue  # the manifest is damaged (reported): which records it named is unknown
        elif manifest is None or name != manifest.records_file:
            report.findings.append(
                Finding(
                    "orphaned_records",
                    Severity.WARNING,
                    checkpoint,
                    path,
                    "a records file no manifest names (a losing or unfinished writer)",
                    participant,
                    fix=f"delete {path}",
                )
            )
    return manifest, has_manifest and manifest is None


def _check_records(
    backend: StorageBackend,
    report: VerifyReport,
    checkpoint: str,
    manifest: Manifest,
    *,
    quick: bool,
    total: int,
    progress: Callable[[int, int], None] | None,
) -> bool:
    """Check the manifest's records file; True when it is intact."""
    try:
        if quick:
            expected = expected_records(manifest)
            try:
                size = backend.size(manifest.records_path)
            except FileNotFoundError as exc:
                raise expected.fail(RecordsMissing, "records file is missing") from exc
            if size != manifest.records_bytes:
                raise expected.fail(
                    RecordsSizeMismatch, f"records file has {size} bytes, manifest says {manifest.records_bytes}"
                )
        else:
            advance = None if progress is None else (lambda done: progress(done, total))
            for _ in iter_manifest_records(backend, manifest, scope=(), decode_all=True, progress=advance):
                pass
            report.records_checked += manifest.record_count
        report.bytes_checked += manifest.records_bytes
        return True
    except InvalidCheckpointState as exc:
        report.findings.append(_from_error(checkpoint, exc, manifest.participant))
        return False


def _check_index(
    backend: StorageBackend,
    report: VerifyReport,
    checkpoint: str,
    files: _CheckpointFiles,
    manifests: dict[tuple[str, str], Manifest],
    damaged: set[tuple[str, str]],
) -> None:
    if files.index is None:
        report.findings.append(
            Finding(
                "checkpoint_unpublished",
                Severity.WARNING,
                checkpoint,
                join(checkpoint, "gym", INDEX_NAME),
                "no checkpoint.json: the checkpoint was committed but never published",
            )
        )
        return
    try:
        index = parse_index(backend.read_bytes(files.index), path=files.index)
    except (InvalidCheckpointState, FileNotFoundError) as exc:
        detail = exc.reason if isinstance(exc, InvalidCheckpointState) else "checkpoint.json vanished"
        report.findings.append(Finding(CheckpointIndexInvalid.problem, Severity.ERROR, checkpoint, files.index, detail))
        return
    listed = {(entry.kind, entry.instance): entry for entry in index.participants}
    for key, entry in sorted(listed.items()):
        manifest = manifests.get(key)
        if key in damaged:
            continue
        if manifest is None:
            report.findings.append(
                Finding(
                    "index_participant_missing",
                    Severity.ERROR,
                    checkpoint,
                    join(checkpoint, entry.manifest),
                    "checkpoint.json lists a participant whose manifest is missing",
                    entry.participant,
                )
            )
        elif hashlib.sha256(manifest.raw).hexdigest() != entry.manifest_sha256:
            report.findings.append(
                Finding(
                    "index_digest_mismatch",
                    Severity.ERROR,
                    checkpoint,
                    manifest.path,
                    f"manifest hashes to {manifest.sha256}, checkpoint.json says {entry.manifest_sha256}",
                    entry.participant,
                )
            )
    for key in sorted(set(manifests) - set(listed) - damaged):
        report.findings.append(
            Finding(
                "index_participant_unlisted",
                Severity.ERROR,
                checkpoint,
                manifests[key].path,
                "a committed participant that checkpoint.json does not list",
                manifests[key].participant,
            )
        )


def _from_error(checkpoint: str, exc: InvalidCheckpointState, participant: str) -> Finding:
    return Finding(exc.problem, Severity.ERROR, checkpoint, exc.path, exc.reason, exc.participant or participant)
