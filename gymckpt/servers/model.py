"""The policy model server: OpenAI Responses-style ``/v1/responses`` in front of the inference backend.

Deterministic policy (docs/reference-stack.md, "model"): the prompt is the canonical JSON
of the request's ``input`` (sorted keys, no spaces) and the seed is
``int(sha256(prompt)[:8], 16)``; the server asks the inference backend for ``max_tokens``
tokens. While the conversation holds fewer tool results than ``tool_turns`` and tools are
offered, the answer is a ``function_call`` of the first tool with arguments
``{"n": tokens[0] % 5 + 1}`` (``{"city": …}`` for ``get_weather``); otherwise a final
message ``"answer " + tokens[:4]`` (followed by ``": <forecast>"`` after a ``get_weather``
result, so a weather rollout's answer names its forecast). With ``reasoning`` the output
starts with a ``reasoning`` item whose summary is the generation's text (a word per
token, :func:`token_words`), so the conversation grows with the generation length. The
reply's ids derive from the prompt too, so the same input always gives the same reply,
with checkpointing on or off.

``"stream": true`` answers Server-Sent Events: one ``response.token`` event per token
(``{"type", "index", "token"}``), then ``response.completed`` with the full response
object (``{"type", "response"}``).

``/v1/chat/completions`` and ``/v1/messages`` take ``messages`` and answer the same policy
in their own shapes (no streaming); every route is gated the same way.

With checkpointing on (and ``checkpoint_policy``, the default), the server is a
:class:`~gymckpt.participants.model.ModelParticipant`: closing admission holds undelivered
responses and makes new calls wait, only a streaming response blocks readiness, prepare
cuts the undelivered generations (:class:`GenerationCutClient`), and a replacement call
continues its restored cut (``ng_capture.generation_cut`` on ``/generate``). Calls without
a rollout prefix are served too. With ``checkpoint_policy: false`` (a judge or other
auxiliary model) nothing is installed: it keeps serving through checkpoints and discover
skips it. The inference backend is not a Gym server: it is called without a rollout
prefix, with call ids ``"<capture key>:<tool results so far>"``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import TYPE_CHECKING, Any

import aiohttp
from fastapi import Request  # noqa: TC002 - FastAPI resolves handler annotations at runtime
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from gymckpt.control.responses import error_response
from gymckpt.errors import DownstreamError, GenerationCutMismatch, InferenceFailed, InvalidRequest, StaleAttempt
from gymckpt.participants.model import ModelParticipant
from gymckpt.participants.rollout import current_episode
from gymckpt.servers.base import Downstream, ServerConfig, build_app
from gymckpt.servers.inference_wire import prefix_digest
from gymckpt.servers.json_body import FastJSONResponse, canonical_json, read_json_object
from gymckpt.servers.model_cut_client import GenerationCutClient
from gymckpt.servers.responses_api import responses_api_reply
from gymckpt.servers.token_codec import TOKEN_ENCODING, pack_logprobs, pack_token_ids

if TYPE_CHECKING:
    from collections.abc import Callable

    from fastapi import FastAPI

    from gymckpt.identity import EpisodeId
    from gymckpt.participants.model_calls import ModelCall

logger = logging.getLogger(__name__)

__all__ = [
    "ConversationRequest",
    "ModelServerConfig",
    "ResponsesRequest",
    "build_model_app",
    "GenerationCutClient",
    "anthropic_message",
    "canonical_prompt",
    "chat_completion",
    "constrained_decoding",
    "policy_reply",
    "sse_events",
    "token_words",
    "tool_results",
]


class ModelServerConfig(ServerConfig):
    """The policy model server's config (``checkpoint_policy: false`` for a judge or other auxiliary model)."""

    #: base URL of the inference backend
    inference_url: str
    #: tool results after which the policy answers a final message
    tool_turns: int = Field(default=3, ge=0)
    #: tokens asked of the inference backend per call (the final message shows the first four)
    max_tokens: int = Field(default=8, ge=1)
    #: whether a reply starts with a ``reasoning`` item holding the generation's text (a word per token)
    reasoning: bool = False
    #: the participant's instance name
    instance: str = "model-0"
    #: whether this server is the policy model, the one checkpoint participant among the model
    #: servers; an auxiliary model (a judge) keeps serving through checkpoints and has no control routes
    checkpoint_policy: bool = True
    #: whether prepare asks the inference backend to cut undelivered generations at a durable prefix
    generation_cuts: bool = True


