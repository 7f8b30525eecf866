"""The on-disk layout of a checkpoint, and the one scan that finds its parts.

::

    <checkpoint_dir>/gym/checkpoint.json                       the index, published last
    <checkpoint_dir>/gym/<kind>/<instance>/manifest.json       one per participant, created last
    <checkpoint_dir>/gym/<kind>/<instance>/records-<sha256>.jsonl
    .gymckpt-tmp-<hex>.part                                    a write in progress (or a leftover)

The reference stack's checkpoints share this layout and are read too: its legacy records
name ``records.jsonl``, its temporary files ``.records.jsonl.<random>`` and
``.manifest.json.<random>`` (leftovers, like gymckpt's), and kind and instance names
longer than gymckpt writes (up to :data:`MAX_READ_NAME_LENGTH`, a file-name limit). It
publishes no ``gym/checkpoint.json``; its controller writes ``collection.json`` beside
``gym/`` instead (:attr:`CheckpointLayout.collection`) and ``LATEST`` at the root, which
lie outside every ``gym/`` and so are never findings.

``verify``, ``inspect`` and a server's restore all find participants through
:func:`scan_checkpoints`, so they see the same ones: every valid name is a participant,
including names equal to layout words (an instance called ``gym``). Only regular files in
real directories are state; a symlink, FIFO or device where state belongs is reported as
damage, never followed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gymckpt.store.backend import EntryKind, join

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = [
    "ANY_RECORDS_NAME_PATTERN",
    "COLLECTION_NAME",
    "GYM_DIR",
    "INDEX_NAME",
    "MANIFEST_NAME",
    "MAX_INDEX_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_READ_NAME_LENGTH",
    "NAME_PATTERN",
    "READ_NAME_PATTERN",
    "RECORDS_NAME_PATTERN",
    "REFERENCE_TEMP_PATTERN",
    "TEMP_PREFIX",
    "CheckpointLayout",
    "EntryKind",
    "ParticipantLayout",
    "check_name",
    "check_readable_name",
    "index_path",
    "is_readable_name",
    "is_records_name",
    "is_temporary_name",
    "is_valid_name",
    "participant_directory",
    "records_name",
    "scan_checkpoints",
]

GYM_DIR = "gym"
INDEX_NAME = "checkpoint.json"
MANIFEST_NAME = "manifest.json"
#: every temporary file a backend writes starts with this; verify reports leftovers
TEMP_PREFIX = ".gymckpt-tmp-"
#: kinds, instances and checkpoint ids: one safe path component (matched whole: no trailing newline)
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: the longest kind or instance name read: the reference sets no limit, a file name holds 255 bytes
MAX_READ_NAME_LENGTH = 255
#: kinds and instances as read: the same characters, as long as a file name can be
READ_NAME_PATTERN = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_READ_NAME_LENGTH - 1}}}")
#: the records name gymckpt writes (and requires in its own manifests)
RECORDS_NAME_PATTERN = re.compile(r"records-([0-9a-f]{64})\.jsonl")
#: every records name read: the reference's readers also take the legacy ``records.jsonl``
ANY_RECORDS_NAME_PATTERN = re.compile(r"records(?:-([0-9a-f]{64}))?\.jsonl")
#: the reference's temporary files (``mkstemp`` prefixes ``.records.jsonl.`` and ``.manifest.json.``)
REFERENCE_TEMP_PATTERN = re.compile(r"\.(?:records\.jsonl|manifest\.json)\.[^/]+")
#: the reference controller's rollout-collection manifest, beside ``gym/``: its publication
COLLECTION_NAME = "collection.json"
#: a manifest lists every episode id, so it grows with the records; larger ones are refused unread
MAX_MANIFEST_BYTES = 64 << 20
#: checkpoint.json lists participants only
MAX_INDEX_BYTES = 16 << 20


def is_valid_name(value: object) -> bool:
    """True for a safe name (kind, instance, checkpoint id), the one rule at every entry point."""
    return isinstance(value, str) and NAME_PATTERN.fullmatch(value) is not None


def check_name(what: str, value: object) -> str:
    """Return ``value`` if it is a safe name (kind, instance, checkpoint id); else ValueError."""
    if not is_valid_name(value):
        raise ValueError(f"{what} must match {NAME_PATTERN.pattern} (1-128 characters), got {value!r}")
    return value  # type: ignore[return-value]


def is_readable_name(value: object) -> bool:
    """True for a kind or instance name a checkpoint may hold: a safe name of up to 255 characters.

    Longer than gymckpt writes (:func:`is_valid_name`), because the reference sets no limit.
    """
    return isinstance(value, str) and READ_NAME_PATTERN.fullmatch(value) is not None


def check_readable_name(what: str, value: object) -> str:
    """Return ``value`` if :func:`is_readable_name`; else ValueError."""
    if not is_readable_name(value):
        raise ValueError(
            f"{what} must match [A-Za-z0-9][A-Za-z0-9._-]* (1-{MAX_READ_NAME_LENGTH} characters), got {value!r}"
        )
    return value  # type: ignore[return-value]


def is_records_name(name: str) -> bool:
    """True for a records file name a reader accepts: ``records-<sha256>.jsonl`` or the legacy ``records.jsonl``."""
    return ANY_RECORDS_NAME_PATTERN.fullmatch(name) is not None


def is_temporary_name(name: str) -> bool:
    """True for a temporary file of a write: gymckpt's ``.gymckpt-tmp-*`` or the reference's ``mkstemp`` names."""
    return name.startswith(TEMP_PREFIX) or REFERENCE_TEMP_PATTERN.fullmatch(name) is not None


def participant_directory(checkpoint_dir: str, kind: str, instance: str) -> str:
    """``<checkpoint_dir>/gym/<kind>/<instance>``, store-relative."""
    return join(checkpoint_dir, GYM_DIR, kind, instance)


def index_path(checkpoint_dir: str) -> str:
    """Store-relative path of a checkpoint's index."""
    return join(checkpoint_dir, GYM_DIR, INDEX_NAME)


