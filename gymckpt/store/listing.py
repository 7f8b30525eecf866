"""What lies under a store's root, as ``verify`` and ``inspect`` see it, and the rows ``inspect`` lists.

:func:`list_store` is the one listing both start from: the checkpoints :func:`scan_checkpoints`
finds (restore finds the same participants), minus the hidden directories a prune is deleting
(:data:`~gymckpt.store.pruning.PRUNING_PREFIX`), plus the object keys no store-relative path
names (``a//b``, ``a/./b``, ``a/../b``): no reader of gymckpt reads those, and ``verify``
reports each one (:func:`place_unaddressable`) rather than skip it.

On a filesystem, where a directory exists without a file in it, the listing also holds the
participant directories no file is in, and the ``gym/`` directories no participant is in
(:func:`_add_empty_directories`): what a failed commit leaves behind once its temporary file
is removed. ``verify`` reports them as unfinished commits, never "no checkpoint here".

:func:`participant_rows` gives ``inspect`` its rows, with a cheap look at each records file
(:func:`records_size`: present, and of the size its manifest claims) and no re-hash.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gymckpt.errors import InvalidCheckpointState, RecordsMissing, RecordsSizeMismatch
from gymckpt.store.backend import EntryKind, join
from gymckpt.store.layout import (
    GYM_DIR,
    INDEX_NAME,
    MANIFEST_NAME,
    CheckpointLayout,
    is_readable_name,
    is_records_name,
    participant_directory,
    scan_checkpoints,
)
from gymckpt.store.participant import expected_records, read_manifest_file
from gymckpt.store.printable import json_text
from gymckpt.store.pruning import is_pruning_name

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from gymckpt.store.backend import StorageBackend
    from gymckpt.store.manifest import Manifest

__all__ = [
    "StoreListing",
    "KeyPlacement",
    "list_checkpoints",
    "list_store",
    "participant_rows",
    "place_unaddressable",
    "records_size",
    "walk_store",
]


@dataclass(frozen=True)
class KeyPlacement:
    """An object key no store-relative path names, and where a tool that maps keys to paths would put it."""

    #: the key relative to the store's root, exactly as listed
    key: str
    #: the checkpoint it belongs to once normalized ("" when none: the root's own, or outside every ``gym/``)
    checkpoint: str
    #: the store-relative path a tool that normalizes keys would read it as
    normalized: str
    #: True when that path is checkpoint state (an index, a manifest, a records file) or leaves the root
    misleading: bool


@dataclass
class StoreListing:
    """The checkpoints under a root and the keys no path names."""

    checkpoints: dict[str, CheckpointLayout]
    unaddressable: list[str] = field(default_factory=list)


def _being_pruned(path: str) -> bool:
    """True for a path inside a directory a prune renamed for deletion (before its checkpoint's ``gym/``)."""
    for part in path.split("/"):
        if part == GYM_DIR:
            return False
        if is_pruning_name(part):
            return True
    return False


def walk_store(backend: StorageBackend, path: str = "") -> tuple[list[tuple[str, EntryKind]], list[str]]:
    """Every entry under ``path``, and the keys no path names (from a backend that lists such keys, and
    without logging them: the caller reports them)."""
    walk_keys = getattr(backend, "walk_keys", None)  # object storage: keys are not paths
    if walk_keys is None:
        return list(backend.walk_entries(path)), []
    entries: list[tuple[str, EntryKind]] = []
    unaddressable: list[str] = []
    for key, addressable in walk_keys(path):
        if addressable:
            entries.append((key, EntryKind.FILE))
        else:
            unaddressable.append(key)
    return entries, unaddressable


def list_store(backend: StorageBackend) -> StoreListing:
    """Every checkpoint under the backend's root, found by the one scan verify and restore use (module docstring)."""
    entries, unaddressable = walk_store(backend)
    kept = [(path, kind) for path, kind in entries if not _being_pruned(path)]
    odd = [key for key in unaddressable if not _being_pruned(posixpath.normpath(key).lstrip("/"))]
    checkpoints = scan_checkpoints(kept)
    # a directory without files exists only where directories are real (the local backend; on object
    # storage and in memory a directory is implied by the keys below it, so there is nothing more to find)
    if backend.supports_directory_fsync:
        occupied = {path.rpartition("/")[0] for path, _ in kept}
        for directory in list(occupied):
            while directory and (directory := directory.rpartition("/")[0]) not in occupied:
                occupied.add(directory)
        checkpoints = _add_empty_directories(backend, checkpoints, occupied)
    return StoreListing(checkpoints, odd)


def _add_empty_directories(
    backend: StorageBackend, checkpoints: dict[str, CheckpointLayout], occupied: set[str]
) -> dict[str, CheckpointLayout]:
    """``checkpoints`` with the participant directories no file is in, and the ``gym/`` directories no
    participant is in (a checkpoint of its own when no file is below it), sorted by directory again.

    ``occupied`` holds every directory with an entry below it, which the scan placed. One listing
    of each directory that is not below a ``gym/`` directory, of each ``gym/`` and of each kind
    directory; a directory inside one a prune is deleting is skipped.
    """
    pending = [""]
    while pending:
        directory = pending.pop()
        for name in backend.list_dir(directory):
            if not name.endswith("/"):
                continue  # a file (the scan has it), a symlink or special file (never followed)
            child = join(directory, name[:-1])
            if _being_pruned(child):
                continue
            if name[:-1] == GYM_DIR:
                _add_gym_directory(backend, checkpoints, occupied, directory)
            else:
                pending.append(child)
    return dict(sorted(checkpoints.items()))


def _add_gym_directory(
    backend: StorageBackend, checkpoints: dict[str, CheckpointLayout], occupied: set[str], checkpoint: str
) -> None:
    """Add what ``<checkpoint>/gym/`` holds that no file is in: its empty participant directories, or the
    checkpoint itself when nothing below its ``gym/`` is a file (see the caller)."""
    gym = join(checkpoint, GYM_DIR)
    empty: list[tuple[str, str]] = []
    for kind in backend.list_dir(gym):
        if not kind.endswith("/") or not is_readable_name(kind[:-1]):
            continue  # a file, or a directory that is no kind: the scan places what is in it
        for instance in backend.list_dir(join(gym, kind)):
            path = join(gym, kind, instance)
            if instance.endswith("/") and is_readable_name(instance[:-1]) and path not in occupied:
                empty.append((kind[:-1], instance[:-1]))
    if not empty and gym in occupied:
        return  # every participant directory holds a file, or the files are a checkpoint's nested below
    layout = checkpoints.get(checkpoint)
    if layout is None:
        layout = checkpoints[checkpoint] = CheckpointLayout(checkpoint)
    for kind, instance in empty:
        layout.participant(kind, instance)


def list_checkpoints(backend: StorageBackend) -> dict[str, CheckpointLayout]:
    """Every checkpoint under the backend's root (:func:`list_store`'s checkpoints)."""
    return list_store(backend).checkpoints


def _at_state(rest: list[str]) -> bool:
    """True when a path below ``gym/`` is where checkpoint state lies: the index, a manifest, a records file."""
    if rest == [INDEX_NAME]:
        return True
    return (
        len(rest) == 3
        and is_readable_name(rest[0])
        and is_readable_name(rest[1])
        and (rest[2] == MANIFEST_NAME or is_records_name(rest[2]))
    )


def place_unaddressable(key: str, checkpoints: Iterable[str]) -> KeyPlacement:
    """Where ``key`` lands once normalized as a path, which checkpoint it belongs to, and whether it misleads.

    A tool that maps keys to file paths (a sync to a filesystem, a reader that normalizes paths)
    reads ``a/./b`` and ``a//b`` as ``a/b``; a key that lands on checkpoint state or outside the
    root could then be read in place of, or beside, what verify checked.
    """
    normalized = posixpath.normpath(key) if key else "."
    leaves_root = normalized.startswith("/") or normalized == ".." or normalized.startswith("../")
    parts = normalized.lstrip("/").split("/")
    known = set(checkpoints)
    gyms = [index for index, part in enumerate(parts) if part == GYM_DIR]
    # the shallowest checkpoint the scan found, else the shallowest gym/ (as scan_checkpoints decides)
    chosen = next((index for index in gyms if "/".join(parts[:index]) in known), gyms[0] if gyms else None)
    if chosen is None:
        return KeyPlacement(key, "", normalized, leaves_root)
    at_state = _at_state(parts[chosen + 1 :])
    return KeyPlacement(key, "/".join(parts[:chosen]), normalized, leaves_root or at_state)


def records_size(backend: StorageBackend, manifest: Manifest) -> int:
    """The size of the manifest's records file, checked without reading it: present, and of the size the
    manifest claims (a reference manifest claims none).

    Raises :class:`~gymckpt.errors.RecordsMissing` or :class:`~gymckpt.errors.RecordsSizeMismatch`
    (a truncated or grown file), or another :class:`~gymckpt.errors.InvalidCheckpointState` (a
    symlink where the file belongs). What ``verify --quick`` and ``inspect`` check; the digest,
    count and lines are ``verify``'s.
    """
    expected = expected_records(manifest)
    try:
        size = backend.size(manifest.records_path)
    except FileNotFoundError as exc:
        if isinstance(exc, InvalidCheckpointState):
            raise
        raise expected.fail(RecordsMissing, "records file is missing") from exc
    if manifest.records_bytes is not None and size != manifest.records_bytes:
        raise expected.fail(
            RecordsSizeMismatch, f"records file has {size} bytes, manifest says {manifest.records_bytes}"
        )
    return size


def participant_rows(backend: StorageBackend, checkpoints: dict[str, CheckpointLayout]) -> Iterator[dict[str, Any]]:
    """One row per participant: its manifest's format, counts, sizes, episodes and extras, and why it is
    damaged where it is (``damaged``: ``problem: reason``).

    Manifests are read by the same bounded, validating read a restore uses; records are not read,
    only their size asked (:func:`records_size`), so a missing, truncated or grown records file is
    marked damaged and its manifest's fields are kept in the row. A reference-format manifest
    claims no size and lists no episodes: ``records_bytes`` and ``episode_ids`` are None in its
    row. A checkpoint with no participant (an empty ``gym/``) is one row, participant ``""``. The
    checkpoint's name is given as :func:`json_text` makes it (a byte of a directory name that is not
    UTF-8 as ``\\xNN``).
    """
    for checkpoint, layout in checkpoints.items():
        if not layout.participants:
            yield {
                "checkpoint": json_text(checkpoint),
                "participant": "",
                "damaged": "no participant in gym/ (unfinished commit)",
            }
        for kind, instance in sorted(layout.participants):
            path = f"{participant_directory(checkpoint, kind, instance)}/{MANIFEST_NAME}"
            row: dict[str, Any] = {"checkpoint": json_text(checkpoint), "participant": f"{kind}/{instance}"}
            try:
                manifest = read_manifest_file(backend, path, kind=kind, instance=instance)
            except InvalidCheckpointState as exc:
                row["damaged"] = f"{exc.problem}: {json_text(exc.reason)}"
                yield row
                continue
            except FileNotFoundError:
                row["damaged"] = "no manifest (unfinished commit)"
                yield row
                continue
            row.update(
                format=manifest.format,
                checkpoint_id=manifest.checkpoint_id,
                record_count=manifest.record_count,
                records_bytes=manifest.records_bytes,
                records_file=manifest.records_file,
                episode_ids=None if manifest.episode_ids is None else list(manifest.episode_ids),
                extra=manifest.extra,
            )
            try:
                records_size(backend, manifest)
            except InvalidCheckpointState as exc:
                row["damaged"] = f"{exc.problem}: {json_text(exc.reason)}"
            yield row
