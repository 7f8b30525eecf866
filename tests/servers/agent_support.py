"""Fake model and resources servers for the agent tests, and a client for the agent app.

The fakes run as real HTTP servers (uvicorn in a thread on 127.0.0.1, a free port), since
the agent reaches them through its aiohttp data pool. Each records every call it receives
(path, capture key, input) and can *hold* a chosen call: the handler signals ``entered``
and waits until the test sets ``release`` (thread events: the servers run their own loops).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gymckpt.servers.agent import AgentConfig, build_agent_app
from gymckpt.servers.base import load_server_config
from gymckpt.store import open_store
from gymckpt.testing.net import serve
from gymckpt.testing.time import run_bounded
from gymckpt.testing.time import until as until_

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from gymckpt.participants.agent import AgentSessionParticipant, RestartOnlyAgentParticipant
    from gymckpt.servers.agent import SimpleAgent

#: every wait in these tests is bounded by this many seconds (only a bug reaches it)
WAIT = 15.0
TOKEN = "agent-test-token"
TOOLS = [{"type": "function", "name": "increment"}]


#: run one test coroutine on a fresh loop, failing instead of hanging on a bug
arun = functools.partial(run_bounded, timeout=60)
#: let the loop run (real I/O included) until ``condition()`` holds; the timeout only catches bugs
until = functools.partial(until_, timeout=WAIT, interval=0.001)


async def wait_event(event: threading.Event, timeout: float = WAIT) -> None:
    """Wait for a thread event set by a fake server, bounded."""
    assert await asyncio.to_thread(event.wait, timeout), "the fake server never reached the held call"


def digest(items: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(items, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class Hold:
    """A held call: ``entered`` when it arrived, it answers once ``release`` is set."""

    match: Callable[[dict[str, Any]], bool]
    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


class _Recorder:
    """Calls received, and holds (each matches one call)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[dict[str, Any]] = []
        self.holds: list[Hold] = []

    def hold(self, **expected: Any) -> Hold:
        """Hold the next call whose record has every field of ``expected``."""
        hold = Hold(lambda call: all(call.get(name) == value for name, value in expected.items()))
        with self.lock:
            self.holds.append(hold)
        return hold

    def release_all(self) -> None:
        with self.lock:
            for hold in self.holds:
                hold.release.set()

    def where(self, **expected: Any) -> list[dict[str, Any]]:
        with self.lock:
            return [call for call in self.calls if all(call.get(name) == value for name, value in expected.items())]

    async def record(self, call: dict[str, Any]) -> bool:
        """Record ``call``; wait if a hold matches it. False when the hold was never released."""
        with self.lock:
            self.calls.append(call)
            hold = next((h for h in self.holds if not h.entered.is_set() and h.match(call)), None)
            if hold is not None:
                hold.entered.set()
        if hold is None:
            return True
        return await asyncio.to_thread(hold.release.wait, WAIT * 2)


