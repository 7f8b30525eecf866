"""Connections that hold at scale: one resend where safe, bounded pools, idle timeouts, the descriptor budget.

The server is uvicorn on loopback in a thread of its own, with a 1 s keep-alive. The
keep-alive race is made certain: the client's event loop is held (as a loaded one is)
until the server has closed the idle connection, so the client does not know yet and
sends its next request on that connection.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from gymckpt import transport
from gymckpt.control.coordination import Coordinator
from gymckpt.control.routes import CONTROL_PREFIX
from gymckpt.errors import DownstreamError, SettingsError
from gymckpt.servers.base import Downstream, server_workers
from gymckpt.servers.environment import EnvironmentConfig
from gymckpt.stack.serving import check_descriptor_budget
from gymckpt.workers.process import ENV_RUNTIME, ENV_WORKERS

if TYPE_CHECKING:
    from collections.abc import Iterator

HOST = "127.0.0.1"
KEEP_ALIVE = 1.0
#: the most any wait for the server here may take
DEADLINE = 15.0


class ServerSide:
    """What the server saw: requests by path, connections opened and closed, requests held open."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.opened = 0
        self.closed = 0
        self.active = 0
        self.peak = 0
        self.changed = threading.Condition()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.release: asyncio.Event | None = None

    def note(self, **changes: int) -> None:
        with self.changed:
            for name, delta in changes.items():
                setattr(self, name, getattr(self, name) + delta)
            self.peak = max(self.peak, self.active)
            self.changed.notify_all()

    def wait_for(self, condition: Any) -> bool:
        """Block this thread until ``condition()`` holds (False after :data:`DEADLINE`)."""
        with self.changed:
            return self.changed.wait_for(condition, timeout=DEADLINE)

    def let_go(self) -> None:
        """Answer every request held at ``/hold``."""
        assert self.loop is not None and self.release is not None
        self.loop.call_soon_threadsafe(self.release.set)

    async def app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        path = scope["path"]
        with self.changed:
            self.hits[path] += 1
            self.changed.notify_all()
        if path == "/hold":
            assert self.release is not None
            self.note(active=1)
            await self.release.wait()
            self.note(active=-1)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"ok": true}'})