class ResponsesRequest(BaseModel):
    """An OpenAI Responses-style request (unknown fields are accepted and ignored).

    The routes build it with :meth:`from_body`: the field types are checked, the input's
    items are not copied or validated one by one (a conversation grows every turn).
    """

    model_config = ConfigDict(extra="allow")

    model: str = "gymckpt-policy"
    input: list[dict[str, Any]] | str
    tools: list[dict[str, Any]] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> ResponsesRequest:
        """The request of a decoded JSON body; :class:`~gymckpt.errors.InvalidRequest` (422) naming a bad field."""
        _check_items(body, "input", required=True, text=True)
        _check_body_fields(body)
        # every default given here: pydantic inspects a default factory's signature on each construct
        return cls.model_construct(_fields_set=set(body), **{**_defaults(), "stream": False, **body})

    def items(self) -> list[dict[str, Any]]:
        """The input as a list of items (a plain string is one user message)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return self.input


def _defaults() -> dict[str, Any]:
    """The defaults of the fields both request shapes share (new lists and dicts each time)."""
    return {"model": "gymckpt-policy", "tools": [], "metadata": {}}


def _check_items(body: dict[str, Any], name: str, *, required: bool = False, text: bool = False) -> None:
    """``body[name]`` is a list of objects (or, with ``text``, a string); absent only when not ``required``."""
    if name not in body:
        if required:
            raise InvalidRequest(f"{name}: field required")
        return
    value = body[name]
    if text and isinstance(value, str):
        return
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        kind = "a string or a list of objects" if text else "a list of objects"
        raise InvalidRequest(f"{name}: must be {kind}")


def _check_body_fields(body: dict[str, Any]) -> None:
    """The optional fields of a model request have their types (``model``, ``tools``, ``metadata``, ``stream``)."""
    if "_fields_set" in body:
        raise InvalidRequest("_fields_set: not a field of a model request")
    _check_items(body, "tools")
    for name, kind, label in (("model", str, "a string"), ("metadata", dict, "an object"), ("stream", bool, "a bool")):
        if name in body and not isinstance(body[name], kind):
            raise InvalidRequest(f"{name}: must be {label}")


#: request fields that constrain decoding when set (a call with one is never cut)
_CONSTRAINING_FIELDS = (
    "guided_choice",
    "guided_grammar",
    "guided_json",
    "guided_regex",
    "guided_whitespace_pattern",
    "structural_tag",
    "structured_outputs",
)


def constrained_decoding(request: BaseModel) -> str | None:
    """Why ``request``'s decoding is constrained (so it is never cut), or None.

    A ``tool_choice`` other than ``auto``/``none``, a ``response_format`` other than text,
    or any guided or structured-output field.
    """
    # the fields given, without dumping the input: a conversation is never copied to look at three fields
    fields = dict(request.model_extra or {})
    for name in ("tool_choice", "response_format", *_CONSTRAINING_FIELDS):
        if name in request.model_fields_set:
            fields[name] = getattr(request, name)
    choice = fields.get("tool_choice")
    if choice is not None and choice not in ("auto", "none"):
        return f"tool_choice:{choice}" if isinstance(choice, str) else "tool_choice:constrained"
    response_format = fields.get("response_format")
    if response_format is not None and not (
        isinstance(response_format, dict) and response_format.get("type") == "text"
    ):
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        return f"response_format:{kind if isinstance(kind, str) else 'unknown'}"
    for name in _CONSTRAINING_FIELDS:
        if fields.get(name) is not None:
            return name
    return None


class ConversationRequest(BaseModel):
    """A ``/v1/chat/completions`` or ``/v1/messages`` request: ``messages`` are the input (no streaming)."""

    model_config = ConfigDict(extra="allow")

    model: str = "gymckpt-policy"
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> ConversationRequest:
        """The request of a decoded JSON body (checked as :meth:`ResponsesRequest.from_body` checks)."""
        _check_items(body, "messages", required=True)
        _check_body_fields(body)
        return cls.model_construct(_fields_set=set(body), **{**_defaults(), **body})

    def as_responses(self) -> ResponsesRequest:
        """The same call as a Responses request (the policy, its gating and its cuts are one)."""
        extra = {name: value for name, value in (self.model_extra or {}).items() if name not in ("stream", "input")}
        return ResponsesRequest.model_construct(
            model=self.model, input=self.messages, tools=self.tools, metadata=self.metadata, **extra
        )


def _as_is(reply: dict[str, Any]) -> dict[str, Any]:
    """The Responses reply, as the ``/v1/responses`` route answers it."""
    return reply


def _first_output(reply: dict[str, Any]) -> dict[str, Any]:
    """The reply's answer: its first output item that is not reasoning."""
    return next(item for item in reply["output"] if item.get("type") != "reasoning")  # type: ignore[no-any-return]


