"""A fault-injecting HTTP proxy on loopback, between an S3 client and moto's server.

Every request is forwarded unchanged unless a :class:`Fault` matches it (method, path
pattern, query parameters, a header), in which case the proxy

- ``status``: answers an S3 error (500, 503, 403…) without forwarding,
- ``drop``: closes the connection without forwarding,
- ``drop_response``: forwards, lets the server apply the request, then closes the
  connection instead of answering (the client never learns it succeeded).

It runs its own event loop on a thread; :attr:`FaultProxy.log` records what it did.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
from aiohttp import web

Action = Literal["status", "drop", "drop_response"]

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
    "content-length",
}

_ERROR_CODES = {403: "AccessDenied", 500: "InternalError", 503: "ServiceUnavailable"}


@dataclass
class Fault:
    """Which requests to fail and how. ``skip`` matches pass first; then ``times`` fail."""

    method: str
    path: str = ".*"  # a regular expression searched in the URL path
    query: tuple[str, ...] = ()  # query parameters that must be present
    header: str | None = None  # a request header that must be present
    action: Action = "status"
    status: int = 503
    times: int = 1
    skip: int = 0
    seen: int = 0
    fired: int = 0

    def matches(self, request: web.Request) -> bool:
        return (
            request.method == self.method
            and re.search(self.path, request.path) is not None
            and all(name in request.query for name in self.query)
            and (self.header is None or self.header in request.headers)
        )


@dataclass
class Entry:
    method: str
    path: str
    query: str
    action: str
    status: int | None = None


@dataclass
class FaultProxy:
    """``with FaultProxy(upstream) as proxy:`` then point the client at ``proxy.url``."""

    upstream: str
    faults: list[Fault] = field(default_factory=list)
    log: list[Entry] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, fault: Fault) -> Fault:
        """Arm ``fault``; returns it so a test can read ``fired`` afterwards."""
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()
            self.log.clear()

    def requests(self, method: str, *, query: str = "") -> list[Entry]:
        """Logged requests of ``method`` whose query holds ``query``."""
        with self._lock:
            return [entry for entry in self.log if entry.method == method and query in entry.query]

    def start(self) -> FaultProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def _start(self) -> None:
        logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def _match(self, request: web.Request) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.matches(request):
                    fault.seen += 1
                    if fault.seen > fault.skip and fault.fired < fault.times:
                        fault.fired += 1
                        return fault
        return None

    def _record(self, request: web.Request, action: str, status: int | None = None) -> None:
        with self._lock:
            self.log.append(Entry(request.method, request.path, request.query_string, action, status))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        fault = self._match(request)
        if fault is not None and fault.action == "status":
            self._record(request, "status", fault.status)
            code = _ERROR_CODES.get(fault.status, "InternalError")
            payload = (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>injected by the fault proxy</Message><RequestId>fault</RequestId></Error>"
            )
            return web.Response(status=fault.status, body=payload.encode(), content_type="application/xml")
        if fault is not None and fault.action == "drop":
            self._record(request, "drop")
            return self._drop(request)
        headers = {name: value for name, value in request.headers.items() if name.lower() not in _HOP_BY_HOP}
        assert self._session is not None
        async with self._session.request(
            request.method,
            f"{self.upstream}{request.rel_url}",
            headers=headers,
            data=body if body else None,
            allow_redirects=False,
        ) as upstream:
            payload = await upstream.read()
            if fault is not None and fault.action == "drop_response":
                self._record(request, "drop_response", upstream.status)
                return self._drop(request)
            self._record(request, "forward", upstream.status)
            reply = {name: value for name, value in upstream.headers.items() if name.lower() not in _HOP_BY_HOP}
            if request.method == "HEAD":  # no body, but the client reads the object's size from this
                if "Content-Length" in upstream.headers:
                    reply["Content-Length"] = upstream.headers["Content-Length"]
                return web.Response(status=upstream.status, headers=reply)
            return web.Response(status=upstream.status, headers=reply, body=payload)

    @staticmethod
    def _drop(request: web.Request) -> web.StreamResponse:
        transport = request.transport
        if transport is not None:
            transport.abort()  # no response at all: the client sees the connection reset
        raise ConnectionResetError("dropped by the fault proxy")
