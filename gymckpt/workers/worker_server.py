"""The coordinator's socket: :class:`WorkerServer` accepts a server's worker connections and runs their
forwarded control calls on the main process's control plane (:func:`dispatch_control`).

A control call's reply carries the seconds of the plane's steps (``export``, ``write``,
``read``, ``install``, …), so the worker's route logs the line a single-process server logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from gymckpt import telemetry
from gymckpt.errors import InvalidRequest
from gymckpt.workers import messages
from gymckpt.workers.channel import Channel
from gymckpt.workers.coordinator import CoordinatedParticipant
from gymckpt.workers.messages import CONTROL_OPERATIONS, Message
from gymckpt.workers.runtime import process_runtime_dir, restrict_socket, socket_path

if TYPE_CHECKING:
    from gymckpt.control.plane import ControlPlane

__all__ = ["WorkerServer", "dispatch_control"]


async def dispatch_control(plane: ControlPlane, operation: object, payload: object) -> Any:
    """Run one forwarded control call on ``plane``; its reply as JSON (errors raise as they are)."""
    spec = CONTROL_OPERATIONS.get(operation) if isinstance(operation, str) else None
    if spec is None:
        raise InvalidRequest(f"no control operation {operation!r}")
    if spec.request is None:
        if isinstance(plane.participant, CoordinatedParticipant):
            await plane.participant.refresh_status()
        return plane.status().model_dump(mode="json")
    try:
        request = spec.request.model_validate(payload)
    except ValidationError as exc:
        raise InvalidRequest(f"{operation}: {exc}"[:2000]) from exc
    participant = plane.participant
    if isinstance(participant, CoordinatedParticipant):
        participant.note_deadline(request.deadline_ts)
    reply = await getattr(plane, str(operation))(request)
    return reply.model_dump(mode="json")


class WorkerServer:
    """Accepts a server's worker connections on a Unix socket, on the event loop :meth:`start` runs on.

    ``path`` defaults to a fresh socket in this process's runtime directory, named after the kind.
    """

    def __init__(self, plane: ControlPlane, *, path: Path | str | None = None) -> None:
        if not isinstance(plane.participant, CoordinatedParticipant):
            raise TypeError("a WorkerServer serves the plane of a CoordinatedParticipant")
        self.plane = plane
        self.participant: CoordinatedParticipant = plane.participant
        self.path = None if path is None else Path(path)
        self._server: asyncio.AbstractServer | None = None
        self._indexes = itertools.count(1)
        self._channels: dict[int, Channel] = {}
        self._connections: set[asyncio.Task[Any]] = set()

    async def start(self) -> Path:
        """Listen (the socket is made 0600 at once); returns its path."""
        if self._server is not None:
            raise RuntimeError("this WorkerServer was started already")
        if self.path is None:
            self.path = socket_path(process_runtime_dir().path, self.participant.kind)
        self._server = await asyncio.start_unix_server(self._connected, path=os.fspath(self.path))
        restrict_socket(self.path)
        return self.path

    async def close(self) -> None:
        """Stop listening and end every worker's connection (each worker then takes its coordinator as lost)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        await asyncio.gather(*(channel.close() for channel in list(self._channels.values())), return_exceptions=True)
        await asyncio.gather(*self._connections, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), messages.MESSAGE_TIMEOUT_SECONDS)
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = next(self._indexes)
        participant = self.participant
        channel = Channel(reader, writer, name=f"{participant.kind} worker {index}")
        channel.handle_immediately(Message.REGISTER, lambda body: participant.register(index, channel, body))
        channel.handle_immediately(Message.REPORT, lambda body: participant.receive_report(index, body))
        channel.handle_immediately(Message.CLAIM, lambda body: participant.claim(index, body))
        channel.handle(Message.EXPORT_CHUNK, lambda body: participant.export_chunk(index, body))
        channel.handle(Message.CONTROL, self._control)
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        self._channels[index] = channel
        channel.start()
        try:
            await channel.closed.wait()
        finally:
            self._channels.pop(index, None)
            participant.leave(index)
            if task is not None:
                self._connections.discard(task)

    async def _control(self, body: object) -> dict[str, Any]:
        """``{reply, steps}``: the worker's route logs the plane's steps as a single-process server does."""
        fields = body if isinstance(body, dict) else {}
        with telemetry.continued(fields.get("trace")), telemetry.collected_steps() as steps:
            # the worker's SERVER span: the plane's steps join its trace
            reply = await dispatch_control(self.plane, fields.get("operation"), fields.get("body"))
        return {"reply": reply, "steps": dict(steps)}
