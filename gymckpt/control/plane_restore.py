"""The restore side of a server's control plane: read, verify and install a checkpoint's scope.

:class:`RestoreRoutes` is a part of :class:`~gymckpt.control.plane.ControlPlane` (its
restore route and the install's resume); the plane's state and helpers it uses are
declared below for the type checker.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gymckpt import telemetry
from gymckpt.control._tasks import close_store, settled, spawn, succeeded
from gymckpt.control.models import Phase, RestoreReply
from gymckpt.control.restore_source import expected_manifest
from gymckpt.errors import (
    CheckpointConflict,
    ControlError,
    GymckptError,
    InvalidCheckpointState,
    InvalidPhase,
    InvalidRolloutId,
)
from gymckpt.gc_pause import paused_gc
from gymckpt.identity import capture_key, first_keys, split_capture_key
from gymckpt.store.codec import rekeyed_line

if TYPE_CHECKING:
    from collections.abc import Awaitable, Iterator

    from gymckpt.control.marks import RetireMarks
    from gymckpt.control.models import RestoreRequest
    from gymckpt.control.participant import Participant
    from gymckpt.store import CheckpointStore
    from gymckpt.store.manifest import Manifest
    from gymckpt.store.spans import LineSpan

__all__ = ["OpenRestore", "RestoreRoutes"]

logger = logging.getLogger("gymckpt.control")


@dataclass
class OpenRestore:
    """A restore this plane runs or ran: its id, what it was asked, its install task."""

    checkpoint_id: str
    #: directory, sorted scope, and the manifest digest and checkpoint id the request expects
    args: tuple[str, tuple[str, ...], str | None, str | None]
    task: asyncio.Task[RestoreReply]


class RestoreRoutes:
    """The restore route of :class:`~gymckpt.control.plane.ControlPlane` and the install's resume."""

    if TYPE_CHECKING:  # the plane's own state and helpers
        participant: Participant
        phase: Phase
        _fresh: bool
        _open: Any
        _restore: OpenRestore | None
        _restored_keys: set[str]
        _reopen_pending: bool
        _loop: asyncio.AbstractEventLoop | None
        lease_expires_at: float | None

        @property
        def marks(self) -> RetireMarks: ...
        async def _within(self, deadline_ts: float, awaitable: Awaitable[Any], what: str) -> Any: ...
        def _check_not_stale(self, checkpoint_id: str) -> None: ...
        def _store_for(self, checkpoint_dir: str) -> CheckpointStore: ...
        def _extend_lease(self, deadline_ts: float) -> None: ...
        def _remember_resumed(self, checkpoint_id: str) -> None: ...

    async def _finish_restore(self, checkpoint_id: str, deadline_ts: float) -> None:
        """Resume a restore: wait for its install, then reopen admission."""
        restore = self._restore
        assert restore is not None
        if restore.checkpoint_id != checkpoint_id:
            raise CheckpointConflict(f"restore of {restore.checkpoint_id!r} is open, not {checkpoint_id!r}")
        if not restore.task.done():
            await self._within(deadline_ts, settled(restore.task), "the restore's install")
        await self._within(deadline_ts, self.participant.open_admission(), "reopening admission")
        self._reopen_pending = False
        self._remember_resumed(checkpoint_id)
        self.phase = Phase.IDLE
        self.lease_expires_at = None

    async def restore(self, request: RestoreRequest) -> RestoreReply:
        """Restore the scope from a checkpoint directory (the cyclic GC paused meanwhile)."""
        with paused_gc():  # no full collection of a large heap meanwhile (gymckpt.gc_pause)
            return await self._restore_paused(request)

    async def _restore_paused(self, request: RestoreRequest) -> RestoreReply:
        """Read, verify and install the scoped records under their next attempt."""
        self._loop = asyncio.get_running_loop()
        self._check_not_stale(request.checkpoint_id)
        args = (
            request.checkpoint_dir,
            tuple(sorted(set(request.episode_ids))),
            request.manifest_sha256,
            request.source_checkpoint_id,
        )
        previous = self._restore
        if previous is not None and previous.checkpoint_id == request.checkpoint_id and not previous.task.done():
            if previous.args != args:
                raise CheckpointConflict("this restore is running with another directory, scope or expected manifest")
            return await self._within(request.deadline_ts, asyncio.shield(previous.task), "the restore")
        if previous is not None and previous.task.done() and succeeded(previous.task):
            if previous.checkpoint_id == request.checkpoint_id and previous.args == args:
                return previous.task.result()
            raise CheckpointConflict(
                f"checkpoint {previous.checkpoint_id!r} was already restored here with its own directory and scope"
            )
        if previous is not None and not previous.task.done():
            await self._within(request.deadline_ts, settled(previous.task), "the previous restore's install")
        if not self._fresh or self._open is not None or self.phase is not Phase.IDLE:
            raise InvalidPhase("restore runs only in a fresh process, before any checkpoint")
        live = self.participant.live_work()
        if inspect.isawaitable(live):  # a coordinator of several workers asks them
            live = await self._within(request.deadline_ts, live, "asking for live work")
        if live:
            raise ControlError(
                f"restore runs only in a fresh process: {self.participant.kind}/{self.participant.instance} "
                f"already serves {first_keys(live)}"
            )
        rollouts: dict[str, str] = {}
        for key in args[1]:
            rollout, attempt = split_capture_key(key)
            if rollout in rollouts:
                raise InvalidRolloutId(
                    f"the restore scope names rollout {rollout!r} twice ({rollouts[rollout]!r}, {key!r})"
                )
            rollouts[rollout] = key
            self.marks.check(capture_key(rollout, attempt + 1))  # its replacement must be allowed to run
        store = self._store_for(request.checkpoint_dir)
        for key in args[1]:
            self.marks.mark(key)  # the captured attempt is replaced by the next one: refuse it from now on
        self.phase = Phase.RESTORED
        self._extend_lease(request.deadline_ts)
        expected = (request.manifest_sha256, request.source_checkpoint_id)
        task = spawn(self._run_restore(request.checkpoint_id, store, list(args[1]), expected), "gymckpt-restore")
        self._restore = OpenRestore(request.checkpoint_id, args, task)
        return await self._within(request.deadline_ts, asyncio.shield(task), "the restore")

    async def _fail_restore(self) -> None:
        try:
            await self.participant.open_admission()
            self._reopen_pending = False
        except Exception:
            logger.exception("reopening admission after a failed restore failed; the next resume retries it")
            self._reopen_pending = True
        self.phase = Phase.IDLE
        self.lease_expires_at = None

    async def _run_restore(
        self, checkpoint_id: str, store: CheckpointStore, scope: list[str], expected: tuple[str | None, str | None]
    ) -> RestoreReply:
        """Close admission, read and verify in one pass off the loop, install; on failure reopen.

        ``expected``: the manifest digest and checkpoint id the request names (None: read from
        the index where one exists, :mod:`gymckpt.control.restore_source`).
        """
        participant = self.participant
        next_keys = {key: capture_key(*_next(key)) for key in scope}
        installed_scope = sorted(next_keys.values())
        streamed = getattr(participant, "installs_streamed", False)  # it reads the records as it installs them
        try:
            try:
                await participant.close_admission(checkpoint_id)
                with telemetry.step("read") as step:
                    manifest, records = await asyncio.to_thread(
                        _read_scope,
                        store,
                        participant.kind,
                        participant.instance,
                        set(scope),
                        next_keys,
                        expected,
                        streamed=streamed,
                    )
                    step.set(records=None if streamed else len(records), bytes=manifest.records_bytes)
                with telemetry.step("install", records=None if streamed else len(records)):
                    await self._install(records, installed_scope, manifest)
            finally:
                await close_store(store)
            telemetry.volume("restore", kind=participant.kind, records=len(records), size_bytes=manifest.records_bytes)
        except BaseException:
            await self._fail_restore()
            raise
        self._restored_keys = set(installed_scope)
        return RestoreReply(
            phase=Phase.RESTORED,
            source_checkpoint_id=manifest.checkpoint_id,
            restored=sorted(
                records.episode_ids
                if isinstance(records, ScopeRecords)
                else (str(record["episode_id"]) for record in records)
            ),
        )

    async def _install(self, records: list[dict[str, Any]], scope: list[str], manifest: Manifest) -> None:
        """``participant.install``; a failure that is no gymckpt error is ``invalid_checkpoint_state`` (422).

        Participants name the episode whose record they could not install; this names the
        scope's first episodes when the failure came from elsewhere.
        """
        participant = self.participant
        try:
            await participant.install(records, scope, manifest)
        except GymckptError:
            raise
        except Exception as exc:
            raise InvalidCheckpointState(
                f"the restored records of {first_keys(scope)} could not be installed: {type(exc).__name__}: {exc}",
                participant=f"{participant.kind}/{participant.instance}",
            ) from exc


