"""Session routing across the uvicorn workers of one server: every request reaches its session's owner.

A request may reach any worker, but a session (a resources server's tool session, an agent's
session) lives in the memory of one worker, its *owner*, named by the worker's routing id
(:func:`~gymckpt.workers.placement.is_routing_id`). Each worker also serves its app on a
private Unix socket ``<socket_dir>/<routing id>.sock`` (0600, :func:`serve_private_socket`);
:class:`SessionRouter`, the outermost middleware of a worker's app, forwards a request whose
session another worker owns there unchanged and streams the reply back unchanged.

The owner of a request, in order (:meth:`SessionRouter.owner_of`):

1. a request that arrived on a private socket (:data:`FORWARDED_SCOPE_KEY`) is handled where it is;
2. the signed session value (:class:`SessionSigner`): on ``/mcp`` paths the
   :data:`TOKEN_HEADER` first, elsewhere the :data:`COOKIE_NAME` cookie first (MCP clients
   send no cookies); a value that does not verify names no owner;
3. with neither cookie nor token, the :data:`OWNER_HEADER` when it holds a routing id;
4. still none: the owner placed for the rollout's capture key (``/ng-rollout/<key>/…``) by a restore;
5. an owner a restore moved is replaced by its alias (:class:`RoutingTables`).

A worker that handles a rollout request itself stamps the reply (``stamp=True``) with a
session value naming it, unless the request's cookie already names it. Forwarding failures
are gymckpt errors: 410 ``session_owner_gone`` (the owner's socket is missing or refuses) and
502 ``session_forward_failed`` (anything else); their details name an owner by its first
8 hex digits only and never carry a cookie value.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import io
import os
import secrets
from contextlib import asynccontextmanager
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import aiohttp
import uvicorn
from multidict import CIMultiDict
from starlette.requests import cookie_parser
from yarl import URL

from gymckpt.control.responses import error_response
from gymckpt.control.routes import is_control_path
from gymckpt.errors import GymckptError, InvalidRolloutId, SessionForwardFailed, SessionOwnerGone
from gymckpt.identity import ROLLOUT_PREFIX, split_rollout_path
from gymckpt.workers.placement import is_routing_id
from gymckpt.workers.runtime import MAX_SOCKET_PATH, InvalidSocketPath, restrict_socket

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, MutableMapping

    Scope = MutableMapping[str, Any]
    Message = MutableMapping[str, Any]
    Receive = Callable[[], Awaitable[Message]]
    Send = Callable[[Message], Awaitable[None]]
    ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

__all__ = [
    "COOKIE_NAME",
    "FORWARDED_SCOPE_KEY",
    "MIN_SECRET_BYTES",
    "OWNER_HEADER",
    "TOKEN_HEADER",
    "RoutingTables",
    "SessionRouter",
    "SessionSigner",
    "derive_secret",
    "serve_private_socket",
]

COOKIE_NAME = "gymckpt_session"
#: the same signed value as the cookie, for clients that send no cookies (MCP clients)
TOKEN_HEADER = "x-nemo-gym-session-token"
#: a request without a session may name the worker it wants (a routing id)
OWNER_HEADER = "x-ng-session-owner"
#: set on the scope of every request that arrived on a private socket (forwarded at most once)
FORWARDED_SCOPE_KEY = "gymckpt.session_forwarded"
#: the shortest secret :class:`SessionSigner` accepts
MIN_SECRET_BYTES = 16

_DERIVE_LABEL = b"gymckpt session routing"
_MAC_LABEL = b"gymckpt-session-v1\n"
#: a session value longer than this is refused unread (a cookie holds 4096 bytes at most)
_MAX_VALUE_CHARS = 4096
_COOKIE_ATTRIBUTES = "Path=/; HttpOnly; SameSite=Lax"
_REQUEST_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "upgrade", "expect"}
)
_REPLY_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding"})
_SKIP_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")
#: an idle forwarding connection is dropped well before the private server's keep-alive ends,
#: so a forwarded request never goes out on a connection the owner is just closing
_CLIENT_KEEPALIVE_SECONDS = 15.0
_PRIVATE_KEEPALIVE_SECONDS = 75.0
#: how long a private server waits for open connections when it stops
_PRIVATE_SHUTDOWN_SECONDS = 10.0


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes | None:
    """The bytes of unpadded urlsafe base64 ``text``; None unless ``text`` is its canonical form."""
    try:
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        return None
    return data if _b64encode(data) == text else None


class SessionSigner:
    """Signs and verifies session values: a cookie-safe ``<owner>.<session b64>.<HMAC-SHA256 b64>``."""

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, (bytes, bytearray)):
            raise TypeError(f"a session secret is bytes, not {type(secret).__name__}")
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a session secret needs at least {MIN_SECRET_BYTES} bytes, not {len(secret)}")
        self._secret = bytes(secret)

    def _mac(self, payload: str) -> str:
        return _b64encode(hmac.new(self._secret, _MAC_LABEL + payload.encode("ascii"), hashlib.sha256).digest())

    def sign(self, owner: str, session: str) -> str:
        """A signed value naming ``owner`` (a routing id) and ``session`` (a non-empty string)."""
        if not is_routing_id(owner):
            raise ValueError("a session owner must be a routing id (32 lowercase hex digits)")
        if not isinstance(session, str) or not session:
            raise ValueError("a session must be a non-empty string")
        payload = f"{owner}.{_b64encode(session.encode('utf-8'))}"
        return f"{payload}.{self._mac(payload)}"

    def verify(self, value: object) -> tuple[str, str] | None:
        """``(owner, session)`` of a value this signer signed; None for anything else (never raises)."""
        if not isinstance(value, str) or len(value) > _MAX_VALUE_CHARS or not value.isascii():
            return None
        parts = value.split(".")
        if len(parts) != 3:
            return None
        owner, encoded, mac = parts
        if not hmac.compare_digest(self._mac(f"{owner}.{encoded}").encode("ascii"), mac.encode("ascii")):
            return None
        data = _b64decode(encoded)
        if not is_routing_id(owner) or data is None:
            return None
        try:
            session = data.decode("utf-8")
        except UnicodeDecodeError:
            return None
        return (owner, session) if session else None


def derive_secret(token: str | None) -> bytes:
    """The routing secret: derived from ``token`` (the same after a restart), else 32 random bytes."""
    if token is None:
        return secrets.token_bytes(32)
    return hmac.new(token.encode("utf-8", "surrogatepass"), _DERIVE_LABEL, hashlib.sha256).digest()


class RoutingTables:
    """Per worker, replaced as a whole by the coordinator (after a restore, and when a worker registers).

    ``aliases``: old owner routing id → the live worker holding its sessions now.
    ``placements``: session key (capture key) → routing id, for restored sessions.
    """

    def __init__(self, aliases: Mapping[str, str] | None = None, placements: Mapping[str, str] | None = None) -> None:
        self._tables: tuple[Mapping[str, str], Mapping[str, str]] = (MappingProxyType({}), MappingProxyType({}))
        self.replace(aliases or {}, placements or {})

    @property
    def aliases(self) -> Mapping[str, str]:
        """Old owner → live owner (read-only)."""
        return self._tables[0]

    @property
    def placements(self) -> Mapping[str, str]:
        """Capture key → owner (read-only)."""
        return self._tables[1]

    def snapshot(self) -> tuple[Mapping[str, str], Mapping[str, str]]:
        """``(aliases, placements)`` of one generation: both from the same :meth:`replace`."""
        return self._tables

    def replace(self, aliases: Mapping[str, str], placements: Mapping[str, str]) -> None:
        """Swap both tables for copies of these at once; ValueError unless every owner is a routing id."""
        new_aliases = dict(aliases)
        new_placements = dict(placements)
        if not all(is_routing_id(old) and is_routing_id(new) for old, new in new_aliases.items()):
            raise ValueError("session aliases map routing ids to routing ids")
        if not all(isinstance(key, str) and is_routing_id(owner) for key, owner in new_placements.items()):
            raise ValueError("session placements map session keys to routing ids")
        self._tables = (MappingProxyType(new_aliases), MappingProxyType(new_placements))


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The first value of header ``name`` (lowercase), stripped; None when absent."""
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return None


