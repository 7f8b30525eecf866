"""The fake inference backend's wire: its limits, request bodies, staging keys, digests and cut acks.

Shared by the backend (:mod:`gymckpt.servers.inference`) and its client, the policy model
server's :class:`~gymckpt.servers.model.GenerationCutClient`.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gymckpt.servers.json_body import canonical_json
from gymckpt.servers.token_codec import TOKEN_ENCODING, pack_logprobs, pack_token_ids

__all__ = [
    "BACKEND_CONTROL_PREFIX",
    "CALLS_STAGING_PREFIX",
    "CUT_STAGING_PREFIX",
    "GENERATION_CUT_ROUTE",
    "GENERATION_CUT_SCHEMA_VERSION",
    "MAX_CUT_PREFIXES",
    "MAX_GENERATE_TOKENS",
    "CaptureAdmission",
    "DecodingRequest",
    "GenerateRequest",
    "GenerationCutContinuation",
    "GenerationCutInventory",
    "GenerationCutPrefix",
    "GenerationCutRelease",
    "StagingDeleteRequest",
    "call_turn",
    "calls_staging_key",
    "cut_staging_key",
    "durable_ack",
    "failure_ack",
    "inventory_digest",
    "packed_prefix",
    "prefix_digest",
    "token_text",
]

#: the most tokens one /generate may ask for
MAX_GENERATE_TOKENS = 1_000_000
#: the most calls one generation-cut inventory may name
MAX_CUT_PREFIXES = 100_000
#: the ``schema_version`` a continuation carries (any positive version is read)
GENERATION_CUT_SCHEMA_VERSION = 2
#: every route under it needs the bearer token when one is configured
BACKEND_CONTROL_PREFIX = "/ng-control/v1/"
GENERATION_CUT_ROUTE = "/ng-control/v1/generation-cut"
#: completed generations are staged under ``__calls__/<call_id>``
CALLS_STAGING_PREFIX = "__calls__"
#: cut prefixes are staged under ``__generation_cut__/<rollout_id>/<model_call_id>``
CUT_STAGING_PREFIX = "__generation_cut__"

_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_HEX64 = r"^[0-9a-f]{64}$"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class GenerationCutPrefix(_Wire):
    """One call of a cut inventory: the ticket the model server admitted it under."""

    ticket_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    rollout_id: str = Field(min_length=1, pattern=_ID_PATTERN)
    attempt: int = Field(ge=0, strict=True)
    model_call_id: str = Field(min_length=1)
    admitted_at: float


class GenerationCutRelease(BaseModel):
    """The body of ``POST /ng-control/v1/generation-cut/release``: the checkpoint that resumed."""

    model_config = ConfigDict(extra="forbid")

    checkpoint_id: str = Field(min_length=1)


class GenerationCutInventory(_Wire):
    """The body of ``POST /ng-control/v1/generation-cut``: the calls to cut, bound by a digest."""

    checkpoint_id: str = Field(min_length=1)
    server_name: str = Field(min_length=1)
    active_prefixes: list[GenerationCutPrefix] = Field(default_factory=list, max_length=MAX_CUT_PREFIXES)
    inventory_digest: str = Field(pattern=_HEX64)


class GenerationCutContinuation(_Wire):
    """A staged prefix of the same generation, which ``/generate`` continues instead of starting over."""

    schema_version: int = Field(default=GENERATION_CUT_SCHEMA_VERSION, ge=1, strict=True)
    source_capture_key: str = Field(min_length=1)
    source_model_call_id: str = Field(min_length=1)
    staging_keys: list[str] = Field(min_length=1)
    prefix_token_count: int = Field(ge=0, strict=True)
    prefix_digest: str = Field(pattern=_HEX64)
    effective_output_limit: int = Field(ge=1, strict=True)
    terminal_finish_reason: Literal["stop", "length"] | None = None
    terminal_stop_reason: str | int | None = None

    @model_validator(mode="after")
    def _consistent(self) -> GenerationCutContinuation:
        if len(set(self.staging_keys)) != len(self.staging_keys):
            raise ValueError("generation_cut staging_keys must be unique")
        if self.terminal_stop_reason is not None and self.terminal_finish_reason is None:
            raise ValueError("terminal_stop_reason requires terminal_finish_reason")
        return self


class CaptureAdmission(BaseModel):
    """``ng_capture`` of a ``/generate``: the capture admission; only ``generation_cut`` is read."""

    model_config = ConfigDict(extra="allow")

    generation_cut: GenerationCutContinuation | None = None


class GenerateRequest(BaseModel):
    """The body of ``POST /generate``."""

    model_config = ConfigDict(extra="forbid")

    call_id: str
    prompt: str
    seed: int
    max_tokens: int = Field(ge=0, le=MAX_GENERATE_TOKENS)
    ng_capture: CaptureAdmission | None = None

    @property
    def generation_cut(self) -> GenerationCutContinuation | None:
        """The cut this call continues, if any."""
        return self.ng_capture.generation_cut if self.ng_capture is not None else None


class DecodingRequest(BaseModel):
    """The body of ``POST /ng-control/v1/decoding``: hold every generation (``paused``) or let them go on."""

    model_config = ConfigDict(extra="forbid")

    paused: bool


class StagingDeleteRequest(BaseModel):
    """The body of ``POST /ng-control/v1/staging/delete``."""

    model_config = ConfigDict(extra="forbid")

    keys: list[str] = Field(max_length=MAX_CUT_PREFIXES)


def call_turn(call_id: str) -> tuple[str, int] | None:
    """``(capture key, turn)`` of a model call id ``"<capture key>:<tool results so far>"`` (turn 1: none yet)."""
    key, _, count = call_id.rpartition(":")
    return (key, int(count) + 1) if key and count.isdigit() else None


def token_text(tokens: list[int]) -> str:
    """The text of ``tokens``: their ids, space-separated."""
    return " ".join(map(str, tokens))


def prefix_digest(tokens: list[int]) -> str:
    """A cut prefix's digest: the sha256 hex of its :func:`token_text`."""
    return hashlib.sha256(token_text(tokens).encode()).hexdigest()