@contextmanager
def served(keep_alive: float = KEEP_ALIVE) -> Iterator[tuple[str, ServerSide]]:
    """uvicorn with ``keep_alive`` on a loopback port, in a thread; its URL and what it saw."""
    side = ServerSide()

    class Counted(H11Protocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            side.note(opened=1)

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            side.note(closed=1)

    sock = socket.create_server((HOST, 0))
    config = uvicorn.Config(
        side.app,
        http=Counted,
        interface="asgi3",
        lifespan="off",
        log_level="warning",
        timeout_keep_alive=keep_alive,  # type: ignore[arg-type]
    )
    server = uvicorn.Server(config)

    async def main() -> None:
        side.loop = asyncio.get_running_loop()
        side.release = asyncio.Event()
        await server.serve(sockets=[sock])

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    try:
        yield f"http://{HOST}:{sock.getsockname()[1]}", side
    finally:
        server.should_exit = True
        if side.release is not None:
            side.let_go()
        thread.join(timeout=DEADLINE)
        sock.close()


def hold_until_closed(side: ServerSide, count: int) -> None:
    """Keep the calling event loop busy until the server closed ``count`` connections (it cannot see the FIN)."""
    assert side.wait_for(lambda: side.closed >= count), f"the server closed {side.closed} of {count} connections"


@pytest.fixture(autouse=True)
def _no_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(transport.KEEP_ALIVE_ENV, raising=False)
    monkeypatch.delenv(transport.POOL_LIMIT_ENV, raising=False)


# --- one resend, where it is safe


def test_a_safe_post_on_a_connection_the_server_closed_is_sent_once_more(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(url: str, side: ServerSide) -> dict[str, Any]:
        downstream = Downstream(checkpointing=False)  # idle 4 s: longer than this server's 1 s keep-alive
        try:
            await downstream.post(url, "/first", {})
            hold_until_closed(side, 1)
            reply, _ = await downstream.post(url, "/second", {"n": 1}, resend=True)
            return reply
        finally:
            await downstream.close()

    with served() as (url, side), caplog.at_level(logging.INFO, logger="gymckpt.transport"):
        reply = asyncio.run(scenario(url, side))
    assert reply == {"ok": True}
    assert side.hits == Counter({"/first": 1, "/second": 1})  # once on the server, not twice
    assert side.opened == 2  # the resend went out on a new connection
    resent = [record.getMessage() for record in caplog.records if "once more" in record.getMessage()]
    assert len(resent) == 1 and resent[0].startswith(f"POST {url}/second: the server closed the reused connection")


def test_a_post_not_safe_to_resend_fails_typed_and_never_reaches_the_server(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario(url: str, side: ServerSide) -> DownstreamError:
        downstream = Downstream(checkpointing=False)
        try:
            await downstream.post(url, "/first", {})
            hold_until_closed(side, 1)
            with pytest.raises(DownstreamError) as caught:
                await downstream.post(url, "/increment", {"n": 1})  # a rollout step: never sent twice
            return caught.value
        finally:
            await downstream.close()

    with served() as (url, side), caplog.at_level(logging.INFO, logger="gymckpt.transport"):
        error = asyncio.run(scenario(url, side))
    assert transport.dropped_connection(error.__cause__)  # type: ignore[arg-type]
    assert error.url == f"{url}/increment" and error.downstream_status == 0
    assert "gave no reply" in str(error)
    assert side.hits == Counter({"/first": 1})
    assert not [record for record in caplog.records if "once more" in record.getMessage()]


def test_an_idle_timeout_below_the_keep_alive_never_sends_on_a_closing_connection(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(transport.KEEP_ALIVE_ENV, str(KEEP_ALIVE))  # as `--keep-alive 1` sets it for the stack

    async def scenario(url: str, side: ServerSide) -> dict[str, Any]:
        downstream = Downstream(checkpointing=False)
        try:
            await downstream.post(url, "/first", {})
            hold_until_closed(side, 1)
            reply, _ = await downstream.post(url, "/increment", {"n": 1})  # not resendable, and no need
            return reply
        finally:
            await downstream.close()

    assert transport.client_idle_seconds() == KEEP_ALIVE / 2
    with served() as (url, side), caplog.at_level(logging.INFO, logger="gymckpt.transport"):
        reply = asyncio.run(scenario(url, side))
    assert reply == {"ok": True}
    assert side.hits == Counter({"/first": 1, "/increment": 1})
    assert not [record for record in caplog.records if "once more" in record.getMessage()]


def test_a_get_is_sent_again_once_in_all() -> None:
    """aiohttp sends a GET again by itself after a dropped reused connection; the helper adds no second resend."""

    async def scenario(url: str, side: ServerSide) -> int:
        async with transport.client_session(idle_seconds=30.0) as session:
            async with transport.request(session, "GET", f"{url}/first") as response:
                await response.read()
            hold_until_closed(side, 1)
            async with transport.request(session, "GET", f"{url}/status") as response:
                await response.read()
                return response.status

    with served() as (url, side):
        status = asyncio.run(scenario(url, side))
    assert status == 200
    assert side.hits == Counter({"/first": 1, "/status": 1})


def test_a_control_call_on_a_connection_the_server_closed_is_sent_once_more() -> None:
    path = f"{CONTROL_PREFIX}/commit"

    async def scenario(url: str, side: ServerSide) -> dict[str, Any]:
        async with Coordinator([url], token="t") as gym:
            await gym._call(url, "commit", b"{}", timeout=DEADLINE)
            hold_until_closed(side, 1)
            return await gym._call(url, "commit", b"{}", timeout=DEADLINE)

    with served() as (url, side):
        reply = asyncio.run(scenario(url, side))
    assert reply == {"ok": True}
    assert side.hits == Counter({path: 2})  # the first call and the second, each once
    assert side.opened == 2


def test_dropped_connection_is_a_closed_connection_not_a_refused_one() -> None:
    closed = socket.create_server((HOST, 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now

    async def refused() -> BaseException:
        async with transport.client_session() as session:
            with pytest.raises(aiohttp.ClientConnectorError) as caught:
                async with transport.request(session, "POST", f"http://{HOST}:{port}/x", resend=True):
                    pass
            return caught.value

    assert not transport.dropped_connection(asyncio.run(refused()))
    assert transport.dropped_connection(aiohttp.ServerDisconnectedError())
    assert transport.dropped_connection(aiohttp.ClientOSError(104, "reset"))
    assert transport.dropped_connection(aiohttp.ClientOSError(32, "broken pipe"))
    assert not transport.dropped_connection(aiohttp.ClientOSError(110, "timed out"))
    assert not transport.dropped_connection(aiohttp.ClientPayloadError("cut"))


# --- a bounded pool per host


def test_the_pool_bounds_the_connections_to_one_host() -> None:
    limit, calls = 3, 8

    async def scenario(url: str, side: ServerSide) -> list[int]:
        queued = 0
        trace = aiohttp.TraceConfig()

        async def on_queued(*_: Any) -> None:
            nonlocal queued
            queued += 1

        trace.on_connection_queued_start.append(on_queued)
        async with transport.client_session(limit_per_host=limit, trace_configs=[trace]) as session:

            async def hold() -> int:
                async with transport.request(session, "POST", f"{url}/hold", data=b"{}") as response:
                    await response.read()
                    return response.status

            tasks = [asyncio.create_task(hold()) for _ in range(calls)]
            give_up = time.monotonic() + DEADLINE
            while not (side.active == limit and queued == calls - limit) and time.monotonic() < give_up:
                await asyncio.wait(tasks, timeout=0.01)
            assert (side.active, queued) == (limit, calls - limit)
            side.let_go()
            return list(await asyncio.gather(*tasks))

    with served(keep_alive=30.0) as (url, side):
        statuses = asyncio.run(scenario(url, side))
    assert statuses == [200] * calls
    assert side.peak == limit
    assert side.opened == limit  # the queued calls went out on the same connections
    assert side.hits["/hold"] == calls


def test_a_call_a_checkpoint_waits_for_never_queues_behind_the_long_calls_to_its_host() -> None:
    async def scenario(url: str, side: ServerSide) -> tuple[int, int, list[dict[str, Any]]]:
        downstream = Downstream(checkpointing=False, connector_limit_per_host=1)
        try:
            long = asyncio.create_task(downstream.post(url, "/hold", {}))
            give_up = time.monotonic() + DEADLINE
            while side.active < 1 and time.monotonic() < give_up:
                await asyncio.wait([long], timeout=0.01)
            assert side.active == 1  # the data pool's one connection is held
            queued = asyncio.create_task(downstream.post(url, "/queued", {}))
            awaited, _ = await asyncio.wait_for(downstream.post(url, "/awaited", {}, awaited=True), DEADLINE)
            seen = (side.hits["/awaited"], side.hits["/queued"])  # the data pool's call is still waiting
            side.let_go()
            replies = [awaited, *(reply for reply, _ in await asyncio.gather(long, queued))]
            return *seen, replies
        finally:
            await downstream.close()

    with served(keep_alive=30.0) as (url, side):
        awaited_hits, queued_hits, replies = asyncio.run(scenario(url, side))
    assert (awaited_hits, queued_hits) == (1, 0)
    assert replies == [{"ok": True}] * 3
    assert side.hits["/queued"] == 1


def test_a_shared_pool_bounds_the_calls_in_use_not_the_idle_connections_kept_for_another_host() -> None:
    """Why a server may give another its own pool: aiohttp's bound in all leaves idle connections out."""

    async def scenario(first: str, second: str, side: ServerSide) -> None:
        downstream = Downstream(checkpointing=False, connector_limit=2, connector_limit_per_host=2)
        try:
            await asyncio.gather(*(downstream.post(second, "/quick", {}) for _ in range(2)))
            held = [asyncio.create_task(downstream.post(first, "/hold", {})) for _ in range(2)]
            give_up = time.monotonic() + DEADLINE
            while side.active < 2 and time.monotonic() < give_up:
                await asyncio.wait(held, timeout=0.01)
            assert side.active == 2  # both went out: the two idle connections to the other host were not counted
            side.let_go()
            await asyncio.gather(*held)
        finally:
            await downstream.close()

    with served(keep_alive=30.0) as (first, side), served(keep_alive=30.0) as (second, other):
        asyncio.run(scenario(first, second, side))
        assert other.opened == 2 and side.opened == 2  # four connections open at once under a bound of two


def test_a_server_with_a_bound_of_its_own_gets_a_pool_of_its_own() -> None:
    async def scenario(first: str, second: str, side: ServerSide, other: ServerSide) -> list[Any]:
        downstream = Downstream(
            checkpointing=False, connector_limit=1, connector_limit_per_host=1, limit_by_url={second + "/": 2}
        )
        try:
            long = asyncio.create_task(downstream.post(first, "/hold", {}))
            own = [asyncio.create_task(downstream.post(second, "/hold", {})) for _ in range(3)]
            give_up = time.monotonic() + DEADLINE
            while (side.active, other.active) != (1, 2) and time.monotonic() < give_up:
                await asyncio.wait([long, *own], timeout=0.01)
            # the shared pool's one connection is held, and two calls to the other server went out beside it
            assert (side.active, other.active) == (1, 2)
            assert other.hits["/hold"] == 2  # the third waits in that server's own pool
            side.let_go()
            other.let_go()
            return [reply for reply, _ in await asyncio.gather(long, *own)]
        finally:
            await downstream.close()

    with served(keep_alive=30.0) as (first, side), served(keep_alive=30.0) as (second, other):
        replies = asyncio.run(scenario(first, second, side, other))
    assert replies == [{"ok": True}] * 4
    assert (other.peak, other.opened, other.hits["/hold"]) == (2, 2, 3)


def test_a_bound_by_url_must_name_a_base_url_and_be_zero_or_more() -> None:
    config = _environment(data_connector_limit_by_url={"http://127.0.0.1:9002/": 50})
    assert config.data_connector_limit_by_url == {"http://127.0.0.1:9002": 50}
    for bounds, why in [
        ({"resources": 50}, "no server's base URL"),
        ({"http://127.0.0.1:9002": -1}, "0 \\(no limit\\)"),
    ]:
        with pytest.raises(ValueError, match=why):
            _environment(data_connector_limit_by_url=bounds)


def test_a_stack_file_names_the_server_of_a_bound_by_its_name() -> None:
    from gymckpt.stack.supervisor import checked_stack, server_configs

    spec = {
        "servers": [
            {"name": "resources", "kind": "counter"},
            {"name": "agent", "kind": "agent", "config": {"model_url": "http://127.0.0.1:9000"}},
            {
                "name": "environment",
                "kind": "environment",
                "config": {
                    "agent_url": "{agent}",
                    "resources_url": "{resources}",
                    "data_connector_limit_by_url": {"{resources}": 64},
                },
            },
        ]
    }
    path, _, entries, checkpoint = checked_stack(spec)
    urls = {"resources": "http://127.0.0.1:9002", "agent": "http://127.0.0.1:9001"}
    configs = server_configs(entries, checkpoint, urls, path)
    assert configs["environment"]["data_connector_limit_by_url"] == {"http://127.0.0.1:9002": 64}
    spec["servers"][2]["config"]["data_connector_limit_by_url"] = {"{resource}": 64}
    with pytest.raises(
        SettingsError, match=re.escape("'{resource}' names no server of this stack; did you mean '{resources}'")
    ):
        server_configs(checked_stack(spec)[2], checkpoint, urls, path)


def test_the_awaited_lane_is_small_and_never_larger_than_the_data_pool() -> None:
    assert transport.awaited_pool_limit(1024) == transport.AWAITED_POOL_LIMIT == 128
    assert transport.awaited_pool_limit(16) == 16
    assert transport.awaited_pool_limit(0) == transport.AWAITED_POOL_LIMIT  # an unbounded data pool


def test_pools_default_to_the_descriptors_and_an_idle_timeout_below_the_keep_alive() -> None:
    async def scenario() -> tuple[int, int, float | None]:
        async with transport.client_session() as session:
            connector = session.connector
            assert isinstance(connector, aiohttp.TCPConnector)
            return connector.limit, connector.limit_per_host, connector._keepalive_timeout

    soft = transport.descriptor_limits()[0]
    expected = max(transport.MIN_POOL_LIMIT, min(transport.MAX_POOL_LIMIT, soft - transport.DESCRIPTOR_RESERVE))
    assert asyncio.run(scenario()) == (expected, expected, transport.CLIENT_IDLE_SECONDS)
    # a trainer-side client: every descriptor but the reserve
    assert transport.pool_limit(1256) == 1000
    assert transport.pool_limit(100) == transport.MIN_POOL_LIMIT
    assert transport.pool_limit(10**7) == transport.MAX_POOL_LIMIT
    # a server's calls out, per host: an eighth of its descriptors, at most DOWNSTREAM_POOL_LIMIT
    assert transport.downstream_pool_limit(1256) == 157
    assert transport.downstream_pool_limit(20_000) == transport.DOWNSTREAM_POOL_LIMIT == 1024
    assert transport.downstream_pool_limit(100) == transport.MIN_POOL_LIMIT
    assert transport.server_keep_alive() == transport.SERVER_KEEP_ALIVE_SECONDS
    assert transport.client_idle_seconds() < transport.server_keep_alive() / 2


def test_a_server_of_several_workers_shares_its_downstream_bound_among_them(monkeypatch: pytest.MonkeyPatch) -> None:
    # the 1,024 per host are the server's: each worker takes its share, rounded up, never under the minimum
    assert transport.downstream_pool_limit(20_000, workers=2) == 512
    assert transport.downstream_pool_limit(20_000, workers=3) == 342
    assert transport.downstream_pool_limit(20_000, workers=64) == transport.MIN_POOL_LIMIT
    assert transport.downstream_pool_limit(2048, workers=2) == 256  # the eighth of the descriptors is smaller
    assert transport.downstream_pool_limit(-1, workers=4) == 256  # no descriptor limit
    monkeypatch.setenv(transport.POOL_LIMIT_ENV, "12")
    assert transport.downstream_pool_limit(20_000, workers=2) == 12  # the variable is per process
    monkeypatch.delenv(transport.POOL_LIMIT_ENV)

    async def bounds(downstream: Downstream) -> tuple[int, int]:
        data, awaited = downstream._client(), downstream._client(awaited=True)
        try:
            return data.connector.limit_per_host, awaited.connector.limit_per_host  # type: ignore[union-attr]
        finally:
            await downstream.close()

    expected = transport.downstream_pool_limit()
    assert asyncio.run(bounds(Downstream(checkpointing=False))) == (expected, transport.AWAITED_POOL_LIMIT)
    # a worker of `gymckpt serve KIND --workers 4` (what its supervisor sets for it)
    monkeypatch.setenv(ENV_RUNTIME, "/nonexistent")
    monkeypatch.setenv(ENV_WORKERS, "4")
    assert server_workers() == 4
    share = transport.downstream_pool_limit(workers=4)
    assert share < expected or expected == transport.MIN_POOL_LIMIT
    assert asyncio.run(bounds(Downstream(checkpointing=False))) == (share, min(transport.AWAITED_POOL_LIMIT, share))
    monkeypatch.setenv(ENV_WORKERS, "four")
    assert server_workers() == 1
    monkeypatch.delenv(ENV_RUNTIME)
    monkeypatch.setenv(ENV_WORKERS, "4")
    assert server_workers() == 1  # not a worker gymckpt serve started


def test_the_variables_set_the_pool_and_the_keep_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(transport.POOL_LIMIT_ENV, "12")
    monkeypatch.setenv(transport.KEEP_ALIVE_ENV, "3")
    assert transport.pool_limit() == transport.downstream_pool_limit() == 12
    assert (transport.server_keep_alive(), transport.client_idle_seconds()) == (3.0, 1.5)
    monkeypatch.setenv(transport.POOL_LIMIT_ENV, "many")
    with pytest.raises(ValueError, match=transport.POOL_LIMIT_ENV):
        transport.pool_limit()
    monkeypatch.setenv(transport.KEEP_ALIVE_ENV, "0")
    with pytest.raises(ValueError, match=transport.KEEP_ALIVE_ENV):
        transport.server_keep_alive()


# --- the descriptor budget at startup


def _environment(**fields: Any) -> EnvironmentConfig:
    return EnvironmentConfig(agent_url="http://127.0.0.1:9001", resources_url="http://127.0.0.1:9002", **fields)


def test_the_startup_check_logs_the_limit_and_the_budget(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="gymckpt.stack.serving"):
        budget = check_descriptor_budget("environment", _environment(), limits=(2048, 4096))
    # an eighth of 2048 per host and the awaited lane's 128 beside it, 2 hosts: 768 out,
    # and 256 reserved leave 1024 for calls coming in
    assert (budget.outbound, budget.inbound, budget.fits) == (768, 1024, True)
    lines = [(record.levelno, record.getMessage()) for record in caplog.records]
    assert len(lines) == 1 and lines[0][0] == logging.INFO
    assert "descriptor limit 2048 (hard 4096)" in lines[0][1]
    assert "768 outbound (2 server(s) downstream) + 256 reserved leave 1024 for calls coming in" in lines[0][1]
    # each of two workers has its descriptors to itself and half the server's 1,024 per host
    two = check_descriptor_budget("environment", _environment(), workers=2, limits=(20_000, 20_000))
    assert two.outbound == 2 * 512 + 2 * transport.AWAITED_POOL_LIMIT


def test_the_startup_check_warns_naming_the_option_when_the_pool_takes_more_than_it_leaves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 2 hosts: 800 on the data pool and 2 × 128 on the awaited lane
    config = _environment(data_connector_limit=5000, data_connector_limit_per_host=400)
    with caplog.at_level(logging.INFO, logger="gymckpt.stack.serving"):
        budget = check_descriptor_budget("environment", config, limits=(1512, 1512))
    assert (budget.outbound, budget.inbound, budget.fits) == (1056, 200, False)
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "1056 connections leave only 200 of the descriptor limit 1512" in warnings[0]
    assert "data_connector_limit" in warnings[0] and "ulimit -Hn" in warnings[0]


def test_the_startup_check_counts_each_server_at_its_own_bound(caplog: pytest.LogCaptureFixture) -> None:
    own = {"http://127.0.0.1:9002": 100, "http://127.0.0.1:9003": 50}  # one the config names, one it does not
    config = _environment(data_connector_limit=5000, data_connector_limit_per_host=400, data_connector_limit_by_url=own)
    with caplog.at_level(logging.INFO, logger="gymckpt.stack.serving"):
        budget = check_descriptor_budget("environment", config, limits=(20_000, 20_000))
    # the agent at 400, the resources server at 100, the third at 50, and the awaited lane to each of the three
    assert budget.outbound == 400 + 100 + 50 + 3 * transport.AWAITED_POOL_LIMIT
    assert "(3 server(s) downstream)" in caplog.records[0].getMessage()
    # the bound in all counts the calls in use only, never the idle connections: it does not lower the budget
    assert check_descriptor_budget(
        "environment", _environment(data_connector_limit=100), limits=(20_000, 20_000)
    ).outbound == (2 * transport.downstream_pool_limit(20_000) + 2 * transport.AWAITED_POOL_LIMIT)


def test_the_startup_check_warns_about_an_unbounded_pool(caplog: pytest.LogCaptureFixture) -> None:
    config = _environment(data_connector_limit=0, data_connector_limit_per_host=0)
    with caplog.at_level(logging.INFO, logger="gymckpt.stack.serving"):
        budget = check_descriptor_budget("environment", config, limits=(20_000, 20_000))
    assert budget.outbound is None and not budget.fits
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "has no bound" in warnings[0]


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one() -> None:
    code = (
        "import resource; from gymckpt.transport import raise_descriptor_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(512, hard), hard))\n"
        "print(*raise_descriptor_limit(), hard)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    soft, hard, original_hard = (int(word) for word in out.stdout.split())
    assert (soft, hard) == (original_hard, original_hard)


# --- gymckpt serve: the keep-alive and the startup line


def test_gymckpt_serve_keeps_idle_connections_for_its_keep_alive_and_logs_its_budget(tmp_path: Any) -> None:
    listening = socket.create_server((HOST, 0))
    listening.set_inheritable(True)
    log = tmp_path / "counter.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gymckpt", "serve", "counter", "--fd", str(listening.fileno()), "--keep-alive", "1"],
            pass_fds=(listening.fileno(),),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "GYMCKPT_LOG_LEVEL": "info"},
        )
    try:
        with socket.create_connection(listening.getsockname(), timeout=DEADLINE) as client:
            client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b""
            while b'{"status":"ok"}' not in reply:
                chunk = client.recv(65536)
                assert chunk, reply
                reply += chunk
            # the server closes the idle connection after its 1 s keep-alive (75 s by default)
            assert client.recv(65536) == b""
        text = log.read_text()
        assert "counter: descriptor limit" in text and "keep-alive 1 s" in text, text
    finally:
        process.kill()
        process.wait(timeout=DEADLINE)
        listening.close()


def test_the_idle_time_of_pooled_connections_is_the_configs_on_every_lane() -> None:
    """``data_connector_idle_seconds`` reaches every pool a server's Downstream makes (the data pool, the
    awaited lane, a pool of its own by URL); unset, the transport's default stays below stock uvicorn's 5 s."""

    async def scenario(idle: float | None) -> list[float]:
        config = _environment(
            data_connector_limit_by_url={"http://127.0.0.1:9002": 5}, data_connector_idle_seconds=idle
        )
        downstream = Downstream.of_config(config, checkpointing=False)
        try:
            lanes = [
                downstream._client(),
                downstream._client(awaited=True),
                downstream._client(base="http://127.0.0.1:9002"),
            ]
            return [lane.connector._keepalive_timeout for lane in lanes]  # type: ignore[union-attr]
        finally:
            await downstream.close()

    assert asyncio.run(scenario(30.0)) == [30.0, 30.0, 30.0]
    assert asyncio.run(scenario(None)) == [transport.client_idle_seconds()] * 3
    assert transport.client_idle_seconds() < 5.0
    for wrong in (0, -1):
        with pytest.raises(ValueError, match="greater than 0"):
            _environment(data_connector_idle_seconds=wrong)
