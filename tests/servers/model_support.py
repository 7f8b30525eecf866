"""Helpers for the inference and model server tests: servers in the test's own event loop.

The inference app runs under uvicorn on 127.0.0.1 (a free port) in the test's event loop,
behind a :class:`GenerateGate` the test can close, so a generation stays in flight exactly
as long as the test wants. The model app is driven in process (httpx's ASGI transport),
or by hand (:class:`AsgiCall`) when a test must pause a streamed reply mid-way. Every wait
is bounded by :data:`TIMEOUT`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from gymckpt.control.routes import CONTROL_PREFIX
from gymckpt.participants.signal import ChangeSignal
from gymckpt.servers.inference import InferenceBackend, InferenceConfig, build_inference_app
from gymckpt.servers.model import ModelServerConfig, build_model_app
from gymckpt.testing.net import serve_in_loop
from gymckpt.testing.time import bounded as bounded_
from gymckpt.testing.time import run_bounded

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Coroutine

    from fastapi import FastAPI

    from gymckpt.control.plane import ControlPlane
    from gymckpt.participants.model import ModelParticipant

#: every wait in these tests is bounded by this many seconds
TIMEOUT = 30.0
TOKEN = "model-token"


def run(main: Callable[[], Coroutine[Any, Any, None]], timeout: float = 120.0) -> None:
    """Run an async test body in a fresh event loop, bounded."""
    run_bounded(main(), timeout)


#: await for at most :data:`TIMEOUT` seconds (a hang fails the test)
bounded = functools.partial(bounded_, timeout=TIMEOUT)


class GenerateGate:
    """An ASGI wrapper: ``/generate`` requests wait here while the gate is closed."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.arrivals = 0
        self.finished = 0
        self.is_open = asyncio.Event()
        self.is_open.set()
        self._changes = ChangeSignal()

    def close(self) -> None:
        self.is_open.clear()

    def open(self) -> None:
        self.is_open.set()

    async def until(self, predicate: Callable[[GenerateGate], bool], timeout: float = TIMEOUT) -> None:
        """Wait until ``predicate(self)`` holds (re-checked on every arrival and finish)."""
        await self._changes.wait_until(lambda: predicate(self), timeout)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/generate":
            await self.app(scope, receive, send)
            return
        self.arrivals += 1
        self._changes.changed()
        try:
            await self.is_open.wait()
            await self.app(scope, receive, send)
        finally:
            self.finished += 1
            self._changes.changed()


@dataclass
class Inference:
    """A running inference backend: its URL, its state and its gate."""

    url: str
    backend: InferenceBackend
    gate: GenerateGate


@asynccontextmanager
async def inference_server(token_delay_seconds: float = 0.0) -> AsyncIterator[Inference]:
    """The fake inference backend behind a gate, served in this event loop."""
    app = build_inference_app(InferenceConfig(token_delay_seconds=token_delay_seconds))
    gate = GenerateGate(app)
    try:
        async with serve_in_loop(gate) as url:
            yield Inference(url, app.state.backend, gate)
    finally:
        gate.open()


@dataclass
class Model:
    """A model app in process: its client, participant and plane (None when checkpointing is off)."""

    app: FastAPI
    client: httpx.AsyncClient

    @property
    def participant(self) -> ModelParticipant:
        participant = self.app.state.participant
        assert participant is not None
        return participant  # type: ignore[no-any-return]

    @property
    def plane(self) -> ControlPlane:
        plane = self.app.state.plane
        assert plane is not None
        return plane  # type: ignore[no-any-return]

    async def respond(self, key: str | None, body: dict[str, Any]) -> httpx.Response:
        """POST /v1/responses for the attempt ``key`` (with its rollout prefix; None: without)."""
        path = "/v1/responses" if key is None else f"/ng-rollout/{key}/v1/responses"
        return await self.client.post(path, json=body)

    async def control(self, op: str, **body: Any) -> httpx.Response:
        """A control call with the bearer token; the deadline defaults to 30 s from now."""
        body.setdefault("deadline_ts", time.time() + TIMEOUT)
        return await self.client.post(f"{CONTROL_PREFIX}/{op}", json=body, headers={"Authorization": f"Bearer {TOKEN}"})


def model_config(inference_url: str, *, enabled: bool = True, **fields: Any) -> ModelServerConfig:
    """A model server config with checkpointing on (token :data:`TOKEN`) or off."""
    block = {"enabled": True, "control_auth_token": TOKEN} if enabled else {"enabled": False}
    return ModelServerConfig(inference_url=inference_url, checkpoint=block, **fields)


@asynccontextmanager
async def model_server(inference_url: str, *, enabled: bool = True, **fields: Any) -> AsyncIterator[Model]:
    """A model app (lifespan run, so its pools close) with an in-process client."""
    app = build_model_app(model_config(inference_url, enabled=enabled, **fields))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://model", timeout=TIMEOUT) as client:
            yield Model(app, client)


class AsgiCall:
    """One POST driven through an ASGI app by hand, so the test sees each body chunk as it is sent.

    With ``pause_after_first_chunk`` the app's ``send`` of the first body chunk does not
    return until :meth:`resume` — the reply is stuck mid-stream, as behind a slow reader.
    """

    def __init__(self, app: Any, path: str, body: dict[str, Any], *, pause_after_first_chunk: bool = False) -> None:
        self.app = app
        self.path = path
        self.body = json.dumps(body).encode()
        self.status: int | None = None
        self.chunks: list[bytes] = []
        self.started = asyncio.Event()
        self.first_chunk = asyncio.Event()
        self.finished = asyncio.Event()
        self._sending = asyncio.Event()
        if not pause_after_first_chunk:
            self._sending.set()

    def resume(self) -> None:
        self._sending.set()

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)

    async def run(self) -> None:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"model"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(self.body)).encode()),
            ],
            "client": ("127.0.0.1", 50000),
            "server": ("model", 80),
        }
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": self.body, "more_body": False}
            await self.finished.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]
                self.started.set()
            elif message["type"] == "http.response.body" and message.get("body"):
                self.chunks.append(bytes(message["body"]))
                if not self.first_chunk.is_set():
                    self.first_chunk.set()
                    await self._sending.wait()

        try:
            await self.app(scope, receive, send)
        finally:
            self.finished.set()


def parse_sse(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    """``(event name, decoded data)`` of every Server-Sent Event in ``data``."""
    events = []
    for block in data.decode().split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((fields["event"], json.loads(fields["data"])))
    return events