def calls_staging_key(call_id: str) -> str:
    """Where a completed generation of ``call_id`` is staged."""
    return f"{CALLS_STAGING_PREFIX}/{call_id}"


def cut_staging_key(rollout_id: str, model_call_id: str) -> str:
    """Where a cut stages the prefix of ``model_call_id``."""
    return f"{CUT_STAGING_PREFIX}/{rollout_id}/{model_call_id}"


def inventory_digest(checkpoint_id: str, server_name: str, active_prefixes: list[dict[str, Any]]) -> str:
    """The ``inventory_digest`` of an inventory: sha256 hex of its canonical JSON (prefixes in the order given)."""
    payload = {"checkpoint_id": checkpoint_id, "server_name": server_name, "active_prefixes": active_prefixes}
    return hashlib.sha256(canonical_json(payload, ensure_ascii=True)).hexdigest()


def packed_prefix(tokens: list[int], logprobs: list[float]) -> dict[str, Any]:
    """A durable ack's prefix itself, packed (:mod:`gymckpt.servers.token_codec`): its token ids and logprobs."""
    return {
        "prefix_token_ids": pack_token_ids(tokens),
        "prefix_logprobs": pack_logprobs(logprobs),
        "prefix_encoding": TOKEN_ENCODING,
    }


def failure_ack() -> dict[str, Any]:
    """The ack of a call a cut could not stage: nothing durable to continue."""
    return {
        "disposition": "durable_failure",
        "cut_kind": None,
        "frozen_buffer_id": None,
        "staging_keys": [],
        "prefix_token_count": None,
        "prefix_digest": None,
        "effective_output_limit": None,
        "terminal_finish_reason": None,
        "terminal_stop_reason": None,
    }


def durable_ack(
    key: str,
    cut_kind: str,
    tokens: list[int],
    output_limit: int,
    finish_reason: str | None,
    frozen_buffer_id: str,
    *,
    digest: str | None = None,
) -> dict[str, Any]:
    """The ack of a prefix staged under ``key`` (``cut_kind``: ``active_prefix`` or ``terminal_completion``;
    ``digest``: the tokens' :func:`prefix_digest`, computed when not given)."""
    return {
        "disposition": "durable_prefix",
        "cut_kind": cut_kind,
        "frozen_buffer_id": frozen_buffer_id,
        "staging_keys": [key],
        "prefix_token_count": len(tokens),
        "prefix_digest": prefix_digest(tokens) if digest is None else digest,
        "effective_output_limit": output_limit,
        "terminal_finish_reason": finish_reason,
        "terminal_stop_reason": None,
    }
