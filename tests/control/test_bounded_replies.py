"""Every reply a gymckpt client reads is bounded (issue 24, item 6).

A server on 127.0.0.1 (aiohttp, in the test's loop) answers with an endless chunked body,
or declares a ``Content-Length`` beyond the bound. The Coordinator's discover reports that
server with :class:`~gymckpt.errors.ReplyTooLarge` while the other server of the fan-out is
found as usual; a server's downstream client (:class:`~gymckpt.servers.base.Downstream`)
fails that one call the same way. Memory is asserted through the bytes read: at most the
bound and one piece (:data:`~gymckpt.transport.REPLY_PIECE_BYTES`), and the endless server
stops sending soon after (its writes fail once the client dropped the connection).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
from aiohttp import web
from fastapi import FastAPI

from gymckpt import errors, transport
from gymckpt.control.coordination import Coordinator
from gymckpt.control.plane import ControlPlane
from gymckpt.control.replies import CONTROL_REPLY_LIMITS
from gymckpt.control.routes import CONTROL_PREFIX, install_control
from gymckpt.servers.base import Downstream
from gymckpt.testing.net import serve_in_loop
from gymckpt.testing.participant import FakeParticipant
from gymckpt.testing.time import bounded

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

TOKEN = "bounded-replies-token"
PIECE = b"[" + b"0," * (32 << 10)  # 64 KiB of a JSON array that never closes
#: the endless server gives up after this much: a client without a bound would read all of it
GIVE_UP_BYTES = 1 << 30
#: what the kernel's socket buffers and aiohttp's own may hold beyond what the client read
IN_FLIGHT_SLACK = 32 << 20


@dataclass
class Endless:
    """What the endless server saw: requests, and bytes it wrote before the client went away."""

    url: str = ""
    requests: int = 0
    sent: int = 0


@contextlib.asynccontextmanager
async def endless_server() -> AsyncIterator[Endless]:
    """``GET <control>/status`` and ``POST /data``: an endless chunked body; ``POST /declared``: a huge
    ``Content-Length`` and nothing after; ``POST /small``: ``{"ok": true}``."""
    seen = Endless()

    async def endless(request: web.Request) -> web.StreamResponse:
        seen.requests += 1
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        with contextlib.suppress(ConnectionError, RuntimeError):
            while seen.sent < GIVE_UP_BYTES:
                await response.write(PIECE)
                seen.sent += len(PIECE)
        return response

    async def declared(request: web.Request) -> web.StreamResponse:
        seen.requests += 1
        response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": str(1 << 40)})
        await response.prepare(request)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await response.write(PIECE)
        return response

    async def small(request: web.Request) -> web.Response:
        seen.requests += 1
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get(f"{CONTROL_PREFIX}/status", endless)
    app.router.add_post("/data", endless)
    app.router.add_post("/declared", declared)
    app.router.add_post("/small", small)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    seen.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        yield seen
    finally:
        await runner.cleanup()


def _participant_app(kind: str, instance: str) -> FastAPI:
    app = FastAPI()
    install_control(app, ControlPlane(FakeParticipant(kind, instance)), TOKEN)
    return app


def _within_bound(exc: errors.ReplyTooLarge, limit: int) -> None:
    assert exc.limit == limit
    assert limit < exc.received <= limit + transport.REPLY_PIECE_BYTES


async def test_discover_reports_a_server_whose_status_never_ends_and_finds_the_others() -> None:
    async with contextlib.AsyncExitStack() as stack:
        endless = await stack.enter_async_context(endless_server())
        good = await stack.enter_async_context(serve_in_loop(_participant_app("model", "model-0")))
        gym = await stack.enter_async_context(Coordinator([endless.url, good], token=TOKEN, probe_timeout=30.0))
        found = await bounded(gym.discover(), 60.0)
    assert [(info.url, info.kind) for info in found.participants] == [(good, "model")]
    assert list(found.problems) == [endless.url]
    cause = found.causes[endless.url]
    assert isinstance(cause, errors.ReplyTooLarge), repr(cause)
    _within_bound(cause, CONTROL_REPLY_LIMITS["status"])
    assert (cause.server, cause.http_status) == (endless.url, 200)  # type: ignore[attr-defined]
    assert endless.requests == 1  # a reply too large is no connection failure: not tried again
    assert endless.sent <= CONTROL_REPLY_LIMITS["status"] + IN_FLIGHT_SLACK


async def test_a_coordinator_reply_bound_can_be_set_per_route() -> None:
    async with (
        endless_server() as endless,
        Coordinator([endless.url], token=TOKEN, reply_limits={"status": 1 << 20}) as gym,
    ):
        with pytest.raises(errors.ReplyTooLarge) as raised:
            await bounded(gym.status(endless.url), 30.0)
    _within_bound(raised.value, 1 << 20)
    assert endless.sent <= (1 << 20) + IN_FLIGHT_SLACK
    with pytest.raises(ValueError, match="'status'"):
        Coordinator([endless.url], token=TOKEN, reply_limits={"status": 0})
    with pytest.raises(ValueError, match="'stats'"):
        Coordinator([endless.url], token=TOKEN, reply_limits={"stats": 1})


async def test_a_downstream_reply_that_never_ends_fails_that_call_only() -> None:
    limit = 2 << 20
    async with endless_server() as endless:
        downstream = Downstream(checkpointing=False, reply_limit=limit)
        try:
            with pytest.raises(errors.ReplyTooLarge) as raised:
                await bounded(downstream.post(endless.url, "/data", {"x": 1}), 30.0)
            with pytest.raises(errors.ReplyTooLarge) as declared:
                await bounded(downstream.post(endless.url, "/declared", {"x": 1}), 30.0)
            # the same client, the same server: the next call is answered (the dropped connection is not reused)
            reply, _ = await bounded(downstream.post(endless.url, "/small", {}), 30.0)
        finally:
            await downstream.close()
    assert isinstance(raised.value, errors.DownstreamError)  # what a server's caller handles as a downstream failure
    _within_bound(raised.value, limit)
    assert raised.value.downstream_status == 200
    assert endless.sent <= limit + IN_FLIGHT_SLACK
    assert (declared.value.received, declared.value.limit) == (0, limit)  # refused before a byte was read
    assert reply == {"ok": True}


def test_the_data_reply_bound_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(transport.REPLY_LIMIT_ENV, raising=False)
    assert transport.data_reply_limit() == transport.DATA_REPLY_LIMIT
    assert Downstream(checkpointing=False).reply_limit == transport.DATA_REPLY_LIMIT
    monkeypatch.setenv(transport.REPLY_LIMIT_ENV, "4096")
    assert transport.data_reply_limit() == 4096
    assert Downstream(checkpointing=False).reply_limit == 4096
    for wrong in ("0", "-1", "1e6", "lots"):
        monkeypatch.setenv(transport.REPLY_LIMIT_ENV, wrong)
        with pytest.raises(ValueError, match=transport.REPLY_LIMIT_ENV):
            transport.data_reply_limit()


def test_every_control_route_has_a_bound_large_enough_for_its_episodes() -> None:
    """16,000+ episodes of the longest capture keys fit every list a route may carry."""
    from gymckpt.control.coordination import RESENT_OPERATIONS
    from gymckpt.identity import MAX_ROLLOUT_ID_LENGTH

    assert set(CONTROL_REPLY_LIMITS) == RESENT_OPERATIONS  # every control route
    longest = '"' + "r" * MAX_ROLLOUT_ID_LENGTH + '-a99999999",'
    one_list = 16_384 * len(longest)
    assert CONTROL_REPLY_LIMITS["status"] > 4 * one_list
    assert CONTROL_REPLY_LIMITS["prepare"] > 2 * one_list
    for route in ("restore", "retire", "forget"):
        assert CONTROL_REPLY_LIMITS[route] > one_list
    assert CONTROL_REPLY_LIMITS["commit"] > (64 << 20) + 4 * one_list