def chat_completion(reply: dict[str, Any]) -> dict[str, Any]:
    """The Responses ``reply`` as an OpenAI chat completion."""
    item = _first_output(reply)
    if item["type"] == "function_call":
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        finish = "tool_calls"
    else:
        message = {"role": "assistant", "content": item["content"][0]["text"]}
        finish = "stop"
    return {
        "id": reply["id"].replace("resp_", "chatcmpl_", 1),
        "object": "chat.completion",
        "model": reply["model"],
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"completion_tokens": reply["usage"]["output_tokens"]},
    }


def anthropic_message(reply: dict[str, Any]) -> dict[str, Any]:
    """The Responses ``reply`` as an Anthropic-style ``/v1/messages`` reply."""
    item = _first_output(reply)
    if item["type"] == "function_call":
        content = [
            {"type": "tool_use", "id": item["call_id"], "name": item["name"], "input": json.loads(item["arguments"])}
        ]
        stop = "tool_use"
    else:
        content = [{"type": "text", "text": item["content"][0]["text"]}]
        stop = "end_turn"
    return {
        "id": reply["id"].replace("resp_", "msg_", 1),
        "type": "message",
        "role": "assistant",
        "model": reply["model"],
        "content": content,
        "stop_reason": stop,
        "usage": {"output_tokens": reply["usage"]["output_tokens"]},
    }


def canonical_prompt(items: list[dict[str, Any]]) -> str:
    """The prompt sent to the inference backend: the input's JSON with sorted keys, no spaces
    (``json.dumps(items, sort_keys=True, separators=(",", ":"), ensure_ascii=False)``, written by orjson)."""
    return canonical_json(items).decode()


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


_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "do", "fu", "gi", "ha", "ju", "be")
#: the policy's words: a token ``t`` reads as ``_WORDS[t % len(_WORDS)]``
_WORDS = tuple(a + b + end for a in _SYLLABLES for b in _SYLLABLES for end in ("", "n", "r", "s"))


def token_words(tokens: list[int]) -> str:
    """The text of a generation: a word per token, space-separated (deterministic, about 6 bytes a token)."""
    words = _WORDS
    return " ".join([words[token % len(words)] for token in tokens])


