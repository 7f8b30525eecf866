"""What ``gymckpt inspect`` lists: the participants verify and restore find, one row each."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gymckpt.errors import InvalidCheckpointState
from gymckpt.store.layout import MANIFEST_NAME, participant_directory, scan_checkpoints
from gymckpt.store.participant import read_manifest_file

if TYPE_CHECKING:
    from collections.abc import Iterator

    from gymckpt.store.backend import StorageBackend
    from gymckpt.store.layout import CheckpointLayout

__all__ = ["list_checkpoints", "participant_rows"]


def list_checkpoints(backend: StorageBackend) -> dict[str, CheckpointLayout]:
    """Every checkpoint under the backend's root, found by the one scan verify and restore use."""
    return scan_checkpoints(backend.walk_entries(""))


def participant_rows(backend: StorageBackend, checkpoints: dict[str, CheckpointLayout]) -> Iterator[dict[str, Any]]:
    """One row per participant: its manifest's format, counts, sizes, episodes and extras, or why it is damaged.

    Manifests are read by the same bounded, validating read a restore uses; records are not read.
    A reference-format manifest claims no size and lists no episodes: ``records_bytes`` and
    ``episode_ids`` are None in its row.
    """
    for checkpoint, layout in checkpoints.items():
        for kind, instance in sorted(layout.participants):
            path = f"{participant_directory(checkpoint, kind, instance)}/{MANIFEST_NAME}"
            row: dict[str, Any] = {"checkpoint": checkpoint, "participant": f"{kind}/{instance}"}
            try:
                manifest = read_manifest_file(backend, path, kind=kind, instance=instance)
            except InvalidCheckpointState as exc:
                row["damaged"] = f"{exc.problem}: {exc.reason}"
            except FileNotFoundError:
                row["damaged"] = "no manifest (unfinished commit)"
            else:
                row.update(
                    format=manifest.format,
                    checkpoint_id=manifest.checkpoint_id,
                    record_count=manifest.record_count,
                    records_bytes=manifest.records_bytes,
                    records_file=manifest.records_file,
                    episode_ids=None if manifest.episode_ids is None else list(manifest.episode_ids),
                    extra=manifest.extra,
                )
            yield row
