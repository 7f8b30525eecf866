"""The policy model server: OpenAI Responses-style ``/v1/responses`` in front of the inference backend.

Deterministic policy (docs/reference-stack.md, "model"): the prompt is the canonical JSON
of the request's ``input`` (sorted keys, no spaces) and the seed is
``int(sha256(prompt)[:8], 16)``; the server asks the inference backend for ``max_tokens``
tokens. While the conversation holds fewer tool results than ``tool_turns`` and tools are
offered, the answer is a ``function_call`` of the first tool with arguments
``{"n": tokens[0] % 5 + 1}`` (``{"city": …}`` for ``get_weather``); otherwise a final
message ``"answer " + tokens[:4]`` (followed by ``": <forecast>"`` after a ``get_weather``
result, so a weather rollout's answer names its forecast). The
reply's ids derive from the prompt too, so the same input always gives the same reply,
with checkpointing on or off.

``"stream": true`` answers Server-Sent Events: one ``response.token`` event per token
(``{"type", "index", "token"}``), then ``response.completed`` with the full response
object (``{"type", "response"}``).

With checkpointing on, the server is a :class:`~gymckpt.participants.model.ModelParticipant`
: calls carry their rollout prefix, closing admission holds undelivered responses and
makes new calls wait, and only a streaming response blocks readiness. The inference
backend is not a Gym server: it is called without a rollout prefix, with call ids
``"<capture key>:<tool results so far>"``.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import aiohttp
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from gymckpt.control.responses import error_response
from gymckpt.errors import DownstreamError, InferenceFailed, StaleAttempt
from gymckpt.participants.model import ModelParticipant
from gymckpt.participants.rollout import current_episode
from gymckpt.servers.base import Downstream, ServerConfig, build_app

if TYPE_CHECKING:
    from fastapi import FastAPI

    from gymckpt.identity import EpisodeId
    from gymckpt.participants.model import ModelCall

__all__ = [
    "ModelServerConfig",
    "ResponsesRequest",
    "build_model_app",
    "canonical_prompt",
    "policy_reply",
    "sse_events",
    "tool_results",
]


class ModelServerConfig(ServerConfig):
    """The policy model server's config."""

    #: base URL of the inference backend
    inference_url: str
    #: tool results after which the policy answers a final message
    tool_turns: int = Field(default=3, ge=0)
    #: tokens asked of the inference backend per call (the final message shows the first four)
    max_tokens: int = Field(default=8, ge=1)
    #: the participant's instance name
    instance: str = "model-0"


class ResponsesRequest(BaseModel):
    """An OpenAI Responses-style request (unknown fields are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")

    model: str = "gymckpt-policy"
    input: list[dict[str, Any]] | str
    tools: list[dict[str, Any]] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False

    def items(self) -> list[dict[str, Any]]:
        """The input as a list of items (a plain string is one user message)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return self.input


