"""The simple agent: a turn loop of model call → tool call, checkpointed per session.

Routes (docs/reference-stack.md, "agent"):

- ``POST /v1/responses`` (``/ng-rollout/<key>/v1/responses``): one turn-loop activation of
  the episode's session: ``{"input": [messages] | str, "resources_url", "tools",
  "expected_tool"?}`` → ``{"output_text", "turns", "expected"}``. The loop calls the model
  (``model_url`` ``/v1/responses``, for the same episode); a ``function_call`` is sent to
  ``POST <resources_url>/<tool name>`` with its JSON arguments (for the same episode), its
  reply appended as a ``role: tool`` message; a final message ends the activation. The
  model's ``reasoning`` items join the conversation as they came, before its call or message.
  ``turns`` counts the activation's model calls, ``expected`` is the session's sum of the
  tool calls' ``n`` arguments (what the counter's ``/verify`` checks).
- ``POST /close_session``: the session ends.
- ``POST /run``: a legacy flat row (``_ng_rollout_id``, ``_ng_attempt_index``,
  ``_ng_task_index``, ``_ng_rollout_index``, ``responses_create_params``, and optionally
  ``task_input`` and ``resources_url``): seed (replay), the turn loop, verify (in the mode
  the resources server reported on its seed reply) → ``{"reward", "response"}``.

Replays are safe: an activation whose input equals the one in progress continues it (the
environment re-invokes the agent after a crash), and the first activation of a restored
session that repeats its last completed one returns that reply without calling the model.

State changes only in step boundary callbacks, and messages are append-only, so a boundary
is a cheap :class:`~gymckpt.servers.agent_state.ConversationSnapshot` (a message count into the list) materialised only
at export. With checkpointing off there is no participant and no rollout context: each
``/v1/responses`` is a session of its own and downstream calls carry no prefix.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import aiohttp
from fastapi import Request  # noqa: TC002 - FastAPI resolves handler annotations at runtime
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response  # noqa: TC002 - FastAPI resolves handler annotations at runtime

from gymckpt.control.responses import error_response
from gymckpt.errors import (
    AgentError,
    AgentRequestError,
    DownstreamError,
    InvalidCheckpointState,
    InvalidRequest,
    InvalidRolloutId,
    RestoredInputMismatch,
)
from gymckpt.identity import EpisodeId
from gymckpt.participants.agent import (
    RUN,
    AgentSessionParticipant,
    PlainActivation,
    RestartOnlyAgentParticipant,
)
from gymckpt.participants.rollout import current_episode, episode_context
from gymckpt.participants.steps import StepMode
from gymckpt.servers.agent_state import (
    Conversation,
    ConversationSnapshot,
    ModelTurn,
    RunState,
    Seeded,
    Session,
    ToolResult,
    input_digest,
    same_snapshot,
)
from gymckpt.servers.base import Downstream, ServerConfig, build_app
from gymckpt.servers.json_body import FastJSONResponse, parse_json, read_json_object

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

__all__ = [
    "AgentConfig",
    "AgentError",
    "AgentRequestError",
    "ResponsesBody",
    "RestoredInputMismatch",
    "SimpleAgent",
    "build_agent_app",
    "input_digest",
]

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class AgentConfig(ServerConfig):
    """The simple agent's config."""

    #: base URL of the policy model server
    model_url: str
    #: model calls per activation before it ends without a final message
    max_turns: int = Field(default=8, ge=1)
    #: False: the agent has no session hooks and is restart-only
    session_hooks: bool = True
    #: resources server for legacy /run rows and activations that name none
    resources_url: str | None = None
    #: the ``model`` field of model calls
    model: str = "gymckpt-policy"
    #: the participant's instance name
    instance: str = "agent-0"


