"""The policy model participant (without generation cuts).

Every ``/v1/responses`` call is tracked under its capture key through four states:

- ``waiting``: admitted while admission was closed; it starts only after resume (new calls
  are never refused by a checkpoint: P4 says they wait);
- ``in_flight``: generating (the inference backend is producing its tokens);
- ``held``: generated while admission is closed; the response is undelivered and its
  handler waits for resume before returning it;
- ``streaming``: a ``"stream": true`` response already sending bytes. Only these block
  readiness: a response half on the wire cannot be taken back.

Nothing is exported for an undelivered call: the agent calls again after a restore, so
the export is empty and a restore installs nothing (generation cuts and the capture ledger
come later). Readiness is a running count of the streaming calls.

A call's waiting, generation and hold run as one child task of its handler, so
:meth:`ModelParticipant.retire` can cancel it without cancelling the server's request
task; the handler then answers ``stale_attempt``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar

from gymckpt.control.participant import Participant
from gymckpt.errors import InvalidCheckpointState, RolloutIdRequired, StaleAttempt
from gymckpt.identity import AttemptsUpTo, EpisodeId
from gymckpt.participants.signal import AdmissionGate, ChangeSignal

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from gymckpt.store.manifest import Manifest

__all__ = ["CallState", "ModelCall", "ModelParticipant"]

T = TypeVar("T")

#: the blocker name of a streaming call that carries no rollout (only without a bound plane)
ANONYMOUS = "(no rollout)"


class CallState(StrEnum):
    """Where a model call is (the names of :meth:`ModelParticipant.counts`)."""

    WAITING = "waiting"
    IN_FLIGHT = "in_flight"
    HELD = "held"
    STREAMING = "streaming"
    ENDED = "ended"


@dataclass(eq=False)
class ModelCall:
    """One ``/v1/responses`` call of one episode attempt (``episode`` None: no rollout prefix)."""

    episode: EpisodeId | None
    stream: bool
    state: CallState = CallState.WAITING
    #: the child task running the call's wait, generation and hold (cancelled by retire)
    task: asyncio.Task[Any] | None = None
    #: set by retire: the call must stop and answer stale_attempt
    retired: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def key(self) -> str:
        """The capture key of the call's attempt (a placeholder without one)."""
        return self.episode.capture_key if self.episode is not None else ANONYMOUS


