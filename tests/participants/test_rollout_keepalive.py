"""A request's episode never leaks into the next request of a kept-alive connection.

uvicorn (h11 on asyncio) starts a connection's next request in a copy of the context its
socket reader was last armed in, and it re-arms the reader from inside the previous
request's ``receive()`` (after a body past its 64 KiB high-water mark paused reading) or
``send()`` (after a pipelined request paused it). Those run inside the rollout-prefix
middleware, where the episode is set: without care, request 2 would run as request 1's
rollout. Here a real uvicorn process and one raw connection: request 1 with a rollout
prefix, request 2 without one (or with another rollout's), in both ways of re-arming.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from typing import TYPE_CHECKING, Any

import orjson
import pytest

from ..support import kill_group, start_uvicorn, uvicorn_port

if TYPE_CHECKING:
    from collections.abc import Iterator

START_SECONDS = 60.0
#: past uvicorn's 64 KiB high-water mark: reading pauses, and the app's receive() resumes it
BIG_BODY = 1024 * 1024


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, int]]:
    """The echo app in a real uvicorn process (h11 on asyncio), its host and port."""
    with tempfile.TemporaryFile() as log:
        process = start_uvicorn(
            [
                "--factory",
                "tests.participants.keepalive_app:app",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--http",
                "h11",
                "--loop",
                "asyncio",
                "--lifespan",
                "off",
            ],
            env=dict(os.environ),
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            deadline = time.monotonic() + START_SECONDS
            port = None
            while port is None:
                assert process.poll() is None, "uvicorn exited"
                assert time.monotonic() < deadline, "uvicorn did not start"
                log.seek(0)
                port = uvicorn_port(log.read().decode(errors="replace"))
                if port is None:
                    time.sleep(0.05)
            yield "127.0.0.1", port
        finally:
            kill_group(process, timeout=30)


def request(method: str, path: str, body: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nhost: test\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


class Replies:
    """HTTP replies read in order from one connection (Content-Length bodies, kept alive)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        assert chunk, f"the server closed the connection; read so far: {self.buffer!r}"
        self.buffer += chunk

    def next(self) -> Any:
        while b"\r\n\r\n" not in self.buffer:
            self._fill()
        head, _, rest = self.buffer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        length = next(
            int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
        )
        while len(rest) < length:
            self._fill()
            rest = self.buffer.partition(b"\r\n\r\n")[2]
        self.buffer = rest[length:]
        return orjson.loads(rest[:length])


def connect(server: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(server, timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


@pytest.mark.parametrize("second", ["/echo", "/ng-rollout/r2-a0/echo"], ids=["no-prefix", "other-rollout"])
def test_a_big_body_does_not_lend_its_episode_to_the_next_request(server: tuple[str, int], second: str) -> None:
    """Request 1's receive() re-arms the reader: request 2 must run as its own rollout, or none."""
    expected = None if second == "/echo" else "r2-a0"
    with connect(server) as sock:
        replies = Replies(sock)
        for _ in range(3):
            sock.sendall(request("POST", "/ng-rollout/r1-a0/echo", b"x" * BIG_BODY))
            assert replies.next() == {"episode": "r1-a0", "received": BIG_BODY}
            sock.sendall(request("POST", second, b"{}"))
            assert replies.next() == {"episode": expected, "received": 2}


def test_a_pipelined_request_does_not_run_as_the_one_before(server: tuple[str, int]) -> None:
    """Request 2 sent before request 1's reply starts from request 1's send(): still its own episode."""
    with connect(server) as sock:
        replies = Replies(sock)
        for _ in range(3):
            sock.sendall(request("POST", "/ng-rollout/r1-a0/echo", b"{}") + request("POST", "/echo", b"{}"))
            assert replies.next() == {"episode": "r1-a0", "received": 2}
            assert replies.next() == {"episode": None, "received": 2}
