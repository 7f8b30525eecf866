"""Fake agent and resources servers for the environment tests, served by uvicorn in a thread
(:func:`gymckpt.testing.net.serve`)."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

if TYPE_CHECKING:
    pass


class FakeDownstream:
    """An agent and a resources server in one app, recording the calls they get."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.gates: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = {}
        self.verify_mode = "wait"
        #: how many more agent calls to refuse with 409 checkpoint_parked (after their gate)
        self.park_agent = 0
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
            if self.park_agent > 0:
                self.park_agent -= 1
                error = {"code": "checkpoint_parked", "detail": "a checkpoint is open; retry after resume"}
                return JSONResponse({"error": error}, status_code=409)  # type: ignore[return-value]
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
