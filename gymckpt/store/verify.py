"""Offline verification of checkpoint directories (``gymckpt verify``), restic-``check`` style.

Findings are typed values with a severity, collected phase by phase and never stopped
at the first. One damage gives one error: a participant whose manifest or records are
already reported damaged is not reported again by the checkpoint index check.

Checkpoints the reference stack wrote are checked as far as their format allows, and the
report says which format each participant is in (:attr:`ParticipantSummary.format`): a
reference manifest claims no size and no episode ids, so those two checks are skipped and
everything else (names, digest, count, every line, one line per episode) is checked. A
checkpoint without ``checkpoint.json`` is normal when the reference published it: every
intact participant is in the reference format, or its controller's ``collection.json``
lies beside ``gym/``.

Checkpoints are checked one at a time, start to end (manifests, records, index), and only
that checkpoint's manifests are held: memory does not grow with the number of checkpoints.
A checkpoint deleted while it is checked (a collector pruning it: see
:mod:`gymckpt.store.pruning`) is one warning, ``checkpoint_vanished``, not the errors its
missing files would give: when a check finds errors or files gone, the checkpoint is listed
again, and if what published it (its ``checkpoint.json``, or for an unpublished one its
manifests) is gone, so is the checkpoint. An object key no path names (``gym//x``) is a
finding too, ``unaddressable_key`` (:func:`gymckpt.store.listing.place_unaddressable`).

Each checkpoint gets a status (:class:`CheckpointStatus`): ``published`` (its
``checkpoint.json``, or the reference's publication), ``unpublished`` (every participant
committed, nothing published), ``unfinished`` (a participant directory without a manifest, or
a ``gym/`` without participants, and nothing published: a commit that did not finish, such as
the empty participant directory a failed commit leaves, which the listing finds on a
filesystem), ``damaged`` (an error) or ``vanished`` (deleted while it was checked). Only
``damaged`` is an error; the others are no damage, and the command says which each checkpoint is.

Strings in findings are data from the checkpoint: :meth:`Finding.to_dict` gives a byte of
a name that is not UTF-8 as ``\\xNN`` (:func:`~gymckpt.store.printable.json_text`); whoever
shows them to a person escapes them (:func:`~gymckpt.store.printable.printable`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from gymckpt.errors import (
    CheckpointIndexInvalid,
    GymckptError,
    InvalidCheckpointState,
    NoCheckpointFound,
    NotRegularFile,
    UnaddressableKey,
)
from gymckpt.store.backend import join
from gymckpt.store.checkpoint_store import backend_for_url
from gymckpt.store.layout import (
    GYM_DIR,
    MANIFEST_NAME,
    REFERENCE_TEMP_PATTERN,
    CheckpointLayout,
    index_path,
    scan_checkpoints,
)
from gymckpt.store.listing import list_store, place_unaddressable, records_size, walk_store
from gymckpt.store.manifest import GYMCKPT_FORMAT, GYMCKPT_ONLY_FIELDS, REFERENCE_FORMAT
from gymckpt.store.participant import iter_manifest_records, read_manifest_file
from gymckpt.store.printable import json_text
from gymckpt.store.publication import index_problems, read_index_file

if TYPE_CHECKING:
    from collections.abc import Callable

    from gymckpt.store.backend import StorageBackend
    from gymckpt.store.layout import ParticipantLayout
    from gymckpt.store.listing import KeyPlacement
    from gymckpt.store.manifest import Manifest
    from gymckpt.store.publication import CheckpointIndex

__all__ = [
    "CHECKPOINT_VANISHED",
    "CheckpointStatus",
    "FORMAT_NOTES",
    "Finding",
    "NoCheckpointFound",
    "ParticipantSummary",
    "Severity",
    "VerifyReport",
    "scan_checkpoints",
    "verify",
    "verify_backend",
]

#: how the report describes each manifest format
FORMAT_NOTES = {
    GYMCKPT_FORMAT: "gymckpt format",
    REFERENCE_FORMAT: f"reference format (no {', '.join(GYMCKPT_ONLY_FIELDS)})",
}


#: the warning for a checkpoint deleted or unpublished while verify read it
CHECKPOINT_VANISHED = "checkpoint_vanished"


class Severity(StrEnum):
    ERROR = "error"
    WARNING = "warning"


class CheckpointStatus(StrEnum):
    """What one checkpoint is, as far as verify saw (module docstring); only ``damaged`` is an error."""

    PUBLISHED = "published"
    UNPUBLISHED = "unpublished"
    UNFINISHED = "unfinished"
    DAMAGED = "damaged"
    VANISHED = "vanished"


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
        """Every field as a string; a byte of a name that is not UTF-8 as ``\\xNN`` (:func:`json_text`)."""
        return {key: json_text(value) for key, value in asdict(self).items()}


@dataclass
class ParticipantSummary:
    """One participant the report covers (the manifest itself is not kept: one checkpoint's at a time)."""

    checkpoint: str
    kind: str
    instance: str
    #: the manifest's format (``gymckpt`` or ``reference``); None when it is missing or damaged
    format: str | None = None

    @property
    def participant(self) -> str:
        return f"{self.kind}/{self.instance}"

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoint": json_text(self.checkpoint), "participant": self.participant, "format": self.format}


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
    #: each checkpoint's status, by checkpoint (the names of :attr:`checkpoints`)
    statuses: dict[str, CheckpointStatus] = field(default_factory=dict)

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

    @property
    def formats(self) -> dict[str, int]:
        """How many participants with a readable manifest are in each format."""
        counts = {GYMCKPT_FORMAT: 0, REFERENCE_FORMAT: 0}
        for summary in self.participants:
            if summary.format is not None:
                counts[summary.format] += 1
        return counts

    def with_status(self, status: CheckpointStatus) -> list[str]:
        """The checkpoints of one status, in order."""
        return [name for name in self.checkpoints if self.statuses.get(name) is status]

    def status_summary(self) -> str:
        """``1 published, 1 unpublished``: how many checkpoints have each status found."""
        return ", ".join(f"{len(names)} {status}" for status in CheckpointStatus if (names := self.with_status(status)))

    def format_summary(self) -> str:
        """``2 gymckpt format, 1 reference format (no records_bytes, episode_ids, writer)``; only formats found."""
        return ", ".join(f"{count} {FORMAT_NOTES[name]}" for name, count in self.formats.items() if count)

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": json_text(self.url),
            "ok": self.ok,
            "quick": self.quick,
            "checkpoints": [json_text(checkpoint) for checkpoint in self.checkpoints],
            "checkpoint_status": {
                json_text(checkpoint): str(self.statuses[checkpoint])
                for checkpoint in self.checkpoints
                if checkpoint in self.statuses
            },
            "participants": len(self.participants),
            "formats": self.formats,
            "participant_formats": [summary.to_dict() for summary in self.participants],
            "records_checked": self.records_checked,
            "bytes_checked": self.bytes_checked,
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "findings": [finding.to_dict() for finding in self.findings],
        }


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
    """:func:`verify` on an open backend: the same scan and the same reads a restore uses.

    Checkpoints are checked one after the other, each from its manifests to its index, so at
    most one checkpoint's manifests are held at a time.
    """
    report = VerifyReport(url=backend.url, quick=quick)
    listing = list_store(backend)
    odd: dict[str, list[KeyPlacement]] = {}
    for key in listing.unaddressable:
        placed = place_unaddressable(key, listing.checkpoints)
        odd.setdefault(placed.checkpoint, []).append(placed)
    if not listing.checkpoints and not odd:
        raise NoCheckpointFound(f"no checkpoint (no gym/ directory) under {backend.url}")
    report.checkpoints = sorted(set(listing.checkpoints) | set(odd))
    total = _records_total(backend, listing.checkpoints) if progress is not None and not quick else 0
    for checkpoint in report.checkpoints:
        layout = listing.checkpoints.get(checkpoint) or CheckpointLayout(checkpoint)
        check = _CheckpointCheck(backend, report, layout, listed=checkpoint in listing.checkpoints)
        check.unaddressable(odd.get(checkpoint, []))
        check.scan_and_manifests()
        check.records(quick=quick, total=total, progress=progress)
        check.index_agreement()
        check.settle()
    return report


