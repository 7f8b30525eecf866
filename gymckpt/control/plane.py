"""One control plane per server: phases, fencing, the readiness wait, leases, marks, storage.

Export, store and cleanup of a checkpoint run as shielded tasks: a deadline ends the
caller's wait, never the work, so a retried commit awaits the running task or returns
its finished result, and a retry after a failed store stores the same records again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from gymckpt import telemetry
from gymckpt.control._tasks import settled, spawn
from gymckpt.control.allowed_roots import normalize_location, open_allowed_store
from gymckpt.control.models import (
    ForgetReply,
    Phase,
    PrepareReply,
    PrepareReport,
    RenewReply,
    ResumeReply,
    RetireReply,
    StatusReply,
)
from gymckpt.control.plane_commit import CommitRoutes, OpenCheckpoint
from gymckpt.control.plane_restore import OpenRestore, RestoreRoutes
from gymckpt.control.restore_source import RESTORE_CHECKS
from gymckpt.errors import (
    CheckpointConflict,
    CheckpointDirNotAllowed,
    DeadlineExceeded,
    ExportFailed,
    GymckptError,
    InvalidPhase,
    RetireIncomplete,
    StaleCheckpoint,
    UnsupportedStorage,
)
from gymckpt.gc_pause import pause_gc, paused_gc
from gymckpt.identity import AttemptsUpTo, first_keys
from gymckpt.store.layout import check_name

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from gymckpt.control.marks import RetireMarks
    from gymckpt.control.models import (
        ControlRequest,
        ForgetRequest,
        RetireRequest,
    )
    from gymckpt.control.participant import Participant
    from gymckpt.store import CheckpointStore

__all__ = [
    "LEASE_RETRY_SECONDS",
    "MAX_BLOCKERS",
    "OPEN_GC_PAUSE_SECONDS",
    "REMEMBERED_CHECKPOINTS",
    "ControlPlane",
    "readiness_report",
]

logger = logging.getLogger("gymckpt.control")

REMEMBERED_CHECKPOINTS = 64
LEASE_RETRY_SECONDS = 30.0
MAX_BLOCKERS = 100
#: how long a prepare waits for admission to close even when its deadline has passed
CLOSE_GRACE_SECONDS = 5.0
#: the longest an open checkpoint keeps the cyclic GC paused, in seconds (a checkpoint takes one or two)
OPEN_GC_PAUSE_SECONDS = 15.0


class ControlPlane(CommitRoutes, RestoreRoutes):
    """Drives one :class:`Participant` through checkpoints on behalf of a controller.

    Parameters
    ----------
    participant:
        The server's participant.
    lease_grace_seconds:
        Added to a request's deadline to form the lease; an expired lease resumes.
    storage_options:
        Passed to :func:`gymckpt.store.open_store` for every checkpoint directory.
    allowed_roots:
        Where checkpoint directories may lie; ``None`` allows any.
    clock:
        Epoch seconds (deadlines are absolute epoch times).
    """

    def __init__(
        self,
        participant: Participant,
        *,
        lease_grace_seconds: float = 600.0,
        storage_options: dict[str, Any] | None = None,
        allowed_roots: list[str] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        check_name("kind", participant.kind)  # the names its state is stored under: refused at startup, not at commit
        check_name("instance", participant.instance)
        self.participant = participant
        self.lease_grace_seconds = lease_grace_seconds
        self.storage_options = dict(storage_options or {})
        self.allowed_roots = allowed_roots
        self.clock = clock
        self.phase = Phase.IDLE
        self.lease_expires_at: float | None = None
        self._open: OpenCheckpoint | None = None
        self._resumed: deque[str] = deque(maxlen=REMEMBERED_CHECKPOINTS)
        self._export_failed: set[str] = set()
        self._fresh = True
        self._restore: OpenRestore | None = None
        self._restored_keys: set[str] = set()
        self._reopen_pending = False
        self._retire_tasks: dict[frozenset[str], asyncio.Task[None]] = {}
        self._readiness = asyncio.Event()
        self._lease_task: asyncio.Task[None] | None = None
        #: set whenever the lease changes, so the watcher never sleeps past a shorter one
        self._lease_changed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        participant.add_readiness_listener(self._readiness_changed)

    @property
    def marks(self) -> RetireMarks:
        """The retire marks: the participant's attempt fence, which this plane marks and forgets through."""
        return self.participant.fence

    # --- helpers

    def _readiness_changed(self) -> None:
        loop = self._loop
        if loop is None:
            self._readiness.set()
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._readiness.set()
        else:
            loop.call_soon_threadsafe(self._readiness.set)

    def _remaining(self, deadline_ts: float) -> float:
        return deadline_ts - self.clock()

    async def _within(self, deadline_ts: float, awaitable: Awaitable[Any], what: str) -> Any:
        """Await ``awaitable`` until the deadline; a shielded task keeps running past it."""
        remaining = self._remaining(deadline_ts)
        try:
            return await asyncio.wait_for(awaitable, timeout=max(remaining, 0.0))
        except TimeoutError:
            raise DeadlineExceeded(f"{what} did not finish before the deadline") from None

    def _report(self) -> PrepareReport:
        return readiness_report(self.participant)

    def _check_not_stale(self, checkpoint_id: str) -> None:
        if checkpoint_id in self._resumed:
            raise StaleCheckpoint(f"checkpoint {checkpoint_id!r} was already resumed")

    def _open_checkpoint(self, checkpoint_id: str) -> OpenCheckpoint:
        """The open checkpoint named ``checkpoint_id``, or the refusal that fits."""
        self._check_not_stale(checkpoint_id)
        current = self._open
        if current is None:
            raise InvalidPhase(f"no checkpoint is open (phase {self.phase}); prepare {checkpoint_id!r} first")
        if current.checkpoint_id != checkpoint_id:
            raise CheckpointConflict(f"checkpoint {current.checkpoint_id!r} is open, not {checkpoint_id!r}")
        return current

    def _store_for(self, checkpoint_dir: str) -> CheckpointStore:
        """Open the store of one commit or restore (its task closes it when it ends).

        A local directory is opened at the real path ``allowed_roots`` was checked against.
        """
        try:
            return open_allowed_store(checkpoint_dir, self.allowed_roots, **self.storage_options)
        except GymckptError:
            raise
        except Exception as exc:
            raise UnsupportedStorage(f"cannot open checkpoint_dir {checkpoint_dir!r}: {exc}") from exc

    def _extend_lease(self, deadline_ts: float) -> None:
        """The lease ends ``lease_grace_seconds`` after the latest deadline seen; it never shrinks."""
        lease = deadline_ts + self.lease_grace_seconds
        if self.lease_expires_at is None or lease > self.lease_expires_at:
            self.lease_expires_at = lease
        self._loop = asyncio.get_running_loop()
        self._lease_changed.set()  # the watcher recomputes its wait
        if self._lease_task is None or self._lease_task.done():
            self._lease_task = asyncio.create_task(self._watch_lease(), name="gymckpt-lease")

    def _remember_resumed(self, checkpoint_id: str) -> None:
        if checkpoint_id not in self._resumed:
            self._resumed.append(checkpoint_id)

    def _check_restore_id(self, checkpoint_id: str, operation: str) -> None:
        """In the restored phase, retire, forget and renew belong to the open restore."""
        restore = self._restore
        if self.phase is Phase.RESTORED and restore is not None and restore.checkpoint_id != checkpoint_id:
            raise CheckpointConflict(
                f"restore {restore.checkpoint_id!r} is open: {operation} with its id, not {checkpoint_id!r}"
            )

    def _current_id(self) -> str | None:
        if self._open is not None:
            return self._open.checkpoint_id
        if self._restore is not None and self.phase is Phase.RESTORED:
            return self._restore.checkpoint_id
        return None

    # --- routes

    def status(self) -> StatusReply:
        """The participant's phase, lease, marks and readiness, and where checkpoint directories may lie."""
        return StatusReply(
            kind=self.participant.kind,
            instance=self.participant.instance,
            phase=self.phase,
            checkpoint_id=self._current_id(),
            lease_expires_at=self.lease_expires_at,
            retired_rollouts=len(self.marks),
            report=self._report(),
            restore_checks=list(RESTORE_CHECKS),
            allowed_roots=_reported_roots(self.allowed_roots),
            **self.participant.status_extra(),
        )

    async def prepare(self, request: ControlRequest) -> PrepareReply:
        """Close admission and wait until ready or the deadline (the cyclic GC paused meanwhile)."""
        with paused_gc():  # no full collection of a large heap meanwhile (gymckpt.gc_pause)
            return await self._prepare(request)

    async def _prepare(self, request: ControlRequest) -> PrepareReply:
        """Close admission and wait until ready or the deadline."""
        self._loop = asyncio.get_running_loop()
        self._check_not_stale(request.checkpoint_id)
        if self._open is not None and self._open.checkpoint_id != request.checkpoint_id:
            raise CheckpointConflict(f"checkpoint {self._open.checkpoint_id!r} is open, not {request.checkpoint_id!r}")
        if self.phase is Phase.RESTORED:
            self._check_restore_id(request.checkpoint_id, "prepare")
            raise InvalidPhase("a restore is open: resume it before preparing a checkpoint")
        if request.checkpoint_id in self._export_failed:
            raise ExportFailed(f"checkpoint {request.checkpoint_id!r} failed its export; resume and prepare a new id")
        if self._open is None:
            self._fresh = False
            checkpoint = self._open = OpenCheckpoint(request.checkpoint_id)
            # no full collection of a large heap between the checkpoint's calls either (gymckpt.gc_pause)
            checkpoint.gc_pause = pause_gc(OPEN_GC_PAUSE_SECONDS, f"checkpoint {request.checkpoint_id!r}")
            self.phase = Phase.PREPARING
            self._extend_lease(request.deadline_ts)
            self.participant.note_deadline(request.deadline_ts)
            checkpoint.closing = spawn(self._close_admission(checkpoint), "gymckpt-close")
        else:
            checkpoint = self._open
            self._extend_lease(request.deadline_ts)
        assert checkpoint.closing is not None
        # a retried prepare waits for the first one's close: ready means nothing while admission is open.
        # Closing is not deadline-limited work (a prepare past its deadline still closes and
        # reports), but a close that hangs is bounded by the grace below.
        closing_deadline = max(request.deadline_ts, self.clock() + CLOSE_GRACE_SECONDS)
        await self._within(closing_deadline, asyncio.shield(checkpoint.closing), "closing admission")
        if self.phase is Phase.PREPARING:
            await self._wait_ready(request.deadline_ts)
            if self.participant.ready() and self.phase is Phase.PREPARING:
                self.phase = Phase.PREPARED
        return PrepareReply(phase=self.phase, report=self._report())

    async def _close_admission(self, checkpoint: OpenCheckpoint) -> None:
        try:
            await self.participant.close_admission(checkpoint.checkpoint_id)
        except BaseException:
            if self._open is checkpoint:
                await self._reopen_after_failed_close()
            raise

    async def _reopen_after_failed_close(self) -> None:
        with contextlib.suppress(Exception):
            await self.participant.open_admission()
        if self._open is not None:
            self._remember_resumed(self._open.checkpoint_id)
            self._end_open(self._open)
        self.phase = Phase.IDLE
        self.lease_expires_at = None

    async def _wait_ready(self, deadline_ts: float) -> None:
        participant = self.participant
        with telemetry.step("wait_ready", blockers=participant.blocker_count()) as step:
            while not participant.ready():
                remaining = self._remaining(deadline_ts)
                if remaining <= 0:
                    telemetry.event("prepare_not_ready", participant_kind=participant.kind)
                    break
                self._readiness.clear()
                if participant.ready():
                    break
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await self._readiness.wait()
            step.set(ready=participant.ready())

    async def renew(self, request: ControlRequest) -> RenewReply:
        """Extend the lease of the open checkpoint (or restore)."""
        if self.phase is Phase.RESTORED and self._restore is not None:
            self._check_restore_id(request.checkpoint_id, "renew")
        else:
            self._open_checkpoint(request.checkpoint_id)
        self._extend_lease(request.deadline_ts)
        assert self.lease_expires_at is not None
        return RenewReply(phase=self.phase, checkpoint_id=request.checkpoint_id, lease_expires_at=self.lease_expires_at)

    async def resume(self, request: ControlRequest) -> ResumeReply:
        """End the open checkpoint or restore (the cyclic GC paused meanwhile)."""
        with paused_gc():  # no full collection of a large heap meanwhile (gymckpt.gc_pause)
            return await self._resume(request)

    async def _resume(self, request: ControlRequest) -> ResumeReply:
        """Reopen admission, cancel an export, wait for cleanup, stop the writer.

        A repeated resume is a no-op reply; one that runs out of time keeps the phase.
        """
        checkpoint_id = request.checkpoint_id
        open_id = self._current_id()
        if open_id is not None and open_id != checkpoint_id:
            if checkpoint_id in self._resumed:
                return ResumeReply(phase=self.phase, idempotent=True, checkpoint_id=checkpoint_id)
            raise CheckpointConflict(f"checkpoint {open_id!r} is open, not {checkpoint_id!r}")
        if self.phase is Phase.RESTORED:
            await self._finish_restore(checkpoint_id, request.deadline_ts)
        elif self._open is not None:
            await self._end_checkpoint(self._open, request.deadline_ts)
        elif self._reopen_pending:
            await self._within(request.deadline_ts, self.participant.open_admission(), "reopening admission")
            self._reopen_pending = False
            self._remember_resumed(checkpoint_id)
        else:
            # nothing open: a repeat, or an id this server never saw (a prepare that stopped at
            # an earlier stage). Remember it, so a late prepare with it is stale.
            self._remember_resumed(checkpoint_id)
            return ResumeReply(phase=self.phase, idempotent=True, checkpoint_id=checkpoint_id)
        return ResumeReply(phase=self.phase, idempotent=False, checkpoint_id=checkpoint_id)

    async def _end_checkpoint(self, checkpoint: OpenCheckpoint, deadline_ts: float) -> None:
        if checkpoint.export_task is not None and not checkpoint.export_task.done():
            checkpoint.export_task.cancel()
        # stop() takes the writer's lock: it returns once no manifest of this checkpoint can appear
        await self._within(deadline_ts, asyncio.shield(asyncio.to_thread(checkpoint.stop.stop)), "stopping the write")
        task = checkpoint.commit_task
        if task is not None and not task.done():
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self._within(deadline_ts, settled(task), "the commit's cleanup")
            if not task.done():
                raise DeadlineExceeded("the commit's cleanup of restored state is still running; resume again")
        await self._within(deadline_ts, self.participant.open_admission(), "reopening admission")
        self._remember_resumed(checkpoint.checkpoint_id)
        self._export_failed.discard(checkpoint.checkpoint_id)
        self._end_open(checkpoint)
        self.phase = Phase.IDLE
        self.lease_expires_at = None

    def _end_open(self, checkpoint: OpenCheckpoint) -> None:
        """``checkpoint`` is no longer open: forget it and end its pause of the cyclic GC."""
        if self._open is checkpoint:
            self._open = None
        if checkpoint.gc_pause is not None:
            checkpoint.gc_pause.release()

    async def retire(self, request: RetireRequest) -> RetireReply:
        """Mark first, then stop, wait for and free the attempts."""
        if self.phase not in (Phase.IDLE, Phase.RESTORED):
            raise InvalidPhase(f"retire is refused while a checkpoint is {self.phase}: resume first")
        self._check_restore_id(request.checkpoint_id, "retire")
        if self.phase is Phase.RESTORED:
            self._extend_lease(request.deadline_ts)
        keys = sorted(set(request.episode_ids))
        for key in keys:
            self.marks.mark(key)
        if self._restore is not None and not self._restore.task.done():
            await self._within(request.deadline_ts, settled(self._restore.task), "the restore's install")
        group = frozenset(keys)
        task = self._retire_tasks.get(group)
        if task is None or task.done():
            task = spawn(self.participant.retire(keys), "gymckpt-retire")
            self._retire_tasks[group] = task
            task.add_done_callback(lambda done, group=group: self._retire_tasks.pop(group, None))
        await self._within(request.deadline_ts, asyncio.shield(task), "the retire")
        self._restored_keys.difference_update(keys)
        return RetireReply(retired_count=len(keys), retired=keys)

    async def forget(self, request: ForgetRequest) -> ForgetReply:
        """End the refusal of these rollouts' retired attempts."""
        if self.phase not in (Phase.IDLE, Phase.RESTORED):
            raise InvalidPhase(f"forget is refused while a checkpoint is {self.phase}: resume first")
        self._check_restore_id(request.checkpoint_id, "forget")
        rollouts = set(request.rollout_ids)
        freeing = sorted(
            {rollout for group in self._retire_tasks for rollout in AttemptsUpTo(group).snapshot()} & rollouts
        )
        if freeing:
            raise RetireIncomplete(
                f"a retire of {first_keys(freeing)} is still stopping and freeing them; forget them once it finished"
            )
        if self.phase is Phase.RESTORED:
            self._extend_lease(request.deadline_ts)
        await self._within(request.deadline_ts, self.participant.check_forget(sorted(rollouts)), "checking the forget")
        forgotten = self.marks.forget(request.rollout_ids)
        await self._within(request.deadline_ts, self.participant.forget(sorted(set(request.rollout_ids))), "the forget")
        return ForgetReply(forgotten_count=forgotten, forgotten=sorted(set(request.rollout_ids)))

    # --- lease

    async def _watch_lease(self) -> None:
        while self.lease_expires_at is not None:
            delay = self.lease_expires_at - self.clock()
            if delay > 0:
                # woken early by any lease change (a renew or prepare with an earlier deadline)
                self._lease_changed.clear()
                # asyncio.timeout, not wait_for: on 3.11 wait_for loses a cancel (close) that
                # arrives as the event is set, and the watcher would sleep on
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(delay, LEASE_RETRY_SECONDS)):
                        await self._lease_changed.wait()
                continue
            try:
                await self.expire_lease()
            except Exception:
                logger.exception("resuming after the lease expired failed; retrying in %s s", LEASE_RETRY_SECONDS)
                self.lease_expires_at = self.clock() + LEASE_RETRY_SECONDS

    async def expire_lease(self) -> bool:
        """Resume by itself if the lease has expired; True when it did."""
        if self.lease_expires_at is None or self.lease_expires_at > self.clock():
            return False
        deadline_ts = self.clock() + LEASE_RETRY_SECONDS
        participant = self.participant
        expired = self._open.checkpoint_id if self._open is not None else None
        if expired is None and self._restore is not None and self.phase is Phase.RESTORED:
            expired = self._restore.checkpoint_id
        if expired is None:
            self.lease_expires_at = None
            return True
        with telemetry.operation(
            "lease_expired",
            kind=participant.kind,
            instance=participant.instance,
            checkpoint_id=expired,
            phase=str(self.phase),
        ):
            telemetry.event("lease_expired", participant_kind=participant.kind, phase=str(self.phase))
            if self._open is not None:
                logger.warning("lease of checkpoint %s expired in phase %s: resuming", expired, self.phase)
                await self._end_checkpoint(self._open, deadline_ts)
            else:
                logger.warning("lease of restore %s expired: resuming", expired)
                await self._finish_restore(expired, deadline_ts)
        return True

    async def close(self) -> None:
        """Stop the lease watcher and end an open checkpoint's pause of the cyclic GC (server shutdown)."""
        if self._open is not None and self._open.gc_pause is not None:
            self._open.gc_pause.release()
        if self._lease_task is not None:
            self._lease_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._lease_task


def _reported_roots(roots: list[str] | None) -> list[str] | None:
    """The status's ``allowed_roots``: each root as requests are compared with it (a local one resolved here).

    Resolved by the server, a relative root (``./checkpoints``) means what it means to the
    server, not to the collector reading the status.
    """
    if roots is None:
        return None
    reported = []
    for root in roots:
        try:
            reported.append(normalize_location(root))
        except CheckpointDirNotAllowed:  # a URL root with '.' segments: every request under it is refused
            reported.append(root)
    return reported


def readiness_report(participant: Participant) -> PrepareReport:
    """A participant's readiness as a prepare report: blockers capped at :data:`MAX_BLOCKERS`, restarts never."""
    ready = participant.ready()
    return PrepareReport(
        ready=ready,
        blockers=[] if ready else participant.blockers(MAX_BLOCKERS),
        blocker_count=0 if ready else participant.blocker_count(),
        counts=participant.counts(),
        restarts=participant.restarts(),
    )
