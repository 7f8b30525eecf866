"""Helpers for the resources tests: bounded async runs, an in-process client, the control
routes, and a resources server whose requests a test can hold open.

Tests are plain functions that call :func:`run`: every test coroutine, and every wait in
it, is bounded, so a hang fails the test instead of blocking the run. Nothing sleeps to
synchronize: a test awaits events its server sets, or lets the event loop run
(``asyncio.sleep(0)``) until a condition holds.
"""

from __future__ import annotations

import asyncio
import functools
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import httpx
from fastapi import Request
from pydantic import BaseModel, ConfigDict

from gymckpt.participants.resources import (
    CheckpointedResources,
    CheckpointMode,
    CheckpointVerify,
    ResourcesParticipant,
    seed_session_key,
    session_key,
)
from gymckpt.servers.base import ServerConfig, build_app, load_server_config
from gymckpt.testing.time import bounded as bounded_
from gymckpt.testing.time import run_bounded
from gymckpt.testing.time import until as until_

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from fastapi import FastAPI

TOKEN = "resources-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CONTROL = "/ng-control/v1/checkpoint"
#: the bound of every wait, in seconds
WAIT = 15.0
#: the bound of a whole test
TEST_TIMEOUT = 60.0


#: run a test coroutine in a fresh event loop, bounded by :data:`TEST_TIMEOUT`
run = functools.partial(run_bounded, timeout=TEST_TIMEOUT)
#: await for at most :data:`WAIT` seconds
bounded = functools.partial(bounded_, timeout=WAIT)
#: let the event loop run until ``condition()`` holds (no time passes on purpose: at most 10 000 turns)
until = functools.partial(until_, timeout=None, rounds=10_000)


def config(cls: type[ServerConfig] = ServerConfig, *, enabled: bool = True, **fields: Any) -> Any:
    """A server config with checkpointing on (token :data:`TOKEN`) or off."""
    block: dict[str, Any] = {"enabled": True, "control_auth_token": TOKEN} if enabled else {}
    return load_server_config(cls, {"checkpoint": block, **fields})


def rp(key: str, path: str) -> str:
    """``path`` for the episode ``key``: ``/ng-rollout/<key><path>``."""
    return f"/ng-rollout/{key}{path}"


@asynccontextmanager
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client that calls ``app`` in process."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://resources") as http:
        yield http


