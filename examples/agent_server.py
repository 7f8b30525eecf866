"""An agent of your own, made a checkpoint participant: a turn loop of model call → tool call.

``POST /v1/responses`` ``{"input": str, "resources_url": str, "tools": [{"type": "function", "name": ...}]}``
→ ``{"output_text": str, "tool_calls": int}``: one activation of the rollout's session. It asks
the policy model (``model_url`` in the settings, OpenAI Responses style) what to do; a
``function_call`` goes to ``POST <resources_url>/<tool name>`` and its reply back to the model,
until the model answers a message. Every model and tool call carries the rollout's prefix
(``/ng-rollout/<capture key>/...``), so the servers it calls know the rollout too, and each tool
call the caller's ``Cookie`` header (the tool server's session cookie), so a tool server with
several workers routes it to the worker that holds the session. One task per session: once
answered, the session replies the same until ``POST /close_session``.

What a checkpoint captures: each session's boundary (the conversation after its last
completed model or tool call) and its state (``resources_url``, ``tools``). A model call is a
``replay`` step (it runs again after a restore), a tool call a ``wait`` step (the checkpoint
waits for it: it changed the tool server's state).

Run it: ``gymckpt serve --app examples.agent_server:app --workers 2 --config examples/agent_server.yaml
--port 8002`` (without ``--config``: ``examples/agent_server.yaml``), or in one process ``uvicorn
examples.agent_server:app --port 8002``.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import yaml
from fastapi import FastAPI, Request
from pydantic import BaseModel, Field

from gymckpt.control.settings import load_settings
from gymckpt.participants.agent import AgentSessionParticipant, PlainActivation
from gymckpt.participants.install import app_config_file, install_checkpointing
from gymckpt.participants.rollout import current_episode

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping

SETTINGS = Path(__file__).with_name("agent_server.yaml")
MAX_TURNS = 8


class Turn(BaseModel):
    input: str
    resources_url: str
    tools: list[dict[str, Any]] = Field(default_factory=list)


class Conversation:
    """One session's turn loop; it changes only in the step boundary callbacks, which return its snapshot."""

    def __init__(self, settings: dict[str, Any], boundary: dict[str, Any] | None = None) -> None:
        self.settings = settings
        boundary = boundary or {}
        self.messages: list[dict[str, Any]] = list(boundary.get("messages", []))
        self.pending: dict[str, Any] | None = boundary.get("pending")  # a function call not yet sent to the tool
        self.reply: dict[str, Any] | None = boundary.get("reply")  # the answer, once the model gave it
        self.turns: int = boundary.get("turns", 0)
        #: what the caller's request carried of its tool session (its Cookie header): not state, not exported
        self.tool_headers: dict[str, str] = {}

    def snapshot(self) -> dict[str, Any]:
        return {"messages": list(self.messages), "pending": self.pending, "reply": self.reply, "turns": self.turns}

    def start(self, text: str) -> dict[str, Any]:
        self.messages.append({"role": "user", "content": text})
        return self.snapshot()

    def model_answered(self, item: dict[str, Any]) -> dict[str, Any]:
        self.turns += 1
        if item.get("type") == "function_call":
            self.messages.append(item)
            self.pending = item
        else:
            text = "".join(part.get("text", "") for part in item.get("content", []))
            self.messages.append({"role": "assistant", "content": text})
            self.reply = {"output_text": text, "tool_calls": self.turns - 1}
        return self.snapshot()

    def tool_answered(self, result: dict[str, Any]) -> dict[str, Any]:
        assert self.pending is not None
        self.messages.append({"role": "tool", "call_id": self.pending.get("call_id"), "content": json.dumps(result)})
        self.pending = None
        return self.snapshot()


