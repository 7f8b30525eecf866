"""A tool (resources) server of your own, made a checkpoint participant: one notes list per rollout.

Routes (the shape every resources server has):

- ``POST /seed_session`` ``{}`` → ``{"session": <key>}``: a new, empty notes list.
- ``POST /add_note`` (the tool) any JSON object → ``{"notes": [...]}``: the object is appended.
- ``POST /verify`` ``{"expected": int}`` → ``{"reward": 1.0 | 0.0}``: 1.0 when the session holds
  ``expected`` notes; the session ends.
- ``POST /close_session`` → ``{"closed": true}``.
- ``GET /health`` → ``{"status": "ok"}``.

With checkpointing on, every call but ``/health`` and the control routes carries its rollout:
``/ng-rollout/<capture key>/add_note``. The session is that capture key.

Run it: ``gymckpt serve --app examples.tool_server:app --workers 2 --port 8001`` (two uvicorn
workers, one checkpoint participant; ``--config other.yaml`` names another settings file than
``examples/tool_server.yaml``), or in one process ``uvicorn examples.tool_server:app --port 8001``.
``--app examples.tool_server:create_app`` builds the app from the factory instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from fastapi import FastAPI, Request

from gymckpt.control.settings import load_settings
from gymckpt.errors import InvalidCheckpointState
from gymckpt.participants.install import app_config_file, install_checkpointing
from gymckpt.participants.resources import CheckpointedResources, CheckpointMode, ResourcesParticipant
from gymckpt.participants.rollout import current_episode

SETTINGS = Path(__file__).with_name("tool_server.yaml")


class Notes(CheckpointedResources):
    """The server's state: a list of notes per session, and the three checkpoint hooks."""

    # "exported": a checkpoint saves each session's state (restart_only and stateless need no hooks)
    checkpoint_mode: ClassVar[CheckpointMode] = "exported"

    def __init__(self) -> None:
        self.sessions: dict[str, list[Any]] = {}

    async def export_session_states(self, session_ids: list[str]) -> dict[str, Any]:
        """Copies of the sessions' states (stored after this returns); a session left out was dropped."""
        return {key: list(self.sessions[key]) for key in session_ids if key in self.sessions}

    async def restore_session_states(self, states: dict[str, Any]) -> None:
        """Install restored sessions, keyed by the next attempt (``r-a1`` for rollout ``r``): all or none."""
        for key, notes in states.items():
            if not isinstance(notes, list):
                raise InvalidCheckpointState(f"the notes of session {key!r} are not a list")
        self.sessions.update((key, list(notes)) for key, notes in states.items())

    async def retire_session_state(self, session_id: str) -> None:
        """Free a session; one this server does not hold is not an error."""
        self.sessions.pop(session_id, None)


def session_of(request: Request) -> str:
    """The request's session: its rollout attempt's capture key (from the prefix), else a header."""
    episode = current_episode()  # set by the rollout-prefix middleware for /ng-rollout/<key>/... requests
    return episode.capture_key if episode is not None else request.headers.get("x-session-id", "default")


def create_app(settings_file: str | Path | None = None) -> FastAPI:
    """The app; checkpointing installed when the settings' ``checkpoint:`` block enables it."""
    notes = Notes()
    app = FastAPI(title="notes tool server")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/seed_session")
    async def seed_session(request: Request) -> dict[str, Any]:
        key = session_of(request)
        notes.sessions[key] = []
        return {"session": key}

    @app.post("/add_note")
    async def add_note(request: Request, note: dict[str, Any]) -> dict[str, Any]:
        key = session_of(request)
        if key not in notes.sessions:  # a tool call that starts a session: tell the participant
            notes.sessions[key] = []
            notes.checkpoint_session_started(key)
        notes.sessions[key].append(note)
        return {"notes": notes.sessions[key]}

    @app.post("/verify")
    async def verify(request: Request, body: dict[str, Any]) -> dict[str, float]:
        held = notes.sessions.pop(session_of(request), [])
        return {"reward": 1.0 if len(held) == body.get("expected") else 0.0}

    @app.post("/close_session")
    async def close_session(request: Request) -> dict[str, bool]:
        notes.sessions.pop(session_of(request), None)
        return {"closed": True}

    settings = load_settings(settings_file or app_config_file(default=SETTINGS))  # --config FILE, else ours
    install_checkpointing(app, ResourcesParticipant(notes, instance="notes-0"), settings)
    return app


app = create_app()
