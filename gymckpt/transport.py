"""HTTP connections that hold at scale: bounded pools, idle timeouts below the servers' keep-alive, one resend.

Every client gymckpt makes (a server's downstream pool, the model server's backend clients,
the harness, the coordinator, the collector) comes from :func:`client_session`:

- **A bounded pool.** Every pool is bounded per host and in all (one socket, one
  descriptor each; more requests wait in the pool). A trainer-side client (the harness,
  the collector, the coordinator) may use the process's descriptors less
  :data:`DESCRIPTOR_RESERVE` (:func:`pool_limit`, at most :data:`MAX_POOL_LIMIT`): its
  concurrency is the number of rollouts in flight. A server's calls out stay few beside
  the calls coming in (:func:`downstream_pool_limit` per host: :data:`DOWNSTREAM_POOL_LIMIT`,
  at most an eighth of its descriptors), so an environment server can hold a trainer's
  16,000 ``/run`` calls while it calls the agent and the resources server on 1,024
  connections each. Those 1,024 are the server's: each of its N workers takes 1,024 / N,
  so running more workers does not multiply the load on the servers downstream.
  ``GYMCKPT_POOL_LIMIT`` sets both, per process (0: no limit).
- **Idle connections dropped before the server drops them.** A pooled connection idle for
  :func:`client_idle_seconds` is closed, well before the server's keep-alive
  (:func:`server_keep_alive`: ``GYMCKPT_KEEP_ALIVE``, else :data:`SERVER_KEEP_ALIVE_SECONDS`)
  and before uvicorn's stock 5 s, so a request never goes out on a connection the server
  is just closing. At most half the server's keep-alive: the margin covers the server's
  event loop running late under load.
- **One resend, where it is safe.** A request whose *reused* connection the server closed
  before any byte of the reply (:func:`dropped_connection`) is sent once more on another
  connection, when the caller says it is safe to send twice (:func:`request`, ``resend``;
  by default only ``GET``, ``HEAD`` and ``OPTIONS``). A fresh connection that drops, a
  refused connect, a timeout, or a reply cut after it began are never resent.

Every reply is read within a bound (:func:`read_bounded`): in pieces, stopping as soon as
it passes the bound (``Content-Length`` is checked first but never trusted alone, a chunked
reply has none), so a server that answers an endless body costs its caller one bound of
memory and fails that one call with :class:`~gymckpt.errors.ReplyTooLarge`. Control replies
have a bound per route (:data:`gymckpt.control.replies.CONTROL_REPLY_LIMITS`); data replies
one generous bound, :func:`data_reply_limit` (``GYMCKPT_MAX_REPLY_BYTES``). aiohttp decodes a
compressed reply piece by piece, each piece bounded, so the bound holds for decoded bytes.

What is safe to resend is the caller's knowledge: the control plane's calls are (prepare,
renew, commit, resume, restore, retire and forget repeated with the same body answer as the
first, SPEC C5-C10), a rollout's data call is not (a tool call would count twice, a
``/verify`` would find its session ended, ``/run`` would conflict with the run it started).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp

from gymckpt.errors import ReplyTooLarge

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from types import SimpleNamespace

__all__ = [
    "AWAITED_POOL_LIMIT",
    "CLIENT_IDLE_SECONDS",
    "DATA_REPLY_LIMIT",
    "DESCRIPTOR_RESERVE",
    "DOWNSTREAM_POOL_LIMIT",
    "KEEP_ALIVE_ENV",
    "LISTEN_BACKLOG",
    "MAX_POOL_LIMIT",
    "MIN_POOL_LIMIT",
    "POOL_LIMIT_ENV",
    "REPLY_LIMIT_ENV",
    "SAFE_METHODS",
    "SERVER_KEEP_ALIVE_SECONDS",
    "DescriptorBudget",
    "awaited_pool_limit",
    "client_idle_seconds",
    "client_session",
    "data_reply_limit",
    "descriptor_limits",
    "downstream_pool_limit",
    "dropped_connection",
    "pool_limit",
    "raise_descriptor_limit",
    "read_bounded",
    "read_bounded_json",
    "request",
    "server_keep_alive",
]

logger = logging.getLogger(__name__)

#: the variable that sets the reference servers' keep-alive (``--keep-alive``), in seconds
KEEP_ALIVE_ENV = "GYMCKPT_KEEP_ALIVE"
#: the variable that sets every pool's bound, per host and in all (0: no limit)
POOL_LIMIT_ENV = "GYMCKPT_POOL_LIMIT"
#: how long a reference server keeps an idle connection open (uvicorn's own default is 5 s);
#: longer than any common client's idle timeout (aiohttp 15 s, httpx 5 s), as proxies do
SERVER_KEEP_ALIVE_SECONDS = 75.0
#: the longest a client keeps an idle pooled connection: below uvicorn's stock 5 s keep-alive
CLIENT_IDLE_SECONDS = 4.0
#: the reference servers' listen backlog (the kernel caps it at ``net.core.somaxconn``)
LISTEN_BACKLOG = 16_384
#: descriptors kept aside for everything but pooled connections: files, pipes, logs, the store
DESCRIPTOR_RESERVE = 256
MIN_POOL_LIMIT = 64
#: a server's downstream pool per host: beyond a thousand connections two cores serve no more calls at once
DOWNSTREAM_POOL_LIMIT = 1024
#: one source address reaches one host:port through about 28,000 ephemeral ports at most
MAX_POOL_LIMIT = 16_384
#: methods sent once more without being told: they change nothing (RFC 9110 safe methods)
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: the variable that sets the bound of every data reply a gymckpt client reads, in bytes (a positive integer)
REPLY_LIMIT_ENV = "GYMCKPT_MAX_REPLY_BYTES"
#: a data reply's bound (a ``/run`` result, a model's or a tool's answer, the backend's call log):
#: generous, far above any reply of the reference stack, yet one bound of memory per call in flight
DATA_REPLY_LIMIT = 256 << 20
#: how much of a reply is read at a time: the most a bounded read holds past its bound
REPLY_PIECE_BYTES = 1 << 16


def _positive_float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, not {raw!r}")
    return value


def server_keep_alive() -> float:
    """The reference servers' keep-alive in seconds: ``GYMCKPT_KEEP_ALIVE``, else :data:`SERVER_KEEP_ALIVE_SECONDS`."""
    raw = os.environ.get(KEEP_ALIVE_ENV, "").strip()
    return _positive_float(KEEP_ALIVE_ENV, raw) if raw else SERVER_KEEP_ALIVE_SECONDS


