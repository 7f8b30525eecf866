"""The fake inference backend: deterministic tokens, produced slowly, and a log of completed calls.

Not a Gym server and not a participant: it has no checkpoint routes and survives a Gym
crash, so tests and the demo can assert on its log that a restore makes no completed call
again.

- ``POST /generate`` ``{"call_id", "prompt", "seed", "max_tokens"}`` →
  ``{"call_id", "tokens", "text"}``. Tokens are a deterministic function of
  ``(seed, prompt)`` (a sha256-seeded :class:`random.Random`); a longer generation extends
  a shorter one. One token every ``token_delay_seconds``, so generations are in flight
  when a checkpoint is taken.
- ``GET /calls`` → every completed call in order,
  ``[{"call_id", "prompt_sha256", "seed", "tokens"}]``; ``POST /calls/reset`` empties it.

A generation whose client disconnects is abandoned and never logged.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import random
from typing import TYPE_CHECKING, Any

from fastapi import Request  # noqa: TC002 - FastAPI resolves handler annotations at runtime
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from gymckpt.control.responses import error_response
from gymckpt.errors import ClientDisconnected
from gymckpt.participants.signal import ChangeSignal
from gymckpt.servers.base import ServerConfig, build_app

if TYPE_CHECKING:
    from collections.abc import Callable

    from fastapi import FastAPI

__all__ = [
    "MAX_GENERATE_TOKENS",
    "VOCAB_SIZE",
    "GenerateRequest",
    "InferenceBackend",
    "InferenceConfig",
    "build_inference_app",
    "generate_tokens",
    "token_text",
]

#: token ids are drawn from ``range(VOCAB_SIZE)``
VOCAB_SIZE = 32_000
#: the most tokens one /generate may ask for
MAX_GENERATE_TOKENS = 1_000_000


class InferenceConfig(ServerConfig):
    """The inference backend's config: the simulated latency per token."""

    token_delay_seconds: float = Field(default=0.01, ge=0)


class GenerateRequest(BaseModel):
    """The body of ``POST /generate``."""

    model_config = ConfigDict(extra="forbid")

    call_id: str
    prompt: str
    seed: int
    max_tokens: int = Field(ge=0, le=MAX_GENERATE_TOKENS)


def _rng(seed: int, prompt: str) -> random.Random:
    digest = hashlib.sha256(f"{seed}\n{prompt}".encode()).digest()
    return random.Random(int.from_bytes(digest, "big"))


def generate_tokens(seed: int, prompt: str, max_tokens: int) -> list[int]:
    """The first ``max_tokens`` tokens of ``(seed, prompt)`` (what ``/generate`` answers, without delay)."""
    rng = _rng(seed, prompt)
    return [rng.randrange(VOCAB_SIZE) for _ in range(max_tokens)]


def token_text(tokens: list[int]) -> str:
    """The text of ``tokens``: their ids, space-separated."""
    return " ".join(map(str, tokens))


class InferenceBackend:
    """The generations in flight and the log of completed ones (one per app)."""

    def __init__(self, token_delay_seconds: float) -> None:
        self.token_delay_seconds = token_delay_seconds
        #: completed calls, in completion order
        self.calls: list[dict[str, Any]] = []
        #: generation serial → call_id, for generations not yet completed
        self.in_flight: dict[int, str] = {}
        #: generations abandoned because their client went away
        self.abandoned = 0
        self._serial = itertools.count()
        self._signal = ChangeSignal()

    def _changed(self) -> None:
        self._signal.changed()

    async def wait_until(self, predicate: Callable[[], bool], timeout: float | None = None) -> None:
        """Wait until ``predicate()`` holds, re-checked whenever a generation starts or ends."""
        await self._signal.wait_until(predicate, timeout)

    async def generate(self, request: GenerateRequest, disconnected: Callable[[], Any]) -> list[int] | None:
        """Produce the tokens one by one; None if the client went away before the end."""
        serial = next(self._serial)
        self.in_flight[serial] = request.call_id
        self._changed()
        rng = _rng(request.seed, request.prompt)
        tokens: list[int] = []
        try:
            for _ in range(request.max_tokens):
                await asyncio.sleep(self.token_delay_seconds)
                if await disconnected():
                    self.abandoned += 1
                    return None
                tokens.append(rng.randrange(VOCAB_SIZE))
            if await disconnected():
                self.abandoned += 1
                return None
            self.calls.append(
                {
                    "call_id": request.call_id,
                    "prompt_sha256": hashlib.sha256(request.prompt.encode()).hexdigest(),
                    "seed": request.seed,
                    "tokens": list(tokens),
                }
            )
            return tokens
        finally:
            del self.in_flight[serial]
            self._changed()


def build_inference_app(config: InferenceConfig) -> FastAPI:
    """The fake inference backend's app (no checkpoint routes, whatever the config says)."""
    app, _, _ = build_app("gymckpt inference", config, participant=None)
    backend = InferenceBackend(config.token_delay_seconds)
    app.state.backend = backend

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> JSONResponse:
        tokens = await backend.generate(body, request.is_disconnected)
        if tokens is None:  # nobody reads this reply
            return error_response(ClientDisconnected(body.call_id))
        return JSONResponse({"call_id": body.call_id, "tokens": tokens, "text": token_text(tokens)})

    @app.get("/calls")
    async def calls() -> list[dict[str, Any]]:
        return backend.calls

    @app.post("/calls/reset")
    async def reset() -> dict[str, int]:
        cleared = len(backend.calls)
        backend.calls.clear()
        return {"cleared": cleared}

    return app
