"""What every reference server shares: its config, its app, and its downstream client."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
import orjson
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from gymckpt.control.responses import handle_gymckpt_error
from gymckpt.control.settings import CheckpointSettings, GymckptSettings, read_yaml_file
from gymckpt.errors import DownstreamError, GymckptError
from gymckpt.identity import rollout_path
from gymckpt.participants.install import install_checkpointing
from gymckpt.participants.rollout import SESSION_HEADER, SessionHeaderMiddleware, current_episode

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from pathlib import Path

    from gymckpt.control.participant import Participant
    from gymckpt.control.plane import ControlPlane
    from gymckpt.identity import EpisodeId

__all__ = [
    "HEALTH_PATH",
    "Downstream",
    "DownstreamError",
    "ServerConfig",
    "add_health_route",
    "build_app",
    "load_server_config",
]

C = TypeVar("C", bound="ServerConfig")


class ServerConfig(BaseModel):
    """A server's config file: its own fields plus the ``checkpoint:`` block."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    #: data connection pool size towards downstream servers (0: no limit)
    data_connector_limit: int = Field(default=0, ge=0)


def load_server_config(cls: type[C], source: str | Path | dict[str, Any] | None = None) -> C:
    """Read ``cls`` from a YAML file or dict; ``GYMCKPT_CHECKPOINT__…`` variables override the block.

    A file YAML cannot parse raises ``ValueError("<file>: invalid YAML at line L, column C: …")``.
    """
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, dict):
        data = dict(source)
    else:
        loaded = read_yaml_file(source) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{source}: a server config must be a mapping")
        data = loaded
    block = GymckptSettings(**({"checkpoint": data["checkpoint"]} if "checkpoint" in data else {})).checkpoint
    data["checkpoint"] = block
    return cls.model_validate(data)


class Downstream:
    """Calls to other servers for an episode, on a data pool of their own.

    With checkpointing on, a call made for an episode (given, or the current request's)
    goes to ``/ng-rollout/<capture key><path>``; with it off, to ``<path>`` unchanged with
    the episode named in the ``x-session-id`` header, the reference servers' session.
    """

    def __init__(self, *, checkpointing: bool, connector_limit: int = 0) -> None:
        self.checkpointing = checkpointing
        self._limit = connector_limit
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._limit), timeout=aiohttp.ClientTimeout(total=None)
            )
        return self._session

    def url(self, base: str, path: str, episode: EpisodeId | None = None) -> str:
        """The URL of ``path`` on ``base`` for ``episode`` (or the current request's)."""
        episode = episode if episode is not None else current_episode()
        if self.checkpointing and episode is not None:
            path = rollout_path(episode, path)
        return base.rstrip("/") + path

    async def post(
        self, base: str, path: str, body: Any, *, episode: EpisodeId | None = None
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """POST JSON; return the decoded reply and its headers (lower-cased names)."""
        url = self.url(base, path, episode)
        headers = {"Content-Type": "application/json"}
        episode = episode if episode is not None else current_episode()
        if not self.checkpointing and episode is not None:
            headers[SESSION_HEADER] = episode.capture_key  # no rollout prefix: name the session instead
        async with self._client().post(url, data=orjson.dumps(body), headers=headers) as response:
            raw = await response.read()
            headers = {name.lower(): value for name, value in response.headers.items()}
            if response.status >= 400:
                raise DownstreamError.answered(url, response.status, raw)
        return orjson.loads(raw) if raw else {}, headers

    async def close(self) -> None:
        """Close the data pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None


#: every reference server answers ``GET /health`` with ``{"status": "ok"}``, checkpointing on or off
HEALTH_PATH = "/health"


def add_health_route(app: FastAPI) -> None:
    """``GET /health`` → 200 ``{"status": "ok"}``: a probe, never fenced (``UNFENCED_PATHS``)."""

    @app.get(HEALTH_PATH, tags=["health"])
    async def health() -> dict[str, str]:
        return {"status": "ok"}


def build_app(
    title: str,
    config: ServerConfig,
    participant: Participant | None,
    *,
    on_shutdown: list[Callable[[], Any]] | None = None,
    plane: ControlPlane | None = None,
) -> tuple[FastAPI, ControlPlane | None, Downstream]:
    """A FastAPI app with checkpointing installed as ``config`` says, and its downstream client.

    What runs once per server is the control plane (it owns the checkpoint phases and opens
    the stores): pass one made by :func:`~gymckpt.participants.install.create_control_plane`
    as ``plane``, or one is made here. The app, its middleware and its downstream data pool
    are what each worker process has of its own.
    """
    downstream = Downstream(checkpointing=config.checkpoint.enabled, connector_limit=config.data_connector_limit)
    closers = [downstream.close, *(on_shutdown or [])]

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        for close in closers:
            result = close()
            if hasattr(result, "__await__"):
                await result

    app = FastAPI(title=title, lifespan=lifespan)
    add_health_route(app)
    app.add_exception_handler(GymckptError, handle_gymckpt_error)  # every reference server: one error body
    if participant is not None:
        plane = install_checkpointing(app, participant, config.checkpoint, plane=plane)
    if not config.checkpoint.enabled:
        app.add_middleware(SessionHeaderMiddleware)
    if plane is not None:
        closers.append(plane.close)
    return app, plane, downstream
