"""A worker's side of a server with several workers: its participant, driven by the coordinator.

:class:`WorkerLink` wraps the participant a single-process server would run (for this
worker's share of the work) and connects it to the coordinator in the main process:

- :meth:`WorkerLink.connect` retries every :data:`CONNECT_RETRY_SECONDS` while the socket is
  missing or refuses, up to ``connect_timeout`` (then
  :class:`~gymckpt.errors.CoordinatorUnavailable`), registers, and adopts the join state:
  the coordinator's marks go into the participant's fence, and if a checkpoint is open the
  worker closes at once and reports;
- it answers the coordinator's messages (:mod:`gymckpt.workers.messages`) by calling its
  participant; ``export`` re-checks readiness first; ``send_records`` encodes each record
  once (:func:`gymckpt.store.codec.encode_record`) and appends the lines to the coordinator's
  local records file itself, or sends them as bytes in chunks that each wait for their answer;
  ``install_chunk`` keeps a restore's records (decoded) until ``install`` installs them
  (:mod:`gymckpt.workers.streams`);
- while closed it pushes numbered reports (``report {generation, seq, report}``) when the
  participant's readiness listener fires (one sender task coalesces bursts) and re-checks
  every :data:`~gymckpt.workers.messages.REPORT_POLL_SECONDS`, since some changes notify
  nobody; a report equal to the last one sent is not sent again;
- when the connection ends without :meth:`WorkerLink.disconnect`, the main process (and
  uvicorn's supervisor with it) is gone: it calls ``on_coordinator_lost``, by default
  SIGTERM to this process, since a worker left behind would hold the port and could never
  take part in a checkpoint again.

Restored whole-episode state waits in the coordinator: the link is the participant's
:attr:`~gymckpt.control.participant.Participant.claim_source` (:meth:`WorkerLink.claim`), asked
only while the coordinator said it holds some. Session records leave with this worker's
``routing_id`` as their owner; the routing tables (join state, ``install``, ``routes``) go to
``on_routes(aliases, placements)``.

A participant may define ``check_forget(rollout_ids)`` (plain or async) to refuse a forget
it cannot do yet (e.g. sessions not freed): it raises, typically
:class:`~gymckpt.errors.RetireIncomplete`. The link itself refuses while one of its own
retires of those rollouts still runs.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gymckpt.control._tasks import close_store
from gymckpt.control.plane import OPEN_GC_PAUSE_SECONDS, readiness_report
from gymckpt.errors import CoordinatorUnavailable, GymckptError, InvalidPhase, InvalidRequest, RetireIncomplete
from gymckpt.gc_pause import GCPause, pause_gc, paused_gc
from gymckpt.identity import AttemptsUpTo, first_keys
from gymckpt.store.manifest import Manifest
from gymckpt.workers import messages
from gymckpt.workers.channel import Channel
from gymckpt.workers.messages import Message
from gymckpt.workers.scatter import read_share
from gymckpt.workers.streams import CHUNK_BYTES, InstallStaging, append_export, encode_export_chunk, owner_of

if TYPE_CHECKING:
    from collections.abc import Callable

    from gymckpt.control.models import PrepareReport
    from gymckpt.control.participant import Participant
    from gymckpt.store.checkpoint_store import CheckpointStore

__all__ = ["CONNECT_RETRY_SECONDS", "WorkerLink", "local_report", "terminate_this_worker"]


def _read_share(store: CheckpointStore, manifest: Manifest, share: list[Any]) -> dict[int, dict[str, Any]]:
    """This worker's share of the records file, only its lines (its thread; the coordinator verified the
    whole file, each line is checked as a line and decoded here)."""
    for entry in share:
        if not (
            isinstance(entry, list)
            and len(entry) == 7
            and isinstance(entry[0], str)
            and isinstance(entry[1], str)
            and (entry[3] is None or isinstance(entry[3], str))
            and all(type(number) is int for number in (entry[2], *entry[4:]))
        ):
            raise InvalidRequest(
                "a share's records are [stored id, key, position, owner | null, offset, length, crc32]"
            )
    return read_share(store.read_spans(manifest, [(entry[0], *entry[4:]) for entry in share]), share)


logger = logging.getLogger(__name__)

#: how often a connecting worker retries a socket that is missing or refuses, in seconds
CONNECT_RETRY_SECONDS = 0.1


def terminate_this_worker() -> None:
    """The default ``on_coordinator_lost``: SIGTERM to this process (uvicorn's worker shuts down)."""
    os.kill(os.getpid(), signal.SIGTERM)


def local_report(participant: Participant) -> PrepareReport:
    """The participant's readiness as a prepare report (what the control plane would reply)."""
    return readiness_report(participant)


def _field(body: object, name: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, kind):
        raise InvalidRequest(f"the message needs {name!r} of type {kind}, not {value!r}")
    return value


def _keys(body: object, name: str) -> list[str]:
    values = _field(body, name, list)
    if not all(isinstance(value, str) for value in values):
        raise InvalidRequest(f"{name!r} must be a list of strings")
    return values


class WorkerLink:
    """Connects one worker's ``participant`` to its server's coordinator at ``socket_path``."""

    def __init__(
        self,
        participant: Participant,
        socket_path: Path | str,
        *,
        on_coordinator_lost: Callable[[], None] | None = None,
        routing_id: str | None = None,
        connect_timeout: float = messages.MESSAGE_TIMEOUT_SECONDS,
        on_routes: Callable[[dict[str, str], dict[str, str]], None] | None = None,
        open_store: Callable[[str], CheckpointStore] | None = None,
    ) -> None:
        self.participant = participant
        #: opens a restore's checkpoint directory as the server's settings allow (None: the coordinator sends the share)
        self.open_store = open_store
        self.socket_path = Path(socket_path)
        self.on_coordinator_lost = on_coordinator_lost or terminate_this_worker
        self.routing_id = routing_id
        self.connect_timeout = connect_timeout
        #: this worker's admission, as the coordinator last set it
        self.accepting = True
        #: the coordinator's generation of the checkpoint this worker closed for
        self.generation = 0
        self._channel: Channel | None = None
        self._disconnecting = False
        self._seq = itertools.count(1)
        self._last_sent: PrepareReport | None = None
        self._report_pending = False
        self._sender: asyncio.Task[None] | None = None
        self._poller: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._admission = asyncio.Lock()
        self._retiring: dict[int, AttemptsUpTo] = {}
        self._retire_ids = itertools.count()
        self._exported: list[dict[str, Any]] = []
        #: the stream number of the export ``_exported`` holds (None: none since admission opened)
        self._export_stream: int | None = None
        #: the records of the restore stream being received, until ``install``
        self._staging = InstallStaging()
        #: the cyclic GC's pause while admission is closed (bounded like a control plane's open checkpoint)
        self._gc_pause: GCPause | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_routes = on_routes
        #: whether the coordinator holds restored whole-episode records (then a new episode claims first)
        self.holding = False
        participant.add_readiness_listener(self._readiness_changed)
        participant.claim_source = self.claim

    @property
    def channel(self) -> Channel | None:
        """The connection to the coordinator, None when there is none (never connected, or it ended)."""
        channel = self._channel
        return channel if channel is not None and not channel.closed.is_set() else None

    # --- connection

    async def connect(self) -> None:
        """Connect, register and adopt the join state; :class:`CoordinatorUnavailable` if nobody listens in time."""
        if self.channel is not None:
            raise RuntimeError("this worker is connected already")
        self._loop = asyncio.get_running_loop()
        reader, writer = await self._open_connection()
        channel = Channel(reader, writer, name=f"{self.participant.kind} coordinator")
        self._serve(channel)
        self._disconnecting = False
        self._channel = channel
        channel.start()
        self._watcher = asyncio.create_task(self._watch(channel), name="gymckpt-coordinator-watch")
        async with self._admission:  # a close or open sent right after the join waits for the adoption
            try:
                body = {"pid": os.getpid(), "routing_id": self.routing_id, "reads_store": self.open_store is not None}
                state = await channel.request(Message.REGISTER, body, timeout=messages.MESSAGE_TIMEOUT_SECONDS)
                await self._adopt(state)
            except BaseException:
                await self.disconnect()
                raise

    async def _open_connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        deadline = time.monotonic() + self.connect_timeout
        while True:
            try:
                return await asyncio.open_unix_connection(os.fspath(self.socket_path))
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if time.monotonic() >= deadline:
                    raise CoordinatorUnavailable(
                        f"no {self.participant.kind} checkpoint coordinator at {self.socket_path} "
                        f"after {self.connect_timeout} s: {exc}"
                    ) from exc
                await asyncio.sleep(CONNECT_RETRY_SECONDS)

    async def _adopt(self, state: object) -> None:
        marks = _field(state, "marks", dict)
        self.participant.fence.update(marks)
        self._take_routes(state)
        if _field(state, "accepting", bool):
            if not self.accepting:  # closed for a coordinator that is gone: this one is open
                await self._open_locally()
            return
        request = _field(state, "request", dict)
        await self._close_locally(_field(request, "checkpoint_id", str), _field(state, "generation", int))
        self._schedule_report()

    async def disconnect(self) -> None:
        """Leave the coordinator on purpose (shutdown): ``on_coordinator_lost`` is not called."""
        self._disconnecting = True
        channel, self._channel = self._channel, None
        self._stop_polling()
        sender = self._sender
        if sender is not None and sender is not asyncio.current_task():
            sender.cancel()
        if channel is not None:
            await channel.close()
        self._staging.drop()  # no install can come now: let the collector run again
        self._end_gc_pause()
        watcher = self._watcher
        if watcher is not None and watcher is not asyncio.current_task():
            await asyncio.gather(watcher, return_exceptions=True)

    async def _watch(self, channel: Channel) -> None:
        await channel.closed.wait()
        if self._disconnecting or channel is not self._channel:
            return
        logger.error(
            "lost the %s checkpoint coordinator (%s); shutting this worker down",
            self.participant.kind,
            channel.close_reason,
        )
        self._channel = None
        self._stop_polling()
        self._staging.drop()  # a stream of a lost coordinator never completes
        self._end_gc_pause()
        self.on_coordinator_lost()

    def _serve(self, channel: Channel) -> None:
        handlers = {
            Message.CLOSE: self._on_close,
            Message.OPEN: self._on_open,
            Message.MARK: self._on_mark,
            Message.RETIRE: self._on_retire,
            Message.CHECK_FORGET: self._on_check_forget,
            Message.FORGET: self._on_forget,
            Message.EXPORT: self._on_export,
            Message.SEND_RECORDS: self._on_send_records,
            Message.INSTALL: self._on_install,
            Message.INSTALL_SHARE: self._on_install_share,
            Message.LIVE_WORK: self._on_live_work,
            Message.PARK: self._on_park,
            Message.DELETE_RESTORED: self._on_delete_restored,
            Message.ROUTES: self._on_routes,
            Message.STATUS: self._on_status,
        }
        for kind, handler in handlers.items():
            channel.handle(kind, handler)
        channel.handle_immediately(Message.INSTALL_CHUNK, self._on_install_chunk)

    # --- claims and routes

    async def claim(self, key: str) -> dict[str, Any] | None:
        """The restored whole-episode record of ``key`` if the coordinator holds it (taken, once), else None.

        Raises :class:`~gymckpt.errors.CheckpointParked` while a checkpoint is open (the caller
        retries the episode) and :class:`CoordinatorUnavailable` without the coordinator.
        """
        if not self.holding:
            return None
        channel = self.channel
        if channel is None:
            raise CoordinatorUnavailable(f"this {self.participant.kind} worker lost its checkpoint coordinator")
        reply = await channel.request(Message.CLAIM, {"episode_id": key}, timeout=messages.MESSAGE_TIMEOUT_SECONDS)
        record = _field(reply, "record", (dict, type(None)))
        if record is not None and record.get("episode_id") != key:
            raise InvalidRequest(f"the coordinator answered the claim of {key!r} with another episode's record")
        return record

    def _take_routes(self, body: object) -> None:
        if isinstance(body, dict) and isinstance(body.get("holding"), bool):
            self.holding = body["holding"]
        routes = body.get("routes") if isinstance(body, dict) else None
        if routes is None:
            return
        aliases, placements = _field(routes, "aliases", dict), _field(routes, "placements", dict)
        if self.on_routes is not None:
            self.on_routes(aliases, placements)

    async def _on_status(self, body: object) -> dict[str, Any]:
        return {"report": local_report(self.participant).model_dump(mode="json")}

    async def _on_routes(self, body: object) -> dict[str, Any]:
        self._take_routes({"routes": body})
        return {}

    # --- admission

    async def _close_locally(self, checkpoint_id: str, generation: int) -> None:
        self.generation = generation
        self.accepting = False
        self._last_sent = None
        if self._gc_pause is None:  # no full collection of a large heap until admission opens (gymckpt.gc_pause)
            self._gc_pause = pause_gc(OPEN_GC_PAUSE_SECONDS, f"checkpoint {checkpoint_id!r} (admission closed)")
        await self.participant.close_admission(checkpoint_id)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll(), name="gymckpt-report-poll")

    async def _on_close(self, body: object) -> dict[str, Any]:
        deadline_ts = body.get("deadline_ts") if isinstance(body, dict) else None
        self.participant.note_deadline(deadline_ts if isinstance(deadline_ts, (int, float)) else None)
        async with self._admission:
            with paused_gc():  # no full collection of a large heap meanwhile (gymckpt.gc_pause)
                await self._close_locally(_field(body, "checkpoint_id", str), _field(body, "generation", int))
            return self._numbered(local_report(self.participant))

    def _end_gc_pause(self) -> None:
        pause, self._gc_pause = self._gc_pause, None
        if pause is not None:
            pause.release()

    async def _open_locally(self) -> None:
        self.accepting = True
        self._last_sent = None
        self._end_gc_pause()
        self._exported, self._export_stream = [], None
        self._staging.drop()  # an unfinished restore stream (a failed restore reopens admission)
        self._stop_polling()
        await self.participant.open_admission()

    async def _on_open(self, body: object) -> dict[str, Any]:
        async with self._admission:
            await self._open_locally()
        return {}

    # --- reports

    def _numbered(self, report: PrepareReport) -> dict[str, Any]:
        self._last_sent = report
        return {"seq": next(self._seq), "report": report.model_dump(mode="json")}

    def _readiness_changed(self) -> None:
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is not None and running is not loop:
            loop.call_soon_threadsafe(self._schedule_report)
        else:
            self._schedule_report()

    def _schedule_report(self) -> None:
        """Push the current report soon (while closed and connected); one sender task takes every request."""
        if self.accepting or self.channel is None:
            return
        self._report_pending = True
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send_reports(), name="gymckpt-report")

    async def _send_reports(self) -> None:
        while self._report_pending and not self.accepting:
            self._report_pending = False
            channel = self.channel
            report = local_report(self.participant)
            if channel is None or report == self._last_sent:
                continue
            body = {"generation": self.generation, **self._numbered(report)}
            try:
                await channel.request(Message.REPORT, body, timeout=messages.MESSAGE_TIMEOUT_SECONDS)
            except GymckptError:
                logger.warning(
                    "could not report to the %s checkpoint coordinator", self.participant.kind, exc_info=True
                )
                return

    def _stop_polling(self) -> None:
        poller, self._poller = self._poller, None
        if poller is not None and poller is not asyncio.current_task():
            poller.cancel()

    async def _poll(self) -> None:
        """While closed: look again every poll interval, since some readiness changes notify nobody."""
        while not self.accepting:
            await asyncio.sleep(messages.REPORT_POLL_SECONDS)
            self._schedule_report()

    # --- retire and forget

    async def _on_mark(self, body: object) -> dict[str, Any]:
        for key in _keys(body, "episode_ids"):
            self.participant.fence.mark(key)
        return {}

    async def _on_retire(self, body: object) -> dict[str, Any]:
        keys = _keys(body, "episode_ids")  # marked already: the coordinator sends mark first
        token = next(self._retire_ids)
        self._retiring[token] = AttemptsUpTo(keys)
        try:
            await self.participant.retire(keys)
        finally:
            del self._retiring[token]
        return {}

    async def _on_check_forget(self, body: object) -> dict[str, Any]:
        rollouts = set(_keys(body, "rollout_ids"))
        freeing = sorted({rollout for group in self._retiring.values() for rollout in group.snapshot()} & rollouts)
        if freeing:
            raise RetireIncomplete(
                f"this worker still stops and frees {first_keys(freeing)}; forget them once it finished"
            )
        check = getattr(self.participant, "check_forget", None)
        if check is not None:
            result = check(sorted(rollouts))
            if inspect.isawaitable(result):
                await result
        return {}

    async def _on_forget(self, body: object) -> dict[str, Any]:
        rollouts = _keys(body, "rollout_ids")
        self.participant.fence.forget(rollouts)
        await self.participant.forget(rollouts)
        return {}

    # --- commit

    async def _on_export(self, body: object) -> dict[str, Any]:
        participant = self.participant
        if self.accepting:
            raise InvalidPhase("this worker's admission is open: no checkpoint to export")
        if not participant.ready():
            raise InvalidPhase(
                f"no longer ready to commit: {participant.blocker_count()} executions of this worker are not at a boundary"
            )
        scope = body.get("episode_ids") if isinstance(body, dict) else None
        if scope is not None:
            scope = _keys(body, "episode_ids")
        stream = _field(body, "stream", int)
        started = time.perf_counter()
        with paused_gc():
            records = list(await participant.export(scope))
        self._exported, self._export_stream = records, stream
        owner, kind = self.routing_id, participant.kind
        named = [[record.get("episode_id"), owner_of(kind, record, owner)] for record in records]
        logger.info("%s worker exported %d records in %.3f s", kind, len(records), time.perf_counter() - started)
        return {"records": named, "reply_extra": participant.commit_reply_extra()}

    async def _on_send_records(self, body: object) -> dict[str, Any]:
        """The lines of the last export but ``skip``: appended to the records file ``append_to`` names
        (the count and bytes), else in chunks (each waits for its answer), then their count."""
        export = _field(body, "export", int)
        stream = _field(body, "stream", int)
        skip = frozenset(_field(body, "skip", list))
        if export != self._export_stream:
            raise InvalidPhase(f"this worker's last export is {self._export_stream}, not {export}: prepare again")
        records, kind = self._exported, self.participant.kind
        started = time.perf_counter()
        if "append_to" in body:  # type: ignore[operator]
            appended = await asyncio.to_thread(
                append_export,
                records,
                kind,
                self.routing_id,
                skip,
                body["append_to"],  # type: ignore[index]
            )
            if appended is None:  # append_export logged why
                return {"appended": False}
            logger.info(
                "%s worker appended %d records (%d bytes) to the records file in %d writes in %.3f s",
                kind,
                sum(count for _, _, count in appended),
                sum(size for _, size, _ in appended),
                len(appended),
                time.perf_counter() - started,
            )
            return {"appended": True, "pieces": appended}
        sent = chunks = 0
        encoding = 0.0

        async def encode_from(start: int) -> tuple[list[str], bytes, int, float]:
            began = time.perf_counter()
            episode_ids, lines, following = await asyncio.to_thread(
                encode_export_chunk, records, start, kind, self.routing_id, CHUNK_BYTES, skip
            )
            return episode_ids, lines, following, time.perf_counter() - began

        # the next chunk is encoded while the one before travels and waits for its answer: a worker
        # holds two chunks at most, and the coordinator's round trip no longer adds to the encoding
        upcoming = asyncio.ensure_future(encode_from(0)) if records else None
        try:
            while upcoming is not None:
                episode_ids, lines, start, took = await upcoming
                encoding += took
                upcoming = asyncio.ensure_future(encode_from(start)) if start < len(records) else None
                if not episode_ids:
                    continue
                channel = self.channel
                if channel is None:
                    raise CoordinatorUnavailable(f"this {kind} worker lost its checkpoint coordinator")
                sent += len(episode_ids)
                chunk = {"stream": stream, "episode_ids": episode_ids}
                await channel.request(Message.EXPORT_CHUNK, chunk, timeout=messages.MESSAGE_TIMEOUT_SECONDS, blob=lines)
                del chunk, lines
                chunks += 1
        finally:
            if upcoming is not None:
                upcoming.cancel()  # a failed send: the chunk after it is not wanted
        logger.info(
            "%s worker sent %d records in %d chunks in %.3f s (encoding %.3f s)",
            kind,
            sent,
            chunks,
            time.perf_counter() - started,
            encoding,
        )
        return {"count": sent}

    async def _on_park(self, body: object) -> dict[str, Any]:
        wanted = set(_keys(body, "episode_ids"))
        await self.participant.park_exported([record for record in self._exported if record["episode_id"] in wanted])
        self._end_gc_pause()  # the controller stops after this checkpoint: no open ends it
        return {}

    async def _on_delete_restored(self, body: object) -> dict[str, Any]:
        await self.participant.delete_restored(_keys(body, "episode_ids"))
        return {}

    # --- restore

    async def _on_live_work(self, body: object) -> dict[str, Any]:
        return {"episode_ids": sorted(self.participant.live_work())}

    def _on_install_chunk(self, body: object) -> dict[str, Any]:
        self._staging.take(body)
        return {}

    async def _on_install_share(self, body: object) -> dict[str, Any]:
        """Read this worker's share of a restore from the records file itself (its lines only, where the
        coordinator's verified read found them), and keep it."""
        if self.open_store is None:
            raise InvalidRequest("this worker does not open the store: send its share in chunks")
        stream = _field(body, "stream", int)
        share = _field(body, "share", list)
        manifest = self._manifest_of(_field(body, "manifest", dict))
        self._staging.begin(stream)
        store = self.open_store(_field(body, "checkpoint_dir", str))
        try:
            records = await asyncio.to_thread(_read_share, store, manifest, share)
        finally:
            await close_store(store)
        self._staging.take_share(stream, records)
        return {"count": len(records)}

    def _manifest_of(self, body: dict[str, Any]) -> Manifest:
        """A manifest sent as ``{path, raw}``, parsed for this worker's participant."""
        participant = self.participant
        raw = _field(body, "raw", str).encode("utf-8")
        return Manifest.parse(raw, path=_field(body, "path", str), kind=participant.kind, instance=participant.instance)

    async def _on_install(self, body: object) -> dict[str, Any]:
        with paused_gc():  # the staged share and what install makes of it: no collection until it is installed
            await self._install_staged(body)
        return {}

    async def _install_staged(self, body: object) -> None:
        participant = self.participant
        records = self._staging.finish(_field(body, "stream", int), _field(body, "count", int))
        scope = _keys(body, "scope")
        participant.fence.update(_field(body, "marks", dict))
        self._take_routes(body)
        manifest = _field(body, "manifest", (dict, type(None)))
        parsed = None if manifest is None else self._manifest_of(manifest)
        await participant.install(records, scope, parsed)  # type: ignore[arg-type]