def policy_reply(
    request: ResponsesRequest,
    tokens: list[int],
    *,
    tool_turns: int,
    reasoning: bool = False,
    prompt_sha256: str | None = None,
) -> dict[str, Any]:
    """The reply of the deterministic policy to ``request`` given the backend's ``tokens``.

    ``reasoning``: the output starts with a ``reasoning`` item summarising all of ``tokens``.
    ``prompt_sha256``: the sha256 hex of the request's :func:`canonical_prompt`, if known already.
    """
    items = request.items()
    digest = prompt_sha256 or hashlib.sha256(canonical_prompt(items).encode()).hexdigest()
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
    output = [item]
    if reasoning:
        summary = [{"type": "summary_text", "text": token_words(tokens)}]
        output.insert(0, {"type": "reasoning", "id": f"rs_{digest[:24]}", "summary": summary})
    return {
        "id": f"resp_{digest[:24]}",
        "object": "response",
        "model": request.model,
        "status": "completed",
        "output": output,
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

    def __init__(
        self,
        events: list[bytes],
        participant: ModelParticipant | None,
        call: ModelCall | None,
        row: dict[str, Any] | None = None,
    ) -> None:
        self.events = events
        self.participant = participant
        self.call = call
        self.row = row
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
            if participant is not None and call is not None and not call.retired and self.row is not None:
                participant.delivered(call, self.row)
        finally:
            if participant is not None and call is not None:
                participant.finish(call)


def _packed(generated: dict[str, Any]) -> dict[str, Any]:
    """A ``/generate`` reply's token ids and logprobs, packed (:mod:`gymckpt.servers.token_codec`)."""
    return {
        "token_ids": pack_token_ids(generated.get("tokens", [])),
        "logprobs": pack_logprobs(generated.get("logprobs", [])),
        "encoding": TOKEN_ENCODING,
    }


def _sending(call: ModelCall | None) -> Callable[[], None] | None:
    """What marks ``call`` sent once its request to the backend has a connection (None: no call)."""
    if call is None:
        return None

    def sent() -> None:
        call.sent = True

    return sent


def build_model_app(config: ModelServerConfig) -> FastAPI:
    """The policy model server's app; a participant only when the config enables checkpointing.

    ``app.state`` holds ``participant`` and ``plane`` (None when off) for tests and tools.
    """
    policy = config.checkpoint.enabled and config.checkpoint_policy
    participant = ModelParticipant(config.instance) if policy else None
    # inference is not a Gym server: never add a rollout prefix to its calls
    inference = Downstream.of_config(config, checkpointing=False)
    cutter = GenerationCutClient(config.inference_url, config.checkpoint.token, server_name=config.instance)
    app, plane, _ = build_app("gymckpt model", config, participant, on_shutdown=[inference.close, cutter.close])
    app.state.participant = participant
    app.state.plane = plane
    if participant is not None and config.generation_cuts:
        participant.cut_source = cutter.cut
        participant.release_source = cutter.release

    def generate_body(request: ResponsesRequest, episode: EpisodeId | None) -> tuple[dict[str, Any], str]:
        """The ``/generate`` body, and the prompt's sha256 hex (its seed, the request digest, the reply's ids)."""
        items = request.items()
        prompt_bytes = canonical_json(items)
        prompt = prompt_bytes.decode()
        prompt_sha256 = hashlib.sha256(prompt_bytes).hexdigest()
        if episode is not None:
            rollout = episode.capture_key
        else:
            named = request.metadata.get("rollout_id")
            rollout = named if isinstance(named, str) else "anonymous"
        body = {
            "call_id": f"{rollout}:{tool_results(items)}",
            "prompt": prompt,
            "seed": int(prompt_sha256[:8], 16),
            "max_tokens": config.max_tokens,
        }
        return body, prompt_sha256

    async def generate(body: dict[str, Any], call: ModelCall | None) -> dict[str, Any]:
        continuation = participant.continuation_for(call) if participant is not None and call is not None else None
        try:
            continued = {**body, "ng_capture": {"generation_cut": continuation}} if continuation else body
            reply, _ = await inference.post(
                config.inference_url, "/generate", continued, episode=None, on_sent=_sending(call)
            )
        except DownstreamError as exc:
            if continuation is None or exc.wire_code != GenerationCutMismatch.code:
                raise
            if participant is not None and call is not None:
                participant.continuation_refused(call)
            # the backend no longer holds the cut's tokens (its token store was lost): generate it all again
            logger.warning(
                "the backend refused to continue the cut of %s (%s); generating it again", body["call_id"], exc
            )
            reply, _ = await inference.post(config.inference_url, "/generate", body, episode=None)
        tokens = reply.get("tokens", [])
        # for the ledger row too: hashed and packed once (the backend's digest of the tokens, when it sends one)
        digest = reply.get("tokens_digest")
        if not isinstance(digest, str):
            digest = prefix_digest(tokens)
        reply["response_digest"] = digest
        reply["packed"] = packed = _packed(reply)
        if participant is not None and call is not None:
            participant.generated(call, reply.get("staging_key"), len(tokens), digest, prefix=packed)
        return reply

    async def serve(request: ResponsesRequest, shape: Callable[[dict[str, Any]], dict[str, Any]]) -> Response:
        """One policy call, gated by the participant; ``shape`` turns the Responses reply into the route's."""
        episode = current_episode()
        body, prompt_sha256 = generate_body(request, episode)
        call = None
        if participant is not None:
            call = participant.admit(
                episode,
                stream=request.stream,
                call_id=body["call_id"],
                request_digest=prompt_sha256,
                constrained=constrained_decoding(request),
                sent=False,  # set when its /generate call has a connection of the (bounded) pool
            )
        handed_over = False
        try:
            try:
                if participant is not None and call is not None:
                    generated = await participant.respond(call, lambda: generate(body, call))
                else:
                    generated = await generate(body, None)
            except (DownstreamError, aiohttp.ClientError) as exc:
                return error_response(InferenceFailed(f"the inference backend failed: {exc}"))
            tokens = generated["tokens"]
            # the ledger row keeps the generation itself: its token ids and logprobs, packed
            row = {
                "model_call_id": body["call_id"],
                "request_digest": call.request_digest if call is not None else "",
                "staging_key": generated.get("staging_key"),
                "tokens": len(tokens),
                "response_digest": generated["response_digest"],
                **generated["packed"],
            }
            reply = responses_api_reply(request)(  # a whole OpenAI Responses API object
                policy_reply(
                    request,
                    tokens,
                    tool_turns=config.tool_turns,
                    reasoning=config.reasoning,
                    prompt_sha256=prompt_sha256,
                )
            )
            if request.stream:
                handed_over = True
                return _EventStream(sse_events(reply, tokens), participant, call, row)
            if participant is not None and call is not None:
                participant.delivered(call, row)
            return FastJSONResponse(shape(reply))
        finally:
            if participant is not None and call is not None and not handed_over:
                participant.finish(call)

    # the bodies are read here (orjson, the field types checked), not by FastAPI: a conversation's
    # messages are neither validated one by one nor copied, and the reply is written by orjson
    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await serve(ResponsesRequest.from_body(await read_json_object(request)), _as_is)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = ConversationRequest.from_body(await read_json_object(request))
        return await serve(body.as_responses(), chat_completion)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        body = ConversationRequest.from_body(await read_json_object(request))
        return await serve(body.as_responses(), anthropic_message)

    return app