class ModelParticipant(Participant):
    """The checkpoint side of a policy model server (kind ``model``)."""

    kind = "model"

    def __init__(self, instance: str = "model-0") -> None:
        self.instance = instance
        self._gate = AdmissionGate()
        #: rollout id → its live calls (every attempt); calls without a rollout under None
        self._calls: dict[str | None, dict[ModelCall, None]] = {}
        self._counts: dict[CallState, int] = dict.fromkeys(CallState, 0)
        #: capture key → how many of its responses are streaming (the blockers, in order)
        self._streaming: dict[str, int] = {}
        self._listeners: list[Callable[[], None]] = []
        self._signal = ChangeSignal()

    # --- the data path, for the server's /v1/responses

    def admit(self, episode: EpisodeId | None, *, stream: bool = False) -> ModelCall:
        """Register a new call (state ``waiting``) after the data-path checks.

        With checkpointing on (a bound plane), a call without a rollout prefix is refused
        (:class:`RolloutIdRequired`) and one of a retired attempt too (:class:`StaleAttempt`).
        Every admitted call must be ended with :meth:`finish`.
        """
        self._check(episode)
        call = ModelCall(episode, stream)
        rollout = episode.rollout_id if episode is not None else None
        self._calls.setdefault(rollout, {})[call] = None
        self._counts[CallState.WAITING] += 1
        self._changed()
        return call

    async def respond(self, call: ModelCall, generate: Callable[[], Awaitable[T]]) -> T:
        """Run ``generate`` for ``call``: after resume if admission is closed; held after it while closed.

        Raises :class:`StaleAttempt` when a retire stops the call. A streaming call stays
        ``in_flight`` after this returns: :meth:`start_stream` holds it or starts its stream.
        """

        async def lifecycle() -> T:
            await self._wait_open(call, CallState.WAITING)
            self._check(call.episode)
            self._set_state(call, CallState.IN_FLIGHT)
            result = await generate()
            if not call.stream:
                await self._wait_open(call, CallState.HELD)
                self._set_state(call, CallState.IN_FLIGHT)
            return result

        return await self._guarded(call, lifecycle)

    async def start_stream(self, call: ModelCall) -> None:
        """Before a streaming call's first byte: hold it while admission is closed, then mark it streaming.

        The check and the mark happen without an await between them, so a checkpoint
        either sees the call held (ready) or streaming (a blocker), never neither.
        """

        async def gate() -> None:
            await self._wait_open(call, CallState.HELD)
            self._set_state(call, CallState.STREAMING)

        await self._guarded(call, gate)

    def finish(self, call: ModelCall) -> None:
        """The call ended (delivered, failed or stopped): stop tracking it."""
        if call.state is CallState.ENDED:
            return
        self._set_state(call, CallState.ENDED)
        rollout = call.episode.rollout_id if call.episode is not None else None
        calls = self._calls.get(rollout)
        if calls is not None:
            calls.pop(call, None)
            if not calls:
                del self._calls[rollout]
        call.ended.set()
        self._changed()

    def _check(self, episode: EpisodeId | None) -> None:
        if self.plane is None:
            return
        if episode is None:
            raise RolloutIdRequired(
                "with checkpointing on, model calls carry their rollout: POST /ng-rollout/<capture key>/v1/responses"
            )
        self.check_attempt(episode.capture_key)

    async def _wait_open(self, call: ModelCall, state: CallState) -> None:
        while self._gate.closed:
            self._set_state(call, state)
            await self._gate.reopened()

    async def _guarded(self, call: ModelCall, work: Callable[[], Awaitable[T]]) -> T:
        """Run ``work`` as the call's child task; a retire's cancellation becomes StaleAttempt."""
        if call.retired:
            raise StaleAttempt(f"attempt {call.key!r} was retired")
        task: asyncio.Task[T] = asyncio.ensure_future(work())
        call.task = task
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if call.retired and task.cancelled() and (current is None or not current.cancelling()):
                raise StaleAttempt(f"attempt {call.key!r} was retired while its model call ran") from None
            raise

    def _set_state(self, call: ModelCall, state: CallState) -> None:
        old = call.state
        if old is state:
            return
        call.state = state
        self._counts[old] -= 1
        self._counts[state] += 1
        if CallState.STREAMING in (old, state):
            key = call.key
            if state is CallState.STREAMING:
                self._streaming[key] = self._streaming.get(key, 0) + 1
            else:
                left = self._streaming[key] - 1
                if left:
                    self._streaming[key] = left
                else:
                    del self._streaming[key]
            if self._gate.closed:
                for listener in self._listeners:
                    listener()
        self._changed()

    # --- observation (tests, diagnostics)

    @property
    def admission_open(self) -> bool:
        """False between a checkpoint's close of admission and its resume."""
        return not self._gate.closed

    def calls_of(self, key: str) -> list[ModelCall]:
        """The live calls of the attempt ``key``."""
        episode = EpisodeId.from_capture_key(key)
        return [call for call in self._calls.get(episode.rollout_id, {}) if call.episode == episode]

    def _changed(self) -> None:
        self._signal.changed()

    async def wait_until(self, predicate: Callable[[], bool], timeout: float | None = None) -> None:
        """Wait until ``predicate()`` holds, re-checked whenever a call changes state or admission opens or closes."""
        await self._signal.wait_until(predicate, timeout)

    # --- the Participant interface

    async def close_admission(self, checkpoint_id: str) -> None:
        self._gate.close()
        self._changed()

    async def open_admission(self) -> None:
        self._gate.open()
        self._changed()

    def ready(self) -> bool:
        return not self._streaming

    def blocker_count(self) -> int:
        return len(self._streaming)

    def blockers(self, limit: int) -> list[str]:
        return [key for key, _ in zip(self._streaming, range(limit), strict=False)]

    def counts(self) -> dict[str, int]:
        return {str(state): self._counts[state] for state in CallState if state is not CallState.ENDED}

    def add_readiness_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    async def export(self, scope: list[str] | None) -> list[dict[str, Any]]:
        """Nothing: an undelivered call is left out, the agent calls again after a restore."""
        return []

    def commit_reply_extra(self) -> dict[str, Any]:
        """``staging_keys``: the inference backend's staged generations a commit keeps (none without a capture ledger)."""
        return {"staging_keys": []}

    async def install(self, records: list[dict[str, Any]], scope: list[str], manifest: Manifest) -> None:
        """Nothing to install: a model checkpoint holds no records."""
        if records:
            raise InvalidCheckpointState(
                f"the model participant exports no records, yet {len(records)} were restored "
                f"(first: {records[0].get('episode_id')!r})",
                participant=f"{self.kind}/{self.instance}",
            )

    async def retire(self, episode_ids: list[str]) -> None:
        """Stop the calls of these attempts and earlier ones of the same rollouts, wait for them, free them."""
        covered = AttemptsUpTo(episode_ids)
        doomed = [
            call
            for rollout in {EpisodeId.from_capture_key(key).rollout_id for key in episode_ids}
            for call in self._calls.get(rollout, {})
            if call.episode is not None and covered.covers(call.episode)
        ]
        for call in doomed:
            call.retired = True
            if call.task is not None and not call.task.done():
                call.task.cancel()
        await asyncio.gather(*(call.ended.wait() for call in doomed))

    async def delete_restored(self, episode_ids: list[str]) -> None:
        """Nothing was restored, and the replacement attempts' calls must go on."""
