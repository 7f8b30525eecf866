"""The main process of a server with several workers: one participant standing for all of them.

:class:`CoordinatedParticipant` is what the main process's
:class:`~gymckpt.control.plane.ControlPlane` drives, unchanged: each participant call becomes
a message to every connected worker (:mod:`gymckpt.workers.messages`), whose
:class:`~gymckpt.workers.link.WorkerLink` applies it to the worker's own participant.
:class:`~gymckpt.workers.worker_server.WorkerServer` accepts the workers' connections on a
Unix socket (0600) and runs their forwarded control calls on the plane.

Readiness is the merge of the workers' numbered reports of the current *generation* (one
per close): ready when every worker reported ready and none is missing. It fails closed:

- ``<kind>-workers-unreported:<n>``: fewer current reports than ``expected_workers`` (or
  than connected workers, if more are connected: an extra worker must report too); while
  admission is open (no numbered reports are taken; a status reply asks every worker for
  its readiness first, :meth:`~CoordinatedParticipant.refresh_status`), fewer connected
  workers than expected;
- ``<kind>-worker-lost``: a worker left while admission was closed (what it held is
  unknown), until the next :meth:`~CoordinatedParticipant.open_admission`.

Both come first in ``blockers``, then the sorted union of the workers' blockers; counts are
summed, with ``counts["workers"]`` the connected workers; restarts are the sorted union. A
prepare is not ready and a commit is refused (the plane refuses a commit whose
participant is not ready) while either blocker stands.

Marks: the plane marks this participant's :attr:`~CoordinatedParticipant.fence`; a retire
broadcasts ``mark`` before ``retire``, an install carries the fence's snapshot (the
restore's marks), and a worker that registers gets the snapshot, so every worker's own
fence refuses a retired attempt until forget. A forget asks every worker first
(``check_forget``): one refusal leaves every mark, the coordinator's included, in place.

Restore: the records are split by ``holds`` (the kind's whole-episode records, see
:data:`~gymckpt.workers.placement.WHOLE_EPISODE`). Whole-episode records stay here: a worker takes one with ``claim``
(answered at once, before any later message to that worker; exactly one claim of a key
gets it; refused with ``checkpoint_parked`` while admission is closed), a commit exports
the unclaimed ones in its scope again, and a ``delete_restored`` or ``retire`` drops them.
Session records are placed (:func:`~gymckpt.workers.placement.place_records`): one old
owner's sessions on one live worker, owners spread evenly; every worker gets the routing
tables (``aliases``: old owner → worker, ``placements``: restored session key → worker) with
its install, and a worker that registers later gets them in its join state.

Records move in bounded chunks both ways (:mod:`gymckpt.workers.streams`): a commit keeps
each worker's lines as the encoded bytes the store writes, as they arrive; a restore sends
each worker its share chunk by chunk and lets go of each record it sent.

Commit adds to the manifest, besides the gathered ``session_owners`` and ``placed_sessions``,
``owner_aliases`` (old owner → the owner whose sessions it follows), so a chain of restores
keeps every cookie ever stamped routable.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from gymckpt.control.models import PrepareReport
from gymckpt.control.participant import Participant
from gymckpt.errors import (
    CheckpointParked,
    ControlError,
    CoordinatorUnavailable,
    GymckptError,
    InvalidRequest,
)
from gymckpt.identity import AttemptsUpTo
from gymckpt.store.codec import decode_line
from gymckpt.store.encoded import EncodedRecord, EncodedRecords
from gymckpt.workers import messages
from gymckpt.workers.coordinator_fields import (
    string_list,
)
from gymckpt.workers.coordinator_records import RecordsAcrossWorkers
from gymckpt.workers.messages import Message, deadline_timeout
from gymckpt.workers.placement import is_whole_episode, whole_episode_rule

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping

    from gymckpt.workers.channel import Channel
    from gymckpt.workers.gather import Gathered
    from gymckpt.workers.streams import LinePipe

__all__ = ["ConnectedWorker", "CoordinatedParticipant"]

logger = logging.getLogger(__name__)


@dataclass
class ConnectedWorker:
    """A registered worker: its channel, what it registered with, and its last report of this generation."""

    index: int
    channel: Channel
    pid: int | None = None
    routing_id: str | None = None
    #: the worker reads a restore's records file itself (``install_share``)
    reads_store: bool = False
    #: the newest report of the current generation (None: none yet, or reset by close and open)
    report: PrepareReport | None = None
    #: the highest report number taken from this worker (numbers never go down, across generations)
    seq: int = 0


class CoordinatedParticipant(RecordsAcrossWorkers, Participant):
    """The participant of a server whose work is spread over ``expected_workers`` worker processes."""

    def __init__(
        self,
        kind: str,
        instance: str,
        *,
        expected_workers: int,
        holds: Callable[[dict[str, Any]], bool] | None = None,
    ) -> None:
        if expected_workers < 1:
            raise ValueError(f"expected_workers must be at least 1, not {expected_workers}")
        self.kind = kind
        self.instance = instance
        self.expected_workers = expected_workers
        #: connected, registered workers by index (1, 2, 3, … per accepted connection)
        self.workers: dict[int, ConnectedWorker] = {}
        self.accepting = True
        #: incremented by each close; a report of another generation is ignored
        self.generation = 0
        #: a worker left while admission was closed (cleared by open_admission)
        self.lost_worker = False
        self._request: dict[str, Any] | None = None
        self._deadline_ts: float | None = None
        self._listeners: list[Callable[[], None]] = []
        self._gathered: Gathered | None = None
        self._joined = asyncio.Event()
        #: each worker's readiness as it answered the last status while admission was open
        self._open_reports: dict[int, PrepareReport] = {}
        self._holds = holds if holds is not None else (lambda record: is_whole_episode(kind, record))
        #: the same rule for a restore that reads undecoded lines (decoding only where it must)
        self._line_holds = holds if holds is not None else whole_episode_rule(kind)
        #: restored whole-episode records no worker has claimed yet, by key (encoded once; decoded for a claim)
        self.held: dict[str, EncodedRecord] = {}
        self._streams = itertools.count(1)
        #: the worker sending the lines of a running write: its stream and the pipe to the writer
        self._pipes: dict[int, tuple[int, LinePipe]] = {}
        self._reply_extra: dict[str, Any] = {}
        #: the routing tables of the last restore: old owner → routing id, restored session key → routing id
        self.aliases: dict[str, str] = {}
        self.placements: dict[str, str] = {}
        #: old owner → the owner whose sessions it follows (kept across commits and restores)
        self.owner_aliases: dict[str, str] = {}

    # --- workers (called by WorkerServer)

    def note_deadline(self, deadline_ts: float | None) -> None:
        """The deadline of the control call about to run: it bounds the waits of the messages it sends."""
        self._deadline_ts = deadline_ts

    def register(self, index: int, channel: Channel, body: object) -> dict[str, Any]:
        """A worker registered: keep it and return its join state (it closes at once if a checkpoint is open)."""
        fields = body if isinstance(body, dict) else {}
        pid, routing_id = fields.get("pid"), fields.get("routing_id")
        self.workers[index] = ConnectedWorker(
            index,
            channel,
            pid=pid if type(pid) is int else None,
            routing_id=routing_id if isinstance(routing_id, str) else None,
            reads_store=fields.get("reads_store") is True,
        )
        logger.info("%s worker %d (pid %s) registered", self.kind, index, pid)
        self._joined.set()
        self._notify()
        return {
            "accepting": self.accepting,
            "generation": self.generation,
            "request": self._request,
            "marks": self.fence.snapshot(),
            "routes": self._routes(),
            "holding": bool(self.held),
        }

    def claim(self, index: int, body: object) -> dict[str, Any]:
        """A worker's claim of a restored whole-episode record: ``{"record": …}``, or null once taken.

        Answered on the channel's reading loop, so a claim that succeeds reaches its worker
        before any later message (a close): the claimed episode is then live on that worker.
        """
        key = body.get("episode_id") if isinstance(body, dict) else None
        if not isinstance(key, str):
            raise InvalidRequest(f"a claim needs an episode_id string, not {key!r}")
        if not self.accepting:
            raise CheckpointParked(f"a checkpoint is open: episode {key!r} cannot continue now; retry it after resume")
        entry = self.held.pop(key, None)
        if entry is not None:
            logger.debug("%s worker %d claimed restored episode %s", self.kind, index, key)
        return {"record": None if entry is None else decode_line(entry.line)}

    def _routes(self) -> dict[str, dict[str, str]]:
        return {"aliases": dict(self.aliases), "placements": dict(self.placements)}

    def receive_report(self, index: int, body: object) -> dict[str, bool]:
        """A pushed report: kept only for the current generation, while closed, with a higher number."""
        generation, seq, report = _report_fields(body)
        worker = self.workers.get(index)
        kept = (
            worker is not None and not self.accepting and generation == self.generation and _keep(worker, seq, report)
        )
        if kept:
            self._notify()
        return {"kept": kept}

    def leave(self, index: int) -> None:
        """A worker's connection ended: it is gone, and lost if admission was closed."""
        if self.workers.pop(index, None) is None:
            return
        if not self.accepting:
            self.lost_worker = True
            logger.warning("%s worker %d left while a checkpoint is open: blocking it until resume", self.kind, index)
        else:
            logger.info("%s worker %d left", self.kind, index)
        self._notify()

    # --- messages to the workers

    def _who(self, index: int) -> str:
        return f"{self.kind} worker {index}"

    def _notify(self) -> None:
        for listener in list(self._listeners):
            listener()

    def _bounded_timeout(self) -> float:
        return deadline_timeout(self._deadline_ts)

    async def _broadcast(
        self, kind: str, body: object, *, timeout: float | None, lost_fails: bool = False
    ) -> dict[int, Any]:
        """Send ``body`` to every connected worker; their replies by index."""
        return await self._call_each(
            {index: body for index in self.workers}, kind, timeout=timeout, lost_fails=lost_fails
        )

    async def _call_each(
        self, bodies: Mapping[int, object], kind: str, *, timeout: float | None, lost_fails: bool = False
    ) -> dict[int, Any]:
        """Send each worker its own body at once; raise the first failure, named after its worker.

        A worker whose connection ended meanwhile is skipped (it is gone; the lost blocker and
        the join state cover it) unless ``lost_fails``: an export or install needs every one.
        """
        return await self._run_each(
            sorted(bodies),
            kind,
            lambda worker: worker.channel.request(kind, bodies[worker.index], timeout=timeout),
            lost_fails=lost_fails,
        )

    async def _run_each(
        self,
        indexes: list[int],
        kind: str,
        run: Callable[[ConnectedWorker], Awaitable[Any]],
        *,
        lost_fails: bool = False,
    ) -> dict[int, Any]:
        """``run`` for each of these workers at once; their results by index (failures as in :meth:`_call_each`)."""
        if lost_fails:
            missing = [index for index in indexes if index not in self.workers]
            if missing:
                raise CoordinatorUnavailable(
                    f"{self._who(missing[0])} left before {kind}; retry once every worker is connected"
                )
        targets = [self.workers[index] for index in indexes if index in self.workers]
        results = await asyncio.gather(*(run(worker) for worker in targets), return_exceptions=True)
        replies: dict[int, Any] = {}
        failure: GymckptError | None = None
        for worker, result in zip(targets, results, strict=True):
            if not isinstance(result, BaseException):
                replies[worker.index] = result
            elif not lost_fails and isinstance(result, CoordinatorUnavailable) and worker.channel.closed.is_set():
                logger.warning("%s left during %s; going on without it", self._who(worker.index), kind)
            elif failure is None:
                failure = self._named_failure(worker.index, kind, result)
        if failure is not None:
            raise failure
        return replies

    def _named_failure(self, index: int, kind: str, exc: BaseException) -> GymckptError:
        """``exc`` (typed as it came, status and code kept) with a detail naming the worker."""
        detail = f"{self._who(index)} did not complete {kind}: {exc or type(exc).__name__}"
        if not isinstance(exc, GymckptError):
            failure = ControlError(detail)
            failure.__cause__ = exc
            return failure
        exc.args = (detail,)
        exc.detail = detail
        return exc

    # --- readiness

    def _current_reports(self) -> list[PrepareReport]:
        if self.accepting:
            return [report for index, report in self._open_reports.items() if index in self.workers]
        return [worker.report for worker in self.workers.values() if worker.report is not None]

    async def refresh_status(self) -> None:
        """Before a status reply while admission is open: ask every worker for its readiness now.

        While closed the numbered reports are current already. A worker that does not answer
        is left out of the counts (and a missing one is a blocker anyway).
        """
        if not self.accepting:
            return
        try:
            replies = await self._broadcast(Message.STATUS, {}, timeout=messages.MESSAGE_TIMEOUT_SECONDS)
        except GymckptError:
            logger.warning("a %s worker did not answer a status request", self.kind, exc_info=True)
            return
        reports: dict[int, PrepareReport] = {}
        for index, reply in replies.items():
            try:
                reports[index] = PrepareReport.model_validate(reply.get("report") if isinstance(reply, dict) else None)
            except ValidationError:
                logger.warning("%s sent a malformed status report", self._who(index))
        if self.accepting:
            self._open_reports = reports

    def _own_blockers(self, reports: list[PrepareReport]) -> list[str]:
        blockers = []
        if self.accepting:  # no reports are taken while open: only a worker not connected is missing
            missing = self.expected_workers - len(self.workers)
        else:
            missing = max(self.expected_workers, len(self.workers)) - len(reports)
        if missing > 0:
            blockers.append(f"{self.kind}-workers-unreported:{missing}")
        if self.lost_worker:
            blockers.append(f"{self.kind}-worker-lost")
        return blockers

    def ready(self) -> bool:
        reports = self._current_reports()
        return not self._own_blockers(reports) and all(report.ready for report in reports)

    def blocker_count(self) -> int:
        reports = self._current_reports()
        return len(self._own_blockers(reports)) + sum(report.blocker_count for report in reports)

    def blockers(self, limit: int) -> list[str]:
        reports = self._current_reports()
        merged = sorted({blocker for report in reports for blocker in report.blockers})
        return [*self._own_blockers(reports), *merged][:limit]

    def counts(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for report in self._current_reports():
            for name, value in report.counts.items():
                totals[name] = totals.get(name, 0) + value
        totals["workers"] = len(self.workers)
        return totals

    def restarts(self) -> list[str]:
        return sorted({key for report in self._current_reports() for key in report.restarts})

    def add_readiness_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    # --- admission

    async def close_admission(self, checkpoint_id: str) -> None:
        self.accepting = False
        self._open_reports = {}
        self.generation += 1
        generation = self.generation
        self._request = {"checkpoint_id": checkpoint_id, "deadline_ts": self._deadline_ts}
        for worker in self.workers.values():
            worker.report = None
        self._notify()
        body = {**self._request, "generation": generation}
        replies = await self._broadcast(Message.CLOSE, body, timeout=self._bounded_timeout())
        for index, reply in replies.items():
            worker = self.workers.get(index)
            if worker is not None and generation == self.generation and not self.accepting:
                _keep(worker, *_close_reply_report(reply))
        self._notify()

    async def open_admission(self) -> None:
        self.accepting = True
        self.lost_worker = False
        self._request = None
        for worker in self.workers.values():
            worker.report = None
        try:
            await self._broadcast(Message.OPEN, {}, timeout=messages.MESSAGE_TIMEOUT_SECONDS)
        except Exception:
            logger.warning("a %s worker did not reopen its admission", self.kind, exc_info=True)
        self._notify()

    # --- commit

    async def park_exported(self, records: Any) -> None:
        if isinstance(records, EncodedRecords):
            ids = list(records.episode_ids)
        else:
            ids = [
                record.episode_id if isinstance(record, EncodedRecord) else record["episode_id"] for record in records
            ]
        await self._broadcast(Message.PARK, {"episode_ids": ids}, timeout=self._bounded_timeout())

    def commit_reply_extra(self) -> dict[str, Any]:
        """The workers' commit reply extras, merged (lists such as ``staging_keys`` joined)."""
        return dict(self._reply_extra)

    def manifest_extra(self) -> dict[str, Any]:
        """``session_owners`` (every owner a cookie may name: the records' and the aliased ones),
        ``placed_sessions`` and ``owner_aliases``."""
        if self._gathered is None:
            return {}
        extra: dict[str, Any] = self._gathered.manifest_extra()
        extra["session_owners"] = sorted({*extra["session_owners"], *self.owner_aliases})
        extra["owner_aliases"] = dict(sorted(self.owner_aliases.items()))
        return extra

    async def delete_restored(self, episode_ids: list[str]) -> None:
        for key in episode_ids:
            self.held.pop(key, None)
        await self._broadcast(
            Message.DELETE_RESTORED, {"episode_ids": list(episode_ids)}, timeout=self._bounded_timeout()
        )

    # --- retire and forget

    async def retire(self, episode_ids: list[str]) -> None:
        """Every worker marks the attempts first (its own fence refuses them), then stops and frees them."""
        body = {"episode_ids": list(episode_ids)}
        covered = AttemptsUpTo(episode_ids)
        for key in [key for key in self.held if covered.covers(key)]:
            del self.held[key]
        await self._broadcast(Message.MARK, body, timeout=messages.MESSAGE_TIMEOUT_SECONDS)
        await self._broadcast(Message.RETIRE, body, timeout=self._bounded_timeout())

    async def check_forget(self, rollout_ids: list[str]) -> None:
        """Every worker must agree before any mark is forgotten: one refusal (``retire_incomplete``) keeps them all."""
        await self._broadcast(
            Message.CHECK_FORGET, {"rollout_ids": list(rollout_ids)}, timeout=messages.MESSAGE_TIMEOUT_SECONDS
        )

    async def forget(self, rollout_ids: list[str]) -> None:
        """Forget on every worker (the plane asked :meth:`check_forget` first)."""
        await self._broadcast(Message.FORGET, {"rollout_ids": list(rollout_ids)}, timeout=self._bounded_timeout())

    # --- restore

    async def live_work(self) -> list[str]:  # type: ignore[override]
        """Every worker's live work (the plane awaits it before a restore)."""
        replies = await self._broadcast(Message.LIVE_WORK, {}, timeout=messages.MESSAGE_TIMEOUT_SECONDS)
        found: set[str] = set()
        for index, reply in replies.items():
            found.update(string_list(reply, "episode_ids", self._who(index)))
        found.update(self.held)
        return sorted(found)

    async def _until_every_worker_joined(self) -> None:
        """Wait (within the control call's deadline) until ``expected_workers`` are connected; else refuse.

        A restore places sessions on the workers there are: with one missing, they would all
        crowd onto the others, and a worker still starting would hold nothing.
        """
        timeout = max(0.0, deadline_timeout(self._deadline_ts) - messages.REPLY_GRACE_SECONDS)
        try:
            async with asyncio.timeout(timeout):
                while len(self.workers) < self.expected_workers:
                    self._joined.clear()
                    await self._joined.wait()
        except TimeoutError:
            raise CoordinatorUnavailable(
                f"only {len(self.workers)} of {self.expected_workers} {self.kind} workers are connected: "
                "the restore cannot place their records; retry once every worker has started"
            ) from None

    # --- status

    def status_extra(self) -> dict[str, Any]:
        """``workers``, ``expected_workers``, ``worker_pids``, ``restored_pending`` (held, unclaimed),
        ``session_aliases`` and ``session_placements``."""
        return {
            "workers": len(self.workers),
            "expected_workers": self.expected_workers,
            "worker_pids": sorted(worker.pid for worker in self.workers.values() if worker.pid is not None),
            "restored_pending": sorted(self.held),
            "session_aliases": dict(self.aliases),
            "session_placements": len(self.placements),
        }


def _keep(worker: ConnectedWorker, seq: int, report: PrepareReport) -> bool:
    """Take ``report`` if it is newer than the worker's last one; True if taken."""
    if seq <= worker.seq:
        return False
    worker.seq = seq
    worker.report = report
    return True


def _report_fields(body: object) -> tuple[int, int, PrepareReport]:
    """``(generation, seq, report)`` of a report message."""
    generation = body.get("generation") if isinstance(body, dict) else None
    if type(generation) is not int:
        raise InvalidRequest(f"a report needs an integer generation, not {generation!r}")
    return (generation, *_close_reply_report(body))


def _close_reply_report(body: object) -> tuple[int, PrepareReport]:
    """``(seq, report)`` of a numbered report (a close reply is the worker's first of the generation)."""
    fields = body if isinstance(body, dict) else {}
    seq = fields.get("seq")
    if type(seq) is not int:
        raise InvalidRequest(f"a report needs an integer seq, not {seq!r}")
    try:
        return seq, PrepareReport.model_validate(fields.get("report"))
    except ValidationError as exc:
        raise InvalidRequest(f"a malformed report: {exc}") from exc
