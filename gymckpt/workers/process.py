"""The two sides of a server started with several workers: the main process's coordinator
thread, and what each worker process installs into its app.

The main process (``gymckpt serve KIND --workers N`` or ``--app MODULE:ATTR``) runs :class:`CoordinatorThread`: an
event loop of its own holding the server's one control plane, its
:class:`~gymckpt.workers.coordinator.CoordinatedParticipant` and the
:class:`~gymckpt.workers.worker_server.WorkerServer` its workers connect to, while uvicorn's
supervisor runs in the main thread. It tells its workers where to connect through
:data:`ENV_SOCKET`, :data:`ENV_RUNTIME` (the runtime directory, which also holds the
routing secret and every worker's private socket) and :data:`ENV_WORKERS`.

A worker process finds those variables and :func:`install_worker` wires its app: the
participant's middleware and the rollout prefix as in one process, control routes served
by a :class:`~gymckpt.workers.remote_plane.RemotePlane`, a
:class:`~gymckpt.workers.link.WorkerLink` connected at startup, and a
:class:`~gymckpt.workers.routing.SessionRouter` outermost, with the worker's private socket
served next to the shared port.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gymckpt.control.allowed_roots import open_allowed_store
from gymckpt.control.routes import install_control
from gymckpt.participants.install import create_control_plane
from gymckpt.participants.rollout import RolloutPrefixMiddleware
from gymckpt.store.warm import warm_storage
from gymckpt.workers.coordinator import CoordinatedParticipant
from gymckpt.workers.link import WorkerLink
from gymckpt.workers.remote_plane import RemotePlane
from gymckpt.workers.routing import RoutingTables, SessionRouter, SessionSigner, derive_secret, serve_private_socket
from gymckpt.workers.runtime import process_runtime_dir
from gymckpt.workers.worker_server import WorkerServer

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from fastapi import FastAPI

    from gymckpt.control.participant import Participant
    from gymckpt.control.plane import ControlPlane
    from gymckpt.control.settings import CheckpointSettings
    from gymckpt.store.checkpoint_store import CheckpointStore

__all__ = [
    "ENV_RUNTIME",
    "ENV_SOCKET",
    "ENV_WORKERS",
    "ROUTED_KINDS",
    "SECRET_FILE",
    "CoordinatorThread",
    "install_worker",
    "worker_environment",
    "write_routing_secret",
]

logger = logging.getLogger(__name__)

#: the coordinator's Unix socket (set for the workers of a server with checkpointing on)
ENV_SOCKET = "GYMCKPT_WORKER_SOCKET"
#: the main process's runtime directory: the routing secret and the workers' private sockets
ENV_RUNTIME = "GYMCKPT_WORKER_RUNTIME"
#: how many workers the server runs
ENV_WORKERS = "GYMCKPT_WORKERS"
#: the routing secret's file in the runtime directory (0600, hex)
SECRET_FILE = "routing-secret"
#: participant kinds whose state spans requests (sessions, a model's capture ledger): their replies
#: stamp the owner, so an episode's later calls reach the worker that holds its state
ROUTED_KINDS = frozenset({"resources", "agent", "model"})


def write_routing_secret(runtime: Path, token: str | None, server: str) -> Path:
    """Write the routing secret every worker of ``server`` signs its session cookies with.

    With a token it is derived from the token and the server's name (``<kind>/<instance>``):
    the same after a restart, so cookies from before a crash still verify, and different
    for every server of a stack, so a cookie one server stamped is never taken as another's
    (callers pass them along to the servers they call). Without a token it is random.
    """
    path = runtime / SECRET_FILE
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(derive_secret(f"{token}\n{server}" if token else None).hex())
    return path


def _read_routing_secret(runtime: Path) -> bytes:
    return bytes.fromhex((runtime / SECRET_FILE).read_text().strip())


class CoordinatorThread:
    """The main process's coordinator: the control plane and the worker socket, on a thread's event loop."""

    def __init__(self, kind: str, instance: str, block: CheckpointSettings, *, workers: int) -> None:
        self.participant = CoordinatedParticipant(kind, instance, expected_workers=workers)
        self.block = block
        self.loop = asyncio.new_event_loop()
        self.plane: ControlPlane | None = None
        self.server: WorkerServer | None = None
        self._thread = threading.Thread(target=self._run, name=f"gymckpt-{kind}-coordinator", daemon=True)
        self._started = threading.Event()
        self._failure: BaseException | None = None

    def start(self, timeout: float = 30.0) -> Path:
        """Start the thread and listen; returns the worker socket's path."""
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError("the checkpoint coordinator did not start in time")
        if self._failure is not None:
            raise self._failure
        assert self.server is not None and self.server.path is not None
        return self.server.path

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._start())
        except BaseException as exc:  # reported to start()
            self._failure = exc
            self._started.set()
            return
        self._started.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        self.plane = create_control_plane(self.participant, self.block)
        self.server = WorkerServer(self.plane)
        await self.server.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Close the workers' connections and the plane, then stop the loop."""
        if not self._thread.is_alive():
            return

        async def close() -> None:
            if self.server is not None:
                await self.server.close()
            if self.plane is not None:
                await self.plane.close()

        try:
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout)
        except Exception:
            logger.warning("the checkpoint coordinator did not close cleanly", exc_info=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)