class NotesAgent:
    """The agent's sessions and turn loop; it implements the three agent session hooks."""

    def __init__(self, model_url: str) -> None:
        self.model_url = model_url
        self.sessions: dict[str, Conversation] = {}
        self.http: aiohttp.ClientSession | None = None

    # --- the agent session hooks

    async def export_agent_sessions(self, keys: list[str]) -> Mapping[str, Any]:
        """Each held session's state (its boundary the participant keeps itself); a key left out was dropped."""
        return {key: dict(self.sessions[key].settings) for key in keys if key in self.sessions}

    async def restore_agent_sessions(self, states: Mapping[str, Any]) -> None:
        """Rebuild sessions under their next-attempt keys from ``{"state": ..., "boundary": ...}``."""
        self.sessions.update((key, Conversation(entry["state"], entry["boundary"])) for key, entry in states.items())

    async def retire_agent_session(self, key: str) -> None:
        self.sessions.pop(key, None)

    # --- one activation

    async def respond(
        self, key: str | None, turn: Turn, activation: PlainActivation, tool_headers: dict[str, str]
    ) -> dict[str, Any]:
        settings = {"resources_url": turn.resources_url, "tools": turn.tools}
        convo = self.sessions.get(key) if key is not None else None
        if convo is None:
            convo = Conversation(settings)
            if key is not None:
                self.sessions[key] = convo
        convo.tool_headers = tool_headers
        if not convo.messages:
            await activation.record(lambda: convo.start(turn.input))
        while convo.reply is None and convo.turns < MAX_TURNS:
            if convo.pending is not None:
                await activation.tool_call(lambda: self.call_tool(key, convo), boundary=convo.tool_answered)
            else:
                await activation.model_call(lambda: self.call_model(key, convo), boundary=convo.model_answered)
        return convo.reply or {"output_text": "", "tool_calls": convo.turns}

    async def call_model(self, key: str | None, convo: Conversation) -> dict[str, Any]:
        body = {"model": "policy", "input": convo.messages, "tools": convo.settings["tools"]}
        reply = await self.post(self.model_url, key, "/v1/responses", body)
        return reply["output"][0]

    async def call_tool(self, key: str | None, convo: Conversation) -> dict[str, Any]:
        assert convo.pending is not None
        arguments = json.loads(convo.pending.get("arguments") or "{}")
        tool = "/" + convo.pending["name"]
        return await self.post(convo.settings["resources_url"], key, tool, arguments, headers=convo.tool_headers)

    async def post(
        self, base: str, key: str | None, path: str, body: Any, *, headers: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """POST for the rollout ``key``: its prefix tells the called server which rollout this is."""
        url = base.rstrip("/") + (f"/ng-rollout/{key}{path}" if key is not None else path)
        assert self.http is not None
        async with self.http.post(url, json=body, headers=headers, raise_for_status=True) as response:
            return await response.json()  # type: ignore[no-any-return]


def create_app(settings_file: str | Path | None = None) -> FastAPI:
    """The app; checkpointing installed when the settings' ``checkpoint:`` block enables it."""
    config = yaml.safe_load(Path(settings_file or app_config_file(default=SETTINGS)).read_text())  # --config FILE
    agent = NotesAgent(config["model_url"])
    participant = AgentSessionParticipant(agent, instance="notes-agent-0")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # no shared cookie jar: each tool call carries its own session's cookie, which the caller gave
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
            agent.http = http
            yield

    app = FastAPI(title="notes agent", lifespan=lifespan)
    plane = install_checkpointing(app, participant, load_settings(config))

    def rollout_key() -> str | None:
        episode = current_episode()
        return episode.capture_key if episode is not None else None

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/responses")
    async def responses(turn: Turn, request: Request) -> dict[str, Any]:
        key = rollout_key()
        # the tool server's session cookie, passed on with each tool call (a tool server's workers route by it)
        tool_headers = {"Cookie": request.headers["cookie"]} if "cookie" in request.headers else {}
        if plane is None:  # checkpointing off: no participant, steps just run
            return await agent.respond(key, turn, PlainActivation(key), tool_headers)
        # an activation: refused without a rollout or for a retired attempt; parks at a boundary while closed
        return await participant.run(key, lambda activation: agent.respond(key, turn, activation, tool_headers))

    @app.post("/close_session")
    async def close_session() -> dict[str, bool]:
        key = rollout_key()
        if plane is not None:
            await participant.close_session(key)
        agent.sessions.pop(key or "", None)
        return {"closed": True}

    return app


app = create_app()
