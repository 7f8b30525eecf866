"""Servers on loopback for tests: free ports, and an ASGI app served by uvicorn in the test's process.

- :func:`free_port`, :func:`free_ports`: ports the kernel just handed out, for a server the
  test starts itself (a subprocess, a stack spec).
- :func:`refused_url`: an address nobody answers on (a bound socket that never listens).
- :func:`serve`: an app under uvicorn in a thread of its own (the test may block).
- :func:`serve_in_loop`: an app under uvicorn in the test's own event loop.

Both serve on a socket that listens before uvicorn starts, so connections queue until
uvicorn serves them: nothing needs to wait for its start.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

import uvicorn

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

__all__ = ["free_port", "free_ports", "refused_url", "serve", "serve_in_loop"]

HOST = "127.0.0.1"
#: how long a server gets to stop, in seconds
STOP_SECONDS = 30.0


def free_ports(count: int, host: str = HOST) -> list[int]:
    """``count`` distinct ports the kernel just handed out (all held at once, then released)."""
    sockets = [socket.create_server((host, 0)) for _ in range(count)]
    try:
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port(host: str = HOST) -> int:
    """A port the kernel just handed out (released again: a server the test starts binds it)."""
    return free_ports(1, host)[0]


@contextmanager
def refused_url(host: str = HOST) -> Iterator[str]:
    """A URL whose connections are refused while the block runs.

    The port stays bound (never listening) so no other server can take it meanwhile, as
    one could a port that was free a moment ago.
    """
    sock = socket.socket()
    try:
        sock.bind((host, 0))
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        sock.close()


def _listening(host: str) -> tuple[socket.socket, str]:
    sock = socket.socket()
    sock.bind((host, 0))
    sock.listen(128)  # connections queue until uvicorn serves them
    return sock, f"http://{host}:{sock.getsockname()[1]}"


def _server(app: Any, graceful_shutdown: float | None) -> uvicorn.Server:
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=graceful_shutdown)
    return uvicorn.Server(config)


@contextmanager
def serve(app: Any, *, host: str = HOST, graceful_shutdown: float | None = None) -> Iterator[str]:
    """Serve ``app`` with uvicorn on ``host`` (a free port) in a thread; yield its base URL.

    ``graceful_shutdown``: seconds uvicorn waits for open connections when the block ends
    (None: until they close).
    """
    sock, url = _listening(host)
    server = _server(app, graceful_shutdown)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=STOP_SECONDS)
        sock.close()


@asynccontextmanager
async def serve_in_loop(app: Any, *, host: str = HOST, graceful_shutdown: float | None = 5.0) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on ``host`` (a free port) in this event loop; yield its base URL."""
    sock, url = _listening(host)
    server = _server(app, graceful_shutdown)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield url
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, STOP_SECONDS)
        sock.close()
