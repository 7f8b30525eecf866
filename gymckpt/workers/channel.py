"""A request/reply channel over one asyncio stream pair, in both directions.

Each message is one frame (:mod:`gymckpt.workers.frames`); each side numbers its own
requests from 1:

- request: ``{"id": n, "kind": str, "body": …}``
- reply: ``{"reply_to": n, "ok": true, "body": …}``, or
  ``{"reply_to": n, "ok": false, "error": {"status": int, "code": str, "detail": str}}``

A handler is registered per kind. An ordinary handler is awaited in a task of its own, so
replies may come back in any order. An immediate handler is a plain function called on the
reading loop before the next frame is read; its reply is written at once, so it precedes
anything this side sends later (a claim answered before a later ``close``).

Errors: a gymckpt error raised by a handler travels as its status, code and detail and is
raised on the caller's side as the class of that code (:func:`gymckpt.errors.error_for_code`;
an unknown code becomes a :class:`~gymckpt.errors.ControlError` carrying that code and
status). Any other exception is logged and travels as 500 ``checkpoint_error``; a reply that
cannot be framed (not JSON, too large) as 422 ``invalid_checkpoint_state``; an unknown kind
as 422 ``invalid_request``. A request that times out (sending included), cannot be sent, or
is pending when the connection ends raises :class:`~gymckpt.errors.CoordinatorUnavailable`.

Every frame is written with one ``write()``, so frames are whole and never interleave; the
write lock serializes the drains behind it. When the connection ends, :attr:`Channel.closed`
is set; handlers that are running finish, and their replies are dropped.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from gymckpt.errors import (
    ControlError,
    CoordinatorUnavailable,
    GymckptError,
    InvalidCheckpointState,
    InvalidRequest,
    error_for_code,
)
from gymckpt.workers.frames import ChannelClosed, FrameError, encode_frame, read_frame

__all__ = ["CLOSE_GRACE_SECONDS", "Channel", "Handler", "ImmediateHandler", "error_envelope", "remote_error"]

logger = logging.getLogger(__name__)

#: an ordinary handler: awaited with the request's body, returns the reply's body
Handler = Callable[[Any], Awaitable[Any]]
#: an immediate handler: called with the request's body on the reading loop, returns the reply's body
ImmediateHandler = Callable[[Any], Any]
#: how long :meth:`Channel.close` lets the last frames leave before it drops the connection, in seconds
CLOSE_GRACE_SECONDS = 1.0
#: longest error detail sent, in characters
MAX_DETAIL = 4000


def error_envelope(exc: BaseException, kind: str) -> dict[str, Any]:
    """The ``error`` of a reply for a handler of ``kind`` that raised ``exc``."""
    if isinstance(exc, GymckptError):
        return {"status": exc.status, "code": exc.code, "detail": str(exc)[:MAX_DETAIL]}
    logger.error("the handler of %r failed", kind, exc_info=exc)
    detail = f"{kind} failed: {type(exc).__name__}: {exc}"
    return {"status": 500, "code": ControlError.code, "detail": detail[:MAX_DETAIL]}


def remote_error(error: object) -> GymckptError:
    """The exception to raise for an error reply's ``error``: the class of its code, with its status."""
    fields = error if isinstance(error, dict) else {}
    code, status, detail = fields.get("code"), fields.get("status"), fields.get("detail")
    detail = detail if isinstance(detail, str) else f"a malformed error reply: {error!r}"[:MAX_DETAIL]
    cls = error_for_code(code) if isinstance(code, str) else None
    try:
        exc = cls(detail) if cls is not None else ControlError(detail)
    except TypeError:  # a class that needs more than a detail
        exc, cls = ControlError(detail), None
    if cls is None:
        exc.code = code if isinstance(code, str) and code else ControlError.code
        exc.status = 500
    if type(status) is int and status != exc.status:
        exc.status = status
    return exc


