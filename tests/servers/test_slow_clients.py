"""Slow clients cannot hold a server: a head deadline, a body rate, and shedding near the connection budget.

Real server processes (``gymckpt serve counter``, or an app of this module under
:func:`gymckpt.stack.serving.uvicorn_options`) on a loopback socket the test binds and
passes in, with small deadlines set through their variables
(:mod:`gymckpt.stack.request_deadlines`). Every wait is a socket timeout well above the
deadline it waits for: the tests assert what the client sees (a 408, a closed connection, a
200), never how long it took.
"""

from __future__ import annotations

import json
import os
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.control.routes import CONTROL_PREFIX
from gymckpt.stack.request_deadlines import (
    BODY_GRACE_ENV,
    BODY_MIN_RATE_ENV,
    CONNECTION_BUDGET_ENV,
    HEADER_TIMEOUT_ENV,
    RequestDeadlines,
)
from gymckpt.transport import KEEP_ALIVE_ENV

from ..support import REPO, read_reply

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

TOKEN = "slow-clients-token"
#: the bound of every wait here: far above each deadline the tests set
WAIT = 30.0
#: a head that never completes (no blank line after the headers)
HALF_HEAD = b"GET /health HTTP/1.1\r\nHost: server\r\nX-Slow: "


@contextmanager
def server(
    tmp_path: Path, env: dict[str, str], *, command: list[str] | None = None, descriptors: int | None = None
) -> Iterator[tuple[str, int]]:
    """A server process on a loopback socket bound here (``gymckpt serve counter`` with checkpointing on, by
    default); its address. ``descriptors``: its RLIMIT_NOFILE, soft and hard.

    Its log may hold no traceback but asyncio's own for an accept that found the descriptors
    taken (it pauses accepting for a second, and the connections wait in the backlog)."""
    listening = socket.create_server(("127.0.0.1", 0), backlog=4096)
    listening.set_inheritable(True)
    fd = listening.fileno()
    argv = command or ["-m", "gymckpt", "serve", "counter", "--fd", "{fd}"]
    full_env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "GYMCKPT_CHECKPOINT__ENABLED": "true",
        "GYMCKPT_CHECKPOINT__CONTROL_AUTH_TOKEN": TOKEN,
        **env,
    }

    def limit() -> None:
        if descriptors is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (descriptors, descriptors))

    log = tmp_path / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, *(arg.format(fd=fd) for arg in argv)],
            pass_fds=(fd,),
            cwd=REPO,
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=limit,
        )
    try:
        address = listening.getsockname()
        assert request(address, b"GET /health HTTP/1.1\r\nHost: server\r\n\r\n").startswith(b"HTTP/1.1 200 ")
        yield address
    finally:
        process.kill()
        process.wait(timeout=WAIT)
        listening.close()
    text = log.read_text(errors="replace")
    tracebacks = text.count("Traceback")
    assert tracebacks == text.count("socket.accept() out of system resource"), text[-3000:]


def server_log(tmp_path: Path) -> str:
    """What the server of :func:`server` logged so far."""
    return (tmp_path / "server.log").read_text(errors="replace")


def wait_for_log(tmp_path: Path, text: str) -> None:
    """Wait (bounded) until the server's log holds ``text``."""
    deadline = time.monotonic() + WAIT
    while text not in server_log(tmp_path):
        assert time.monotonic() < deadline, server_log(tmp_path)[-3000:]
        time.sleep(0.05)


def request(address: tuple[str, int], raw: bytes) -> bytes:
    with socket.create_connection(address, timeout=WAIT) as sock:
        sock.sendall(raw)
        return read_reply(sock)


def until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout fails the test)."""
    sock.settimeout(WAIT)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


STATUS = f"GET {CONTROL_PREFIX}/status HTTP/1.1\r\nHost: server\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()


# --- the head


def test_a_half_sent_head_gets_408_and_is_closed(tmp_path: Path) -> None:
    with server(tmp_path, {HEADER_TIMEOUT_ENV: "1"}) as address, socket.create_connection(address) as sock:
        sock.sendall(HALF_HEAD)
        reply = until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    body = json.loads(reply.partition(b"\r\n\r\n")[2])
    assert body["error"]["code"] == "request_timeout"
    assert HEADER_TIMEOUT_ENV in body["error"]["detail"]


def test_a_connection_that_sends_nothing_is_closed_without_a_reply_after_the_keep_alive(tmp_path: Path) -> None:
    """The time before a request's first byte is the keep-alive's (a loaded client may be slow to write), not
    the head's: a new connection unused that long is closed as an idle kept-alive one is, and the log says so."""
    env = {HEADER_TIMEOUT_ENV: "60", KEEP_ALIVE_ENV: "1"}
    with server(tmp_path, env) as address, socket.create_connection(address) as sock:
        assert until_closed(sock) == b""
    assert "1 new, sent no byte within the keep-alive (GYMCKPT_KEEP_ALIVE)" in server_log(tmp_path)