def _cookie(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The :data:`COOKIE_NAME` cookie of a request's Cookie headers; None when absent."""
    lines = [value.decode("latin-1") for key, value in headers if key.lower() == b"cookie"]
    return cookie_parser("; ".join(lines)).get(COOKIE_NAME) if lines else None


def _capture_key(path: str) -> str | None:
    """The capture key of a rollout path; None for another path or an invalid one."""
    if not path.startswith(ROLLOUT_PREFIX):
        return None
    try:
        episode, _ = split_rollout_path(path)
    except InvalidRolloutId:
        return None
    return None if episode is None else episode.capture_key


def _is_mcp(path: str) -> bool:
    return path == "/mcp" or path.startswith("/mcp/")


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body; None when the client disconnected first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        if message["type"] == "http.request":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)


async def _wait_disconnect(receive: Receive) -> None:
    """Return once the client has gone (after the body, nothing else comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _target(scope: Scope) -> URL:
    """``http://localhost`` + the request's raw path and query string, kept encoded."""
    raw_path = scope.get("raw_path") or scope["path"].encode("utf-8")
    query = scope.get("query_string", b"")
    target = raw_path + (b"?" + query if query else b"")
    return URL("http://localhost" + target.decode("latin-1"), encoded=True)


def _forwarded_headers(scope: Scope) -> CIMultiDict[str]:
    return CIMultiDict(
        (key.decode("latin-1"), value.decode("latin-1"))
        for key, value in scope.get("headers", [])
        if key.decode("latin-1").lower() not in _REQUEST_HOP_BY_HOP
    )