def records_name(sha256_hex: str) -> str:
    """The file name of a records file whose bytes hash to ``sha256_hex``."""
    return f"records-{sha256_hex}.jsonl"


@dataclass
class ParticipantLayout:
    """The files of one participant directory."""

    checkpoint: str
    kind: str
    instance: str
    manifest: str | None = None
    records: list[str] = field(default_factory=list)
    temporary: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    @property
    def participant(self) -> str:
        return f"{self.kind}/{self.instance}"

    @property
    def directory(self) -> str:
        return participant_directory(self.checkpoint, self.kind, self.instance)


@dataclass
class CheckpointLayout:
    """What lies under one checkpoint directory's ``gym/``."""

    directory: str
    index: str | None = None
    #: the reference controller's ``collection.json`` beside ``gym/``: published by it (no index then)
    collection: str | None = None
    participants: dict[tuple[str, str], ParticipantLayout] = field(default_factory=dict)
    #: (path, kind, participant) of a symlink or special file where state belongs: damage
    irregular: list[tuple[str, EntryKind, str]] = field(default_factory=list)
    #: leftover temporary files outside participant directories
    temporary: list[str] = field(default_factory=list)
    #: (path, participant) of anything else gymckpt did not write, at any depth
    unexpected: list[tuple[str, str]] = field(default_factory=list)

    def participant(self, kind: str, instance: str) -> ParticipantLayout:
        key = (kind, instance)
        if key not in self.participants:
            self.participants[key] = ParticipantLayout(self.directory, kind, instance)
        return self.participants[key]


def _fits(rest: list[str]) -> bool:
    """True when a path below ``gym/`` is where gymckpt writes state: the index or a participant's file."""
    if len(rest) == 1:
        return rest[0] == INDEX_NAME
    if len(rest) != 3 or not (is_readable_name(rest[0]) and is_readable_name(rest[1])):
        return False
    name = rest[2]
    return name == MANIFEST_NAME or is_records_name(name) or is_temporary_name(name)


