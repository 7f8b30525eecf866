"""The fake inference backend's state: generations decoding, the log of completed calls, the token store, cuts.

:class:`InferenceBackend` is what :func:`~gymckpt.servers.inference.build_inference_app`
serves (the routes and what they answer are described there): it produces each
generation's tokens a decoding step at a time, stages completed generations and cut
prefixes in its token store, freezes a cut generation at its prefix until the cut's
release, and continues a cut generation on the replacement call.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import uuid
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gymckpt.errors import GenerationCutMismatch
from gymckpt.participants.signal import ChangeSignal
from gymckpt.servers.inference_tokens import draw_tokens, logprob_stream, next_logprob, token_logprobs, token_stream
from gymckpt.servers.inference_wire import (
    call_turn,
    calls_staging_key,
    cut_staging_key,
    durable_ack,
    failure_ack,
    packed_prefix,
    token_text,
)

if TYPE_CHECKING:
    import random
    from collections.abc import AsyncIterator, Callable

    from gymckpt.servers.inference_wire import (
        GenerateRequest,
        GenerationCutContinuation,
        GenerationCutInventory,
        GenerationCutPrefix,
    )

__all__ = [
    "DECODE_CHUNK",
    "DECODE_PHASES",
    "FREEZE_SECONDS",
    "ClientWatch",
    "Generated",
    "InferenceBackend",
    "StagedTokens",
]

logger = logging.getLogger(__name__)


@dataclass
class StagedTokens:
    """One entry of the token store: a generation's token ids and what they were generated for.

    The ids are an ``array("i")``: the store keeps every completed generation, and an array,
    unlike a list of ints, is nothing the cyclic garbage collector walks.
    """

    tokens: array[int]
    seed: int
    prompt_sha256: str
    max_tokens: int
    #: True for a completed generation, False for the prefix of one cut while decoding
    complete: bool
    call_id: str = ""
    #: the tokens' :func:`~gymckpt.servers.inference_wire.token_text`, when it was at hand (None: not kept)
    text: str | None = None

    def digest(self) -> str:
        """The tokens' :func:`~gymckpt.servers.inference_wire.prefix_digest`."""
        text = self.text if self.text is not None else token_text(self.tokens)
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class Generated:
    """A completed ``/generate``: the full token list and how much of it this call produced."""

    tokens: list[int]
    staging_key: str
    generated: int
    continued_from: int
    logprobs: list[float] = field(default_factory=list)
    #: the tokens' :func:`~gymckpt.servers.inference_wire.token_text`
    text: str = ""


@dataclass
class _Live:
    """A generation still decoding: what a cut needs of it."""

    serial: int
    call_id: str
    seed: int
    prompt_sha256: str
    max_tokens: int
    #: the tokens so far, and the logprob of each: arrays, which the cyclic garbage collector never walks
    #: (thousands decode at once) and which pack without a copy (:mod:`gymckpt.servers.token_codec`)
    tokens: array[int] = field(default_factory=lambda: array("i"))
    logprobs: array[float] = field(default_factory=lambda: array("d"))
    #: the checkpoint whose cut froze this generation (None: decoding), and until when (the loop's clock)
    frozen_by: str | None = None
    frozen_until: float = 0.0
    #: the streams of its next tokens and logprobs, and its client (set when it starts decoding)
    rng: random.Random | None = None
    logprob_rng: random.Random | None = None
    client: ClientWatch | None = None
    #: resolved by the decoder: True once every token is made, False when the client went away
    outcome: asyncio.Future[bool] | None = None
    #: the decoder's phase this generation is stepped in
    phase: int = 0
    #: the text of the tokens so far, a part per decoding step: each token's id is written once,
    #: whether a cut, the completion or both need the text (and its digest)
    text_parts: list[str] = field(default_factory=list)

    def extend(self, tokens: list[int], logprobs: list[float]) -> None:
        """A decoding step's tokens and their logprobs."""
        self.tokens.extend(tokens)
        self.logprobs.extend(logprobs)
        if tokens:
            self.text_parts.append(token_text(tokens))

    def text(self) -> str:
        """The :func:`~gymckpt.servers.inference_wire.token_text` of the tokens so far."""
        return " ".join(self.text_parts)

    def end(self, complete: bool) -> None:
        """Wake the generation: complete (True), or its client went away (False)."""
        if self.outcome is not None and not self.outcome.done():
            self.outcome.set_result(complete)


