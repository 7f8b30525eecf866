"""The fake inference backend: deterministic tokens, produced slowly, a log of completed calls, a token store.

Not a Gym server and not a participant: it has no checkpoint routes and survives a Gym
crash, so tests and the demo can assert on its log that a restore makes no completed call
again. It plays the inference worker of a training framework towards the policy model
server: it stages token ids in a token store, cuts generations at a checkpoint, and
continues a cut generation on the replacement call.

- ``POST /generate`` ``{"call_id", "prompt", "seed", "max_tokens", "ng_capture"?}`` →
  ``{"call_id", "tokens", "logprobs", "text", "tokens_digest", "staging_key", "generated",
  "continued_from"}`` (``text``: :func:`token_text` of the tokens; ``tokens_digest``: their
  :func:`prefix_digest`, what a cut of them would ack).
  Tokens and their logprobs are deterministic functions of ``(seed, prompt)`` (sha256-seeded
  :class:`random.Random` streams); a longer generation extends a shorter one. One decoding
  step of ``tokens_per_step`` tokens every ``token_delay_seconds``, so generations are in
  flight when a checkpoint is taken. A
  completed generation is staged under ``__calls__/<call_id>``. With
  ``ng_capture.generation_cut`` (a :class:`GenerationCutContinuation`) the backend checks
  the staged prefix it names and produces only the rest: the tokens are the same as an
  uncut generation's; a mismatch is 409 ``generation_cut_mismatch``.
- ``GET /turns`` → ``{"rollouts_by_turn": {"<turn>": count}}``: how many rollout attempts have
  started each turn as their latest (turn ``n + 1`` for a call id ``"<capture key>:<n>"``), so
  a controller can checkpoint once enough rollouts are past their first turn.
- ``GET /calls`` → every completed call in order, ``[{"call_id", "prompt_sha256", "seed",
  "tokens", "staging_key", "generated", "continued_from"}]``; ``GET /calls/count`` →
  ``{"count"}``, how many there are (the log only grows: the first ``count`` entries read
  later are those completed by then); ``POST /calls/reset`` empties it and forgets the turns
  ``GET /turns`` counts (a run after it counts only its own rollouts).
- ``POST /ng-control/v1/generation-cut`` (a :class:`GenerationCutInventory`) → a generation
  cut receipt: each named call still decoding has the tokens it produced so far staged
  under ``__generation_cut__/<rollout_id>/<model_call_id>`` and is frozen there (it
  decodes no further token) until ``POST /ng-control/v1/generation-cut/release
  {"checkpoint_id"}`` (the checkpoint resumed: it goes on), its client goes away (a crash:
  abandoned), or :data:`FREEZE_SECONDS` pass; a completed one is staged whole (a terminal
  completion); any other is a ``durable_failure``. A durable ack carries the prefix itself,
  ``prefix_token_ids`` and ``prefix_logprobs``, packed (:mod:`gymckpt.servers.token_codec`). So after a crash the replacement call
  generates only tokens nobody generated before.
- ``GET /ng-control/v1/generations`` → ``{"generations": [{"call_id", "tokens", "max_tokens",
  "frozen_by"}]}``: the generations still decoding (what a cut can name).
- ``POST /ng-control/v1/decoding {"paused": bool}`` → ``{"paused", "generations"}``: holds
  every generation before its next token, or lets them go on, and lists the generations
  still decoding at that moment (a test can checkpoint while a generation is mid-way,
  whatever the machine's load).
- ``GET /ng-control/v1/staging`` → ``{"keys"}``; ``POST /ng-control/v1/staging/delete``
  ``{"keys"}`` → ``{"deleted"}``: the trainer's view of its token store.

With ``checkpoint.control_auth_token`` set, every ``/ng-control/v1/`` route needs
``Authorization: Bearer <token>`` (401 ``unauthorized``); ``/generate`` and ``/calls`` never do.
A generation whose client disconnects is abandoned: never logged, never staged.

The modules: :mod:`~gymckpt.servers.inference_wire` (bodies, keys, digests, acks),
:mod:`~gymckpt.servers.inference_tokens` (the deterministic streams),
:mod:`~gymckpt.servers.inference_backend` (the state behind the routes); this one serves
them. Bodies are read and replies written with orjson (:mod:`gymckpt.servers.json_body`):
a cut's inventory and receipt name every undelivered call of a policy model server.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

from fastapi import Request  # noqa: TC002 - FastAPI resolves handler annotations at runtime
from pydantic import BaseModel, Field, ValidationError
from starlette.responses import Response  # noqa: TC002 - FastAPI resolves handler annotations at runtime

from gymckpt.control.responses import error_response
from gymckpt.errors import ClientDisconnected, GenerationCutMismatch, InvalidRequest, Unauthorized
from gymckpt.gc_pause import paused_gc
from gymckpt.servers.base import ServerConfig, build_app
from gymckpt.servers.inference_backend import ClientWatch, Generated, InferenceBackend, StagedTokens
from gymckpt.servers.inference_tokens import VOCAB_SIZE, generate_tokens, token_logprobs
from gymckpt.servers.inference_wire import (
    BACKEND_CONTROL_PREFIX,
    CALLS_STAGING_PREFIX,
    CUT_STAGING_PREFIX,
    GENERATION_CUT_ROUTE,
    GENERATION_CUT_SCHEMA_VERSION,
    MAX_CUT_PREFIXES,
    MAX_GENERATE_TOKENS,
    CaptureAdmission,
    DecodingRequest,
    GenerateRequest,
    GenerationCutContinuation,
    GenerationCutInventory,
    GenerationCutPrefix,
    GenerationCutRelease,
    StagingDeleteRequest,
    call_turn,
    calls_staging_key,
    cut_staging_key,
    inventory_digest,
    prefix_digest,
    token_text,
)
from gymckpt.servers.json_body import FastJSONResponse, read_json

if TYPE_CHECKING:
    from fastapi import FastAPI

logger = logging.getLogger(__name__)

__all__ = [
    "BACKEND_CONTROL_PREFIX",
    "CALLS_STAGING_PREFIX",
    "CUT_STAGING_PREFIX",
    "GENERATION_CUT_ROUTE",
    "GENERATION_CUT_SCHEMA_VERSION",
    "MAX_CUT_PREFIXES",
    "MAX_GENERATE_TOKENS",
    "VOCAB_SIZE",
    "CaptureAdmission",
    "ClientWatch",
    "Generated",
    "GenerateRequest",
    "GenerationCutContinuation",
    "GenerationCutInventory",
    "GenerationCutMismatch",
    "GenerationCutPrefix",
    "GenerationCutRelease",
    "InferenceBackend",
    "InferenceConfig",
    "StagedTokens",
    "StagingDeleteRequest",
    "build_inference_app",
    "call_turn",
    "calls_staging_key",
    "cut_staging_key",
    "generate_tokens",
    "inventory_digest",
    "token_logprobs",
    "prefix_digest",
    "token_text",
]


class InferenceConfig(ServerConfig):
    """The inference backend's config: the simulated latency of each decoding step and its tokens."""

    #: the latency of one decoding step
    token_delay_seconds: float = Field(default=0.01, ge=0)
    #: tokens one decoding step produces (long generations stay cheap: one wake-up per step, not per token)
    tokens_per_step: int = Field(default=1, ge=1)


