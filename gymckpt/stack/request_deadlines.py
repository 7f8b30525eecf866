"""Deadlines for what a client owes a server, and room for new connections when descriptors run short.

uvicorn closes a connection only when a keep-alive runs out after a response: a connection that
opened and sent half a request head, or that trickles its head or its body a byte at a time, is
held for ever, and enough of them take every descriptor the process has (new connections then
wait in the listen backlog, the Coordinator's status call among them). :class:`DeadlineProtocol`,
the HTTP protocol of every server ``gymckpt serve`` runs (:mod:`gymckpt.stack.serving`), bounds
what a client may hold:

- **Head.** A request's head (request line and headers) must be complete within
  ``GYMCKPT_HEADER_TIMEOUT`` seconds (default :data:`HEADER_TIMEOUT_SECONDS`) of its first byte,
  on a new connection as on a kept-alive one; otherwise the server answers 408
  ``request_timeout`` and closes. The time before that first byte is the keep-alive's
  (``GYMCKPT_KEEP_ALIVE``), never the head's: a client's event loop under load may take many
  seconds between its connect and its first write (a trainer opening thousands of ``/run``
  calls at once), and an idle pooled connection waits for its next request; counting either
  here cut legitimate calls by the thousand. A new connection that sends nothing within the
  keep-alive is closed without a reply, as a kept-alive idle one is; one that is merely idle
  is bounded by shedding too. (h11 bounds the head's size: past 16 KiB it is a 400.)
- **Body.** Only the client's slowness counts, never the app's: the body's clock runs from the
  end of the head until the body is complete, while the server waits for the client's bytes. It
  stops while reading is paused (uvicorn stops reading once 64 KiB the app has not taken are
  buffered: a parked ``/run`` that reads its body only after resume waits as long as it likes)
  and while the client waits for a ``100 Continue`` the app has not sent yet. On that clock,
  after a grace of ``GYMCKPT_BODY_GRACE`` seconds (default :data:`BODY_GRACE_SECONDS`), the body
  must keep an average of ``GYMCKPT_BODY_MIN_RATE`` bytes a second (default
  :data:`BODY_MIN_RATE`): the connection is closed once ``waited > grace + received / rate``,
  with a 408 when no reply has started (the app sees the client disconnect). This also bounds
  a body the server drains after an early reply (a 401 sent before the body was read).
- **Shedding.** A process may hold ``GYMCKPT_CONNECTION_BUDGET`` connections (``gymckpt serve``
  sets it to what its descriptor budget leaves for calls coming in,
  :func:`~gymckpt.stack.serving.check_descriptor_budget`; unset, the descriptor limit less
  :data:`~gymckpt.transport.DESCRIPTOR_RESERVE`). When a new connection would take it past
  that, the server closes connections that have no request in progress until it is back at
  the budget: first those with a head partway in, then new ones that sent nothing yet (each
  longest waiting first, never the newcomer); then kept-alive ones that have idled at least half the
  keep-alive (every :mod:`gymckpt.transport` client drops its side before that, so no active
  client's pooled connection is taken). Requests being served, parked calls among them, are
  never shed; when nothing else is left the server stays over its budget and says so. So a
  connection that sends its whole head at once, as every client does (the Coordinator's status
  call), is served however many slow or idle connections there are.
- **Told.** Every connection the server closes on its own (shed, a head or a body too slow, a
  new connection unused for the keep-alive), and every time it stays over its budget, is
  counted by reason; one WARNING line every 10 s at most says how many of each since the last
  line, and a timer writes the last counts, so none goes untold.

The protocol is uvicorn's h11 protocol with these timers added; it is given to uvicorn as a
class (``http=DeadlineProtocol``), so uvicorn never picks httptools for a server even where
httptools is installed (``http="auto"`` would): httptools' protocol has none of the deadlines.
The settings are read from the environment once per process, so the workers of
``gymckpt serve --workers N`` (separate processes) take the same.
"""

from __future__ import annotations

import logging
import os
import resource
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import h11
import orjson
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol

from gymckpt import telemetry
from gymckpt.errors import RequestTimeout
from gymckpt.transport import DESCRIPTOR_RESERVE, KEEP_ALIVE_ENV

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Mapping

    from uvicorn.server import ServerState

