"""The fake inference backend: deterministic tokens, produced slowly, a log of completed calls, a token store.

Not a Gym server and not a participant: it has no checkpoint routes and survives a Gym
crash, so tests and the demo can assert on its log that a restore makes no completed call
again. It plays the inference worker of a training framework towards the policy model
server: it stages token ids in a token store, cuts generations at a checkpoint, and
continues a cut generation on the replacement call.

- ``POST /generate`` ``{"call_id", "prompt", "seed", "max_tokens", "ng_capture"?}`` →
  ``{"call_id", "tokens", "logprobs", "text", "staging_key", "generated", "continued_from"}``.
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
  "tokens", "staging_key", "generated", "continued_from"}]``; ``POST /calls/reset`` empties it.
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
- ``GET /ng-control/v1/staging`` → ``{"keys"}``; ``POST /ng-control/v1/staging/delete``
  ``{"keys"}`` → ``{"deleted"}``: the trainer's view of its token store.

With ``checkpoint.control_auth_token`` set, every ``/ng-control/v1/`` route needs
``Authorization: Bearer <token>`` (401 ``unauthorized``); ``/generate`` and ``/calls`` never do.
A generation whose client disconnects is abandoned: never logged, never staged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import random
import secrets
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request  # noqa: TC002 - FastAPI resolves handler annotations at runtime
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gymckpt.control.responses import error_response
from gymckpt.errors import ClientDisconnected, GenerationCutMismatch, InvalidRequest, Unauthorized
from gymckpt.participants.signal import ChangeSignal
from gymckpt.servers.base import ServerConfig, build_app
from gymckpt.servers.token_codec import TOKEN_ENCODING, pack_logprobs, pack_token_ids

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from fastapi import FastAPI

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
    "InferenceBackend",
    "InferenceConfig",
    "StagedTokens",
    "StagingDeleteRequest",
    "build_inference_app",
    "calls_staging_key",
    "cut_staging_key",
    "generate_tokens",
    "inventory_digest",
    "token_logprobs",
    "prefix_digest",
    "token_text",
]

#: token ids are drawn from ``range(VOCAB_SIZE)``
VOCAB_SIZE = 32_000
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


class InferenceConfig(ServerConfig):
    """The inference backend's config: the simulated latency of each decoding step and its tokens."""

    #: the latency of one decoding step
    token_delay_seconds: float = Field(default=0.01, ge=0)
    #: tokens one decoding step produces (long generations stay cheap: one wake-up per step, not per token)
    tokens_per_step: int = Field(default=1, ge=1)


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


class StagingDeleteRequest(BaseModel):
    """The body of ``POST /ng-control/v1/staging/delete``."""

    model_config = ConfigDict(extra="forbid")

    keys: list[str] = Field(max_length=MAX_CUT_PREFIXES)


@dataclass
class StagedTokens:
    """One entry of the token store: a generation's token ids and what they were generated for."""

    tokens: list[int]
    seed: int
    prompt_sha256: str
    max_tokens: int
    #: True for a completed generation, False for the prefix of one cut while decoding
    complete: bool
    call_id: str = ""


@dataclass
class Generated:
    """A completed ``/generate``: the full token list and how much of it this call produced."""

    tokens: list[int]
    staging_key: str
    generated: int
    continued_from: int
    logprobs: list[float] = field(default_factory=list)


@dataclass
class _Live:
    """A generation still decoding: what a cut needs of it."""

    serial: int
    call_id: str
    seed: int
    prompt_sha256: str
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    #: the logprob of each token so far
    logprobs: list[float] = field(default_factory=list)
    #: the checkpoint whose cut froze this generation (None: decoding), and its release
    frozen_by: str | None = None
    released: asyncio.Event = field(default_factory=asyncio.Event)


#: the longest a cut generation stays frozen without a release, in seconds
FREEZE_SECONDS = 600.0