def _checkpoint_of(parts: list[str], established: set[str]) -> int | None:
    """Index of the ``gym`` segment that makes ``parts`` part of a checkpoint, or None.

    A file belongs to the shallowest checkpoint whose ``gym/`` contains it (checkpoints do
    not nest inside another's ``gym/``); a checkpoint is established by a file that lies
    where gymckpt writes state. Without one, the shallowest ``gym`` segment counts.
    """
    candidates = [index for index, part in enumerate(parts) if part == GYM_DIR]
    for index in candidates:
        if "/".join(parts[:index]) in established:
            return index
    return candidates[0] if candidates else None


def scan_checkpoints(entries: Iterable[str | tuple[str, EntryKind]]) -> dict[str, CheckpointLayout]:
    """Group store-relative entries (paths of regular files, or ``(path, kind)``) by checkpoint.

    A checkpoint directory is the parent of a ``gym`` directory. Returns the checkpoints
    sorted by directory.
    """
    listed: list[tuple[list[str], EntryKind]] = []
    established: set[str] = set()
    for entry in entries:
        path, kind = (entry, EntryKind.FILE) if isinstance(entry, str) else entry
        parts = path.split("/")
        listed.append((parts, kind))
        for index, part in enumerate(parts):
            if part == GYM_DIR and _fits(parts[index + 1 :]):
                established.add("/".join(parts[:index]))
    found: dict[str, CheckpointLayout] = {}
    collections: dict[str, str] = {}
    for parts, kind in listed:
        index = _checkpoint_of(parts, established)
        if index is None:
            if parts[-1] == COLLECTION_NAME and kind is EntryKind.FILE:
                collections["/".join(parts[:-1])] = "/".join(parts)
            continue
        directory = "/".join(parts[:index])
        layout = found.get(directory)
        if layout is None:
            layout = found[directory] = CheckpointLayout(directory)
        _place(layout, "/".join(parts), parts[index + 1 :], kind)
    for directory, path in collections.items():
        if directory in found:
            found[directory].collection = path
    return dict(sorted(found.items()))


def _place(layout: CheckpointLayout, path: str, rest: list[str], kind: EntryKind) -> None:
    """Put one entry below ``gym/`` where it belongs in ``layout``."""
    names_valid = len(rest) >= 2 and is_readable_name(rest[0]) and is_readable_name(rest[1])
    participant = f"{rest[0]}/{rest[1]}" if names_valid else ""
    if kind is not EntryKind.FILE:
        # only where state belongs is a non-regular entry damage: gym/ itself, the index, a kind
        # or participant directory, a manifest or a records file
        at_state = (
            not rest
            or (len(rest) == 1 and (rest[0] == INDEX_NAME or is_readable_name(rest[0])))
            or (len(rest) == 2 and names_valid)
            or (len(rest) == 3 and names_valid and (rest[2] == MANIFEST_NAME or is_records_name(rest[2])))
        )
        if at_state:
            layout.irregular.append((path, kind, participant))
            if len(rest) >= 2 and names_valid:
                layout.participant(rest[0], rest[1])
        else:
            layout.unexpected.append((path, participant))
        return
    if len(rest) == 3 and names_valid:
        files = layout.participant(rest[0], rest[1])
        name = rest[2]
        if name == MANIFEST_NAME:
            files.manifest = path
        elif is_records_name(name):
            files.records.append(path)
        elif is_temporary_name(name):
            files.temporary.append(path)
        else:
            files.unexpected.append(path)
        return
    if len(rest) > 3 and names_valid:
        layout.participant(rest[0], rest[1]).unexpected.append(path)
        return
    if rest == [INDEX_NAME]:
        layout.index = path
    elif len(rest) == 1 and is_temporary_name(rest[0]):
        layout.temporary.append(path)
    else:
        layout.unexpected.append((path, participant))