class ResponsesBody(BaseModel):
    """One activation's request (unknown fields are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")

    input: list[dict[str, Any]] | str
    resources_url: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    expected_tool: str | None = None

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> ResponsesBody:
        """The activation of a decoded JSON body: the field types checked, the input neither validated item by
        item nor copied; :class:`~gymckpt.errors.InvalidRequest` (422) naming a bad field."""
        value = body.get("input")
        if not isinstance(value, str) and not (
            isinstance(value, list) and all(isinstance(item, dict) for item in value)
        ):
            raise InvalidRequest("input: must be a string or a list of objects")
        tools = body.get("tools", [])
        if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
            raise InvalidRequest("tools: must be a list of objects")
        for name in ("resources_url", "expected_tool"):
            if body.get(name) is not None and not isinstance(body[name], str):
                raise InvalidRequest(f"{name}: must be a string")
        if "_fields_set" in body:
            raise InvalidRequest("_fields_set: not a field of an activation")
        values = {"resources_url": None, "tools": tools, "expected_tool": None, **body}
        return cls.model_construct(_fields_set=set(body), **values)

    def items(self) -> list[dict[str, Any]]:
        return _items(self.input)


def _items(value: object) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and all(isinstance(item, dict) for item in value):
        return list(value)
    raise AgentRequestError("input must be a string or a list of message objects")


# ----------------------------------------------------------------------------- the agent


class SimpleAgent:
    """The simple agent's sessions and turn loop; it implements the agent session hooks."""

    def __init__(self, config: AgentConfig, downstream: Downstream) -> None:
        self.config = config
        self.downstream = downstream
        #: live sessions by capture key
        self.sessions: dict[str, Session] = {}

    # --------------------------------------------------------------- session hooks

    async def export_agent_sessions(self, keys: list[str]) -> dict[str, Any]:
        """Each held session's settings (its conversation is the participant's boundary)."""
        return {key: self.sessions[key].settings for key in keys if key in self.sessions}

    async def restore_agent_sessions(self, states: Mapping[str, Any]) -> None:
        """Rebuild sessions from their settings and boundaries, all or none.

        A boundary that describes no conversation is ``invalid_checkpoint_state`` naming its session.
        """
        restored: dict[str, Session] = {}
        for key, entry in states.items():
            try:
                conversation = Conversation.from_boundary(entry.get("boundary"))
            except (AgentError, ArithmeticError, LookupError, TypeError, ValueError) as exc:
                raise InvalidCheckpointState(
                    f"the restored conversation of agent session {key!r} cannot be used: {exc}"
                ) from exc
            conversation.restored = True
            settings = entry.get("state")
            restored[key] = Session(dict(settings) if isinstance(settings, dict) else {}, conversation)
        self.sessions.update(restored)

    async def retire_agent_session(self, key: str) -> None:
        """Forget the session."""
        self.sessions.pop(key, None)

    def close_session(self, key: str | None) -> None:
        """``/close_session``: forget the session."""
        if key is not None:
            self.sessions.pop(key, None)

    # --------------------------------------------------------------- /v1/responses

    async def respond(self, key: str | None, body: ResponsesBody, activation: PlainActivation) -> dict[str, Any]:
        """One activation of ``key``'s session (a session of its own when ``key`` is None)."""
        items = body.items()
        digest = input_digest(items)
        settings = {"resources_url": body.resources_url or self.config.resources_url, "tools": body.tools}
        session = self.sessions.get(key) if key is not None else None
        if session is None:
            session = Session(settings, Conversation())
            if key is not None:
                self.sessions[key] = session
        else:
            session.settings = settings
        conversation = session.conversation
        if conversation.restored:
            conversation.restored = False
            last = conversation.last
            if conversation.activation is None and last is not None and last.get("input_sha256") == digest:
                return dict(last["reply"])  # completed before the checkpoint; the caller replays it
        if conversation.activation is None or conversation.activation[0] != digest:
            await activation.record(lambda: conversation.begin(items, digest))
        return await self._turn_loop(
            conversation,
            tools=body.tools,
            resources_url=settings["resources_url"],
            activation=activation,
            wrap=same_snapshot,
        )

    async def _turn_loop(
        self,
        conversation: Conversation,
        *,
        tools: list[dict[str, Any]],
        resources_url: str | None,
        activation: PlainActivation,
        wrap: Callable[[ConversationSnapshot], object],
    ) -> dict[str, Any]:
        """Model call (replay) → tool call (wait) until a final message or max_turns."""
        while conversation.activation is not None:
            call = conversation.pending_call
            if call is not None:
                await activation.tool_call(
                    lambda call=call: self._call_tool(resources_url, call),
                    boundary=lambda result, call=call: wrap(conversation.apply_tool(call, result)),
                )
            elif conversation.activation[1] >= self.config.max_turns:
                await activation.record(lambda: wrap(conversation.give_up()))
            else:
                await activation.model_call(
                    lambda: self._call_model(conversation, tools),
                    boundary=lambda turn: wrap(conversation.apply_model(turn)),
                )
        assert conversation.last is not None
        return dict(conversation.last["reply"])

    async def _call_model(self, conversation: Conversation, tools: list[dict[str, Any]]) -> ModelTurn:
        body = {"model": self.config.model, "input": conversation.messages, "tools": tools}
        reply, _ = await self.downstream.post(self.config.model_url, "/v1/responses", body)
        return _parse_model_reply(reply)

    async def _call_tool(self, resources_url: str | None, call: dict[str, Any]) -> ToolResult:
        if not resources_url:
            raise AgentRequestError(f"the model called tool {call.get('name')!r} but no resources_url is known")
        try:
            arguments = json.loads(call.get("arguments") or "{}")
        except (TypeError, ValueError) as exc:
            raise AgentError(f"tool call arguments are not JSON: {call.get('arguments')!r}") from exc
        if not isinstance(arguments, dict):
            raise AgentError(f"tool call arguments must be an object: {call.get('arguments')!r}")
        reply, _ = await self.downstream.post(resources_url, "/" + call["name"], arguments)
        return ToolResult(arguments, reply)

    # --------------------------------------------------------------- legacy /run

    @staticmethod
    def check_restored_run(boundary: object, row: dict[str, Any]) -> None:
        """Refuse a replacement ``/run`` whose input is not the one its restored boundary began with."""
        if not isinstance(boundary, dict):
            return
        conversation = boundary.get("conversation") or {}
        recorded = (conversation.get("activation") or conversation.get("last") or {}).get("input_sha256")
        params = row.get("responses_create_params")
        given = input_digest(_items(params.get("input", []))) if isinstance(params, dict) else None
        if recorded is not None and recorded != given:
            raise RestoredInputMismatch("this /run's input differs from the input of the restored episode it continues")

    async def run_legacy(self, row: dict[str, Any], activation: PlainActivation) -> dict[str, Any]:
        """Seed, the turn loop, verify: an episode of its own that continues from a restored boundary."""
        params = row.get("responses_create_params") or {}
        if not isinstance(params, dict):
            raise AgentRequestError("responses_create_params must be an object")
        items = _items(params.get("input", []))
        tools = params.get("tools") or []
        resources_url = row.get("resources_url") or self.config.resources_url
        if not resources_url:
            raise AgentRequestError("a legacy /run needs a resources_url (in the row or the agent's config)")
        task_input = row.get("task_input") or {}
        state = RunState.from_boundary(activation.boundary if activation.restored else None)
        if not state.seeded:
            seeded = await activation.step(
                StepMode.REPLAY,
                lambda: self._seed(resources_url, task_input),
                boundary=lambda result: state.apply_seed(result, items),
            )
            if seeded.restart:
                await activation.mark_restart()
        conversation = state.conversation
        if conversation.last is None:
            await self._turn_loop(
                conversation, tools=tools, resources_url=resources_url, activation=activation, wrap=state.wrap
            )
        assert conversation.last is not None
        response = dict(conversation.last["reply"])
        if state.verify is None:
            mode = StepMode.REPLAY if state.verify_mode == "replay" else StepMode.WAIT
            await activation.step(mode, lambda: self._verify(resources_url, response), boundary=state.apply_verify)
        verify = state.verify or {}
        return {"reward": verify.get("reward"), "response": response}

    async def _seed(self, resources_url: str, task_input: object) -> Seeded:
        reply, headers = await self.downstream.post(resources_url, "/seed_session", {"task_input": task_input})
        mode = "replay" if headers.get("x-ng-checkpoint-verify") == "replay" else "wait"
        return Seeded(reply, mode, headers.get("x-ng-checkpoint-restart") == "1")

    async def _verify(self, resources_url: str, response: dict[str, Any]) -> dict[str, Any]:
        body = {"response": response["output_text"], "expected": response["expected"]}
        reply, _ = await self.downstream.post(resources_url, "/verify", body)
        return reply