def _next(key: str) -> tuple[str, int]:
    rollout, attempt = split_capture_key(key)
    return rollout, attempt + 1


class ScopeRecords:
    """The scope's records for a participant that reads them as it installs them (``installs_streamed``,
    a server's coordinator): each iteration reads and verifies the records file anew (off the
    event loop), under the next attempt; :attr:`episode_ids` are those of the last whole pass."""

    def __init__(self, store: CheckpointStore, manifest: Manifest, scope: set[str], next_keys: dict[str, str]) -> None:
        self.store = store
        self.manifest = manifest
        self.scope = scope
        self.next_keys = next_keys
        self.episode_ids: list[str] = []

    def __len__(self) -> int:
        return len(self.episode_ids)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        keys = []
        for record in self.store.read_records(self.manifest, scope=self.scope):
            record["episode_id"] = key = self.next_keys[record["episode_id"]]
            keys.append(key)
            yield record
        self.episode_ids = keys

    @property
    def lines_readable(self) -> bool:
        """True when :meth:`lines` can read the file (gymckpt's own format; a reference one is decoded)."""
        return not self.manifest.is_reference

    def lines(self, *, rekeyed: bool = True, spans: dict[str, LineSpan] | None = None) -> Iterator[tuple[str, bytes]]:
        """``(key, line)`` of the scope's records, undecoded, each line's leading id rewritten to its next
        attempt (``rekeyed``; else the line as read, for a reader of the other fields); the whole file
        is verified as :meth:`__iter__` does (the lines' JSON past the id is checked by whoever decodes
        them). ``spans`` gets each line's ``(offset, length, crc32)`` by stored id, for readers of its bytes
        alone (:meth:`~gymckpt.store.checkpoint_store.CheckpointStore.read_spans`). Only where
        :attr:`lines_readable`."""
        keys = []
        for episode_id, line in self.store.read_lines(self.manifest, scope=self.scope, spans=spans):
            key = self.next_keys[episode_id]
            keys.append(key)
            yield key, rekeyed_line(line, key) if rekeyed else line
        self.episode_ids = keys


def _read_scope(
    store: CheckpointStore,
    kind: str,
    instance: str,
    scope: set[str],
    next_keys: dict[str, str],
    expected: tuple[str | None, str | None],
    *,
    streamed: bool = False,
) -> tuple[Manifest, list[dict[str, Any]] | ScopeRecords]:
    """The manifest and the scope's records (verified in one pass), keyed by their next attempt
    (``streamed``: read later, as the participant iterates them).

    The manifest must be the published one (:func:`~gymckpt.control.restore_source.expected_manifest`)
    before any record is read.
    """
    manifest_sha256, checkpoint_id = expected
    wanted = expected_manifest(store, kind, instance, manifest_sha256=manifest_sha256, checkpoint_id=checkpoint_id)
    manifest = store.read_manifest("", kind=kind, instance=instance)
    if wanted is not None:
        wanted.check(manifest)
    if streamed:
        return manifest, ScopeRecords(store, manifest, scope, next_keys)
    records = []
    for record in store.read_records(manifest, scope=scope):
        record["episode_id"] = next_keys[record["episode_id"]]
        records.append(record)
    return manifest, records
