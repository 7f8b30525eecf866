"""The policy model participant: held responses, generation cuts and the capture ledger (P4).

Every ``/v1/responses`` call is tracked under its capture key through four states:

- ``waiting``: admitted while admission was closed; it starts only after resume (new calls
  are never refused by a checkpoint: P4 says they wait);
- ``in_flight``: generating (the inference backend is producing its tokens);
- ``held``: generated while admission is closed; the response is undelivered and its
  handler waits for resume before returning it;
- ``streaming``: a ``"stream": true`` response already sending bytes. Only these block
  readiness: a response half on the wire cannot be taken back.

Generation cuts. Closing admission (prepare) asks the inference backend, through
:attr:`ModelParticipant.cut_source`, to cut every undelivered call of an episode that
has been sent to it (:attr:`ModelCall.sent`) at a durable token prefix, within half of
the remaining deadline (:meth:`note_deadline`); the backend holds a cut generation at its
prefix until resume (:attr:`release_source`), so after a crash no token past the prefix
was generated and is generated again. A call with constrained decoding
(:attr:`ModelCall.constrained`) is never cut; a cut that fails leaves the call held and
the checkpoint valid (it is generated again after a crash). Counts: ``cut``,
``cut_failed``, ``cut_skipped``.

The capture ledger. Each delivered call leaves a row ``{model_call_id, request_digest,
staging_key, tokens, response_digest, …}`` under its capture key (:meth:`ModelParticipant.delivered`;
the reference server adds the generation's ``token_ids`` and ``logprobs``, packed). A commit
exports, per scoped episode with rows or a cut, ``{"episode_id", "rows", "generation_cuts"}``
(one cut per episode: its latest admitted undelivered call's; a generation that completed
while undelivered is kept whole, as a terminal cut; a cut carries its ``prefix``, the
token ids and logprobs it kept, when the backend gave them), and its reply lists the
``staging_keys`` those records still refer to (and ``staging_keys_by_episode``). A restore,
only on a server that has served no call, installs the rows under the replacement attempt
and keeps each restored cut until the replacement call with the same request delivers:
that call continues the cut's prefix (:meth:`ModelParticipant.continuation_for`). A
restored row the replacement asks for again (the same request: the response had left the
model server but the agent's checkpoint was taken before it arrived) is replayed from its
staged tokens, not generated again, and the ledger keeps the one row.

A call's waiting, generation and hold run as one child task of its handler, so
:meth:`ModelParticipant.retire` can cancel it without cancelling the server's request
task; the handler then answers ``stale_attempt``. Calls without a rollout (health checks,
evaluations) are admitted and tracked, but never cut or exported.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, TypeVar

from gymckpt import telemetry
from gymckpt.control.participant import Participant
from gymckpt.errors import ControlError, StaleAttempt
from gymckpt.identity import AttemptsUpTo, EpisodeId
from gymckpt.participants.model_calls import CallState, ModelCall
from gymckpt.participants.model_records import checked_records, staging_keys_of
from gymckpt.participants.signal import AdmissionGate, ChangeSignal

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from gymckpt.store.manifest import Manifest

__all__ = ["SERVED_REFUSAL", "CallState", "ModelCall", "ModelParticipant", "staging_keys_of"]

logger = logging.getLogger(__name__)

#: the detail of a restore refused on a model server that has served calls
SERVED_REFUSAL = "model restore requires a freshly started model server; this one has served calls"
#: how long a cut round may take when no deadline was noted, in seconds
DEFAULT_CUT_SECONDS = 10.0

T = TypeVar("T")


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
        #: set by the server: asks the inference backend to cut undelivered calls
        self.cut_source: Callable[[str, list[dict[str, Any]]], Awaitable[dict[str, dict[str, Any]]]] | None = None
        #: set by the server: tells the backend a checkpoint resumed (its cut generations decode on)
        self.release_source: Callable[[str], Awaitable[Any]] | None = None
        self._cut_checkpoint: str | None = None
        self._deadline_ts: float | None = None
        #: whether any call was admitted since start (a restore needs a fresh server)
        self.served = False
        #: the capture ledger: capture key → rows of its delivered calls
        self.ledger: dict[str, list[dict[str, Any]]] = {}
        #: restored cuts by the capture key of the attempt that continues them
        self.restored_cuts: dict[str, dict[str, Any]] = {}
        #: restored ledger rows no call has replayed yet, by capture key
        self.restored_rows: dict[str, list[dict[str, Any]]] = {}
        #: calls answered by replaying a restored row
        self.replayed = 0
        self._exported: list[dict[str, Any]] = []

    # --- the data path, for the server's /v1/responses

    def admit(
        self,
        episode: EpisodeId | None,
        *,
        stream: bool = False,
        call_id: str = "",
        request_digest: str = "",
        constrained: str | None = None,
        sent: bool = True,
    ) -> ModelCall:
        """Register a new call (state ``waiting``) after the data-path checks.

        A call of a retired attempt is refused (:class:`StaleAttempt`); one without a
        rollout prefix is admitted (an evaluation, a probe) but never cut or exported.
        Every admitted call must be ended with :meth:`finish`. ``sent=False``: the server
        sets :attr:`ModelCall.sent` once the call's request goes out to the backend.
        """
        self._check(episode)
        self.served = True
        call = ModelCall(
            episode, stream, call_id=call_id, request_digest=request_digest, constrained=constrained, sent=sent
        )
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
        if self.plane is None or episode is None:
            return
        self.check_attempt(episode.capture_key)

    # --- generation cuts and the capture ledger, for the server

    def continuation_for(self, call: ModelCall) -> dict[str, Any] | None:
        """What ``call`` continues (same attempt, same request), else None.

        A restored cut's continuation (never for constrained decoding), else a terminal
        continuation replaying a restored ledger row with the same request: the whole
        response, staged, so nothing is generated.
        """
        if call.episode is None or not call.request_digest:
            return None
        restored = self.restored_cuts.get(call.key)
        if restored is not None and restored.get("request_digest") == call.request_digest and not call.constrained:
            call.continues = restored
            return dict(restored["continuation"])
        rows = self.restored_rows.get(call.key, [])
        row = next((row for row in rows if row.get("request_digest") == call.request_digest), None)
        if row is None:
            return None
        rows.remove(row)
        call.replays = row
        return {
            "schema_version": 2,
            "source_capture_key": call.key,
            "source_model_call_id": row["model_call_id"],
            "staging_keys": [row["staging_key"]],
            "prefix_token_count": row["tokens"],
            "prefix_digest": row["response_digest"],
            "effective_output_limit": 1,
            "terminal_finish_reason": "length",
            "terminal_stop_reason": None,
        }

    def continuation_refused(self, call: ModelCall) -> None:
        """The backend could not continue ``call`` (its staged tokens are gone): it is generated anew.

        A replayed row's response is then not the one the trajectory gets: it leaves the ledger.
        """
        row, call.replays = call.replays, None
        if row is not None:
            rows = self.ledger.get(call.key, [])
            if row in rows:
                rows.remove(row)

    def delivered(self, call: ModelCall, row: dict[str, Any]) -> None:
        """``call``'s response was delivered: its ledger row is kept, a restored cut it continued is used up."""
        call.delivered = True
        if call.episode is None:
            return
        if call.replays is not None:
            self.replayed += 1  # the ledger already has this response's row
        else:
            self.ledger.setdefault(call.key, []).append(dict(row))
        if call.continues is not None and self.restored_cuts.get(call.key) is call.continues:
            del self.restored_cuts[call.key]

    def generated(
        self,
        call: ModelCall,
        staging_key: str | None,
        tokens: int,
        digest: str,
        *,
        prefix: dict[str, Any] | None = None,
    ) -> None:
        """``call``'s generation completed and was staged: if it stays undelivered, a checkpoint keeps all of it.

        A terminal cut (``terminal_finish_reason`` set) continues without generating a token.
        ``prefix`` (e.g. ``{"token_ids", "logprobs", "encoding"}``) is the generation itself, kept in the cut's record.
        """
        if call.episode is None or not staging_key or call.constrained is not None:
            return
        call.prefix = prefix
        call.terminal = {
            "schema_version": 2,
            "source_capture_key": call.key,
            "source_model_call_id": call.call_id,
            "staging_keys": [staging_key],
            "prefix_token_count": tokens,
            "prefix_digest": digest,
            "effective_output_limit": 1,
            "terminal_finish_reason": "length",
            "terminal_stop_reason": None,
        }

    def _kept(self, call: ModelCall) -> dict[str, Any] | None:
        """What a checkpoint keeps of an undelivered call: its whole generation, else its cut prefix."""
        return call.terminal if call.terminal is not None else call.cut

    @staticmethod
    def _kept_prefix(call: ModelCall) -> dict[str, Any] | None:
        """The token ids and logprobs of what :meth:`_kept` keeps, when known."""
        return call.prefix if call.terminal is not None else call.cut_prefix

    def note_deadline(self, deadline_ts: float | None) -> None:
        """The deadline of the prepare about to close admission: the cut round takes half of what is left."""
        self._deadline_ts = deadline_ts

    def _undelivered(self) -> list[ModelCall]:
        return [
            call
            for calls in self._calls.values()
            for call in calls
            if call.episode is not None
            and call.state in (CallState.IN_FLIGHT, CallState.HELD)
            and call.call_id
            and not call.delivered
        ]

    async def _cut_round(self, checkpoint_id: str, *, again: bool = False) -> None:
        """Ask the backend to cut every undelivered, unconstrained call; a failure leaves them held.

        ``again`` (at export): only the calls this checkpoint has kept nothing of yet, e.g. one
        whose generation had not reached the backend when admission closed.
        """
        undelivered = self._undelivered()
        if again:
            cuttable = [call for call in undelivered if call.constrained is None and self._kept(call) is None]
        else:
            for call in undelivered:
                call.cut, call.cut_failed, call.cut_prefix = None, False, None
            cuttable = [call for call in undelivered if call.constrained is None]
        # a call still waiting to be sent has nothing at the backend to cut
        cuttable = [call for call in cuttable if call.sent]
        if self.cut_source is None or not cuttable:
            return
        remaining = DEFAULT_CUT_SECONDS if self._deadline_ts is None else self._deadline_ts - time.time()
        prefixes = [
            {
                "ticket_id": call.ticket_id,
                "rollout_id": call.episode.rollout_id,
                "attempt": call.episode.attempt,
                "model_call_id": call.call_id,
                "admitted_at": call.admitted_at,
            }
            for call in cuttable
            if call.episode is not None
        ]
        self._cut_checkpoint = checkpoint_id
        with telemetry.step("generation_cut", calls=len(prefixes), again=again) as step:
            try:
                async with asyncio.timeout(max(0.0, remaining) / 2):
                    acks = await self.cut_source(checkpoint_id, prefixes)
            except Exception as exc:  # the backend, the network, the deadline: the calls stay held, uncut
                logger.warning("the generation cut of %d calls failed: %s", len(cuttable), exc)
                acks = {}
            dispositions = Counter(
                str((acks.get(call.ticket_id) or {}).get("disposition", "no_ack")) for call in cuttable
            )
            step.set(**{f"cut_{name}": count for name, count in dispositions.items()})
            for name, count in dispositions.items():
                telemetry.event("generation_cut", count, disposition=name)
        for call in cuttable:
            ack = acks.get(call.ticket_id)
            if ack is not None and ack.get("disposition") == "durable_prefix":
                call.cut, call.cut_failed = _continuation(call, ack), False
                if ack.get("prefix_token_ids") is not None:  # the prefix itself, as the backend gave it
                    call.cut_prefix = {
                        "token_ids": ack["prefix_token_ids"],
                        "logprobs": ack.get("prefix_logprobs"),
                        "encoding": ack.get("prefix_encoding"),
                    }
            elif self._kept(call) is None:
                call.cut_failed = True
        self._changed()

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
        """Hold every undelivered response, make new calls wait, then cut the undelivered calls."""
        self._gate.close()
        self._changed()
        await self._cut_round(checkpoint_id)

    async def open_admission(self) -> None:
        """Deliver what was held; this checkpoint's cuts are over (the calls were not interrupted)."""
        for call in self._undelivered():
            call.cut, call.cut_failed, call.cut_prefix = None, False, None
        checkpoint_id, self._cut_checkpoint = self._cut_checkpoint, None
        if checkpoint_id is not None and self.release_source is not None:
            try:  # the backend froze the cut generations at their prefixes: they decode on
                await self.release_source(checkpoint_id)
            except Exception as exc:  # a backend that keeps them frozen lets them go after its own bound
                logger.warning("releasing the generations cut for %s failed: %s", checkpoint_id, exc)
        self._gate.open()
        self._changed()

    def ready(self) -> bool:
        return not self._streaming

    def blocker_count(self) -> int:
        return len(self._streaming)

    def blockers(self, limit: int) -> list[str]:
        return [key for key, _ in zip(self._streaming, range(limit), strict=False)]

    def counts(self) -> dict[str, int]:
        """Calls by state, and the undelivered calls ``cut``, ``cut_failed`` and ``cut_skipped`` (constrained)."""
        counts = {str(state): self._counts[state] for state in CallState if state is not CallState.ENDED}
        undelivered = self._undelivered()
        counts["cut"] = sum(1 for call in undelivered if self._kept(call) is not None)
        counts["cut_failed"] = sum(1 for call in undelivered if call.cut_failed and call.terminal is None)
        counts["cut_skipped"] = sum(1 for call in undelivered if call.constrained is not None)
        return counts

    def add_readiness_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    async def export(self, scope: list[str] | None) -> list[dict[str, Any]]:
        """Per scoped episode with ledger rows or a cut: ``{"episode_id", "rows", "generation_cuts"}``.

        The cut is the one of the episode's latest admitted undelivered call, else a restored
        cut no replacement call has delivered yet. Delivered calls' rows only: an undelivered
        call is continued from its cut, or called again, after a restore.
        """
        if self._cut_checkpoint is not None:
            await self._cut_round(self._cut_checkpoint, again=True)
        cuts: dict[str, ModelCall] = {}
        for call in self._undelivered():
            if self._kept(call) is not None and (call.key not in cuts or call.admitted_at > cuts[call.key].admitted_at):
                cuts[call.key] = call
        keys = (
            list(dict.fromkeys([*self.ledger, *cuts, *self.restored_cuts]))
            if scope is None
            else list(dict.fromkeys(scope))
        )
        records = []
        for key in keys:
            rows = self.ledger.get(key, [])
            cut = cuts.get(key)
            if cut is not None:
                kept: dict[str, Any] = {
                    "model_call_id": cut.call_id,
                    "request_digest": cut.request_digest,
                    "continuation": self._kept(cut),
                }
                if (prefix := self._kept_prefix(cut)) is not None:
                    kept["prefix"] = prefix
                generation_cuts = [kept]
            elif key in self.restored_cuts:
                generation_cuts = [dict(self.restored_cuts[key])]
            else:
                generation_cuts = []
            if rows or generation_cuts:
                # rows are never changed once delivered: the record shares them (its list is its own)
                records.append({"episode_id": key, "rows": list(rows), "generation_cuts": generation_cuts})
        self._exported = records
        return records

    def commit_reply_extra(self) -> dict[str, Any]:
        """``staging_keys`` (every staged key the exported records refer to) and ``staging_keys_by_episode``."""
        by_episode = {record["episode_id"]: staging_keys_of(record) for record in self._exported}
        return {
            "staging_keys": sorted({key for keys in by_episode.values() for key in keys}),
            "staging_keys_by_episode": by_episode,
        }

    def live_work(self) -> list[str]:
        """The capture keys of live calls (a restore refuses to run over them)."""
        return sorted({call.key for calls in self._calls.values() for call in calls if call.episode is not None})

    async def install(self, records: list[dict[str, Any]], scope: list[str], manifest: Manifest) -> None:
        """Install the ledger rows and restored cuts under the replacement attempts (all checked first).

        Refused (409 ``checkpoint_error``) on a server that has served a call since it started.
        """
        if self.served:
            raise ControlError(SERVED_REFUSAL)
        checked = checked_records(records, f"{self.kind}/{self.instance}")
        for key, rows, cut in checked:
            self.ledger[key] = list(rows)  # its own list; the rows themselves are never changed: not copied
            replayable = [
                row
                for row in self.ledger[key]
                if isinstance(row.get("staging_key"), str)
                and isinstance(row.get("request_digest"), str)
                and isinstance(row.get("response_digest"), str)
                and type(row.get("tokens")) is int
            ]
            if replayable:
                self.restored_rows[key] = replayable
            if cut is not None:
                self.restored_cuts[key] = dict(cut)

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
        for key in [key for key in {*self.ledger, *self.restored_cuts} if covered.covers(key)]:
            self.ledger.pop(key, None)
            self.restored_cuts.pop(key, None)
            self.restored_rows.pop(key, None)

    async def delete_restored(self, episode_ids: list[str]) -> None:
        """Drop the restored cuts and rows a commit left out whose replacement has made no call."""
        live = {call.key for calls in self._calls.values() for call in calls}
        for key in episode_ids:
            if key not in live and key in self.restored_cuts:
                del self.restored_cuts[key]
                self.ledger.pop(key, None)
                self.restored_rows.pop(key, None)

    def status_extra(self) -> dict[str, Any]:
        """``restored_generation_cuts`` (the attempts whose restored cut no call has delivered yet) and
        ``replayed_calls`` (calls answered from a restored ledger row)."""
        return {"restored_generation_cuts": sorted(self.restored_cuts), "replayed_calls": self.replayed}


def _continuation(call: ModelCall, ack: dict[str, Any]) -> dict[str, Any]:
    """What a replacement call sends the backend to continue ``call``'s cut (the reference's field names)."""
    return {
        "schema_version": 2,
        "source_capture_key": call.key,
        "source_model_call_id": call.call_id,
        "staging_keys": list(ack.get("staging_keys") or []),
        "prefix_token_count": ack.get("prefix_token_count"),
        "prefix_digest": ack.get("prefix_digest"),
        "effective_output_limit": ack.get("effective_output_limit"),
        "terminal_finish_reason": ack.get("terminal_finish_reason"),
        "terminal_stop_reason": ack.get("terminal_stop_reason"),
    }