class ClientWatch:
    """Whether the client of one request went away, learnt without polling.

    :meth:`watching` reads the request's ASGI ``receive`` channel in a task of its own: once
    the body is read, the server's next message is ``http.disconnect``, sent when the
    connection closes (or the reply is complete). A generation then looks at :attr:`gone`
    per token and waits on :attr:`departed` while frozen, instead of asking the connection
    every few milliseconds: a cut freezes thousands of generations at once.
    """

    def __init__(self) -> None:
        #: set once the client went away
        self.departed = asyncio.Event()

    @property
    def gone(self) -> bool:
        """True once the client went away."""
        return self.departed.is_set()

    async def _watch(self, receive: Callable[[], Any]) -> None:
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                self.departed.set()
                return

    @contextlib.asynccontextmanager
    async def watching(self, receive: Callable[[], Any]) -> AsyncIterator[ClientWatch]:
        """Watch ``receive`` while the block runs (the task ends with it)."""
        task = asyncio.create_task(self._watch(receive))
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _rng(seed: int, prompt: str) -> random.Random:
    digest = hashlib.sha256(f"{seed}\n{prompt}".encode()).digest()
    return random.Random(int.from_bytes(digest, "big"))


def generate_tokens(seed: int, prompt: str, max_tokens: int) -> list[int]:
    """The first ``max_tokens`` tokens of ``(seed, prompt)`` (what ``/generate`` answers, without delay)."""
    rng = _rng(seed, prompt)
    return [rng.randrange(VOCAB_SIZE) for _ in range(max_tokens)]


def token_logprobs(seed: int, prompt_sha256: str, count: int) -> list[float]:
    """The logprobs of the first ``count`` tokens of ``(seed, prompt)`` (``prompt_sha256``: the prompt's sha256
    hex): a stream of their own, so the tokens stay those of :func:`generate_tokens`; 6 decimals."""
    rng = _logprob_rng(seed, prompt_sha256)
    return [_logprob(rng) for _ in range(count)]


def _logprob_rng(seed: int, prompt_sha256: str) -> random.Random:
    return random.Random(int.from_bytes(hashlib.sha256(f"logprobs\n{seed}\n{prompt_sha256}".encode()).digest(), "big"))


def _logprob(rng: random.Random) -> float:
    return -round(rng.expovariate(2.0), 6)


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
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _prefix(tokens: list[int], logprobs: list[float]) -> dict[str, Any]:
    """A durable ack's prefix itself, packed (:mod:`gymckpt.servers.token_codec`): its token ids and logprobs."""
    return {
        "prefix_token_ids": pack_token_ids(tokens),
        "prefix_logprobs": pack_logprobs(logprobs),
        "prefix_encoding": TOKEN_ENCODING,
    }


def _failure_ack() -> dict[str, Any]:
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


