"""The commit side of a server's control plane: export once, store, clean up, park on stop.

:class:`CommitRoutes` is a part of :class:`~gymckpt.control.plane.ControlPlane` (its commit
route); the plane's state and helpers it uses are declared below for the type checker.
:class:`OpenCheckpoint` is what the plane knows of the checkpoint it has open.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gymckpt import telemetry
from gymckpt.control._tasks import close_store, spawn, succeeded
from gymckpt.control.models import CommitReply, Phase
from gymckpt.errors import CheckpointConflict, ExportFailed, InvalidPhase, RestartInScope
from gymckpt.gc_pause import GCPause, paused_gc
from gymckpt.store import WriteStop
from gymckpt.store.encoded import EncodedRecord, EncodedRecords

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from gymckpt.control.models import CommitRequest
    from gymckpt.control.participant import Participant
    from gymckpt.store import CheckpointStore

__all__ = ["CommitRoutes", "OpenCheckpoint"]

logger = logging.getLogger("gymckpt.control")


@dataclass
class OpenCheckpoint:
    """What one open checkpoint has done so far."""

    checkpoint_id: str
    stop: WriteStop = field(default_factory=WriteStop)
    closing: asyncio.Task[None] | None = None
    export_task: asyncio.Task[list[dict[str, Any]]] | None = None
    commit_task: asyncio.Task[CommitReply] | None = None
    commit_args: tuple[str, tuple[str, ...] | None] | None = None
    committed: CommitReply | None = None
    #: the exported records, kept for ``park_exported`` when a commit asks to stop
    exported: list[dict[str, Any]] = field(default_factory=list)
    parked: bool = False
    #: the cyclic GC's pause from prepare until this checkpoint ends (bounded: ``plane.OPEN_GC_PAUSE_SECONDS``)
    gc_pause: GCPause | None = None


class CommitRoutes:
    """The commit route of :class:`~gymckpt.control.plane.ControlPlane`."""

    if TYPE_CHECKING:  # the plane's own state and helpers
        participant: Participant
        phase: Phase
        _open: OpenCheckpoint | None
        _export_failed: set[str]
        _restored_keys: set[str]

        async def _within(self, deadline_ts: float, awaitable: Awaitable[Any], what: str) -> Any: ...
        def _check_not_stale(self, checkpoint_id: str) -> None: ...
        def _open_checkpoint(self, checkpoint_id: str) -> OpenCheckpoint: ...
        def _store_for(self, checkpoint_dir: str) -> CheckpointStore: ...
        def _extend_lease(self, deadline_ts: float) -> None: ...

    async def commit(self, request: CommitRequest) -> CommitReply:
        """Export once, store, clean up (the cyclic GC paused meanwhile)."""
        with paused_gc():  # no full collection of a large heap meanwhile (gymckpt.gc_pause)
            return await self._commit(request)

    async def _commit(self, request: CommitRequest) -> CommitReply:
        """Export once, store through the store, delete unscoped restored state."""
        self._check_not_stale(request.checkpoint_id)
        if request.checkpoint_id in self._export_failed:
            raise ExportFailed(f"checkpoint {request.checkpoint_id!r} failed its export; resume and prepare a new id")
        checkpoint = self._open_checkpoint(request.checkpoint_id)
        scope = None if request.episode_ids is None else tuple(sorted(set(request.episode_ids)))
        args = (request.checkpoint_dir, scope)
        if checkpoint.commit_args is not None and checkpoint.commit_args != args:
            raise CheckpointConflict(
                f"checkpoint {request.checkpoint_id!r} is being committed with another directory or scope"
            )
        self._extend_lease(request.deadline_ts)
        reply = checkpoint.committed
        if reply is None:
            task = checkpoint.commit_task
            if task is None or (task.done() and not succeeded(task)):
                if task is None:
                    self._check_commit_start(checkpoint, request)
                store = self._store_for(request.checkpoint_dir)
                checkpoint.commit_args = args
                task = spawn(
                    self._run_commit(checkpoint, store, None if scope is None else list(scope)), "gymckpt-commit"
                )
                checkpoint.commit_task = task
            reply = await self._within(request.deadline_ts, asyncio.shield(task), "the commit")
        if request.stop:
            await self._park_exported(checkpoint, request.deadline_ts)
            if checkpoint.gc_pause is not None:  # the controller stops: no resume ends this checkpoint
                checkpoint.gc_pause.release()
        return reply

    async def _park_exported(self, checkpoint: OpenCheckpoint, deadline_ts: float) -> None:
        """The controller stops after this checkpoint: let the participant free what it exported.

        Once per checkpoint; a failure is logged and the commit still succeeds.
        """
        if checkpoint.parked:
            return
        checkpoint.parked = True
        try:
            await self._within(deadline_ts, self.participant.park_exported(checkpoint.exported), "parking")
        except Exception:
            logger.warning("parking the exported state of %s failed", checkpoint.checkpoint_id, exc_info=True)

    def _check_commit_start(self, checkpoint: OpenCheckpoint, request: CommitRequest) -> None:
        restarts = set(self.participant.restarts()).intersection(request.episode_ids or ())
        if restarts:
            raise RestartInScope(f"the scope names restarts, which are never exported: {sorted(restarts)[:10]}")
        if self.phase is Phase.PREPARING and not self.participant.ready():
            raise InvalidPhase(
                f"not prepared: {self.participant.blocker_count()} executions are not at a boundary; prepare again"
            )
        if not self.participant.ready():
            self._export_failed.add(checkpoint.checkpoint_id)
            logger.warning(
                "checkpoint %s: readiness regressed after prepare; the export failed", checkpoint.checkpoint_id
            )
            raise ExportFailed("readiness regressed after prepare; resume and prepare a new checkpoint id")
        self.phase = Phase.PREPARED

    async def _run_commit(
        self, checkpoint: OpenCheckpoint, store: CheckpointStore, scope: list[str] | None
    ) -> CommitReply:
        """The commit task: export (once), store, clean up; the store it was given is closed at its end."""
        try:
            return await self._commit_into(checkpoint, store, scope)
        finally:
            await close_store(store)

    async def _commit_into(
        self, checkpoint: OpenCheckpoint, store: CheckpointStore, scope: list[str] | None
    ) -> CommitReply:
        if checkpoint.export_task is None:
            checkpoint.export_task = spawn(self._export(scope), "gymckpt-export")
        try:
            records = await checkpoint.export_task
        except asyncio.CancelledError:
            self._export_failed.add(checkpoint.checkpoint_id)
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            raise ExportFailed("the export was cancelled by resume; prepare a new checkpoint id") from None
        except Exception as exc:
            self._export_failed.add(checkpoint.checkpoint_id)
            logger.warning("checkpoint %s: the export failed: %s", checkpoint.checkpoint_id, exc)
            raise ExportFailed(f"the export failed: {exc}") from exc
        participant = self.participant
        with telemetry.step("write", records=len(records)) as step:
            manifest = await asyncio.to_thread(
                store.write_participant,
                "",
                kind=participant.kind,
                instance=participant.instance,
                checkpoint_id=checkpoint.checkpoint_id,
                records=records,
                extra=participant.manifest_extra(),
                stop=checkpoint.stop,
            )
            step.set(bytes=manifest.records_bytes)
        telemetry.volume(
            "commit", kind=participant.kind, records=manifest.record_count, size_bytes=manifest.records_bytes
        )
        if scope is not None:  # no scope: nothing restored is left out, nothing is deleted
            unscoped = sorted(self._restored_keys.difference(scope))
            if unscoped:
                with telemetry.step("cleanup", episodes=len(unscoped)):
                    await participant.delete_restored(unscoped)
            self._restored_keys.intersection_update(scope)
        checkpoint.exported = records
        reply = CommitReply(
            phase=Phase.COMMITTED,
            manifest=manifest.to_document(),
            episode_ids=sorted(
                records.episode_ids
                if isinstance(records, EncodedRecords)
                else (_episode_of(record) for record in records)
            ),
            kind=participant.kind,
            instance=participant.instance,
            checkpoint_id=checkpoint.checkpoint_id,
            checkpoint_dir=store.url,
            manifest_path=manifest.path,
            manifest_sha256=manifest.sha256,
            records_file=manifest.records_file,
            record_count=manifest.record_count,
            records_bytes=manifest.records_bytes,
            **participant.commit_reply_extra(),
        )
        checkpoint.committed = reply
        if self._open is checkpoint:
            self.phase = Phase.COMMITTED
        return reply

    async def _export(self, scope: list[str] | None) -> list[dict[str, Any]]:
        with telemetry.step("export") as step:
            exported = await self.participant.export(scope)
            records = exported if isinstance(exported, EncodedRecords) else list(exported)  # streamed: kept as is
            step.set(records=len(records))
        return records


def _episode_of(record: dict[str, Any] | EncodedRecord) -> str:
    """The capture key of an exported record: a dict, or a line encoded elsewhere (a worker's)."""
    return record.episode_id if type(record) is EncodedRecord else str(record["episode_id"])