def test_a_head_trickled_a_byte_at_a_time_is_cut(tmp_path: Path) -> None:
    """Bytes keep coming, but the head is never complete: the deadline counts from the first byte, not the last."""
    with server(tmp_path, {HEADER_TIMEOUT_ENV: "1"}) as address, socket.create_connection(address) as sock:
        sock.sendall(HALF_HEAD)
        stop = threading.Event()

        def trickle() -> None:
            # the attack: one byte every 0.1 s, for at most 60 s
            for _ in range(600):
                if stop.wait(0.1):
                    return
                try:
                    sock.send(b"a")
                except OSError:
                    return

        thread = threading.Thread(target=trickle, daemon=True)
        thread.start()
        try:
            reply = until_closed(sock)
        finally:
            stop.set()
            thread.join(timeout=WAIT)
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    assert "1 request head not complete in time (GYMCKPT_HEADER_TIMEOUT)" in server_log(tmp_path)


def test_a_kept_alive_connection_idles_past_the_head_deadline_and_is_still_served(tmp_path: Path) -> None:
    """The idle time between requests is the keep-alive's: the head's clock starts with the next request's first byte."""
    with server(tmp_path, {HEADER_TIMEOUT_ENV: "1"}) as address, socket.create_connection(address) as kept:
        kept.settimeout(WAIT)
        kept.sendall(STATUS)
        assert read_reply(kept).startswith(b"HTTP/1.1 200 ")
        with socket.create_connection(address) as other:
            other.sendall(HALF_HEAD)
            # once this one was cut, more than the head deadline has passed since ``kept`` went idle
            assert until_closed(other).startswith(b"HTTP/1.1 408 ")
        kept.sendall(STATUS)
        assert read_reply(kept).startswith(b"HTTP/1.1 200 ")


# --- the connection budget

#: the connections the attack opens, more than the server's descriptors allow
ATTACKERS = 400
BUDGET = 64


def test_control_calls_get_through_while_slow_heads_exceed_the_descriptors(tmp_path: Path) -> None:
    """400 half heads against a process of 256 descriptors (a head deadline of 60 s, so none expires here):
    the oldest waiting connections are shed at the budget of 64, and the authenticated status call is served."""
    env = {HEADER_TIMEOUT_ENV: "60", CONNECTION_BUDGET_ENV: str(BUDGET)}
    with server(tmp_path, env, descriptors=256) as address:
        attackers = []
        try:
            for _ in range(ATTACKERS):
                sock = socket.create_connection(address, timeout=WAIT)
                sock.sendall(HALF_HEAD)
                attackers.append(sock)
            reply = request(address, STATUS)
            assert reply.startswith(b"HTTP/1.1 200 "), reply[:300]
            assert json.loads(reply.partition(b"\r\n\r\n")[2])["phase"] == "idle"
            closed = count_closed(attackers, at_least=ATTACKERS - BUDGET)
        finally:
            for sock in attackers:
                sock.close()
    # the server holds at most its budget: the rest of the attack was shed, oldest first
    assert closed >= ATTACKERS - BUDGET
    assert "shed at the connection budget (GYMCKPT_CONNECTION_BUDGET)" in server_log(tmp_path)


def count_closed(socks: list[socket.socket], *, at_least: int) -> int:
    """How many of ``socks`` the server closed, waiting (bounded) until at least ``at_least`` are."""
    closed = 0
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        deadline = time.monotonic() + WAIT
        while closed < at_least and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=1.0):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    data = b""
                assert data == b"", data  # shed without a reply
                selector.unregister(sock)
                closed += 1
    return closed


# --- the body: the client's slowness counts, the app's does not

#: the parked client's body: far beyond what uvicorn buffers before it stops reading (64 KiB)
PARKED_BODY = 1024 * 1024