class FakeModel(_Recorder):
    """A deterministic policy: a function call of the first tool while the conversation holds
    fewer than ``tool_turns`` tool results (arguments ``{"n": results + 1}``), then a final
    message whose text depends on the whole conversation."""

    def __init__(self, tool_turns: int = 2) -> None:
        super().__init__()
        self.tool_turns = tool_turns

    def reply(self, items: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        results = sum(1 for item in items if item.get("role") == "tool")
        if tools and results < self.tool_turns:
            item: dict[str, Any] = {
                "type": "function_call",
                "name": tools[0]["name"],
                "arguments": json.dumps({"n": results + 1}),
                "call_id": f"call_{results}",
            }
        else:
            text = f"answer {results} {digest(items)[:8]}"
            item = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
        return {"id": "resp", "output": [item]}

    def app(self) -> FastAPI:
        app = FastAPI()

        async def handle(request: Request, key: str | None) -> Any:
            body = await request.json()
            items = body["input"]
            call = {
                "path": request.url.path,
                "key": key,
                "tool_results": sum(1 for item in items if item.get("role") == "tool"),
                "input_sha256": digest(items),
            }
            if not await self.record(call):
                return JSONResponse({"error": "held too long"}, status_code=503)
            return self.reply(items, body.get("tools") or [])

        @app.post("/v1/responses")
        async def plain(request: Request) -> Any:
            return await handle(request, None)

        @app.post("/ng-rollout/{key}/v1/responses")
        async def prefixed(request: Request, key: str) -> Any:
            return await handle(request, key)

        return app


class FakeResources(_Recorder):
    """A counter: ``/increment {"n"}`` adds to the session's count, ``/verify`` rewards count == expected."""

    def __init__(self, verify_mode: str = "wait") -> None:
        super().__init__()
        self.verify_mode = verify_mode
        self.restart = False
        self.counts: dict[str, int] = {}

    def rename(self, old: str, new: str) -> None:
        """What the counter's own restore does: the session continues under the next attempt."""
        with self.lock:
            self.counts[new] = self.counts.pop(old, 0)

    def app(self) -> FastAPI:
        app = FastAPI()

        async def handle(request: Request, key: str | None, op: str) -> Any:
            body = await request.json()
            session = key or "-"
            call = {"path": request.url.path, "key": key, "op": op, "body": body}
            if not await self.record(call):
                return JSONResponse({"error": "held too long"}, status_code=503)
            with self.lock:
                if op == "seed_session":
                    self.counts[session] = 0
                    headers = {"x-ng-checkpoint-verify": self.verify_mode}
                    if self.restart:
                        headers["x-ng-checkpoint-restart"] = "1"
                    return JSONResponse({"session": session}, headers=headers)
                if op == "increment":
                    self.counts[session] = self.counts.get(session, 0) + int(body["n"])
                    return {"count": self.counts[session]}
                if op == "verify":
                    return {"reward": 1.0 if self.counts.get(session) == body.get("expected") else 0.0}
                if op == "close_session":
                    self.counts.pop(session, None)
                    return {"closed": True}
            return JSONResponse({"error": f"unknown tool {op}"}, status_code=404)

        @app.post("/ng-rollout/{key}/{op}")
        async def prefixed(request: Request, key: str, op: str) -> Any:
            return await handle(request, key, op)

        @app.post("/{op}")
        async def plain(request: Request, op: str) -> Any:
            return await handle(request, None, op)

        return app


@dataclass
class Fakes:
    model: FakeModel
    resources: FakeResources
    model_url: str
    resources_url: str


@contextmanager
def fake_servers(tool_turns: int = 2) -> Iterator[Fakes]:
    """A fake model and a fake counter, served; every hold is released at the end."""
    model, resources = FakeModel(tool_turns), FakeResources()
    try:
        with (
            serve(model.app(), graceful_shutdown=5) as model_url,
            serve(resources.app(), graceful_shutdown=5) as resources_url,
        ):
            try:
                yield Fakes(model, resources, model_url, resources_url)
            finally:
                model.release_all()
                resources.release_all()
    finally:
        model.release_all()
        resources.release_all()


def agent_config(fakes: Fakes, *, checkpoint: bool = True, session_hooks: bool = True, **fields: Any) -> AgentConfig:
    block = {"enabled": True, "control_auth_token": TOKEN} if checkpoint else {"enabled": False}
    return load_server_config(
        AgentConfig,
        {
            "checkpoint": block,
            "model_url": fakes.model_url,
            "resources_url": fakes.resources_url,
            "session_hooks": session_hooks,
            **fields,
        },
    )


class AgentClient:
    """The agent app behind an httpx client (ASGI transport), with data and control helpers."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.app = build_agent_app(config)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://agent")

    @property
    def agent(self) -> SimpleAgent:
        return self.app.state.agent

    @property
    def participant(self) -> AgentSessionParticipant | RestartOnlyAgentParticipant:
        return self.app.state.participant

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.app.state.downstream.close()

    @staticmethod
    def _path(key: str | None, path: str) -> str:
        return path if key is None else f"/ng-rollout/{key}{path}"

    async def responses(self, key: str | None, items: list[dict[str, Any]], **extra: Any) -> httpx.Response:
        body = {"input": items, "resources_url": extra.pop("resources_url", self.config.resources_url), "tools": TOOLS}
        return await self.client.post(self._path(key, "/v1/responses"), json={**body, **extra})

    async def close_session(self, key: str | None) -> httpx.Response:
        return await self.client.post(self._path(key, "/close_session"), json={})

    async def run(self, row: dict[str, Any]) -> httpx.Response:
        return await self.client.post("/run", json=row)

    async def control(self, op: str, checkpoint_id: str, **body: Any) -> httpx.Response:
        payload = {"checkpoint_id": checkpoint_id, "deadline_ts": time.time() + WAIT, **body}
        return await self.client.post(
            f"/ng-control/v1/checkpoint/{op}", json=payload, headers={"Authorization": f"Bearer {TOKEN}"}
        )

    async def checkpoint(self, checkpoint_id: str, checkpoint_dir: str, scope: list[str]) -> dict[str, Any]:
        """prepare (asserting it is ready) and commit; the checkpoint stays open until resume."""
        prepared = await self.control("prepare", checkpoint_id)
        assert prepared.status_code == 200, prepared.text
        assert prepared.json()["report"]["ready"], prepared.json()
        committed = await self.control("commit", checkpoint_id, checkpoint_dir=checkpoint_dir, episode_ids=scope)
        assert committed.status_code == 200, committed.text
        return prepared.json()

    async def resume(self, checkpoint_id: str) -> None:
        resumed = await self.control("resume", checkpoint_id)
        assert resumed.status_code == 200, resumed.text

    async def restore(self, checkpoint_id: str, checkpoint_dir: str, scope: list[str]) -> list[str]:
        restored = await self.control("restore", checkpoint_id, checkpoint_dir=checkpoint_dir, episode_ids=scope)
        assert restored.status_code == 200, restored.text
        return restored.json()["restored"]


def records(checkpoint_dir: str, instance: str = "agent-0") -> dict[str, dict[str, Any]]:
    """The agent participant's stored records by capture key."""
    store = open_store(checkpoint_dir)
    try:
        return {record["episode_id"]: record for record in store.read_participant("", kind="agent", instance=instance)}
    finally:
        store.close()


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]
