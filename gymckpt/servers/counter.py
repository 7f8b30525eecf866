"""The counter resources server: exported session state is required for the right reward.

Routes (docs/reference-stack.md, "resources"):

- ``POST /seed_session`` ``{"task_input": {...}}`` → ``{"session": <id>}``: a fresh session,
  count 0 (seeding an existing session starts it over).
- ``POST /increment`` ``{"n": int}`` → ``{"count": int}`` (and ``"output"``, ``output_chars`` of
  text derived from the count, when configured: a tool's output). A session the server does not hold
  starts at 0 (so a continued rollout whose state was not restored gets the wrong count,
  not an error).
- ``POST /verify`` ``{"response": str, "expected": int}`` → ``{"reward": 1.0 | 0.0}``: 1.0 when
  the session's count equals ``expected``; the session ends (its state is freed).
- ``POST /close_session`` → ``{"closed": true}``: frees the session.

Sessions: with checkpointing on, a session is the capture key of the request's rollout
(``/ng-rollout/<key>/…``), and ``{"session": <key>}`` is only informative. With it off,
``/seed_session`` uses the ``x-session-id`` request header if given, else a new id, and the
caller passes the reply's ``session`` back in ``x-session-id`` on every later call.

Checkpoint declarations: ``checkpoint_mode = "exported"`` (state ``{"count", "calls"}``
per session), ``checkpoint_verify = "wait"``.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, ClassVar

from fastapi import Request  # noqa: TC002 - FastAPI resolves handler annotations at runtime
from pydantic import BaseModel, ConfigDict, Field

from gymckpt.errors import InvalidCheckpointState
from gymckpt.participants.resources import (
    CheckpointedResources,
    CheckpointMode,
    CheckpointVerify,
    ResourcesParticipant,
    seed_session_key,
    session_key,
)
from gymckpt.servers.base import ServerConfig, build_app

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["CounterConfig", "CounterServer", "build_counter_app"]


class CounterConfig(ServerConfig):
    """The counter server's config: the participant instance name and the ``checkpoint:`` block."""

    instance: str = "counter-0"
    #: characters of ``output`` text in each ``/increment`` reply (0: none), like a tool's output
    output_chars: int = Field(default=0, ge=0)


def tool_output(count: int, n: int, chars: int) -> str:
    """``chars`` characters of text derived from ``(count, n)``: the same increment gives the same output."""
    line = f"added {n}, count is now {count}; " + hashlib.sha256(f"{count}:{n}".encode()).hexdigest() + "\n"
    return (line * (chars // len(line) + 1))[:chars]


class SeedBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    task_input: dict[str, Any] = Field(default_factory=dict)


class IncrementBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    n: int


class VerifyBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    response: str = ""
    expected: int | None = None


class CounterServer(CheckpointedResources):
    """Per-session counters: ``{"count": int, "calls": int}``."""

    checkpoint_mode: ClassVar[CheckpointMode] = "exported"
    checkpoint_verify: ClassVar[CheckpointVerify] = "wait"

    def __init__(self) -> None:
        self.sessions: dict[str, dict[str, int]] = {}

    async def seed(self, key: str, task_input: dict[str, Any]) -> None:
        """Start ``key`` over at count 0."""
        self.sessions[key] = {"count": 0, "calls": 0}

    async def increment(self, key: str, n: int) -> int:
        """Add ``n`` to the session's count; return the count."""
        state = self.sessions.get(key)
        if state is None:
            state = self.sessions[key] = {"count": 0, "calls": 0}
            self.checkpoint_session_started(key)
        state["count"] += n
        state["calls"] += 1
        return state["count"]

    async def verify(self, key: str, expected: int | None) -> float:
        """1.0 when the count equals ``expected``; the session ends."""
        state = self.sessions.pop(key, None)
        count = state["count"] if state is not None else 0
        return 1.0 if expected is not None and count == expected else 0.0

    async def close(self, key: str) -> None:
        """Free the session."""
        self.sessions.pop(key, None)

    # --- checkpoint hooks

    async def export_session_states(self, session_ids: list[str]) -> dict[str, Any]:
        """Copies of the held sessions' states (a session not held was dropped)."""
        sessions = self.sessions
        return {key: dict(sessions[key]) for key in session_ids if key in sessions}

    async def restore_session_states(self, states: dict[str, Any]) -> None:
        """Install restored counters under their (next-attempt) keys, all or none.

        A state that is not ``{"count": int, "calls": int}`` is ``invalid_checkpoint_state``
        naming its session; nothing is installed then.
        """
        restored = {key: _counter_state(key, state) for key, state in states.items()}
        self.sessions.update(restored)

    async def retire_session_state(self, session_id: str) -> None:
        """Free the session, if held."""
        self.sessions.pop(session_id, None)


def _counter_state(key: str, state: Any) -> dict[str, int]:
    """A restored session state, checked: integer ``count`` and ``calls`` (booleans are not counts)."""
    if not isinstance(state, dict):
        raise InvalidCheckpointState(f"the counter state of session {key!r} is not an object: {type(state).__name__}")
    checked: dict[str, int] = {}
    for name in ("count", "calls"):
        value = state.get(name)
        if type(value) is not int:
            raise InvalidCheckpointState(
                f"the counter state of session {key!r} has no integer {name!r} (got {value!r:.80})",
            )
        checked[name] = value
    return checked


def build_counter_app(config: CounterConfig, server: CounterServer | None = None) -> FastAPI:
    """The counter server's app; checkpointing installed only when the config enables it.

    ``app.state.server`` is the :class:`CounterServer`, ``app.state.participant`` and
    ``app.state.plane`` the participant and control plane (None with checkpointing off).
    """
    server = server if server is not None else CounterServer()
    participant = ResourcesParticipant(server, config.instance) if config.checkpoint.enabled else None
    app, plane, _ = build_app("gymckpt counter", config, participant)
    app.state.server = server
    app.state.participant = participant
    app.state.plane = plane

    @app.post("/seed_session")
    async def seed_session(request: Request, body: SeedBody | None = None) -> dict[str, Any]:
        key = seed_session_key(request)
        await server.seed(key, body.task_input if body is not None else {})
        return {"session": key}

    @app.post("/increment")
    async def increment(request: Request, body: IncrementBody) -> dict[str, Any]:
        count = await server.increment(session_key(request), body.n)
        if config.output_chars:
            return {"count": count, "output": tool_output(count, body.n, config.output_chars)}
        return {"count": count}

    @app.post("/verify")
    async def verify(request: Request, body: VerifyBody) -> dict[str, Any]:
        return {"reward": await server.verify(session_key(request), body.expected)}

    @app.post("/close_session")
    async def close_session(request: Request) -> dict[str, Any]:
        await server.close(session_key(request))
        return {"closed": True}

    return app