class SessionRouter:
    """ASGI middleware, outermost on a worker's app: forwards each request to its session's owner.

    ``stamp``: add a session value naming this worker to the replies of rollout requests it
    handles (on servers whose sessions span requests).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        routing_id: str,
        socket_dir: str | Path,
        signer: SessionSigner,
        tables: RoutingTables,
        stamp: bool,
    ) -> None:
        if not is_routing_id(routing_id):
            raise ValueError("a worker's routing id is 32 lowercase hex digits")
        self.app = app
        self.routing_id = routing_id
        self.socket_dir = Path(socket_dir)
        self.signer = signer
        self.tables = tables
        self.stamp = stamp
        own = self.socket_path(routing_id)
        if len(os.fsencode(own)) > MAX_SOCKET_PATH:
            raise InvalidSocketPath(f"socket path {own} is longer than {MAX_SOCKET_PATH} bytes")
        self._clients: dict[str, aiohttp.ClientSession] = {}

    def socket_path(self, owner: str) -> Path:
        """The private socket of worker ``owner``."""
        return self.socket_dir / f"{owner}.sock"

    def owner_of(self, scope: Scope) -> str | None:
        """The routing id of the worker that should handle this request; None: this one, no session."""
        path = scope.get("path", "")
        # a control call is never forwarded: its route checks the token before reading the body, and a
        # worker's plane passes it to the coordinator anyway (forwarding would buffer an unauthenticated body)
        if scope.get(FORWARDED_SCOPE_KEY) or is_control_path(path):
            return None
        headers = scope.get("headers", [])
        cookie = _cookie(headers)
        token = _header(headers, TOKEN_HEADER.encode("ascii"))
        owner: str | None = None
        if cookie is not None or token is not None:
            first, second = (token, cookie) if _is_mcp(path) else (cookie, token)
            verified = self.signer.verify(first if first is not None else second)
            owner = verified[0] if verified else None
        else:
            named = _header(headers, OWNER_HEADER.encode("ascii"))
            owner = named if is_routing_id(named) else None
        aliases, placements = self.tables.snapshot()
        if owner is None:
            key = _capture_key(path)
            owner = placements.get(key) if key is not None else None
        return aliases.get(owner, owner) if owner is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        owner = self.owner_of(scope)
        if owner is not None and owner != self.routing_id:
            await self._forward(owner, scope, receive, send)
            return
        await self.app(scope, receive, self._stamping(scope, send))

    def _stamping(self, scope: Scope, send: Send) -> Send:
        """``send``, adding a session value naming this worker to the reply when one is due."""
        key = _capture_key(scope.get("path", ""))
        if not self.stamp or key is None:
            return send
        verified = self.signer.verify(_cookie(scope.get("headers", [])))
        if verified is not None and verified[0] == self.routing_id:
            return send
        value = self.signer.sign(self.routing_id, key).encode("ascii")
        stamps = [
            (b"set-cookie", f"{COOKIE_NAME}=".encode("ascii") + value + b"; " + _COOKIE_ATTRIBUTES.encode("ascii")),
            (TOKEN_HEADER.encode("ascii"), value),
        ]

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *stamps]}
            await send(message)

        return stamped

    def _client(self, owner: str) -> aiohttp.ClientSession:
        client = self._clients.get(owner)
        if client is None or client.closed:
            connector = aiohttp.UnixConnector(
                path=os.fspath(self.socket_path(owner)), limit=0, keepalive_timeout=_CLIENT_KEEPALIVE_SECONDS
            )
            client = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None),
            )
            self._clients[owner] = client
        return client

    async def _drop(self, owner: str, client: aiohttp.ClientSession) -> None:
        if self._clients.get(owner) is client:
            del self._clients[owner]
        await client.close()

    async def close(self) -> None:
        """Close the forwarding clients (a later forward opens new ones)."""
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()

    async def _forward(self, owner: str, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the request to ``owner``'s socket and its reply back; stop when the client goes."""
        body = await _read_body(receive)
        if body is None:
            return
        relay = asyncio.ensure_future(self._relay(owner, scope, body, send))
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        client_gone = False
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
            client_gone = gone.done()
        finally:
            for task in (gone, relay):
                if not task.done():
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({task})
        # a failure after the reply started raises here: the client's connection is cut
        error = None if relay.cancelled() else relay.result()
        if error is not None and not client_gone:
            await error_response(error)(scope, receive, send)

    async def _relay(self, owner: str, scope: Scope, body: bytes, send: Send) -> GymckptError | None:
        """Relay the owner's reply to ``send``; the error to answer instead when none came."""
        client = self._client(owner)
        started = False
        try:
            async with client.request(
                scope["method"],
                _target(scope),
                headers=_forwarded_headers(scope),
                data=io.BytesIO(body) if body else None,  # a stream: aiohttp warns of big bytes
                allow_redirects=False,
                skip_auto_headers=_SKIP_AUTO_HEADERS,
            ) as answer:
                headers = [(key, value) for key, value in answer.raw_headers if key.lower() not in _REPLY_HOP_BY_HOP]
                await send({"type": "http.response.start", "status": answer.status, "headers": headers})
                started = True
                async for chunk in answer.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            return None
        except aiohttp.ClientConnectorError:
            if started:
                raise
            await self._drop(owner, client)
            return SessionOwnerGone(
                f"the worker {owner[:8]} that held this session is gone, and its session state with it; "
                "start a new session"
            )
        except aiohttp.ClientError as exc:
            if started:
                raise
            return SessionForwardFailed(
                f"the worker {owner[:8]} that owns this session did not answer ({type(exc).__name__})"
            )


