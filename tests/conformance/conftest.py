"""The wire-conformance suite: gymckpt driven with the reference stack's shapes (docs/wire.md).

- ``test_reference_controller``: :mod:`.reference_controller`, a controller written from the
  reference's documented wire, drives a stack of real ``gymckpt serve`` processes through
  a checkpoint, a SIGKILL of every server, a restore and the continuation.
- ``test_reference_bodies``: a table of reference-shaped bodies for every control route,
  against one in-process participant app (:class:`PlaneApp`), plus the environment's ``/run``.
- ``test_reference_coordinator``: gymckpt's Coordinator beside that controller, on servers
  that speak only the reference's shapes (``tests/control/coord_server``): the same bodies
  sent, the same outcome read.
- ``test_reference_fixtures``: checkpoints written byte for byte in the reference's on-disk
  format (:mod:`gymckpt.testing.reference_format`) verify and restore through gymckpt.

Helpers shared by those files live here (``from .conftest import …``).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from fastapi import FastAPI

from gymckpt.control.plane import ControlPlane
from gymckpt.control.routes import CONTROL_PREFIX, install_control
from gymckpt.servers.environment import EnvironmentConfig, build_environment_app
from gymckpt.testing.net import serve
from gymckpt.testing.participant import FakeParticipant
from tests.servers.env_support import FakeDownstream

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

TOKEN = "conformance-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: the bound of a control call's deadline in these tests (seconds from now)
DEADLINE_SECONDS = 30.0
#: how long a control plane may take to close (it has nothing to wait for)
CLOSE_BOUND = 5.0


def obj(rollout_id: str, attempt: int = 0) -> dict[str, Any]:
    """The reference's episode id object."""
    return {"rollout_id": rollout_id, "attempt": attempt}


def deadline() -> float:
    return time.time() + DEADLINE_SECONDS


def error_of(response: httpx.Response) -> str:
    """The code of an error reply, which must be exactly ``{"error": {"code", "detail"}}``."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "detail"}, body
    assert isinstance(body["error"]["code"], str) and isinstance(body["error"]["detail"], str), body
    return str(body["error"]["code"])


@dataclass
class PlaneApp:
    """One participant (a :class:`FakeParticipant`) behind gymckpt's control routes, in process."""

    fake: FakeParticipant
    plane: ControlPlane
    client: httpx.AsyncClient

    async def post(self, route: str, body: Any, *, auth: bool = True) -> httpx.Response:
        return await self.client.post(f"{CONTROL_PREFIX}/{route}", json=body, headers=AUTH if auth else {})

    async def status(self) -> dict[str, Any]:
        response = await self.client.get(f"{CONTROL_PREFIX}/status", headers=AUTH)
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]


def plane_app(fake: FakeParticipant) -> tuple[FastAPI, ControlPlane]:
    """An app with nothing but the control routes of ``fake``'s plane."""
    plane = ControlPlane(fake)
    app = FastAPI()
    install_control(app, plane, TOKEN)
    return app, plane


@asynccontextmanager
async def participant_app(fake: FakeParticipant | None = None) -> AsyncIterator[PlaneApp]:
    """:class:`PlaneApp` over ``fake`` (a fresh environment participant by default); the plane closed after."""
    participant = fake if fake is not None else FakeParticipant()
    app, plane = plane_app(participant)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://participant", timeout=60) as client:
            yield PlaneApp(participant, plane, client)
    finally:
        await close_plane(plane)


async def close_plane(plane: ControlPlane) -> None:
    """``plane.close()``, which must return within :data:`CLOSE_BOUND` seconds (a hang is a failure, not a wait)."""
    closing = asyncio.create_task(plane.close())
    await asyncio.wait({closing}, timeout=CLOSE_BOUND)
    if not closing.done():
        closing.cancel()
        await asyncio.gather(closing, return_exceptions=True)
        raise AssertionError(
            f"ControlPlane.close() did not return within {CLOSE_BOUND} s: its lease watcher still runs"
        )


@pytest.fixture
def downstream() -> Iterator[FakeDownstream]:
    """A fake agent and resources server in one app, on loopback (its gates opened after the test)."""
    fake = FakeDownstream()
    with serve(fake.app) as url:
        fake.url = url  # type: ignore[attr-defined]
        try:
            yield fake
        finally:
            for gate in fake.gates.values():
                gate.set()


def environment_app(downstream: FakeDownstream) -> FastAPI:
    """A fresh environment server's app (checkpointing on) calling ``downstream``."""
    url = downstream.url  # type: ignore[attr-defined]
    config = EnvironmentConfig(
        agent_url=url, resources_url=url, checkpoint={"enabled": True, "control_auth_token": TOKEN}
    )
    return build_environment_app(config)


def environment_client(downstream: FakeDownstream) -> httpx.AsyncClient:
    """An in-process client of a fresh environment server (:func:`environment_app`)."""
    transport = httpx.ASGITransport(app=environment_app(downstream))
    return httpx.AsyncClient(transport=transport, base_url="http://environment", timeout=60)


async def control(client: httpx.AsyncClient, route: str, **body: Any) -> httpx.Response:
    """One control call (the deadline filled in unless given)."""
    body.setdefault("deadline_ts", deadline())
    return await client.post(f"{CONTROL_PREFIX}/{route}", json=body, headers=AUTH)