class InferenceBackend:
    """The generations in flight, the log of completed ones and the token store (one per app)."""

    def __init__(self, token_delay_seconds: float, tokens_per_step: int = 1) -> None:
        self.token_delay_seconds = token_delay_seconds
        self.tokens_per_step = tokens_per_step
        #: capture key → the latest turn a call of it started (:func:`call_turn`)
        self.turns: dict[str, int] = {}
        #: completed calls, in completion order
        self.calls: list[dict[str, Any]] = []
        #: generation serial → call_id, for generations not yet completed
        self.in_flight: dict[int, str] = {}
        #: generations abandoned because their client went away
        self.abandoned = 0
        #: the token store: staging key → staged token ids
        self.staged: dict[str, StagedTokens] = {}
        #: generation serial → its state, for generations not yet completed
        self._live: dict[int, _Live] = {}
        #: call id → its generations still decoding, by serial: a cut names thousands of calls
        self._live_by_call: dict[str, dict[int, _Live]] = {}
        self._serial = itertools.count()
        self._signal = ChangeSignal()
        self._decoding = asyncio.Event()
        self._decoding.set()

    def _changed(self) -> None:
        self._signal.changed()

    async def wait_until(self, predicate: Callable[[], bool], timeout: float | None = None) -> None:
        """Wait until ``predicate()`` holds, re-checked whenever a generation starts, ends or makes a token."""
        await self._signal.wait_until(predicate, timeout)

    def pause(self) -> None:
        """Hold every generation before its next token until :meth:`resume` (tests: a generation stays mid-way)."""
        self._decoding.clear()

    def resume(self) -> None:
        """Let the generations :meth:`pause` held go on."""
        self._decoding.set()

    def progress(self, call_id: str) -> int | None:
        """The tokens the latest generation of ``call_id`` still decoding has so far (None: none decodes)."""
        live = self._latest_live(call_id)
        return None if live is None else len(live.tokens)

    def _latest_live(self, call_id: str) -> _Live | None:
        lives = self._live_by_call.get(call_id)
        return lives[max(lives)] if lives else None

    # --- generation

    def _checked_prefix(self, request: GenerateRequest, cut: GenerationCutContinuation) -> StagedTokens:
        """The staged prefix ``cut`` names, if it is this request's; else :class:`GenerationCutMismatch`."""
        key = cut.staging_keys[0]
        staged = self.staged.get(key)
        if staged is None:
            raise GenerationCutMismatch(f"generation_cut: no staged prefix under {key!r}")
        differences = []
        if staged.seed != request.seed:
            differences.append(f"seed {staged.seed} != {request.seed}")
        if staged.prompt_sha256 != hashlib.sha256(request.prompt.encode()).hexdigest():
            differences.append("prompt_sha256 differs from this prompt's")
        if len(staged.tokens) != cut.prefix_token_count:
            differences.append(f"prefix_token_count {cut.prefix_token_count} != {len(staged.tokens)} staged")
        if prefix_digest(staged.tokens) != cut.prefix_digest:
            differences.append("prefix_digest differs from the staged tokens'")
        if len(staged.tokens) > request.max_tokens and cut.terminal_finish_reason is None:
            differences.append(f"{len(staged.tokens)} staged tokens exceed max_tokens {request.max_tokens}")
        if differences:
            raise GenerationCutMismatch(f"generation_cut {key!r}: " + "; ".join(differences))
        return staged

    def _complete(
        self, request: GenerateRequest, tokens: list[int], continued_from: int, logprobs: list[float] | None = None
    ) -> Generated:
        """Stage and log a completed generation (``logprobs``: those of ``tokens``, computed when not given)."""
        key = calls_staging_key(request.call_id)
        prompt_sha256 = hashlib.sha256(request.prompt.encode()).hexdigest()
        self.staged[key] = StagedTokens(
            list(tokens), request.seed, prompt_sha256, request.max_tokens, complete=True, call_id=request.call_id
        )
        generated = len(tokens) - continued_from
        if logprobs is None:
            logprobs = token_logprobs(request.seed, prompt_sha256, len(tokens))
        self.calls.append(
            {
                "call_id": request.call_id,
                "prompt_sha256": prompt_sha256,
                "seed": request.seed,
                "tokens": list(tokens),
                "staging_key": key,
                "generated": generated,
                "continued_from": continued_from,
            }
        )
        return Generated(list(tokens), key, generated, continued_from, logprobs)

    async def generate(self, request: GenerateRequest, client: ClientWatch) -> Generated | None:
        """Produce the tokens one by one; None if the ``client`` went away before the end.

        A continuation (``ng_capture.generation_cut``) starts from its checked staged prefix
        (:class:`GenerationCutMismatch` before anything is generated), or with a terminal
        finish reason returns the staged tokens at once.
        """
        self._note_turn(request.call_id)
        cut = request.generation_cut
        prefix: list[int] = []
        if cut is not None:
            prefix = list(self._checked_prefix(request, cut).tokens)
            if cut.terminal_finish_reason is not None:
                return self._complete(request, prefix, continued_from=len(prefix))
        serial = next(self._serial)
        prompt_sha256 = hashlib.sha256(request.prompt.encode()).hexdigest()
        live = _Live(serial, request.call_id, request.seed, prompt_sha256, request.max_tokens, list(prefix))
        logprob_rng = _logprob_rng(request.seed, prompt_sha256)
        live.logprobs = [_logprob(logprob_rng) for _ in prefix]
        self._live[serial] = live
        self._live_by_call.setdefault(request.call_id, {})[serial] = live
        self.in_flight[serial] = request.call_id
        self._changed()
        rng = _rng(request.seed, request.prompt)
        for _ in prefix:  # the prefix's draws, without delay: the rest is what an uncut generation makes
            rng.randrange(VOCAB_SIZE)
        try:
            while len(live.tokens) < request.max_tokens:
                if live.frozen_by is not None and not await self._stay_frozen(live, client):
                    self.abandoned += 1
                    return None
                await asyncio.sleep(self.token_delay_seconds)
                await self._decoding.wait()
                if live.frozen_by is not None:
                    continue  # cut during this step's delay: its tokens are not produced
                if client.gone:
                    self.abandoned += 1
                    return None
                step = min(self.tokens_per_step, request.max_tokens - len(live.tokens))
                live.tokens.extend([rng.randrange(VOCAB_SIZE) for _ in range(step)])
                live.logprobs.extend([_logprob(logprob_rng) for _ in range(step)])
                self._changed()
            if client.gone:
                self.abandoned += 1
                return None
            return self._complete(request, live.tokens, continued_from=len(prefix), logprobs=live.logprobs)
        finally:
            del self.in_flight[serial]
            del self._live[serial]
            lives = self._live_by_call[request.call_id]
            del lives[serial]
            if not lives:
                del self._live_by_call[request.call_id]
            self._changed()

    def _note_turn(self, call_id: str) -> None:
        turn = call_turn(call_id)
        if turn is not None and turn[1] > self.turns.get(turn[0], 0):
            self.turns[turn[0]] = turn[1]

    def rollouts_by_turn(self) -> dict[str, int]:
        """How many rollout attempts stand at each turn (the latest one a call of theirs started)."""
        return {str(turn): count for turn, count in sorted(Counter(self.turns.values()).items())}

    # --- generation cut

    async def _stay_frozen(self, live: _Live, client: ClientWatch) -> bool:
        """Wait until the cut's release (True) or the client went away (False); at most FREEZE_SECONDS."""
        loop = asyncio.get_running_loop()
        until = loop.time() + FREEZE_SECONDS
        departed = asyncio.ensure_future(client.departed.wait())
        try:
            while live.frozen_by is not None and not client.gone and (left := until - loop.time()) > 0:
                released = asyncio.ensure_future(live.released.wait())
                await asyncio.wait((released, departed), timeout=left, return_when=asyncio.FIRST_COMPLETED)
                released.cancel()
        finally:
            departed.cancel()
        if client.gone:
            return False
        live.frozen_by = None
        return True

    def generations(self) -> list[dict[str, Any]]:
        """Every generation still decoding, oldest first: its call id, tokens so far, limit and the cut freezing it."""
        return [
            {
                "call_id": live.call_id,
                "tokens": len(live.tokens),
                "max_tokens": live.max_tokens,
                "frozen_by": live.frozen_by,
            }
            for live in sorted(self._live.values(), key=lambda live: live.serial)
        ]

    def release(self, checkpoint_id: str) -> int:
        """The checkpoint ``checkpoint_id`` resumed: its frozen generations decode on; how many."""
        released = 0
        for live in self._live.values():
            if live.frozen_by == checkpoint_id:
                live.frozen_by = None
                live.released.set()
                released += 1
        return released

    def cut(self, inventory: GenerationCutInventory) -> dict[str, Any]:
        """The receipt of a cut: each named call's prefix staged (or a durable failure), in the order named."""
        echoed = inventory.model_dump(mode="json")
        return {
            "checkpoint_id": inventory.checkpoint_id,
            "cut_id": uuid.uuid4().hex,
            "inventory_digest": inventory.inventory_digest,
            "inventory": echoed,
            "backend_snapshot_id": uuid.uuid4().hex,
            "prefixes": [
                {**sent, **self._cut_one(prefix, inventory.checkpoint_id)}
                for sent, prefix in zip(echoed["active_prefixes"], inventory.active_prefixes, strict=True)
            ],
        }

    def _cut_one(self, prefix: GenerationCutPrefix, checkpoint_id: str) -> dict[str, Any]:
        key = cut_staging_key(prefix.rollout_id, prefix.model_call_id)
        live = self._latest_live(prefix.model_call_id)
        if live is not None:  # still decoding: stage what it has and freeze it there until the release
            live.frozen_by = checkpoint_id
            live.released.clear()
            tokens = list(live.tokens)
            self.staged[key] = StagedTokens(
                tokens, live.seed, live.prompt_sha256, live.max_tokens, complete=False, call_id=live.call_id
            )
            ack = self._durable_ack(key, "active_prefix", tokens, max(1, live.max_tokens - len(tokens)), None)
            return {**ack, **_prefix(tokens, live.logprobs[: len(tokens)])}
        done = self.staged.get(calls_staging_key(prefix.model_call_id))
        if done is not None and done.complete:
            tokens = list(done.tokens)
            self.staged[key] = StagedTokens(
                tokens, done.seed, done.prompt_sha256, done.max_tokens, complete=True, call_id=done.call_id
            )
            ack = self._durable_ack(key, "terminal_completion", tokens, 1, "length")
            return {**ack, **_prefix(tokens, token_logprobs(done.seed, done.prompt_sha256, len(tokens)))}
        return _failure_ack()

    @staticmethod
    def _durable_ack(
        key: str, cut_kind: str, tokens: list[int], output_limit: int, finish_reason: str | None
    ) -> dict[str, Any]:
        return {
            "disposition": "durable_prefix",
            "cut_kind": cut_kind,
            "frozen_buffer_id": uuid.uuid4().hex,
            "staging_keys": [key],
            "prefix_token_count": len(tokens),
            "prefix_digest": prefix_digest(tokens),
            "effective_output_limit": output_limit,
            "terminal_finish_reason": finish_reason,
            "terminal_stop_reason": None,
        }

    # --- token store

    def staging_keys(self) -> list[str]:
        """Every staged key, sorted."""
        return sorted(self.staged)

    def delete_staged(self, keys: list[str]) -> int:
        """Drop ``keys`` from the token store; how many were there."""
        return sum(1 for key in set(keys) if self.staged.pop(key, None) is not None)


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
    try:
        raw = await request.json()
    except ValueError as exc:
        raise InvalidRequest(f"the body is not JSON: {exc}") from exc
    try:
        return raw, model.model_validate(raw)
    except ValidationError as exc:
        raise InvalidRequest(_validation_detail(exc)) from exc