class _BackendControlAuth:
    """ASGI middleware: every ``/ng-control/v1/`` path needs ``Authorization: Bearer <token>``."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(BACKEND_CONTROL_PREFIX):
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not secrets.compare_digest(given, self.expected):
                await error_response(Unauthorized("missing or wrong bearer token"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_detail(exc: ValidationError) -> str:
    detail = "; ".join(
        f"{'.'.join(str(part) for part in error.get('loc', ()))}: {error.get('msg', '')}" for error in exc.errors()
    )
    return detail[:2000]


async def _parse(request: Request, model: type[BaseModel]) -> tuple[Any, Any]:
    """The body as JSON and as ``model``; :class:`InvalidRequest` when it is neither."""
    raw = await read_json(request)
    try:
        return raw, model.model_validate(raw)
    except ValidationError as exc:
        raise InvalidRequest(_validation_detail(exc)) from exc


def _check_digest(raw: dict[str, Any], inventory: GenerationCutInventory) -> None:
    """The digest must be the inventory's, prefixes as sent or as read (an int ``admitted_at`` reads as a float)."""
    sent = inventory_digest(inventory.checkpoint_id, inventory.server_name, list(raw.get("active_prefixes", [])))
    if inventory.inventory_digest == sent:
        return  # as sent: the prefixes need not be written again to know
    read = inventory_digest(
        inventory.checkpoint_id,
        inventory.server_name,
        [prefix.model_dump(mode="json") for prefix in inventory.active_prefixes],
    )
    if inventory.inventory_digest != read:
        raise InvalidRequest(f"inventory_digest {inventory.inventory_digest} is not the inventory's ({read})")