#: the longest a cut generation stays frozen without a release, in seconds
FREEZE_SECONDS = 600.0
#: generations one decoding callback steps before it lets the event loop run others
DECODE_CHUNK = 512
#: how many phases a token delay's decoding steps are spread over (one wake-up of the decoder each)
DECODE_PHASES = 8


class ClientWatch:
    """Whether the client of one request went away, learnt without polling.

    :meth:`watching` reads the request's ASGI ``receive`` channel in a task of its own: once
    the body is read, the server's next message is ``http.disconnect``, sent when the
    connection closes (or the reply is complete). The decoder then looks at :attr:`gone` per
    step, and :meth:`on_departure` ends a frozen generation at once, instead of asking the
    connection every few milliseconds: a cut freezes thousands of generations at once.
    """

    def __init__(self) -> None:
        #: set once the client went away
        self.departed = asyncio.Event()
        self._on_departure: list[Callable[[], None]] = []

    def on_departure(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the client went away (at once if it has)."""
        if self.gone:
            callback()
        else:
            self._on_departure.append(callback)

    @property
    def gone(self) -> bool:
        """True once the client went away."""
        return self.departed.is_set()

    async def _watch(self, receive: Callable[[], Any]) -> None:
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                self.departed.set()
                callbacks, self._on_departure = self._on_departure, []
                for callback in callbacks:
                    callback()
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
        #: frozen buffer ids: this backend's random salt and a serial (a cut names thousands)
        self._buffer_salt = uuid.uuid4().hex[:16]
        self._buffers = itertools.count()
        self._signal = ChangeSignal()
        self._decoding = asyncio.Event()
        self._decoding.set()
        #: the generations the decoder steps (serial → state), and the decoder's task while any decode
        self._decoding_lives: dict[int, _Live] = {}
        self._decoder: asyncio.Task[None] | None = None
        #: the decoder wakes DECODE_PHASES times a token delay and steps one phase's generations each time
        self._phases = DECODE_PHASES if token_delay_seconds > 0 else 1
        self._by_phase: list[dict[int, _Live]] = [{} for _ in range(self._phases)]
        self._tick = 0

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

    def _checked_prefix(
        self, request: GenerateRequest, cut: GenerationCutContinuation, prompt_sha256: str
    ) -> StagedTokens:
        """The staged prefix ``cut`` names, if it is this request's (``prompt_sha256``: its prompt's);
        else :class:`GenerationCutMismatch`."""
        key = cut.staging_keys[0]
        staged = self.staged.get(key)
        if staged is None:
            raise GenerationCutMismatch(f"generation_cut: no staged prefix under {key!r}")
        differences = []
        if staged.seed != request.seed:
            differences.append(f"seed {staged.seed} != {request.seed}")
        if staged.prompt_sha256 != prompt_sha256:
            differences.append("prompt_sha256 differs from this prompt's")
        if len(staged.tokens) != cut.prefix_token_count:
            differences.append(f"prefix_token_count {cut.prefix_token_count} != {len(staged.tokens)} staged")
        if staged.digest() != cut.prefix_digest:
            differences.append("prefix_digest differs from the staged tokens'")
        if len(staged.tokens) > request.max_tokens and cut.terminal_finish_reason is None:
            differences.append(f"{len(staged.tokens)} staged tokens exceed max_tokens {request.max_tokens}")
        if differences:
            raise GenerationCutMismatch(f"generation_cut {key!r}: " + "; ".join(differences))
        return staged

    def _complete(
        self,
        request: GenerateRequest,
        prompt_sha256: str,
        tokens: list[int],
        continued_from: int,
        logprobs: list[float] | None = None,
        text: str | None = None,
    ) -> Generated:
        """Stage and log a completed generation (``logprobs`` and ``text``: those of ``tokens``, computed when
        not given)."""
        key = calls_staging_key(request.call_id)
        if text is None:
            text = token_text(tokens)
        self.staged[key] = StagedTokens(
            array("i", tokens),
            request.seed,
            prompt_sha256,
            request.max_tokens,
            complete=True,
            call_id=request.call_id,
            text=text,
        )
        generated = len(tokens) - continued_from
        if logprobs is None:
            logprobs = token_logprobs(request.seed, prompt_sha256, len(tokens))
        self.calls.append(
            {
                "call_id": request.call_id,
                "prompt_sha256": prompt_sha256,
                "seed": request.seed,
                "tokens": tuple(tokens),  # untracked by the garbage collector, as the log grows
                "staging_key": key,
                "generated": generated,
                "continued_from": continued_from,
            }
        )
        return Generated(list(tokens), key, generated, continued_from, list(logprobs), text)

    async def generate(self, request: GenerateRequest, client: ClientWatch) -> Generated | None:
        """Produce the tokens one by one; None if the ``client`` went away before the end.

        A continuation (``ng_capture.generation_cut``) starts from its checked staged prefix
        (:class:`GenerationCutMismatch` before anything is generated), or with a terminal
        finish reason returns the staged tokens at once.
        """
        self._note_turn(request.call_id)
        prompt_sha256 = hashlib.sha256(request.prompt.encode()).hexdigest()  # once per call: prompts are long
        cut = request.generation_cut
        prefix: list[int] = []
        if cut is not None:
            staged = self._checked_prefix(request, cut, prompt_sha256)
            prefix = list(staged.tokens)
            if cut.terminal_finish_reason is not None:
                return self._complete(request, prompt_sha256, prefix, continued_from=len(prefix), text=staged.text)
        serial = next(self._serial)
        live = _Live(serial, request.call_id, request.seed, prompt_sha256, request.max_tokens)
        logprob_rng = logprob_stream(request.seed, prompt_sha256)
        live.extend(prefix, [next_logprob(logprob_rng) for _ in prefix])
        self._live[serial] = live
        self._live_by_call.setdefault(request.call_id, {})[serial] = live
        self.in_flight[serial] = request.call_id
        self._changed()
        rng = token_stream(request.seed, request.prompt)
        draw_tokens(rng, len(prefix))  # the prefix's draws, without delay: the rest is what an uncut one makes
        live.rng, live.logprob_rng, live.client = rng, logprob_rng, client
        try:
            if len(live.tokens) < request.max_tokens and not await self._decoded(live, client):
                self.abandoned += 1
                return None
            if client.gone:
                self.abandoned += 1
                return None
            return self._complete(
                request,
                prompt_sha256,
                live.tokens,
                continued_from=len(prefix),
                logprobs=live.logprobs,
                text=live.text(),
            )
        finally:
            self._forget_decoding(live)
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

    def reset_log(self) -> int:
        """Forget the completed calls and the turns seen so far (a new run counts only its own); how many calls."""
        cleared = len(self.calls)
        self.calls.clear()
        self.turns.clear()
        return cleared

    # --- generation cut

    async def _decoded(self, live: _Live, client: ClientWatch) -> bool:
        """Hand ``live`` to the decoder; True once its tokens are all made, False if its client went away."""
        live.outcome = asyncio.get_running_loop().create_future()
        self._decoding_lives[live.serial] = live
        live.phase = self._tick % self._phases  # the phase stepped last: its first step comes a token delay on
        self._by_phase[live.phase][live.serial] = live
        client.on_departure(lambda: live.end(False))
        if self._decoder is None or self._decoder.done():
            self._decoder = asyncio.create_task(self._decode())
        return await live.outcome

    def _forget_decoding(self, live: _Live) -> None:
        if self._decoding_lives.pop(live.serial, None) is not None:
            self._by_phase[live.phase].pop(live.serial, None)

    async def _decode(self) -> None:
        """One decoding step of every generation not frozen each ``token_delay_seconds``: one task and one
        timer for them all, not one each (thousands decode at once).

        The generations are spread over :data:`DECODE_PHASES` phases by when they started, and
        the decoder wakes once per phase, so their steps and completions (and the work those
        bring the model server) come spread over the delay, not in one burst; a phase's
        generations are stepped in chunks, so requests (a cut) interleave. A generation cut
        during a step's delay makes no token in that step; one frozen longer than
        :data:`FREEZE_SECONDS` without a release decodes on; one whose client went away is
        abandoned.
        """
        loop = asyncio.get_running_loop()
        try:
            while self._decoding_lives:
                await asyncio.sleep(self.token_delay_seconds / self._phases)
                if not self._decoding.is_set():
                    await self._decoding.wait()
                self._tick += 1
                lives = list(self._by_phase[self._tick % self._phases].values())
                for start in range(0, len(lives), DECODE_CHUNK):
                    if start:
                        await asyncio.sleep(0)  # let requests (a cut) in between chunks
                    now = loop.time()
                    for live in lives[start : start + DECODE_CHUNK]:
                        self._step(live, now)
                    self._changed()
        except Exception as exc:  # never leave a generation waiting on a decoder that is gone
            logger.exception("the decoder failed; failing the generations it was decoding")
            for live in list(self._decoding_lives.values()):
                if live.outcome is not None and not live.outcome.done():
                    live.outcome.set_exception(exc)
            raise

    def _step(self, live: _Live, now: float) -> None:
        if live.outcome is None or live.outcome.done() or live.serial not in self._decoding_lives:
            return
        if live.frozen_by is not None:
            if now < live.frozen_until:
                return
            live.frozen_by = None  # frozen too long without a release: it decodes on
        assert live.rng is not None and live.logprob_rng is not None and live.client is not None
        if live.client.gone:
            live.end(False)
            return
        rng, logprob_rng = live.rng, live.logprob_rng
        step = min(self.tokens_per_step, live.max_tokens - len(live.tokens))
        live.extend(draw_tokens(rng, step), [next_logprob(logprob_rng) for _ in range(step)])
        if len(live.tokens) >= live.max_tokens:
            self._forget_decoding(live)
            live.end(True)

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

    def _buffer_id(self) -> str:
        return f"{self._buffer_salt}{next(self._buffers):016x}"

    def _cut_one(self, prefix: GenerationCutPrefix, checkpoint_id: str) -> dict[str, Any]:
        key = cut_staging_key(prefix.rollout_id, prefix.model_call_id)
        live = self._latest_live(prefix.model_call_id)
        if live is not None:  # still decoding: stage what it has and freeze it there until the release
            live.frozen_by = checkpoint_id
            live.frozen_until = asyncio.get_running_loop().time() + FREEZE_SECONDS
            tokens = array("i", live.tokens)
            staged = self.staged[key] = StagedTokens(
                tokens,
                live.seed,
                live.prompt_sha256,
                live.max_tokens,
                complete=False,
                call_id=live.call_id,
                text=live.text(),
            )
            limit = max(1, live.max_tokens - len(tokens))
            ack = durable_ack(key, "active_prefix", tokens, limit, None, self._buffer_id(), digest=staged.digest())
            return {**ack, **packed_prefix(tokens, live.logprobs[: len(tokens)])}
        done = self.staged.get(calls_staging_key(prefix.model_call_id))
        if done is not None and done.complete:
            tokens = array("i", done.tokens)
            self.staged[key] = StagedTokens(
                tokens,
                done.seed,
                done.prompt_sha256,
                done.max_tokens,
                complete=True,
                call_id=done.call_id,
                text=done.text,
            )
            ack = durable_ack(key, "terminal_completion", tokens, 1, "length", self._buffer_id(), digest=done.digest())
            return {**ack, **packed_prefix(tokens, token_logprobs(done.seed, done.prompt_sha256, len(tokens)))}
        return failure_ack()

    # --- token store

    def staging_keys(self) -> list[str]:
        """Every staged key, sorted."""
        return sorted(self.staged)

    def delete_staged(self, keys: list[str]) -> int:
        """Drop ``keys`` from the token store; how many were there."""
        return sum(1 for key in set(keys) if self.staged.pop(key, None) is not None)
