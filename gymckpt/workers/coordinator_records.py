"""The records of a server's workers: a commit's gather and a restore's scatter, streamed.

:class:`RecordsAcrossWorkers` is the part of
:class:`~gymckpt.workers.coordinator.CoordinatedParticipant` that moves records
(:mod:`gymckpt.workers.streams`, :mod:`gymckpt.workers.scatter`): a commit's lines go from
each worker to the store's writer a chunk at a time while it writes, and a restore's records
from the store's reader to each worker a chunk at a time while it reads. The participant's
state and helpers it uses are declared below for the type checker.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from gymckpt.errors import CoordinatorUnavailable, InvalidCheckpointState, InvalidPhase
from gymckpt.workers.coordinator_fields import manifest_body, merged_reply_extra
from gymckpt.workers.frames import BLOB_KEY
from gymckpt.workers.gather import WorkerExport, gather_exports
from gymckpt.workers.messages import Message
from gymckpt.workers.scatter import (
    ChunkSender,
    plan_scatter,
    scatter,
    scatter_lines,
    share_lists,
    survey,
    survey_lines,
)
from gymckpt.workers.streams import (
    CHUNK_BYTES,
    GatheredLines,
    LinePipe,
    LineRef,
    appended_pieces,
    exported_refs,
    exported_run,
)

if TYPE_CHECKING:
    import concurrent.futures
    import itertools
    from collections.abc import Callable, Iterable, Mapping

    from gymckpt.control.marks import RetireMarks
    from gymckpt.errors import GymckptError
    from gymckpt.store.encoded import EncodedRecord
    from gymckpt.store.manifest import Manifest
    from gymckpt.store.spans import LineSpan
    from gymckpt.workers.coordinator import ConnectedWorker
    from gymckpt.workers.gather import Gathered
    from gymckpt.workers.scatter import Holds, ScatterPlan

__all__ = ["RecordsAcrossWorkers"]


class RecordsAcrossWorkers:
    """Export, the lines' stream to the writer, and install across a server's workers."""

    if TYPE_CHECKING:  # the participant's own state and helpers
        workers: dict[int, ConnectedWorker]
        held: dict[str, EncodedRecord]
        aliases: dict[str, str]
        placements: dict[str, str]
        owner_aliases: dict[str, str]
        _streams: itertools.count[int]
        _pipes: dict[int, tuple[int, LinePipe]]
        _gathered: Gathered | None
        _reply_extra: dict[str, Any]
        _holds: Callable[[dict[str, Any]], bool]
        _line_holds: Holds

        @property
        def fence(self) -> RetireMarks: ...
        def _who(self, index: int) -> str: ...
        def _named_failure(self, index: int, kind: str, exc: BaseException) -> GymckptError: ...
        def _routes(self) -> dict[str, dict[str, str]]: ...
        async def _until_every_worker_joined(self) -> None: ...
        async def _broadcast(
            self, kind: str, body: object, *, timeout: float | None, lost_fails: bool = False
        ) -> dict[int, Any]: ...
        async def _call_each(
            self, bodies: Mapping[int, object], kind: str, *, timeout: float | None, lost_fails: bool = False
        ) -> dict[int, Any]: ...

    async def export_chunk(self, index: int, body: object) -> dict[str, Any]:
        """A chunk of worker ``index``'s lines, answered once the store's writer took it; refused
        when it is not of the stream this worker was asked for."""
        entry = self._pipes.get(index)
        stream = body.get("stream") if isinstance(body, dict) else None
        if entry is None or entry[0] != stream:
            raise InvalidPhase(f"{self._who(index)} sent records of stream {stream!r}, which no write reads")
        fields: dict[str, Any] = body  # type: ignore[assignment]
        await entry[1].put(exported_run(fields.get("episode_ids"), fields.get(BLOB_KEY), self._who(index)))
        return {}

    async def export(self, scope: list[str] | None) -> GatheredLines:
        """Every worker's records, gathered (one copy per episode); a worker that fails fails the export.

        The workers name their records; their lines move only while the store writes them
        (:class:`~gymckpt.workers.streams.GatheredLines`): each worker in turn appends its own
        to a local records file, which the writer then reads back, or sends them a chunk at a time.
        """
        stream = next(self._streams)
        body = {"episode_ids": scope, "stream": stream}
        replies = await self._broadcast(Message.EXPORT, body, timeout=None, lost_fails=True)
        exports = {
            index: WorkerExport(exported_refs(reply, index, self._who(index))) for index, reply in replies.items()
        }
        self._reply_extra = merged_reply_extra(replies)
        held = list(self.held.values())
        self._gathered = gathered = gather_exports(exports, held=held, scope=scope, placements=self.placements)
        plan = []
        for index, export in sorted(exports.items()):
            kept = [ref for ref in gathered.records if isinstance(ref, LineRef) and ref.worker == index]
            positions = {ref.position for ref in kept}
            skip = [position for position in range(len(export.records)) if position not in positions]
            plan.append((index, skip, [ref.episode_id for ref in kept]))
        kept_held = [record for record in gathered.records if not isinstance(record, LineRef)]

        async def fetch(index: int, skip: list[int], pipe: LinePipe) -> None:
            await self._send_lines(index, stream, skip, pipe)

        async def append(index: int, skip: list[int], target: str) -> int | None:
            return await self._append_lines(index, stream, skip, target)

        return GatheredLines(plan, kept_held, fetch, asyncio.get_running_loop(), append)

    async def _append_lines(
        self, index: int, export_stream: int, skip: list[int], target: str
    ) -> list[tuple[int, int, int]] | None:
        """Have worker ``index`` append the lines of its export ``export_stream`` (but ``skip``) to the
        file at ``target`` (other workers append theirs meanwhile): where each of its writes landed,
        ``(offset, length, count)`` in its order, or None when it could not open the file."""
        try:
            worker = self.workers.get(index)
            if worker is None:
                raise CoordinatorUnavailable(f"{self._who(index)} left after its export; prepare again")
            body = {"export": export_stream, "stream": next(self._streams), "skip": skip, "append_to": target}
            reply = await worker.channel.request(Message.SEND_RECORDS, body, timeout=None)
            if not isinstance(reply, dict) or reply.get("appended") is not True:
                return None  # it could not open the file: nothing appended, its lines go in chunks
            return appended_pieces(reply.get("pieces"), self._who(index))
        except Exception as exc:
            raise self._named_failure(index, Message.SEND_RECORDS, exc) from None

    async def _send_lines(self, index: int, export_stream: int, skip: list[int], pipe: LinePipe) -> None:
        """Ask worker ``index`` for the lines of its export ``export_stream`` (but ``skip``) into ``pipe``."""
        failure: BaseException | None = None
        stream = next(self._streams)
        try:
            worker = self.workers.get(index)
            if worker is None:
                raise CoordinatorUnavailable(f"{self._who(index)} left after its export; prepare again")
            self._pipes[index] = (stream, pipe)
            body = {"export": export_stream, "stream": stream, "skip": skip}
            reply = await worker.channel.request(Message.SEND_RECORDS, body, timeout=None)
            count = reply.get("count") if isinstance(reply, dict) else None
            if count != pipe.received:
                raise InvalidCheckpointState(
                    f"{self._who(index)} sent {pipe.received} records, not the {count!r} it named"
                )
        except Exception as exc:
            failure = self._named_failure(index, Message.SEND_RECORDS, exc)
            raise failure from None
        except BaseException as exc:
            failure = exc
            raise
        finally:
            if self._pipes.get(index, (None,))[0] == stream:
                del self._pipes[index]
            pipe.finish(failure)

    #: the control plane hands :meth:`install` the scope's records unread: it reads them twice, streamed
    installs_streamed = True

    async def install(self, records: Iterable[dict[str, Any]], scope: list[str], manifest: Manifest) -> None:
        """Hold the whole-episode records, place the sessions, and send every worker its share and the tables.

        ``records`` is read twice (:mod:`gymckpt.workers.scatter`): once to hold and to place,
        then by each worker for its share where every worker reads the store itself, else by the
        coordinator, sending each worker its share in chunks as it is read. The coordinator never
        keeps the sessions' records; every share arrives before any worker installs, so a worker
        lost on the way fails the restore, named, with nothing installed.
        """
        await self._until_every_worker_joined()
        extra = manifest.extra if manifest is not None else {}
        # records from gymckpt's own file move as undecoded lines (see gymckpt.workers.scatter)
        lines: Callable[..., Iterable[tuple[str, bytes]]] | None = (
            getattr(records, "lines", None) if getattr(records, "lines_readable", False) else None
        )
        spans: dict[str, LineSpan] = {}  # each line's place in the file, for the workers' own reads
        if lines is not None:
            held, placed = await asyncio.to_thread(survey_lines, lines(rekeyed=False, spans=spans), self._line_holds)
        else:
            held, placed = await asyncio.to_thread(survey, records, self._holds)
        routing = {index: worker.routing_id for index, worker in self.workers.items()}
        plan = plan_scatter(placed, routing, extra)
        del placed
        missing = [index for index in plan.counts if index not in self.workers]
        if missing:
            raise CoordinatorUnavailable(f"{self._who(missing[0])} left during the restore; restore again")
        self.held = held
        self.aliases, self.placements = plan.aliases, plan.placements
        self.owner_aliases = {old: new for old, new in plan.aliases.items() if old != new}
        stream = next(self._streams)
        if plan.targets and lines is not None and self._workers_read(plan, records, manifest):
            await self._send_shares(stream, plan, records, manifest, spans)
        elif plan.targets:
            loop = asyncio.get_running_loop()

            def submit(index: int, chunk: list[list[Any]]) -> concurrent.futures.Future[None]:
                return asyncio.run_coroutine_threadsafe(self._send_chunk(index, stream, chunk), loop)

            if lines is not None:
                await asyncio.to_thread(scatter_lines, lines(), plan, ChunkSender(submit), CHUNK_BYTES)
            else:
                await asyncio.to_thread(scatter, records, plan, ChunkSender(submit), CHUNK_BYTES)
        base = {
            "stream": stream,
            "scope": list(scope),
            "manifest": manifest_body(manifest),
            "marks": self.fence.snapshot(),
            "routes": self._routes(),
            "holding": bool(self.held),
        }
        bodies = {index: {**base, "count": count} for index, count in plan.counts.items()}
        await self._call_each(bodies, Message.INSTALL, timeout=None, lost_fails=True)

    def _workers_read(self, plan: ScatterPlan, records: object, manifest: Manifest | None) -> bool:
        """True when every worker with a share reads the records file itself (and can be told where it is)."""
        return (
            manifest_body(manifest) is not None
            and isinstance(getattr(records, "next_keys", None), dict)
            and getattr(getattr(records, "store", None), "url", None) is not None
            and all(index in self.workers and self.workers[index].reads_store for index in plan.counts)
        )

    async def _send_shares(
        self,
        stream: int,
        plan: ScatterPlan,
        records: Any,
        manifest: Manifest | None,
        spans: Mapping[str, LineSpan],
    ) -> None:
        """Tell each worker its share and where each of its lines is in the file (which the survey verified
        whole); the workers read their lines at once, each only its own."""
        shares = share_lists(plan, records.next_keys, spans)
        base = {"stream": stream, "checkpoint_dir": records.store.url, "manifest": manifest_body(manifest)}
        bodies = {index: {**base, "share": share} for index, share in shares.items()}
        replies = await self._call_each(bodies, Message.INSTALL_SHARE, timeout=None, lost_fails=True)
        for index, reply in replies.items():
            count = reply.get("count") if isinstance(reply, dict) else None
            if count != plan.counts[index]:
                raise InvalidCheckpointState(
                    f"{self._who(index)} read {count!r} records of its share of {plan.counts[index]}"
                )

    async def _send_chunk(self, index: int, stream: int, chunk: list[list[Any]]) -> None:
        """One chunk of worker ``index``'s share; a failure names the worker."""
        worker = self.workers.get(index)
        try:
            if worker is None:
                raise CoordinatorUnavailable(f"{self._who(index)} left during the restore; restore again")
            await worker.channel.request(Message.INSTALL_CHUNK, {"stream": stream, "records": chunk}, timeout=None)
        except Exception as exc:
            raise self._named_failure(index, Message.INSTALL_CHUNK, exc) from None