def build_inference_app(config: InferenceConfig) -> FastAPI:
    """The fake inference backend's app (no checkpoint routes, whatever the config says)."""
    app, _, _ = build_app("gymckpt inference", config, participant=None)
    backend = InferenceBackend(config.token_delay_seconds, config.tokens_per_step)
    app.state.backend = backend
    if config.checkpoint.token:
        app.add_middleware(_BackendControlAuth, token=config.checkpoint.token)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        _, body = await _parse(request, GenerateRequest)  # the whole body is read before the watch starts
        async with ClientWatch().watching(request.receive) as client:
            result = await backend.generate(body, client)
        if result is None:  # nobody reads this reply
            return error_response(ClientDisconnected(body.call_id))
        return FastJSONResponse(
            {
                "call_id": body.call_id,
                "tokens": result.tokens,
                "logprobs": result.logprobs,
                "text": result.text,
                "tokens_digest": hashlib.sha256(result.text.encode()).hexdigest(),
                "staging_key": result.staging_key,
                "generated": result.generated,
                "continued_from": result.continued_from,
            }
        )

    @app.get("/turns")
    async def turns() -> dict[str, dict[str, int]]:
        return {"rollouts_by_turn": backend.rollouts_by_turn()}

    @app.get("/calls")
    async def calls() -> Response:
        return FastJSONResponse(backend.calls)

    @app.get("/calls/count")
    async def call_count() -> dict[str, int]:
        return {"count": len(backend.calls)}

    @app.post("/calls/reset")
    async def reset() -> dict[str, int]:
        return {"cleared": backend.reset_log()}

    @app.post(GENERATION_CUT_ROUTE)
    async def generation_cut(request: Request) -> Response:
        started = time.perf_counter()
        with paused_gc():  # thousands of prefixes staged at once: no full collection of the token store meanwhile
            raw, inventory = await _parse(request, GenerationCutInventory)
            _check_digest(raw, inventory)
            read = time.perf_counter()
            reply = FastJSONResponse(backend.cut(inventory))
        logger.info(
            "generation cut %s: %d calls, request read in %.3f s, staged and answered (%d bytes) in %.3f s",
            inventory.checkpoint_id,
            len(inventory.active_prefixes),
            read - started,
            len(reply.body),
            time.perf_counter() - read,
        )
        return reply

    @app.post(GENERATION_CUT_ROUTE + "/release")
    async def release(request: Request) -> dict[str, int]:
        _, body = await _parse(request, GenerationCutRelease)
        return {"released": backend.release(body.checkpoint_id)}

    @app.get(f"{BACKEND_CONTROL_PREFIX}generations")
    async def generations() -> dict[str, list[dict[str, Any]]]:
        return {"generations": backend.generations()}

    @app.post(f"{BACKEND_CONTROL_PREFIX}decoding")
    async def decoding(request: Request) -> dict[str, Any]:
        _, body = await _parse(request, DecodingRequest)
        if body.paused:
            backend.pause()
        else:
            backend.resume()
        return {"paused": body.paused, "generations": backend.generations()}

    @app.get(f"{BACKEND_CONTROL_PREFIX}staging")
    async def staging() -> dict[str, list[str]]:
        return {"keys": backend.staging_keys()}

    @app.post(f"{BACKEND_CONTROL_PREFIX}staging/delete")
    async def delete_staging(request: Request) -> dict[str, int]:
        _, body = await _parse(request, StagingDeleteRequest)
        return {"deleted": backend.delete_staged(body.keys)}

    return app
