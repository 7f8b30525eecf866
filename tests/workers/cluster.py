"""One server with several workers, in one event loop: a coordinator and its plane, linked workers, their apps.

The coordinator (a real :class:`~gymckpt.control.plane.ControlPlane` over a
:class:`~gymckpt.workers.coordinator.CoordinatedParticipant`) listens on a real Unix socket
in ``tmp_path``; each worker is a :class:`~gymckpt.workers.link.WorkerLink` around a
:class:`~gymckpt.testing.participant.FakeParticipant`, with a FastAPI app whose control
routes call a :class:`~gymckpt.workers.remote_plane.RemotePlane`, driven by httpx.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI

from gymckpt.control.plane import ControlPlane
from gymckpt.control.routes import CONTROL_PREFIX, install_control
from gymckpt.store import open_store
from gymckpt.testing.participant import FakeParticipant
from gymckpt.testing.time import bounded, until
from gymckpt.workers.coordinator import CoordinatedParticipant
from gymckpt.workers.link import WorkerLink
from gymckpt.workers.remote_plane import RemotePlane
from gymckpt.workers.runtime import socket_path
from gymckpt.workers.worker_server import WorkerServer

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from gymckpt.control.participant import Participant

TOKEN = "workers-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
KIND, INSTANCE = "environment", "env-0"


def request(checkpoint_id: str = "c1", *, seconds: float = 20.0, **extra: Any) -> dict[str, Any]:
    """A control request body whose deadline is ``seconds`` from now."""
    return {"checkpoint_id": checkpoint_id, "deadline_ts": time.time() + seconds, **extra}


def control_app(plane: Any) -> FastAPI:
    """An app with the control routes over ``plane`` (a ControlPlane or a RemotePlane)."""
    app = FastAPI()
    install_control(app, plane, TOKEN)
    return app


def client_of(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server", timeout=60)


async def call(client: httpx.AsyncClient, route: str, body: dict[str, Any] | None = None) -> httpx.Response:
    """A control call: GET status, POST every other route."""
    url = f"{CONTROL_PREFIX}/{route}"
    if route == "status":
        return await bounded(client.get(url, headers=AUTH))
    return await bounded(client.post(url, json=body, headers=AUTH))


@dataclass
class Worker:
    """One linked worker: its participant, link, control client, index at the coordinator and lost calls."""

    fake: Any
    link: WorkerLink
    client: httpx.AsyncClient
    index: int
    lost: list[str] = field(default_factory=list)
    #: every (aliases, placements) the coordinator sent, in order
    routes: list[tuple[dict[str, str], dict[str, str]]] = field(default_factory=list)

    async def call(self, route: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return await call(self.client, route, body)


@dataclass
class Cluster:
    coordinator: CoordinatedParticipant
    plane: ControlPlane
    server: WorkerServer
    path: Path
    workers: list[Worker] = field(default_factory=list)

    async def add_worker(
        self, fake: Participant | None = None, *, routing_id: str | None = None, reads_store: bool = False
    ) -> Worker:
        """Connect one more worker (registered when this returns); its routing tables land in ``worker.routes``.

        ``reads_store``: the worker opens a restore's checkpoint directory itself (``install_share``).
        """
        fake = fake if fake is not None else FakeParticipant(self.coordinator.kind, INSTANCE)
        lost: list[str] = []
        routes: list[tuple[dict[str, str], dict[str, str]]] = []
        link = WorkerLink(
            fake,
            self.path,
            on_coordinator_lost=lambda: lost.append("lost"),
            routing_id=routing_id,
            on_routes=lambda aliases, placements: routes.append((aliases, placements)),
            open_store=open_store if reads_store else None,
        )
        before = set(self.coordinator.workers)
        await bounded(link.connect())
        (index,) = set(self.coordinator.workers) - before
        worker = Worker(fake, link, client_of(control_app(RemotePlane(link))), index, lost, routes)
        self.workers.append(worker)
        return worker

    async def remove(self, worker: Worker) -> None:
        """The worker leaves (its link disconnects); returns once the coordinator saw it go."""
        await bounded(worker.link.disconnect())
        await until(lambda: worker.index not in self.coordinator.workers, message="the coordinator kept the worker")
        self.workers.remove(worker)
        await worker.client.aclose()

    def reported(self) -> bool:
        """Every connected worker has a report of the current generation."""
        return all(entry.report is not None for entry in self.coordinator.workers.values())


@asynccontextmanager
async def cluster(
    tmp_path: Path,
    workers: int = 2,
    *,
    expected: int | None = None,
    fakes: list[Participant] | None = None,
    routing_ids: list[str | None] | None = None,
    kind: str = KIND,
    reads_store: bool | list[bool] = False,
) -> AsyncIterator[Cluster]:
    """A coordinator of ``kind`` expecting ``expected`` workers (default: ``workers``) and ``workers`` linked workers."""
    coordinator = CoordinatedParticipant(kind, INSTANCE, expected_workers=expected or workers)
    plane = ControlPlane(coordinator)
    server = WorkerServer(plane, path=socket_path(tmp_path, "env"))
    path = await server.start()
    running = Cluster(coordinator, plane, server, path)
    try:
        for number in range(workers):
            fake = fakes[number] if fakes is not None else None
            reads = reads_store[number] if isinstance(reads_store, list) else reads_store
            await running.add_worker(fake, routing_id=routing_ids[number] if routing_ids else None, reads_store=reads)
        yield running
    finally:
        for worker in running.workers:
            await worker.client.aclose()
            await bounded(worker.link.disconnect())
        await bounded(server.close())
        await bounded(plane.close())
