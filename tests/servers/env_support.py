"""Fake agent and resources servers for the environment tests, served by uvicorn in a thread."""

from __future__ import annotations

import asyncio
import socket
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

if TYPE_CHECKING:
    from collections.abc import Iterator


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 (a free port) in a thread; yield its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # connections queue until uvicorn serves them: no need to wait for its start
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


class FakeDownstream:
    """An agent and a resources server in one app, recording the calls they get."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.gates: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = {}
        self.verify_mode = "wait"
        self.app = FastAPI()
        app = self.app

        async def hold(name: str) -> None:
            if name in self.entered:
                self.entered[name].set()
            gate = self.gates.get(name)
            if gate is not None:
                assert await asyncio.to_thread(gate.wait, 30), f"gate {name} never opened"

        @app.post("/{prefix:path}/seed_session")
        @app.post("/seed_session")
        async def seed(request: Request, prefix: str = "") -> JSONResponse:
            self.calls.append(("seed", request.url.path))
            await hold("seed")
            return JSONResponse({"session": "s"}, headers={"x-ng-checkpoint-verify": self.verify_mode})

        @app.post("/{prefix:path}/v1/responses")
        @app.post("/v1/responses")
        async def responses(request: Request, prefix: str = "") -> dict[str, Any]:
            self.calls.append(("agent", request.url.path))
            await hold("agent")
            return {"output_text": "answer 7", "turns": 2, "expected": 7}

        @app.post("/{prefix:path}/close_session")
        @app.post("/close_session")
        async def close(request: Request, prefix: str = "") -> dict[str, Any]:
            self.calls.append(("close", request.url.path))
            await hold("close")
            return {"closed": True}

        @app.post("/{prefix:path}/verify")
        @app.post("/verify")
        async def verify(request: Request, prefix: str = "") -> dict[str, Any]:
            body = await request.json()
            self.calls.append(("verify", request.url.path))
            await hold("verify")
            return {"reward": 1.0 if body.get("expected") == 7 else 0.0}