def parking_app() -> Any:
    """An ASGI app: ``/parked`` reads its body only once ``/release`` was called; ``/wait-entered?n=N``
    answers once N ``/parked`` calls have arrived; ``/read`` reads its body at once. Each answers
    ``{"bytes": N}``, the body bytes it read."""
    import asyncio

    state: dict[str, Any] = {"entered": 0}

    def changed() -> asyncio.Condition:
        if "changed" not in state:
            state["changed"] = asyncio.Condition()
        return state["changed"]  # type: ignore[no-any-return]

    async def body_size(receive: Any) -> int:
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return -1
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        return size

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        path, size = scope["path"], 0
        async with changed():
            if path == "/parked":
                state["entered"] += 1
                changed().notify_all()
                await changed().wait_for(lambda: state.get("released", False))
            elif path == "/wait-entered":
                wanted = int(scope["query_string"].decode().removeprefix("n="))
                await changed().wait_for(lambda: state["entered"] >= wanted)
            elif path == "/release":
                state["released"] = True
                changed().notify_all()
        if path in ("/parked", "/read", "/health"):
            size = await body_size(receive)
        body = json.dumps({"bytes": size}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


#: serve :func:`parking_app` on the inherited socket with every server's uvicorn options
PARKING_SERVER = [
    "-c",
    "import uvicorn; from gymckpt.stack.serving import uvicorn_options; "
    "from tests.servers.test_slow_clients import parking_app; "
    "uvicorn.run(parking_app(), fd={fd}, **uvicorn_options())",
]


def post(path: str, size: int, *, extra: bytes = b"") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: server\r\nContent-Length: {size}\r\n".encode() + extra + b"\r\n"


def test_a_parked_app_keeps_its_clients_while_a_slow_body_is_cut(tmp_path: Path) -> None:
    """The app does not read two 1 MiB bodies until released (one client sent its body, the other waits for
    ``100 Continue``); meanwhile a client sending 1 byte of 1,000 is cut after the grace (2 s, at a rate of
    1 GB/s). Released after that, both parked calls read their whole bodies."""
    env = {BODY_GRACE_ENV: "2", BODY_MIN_RATE_ENV: "1e9", HEADER_TIMEOUT_ENV: "60"}
    with server(tmp_path, env, command=PARKING_SERVER) as address:
        replies: dict[str, bytes] = {}

        def parked() -> None:
            with socket.create_connection(address, timeout=WAIT) as sock:
                sock.sendall(post("/parked", PARKED_BODY) + b"p" * PARKED_BODY)
                replies["parked"] = read_reply(sock)

        def expecting() -> None:
            with socket.create_connection(address, timeout=WAIT) as sock:
                sock.sendall(post("/parked", PARKED_BODY, extra=b"Expect: 100-continue\r\n"))
                interim = b""
                while b"\r\n\r\n" not in interim:
                    chunk = sock.recv(1)
                    assert chunk, interim
                    interim += chunk
                assert interim.startswith(b"HTTP/1.1 100 "), interim
                sock.sendall(b"e" * PARKED_BODY)
                replies["expecting"] = read_reply(sock)

        threads = [threading.Thread(target=target, daemon=True) for target in (parked, expecting)]
        for thread in threads:
            thread.start()
        try:
            entered = request(address, b"GET /wait-entered?n=2 HTTP/1.1\r\nHost: server\r\n\r\n")
            assert entered.startswith(b"HTTP/1.1 200 "), entered
            with socket.create_connection(address) as slow:
                slow.sendall(post("/read", 1000) + b"s")
                cut = until_closed(slow)
            assert cut.startswith(b"HTTP/1.1 408 "), cut
            assert BODY_MIN_RATE_ENV in cut.decode()
            # the log says so (the first close is logged at once)
            wait_for_log(tmp_path, "1 request body too slow")
            # the parked calls have waited longer than the grace by now; they were not waiting for their clients
            assert request(address, b"GET /release HTTP/1.1\r\nHost: server\r\n\r\n").startswith(b"HTTP/1.1 200")
        finally:
            for thread in threads:
                thread.join(timeout=WAIT)
    assert set(replies) == {"parked", "expecting"}, replies
    for name, reply in replies.items():
        assert reply.startswith(b"HTTP/1.1 200 "), (name, reply[:300])
        assert json.loads(reply.partition(b"\r\n\r\n")[2]) == {"bytes": PARKED_BODY}, name


def test_a_body_the_server_drains_after_an_early_401_is_bounded_too(tmp_path: Path) -> None:
    """An unauthenticated commit is refused before its body; a client that then trickles the body is cut."""
    env = {BODY_GRACE_ENV: "1", BODY_MIN_RATE_ENV: "1e9", HEADER_TIMEOUT_ENV: "60"}
    with server(tmp_path, env) as address, socket.create_connection(address, timeout=WAIT) as sock:
        sock.sendall(post(f"/ng-rollout/r1{CONTROL_PREFIX}/commit", 10_000_000) + b"{")
        rest = until_closed(sock)
    assert rest.startswith(b"HTTP/1.1 401 "), rest[:300]  # the refusal, then the close (no second reply)
    assert rest.count(b"HTTP/1.1 ") == 1


# --- the settings


def test_the_settings_come_from_the_environment_and_bad_ones_are_named() -> None:
    assert RequestDeadlines.from_environment({}).header_timeout == 10.0
    read = RequestDeadlines.from_environment(
        {HEADER_TIMEOUT_ENV: "2.5", BODY_GRACE_ENV: "3", BODY_MIN_RATE_ENV: "100", CONNECTION_BUDGET_ENV: "7"}
    )
    assert (read.header_timeout, read.body_grace, read.body_min_rate, read.connection_budget) == (2.5, 3.0, 100.0, 7)
    for name, value in (
        (HEADER_TIMEOUT_ENV, "0"),
        (BODY_GRACE_ENV, "-1"),
        (BODY_MIN_RATE_ENV, "fast"),
        (HEADER_TIMEOUT_ENV, "inf"),
        (CONNECTION_BUDGET_ENV, "0"),
    ):
        with pytest.raises(ValueError, match=name):
            RequestDeadlines.from_environment({name: value})


def test_gymckpt_serve_refuses_a_bad_deadline_before_it_serves(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gymckpt", "serve", "counter", "--port", "0"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), HEADER_TIMEOUT_ENV: "soon"},
        capture_output=True,
        text=True,
        timeout=WAIT * 2,
    )
    assert result.returncode != 0
    assert HEADER_TIMEOUT_ENV in result.stdout + result.stderr