__all__ = [
    "BODY_GRACE_ENV",
    "BODY_GRACE_SECONDS",
    "BODY_MIN_RATE",
    "BODY_MIN_RATE_ENV",
    "CONNECTION_BUDGET_ENV",
    "HEADER_TIMEOUT_ENV",
    "HEADER_TIMEOUT_SECONDS",
    "DeadlineProtocol",
    "RequestDeadlines",
    "request_deadlines",
]

logger = logging.getLogger(__name__)

#: how long a client may take to send a request's head, in seconds
HEADER_TIMEOUT_SECONDS = 10.0
#: the variable that sets :data:`HEADER_TIMEOUT_SECONDS`
HEADER_TIMEOUT_ENV = "GYMCKPT_HEADER_TIMEOUT"
#: the seconds of waiting for a body before its rate counts
BODY_GRACE_SECONDS = 10.0
#: the variable that sets :data:`BODY_GRACE_SECONDS`
BODY_GRACE_ENV = "GYMCKPT_BODY_GRACE"
#: the average rate, in bytes a second, a body must keep after the grace (Apache's mod_reqtimeout has 500)
BODY_MIN_RATE = 1024.0
#: the variable that sets :data:`BODY_MIN_RATE`
BODY_MIN_RATE_ENV = "GYMCKPT_BODY_MIN_RATE"
#: the variable that sets how many connections a process holds before it sheds waiting ones
CONNECTION_BUDGET_ENV = "GYMCKPT_CONNECTION_BUDGET"
#: the least a derived connection budget is
MIN_CONNECTION_BUDGET = 64
#: at most one WARNING about the connections a server closed on its own per this many seconds
_REPORT_SECONDS = 10.0
#: the shortest wait before the body's clock is looked at again
_MIN_CHECK_SECONDS = 0.05


@dataclass(frozen=True)
class RequestDeadlines:
    """The deadlines of one process's connections (see the module's docstring for the rules)."""

    header_timeout: float = HEADER_TIMEOUT_SECONDS
    body_grace: float = BODY_GRACE_SECONDS
    body_min_rate: float = BODY_MIN_RATE
    #: the connections held before waiting ones are shed (None: never shed)
    connection_budget: int | None = None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> RequestDeadlines:
        """The ``GYMCKPT_HEADER_TIMEOUT``, ``…_BODY_GRACE``, ``…_BODY_MIN_RATE`` and ``…_CONNECTION_BUDGET``
        variables, else the defaults; ValueError naming a variable that is not a positive number."""
        environ = os.environ if environ is None else environ
        raw_budget = environ.get(CONNECTION_BUDGET_ENV, "").strip()
        if raw_budget and (not raw_budget.isdigit() or int(raw_budget) < 1):
            raise ValueError(f"{CONNECTION_BUDGET_ENV} must be a whole number >= 1, not {raw_budget!r}")
        return cls(
            header_timeout=_positive(environ, HEADER_TIMEOUT_ENV, HEADER_TIMEOUT_SECONDS),
            body_grace=_positive(environ, BODY_GRACE_ENV, BODY_GRACE_SECONDS),
            body_min_rate=_positive(environ, BODY_MIN_RATE_ENV, BODY_MIN_RATE),
            connection_budget=int(raw_budget) if raw_budget else default_connection_budget(),
        )