def client_idle_seconds(keep_alive: float | None = None) -> float:
    """How long a pooled connection may idle: :data:`CLIENT_IDLE_SECONDS`, at most half the server's keep-alive."""
    return min(CLIENT_IDLE_SECONDS, (server_keep_alive() if keep_alive is None else keep_alive) / 2)


def descriptor_limits() -> tuple[int, int]:
    """This process's ``RLIMIT_NOFILE`` (soft, hard); -1 is unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, hard


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit where allowed; return (soft, hard) after.

    Child processes (a server's workers) inherit the raised limit.
    """
    soft, hard = descriptor_limits()
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:  # an unlimited hard limit, or a kernel ceiling below it
            logger.debug("could not raise the descriptor limit from %d to %d: %s", soft, hard, exc)
        soft, hard = descriptor_limits()
    return soft, hard


def _pool_limit_from_environment() -> int | None:
    raw = os.environ.get(POOL_LIMIT_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(f"{POOL_LIMIT_ENV} must be an integer >= 0 (0: no limit), not {raw!r}")
    return int(raw)


def _descriptors(descriptors: int | None) -> int:
    return descriptor_limits()[0] if descriptors is None else descriptors


def pool_limit(descriptors: int | None = None) -> int:
    """A trainer-side client's pool bound, per host and in all (0: no limit).

    ``GYMCKPT_POOL_LIMIT`` when set; else ``descriptors`` (default: this process's soft
    limit) less :data:`DESCRIPTOR_RESERVE`, clamped to [:data:`MIN_POOL_LIMIT`,
    :data:`MAX_POOL_LIMIT`].
    """
    configured = _pool_limit_from_environment()
    if configured is not None:
        return configured
    descriptors = _descriptors(descriptors)
    if descriptors < 0:  # RLIM_INFINITY
        return MAX_POOL_LIMIT
    return max(MIN_POOL_LIMIT, min(MAX_POOL_LIMIT, descriptors - DESCRIPTOR_RESERVE))


def downstream_pool_limit(descriptors: int | None = None, workers: int = 1) -> int:
    """One server process's downstream pool bound, per host and in all (0: no limit).

    ``GYMCKPT_POOL_LIMIT`` when set (per process); else :data:`DOWNSTREAM_POOL_LIMIT`, which
    is the whole server's: a server of several ``workers`` gives each its share (rounded up),
    so a downstream server gets as many calls at once from it whatever its worker count.
    At most an eighth of ``descriptors`` (default: this process's soft limit), at least
    :data:`MIN_POOL_LIMIT`.
    """
    configured = _pool_limit_from_environment()
    if configured is not None:
        return configured
    share = -(-DOWNSTREAM_POOL_LIMIT // max(workers, 1))
    descriptors = _descriptors(descriptors)
    if descriptors < 0:
        return max(MIN_POOL_LIMIT, share)
    return max(MIN_POOL_LIMIT, min(share, descriptors // 8))


#: the awaited lane's bound per host: the calls a checkpoint waits for (a wait step's), which are short
AWAITED_POOL_LIMIT = 128


def awaited_pool_limit(data_pool_limit: int) -> int:
    """The awaited lane's bound per host beside a data pool of ``data_pool_limit`` (0: no limit).

    The calls a checkpoint waits for go on a pool of their own, so they never queue behind
    the long calls it does not wait for (an agent's whole rollout holds a connection of the
    data pool for minutes): :data:`AWAITED_POOL_LIMIT`, never more than the data pool's bound.
    """
    return AWAITED_POOL_LIMIT if data_pool_limit == 0 else min(AWAITED_POOL_LIMIT, data_pool_limit)


@dataclass(frozen=True)
class DescriptorBudget:
    """What a server's descriptors leave for the connections coming in, by a simple stated model.

    Its ``outbound`` connections (its pools at their bounds; None: unbounded) and
    :data:`DESCRIPTOR_RESERVE` for files, pipes and logs are taken from ``limit``; what is
    left is :attr:`inbound`, the calls it can hold at once (for an environment server, the
    rollouts in flight). It fits when that is at least as many as it sends out.
    """

    limit: int
    hard_limit: int
    outbound: int | None
    reserve: int = DESCRIPTOR_RESERVE

    @property
    def inbound(self) -> int | None:
        """The connections left for callers (None: the pools are unbounded, or the limit is)."""
        if self.outbound is None or self.limit < 0:
            return None
        return self.limit - self.outbound - self.reserve

    @property
    def fits(self) -> bool:
        if self.outbound is None:
            return False
        inbound = self.inbound
        return inbound is None or inbound >= self.outbound


def _trace_config() -> aiohttp.TraceConfig:
    """Counts each request's connections and notes whether the last one was reused (see :func:`request`)."""
    config = aiohttp.TraceConfig()

    async def reused(session: aiohttp.ClientSession, context: SimpleNamespace, params: Any) -> None:
        attempt = context.trace_request_ctx
        if isinstance(attempt, _Attempt):
            attempt.connected(reused=True)

    async def created(session: aiohttp.ClientSession, context: SimpleNamespace, params: Any) -> None:
        attempt = context.trace_request_ctx
        if isinstance(attempt, _Attempt):
            attempt.connected(reused=False)

    config.on_connection_reuseconn.append(reused)
    config.on_connection_create_end.append(created)
    return config


class _Attempt:
    """One :func:`request`'s connections, as the trace config saw them."""

    __slots__ = ("connections", "on_connected", "reused")

    def __init__(self, on_connected: Callable[[], None] | None = None) -> None:
        self.connections = 0
        self.reused = False
        self.on_connected = on_connected

    def connected(self, *, reused: bool) -> None:
        self.connections += 1
        self.reused = reused
        if self.on_connected is not None:
            self.on_connected()


def client_session(
    *,
    limit: int | None = None,
    limit_per_host: int | None = None,
    idle_seconds: float | None = None,
    **session_options: Any,
) -> aiohttp.ClientSession:
    """A client session on a bounded pool whose idle connections close before the server closes them.

    ``limit`` and ``limit_per_host`` default to :func:`pool_limit` (0: no limit);
    ``idle_seconds`` to :func:`client_idle_seconds`. Other options go to
    :class:`aiohttp.ClientSession` (``timeout``, ``headers``, ``cookie_jar``, …). Send
    through :func:`request` to get the one resend.
    """
    default = pool_limit() if limit is None or limit_per_host is None else 0
    connector = aiohttp.TCPConnector(
        limit=default if limit is None else limit,
        limit_per_host=default if limit_per_host is None else limit_per_host,
        keepalive_timeout=client_idle_seconds() if idle_seconds is None else idle_seconds,
    )
    traces = [*session_options.pop("trace_configs", []), _trace_config()]
    return aiohttp.ClientSession(connector=connector, trace_configs=traces, **session_options)


def dropped_connection(exc: BaseException) -> bool:
    """True when the server closed the connection before any byte of the reply.

    ``ServerDisconnectedError``, a reset connection, or a write into a closed one
    (``ECONNRESET``, ``EPIPE``); never a refused connect (that connection never was).
    """
    if isinstance(exc, aiohttp.ClientConnectorError):
        return False
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientConnectionResetError):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and exc.errno in (errno.ECONNRESET, errno.EPIPE)


def data_reply_limit() -> int:
    """The bound of a data reply in bytes: ``GYMCKPT_MAX_REPLY_BYTES``, else :data:`DATA_REPLY_LIMIT`."""
    raw = os.environ.get(REPLY_LIMIT_ENV, "").strip()
    if not raw:
        return DATA_REPLY_LIMIT
    if not raw.isdigit() or int(raw) <= 0:
        raise ValueError(f"{REPLY_LIMIT_ENV} must be a positive number of bytes, not {raw!r}")
    return int(raw)


async def read_bounded(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The reply's body, read in pieces of :data:`REPLY_PIECE_BYTES`; past ``limit`` bytes, :class:`ReplyTooLarge`.

    A ``Content-Length`` above the bound is refused before any byte is read; a body that
    grows past it (chunked, or longer than it said) is refused once the bound is passed,
    having held at most one piece more. Either way the connection is closed, not reused.
    """
    if limit <= 0:
        raise ValueError(f"a reply bound must be positive, not {limit}")
    declared = response.content_length
    if declared is not None and declared > limit:
        _refuse(response, limit, 0, f"declares {declared} bytes")
    pieces: list[bytes] = []
    received = 0
    async for piece in response.content.iter_chunked(REPLY_PIECE_BYTES):
        received += len(piece)
        if received > limit:
            pieces.clear()
            _refuse(response, limit, received, "goes on")
        pieces.append(piece)
    return b"".join(pieces)


async def read_bounded_json(response: aiohttp.ClientResponse, limit: int) -> Any:
    """The reply's JSON within ``limit`` bytes (:func:`read_bounded`); an empty body is None, as aiohttp's ``json()``.

    A body that is not JSON raises ``ValueError``.
    """
    raw = await read_bounded(response, limit)
    return json.loads(raw) if raw.strip() else None


def _refuse(response: aiohttp.ClientResponse, limit: int, received: int, why: str) -> None:
    response.close()  # the rest of the body is never read: the connection cannot serve another request
    where = _where(str(response.url))
    raise ReplyTooLarge(
        f"{where} answered {response.status} with a reply that {why}: more than the {limit} bytes read of it",
        url=where,
        downstream_status=response.status,
        limit=limit,
        received=received,
    )


def _where(url: str) -> str:
    """``scheme://host:port/path`` of ``url``: no query, no credentials."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path}"


@asynccontextmanager
async def request(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    resend: bool | None = None,
    on_connected: Callable[[], None] | None = None,
    **options: Any,
) -> AsyncIterator[aiohttp.ClientResponse]:
    """``session.request(method, url, **options)`` as a context manager, sent once more where safe.

    When the connection the request went out on was a reused one and the server closed it
    before any byte of the reply (:func:`dropped_connection`), the request is sent once
    more, on another connection, if ``resend`` (default: the method is one of
    :data:`SAFE_METHODS`). Once in all: aiohttp sends a ``GET`` again by itself in that
    case, and then this does not. The resend is logged at INFO (method, host, path). A body
    must be bytes (or JSON), not a stream. Anything else is raised as aiohttp raised it.

    ``on_connected`` is called each time the request has its connection (from the pool or
    new), just before it is sent: a request still waiting for a free connection of a full
    pool has not been called back.
    """
    if resend is None:
        resend = method.upper() in SAFE_METHODS
    attempt = _Attempt(on_connected)
    try:
        response = await session.request(method, url, trace_request_ctx=attempt, **options)
    except aiohttp.ClientError as exc:
        if not (resend and attempt.reused and attempt.connections == 1 and dropped_connection(exc)):
            raise
        logger.info(
            "%s %s: the server closed the reused connection before replying (%s); sending it once more",
            method.upper(),
            _where(url),
            type(exc).__name__,
        )
        response = await session.request(method, url, trace_request_ctx=_Attempt(on_connected), **options)
    async with response:
        yield response