class Channel:
    """One side of a request/reply connection; ``name`` (the peer) appears in errors and logs."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, name: str = "peer") -> None:
        self.name = name
        #: why the connection ended, once it has
        self.close_reason: str | None = None
        self._reader = reader
        self._writer = writer
        self._handlers: dict[str, Handler] = {}
        self._immediate: dict[str, ImmediateHandler] = {}
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self._closed = asyncio.Event()
        self._reader_task: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()

    @property
    def closed(self) -> asyncio.Event:
        """Set once the connection has ended (either side closed it, or it broke)."""
        return self._closed

    def handle(self, kind: str, handler: Handler) -> None:
        """Answer requests of ``kind`` with ``await handler(body)``, each in a task of its own."""
        self._immediate.pop(kind, None)
        self._handlers[kind] = handler

    def handle_immediately(self, kind: str, handler: ImmediateHandler) -> None:
        """Answer requests of ``kind`` with ``handler(body)`` on the reading loop, before the next frame."""
        if inspect.iscoroutinefunction(handler):
            raise TypeError(f"the immediate handler of {kind!r} must be a plain function")
        self._handlers.pop(kind, None)
        self._immediate[kind] = handler

    def start(self) -> Channel:
        """Start reading (register the handlers first); returns the channel."""
        if self._reader_task is None:
            self._reader_task = asyncio.get_running_loop().create_task(self._read_loop(), name=f"channel {self.name}")
        return self

    async def request(
        self, kind: str, body: Any = None, timeout: float | None = None, blob: bytes | None = None
    ) -> Any:
        """Send a request and return the reply's body; ``timeout`` (seconds, None: none) covers the send too.

        ``blob``: bytes sent as they are beside ``body`` (an object); the handler finds them as its
        ``"blob"`` member (:mod:`gymckpt.workers.frames`).

        Raises the reply's error, :class:`CoordinatorUnavailable` on a timeout or a lost
        connection, and :class:`~gymckpt.workers.frames.FrameError` for a body that cannot be framed.
        """
        if self._closed.is_set():
            raise self._unavailable(f"cannot send {kind}: {self.close_reason}")
        request_id = next(self._ids)
        frame = encode_frame({"id": request_id, "kind": kind, "body": {} if body is None else body}, blob)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        scope = asyncio.timeout(timeout)
        try:
            async with scope:
                await self._send(frame)
                return await future
        except TimeoutError as exc:
            if scope.expired():
                raise self._unavailable(f"no reply to {kind} within {timeout} s") from exc
            raise  # a remote DeadlineExceeded
        except ChannelClosed as exc:
            raise self._unavailable(f"cannot send {kind}: {exc}") from exc
        finally:
            self._pending.pop(request_id, None)

    async def close(self) -> None:
        """Close the connection: pending requests fail with :class:`CoordinatorUnavailable`."""
        self._shutdown("closed by this side")
        reader = self._reader_task
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        try:
            await asyncio.wait_for(self._writer.wait_closed(), CLOSE_GRACE_SECONDS)
        except (TimeoutError, OSError):
            self._writer.transport.abort()

    def _unavailable(self, detail: str) -> CoordinatorUnavailable:
        return CoordinatorUnavailable(f"{self.name}: {detail}")

    async def _send(self, frame: bytes) -> None:
        async with self._write_lock:
            if self._closed.is_set():
                raise ChannelClosed(f"the channel is closed ({self.close_reason})")
            try:
                self._writer.write(frame)
                await self._writer.drain()
            except (OSError, RuntimeError) as exc:  # a reset, a broken pipe, a transport already closed
                raise ChannelClosed(f"the connection broke: {exc}") from exc

    async def _read_loop(self) -> None:
        reason, abort = "the connection ended", False
        try:
            while True:
                message = await read_frame(self._reader)
                if not self._dispatch(message):
                    reason, abort = "the peer sent a message that is neither a request nor a reply", True
                    logger.warning("%s: %s; closing", self.name, reason)
                    return
        except ChannelClosed as exc:
            reason = str(exc)
        except FrameError as exc:
            reason, abort = f"broken frame: {exc}", True
            logger.warning("%s: %s; closing", self.name, reason)
        except asyncio.CancelledError:
            reason = "closed by this side"
            raise
        except Exception as exc:
            reason, abort = f"reading failed: {exc!r}", True
            logger.exception("%s: reading failed; closing", self.name)
        finally:
            self._shutdown(reason, abort=abort)

    def _dispatch(self, message: object) -> bool:
        """Route one message; False for one that breaks the protocol."""
        if type(message) is not dict:
            return False
        if "reply_to" in message:
            return self._take_reply(message)
        request_id, kind = message.get("id"), message.get("kind")
        if type(request_id) is not int or type(kind) is not str:
            return False
        body = message.get("body")
        if kind in self._immediate:
            self._answer_now(request_id, kind, body)
        else:
            task = asyncio.get_running_loop().create_task(self._serve(request_id, kind, body))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)
        return True

    def _take_reply(self, message: dict[str, Any]) -> bool:
        reply_to = message["reply_to"]
        if type(reply_to) is not int:
            return False
        future = self._pending.get(reply_to)
        if future is None or future.done():
            logger.debug("%s: reply to request %d, which no longer waits", self.name, reply_to)
        elif message.get("ok") is True:
            future.set_result(message.get("body"))
        else:
            future.set_exception(remote_error(message.get("error")))
        return True

    def _answer_now(self, request_id: int, kind: str, body: Any) -> None:
        try:
            result = self._immediate[kind](body)
        except Exception as exc:
            frame = self._error_frame(request_id, kind, exc)
        else:
            frame = self._reply_frame(request_id, kind, result)
        if self._closed.is_set():
            return
        try:
            self._writer.write(frame)  # whole and at once: before anything this side sends later
        except (OSError, RuntimeError) as exc:
            logger.debug("%s: the reply to %s was not sent: %s", self.name, kind, exc)

    async def _serve(self, request_id: int, kind: str, body: Any) -> None:
        handler = self._handlers.get(kind)
        try:
            if handler is None:
                raise InvalidRequest(f"no handler for message kind {kind!r}")
            result = await handler(body)
        except Exception as exc:
            frame = self._error_frame(request_id, kind, exc)
        else:
            frame = self._reply_frame(request_id, kind, result)
        try:
            await self._send(frame)
        except ChannelClosed as exc:
            logger.debug("%s: the reply to %s was not sent: %s", self.name, kind, exc)

    def _reply_frame(self, request_id: int, kind: str, result: Any) -> bytes:
        try:
            return encode_frame({"reply_to": request_id, "ok": True, "body": result})
        except FrameError as exc:
            logger.warning("%s: the reply to %s cannot be framed: %s", self.name, kind, exc)
            refusal = InvalidCheckpointState(f"the reply to {kind} cannot be framed: {exc}")
            return self._error_frame(request_id, kind, refusal)

    def _error_frame(self, request_id: int, kind: str, exc: BaseException) -> bytes:
        error = error_envelope(exc, kind)
        try:
            return encode_frame({"reply_to": request_id, "ok": False, "error": error})
        except FrameError:  # a detail JSON cannot carry as it is
            error["detail"] = f"{kind} failed with {error['code']} (its detail cannot be framed)"
            return encode_frame({"reply_to": request_id, "ok": False, "error": error})

    def _shutdown(self, reason: str, *, abort: bool = False) -> None:
        if self._closed.is_set():
            return
        self.close_reason = reason
        self._closed.set()
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(self._unavailable(f"the connection ended: {reason}"))
        if abort:
            self._writer.transport.abort()
        else:
            self._writer.close()