def _records_total(backend: StorageBackend, checkpoints: dict[str, CheckpointLayout]) -> int:
    """The bytes of every records file listed, for a progress bar's total (a stat each: no manifest kept)."""
    total = 0
    for layout in checkpoints.values():
        for files in layout.participants.values():
            for path in files.records:
                try:
                    total += backend.size(path)
                except (OSError, InvalidCheckpointState):
                    pass  # missing or refused: the check reports it
    return total


class _CheckpointCheck:
    """The phases of checking one checkpoint directory; one damage gives one finding."""

    def __init__(
        self, backend: StorageBackend, report: VerifyReport, layout: CheckpointLayout, *, listed: bool = True
    ) -> None:
        self.backend = backend
        self.report = report
        self.layout = layout
        #: False for a checkpoint only object keys no path names place here (nothing of it was listed)
        self.found = listed
        self.checkpoint = layout.directory
        self.irregular = {path for path, _, _ in layout.irregular}
        #: this checkpoint's findings, handed to the report by :meth:`settle`
        self.findings: list[Finding] = []
        #: the manifests the listing found (what publishes an unpublished checkpoint)
        self.listed_manifests = {files.manifest for files in layout.participants.values() if files.manifest}
        #: a file the listing found was gone when read
        self.files_gone = False
        self.manifests: dict[tuple[str, str], Manifest] = {}
        self.damaged: set[tuple[str, str]] = set()
        self.index: CheckpointIndex | None = None
        #: records files a valid manifest does not name: (participant key, path)
        self.orphans: list[tuple[tuple[str, str], str]] = []
        #: sizes of records files whose manifest claims none (reference format), as the storage reports them
        self.stat_sizes: dict[str, int] = {}

    def add(self, code: str, severity: Severity, path: str, detail: str, participant: str = "", fix: str = "") -> None:
        self.findings.append(Finding(code, severity, self.checkpoint, path, detail, participant, fix))

    def add_error(self, exc: InvalidCheckpointState, participant: str = "") -> None:
        self.add(exc.problem, Severity.ERROR, exc.path, exc.reason, exc.participant or participant)

    def size_of(self, manifest: Manifest) -> int:
        """The records size a manifest claims; for one that claims none, the file's (0 if unreadable)."""
        if manifest.records_bytes is not None:
            return manifest.records_bytes
        path = manifest.records_path
        if path not in self.stat_sizes:
            try:
                self.stat_sizes[path] = 0 if path in self.irregular else self.backend.size(path)
            except (OSError, InvalidCheckpointState):
                self.stat_sizes[path] = 0  # missing or refused: the records check reports it
        return self.stat_sizes[path]

    def unaddressable(self, placed: list[KeyPlacement]) -> None:
        """One finding per object key no path names: an error where a tool that maps keys to paths would
        read it as checkpoint state (or outside the root), a warning elsewhere."""
        for key in placed:
            if key.misleading:
                self.add(
                    UnaddressableKey.problem,
                    Severity.ERROR,
                    key.key,
                    f"an object key with empty, '.' or '..' segments: gymckpt never reads it, but a tool that "
                    f"maps keys to paths reads it as {key.normalized}, in place of or beside what was checked",
                    fix=f"delete the object {key.key!r}",
                )
            else:
                self.add(
                    UnaddressableKey.problem,
                    Severity.WARNING,
                    key.key,
                    f"an object key with empty, '.' or '..' segments: no reader of the checkpoint reads it "
                    f"(a tool that maps keys to paths would read it as {key.normalized})",
                    fix=f"delete the object {key.key!r}",
                )

    def scan_and_manifests(self) -> None:
        layout = self.layout
        for path, kind, participant in layout.irregular:
            self.add(
                NotRegularFile.problem,
                Severity.ERROR,
                path,
                f"a {kind} where checkpoint state belongs: refused, never followed or read",
                participant,
            )
        for path in layout.temporary:
            self.add_leftover(path, "")
        for path, participant in layout.unexpected:
            self.add_unexpected(path, participant)
        self.read_index()
        for key, files in sorted(layout.participants.items()):
            self.report.participants.append(ParticipantSummary(self.checkpoint, *key))
            self.participant(files)

    def read_index(self) -> None:
        path = index_path(self.checkpoint)
        if self.layout.index is None or path in self.irregular:
            return
        try:
            self.index = read_index_file(self.backend, path)
        except InvalidCheckpointState as exc:
            self.add_error(exc)
        except FileNotFoundError:
            self.files_gone = True
            self.add(CheckpointIndexInvalid.problem, Severity.ERROR, path, "checkpoint.json vanished while verify ran")

    def listed(self, key: tuple[str, str]) -> bool:
        return self.index is not None and any((entry.kind, entry.instance) == key for entry in self.index.participants)

    def participant(self, files: ParticipantLayout) -> None:
        key = (files.kind, files.instance)
        participant = files.participant
        manifest_path = join(files.directory, MANIFEST_NAME)
        manifest: Manifest | None = None
        if files.directory in self.irregular or manifest_path in self.irregular:
            self.damaged.add(key)  # reported by the scan
        elif files.manifest is not None:
            try:
                manifest = read_manifest_file(self.backend, manifest_path, kind=files.kind, instance=files.instance)
            except InvalidCheckpointState as exc:
                self.add_error(exc, participant)
                self.damaged.add(key)
            except FileNotFoundError:
                files.manifest = None  # deleted while we looked
                self.files_gone = True
        if manifest is None and key not in self.damaged and not self.listed(key):
            empty = not (files.manifest or files.records or files.temporary or files.unexpected)
            self.add(
                "unfinished_commit",
                Severity.WARNING,
                files.directory,
                "an empty participant directory: what a commit that failed leaves (no records, no manifest)"
                if empty
                else "participant directory without a manifest: a commit that did not finish",
                participant,
            )
        if manifest is not None:
            self.manifests[key] = manifest
            self.report.participants[-1].format = manifest.format
        for path in files.temporary:
            self.add_leftover(path, participant)
        for path in files.unexpected:
            self.add_unexpected(path, participant)
        for path in files.records:
            if manifest is not None and path == manifest.records_path:
                continue
            if manifest is not None:
                self.orphans.append((key, path))  # the advice waits for the manifest's own records
            elif key in self.damaged:
                continue  # the manifest is damaged (reported): which records it named is unknown
            elif self.listed(key):
                self.add(
                    "orphaned_records",
                    Severity.WARNING,
                    path,
                    "the manifest of this records file is missing, but checkpoint.json lists the participant: "
                    "keep the file, it may be the only copy of the participant's state",
                    participant,
                )
            else:
                self.add(
                    "orphaned_records",
                    Severity.WARNING,
                    path,
                    "a records file no manifest names (an unfinished commit's)",
                    participant,
                )

    def add_leftover(self, path: str, participant: str) -> None:
        whose = " (the reference stack's)" if REFERENCE_TEMP_PATTERN.fullmatch(path.rpartition("/")[2]) else ""
        self.add(
            "leftover_temporary_file",
            Severity.WARNING,
            path,
            f"a temporary file of a write that did not finish{whose}",
            participant,
            fix=f"delete {path}",
        )

    def add_unexpected(self, path: str, participant: str) -> None:
        self.add("unexpected_file", Severity.WARNING, path, "a file gymckpt did not write", participant)

    def records(self, *, quick: bool, total: int, progress: Callable[[int, int], None] | None) -> None:
        for key, manifest in list(self.manifests.items()):
            if manifest.records_path in self.irregular:
                self.damaged.add(key)  # reported by the scan
                continue
            if not self.records_intact(manifest, quick=quick, total=total, progress=progress):
                self.damaged.add(key)
        for key, path in self.orphans:
            if key in self.damaged:  # the named records are damaged: this file may be the only good copy
                self.add(
                    "orphaned_records",
                    Severity.WARNING,
                    path,
                    "a records file the manifest does not name; the manifest's own records are damaged, "
                    "so keep it until the damage is understood",
                    self.manifests[key].participant,
                )
            else:
                self.add(
                    "orphaned_records",
                    Severity.WARNING,
                    path,
                    "a records file the manifest does not name (a losing writer's)",
                    self.manifests[key].participant,
                    fix=f"delete {path}",
                )

    def records_intact(
        self, manifest: Manifest, *, quick: bool, total: int, progress: Callable[[int, int], None] | None
    ) -> bool:
        try:
            if quick:
                checked = records_size(self.backend, manifest)
            else:
                advance = None if progress is None else (lambda done: progress(done, total))
                for _ in iter_manifest_records(self.backend, manifest, scope=(), decode_all=True, progress=advance):
                    pass
                self.report.records_checked += manifest.record_count
                checked = self.size_of(manifest)
            self.report.bytes_checked += checked
            return True
        except InvalidCheckpointState as exc:
            self.add_error(exc, manifest.participant)
            return False

    def published_by_reference(self) -> bool:
        """True when the reference stack published this checkpoint, so no ``checkpoint.json`` is expected.

        Its controller's ``collection.json`` lies beside ``gym/``, or every intact
        participant is in the reference format (which publishes no index).
        """
        if self.layout.collection is not None:
            return True
        manifests = list(self.manifests.values())
        return bool(manifests) and all(manifest.is_reference for manifest in manifests)

    def index_agreement(self) -> None:
        if join(self.checkpoint, GYM_DIR) in self.irregular:
            return  # gym/ itself is refused: nothing below it was looked at
        if index_path(self.checkpoint) in self.irregular:
            return  # reported by the scan
        if self.layout.index is None:
            if self.found and not self.layout.participants:
                self.add(
                    "unfinished_commit",
                    Severity.WARNING,
                    join(self.checkpoint, GYM_DIR),
                    "a gym/ directory without a participant: a commit that did not finish",
                )
            elif not self.published_by_reference():
                self.add(
                    "checkpoint_unpublished",
                    Severity.WARNING,
                    index_path(self.checkpoint),
                    "no checkpoint.json: a commit that did not finish, so nothing was published"
                    if self.unfinished()
                    else "no checkpoint.json: the checkpoint was committed but never published",
                )
            return
        if self.index is None:
            return  # unreadable or not a regular file: reported
        refused = [path + "/" for path in self.irregular]
        hidden = {  # listed participants below a refused directory: that refusal is their finding
            (entry.kind, entry.instance)
            for entry in self.index.participants
            if any(join(self.checkpoint, entry.manifest).startswith(prefix) for prefix in refused)
        }
        for problem in index_problems(self.index, self.checkpoint, self.manifests, damaged=self.damaged | hidden):
            self.add_error(problem)

    def unfinished(self) -> bool:
        """True when a listed participant has no manifest and none is damaged: its commit did not finish."""
        return any(key not in self.manifests and key not in self.damaged for key in self.layout.participants)

    def status(self) -> CheckpointStatus:
        """This checkpoint's status from its findings and files (before :meth:`settle` clears its manifests)."""
        if any(finding.severity is Severity.ERROR for finding in self.findings):
            return CheckpointStatus.DAMAGED
        if self.layout.index is not None or self.published_by_reference():
            return CheckpointStatus.PUBLISHED
        if self.found and (not self.layout.participants or self.unfinished()):
            return CheckpointStatus.UNFINISHED
        return CheckpointStatus.UNPUBLISHED

    def settle(self) -> None:
        """Hand this checkpoint's findings and status to the report; one ``checkpoint_vanished`` warning
        instead if it was deleted or unpublished while it was checked (its errors are then what the
        deletion did)."""
        status = self.status()
        if (
            self.files_gone or any(finding.severity is Severity.ERROR for finding in self.findings)
        ) and self.vanished():
            status = CheckpointStatus.VANISHED
            self.findings = [
                Finding(
                    CHECKPOINT_VANISHED,
                    Severity.WARNING,
                    self.checkpoint,
                    join(self.checkpoint, GYM_DIR),
                    "the checkpoint was deleted or unpublished while verify read it (a collector pruning it, "
                    "most likely): what is left of it is not checked",
                )
            ]
        self.report.findings.extend(self.findings)
        self.report.statuses[self.checkpoint] = status
        self.manifests.clear()  # one checkpoint's manifests at a time

    def vanished(self) -> bool:
        """True when what published this checkpoint when it was listed is gone now.

        Its ``checkpoint.json``; for a checkpoint listed without one, a manifest. A published
        checkpoint whose index is still there is damaged, not vanished, whatever else is missing.
        """
        try:
            now = {path for path, _ in walk_store(self.backend, join(self.checkpoint, GYM_DIR))[0]}
        except (OSError, GymckptError):
            return False  # cannot tell: the findings stand
        if self.layout.index is not None:
            return self.layout.index not in now
        return bool(self.listed_manifests - now)
