"""The weather resources server: stateless tools and a verification that may run again.

Routes (docs/reference-stack.md, "resources"):

- ``POST /seed_session`` ``{"task_input": {...}}`` → ``{"session": <id>}`` (nothing is kept).
- ``POST /get_weather`` ``{"city": str}`` → ``{"forecast": str}``, a deterministic function of
  the city (sha256 of its stripped, lower-cased name).
- ``POST /verify`` ``{"response": str}`` → ``{"reward": 1.0}`` when the response mentions a
  forecast word (sunny, cloudy, …), else 0.0.
- ``POST /close_session`` → ``{"closed": true}``.

Sessions are named as on the counter server (capture key with checkpointing on, the
``x-session-id`` header or a new id with it off); no route needs one.

Checkpoint declarations: ``checkpoint_mode = "stateless"``, ``checkpoint_verify = "replay"``.
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING, Any, ClassVar

from fastapi import Request  # noqa: TC002 - FastAPI resolves handler annotations at runtime
from pydantic import BaseModel, ConfigDict

from gymckpt.participants.resources import (
    CheckpointedResources,
    CheckpointMode,
    CheckpointVerify,
    ResourcesParticipant,
    seed_session_key,
)
from gymckpt.servers.base import ServerConfig, build_app

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["FORECAST_WORDS", "WeatherConfig", "WeatherServer", "build_weather_app", "forecast"]

#: the conditions a forecast names; verify looks for any of them
FORECAST_WORDS = ("sunny", "cloudy", "rainy", "snowy", "windy", "foggy", "stormy")
_MENTION = re.compile(r"\b(" + "|".join(FORECAST_WORDS) + r")\b", re.IGNORECASE)


def forecast(city: str) -> str:
    """The forecast of ``city``: the same city always gets the same one."""
    digest = hashlib.sha256(city.strip().lower().encode()).digest()
    word = FORECAST_WORDS[digest[0] % len(FORECAST_WORDS)]
    return f"{word}, high of {digest[1] % 35 - 5} C"


class WeatherConfig(ServerConfig):
    """The weather server's config: the participant instance name and the ``checkpoint:`` block."""

    instance: str = "weather-0"


class CityBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    city: str


class VerifyBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    response: str = ""


class WeatherServer(CheckpointedResources):
    """No session state: every reply depends on its request only."""

    checkpoint_mode: ClassVar[CheckpointMode] = "stateless"
    checkpoint_verify: ClassVar[CheckpointVerify] = "replay"


def build_weather_app(config: WeatherConfig) -> FastAPI:
    """The weather server's app; checkpointing installed only when the config enables it."""
    server = WeatherServer()
    participant = ResourcesParticipant(server, config.instance) if config.checkpoint.enabled else None
    app, plane, _ = build_app("gymckpt weather", config, participant)
    app.state.server = server
    app.state.participant = participant
    app.state.plane = plane

    @app.post("/seed_session")
    async def seed_session(request: Request) -> dict[str, Any]:
        return {"session": seed_session_key(request)}

    @app.post("/get_weather")
    async def get_weather(body: CityBody) -> dict[str, Any]:
        return {"forecast": forecast(body.city)}

    @app.post("/verify")
    async def verify(body: VerifyBody) -> dict[str, Any]:
        return {"reward": 1.0 if _MENTION.search(body.response) else 0.0}

    @app.post("/close_session")
    async def close_session() -> dict[str, Any]:
        return {"closed": True}

    return app
