"""Session routing: signed session values, owner resolution, forwarding over real Unix sockets, stamping."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import os
import re
import shutil
import socket
import stat
import tempfile
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gymckpt.workers.routing import (
    COOKIE_NAME,
    FORWARDED_SCOPE_KEY,
    OWNER_HEADER,
    TOKEN_HEADER,
    RoutingTables,
    SessionRouter,
    SessionSigner,
    derive_secret,
    serve_private_socket,
)

from ..support import error_code

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

WAIT = 10.0
SIGNER = SessionSigner(b"s" * 32)
OTHER_SIGNER = SessionSigner(b"o" * 32)
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]
#: 3 MiB, not a multiple of any chunk size a transport would pick by accident
BIG = bytes(range(256)) * (3 * 4096)


def rid() -> str:
    return uuid.uuid4().hex


def sign(owner: str, session: str = "r1") -> str:
    return SIGNER.sign(owner, session)


# ---------------------------------------------------------------------------------------------- signer


def test_a_signed_value_verifies_to_its_owner_and_session_and_is_cookie_safe() -> None:
    owner = rid()
    for session in ("r1", "r1-a3", "a.b=c; d", "Ünïcödé ✓", "x" * 500):
        value = SIGNER.sign(owner, session)
        assert re.fullmatch(r"[A-Za-z0-9._-]+", value), value
        assert SIGNER.verify(value) == (owner, session)


def test_a_tampered_value_does_not_verify() -> None:
    owner, other = rid(), rid()
    value = SIGNER.sign(owner, "r1")
    owner_part, session_part, mac = value.split(".")
    forged = SIGNER.sign(other, "r2").split(".")
    tampered = [
        f"{other}.{session_part}.{mac}",  # another owner
        f"{owner_part}.{forged[1]}.{mac}",  # another session
        f"{owner_part}.{session_part}.{forged[2]}",  # another signature
        f"{owner_part}.{session_part}.{mac[:-1]}",  # a truncated signature
        f"{owner_part}.{session_part}.{mac}A",  # a longer signature
        f"{owner_part}.{session_part}.{mac}.x",  # an extra part
        value.upper(),
        value + " ",
    ]
    for index in range(len(value)):  # every single changed character
        if value[index] != ".":
            tampered.append(value[:index] + ("A" if value[index] != "A" else "B") + value[index + 1 :])
    for candidate in tampered:
        assert SIGNER.verify(candidate) is None, candidate


def test_a_value_signed_with_another_secret_does_not_verify() -> None:
    value = OTHER_SIGNER.sign(rid(), "r1")
    assert OTHER_SIGNER.verify(value) is not None
    assert SIGNER.verify(value) is None


def test_signing_refuses_an_owner_that_is_not_a_routing_id_and_an_empty_session() -> None:
    for owner in ("", "worker-b", rid().upper(), rid()[:31], rid() + "0", str(uuid.uuid4())):
        with pytest.raises(ValueError, match="routing id"):
            SIGNER.sign(owner, "r1")
    with pytest.raises(ValueError, match="session"):
        SIGNER.sign(rid(), "")


def test_garbage_never_verifies_and_never_raises() -> None:
    garbage: list[Any] = ["", ".", "..", "...", "....", "é.é.é", "\x00", "\udcff", "a" * 10_000, None, 123, b"a.b.c"]
    garbage += [f"{rid()}..", f"{rid()}.{'=' * 4}.{'=' * 4}", f"..{rid()}", "ünï.cö.dé"]
    for value in garbage:
        assert SIGNER.verify(value) is None, value


def test_a_secret_must_hold_16_bytes() -> None:
    with pytest.raises(ValueError, match="16"):
        SessionSigner(b"x" * 15)
    assert SessionSigner(b"x" * 16).verify(SessionSigner(b"x" * 16).sign(rid(), "r")) is not None


def test_derive_secret_is_stable_for_one_token_and_random_without_one() -> None:
    assert derive_secret("token-1") == derive_secret("token-1")
    assert derive_secret("token-1") != derive_secret("token-2")
    assert len(derive_secret("token-1")) == 32
    assert len(derive_secret(None)) == 32
    assert derive_secret(None) != derive_secret(None)
    owner = rid()
    value = SessionSigner(derive_secret("token-1")).sign(owner, "r1")
    assert SessionSigner(derive_secret("token-1")).verify(value) == (owner, "r1")  # after a restart


def test_routing_tables_replace_swaps_both_tables_for_copies() -> None:
    old, new, placed = rid(), rid(), rid()
    tables = RoutingTables()
    assert (dict(tables.aliases), dict(tables.placements)) == ({}, {})
    aliases, placements = {old: new}, {"r1": placed}
    tables.replace(aliases, placements)
    first = tables.snapshot()
    aliases[rid()] = rid()  # the caller's dicts are copied
    placements["r2"] = placed
    assert (dict(tables.aliases), dict(tables.placements)) == ({old: new}, {"r1": placed})
    tables.replace({}, {"r3": new})
    assert (dict(tables.aliases), dict(tables.placements)) == ({}, {"r3": new})
    assert (dict(first[0]), dict(first[1])) == ({old: new}, {"r1": placed})  # an earlier snapshot stays whole
    with pytest.raises(TypeError):
        tables.aliases[old] = new  # type: ignore[index]
    with pytest.raises(ValueError, match="aliases"):
        tables.replace({old: "worker-b"}, {})
    with pytest.raises(ValueError, match="placements"):
        tables.replace({}, {"r1": "worker-b"})
    assert dict(tables.placements) == {"r3": new}  # a refused replace changes nothing


# ---------------------------------------------------------------------------------------------- workers


def probe_app(name: str, closed: asyncio.Event | None = None) -> Starlette:
    """A worker's app: says who answered and echoes what it got."""

    async def echo(request: Request) -> Response:
        body = await request.body()
        return JSONResponse(
            {
                "worker": name,
                "method": request.method,
                "path": request.url.path,
                "raw_path": request.scope["raw_path"].decode("latin-1"),
                "query": request.scope["query_string"].decode("latin-1"),
                "body": body.decode("latin-1") if len(body) <= 1000 else None,
                "length": len(body),
                "sha256": hashlib.sha256(body).hexdigest(),
                "probe": request.headers.getlist("x-probe"),
                "content_type": request.headers.get("content-type"),
                "user_agent": request.headers.get("user-agent"),
                "accept_encoding": request.headers.get("accept-encoding"),
                "forwarded": bool(request.scope.get(FORWARDED_SCOPE_KEY)),
            }
        )

    async def created(request: Request) -> Response:
        response = Response(b"made by " + name.encode(), status_code=201, headers={"x-custom": name})
        response.raw_headers.extend([(b"x-multi", b"one"), (b"x-multi", b"two")])
        return response

    async def big(request: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(BIG), 65_536):
                yield BIG[start : start + 65_536]

        return StreamingResponse(chunks(), media_type="application/octet-stream")

    async def gzipped(request: Request) -> Response:
        return Response(gzip.compress(b"squeezed " * 100), headers={"content-encoding": "gzip"})

    async def teapot(request: Request) -> Response:
        return JSONResponse({"worker": name}, status_code=418)

    async def endless(request: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            try:
                yield b"first"
                await asyncio.Event().wait()  # until the client goes
            finally:
                if closed is not None:
                    closed.set()

        return StreamingResponse(chunks())

    return Starlette(
        routes=[
            Route("/created", created, methods=["POST"]),
            Route("/big", big),
            Route("/gzip", gzipped),
            Route("/endless", endless),
            Route("/teapot", teapot, methods=["DELETE"]),
            Route("/{rest:path}", echo, methods=METHODS),
        ]
    )


@dataclass
class Worker:
    routing_id: str
    tables: RoutingTables
    router: SessionRouter
    socket: Path
    closed: asyncio.Event


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short directory under /tmp (an AF_UNIX path holds at most 107 bytes), 0700."""
    path = Path(tempfile.mkdtemp(prefix="gr-", dir="/tmp"))
    path.chmod(0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def make_worker(socket_dir: Path, *, routing_id: str | None = None, stamp: bool = True) -> Worker:
    name = routing_id or rid()
    closed = asyncio.Event()
    tables = RoutingTables()
    router = SessionRouter(
        probe_app(name, closed), routing_id=name, socket_dir=socket_dir, signer=SIGNER, tables=tables, stamp=stamp
    )
    return Worker(name, tables, router, socket_dir / f"{name}.sock", closed)


@asynccontextmanager
async def cluster(socket_dir: Path, count: int = 2, *, stamp: bool = True) -> AsyncIterator[list[Worker]]:
    """``count`` in-process workers, each serving its router on its private socket."""
    workers = [make_worker(socket_dir, stamp=stamp) for _ in range(count)]
    async with contextlib.AsyncExitStack() as stack:
        for worker in workers:
            await stack.enter_async_context(serve_private_socket(worker.router, worker.socket))
        for worker in workers:  # closed first, before the servers stop
            stack.push_async_callback(worker.router.close)
        yield workers


async def call(
    app: Any,
    method: str,
    path: str,
    *,
    cookie: str | None = None,
    headers: dict[str, str] | None = None,
    content: bytes | None = None,
) -> httpx.Response:
    """One request to ``app`` (a worker's router, as its public port would pass it), without a cookie jar."""
    sent = dict(headers or {})
    if cookie is not None:
        sent["cookie"] = f"other=1; {COOKIE_NAME}={cookie}"
    async with asyncio.timeout(WAIT):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
            return await client.request(method, path, headers=sent, content=content)


def answered_by(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["worker"]  # type: ignore[no-any-return]


def stamp_of(response: httpx.Response) -> tuple[str, str] | None:
    """The (owner, session) a reply's stamp names (both headers agree); None without a stamp."""
    cookies = response.headers.get_list("set-cookie")
    token = response.headers.get(TOKEN_HEADER)
    if not cookies and token is None:
        return None
    assert len(cookies) == 1, cookies
    assert cookies[0] == f"{COOKIE_NAME}={token}; Path=/; HttpOnly; SameSite=Lax"
    return SIGNER.verify(token)


# ---------------------------------------------------------------------------------------------- routing


async def test_a_request_without_a_session_is_handled_locally_and_stamped(socket_dir: Path) -> None:
    async with cluster(socket_dir) as (a, _b):
        reply = await call(a.router, "POST", "/ng-rollout/r1-a2/seed", content=b"{}")
        assert answered_by(reply) == a.routing_id
        assert reply.json()["forwarded"] is False
        assert stamp_of(reply) == (a.routing_id, "r1-a2")


async def test_a_cookie_naming_another_worker_reaches_it_with_the_request_intact(socket_dir: Path) -> None:
    async with cluster(socket_dir) as (a, b):
        reply = await call(
            a.router,
            "PUT",
            "/ng-rollout/r1/echo/a%2Fb?x=1&y=two%20words&x=3",
            cookie=sign(b.routing_id),
            headers={"x-probe": "kept", "content-type": "text/plain; charset=latin-1"},
            content=b"hello body",
        )
        echoed = reply.json()
        assert answered_by(reply) == b.routing_id
        assert echoed["forwarded"] is True
        assert echoed["method"] == "PUT"
        assert echoed["raw_path"] == "/ng-rollout/r1/echo/a%2Fb"
        assert echoed["query"] == "x=1&y=two%20words&x=3"
        assert echoed["body"] == "hello body"
        assert echoed["probe"] == ["kept"]
        assert echoed["content_type"] == "text/plain; charset=latin-1"
        assert echoed["user_agent"].startswith("python-httpx/")  # the client's, not aiohttp's
        assert echoed["accept_encoding"] == reply.request.headers["accept-encoding"]
        assert stamp_of(reply) is None  # the cookie names the worker that answered


async def test_a_forwarded_reply_keeps_its_status_headers_and_encoding(socket_dir: Path) -> None:
    async with cluster(socket_dir) as (a, b):
        created = await call(a.router, "POST", "/created", cookie=sign(b.routing_id))
        assert created.status_code == 201
        assert created.content == b"made by " + b.routing_id.encode()
        assert created.headers["x-custom"] == b.routing_id
        assert created.headers.get_list("x-multi") == ["one", "two"]
        squeezed = await call(a.router, "GET", "/gzip", cookie=sign(b.routing_id))
        assert squeezed.headers["content-encoding"] == "gzip"  # passed on compressed, decoded by the client only
        assert squeezed.content == b"squeezed " * 100
        teapot = await call(a.router, "DELETE", "/teapot", cookie=sign(b.routing_id))
        assert (teapot.status_code, teapot.json()) == (418, {"worker": b.routing_id})


async def test_large_bodies_are_forwarded_whole_both_ways(socket_dir: Path) -> None:
    async with cluster(socket_dir) as (a, b):
        upload = await call(a.router, "POST", "/upload", cookie=sign(b.routing_id), content=BIG)
        assert answered_by(upload) == b.routing_id
        assert (upload.json()["length"], upload.json()["sha256"]) == (len(BIG), hashlib.sha256(BIG).hexdigest())
        assert upload.json()["content_type"] is None  # none sent, none added
        download = await call(a.router, "GET", "/big", cookie=sign(b.routing_id))
        assert download.status_code == 200
        assert download.content == BIG


async def test_a_forwarded_request_is_never_forwarded_again(socket_dir: Path) -> None:
    async with cluster(socket_dir, 3) as (a, b, c):
        a.tables.replace({c.routing_id: b.routing_id}, {})  # A sends C's sessions to B; B would send them to C
        reply = await call(a.router, "GET", "/where", cookie=sign(c.routing_id))
        assert answered_by(reply) == b.routing_id
        assert reply.json()["forwarded"] is True
        # on B's private socket, a cookie naming C is handled by B
        transport = httpx.AsyncHTTPTransport(uds=os.fspath(b.socket))
        async with asyncio.timeout(WAIT), httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            direct = await client.get("/where", headers={"cookie": f"{COOKIE_NAME}={sign(c.routing_id)}"})
        assert answered_by(direct) == b.routing_id
        # and on B's public side the same request does go to C
        assert answered_by(await call(b.router, "GET", "/where", cookie=sign(c.routing_id))) == c.routing_id


async def test_an_alias_sends_an_old_owners_sessions_to_its_new_worker_which_stamps_itself(socket_dir: Path) -> None:
    old = rid()  # a worker of an earlier run: no socket
    async with cluster(socket_dir) as (a, b):
        a.tables.replace({old: b.routing_id}, {})
        reply = await call(a.router, "GET", "/ng-rollout/r4/state", cookie=sign(old, "r4"))
        assert answered_by(reply) == b.routing_id
        assert stamp_of(reply) == (b.routing_id, "r4")
        # the stamped value now reaches B directly, without a new stamp
        again = await call(a.router, "GET", "/ng-rollout/r4/state", cookie=reply.headers[TOKEN_HEADER])
        assert answered_by(again) == b.routing_id
        assert stamp_of(again) is None


async def test_an_alias_to_this_worker_is_handled_here_and_stamped(socket_dir: Path) -> None:
    old = rid()
    async with cluster(socket_dir) as (a, _b):
        a.tables.replace({old: a.routing_id}, {})
        reply = await call(a.router, "GET", "/ng-rollout/r4/state", cookie=sign(old, "r4"))
        assert answered_by(reply) == a.routing_id
        assert stamp_of(reply) == (a.routing_id, "r4")


async def test_a_placement_routes_a_rollout_without_a_session(socket_dir: Path) -> None:
    async with cluster(socket_dir) as (a, b):
        a.tables.replace({}, {"r7-a1": b.routing_id})
        reply = await call(a.router, "POST", "/ng-rollout/r7-a1/step", content=b"{}")
        assert answered_by(reply) == b.routing_id
        assert stamp_of(reply) == (b.routing_id, "r7-a1")
        other = await call(a.router, "POST", "/ng-rollout/r8/step", content=b"{}")
        assert answered_by(other) == a.routing_id
        # a session value that names a worker wins over a placement
        named = await call(a.router, "POST", "/ng-rollout/r7-a1/step", cookie=sign(a.routing_id, "r7-a1"))
        assert answered_by(named) == a.routing_id


async def test_a_placed_old_owner_is_aliased_too(socket_dir: Path) -> None:
    old = rid()
    async with cluster(socket_dir) as (a, b):
        a.tables.replace({old: b.routing_id}, {"r9": old})
        assert answered_by(await call(a.router, "GET", "/ng-rollout/r9/x")) == b.routing_id


async def test_the_token_header_routes_and_wins_on_mcp_paths(socket_dir: Path) -> None:
    async with cluster(socket_dir, 3) as (a, b, c):
        token = {TOKEN_HEADER: sign(b.routing_id)}
        assert answered_by(await call(a.router, "GET", "/anything", headers=token)) == b.routing_id
        for path in ("/mcp", "/mcp/", "/mcp/tools/list"):
            reply = await call(a.router, "POST", path, cookie=sign(c.routing_id), headers=token)
            assert answered_by(reply) == b.routing_id, path
        # elsewhere the cookie wins; on /mcp without a token the cookie still counts
        assert answered_by(await call(a.router, "GET", "/mcpx", cookie=sign(c.routing_id), headers=token)) == (
            c.routing_id
        )
        assert answered_by(await call(a.router, "GET", "/mcp", cookie=sign(c.routing_id))) == c.routing_id


async def test_the_owner_header_counts_only_without_cookie_or_token(socket_dir: Path) -> None:
    async with cluster(socket_dir) as (a, b):
        named = {OWNER_HEADER: b.routing_id}
        assert answered_by(await call(a.router, "GET", "/x", headers=named)) == b.routing_id
        assert answered_by(await call(a.router, "GET", "/x", cookie=sign(a.routing_id), headers=named)) == (
            a.routing_id
        )
        with_token = {**named, TOKEN_HEADER: sign(a.routing_id)}
        assert answered_by(await call(a.router, "GET", "/x", headers=with_token)) == a.routing_id
        with_bad_cookie = await call(a.router, "GET", "/x", cookie="garbage", headers=named)
        assert answered_by(with_bad_cookie) == a.routing_id
        for value in (b.routing_id.upper(), b.routing_id[:8], "worker-b", ""):
            assert answered_by(await call(a.router, "GET", "/x", headers={OWNER_HEADER: value})) == a.routing_id


async def test_a_session_value_that_does_not_verify_is_handled_locally(socket_dir: Path) -> None:
    async with cluster(socket_dir) as (a, b):
        good = sign(b.routing_id, "r1")
        for bad in ("garbage", "", OTHER_SIGNER.sign(b.routing_id, "r1"), good[:-2], good.replace(".", "..", 1)):
            reply = await call(a.router, "GET", "/ng-rollout/r1/x", cookie=bad)
            assert answered_by(reply) == a.routing_id, bad
            assert stamp_of(reply) == (a.routing_id, "r1")
            assert answered_by(await call(a.router, "GET", "/x", headers={TOKEN_HEADER: bad})) == a.routing_id


async def test_a_missing_owner_is_410_and_a_later_socket_is_used(socket_dir: Path) -> None:
    async with cluster(socket_dir, 1) as (a,):
        late = make_worker(socket_dir)
        cookie = sign(late.routing_id)
        gone = await call(a.router, "GET", "/x", cookie=cookie)
        assert (gone.status_code, error_code(gone)) == (410, "session_owner_gone")
        detail = gone.json()["error"]["detail"]
        assert late.routing_id[:8] in detail
        assert late.routing_id not in detail
        assert cookie.split(".")[2] not in detail
        assert "set-cookie" not in gone.headers
        async with serve_private_socket(late.router, late.socket):
            assert answered_by(await call(a.router, "GET", "/x", cookie=cookie)) == late.routing_id
        await late.router.close()


async def test_an_owner_socket_that_refuses_connections_is_410(socket_dir: Path) -> None:
    owner = rid()
    async with cluster(socket_dir, 1) as (a,):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bound:  # bound, never listening: refused
            bound.bind(os.fspath(socket_dir / f"{owner}.sock"))
            reply = await call(a.router, "GET", "/x", cookie=sign(owner))
        assert (reply.status_code, error_code(reply)) == (410, "session_owner_gone")


@asynccontextmanager
async def raw_server(path: Path, reply: bytes) -> AsyncIterator[None]:
    """A Unix socket server that is not HTTP: it sends ``reply`` after the request head (none: closes at once)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if reply:
                async with asyncio.timeout(WAIT):
                    await reader.readuntil(b"\r\n\r\n")
                writer.write(reply)
                await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_unix_server(handle, path=os.fspath(path))
    try:
        yield
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    "reply", [b"", b"this is no HTTP at all\r\n\r\n", b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort"]
)
async def test_an_owner_that_answers_garbage_or_closes_is_502(socket_dir: Path, reply: bytes) -> None:
    owner = rid()
    async with cluster(socket_dir, 1) as (a,), raw_server(socket_dir / f"{owner}.sock", reply):
        cookie = sign(owner)
        if reply.startswith(b"HTTP/1.1 200"):  # the reply started: the client's connection is cut instead
            with pytest.raises(aiohttp.ClientPayloadError):
                await call(a.router, "GET", "/x", cookie=cookie)
            return
        failed = await call(a.router, "GET", "/x", cookie=cookie)
        assert (failed.status_code, error_code(failed)) == (502, "session_forward_failed")
        detail = failed.json()["error"]["detail"]
        assert owner[:8] in detail
        assert owner not in detail
        assert cookie not in detail


# ---------------------------------------------------------------------------------------------- stamping


async def test_stamping_rules(socket_dir: Path) -> None:
    async with cluster(socket_dir) as (a, b):
        assert stamp_of(await call(a.router, "GET", "/ng-rollout/r1/x")) == (a.routing_id, "r1")
        assert stamp_of(await call(a.router, "GET", "/ng-rollout/r1/x", cookie=sign(a.routing_id))) is None
        # a cookie naming this worker for another session still names this worker: no new stamp
        assert stamp_of(await call(a.router, "GET", "/ng-rollout/r2/x", cookie=sign(a.routing_id, "r1"))) is None
        # a token header is not a cookie: the reply is stamped, so a cookie client gets one
        token = {TOKEN_HEADER: sign(a.routing_id)}
        assert stamp_of(await call(a.router, "GET", "/ng-rollout/r1/x", headers=token)) == (a.routing_id, "r1")
        # no rollout key (or an invalid one): nothing to name
        assert stamp_of(await call(a.router, "GET", "/x")) is None
        for invalid in ("/ng-rollout/r1", "/ng-rollout/-bad/x", "/ng-rollout/r1/ng-rollout/r2/x"):
            reply = await call(a.router, "GET", invalid)
            assert answered_by(reply) == a.routing_id
            assert stamp_of(reply) is None, invalid
        # the owner stamps a forwarded reply; the forwarding worker adds nothing
        forwarded = await call(a.router, "GET", "/ng-rollout/r3/x", headers={OWNER_HEADER: b.routing_id})
        assert answered_by(forwarded) == b.routing_id
        assert stamp_of(forwarded) == (b.routing_id, "r3")


async def test_a_worker_that_does_not_stamp_never_adds_headers(socket_dir: Path) -> None:
    old = rid()
    async with cluster(socket_dir, stamp=False) as (a, b):
        a.tables.replace({old: b.routing_id}, {"r5": b.routing_id})
        for reply in (
            await call(a.router, "GET", "/ng-rollout/r1/x"),
            await call(a.router, "GET", "/ng-rollout/r1/x", cookie="garbage"),
            await call(a.router, "GET", "/ng-rollout/r1/x", cookie=sign(old)),
            await call(a.router, "GET", "/ng-rollout/r5/x"),
        ):
            assert reply.status_code == 200
            assert "set-cookie" not in reply.headers
            assert TOKEN_HEADER not in reply.headers


async def test_a_client_follows_its_stamp_to_the_owner(socket_dir: Path) -> None:
    async with cluster(socket_dir, 3) as (a, b, c):
        first = await call(b.router, "POST", "/ng-rollout/r1/seed", content=b"{}")
        assert stamp_of(first) == (b.routing_id, "r1")
        value = first.headers[TOKEN_HEADER]
        for worker in (a, b, c):
            by_cookie = await call(worker.router, "POST", "/ng-rollout/r1/step", cookie=value)
            by_token = await call(worker.router, "POST", "/ng-rollout/r1/step", headers={TOKEN_HEADER: value})
            assert (answered_by(by_cookie), answered_by(by_token)) == (b.routing_id, b.routing_id)


# ---------------------------------------------------------------------------------------------- ASGI edges


async def test_the_private_socket_is_0600_marks_requests_and_is_removed_at_exit(socket_dir: Path) -> None:
    worker = make_worker(socket_dir)
    async with serve_private_socket(worker.router, worker.socket):
        info = os.stat(worker.socket)
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o600
        transport = httpx.AsyncHTTPTransport(uds=os.fspath(worker.socket))
        async with asyncio.timeout(WAIT), httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            reply = await client.get("/ng-rollout/r1/x")
        assert reply.json()["forwarded"] is True
        assert "server" not in reply.headers
        assert "date" not in reply.headers
        assert stamp_of(reply) == (worker.routing_id, "r1")
    assert not worker.socket.exists()


async def test_scopes_other_than_http_pass_through(socket_dir: Path) -> None:
    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    router = SessionRouter(
        app, routing_id=rid(), socket_dir=socket_dir, signer=SIGNER, tables=RoutingTables(), stamp=True
    )
    cookie = f"{COOKIE_NAME}={sign(rid())}".encode()
    for kind in ("lifespan", "websocket"):
        await router({"type": kind, "path": "/x", "headers": [(b"cookie", cookie)]}, None, None)  # type: ignore[arg-type]
    assert seen == ["lifespan", "websocket"]


async def test_a_client_gone_before_its_body_arrived_gets_no_reply(socket_dir: Path) -> None:
    async with cluster(socket_dir) as (a, b):
        messages = iter([{"type": "http.request", "body": b"part", "more_body": True}, {"type": "http.disconnect"}])
        sent: list[Any] = []

        async def receive() -> Any:
            return next(messages)

        async def send(message: Any) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/x",
            "raw_path": b"/x",
            "query_string": b"",
            "headers": [(b"cookie", f"{COOKIE_NAME}={sign(b.routing_id)}".encode())],
        }
        async with asyncio.timeout(WAIT):
            await a.router(scope, receive, send)
        assert sent == []


async def test_a_client_gone_during_a_forwarded_stream_ends_the_owners_stream(socket_dir: Path) -> None:
    async with cluster(socket_dir) as (a, b):
        leave = asyncio.Event()
        sent: list[Any] = []
        body_done = False

        async def receive() -> Any:
            nonlocal body_done
            if not body_done:
                body_done = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await leave.wait()
            return {"type": "http.disconnect"}

        async def send(message: Any) -> None:
            sent.append(message)
            if message.get("body"):
                leave.set()  # the first chunk arrived: the client goes

        scope = {
            "type": "http",
            "method": "GET",
            "path": "/endless",
            "raw_path": b"/endless",
            "query_string": b"",
            "headers": [(b"host", b"worker"), (b"cookie", f"{COOKIE_NAME}={sign(b.routing_id)}".encode())],
        }
        async with asyncio.timeout(WAIT):
            await a.router(scope, receive, send)
            await b.closed.wait()  # the owner saw its client go
        assert sent[0]["type"] == "http.response.start"
        assert sent[0]["status"] == 200
        assert [message["body"] for message in sent[1:]] == [b"first"]
        assert not a.closed.is_set()
