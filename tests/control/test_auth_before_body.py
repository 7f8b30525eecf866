"""Every route to a control endpoint refuses a call without the token before it reads the body (SPEC C1).

However the call reaches the route (directly, behind a rollout prefix, through any middleware
that rewrites the path), a missing or wrong token is a 401 and not one byte of the body is
pulled from the server: the ASGI tests count the bytes ``receive()`` hands out; the uvicorn
test sends a head announcing 64 MiB and only its first KiB, and gets the 401 all the same.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from gymckpt.control.routes import CONTROL_PREFIX, control_router, install_error_handlers
from gymckpt.stack import KINDS, build_server
from gymckpt.testing.participant import FakeParticipant
from gymckpt.workers.routing import OWNER_HEADER, RoutingTables, SessionRouter, SessionSigner

from ..servers.test_health import FIELDS
from ..support import REPO, read_reply

TOKEN = "auth-before-body-token"
#: the body a hostile caller announces (the issue's was 33 MiB), handed out in 1 MiB chunks
BODY_BYTES = 33 * 1024 * 1024
CHUNK = 1024 * 1024
ROUTES = ("prepare", "renew", "commit", "restore", "resume", "retire", "forget")
#: a valid capture key in front of the control path
PREFIXED = "/ng-rollout/r1-a2" + CONTROL_PREFIX
WRONG = (None, b"Bearer wrong", b"Bearer " + TOKEN.encode() + b"x", b"bearer " + TOKEN.encode(), b"Basic Zm9vOmJhcg==")


class CountingReceive:
    """A request body of :data:`BODY_BYTES`, handed out by ``receive()`` in chunks; counts what was pulled."""

    def __init__(self, total: int = BODY_BYTES) -> None:
        self.left = total
        self.pulled = 0

    async def __call__(self) -> dict[str, Any]:
        if self.left <= 0:
            await asyncio.Event().wait()  # after the body, a client that stays: nothing more comes
        size = min(CHUNK, self.left)
        self.left -= size
        self.pulled += size
        return {"type": "http.request", "body": b"x" * size, "more_body": self.left > 0}


async def call(app: Any, path: str, authorization: bytes | None) -> tuple[int, bytes, int]:
    """POST ``path`` to ``app`` at the ASGI level; the status, the reply body and the body bytes pulled."""
    headers = [
        (b"host", b"server"),
        (b"content-type", b"application/json"),
        (b"content-length", str(BODY_BYTES).encode()),
    ]
    if authorization is not None:
        headers.append((b"authorization", authorization))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    receive = CountingReceive()
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), timeout=30)
    status = next(message["status"] for message in sent if message["type"] == "http.response.start")
    body = b"".join(message.get("body", b"") for message in sent if message["type"] == "http.response.body")
    return status, body, receive.pulled


def participant_kinds() -> list[str]:
    return sorted(kind for kind in KINDS if kind != "inference")  # the backend has no checkpoint block


@pytest.mark.parametrize("kind", participant_kinds())
def test_every_server_refuses_an_unauthenticated_control_body_before_reading_it_with_or_without_the_prefix(
    kind: str,
) -> None:
    app, _ = build_server(kind, {**FIELDS[kind], "checkpoint": {"enabled": True, "control_auth_token": TOKEN}})

    async def main() -> list[tuple[str, Any, int, int]]:
        outcomes = []
        for base in (CONTROL_PREFIX, PREFIXED):
            for route in ROUTES:
                for authorization in WRONG:
                    status, body, pulled = await call(app, f"{base}/{route}", authorization)
                    outcomes.append((f"{base}/{route}", authorization, status, pulled))
                    assert b'"unauthorized"' in body, body[:300]
        return outcomes

    outcomes = asyncio.run(main())
    refused_unread = [(path, auth) for path, auth, status, pulled in outcomes if status == 401 and pulled == 0]
    assert len(refused_unread) == len(outcomes), [o for o in outcomes if o[2] != 401 or o[3] != 0][:5]


def test_an_authorized_prefixed_call_reaches_the_route_and_reads_its_body() -> None:
    """The counting receive does count: the same call with the token pulls the body (and is refused as JSON)."""
    app, _ = build_server("counter", {"checkpoint": {"enabled": True, "control_auth_token": TOKEN}})
    status, body, pulled = asyncio.run(call(app, f"{PREFIXED}/commit", b"Bearer " + TOKEN.encode()))
    assert pulled == BODY_BYTES
    assert status == 422, body[:300]  # 33 MiB of "x" is no JSON: the route read and decoded it


def test_a_control_path_no_route_serves_is_401_too_behind_the_prefix() -> None:
    app, _ = build_server("counter", {"checkpoint": {"enabled": True, "control_auth_token": TOKEN}})
    for path in (f"{CONTROL_PREFIX}/nope", f"{PREFIXED}/nope", f"{PREFIXED}/status/x"):
        status, body, pulled = asyncio.run(call(app, path, None))
        assert (status, pulled) == (401, 0), (path, status, body[:200])


class Rewrite:
    """A middleware rewriting ``/elsewhere/<route>`` to the control route: a path no other check knows."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/elsewhere/"):
            path = CONTROL_PREFIX + "/" + scope["path"].removeprefix("/elsewhere/")
            scope = {**scope, "path": path, "raw_path": path.encode()}
        await self.app(scope, receive, send)