def worker_environment(block: CheckpointSettings | None, workers: int, server: str) -> dict[str, str]:
    """The variables the workers of ``server`` (``<kind>/<instance>``) need; the coordinator's
    socket is added once it listens. Writes the routing secret into this process's runtime directory.
    """
    runtime = process_runtime_dir().path
    write_routing_secret(runtime, block.token if block is not None else None, server)
    return {ENV_RUNTIME: str(runtime), ENV_WORKERS: str(workers)}


def _private_socket(runtime: Path, routing_id: str) -> Path:
    return runtime / f"{routing_id}.sock"


def install_worker(
    app: FastAPI, participant: Participant | None, block: CheckpointSettings | None, environ: dict[str, str]
) -> RemotePlane | None:
    """Wire a worker's app: routing always; with a participant, the link and the remote control routes.

    ``environ`` holds :data:`ENV_RUNTIME` (and :data:`ENV_SOCKET` with checkpointing on).
    Returns the worker's :class:`RemotePlane`, or None without checkpointing.
    """
    runtime = Path(environ[ENV_RUNTIME])
    routing_id = uuid.uuid4().hex
    tables = RoutingTables()
    link: WorkerLink | None = None
    plane: RemotePlane | None = None
    if participant is not None and block is not None:
        if not environ.get(ENV_SOCKET):
            raise RuntimeError(
                f"this worker has checkpointing on but no coordinator ({ENV_SOCKET} is unset): start several "
                "workers with `gymckpt serve KIND --workers N` (your own app: `gymckpt serve --app MODULE:ATTR "
                "--workers N`), which runs the coordinator in the main process"
            )
        settings = block
        warm_storage(block.allowed_roots, block.storage_options)  # a restore's share is read here

        def open_checkpoint(checkpoint_dir: str) -> CheckpointStore:
            return open_allowed_store(checkpoint_dir, settings.allowed_roots, **settings.storage_options)

        link = WorkerLink(
            participant,
            environ[ENV_SOCKET],
            routing_id=routing_id,
            on_routes=tables.replace,
            open_store=open_checkpoint,
        )
        plane = RemotePlane(link)
        participant.bind(plane)  # type: ignore[arg-type]  # what the participant asks of it, a RemotePlane has
        participant.exempt_paths = participant.exempt_paths | frozenset(block.exempt_paths)
        if participant.middleware is not None:
            app.add_middleware(participant.middleware, participant=participant)
        app.add_middleware(RolloutPrefixMiddleware)
        install_control(app, plane, block.token)
    routers: list[SessionRouter] = []
    kind = participant.kind if participant is not None else ""

    class _Router(SessionRouter):
        def __init__(self, inner: Any) -> None:
            super().__init__(
                inner,
                routing_id=routing_id,
                socket_dir=runtime,
                signer=SessionSigner(_read_routing_secret(runtime)),
                tables=tables,
                stamp=kind in ROUTED_KINDS,
            )
            routers.append(self)

    app.add_middleware(_Router)
    app.state.routing_id = routing_id
    app.state.routing_tables = tables
    app.state.worker_link = link
    inner_lifespan = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app_: Any) -> AsyncIterator[Any]:
        async with serve_private_socket(app_, _private_socket(runtime, routing_id)):
            if link is not None:
                await link.connect()
            try:
                async with inner_lifespan(app_) as state:
                    yield state
            finally:
                if link is not None:
                    await link.disconnect()
                for router in routers:
                    await router.close()

    app.router.lifespan_context = lifespan
    return plane