def _check_digest(raw: dict[str, Any], inventory: GenerationCutInventory) -> None:
    """The digest must be the inventory's, prefixes as sent or as read (an int ``admitted_at`` reads as a float)."""
    sent = inventory_digest(inventory.checkpoint_id, inventory.server_name, list(raw.get("active_prefixes", [])))
    read = inventory_digest(
        inventory.checkpoint_id,
        inventory.server_name,
        [prefix.model_dump(mode="json") for prefix in inventory.active_prefixes],
    )
    if inventory.inventory_digest not in (sent, read):
        raise InvalidRequest(f"inventory_digest {inventory.inventory_digest} is not the inventory's ({read})")


def build_inference_app(config: InferenceConfig) -> FastAPI:
    """The fake inference backend's app (no checkpoint routes, whatever the config says)."""
    app, _, _ = build_app("gymckpt inference", config, participant=None)
    backend = InferenceBackend(config.token_delay_seconds, config.tokens_per_step)
    app.state.backend = backend
    if config.checkpoint.token:
        app.add_middleware(_BackendControlAuth, token=config.checkpoint.token)

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> JSONResponse:
        async with ClientWatch().watching(request.receive) as client:
            result = await backend.generate(body, client)
        if result is None:  # nobody reads this reply
            return error_response(ClientDisconnected(body.call_id))
        return JSONResponse(
            {
                "call_id": body.call_id,
                "tokens": result.tokens,
                "logprobs": result.logprobs,
                "text": token_text(result.tokens),
                "staging_key": result.staging_key,
                "generated": result.generated,
                "continued_from": result.continued_from,
            }
        )

    @app.get("/turns")
    async def turns() -> dict[str, dict[str, int]]:
        return {"rollouts_by_turn": backend.rollouts_by_turn()}

    @app.get("/calls")
    async def calls() -> list[dict[str, Any]]:
        return backend.calls

    @app.post("/calls/reset")
    async def reset() -> dict[str, int]:
        cleared = len(backend.calls)
        backend.calls.clear()
        return {"cleared": cleared}

    @app.post(GENERATION_CUT_ROUTE)
    async def generation_cut(request: Request) -> JSONResponse:
        raw, inventory = await _parse(request, GenerationCutInventory)
        _check_digest(raw, inventory)
        return JSONResponse(backend.cut(inventory))

    @app.post(GENERATION_CUT_ROUTE + "/release")
    async def release(request: Request) -> dict[str, int]:
        _, body = await _parse(request, GenerationCutRelease)
        return {"released": backend.release(body.checkpoint_id)}

    @app.get(f"{BACKEND_CONTROL_PREFIX}generations")
    async def generations() -> dict[str, list[dict[str, Any]]]:
        return {"generations": backend.generations()}

    @app.get(f"{BACKEND_CONTROL_PREFIX}staging")
    async def staging() -> dict[str, list[str]]:
        return {"keys": backend.staging_keys()}

    @app.post(f"{BACKEND_CONTROL_PREFIX}staging/delete")
    async def delete_staging(request: Request) -> dict[str, int]:
        _, body = await _parse(request, StagingDeleteRequest)
        return {"deleted": backend.delete_staged(body.keys)}

    return app
