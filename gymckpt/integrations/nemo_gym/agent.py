"""A NeMo Gym agent's ``/run`` and ``/v1/responses`` as checkpointable agent episodes, its code unchanged.

:class:`AgentActivationMiddleware` runs each top-level ``POST /run`` (a whole rollout) and
``POST /v1/responses`` (one turn loop) as one activation of the agent participant, an episode
of its own that ends with it: NeMo Gym's agents keep nothing between turn loops (the input
holds the conversation so far), so between two of them there is nothing to export. Inside it, every call the agent makes through
NeMo Gym's ``ServerClient`` is a journaled step (:mod:`gymckpt.integrations.nemo_gym.client`),
so there is a boundary after each model call and each tool call. A restored episode's
replacement request runs the agent's code again from its input; the journal answers the
calls made before the checkpoint and the conversation goes on from there.

The rollout is the request's ``/ng-rollout/<capture key>`` prefix, or for ``/run`` the row's
``_ng_rollout_id`` / ``_ng_attempt_index`` (``_ng_task_index`` and ``_ng_rollout_index``);
neither is ``rollout_id_required``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from gymckpt.control.responses import error_response
from gymckpt.errors import GymckptError, InvalidRolloutId
from gymckpt.identity import EpisodeId
from gymckpt.integrations.nemo_gym.context import IN_PROCESS_KEY, ActiveActivation, activation_context
from gymckpt.integrations.nemo_gym.journal import input_digest
from gymckpt.participants.agent import RUN
from gymckpt.participants.rollout import current_episode, episode_context

if TYPE_CHECKING:
    from gymckpt.integrations.nemo_gym.journal import JournalBook
    from gymckpt.participants.agent import AgentSessionParticipant, PlainActivation

__all__ = ["ACTIVATION_PATHS", "AgentActivationMiddleware"]

#: the agent routes that are activations: a legacy run, a turn loop
ACTIVATION_PATHS = ("/run", "/v1/responses")


async def _read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


class AgentActivationMiddleware:
    """Each top-level ``/run`` and ``/v1/responses`` is one activation of its rollout's episode."""

    def __init__(self, app: Any, participant: AgentSessionParticipant, journals: JournalBook) -> None:
        self.app = app
        self.participant = participant
        self.journals = journals

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get(IN_PROCESS_KEY):
            await self.app(scope, receive, send)  # a call of the activation to its own server: part of it
            return
        path = scope.get("path", "")
        if path not in ACTIVATION_PATHS or scope.get("method") != "POST":
            with activation_context(None):  # set per request: none inherited from an earlier one on the connection
                await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        replayed = {"done": False}

        async def again() -> dict[str, Any]:
            if replayed["done"]:
                return await receive()
            replayed["done"] = True
            return {"type": "http.request", "body": body, "more_body": False}

        started = {"yes": False}

        async def watch(message: Any) -> None:
            if message["type"] == "http.response.start":
                started["yes"] = True
            await send(message)

        try:
            payload = orjson.loads(body) if body else {}
        except orjson.JSONDecodeError:
            await self.app(scope, again, send)  # the agent's own validation answers
            return
        try:
            episode = self._episode(path, payload)
            await self._activate(episode, input_digest(payload), scope, again, watch)
        except GymckptError as exc:
            if not started["yes"]:
                await error_response(exc)(scope, again, send)
                return
            raise

    @staticmethod
    def _episode(path: str, payload: Any) -> EpisodeId | None:
        prefixed = current_episode()
        if path != "/run" or not isinstance(payload, dict):
            return prefixed
        named = EpisodeId.from_run_body(payload)
        if named is not None and prefixed is not None and named != prefixed:
            raise InvalidRolloutId(f"the row names {named} but the path names {prefixed}")
        return named or prefixed

    async def _activate(self, episode: EpisodeId | None, digest: str, scope: Any, receive: Any, send: Any) -> None:
        participant = self.participant
        key = episode.capture_key if episode is not None else None
        if key is not None and participant.kind_of(key) is None:
            participant.check_attempt(key)
            await participant.take_restored(key)  # several workers: the coordinator holds restored runs

        async def activation_body(activation: PlainActivation) -> None:
            assert key is not None
            journal = self.journals.open(key, activation.boundary if activation.restored else None)
            journal.begin(digest)
            with episode_context(episode), activation_context(ActiveActivation(key, activation, journal)):
                await self.app(scope, receive, send)

        try:
            await participant.run(key, activation_body, kind=RUN)
        finally:
            if key is not None and participant.kind_of(key) is None:
                self.journals.drop(key)  # the episode ended with its activation