def canonical_prompt(items: list[dict[str, Any]]) -> str:
    """The prompt sent to the inference backend: the input's JSON with sorted keys."""
    return json.dumps(items, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def tool_results(items: list[dict[str, Any]]) -> int:
    """How many tool results the conversation holds (``role: tool`` or ``function_call_output`` items)."""
    return sum(1 for item in items if item.get("role") == "tool" or item.get("type") == "function_call_output")


def _tool_name(tool: dict[str, Any]) -> str:
    name = tool.get("name")
    if name is None and isinstance(tool.get("function"), dict):
        name = tool["function"].get("name")
    return str(name)


#: cities the policy asks a ``get_weather`` tool about
CITIES = ("Paris", "Lagos", "Lima", "Oslo", "Hanoi")


def _tool_arguments(name: str, tokens: list[int]) -> dict[str, Any]:
    if name == "get_weather":
        return {"city": CITIES[tokens[0] % len(CITIES)]}
    return {"n": tokens[0] % 5 + 1}


def _last_forecast(items: list[dict[str, Any]]) -> str:
    """The forecast of the conversation's last ``get_weather`` result, if any."""
    for item in reversed(items):
        if (item.get("role") == "tool" or item.get("type") == "function_call_output") and item.get(
            "name"
        ) == "get_weather":
            content = item.get("content", item.get("output", ""))
            try:
                decoded = json.loads(content) if isinstance(content, str) else content
            except ValueError:
                return str(content)
            return str(decoded.get("forecast", "")) if isinstance(decoded, dict) else str(decoded)
    return ""


def policy_reply(request: ResponsesRequest, tokens: list[int], *, tool_turns: int) -> dict[str, Any]:
    """The reply of the deterministic policy to ``request`` given the backend's ``tokens``."""
    items = request.items()
    digest = hashlib.sha256(canonical_prompt(items).encode()).hexdigest()
    if request.tools and tool_results(items) < tool_turns:
        name = _tool_name(request.tools[0])
        item: dict[str, Any] = {
            "type": "function_call",
            "name": name,
            "arguments": json.dumps(_tool_arguments(name, tokens)),
            "call_id": f"call_{digest[:16]}",
        }
    else:
        text = "answer " + " ".join(map(str, tokens[:4]))
        forecast = _last_forecast(items)
        item = {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": f"{text}: {forecast}" if forecast else text}],
        }
    return {
        "id": f"resp_{digest[:24]}",
        "object": "response",
        "model": request.model,
        "status": "completed",
        "output": [item],
        "usage": {"output_tokens": len(tokens)},
    }


def sse_events(reply: dict[str, Any], tokens: list[int]) -> list[bytes]:
    """The Server-Sent Events of a streamed reply: one per token, then the completed response."""

    def event(name: str, data: dict[str, Any]) -> bytes:
        return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

    events = [
        event("response.token", {"type": "response.token", "index": index, "token": token})
        for index, token in enumerate(tokens)
    ]
    events.append(event("response.completed", {"type": "response.completed", "response": reply}))
    return events


class _EventStream(Response):
    """An SSE reply that, with a participant, is held before its first byte while admission is closed
    and counts as streaming (a checkpoint blocker) while its bytes flow."""

    media_type = "text/event-stream"

    def __init__(self, events: list[bytes], participant: ModelParticipant | None, call: ModelCall | None) -> None:
        self.events = events
        self.participant = participant
        self.call = call
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        participant, call = self.participant, self.call
        try:
            if participant is not None and call is not None:
                try:
                    await participant.start_stream(call)
                except StaleAttempt as exc:
                    refusal = error_response(exc)
                    await refusal(scope, receive, send)
                    return
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            for chunk in self.events:
                if call is not None and call.retired:
                    break  # retired mid-stream: end it without the completed event
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if participant is not None and call is not None:
                participant.finish(call)


def build_model_app(config: ModelServerConfig) -> FastAPI:
    """The policy model server's app; a participant only when the config enables checkpointing.

    ``app.state`` holds ``participant`` and ``plane`` (None when off) for tests and tools.
    """
    participant = ModelParticipant(config.instance) if config.checkpoint.enabled else None
    # inference is not a Gym server: never add a rollout prefix to its calls
    inference = Downstream(checkpointing=False, connector_limit=config.data_connector_limit)
    app, plane, _ = build_app("gymckpt model", config, participant, on_shutdown=[inference.close])
    app.state.participant = participant
    app.state.plane = plane

    async def generate(request: ResponsesRequest, episode: EpisodeId | None) -> list[int]:
        items = request.items()
        prompt = canonical_prompt(items)
        if episode is not None:
            rollout = episode.capture_key
        else:
            named = request.metadata.get("rollout_id")
            rollout = named if isinstance(named, str) else "anonymous"
        body = {
            "call_id": f"{rollout}:{tool_results(items)}",
            "prompt": prompt,
            "seed": int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16),
            "max_tokens": config.max_tokens,
        }
        reply, _ = await inference.post(config.inference_url, "/generate", body, episode=None)
        return [int(token) for token in reply["tokens"]]

    @app.post("/v1/responses")
    async def responses(request: ResponsesRequest) -> Response:
        episode = current_episode()
        call = participant.admit(episode, stream=request.stream) if participant is not None else None
        handed_over = False
        try:
            try:
                if participant is not None and call is not None:
                    tokens = await participant.respond(call, lambda: generate(request, episode))
                else:
                    tokens = await generate(request, episode)
            except (DownstreamError, aiohttp.ClientError) as exc:
                return error_response(InferenceFailed(f"the inference backend failed: {exc}"))
            reply = policy_reply(request, tokens, tool_turns=config.tool_turns)
            if request.stream:
                handed_over = True
                return _EventStream(sse_events(reply, tokens), participant, call)
            return JSONResponse(reply)
        finally:
            if participant is not None and call is not None and not handed_over:
                participant.finish(call)

    return app