def _parse_model_reply(reply: dict[str, Any]) -> ModelTurn:
    output = reply.get("output")
    if not isinstance(output, list):
        raise AgentError("the model reply has no output list")
    reasoning: list[dict[str, Any]] = []
    for item in output:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "reasoning":
            reasoning.append(item)
        elif item.get("type") == "function_call":
            name = item.get("name")
            if not isinstance(name, str) or not _TOOL_NAME.match(name):
                raise AgentError(f"the model called a tool with an unusable name: {name!r}")
            arguments = item.get("arguments", "{}")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments)
            return ModelTurn(
                {"type": "function_call", "name": name, "arguments": arguments, "call_id": item.get("call_id")},
                "",
                tuple(reasoning),
            )
        elif item.get("type") == "message" or item.get("role") == "assistant":
            content = item.get("content")
            if isinstance(content, str):
                return ModelTurn(None, content, tuple(reasoning))
            if isinstance(content, list):
                text = "".join(
                    part.get("text", "")
                    for part in content
                    if isinstance(part, dict) and part.get("type") in ("output_text", "text")
                )
                return ModelTurn(None, text, tuple(reasoning))
    raise AgentError("the model reply has neither a function_call nor a message")


# ----------------------------------------------------------------------------- the app


def build_agent_app(config: AgentConfig) -> FastAPI:
    """The simple agent's app; checkpointing installed only when the config enables it.

    ``app.state`` holds ``agent``, ``participant`` and ``plane`` (None when off) and
    ``downstream``, for tests and tools.
    """
    agent = SimpleAgent(config, Downstream(checkpointing=False))
    participant: AgentSessionParticipant | RestartOnlyAgentParticipant | None = None
    if config.checkpoint.enabled and config.session_hooks:
        participant = AgentSessionParticipant(agent, instance=config.instance)
    elif config.checkpoint.enabled:
        # no hooks: restart-only, but a retired session's messages are still freed
        participant = RestartOnlyAgentParticipant(instance=config.instance, free=agent.retire_agent_session)
    app, plane, downstream = build_app("gymckpt agent", config, participant)
    agent.downstream = downstream
    app.state.agent = agent
    app.state.participant = participant
    app.state.plane = plane
    app.state.downstream = downstream

    async def downstream_unreachable(request: Request, exc: Exception) -> JSONResponse:
        return error_response(DownstreamError(f"a downstream call failed: {exc}"))

    app.add_exception_handler(aiohttp.ClientError, downstream_unreachable)

    def episode_key() -> str | None:
        episode = current_episode()
        return episode.capture_key if episode is not None else None

    # bodies are read here (orjson, the field types checked) and replies written by orjson:
    # FastAPI's validation and serialisation of every request and reply is the larger share of a cheap route
    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = ResponsesBody.from_body(await read_json_object(request))
        key = episode_key()
        if participant is None:
            return FastJSONResponse(await agent.respond(key, body, PlainActivation(key)))
        return FastJSONResponse(await participant.run(key, lambda activation: agent.respond(key, body, activation)))

    @app.post("/close_session")
    async def close_session() -> Response:
        key = episode_key()
        if participant is not None:
            await participant.close_session(key)
        agent.close_session(key)
        if (episode := current_episode()) is not None:
            downstream.forget_episode(episode)
        return FastJSONResponse({"closed": True})

    @app.post("/run")
    async def run(request: Request) -> Response:
        try:
            row = parse_json(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            raise AgentRequestError(f"a /run body must be JSON: {exc}") from exc
        if not isinstance(row, dict):
            raise AgentRequestError("a /run body must be a JSON object (a flat row)")
        episode = EpisodeId.from_run_body(row)
        prefixed = current_episode()
        if episode is None:
            episode = prefixed
        elif prefixed is not None and prefixed != episode:
            raise InvalidRolloutId(f"the row names {episode} but the path names {prefixed}")
        key = episode.capture_key if episode is not None else None
        if participant is not None and key is not None and participant.kind_of(key) is None:
            participant.check_attempt(key)
            await participant.take_restored(key)  # several workers: the coordinator holds restored runs
        if participant is not None and key is not None and participant.kind_of(key) == RUN:
            restored = participant.registry.get(key)
            if restored is not None and restored.restored:
                agent.check_restored_run(restored.boundary, row)  # before the run would consume it
        with episode_context(episode):
            try:
                if participant is None:
                    return FastJSONResponse(await agent.run_legacy(row, PlainActivation(key)))
                return FastJSONResponse(
                    await participant.run(key, lambda activation: agent.run_legacy(row, activation), kind=RUN)
                )
            finally:
                if episode is not None:
                    downstream.forget_episode(episode)

    return app