class Control:
    """The control routes of one app, with the bearer token; every call returns the response."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    async def call(self, name: str, checkpoint_id: str, seconds: float = 10.0, **fields: Any) -> httpx.Response:
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": time.time() + seconds, **fields}
        return await bounded(self.http.post(f"{CONTROL}/{name}", json=body, headers=AUTH))

    async def status(self) -> dict[str, Any]:
        response = await bounded(self.http.get(f"{CONTROL}/status", headers=AUTH))
        assert response.status_code == 200, response.text
        return response.json()

    async def prepare(self, checkpoint_id: str, seconds: float = 10.0) -> dict[str, Any]:
        response = await self.call("prepare", checkpoint_id, seconds)
        assert response.status_code == 200, response.text
        return response.json()

    async def commit(self, checkpoint_id: str, directory: str, scope: list[str], **body: Any) -> httpx.Response:
        return await self.call("commit", checkpoint_id, checkpoint_dir=directory, episode_ids=scope, **body)

    async def resume(self, checkpoint_id: str) -> dict[str, Any]:
        response = await self.call("resume", checkpoint_id)
        assert response.status_code == 200, response.text
        return response.json()

    async def restore(self, checkpoint_id: str, directory: str, scope: list[str]) -> dict[str, Any]:
        response = await self.call("restore", checkpoint_id, checkpoint_dir=directory, episode_ids=scope)
        assert response.status_code == 200, response.text
        return response.json()

    async def retire(self, keys: list[str], checkpoint_id: str = "retire") -> dict[str, Any]:
        response = await self.call("retire", checkpoint_id, episode_ids=keys)
        assert response.status_code == 200, response.text
        return response.json()

    async def checkpoint(self, checkpoint_id: str, directory: str, scope: list[str]) -> dict[str, Any]:
        """Prepare (must be ready), commit and resume; return the commit reply."""
        prepared = await self.prepare(checkpoint_id)
        assert prepared["report"]["ready"], prepared
        committed = await self.commit(checkpoint_id, directory, scope)
        assert committed.status_code == 200, committed.text
        await self.resume(checkpoint_id)
        return committed.json()


class GateBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    gate: str | None = None


class Gates:
    """Named points a request holds at until the test opens them."""

    def __init__(self) -> None:
        self.entered: dict[str, asyncio.Event] = {}
        self.gates: dict[str, asyncio.Event] = {}

    def entered_event(self, name: str) -> asyncio.Event:
        return self.entered.setdefault(name, asyncio.Event())

    def close(self, name: str) -> None:
        """Requests reaching ``name`` hold there until :meth:`open`."""
        self.gates[name] = asyncio.Event()

    def open(self, name: str) -> None:
        self.gates[name].set()

    async def hold(self, name: str | None) -> None:
        if name is None:
            return
        self.entered_event(name).set()
        gate = self.gates.get(name)
        if gate is not None:
            await bounded(gate.wait())


class GatedServer(CheckpointedResources):
    """Sessions ``{"calls": int}``; ``/tool`` and ``/verify`` can hold at a named gate.

    Subclasses (see :func:`gated_server`) declare the mode and verify mode.
    """

    checkpoint_mode: ClassVar[CheckpointMode] = "exported"
    checkpoint_verify: ClassVar[CheckpointVerify] = "wait"

    def __init__(self) -> None:
        self.sessions: dict[str, dict[str, int]] = {}
        self.gates = Gates()
        self.retired: list[str] = []
        self.restored: list[dict[str, Any]] = []
        self.exported: list[list[str]] = []
        self.parked: list[list[str]] = []

    def drop(self, key: str) -> None:
        """Lose a session without telling the participant."""
        del self.sessions[key]

    async def export_session_states(self, session_ids: list[str]) -> dict[str, Any]:
        self.exported.append(list(session_ids))
        return {key: dict(self.sessions[key]) for key in session_ids if key in self.sessions}

    async def restore_session_states(self, states: dict[str, Any]) -> None:
        self.restored.append(states)
        for key, state in states.items():
            self.sessions[key] = dict(state)

    async def park_session_states(self, session_ids: list[str]) -> None:
        self.parked.append(list(session_ids))

    async def retire_session_state(self, session_id: str) -> None:
        self.retired.append(session_id)
        self.sessions.pop(session_id, None)


def gated_server(mode: CheckpointMode = "exported", verify: CheckpointVerify = "wait") -> GatedServer:
    """A :class:`GatedServer` of a subclass declaring ``mode`` and ``verify``."""
    cls = type(f"Gated_{mode}_{verify}", (GatedServer,), {"checkpoint_mode": mode, "checkpoint_verify": verify})
    return cls()


def build_gated_app(server: GatedServer, *, enabled: bool = True) -> FastAPI:
    """An app serving ``server``: ``/seed_session``, ``/tool``, ``/verify``, ``/close_session``."""
    participant = ResourcesParticipant(server, "gated-0") if enabled else None
    app, plane, _ = build_app("gated resources", config(enabled=enabled), participant)
    app.state.server = server
    app.state.participant = participant
    app.state.plane = plane

    @app.post("/seed_session")
    async def seed_session(request: Request) -> dict[str, Any]:
        key = seed_session_key(request)
        server.sessions[key] = {"calls": 0}
        return {"session": key}

    @app.post("/tool")
    async def tool(request: Request, body: GateBody) -> dict[str, Any]:
        key = session_key(request)
        await server.gates.hold(body.gate)
        state = server.sessions.setdefault(key, {"calls": 0})
        state["calls"] += 1
        return {"calls": state["calls"]}

    @app.post("/verify")
    async def verify(request: Request, body: GateBody) -> dict[str, Any]:
        key = session_key(request)
        await server.gates.hold(body.gate)
        return {"reward": float(server.sessions.get(key, {}).get("calls", 0))}

    @app.post("/close_session")
    async def close_session(request: Request) -> dict[str, Any]:
        server.sessions.pop(session_key(request), None)
        return {"closed": True}

    return app