def test_the_route_itself_refuses_before_the_body_whatever_rewrote_the_path(tmp_path: Path) -> None:
    """No ControlAuthMiddleware at all: the control routes' own class is the check."""
    from gymckpt.control.plane import ControlPlane

    app = FastAPI()
    app.include_router(control_router(ControlPlane(FakeParticipant()), TOKEN))
    install_error_handlers(app)
    app.add_middleware(Rewrite)

    async def main() -> list[tuple[str, int, int]]:
        outcomes = []
        for route in ROUTES:
            for authorization in WRONG:
                status, _, pulled = await call(app, f"/elsewhere/{route}", authorization)
                outcomes.append((route, status, pulled))
        status, _, pulled = await call(app, "/elsewhere/commit", b"Bearer " + TOKEN.encode())
        outcomes.append(("authorized commit", status, pulled))
        return outcomes

    outcomes = asyncio.run(main())
    assert all((status, pulled) == (401, 0) for _, status, pulled in outcomes[:-1]), outcomes
    assert outcomes[-1][1:] == (422, BODY_BYTES), outcomes[-1]


def test_a_worker_never_forwards_an_unauthenticated_control_body_to_another_worker() -> None:
    from gymckpt.control.plane import ControlPlane

    inner = FastAPI()
    inner.include_router(control_router(ControlPlane(FakeParticipant()), TOKEN))
    install_error_handlers(inner)
    socket_dir = Path(tempfile.mkdtemp(prefix="ga-", dir="/tmp"))  # an AF_UNIX path holds at most 107 bytes
    router = SessionRouter(
        inner,
        routing_id="a" * 32,
        socket_dir=socket_dir,
        signer=SessionSigner(b"k" * 32),
        tables=RoutingTables(),
        stamp=False,
    )

    async def forwarded(scope: Any, receive: Any, send: Any) -> None:
        scope["headers"].append((OWNER_HEADER.encode(), b"b" * 32))  # names another worker
        await router(scope, receive, send)

    try:
        status, _, pulled = asyncio.run(call(forwarded, f"{CONTROL_PREFIX}/commit", None))
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)
    assert (status, pulled) == (401, 0)


# --- over a real uvicorn server

#: the body the head announces, of which only :data:`SENT` bytes are ever sent
ANNOUNCED = 64 * 1024 * 1024
SENT = 1024
#: the most any wait for the server here may take
WAIT = 30.0


@pytest.mark.parametrize("path", [f"{CONTROL_PREFIX}/commit", f"{PREFIXED}/commit"], ids=["direct", "prefixed"])
def test_a_real_server_answers_401_before_the_client_sent_the_body(path: str, tmp_path: Path) -> None:
    """``gymckpt serve counter``: the 401 comes while 64 MiB announced are still unsent, and then status works."""
    listening = socket.create_server(("127.0.0.1", 0))
    listening.set_inheritable(True)
    log = tmp_path / "server.log"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "GYMCKPT_CHECKPOINT__ENABLED": "true",
        "GYMCKPT_CHECKPOINT__CONTROL_AUTH_TOKEN": TOKEN,
    }
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gymckpt", "serve", "counter", "--fd", str(listening.fileno())],
            pass_fds=(listening.fileno(),),
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        with socket.create_connection(listening.getsockname(), timeout=WAIT) as client:
            head = (
                f"POST {path} HTTP/1.1\r\nHost: server\r\nContent-Type: application/json\r\n"
                f"Content-Length: {ANNOUNCED}\r\n\r\n"
            ).encode()
            client.sendall(head + b"[" * SENT)
            reply = read_reply(client)
            assert reply.startswith(b"HTTP/1.1 401 "), reply[:300]
            assert b'"unauthorized"' in reply
        with socket.create_connection(listening.getsockname(), timeout=WAIT) as client:
            client.sendall(
                f"GET {CONTROL_PREFIX}/status HTTP/1.1\r\nHost: server\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
            )
            assert read_reply(client).startswith(b"HTTP/1.1 200 ")
    finally:
        process.kill()
        process.wait(timeout=WAIT)
        listening.close()
    assert "Traceback" not in log.read_text(errors="replace")