class _MarkForwarded:
    """Marks each http scope as forwarded (:data:`FORWARDED_SCOPE_KEY`) before ``app`` sees it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope = {**scope, FORWARDED_SCOPE_KEY: True}
        await self.app(scope, receive, send)


@asynccontextmanager
async def serve_private_socket(app: ASGIApp, path: str | Path) -> AsyncIterator[None]:
    """Serve ``app`` on the Unix socket ``path`` (0600) in this event loop, for requests other workers forward.

    Every http request it serves is marked forwarded. No signal handlers are installed (the
    worker's own server has them); on exit the server stops and the socket file is removed.
    """
    path = Path(path)
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise InvalidSocketPath(f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes")
    config = uvicorn.Config(
        _MarkForwarded(app),
        uds=os.fspath(path),
        lifespan="off",
        server_header=False,
        date_header=False,
        access_log=False,
        log_level="warning",
        log_config=None,  # the worker's own server configured logging already
        timeout_keep_alive=_PRIVATE_KEEPALIVE_SECONDS,
        timeout_graceful_shutdown=_PRIVATE_SHUTDOWN_SECONDS,
    )
    server = uvicorn.Server(config)
    config.load()
    server.lifespan = config.lifespan_class(config)
    await server.startup()
    try:
        restrict_socket(path)
        yield
    finally:
        try:
            await server.shutdown()
        finally:
            path.unlink(missing_ok=True)
