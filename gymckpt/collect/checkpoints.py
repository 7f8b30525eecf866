"""The collector's checkpoint root: one directory per checkpoint, ``LATEST`` naming the newest published.

``<root>/<checkpoint id>/`` holds a checkpoint (ids ``ckpt-<UTC time>-<8 hex>``); it is
published once its ``gym/checkpoint.json`` exists, whose ``extra`` carries the
collection's own record: ``run_id``, ``created_at``, ``continued`` and ``restarted`` (each
``[{"rollout_id", "attempt"}]``, the reference's shapes), and ``dispatched`` (rollout id →
the highest attempt sent). ``<root>/LATEST`` is replaced (atomically) after each publish.
Older checkpoints beyond the ones kept are deleted only after that, by
:func:`~gymckpt.store.pruning.delete_checkpoint`: unpublished first in one step (on a
filesystem, an atomic rename to a hidden ``.gymckpt-pruning-<id>-<hex>`` directory; on object
storage, its index deleted first), then deleted. A ``gymckpt verify`` running meanwhile
reports the checkpoint as vanished (a warning), never as damaged; a crash mid-delete leaves a
hidden directory or an unpublished one, which resume never picks and the next prune removes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gymckpt.errors import InvalidCheckpointState
from gymckpt.identity import new_checkpoint_id
from gymckpt.store import open_store
from gymckpt.store.layout import index_path
from gymckpt.store.pruning import delete_checkpoint, remove_pruning_leftovers

__all__ = ["CheckpointRoot", "PublishedCheckpoint", "new_checkpoint_id"]

LATEST_NAME = "LATEST"
_ID = re.compile(r"ckpt-\d{8}T\d{6}-[0-9a-f]{8}")


@dataclass(frozen=True)
class PublishedCheckpoint:
    """A published checkpoint of the root: its id, URL and the collection's record."""

    checkpoint_id: str
    url: str
    extra: dict[str, Any]

    @property
    def run_id(self) -> str:
        return str(self.extra.get("run_id", ""))

    @property
    def created_at(self) -> float:
        value = self.extra.get("created_at")
        return float(value) if isinstance(value, int | float) else 0.0

    def attempts(self, field: str) -> dict[str, int]:
        """``continued`` or ``restarted`` as rollout id → attempt."""
        found: dict[str, int] = {}
        for item in self.extra.get(field) or []:
            if (
                isinstance(item, dict)
                and isinstance(item.get("rollout_id"), str)
                and isinstance(item.get("attempt"), int)
            ):
                found[item["rollout_id"]] = item["attempt"]
        return found

    @property
    def dispatched(self) -> dict[str, int]:
        raw = self.extra.get("dispatched") or {}
        return {key: value for key, value in raw.items() if isinstance(value, int)} if isinstance(raw, dict) else {}


class CheckpointRoot:
    """The checkpoint root at ``url`` (a local directory or ``s3://…``), through the store."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self._store = open_store(self.url, **self.storage_options)

    @property
    def backend(self) -> Any:
        return self._store.backend

    def directory(self, checkpoint_id: str) -> str:
        """The URL of one checkpoint's directory (what the servers commit into)."""
        return f"{self.url}/{checkpoint_id}"

    def _ids(self) -> list[str]:
        return sorted(name.rstrip("/") for name in self.backend.list_dir("") if _ID.fullmatch(name.rstrip("/")))

    def published(self) -> list[PublishedCheckpoint]:
        """Every published checkpoint, oldest first (by ``created_at``, then id)."""
        found = []
        for checkpoint_id in self._ids():
            if not self.backend.exists(index_path(checkpoint_id)):
                continue
            try:
                index = self._store.read_index(checkpoint_id)
            except (InvalidCheckpointState, FileNotFoundError):
                continue  # being deleted, or damaged: never a resume's source
            found.append(PublishedCheckpoint(checkpoint_id, self.directory(checkpoint_id), dict(index.extra)))
        return sorted(found, key=lambda item: (item.created_at, item.checkpoint_id))

    def latest(self) -> PublishedCheckpoint | None:
        """The checkpoint ``LATEST`` names if it is published, else the newest published one, else None."""
        published = self.published()
        try:
            named = self.backend.read_bytes(LATEST_NAME).decode().strip()
        except (FileNotFoundError, UnicodeDecodeError):
            named = ""
        for checkpoint in published:
            if checkpoint.checkpoint_id == named:
                return checkpoint
        return published[-1] if published else None

    def advance(self, checkpoint_id: str) -> None:
        """Point ``LATEST`` at a checkpoint just published."""
        self.backend.replace(LATEST_NAME, checkpoint_id.encode())

    def prune(self, keep: int, current: str) -> list[str]:
        """Delete published checkpoints beyond the ``keep`` newest, and unpublished ones but ``current``.

        Each is unpublished in one step before its files go (module docstring); what an earlier
        prune's crash left half deleted goes first. Returns the ids deleted.
        """
        remove_pruning_leftovers(self.backend)
        published = [item.checkpoint_id for item in self.published()]
        kept = set(published[-keep:]) | {current} if keep > 0 else {current}
        deleted = []
        for checkpoint_id in self._ids():
            if checkpoint_id in kept:
                continue
            delete_checkpoint(self.backend, checkpoint_id)
            deleted.append(checkpoint_id)
        return deleted

    def reset(self) -> list[str]:
        """A fresh collection: delete every checkpoint and ``LATEST``."""
        deleted = self.prune(0, current="")
        self.backend.delete(LATEST_NAME)
        return deleted

    def close(self) -> None:
        self._store.close()