def _positive(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a positive number, not {raw!r}")
    return value


def default_connection_budget() -> int | None:
    """The descriptor limit less :data:`~gymckpt.transport.DESCRIPTOR_RESERVE` (None when unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 0 or soft == resource.RLIM_INFINITY:
        return None
    return max(MIN_CONNECTION_BUDGET, soft - DESCRIPTOR_RESERVE)


@cache
def request_deadlines() -> RequestDeadlines:
    """This process's deadlines, read from its environment once."""
    return RequestDeadlines.from_environment()


def _timeout_reply(detail: str) -> bytes:
    """A whole 408 reply that closes the connection, written below h11 (no request may have been parsed)."""
    body = orjson.dumps({"error": {"code": RequestTimeout.code, "detail": detail}})
    head = (
        f"HTTP/1.1 {RequestTimeout.status} Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


#: why a server closed a connection it was not asked to close, as its WARNING line says it
_REASONS = {
    "shed": f"shed at the connection budget ({CONNECTION_BUDGET_ENV}), no request in progress on them",
    "head": f"request head not complete in time ({HEADER_TIMEOUT_ENV})",
    "unused": f"new, sent no byte within the keep-alive ({KEEP_ALIVE_ENV})",
    "body": f"request body too slow ({BODY_MIN_RATE_ENV} after {BODY_GRACE_ENV})",
    "over": (
        f"NOT closed: over the connection budget ({CONNECTION_BUDGET_ENV}), yet every connection is serving a "
        "request or is a recently used kept-alive one (times a connection arrived past the budget)"
    ),
}


class _Closings:
    """The connections one server closed on its own, by reason: one WARNING line per
    :data:`_REPORT_SECONDS` at most, and none left untold (a timer writes what the last line did not)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.notes: dict[str, str] = {}
        self.logged_at = float("-inf")
        self.timer: asyncio.TimerHandle | None = None

    def add(self, reason: str, loop: asyncio.AbstractEventLoop, note: str = "", *, count: int = 1) -> None:
        """Count ``count`` closings for ``reason`` (``note``: the latest figures), logging now or by the timer."""
        self.counts[reason] = self.counts.get(reason, 0) + count
        if note:
            self.notes[reason] = note
        wait = self.logged_at + _REPORT_SECONDS - loop.time()
        if wait <= 0:
            self.report(loop)
        elif self.timer is None:
            self.timer = loop.call_later(wait, self.report, loop)

    def report(self, loop: asyncio.AbstractEventLoop) -> None:
        """Log what was closed since the last line (nothing when nothing was)."""
        self.timer = None
        if not self.counts:
            return
        told = "; ".join(
            f"{count} {_REASONS[reason]}" + (f" [{self.notes[reason]}]" if reason in self.notes else "")
            for reason, count in self.counts.items()
        )
        logger.warning("closed connections on the server's side: %s", told)
        self.counts.clear()
        self.notes.clear()
        self.logged_at = loop.time()


class _Waiting:
    """One server's connections with no request in progress, and the shedding of them.

    Three kinds, each longest waiting first: ``partial``, a head partway in (what a slow
    client attack looks like: every client writes its head at once); ``silent``, new
    connections with no byte yet (an idle attack, or a loaded client slow to write after its
    connect); ``idle``, kept-alive connections between requests, with when they went idle.
    Shedding takes partial ones first, then silent ones, then idle ones only once they have
    idled half the keep-alive (every client of :mod:`gymckpt.transport` has dropped its side
    by then, so no active client's pooled connection is taken); never a request in progress.
    """

    def __init__(self) -> None:
        self.partial: OrderedDict[DeadlineProtocol, None] = OrderedDict()
        self.silent: OrderedDict[DeadlineProtocol, None] = OrderedDict()
        self.idle: OrderedDict[DeadlineProtocol, float] = OrderedDict()
        #: connections shed and not gone yet (still in uvicorn's set of connections)
        self.closing: weakref.WeakSet[DeadlineProtocol] = weakref.WeakSet()
        self.closings = _Closings()

    def wait(self, connection: DeadlineProtocol, *, started: bool) -> None:
        """``connection`` has no whole head yet; ``started``: some of it came."""
        self.done(connection)
        (self.partial if started else self.silent)[connection] = None

    def go_idle(self, connection: DeadlineProtocol, since: float) -> None:
        self.done(connection)
        self.idle[connection] = since

    def done(self, connection: DeadlineProtocol) -> None:
        self.partial.pop(connection, None)
        self.silent.pop(connection, None)
        self.idle.pop(connection, None)

    def _victims(self, newcomer: DeadlineProtocol, excess: int) -> list[DeadlineProtocol]:
        victims: list[DeadlineProtocol] = []
        for kind in (self.partial, self.silent):
            for connection in kind:
                if len(victims) == excess:
                    return victims
                if connection is not newcomer:
                    victims.append(connection)
        idle_enough = newcomer.loop.time() - newcomer.timeout_keep_alive / 2
        for connection, since in self.idle.items():
            if since > idle_enough or len(victims) == excess:
                break  # the rest idled less: an active client may send its next request on them
            victims.append(connection)
        return victims

    def shed(self, newcomer: DeadlineProtocol, open_connections: int, budget: int) -> None:
        """Close waiting connections (never ``newcomer``) until at most ``budget`` stay open, or none may go."""
        excess = open_connections - len(self.closing) - budget
        if excess <= 0:
            return
        loop = newcomer.loop
        victims = self._victims(newcomer, excess)
        for victim in victims:
            self.done(victim)
            self.closing.add(victim)
            victim.close_shed()
        still_over = excess - len(victims)
        note = f"{open_connections - len(self.closing)} open, budget {budget}"
        if victims:
            self.closings.add("shed", loop, note, count=len(victims))
        if still_over > 0:
            self.closings.add("over", loop, note)


#: each server's (uvicorn's ServerState) waiting connections
_WAITING: weakref.WeakKeyDictionary[ServerState, _Waiting] = weakref.WeakKeyDictionary()


class _TimedFlow(FlowControl):
    """uvicorn's flow control, telling its connection when reading pauses or resumes (the body's clock)."""

    def __init__(self, transport: asyncio.Transport, connection: DeadlineProtocol) -> None:
        super().__init__(transport)
        self.connection = connection

    def pause_reading(self) -> None:
        super().pause_reading()
        self.connection.update_body_clock()

    def resume_reading(self) -> None:
        super().resume_reading()
        self.connection.update_body_clock()


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a head deadline, a body rate and shedding (the module's docstring)."""

    def __init__(
        self,
        config: Any,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.deadlines = request_deadlines()
        waiting = _WAITING.get(server_state)
        if waiting is None:
            waiting = _WAITING[server_state] = _Waiting()
        self.waiting = waiting
        self.head_timer: asyncio.TimerHandle | None = None
        #: False while no byte of the next request has come (the keep-alive's time, not the head's)
        self.head_clock = False
        self.seen_cycle: object = None
        # the body's clock: on while the server waits for the client's bytes
        self.in_body = False
        self.body_received = 0
        self.body_waited = 0.0
        self.body_running_since: float | None = None
        self.body_timer: asyncio.TimerHandle | None = None

    # --- uvicorn's protocol

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _TimedFlow(transport, self)
        # the head's clock starts with the first byte: a client's loop may take a while to write after its
        # connect (a loaded process); until then the connection is idle, for the keep-alive at most
        self._wait_for_head(started=False)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self._unused_expired)
        budget = self.deadlines.connection_budget
        if budget is not None and len(self.connections) > budget:
            self.waiting.shed(self, len(self.connections), budget)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_waiting()
        self._end_body()
        self.waiting.closing.discard(self)
        self._unset_keepalive_if_required()  # uvicorn cancels it only on a clean close
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.in_body:
            self.body_received += len(data)
        elif not self.head_clock and self.seen_cycle_done():
            self._wait_for_head(started=True)  # the first byte of a request: its head's clock starts
        super().data_received(data)
        self._after_events()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._after_events()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        # the connection becomes a websocket protocol's: nothing of it is this protocol's to time any more
        self._end_waiting()
        self._end_body()
        super().handle_websocket_upgrade(event)

    # --- the request's phases

    def seen_cycle_done(self) -> bool:
        """No request in progress: none yet, or the last one answered and its body read."""
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def _after_events(self) -> None:
        """After h11 handled what arrived (or a reply finished): which phase the connection is in now."""
        if self.transport is None or self.transport.is_closing():
            return
        if self.cycle is not None and self.cycle is not self.seen_cycle:
            self.seen_cycle = self.cycle  # a request's head is complete
            self._end_waiting()
            if self.conn.their_state is h11.SEND_BODY:
                self._start_body()
        if self.in_body and self.conn.their_state is not h11.SEND_BODY:
            self._end_body()
        elif self.in_body:
            self.update_body_clock()
        if not self.in_body and self.head_timer is None and self.seen_cycle_done():
            if self.conn.trailing_data[0]:
                self._wait_for_head(started=True)  # a part of the next head already buffered starts its clock
            elif self.cycle is not None:
                self._end_waiting()
                self.waiting.go_idle(self, self.loop.time())  # kept alive between requests

    def _wait_for_head(self, *, started: bool) -> None:
        """No whole head yet: among the first to shed when over budget, and the head timed once it has started."""
        self.waiting.wait(self, started=started)
        self.head_clock = started
        if started and self.head_timer is None:
            self.head_timer = self.loop.call_later(self.deadlines.header_timeout, self._head_expired)

    def _end_waiting(self) -> None:
        self.waiting.done(self)
        self.head_clock = False
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_expired(self) -> None:
        self.head_timer = None
        if self.transport.is_closing():
            return
        detail = f"the request head was not complete within {self.deadlines.header_timeout:g} s ({HEADER_TIMEOUT_ENV})"
        telemetry.refused(RequestTimeout.code)
        self.transport.write(_timeout_reply(detail))
        self.waiting.closings.add("head", self.loop)
        self.transport.close()

    def _unused_expired(self) -> None:
        """A new connection sent nothing for the keep-alive: closed as an idle kept-alive one is (no reply)."""
        self.timeout_keep_alive_task = None
        if self.transport.is_closing():
            return
        self._end_waiting()
        self.waiting.closings.add("unused", self.loop)
        self.transport.close()

    def close_shed(self) -> None:
        """Close this waiting connection to make room (no reply: no request of it is being served)."""
        self._end_waiting()
        if not self.transport.is_closing():
            self.transport.close()

    # --- the body's clock

    def _start_body(self) -> None:
        self.in_body = True
        self.body_received = 0
        self.body_waited = 0.0
        self.body_running_since = None
        self.update_body_clock()
        self._arm_body_check(self.deadlines.body_grace)

    def _end_body(self) -> None:
        self.in_body = False
        self.body_running_since = None
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None

    def _client_owes_bytes(self) -> bool:
        """Whether the server is waiting for the client: reading, and no ``100 Continue`` outstanding."""
        if not self.in_body or self.flow is None or self.flow.read_paused:
            return False
        cycle = self.cycle
        return cycle is None or cycle.response_started or not cycle.waiting_for_100_continue

    def update_body_clock(self) -> None:
        """Start or stop the body's clock as the server starts or stops waiting for the client."""
        if not self.in_body:
            return
        now = self.loop.time()
        running = self._client_owes_bytes()
        if self.body_running_since is not None and not running:
            self.body_waited += now - self.body_running_since
            self.body_running_since = None
        elif self.body_running_since is None and running:
            self.body_running_since = now

    def _waited(self) -> float:
        running = 0.0 if self.body_running_since is None else self.loop.time() - self.body_running_since
        return self.body_waited + running

    def _arm_body_check(self, delay: float) -> None:
        if self.body_timer is not None:
            self.body_timer.cancel()
        self.body_timer = self.loop.call_later(max(delay, _MIN_CHECK_SECONDS), self._check_body)

    def _check_body(self) -> None:
        self.body_timer = None
        if not self.in_body or self.transport.is_closing():
            return
        self.update_body_clock()
        allowed = self.deadlines.body_grace + self.body_received / self.deadlines.body_min_rate
        waited = self._waited()
        if waited <= allowed:
            # at the earliest, the clock reaches what is allowed now after the difference (it may be stopped)
            self._arm_body_check(allowed - waited if self.body_running_since is not None else self.deadlines.body_grace)
            return
        self._body_expired(waited)

    def _body_expired(self, waited: float) -> None:
        cycle = self.cycle
        self._end_body()
        if cycle is not None and not cycle.response_started:
            detail = (
                f"the request body came at less than {self.deadlines.body_min_rate:g} bytes/s "
                f"({BODY_MIN_RATE_ENV}) after a grace of {self.deadlines.body_grace:g} s ({BODY_GRACE_ENV})"
            )
            telemetry.refused(RequestTimeout.code)
            self.transport.write(_timeout_reply(detail))
        if cycle is not None and not cycle.response_complete:
            # the app sees the client gone: its receive() says disconnect, its send() is dropped
            cycle.disconnected = True
            cycle.message_event.set()
        self.waiting.closings.add("body", self.loop, f"the last after {waited:.1f} s")
        self.transport.close()
