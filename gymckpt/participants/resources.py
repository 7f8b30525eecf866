"""The resources participant: tool-server sessions keyed by the rollout attempt.

A resources server subclasses :class:`CheckpointedResources`, declares in code what it can
do (``checkpoint_mode``, ``checkpoint_verify``) and, for ``exported``, implements the three
async session hooks. :class:`ResourcesParticipant` wraps the server; its ASGI middleware
(:class:`ResourcesMiddleware`, installed by ``install_checkpointing``) applies to every
request as a whole, so no request body is ever inspected:

- Every data request must carry the rollout prefix (``/ng-rollout/<capture key>/…``);
  one without it is ``rollout_id_required`` (400), one of a retired attempt is
  ``stale_attempt`` (409). Control routes, health probes and the API docs
  (:data:`~gymckpt.participants.rollout.UNFENCED_PATHS`) are not fenced, nor the participant's
  ``exempt_paths`` (``checkpoint.exempt_paths``, and an integration's defaults).
- The session lifecycle comes from the paths: a successful ``/seed_session`` starts the
  session of the request's capture key; a successful ``/verify`` or ``/close_session``
  ends it. A server whose sessions also start elsewhere (a tool call on an unknown
  session) calls :meth:`CheckpointedResources.checkpoint_session_started`.
- Every ``/seed_session`` reply carries ``x-ng-checkpoint-verify: wait|replay`` and, for a
  ``restart_only`` server, ``x-ng-checkpoint-restart: 1``.
- Replay-safe requests (``/seed_session``, and ``/verify`` when declared ``replay``) are
  admitted while admission is closed and never block readiness. Every other request
  arriving while closed waits for resume (it is not refused, and not in flight while it
  waits); one admitted while open blocks readiness until it finishes (a running count).
- A ``restart_only`` server's rollouts are restarts: they keep running through a
  checkpoint, so its admission stays open for them (no request waits or blocks) except
  ``/seed_session``, which waits for resume so that the set of restarts cannot change.
- A session seeded while closed is not part of that checkpoint (neither blocks nor is
  exported, nor listed as a restart); it becomes an ordinary session on resume. A session
  a replay ``/verify`` ends while closed stays in that checkpoint until resume (the verify
  may run again after a crash).

Modes:

- ``restart_only`` (default): live sessions are reported by :meth:`restarts` (never
  blocking, never exported: SPEC glossary), so the controller starts those rollouts over.
- ``stateless``: nothing is exported; only requests in flight block.
- ``exported``: :meth:`export` asks ``export_session_states(ids)`` once for every scoped
  session still held and writes ``{"episode_id": key, "state": state}``; a session missing
  from the result was dropped by the server and is no longer tracked. :meth:`install`
  hands the restored states (already keyed by the next attempt) to
  ``restore_session_states``.

Retire stops the requests of the given attempts and earlier ones (they answer
``stale_attempt``), waits for them, calls ``retire_session_state`` for every such session
(and for each given key, tracked or not: the hook must accept unknown ids) and forgets it.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from itertools import chain
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

from gymckpt.control.participant import Participant
from gymckpt.control.responses import error_response
from gymckpt.errors import GymckptError, InvalidCheckpointState, RolloutIdRequired, StaleAttempt
from gymckpt.identity import AttemptsUpTo, first_keys
from gymckpt.participants.rollout import SESSION_HEADER, current_episode, is_unfenced
from gymckpt.participants.signal import AdmissionGate

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from starlette.requests import Request

    from gymckpt.store.manifest import Manifest

__all__ = [
    "RESTART_HEADER",
    "SESSION_HEADER",
    "VERIFY_HEADER",
    "CheckpointMode",
    "CheckpointVerify",
    "CheckpointedResources",
    "ResourcesMiddleware",
    "ResourcesParticipant",
    "seed_session_key",
    "session_key",
]

CheckpointMode = Literal["restart_only", "stateless", "exported"]
CheckpointVerify = Literal["wait", "replay"]

#: on every /seed_session reply (checkpointing on): whether /verify may run again after a crash
VERIFY_HEADER = "x-ng-checkpoint-verify"
#: on /seed_session replies of a server that cannot capture its rollouts
RESTART_HEADER = "x-ng-checkpoint-restart"
#: with checkpointing off, the caller names its session with this header (the seed reply's ``session``)

SEED_PATH = "/seed_session"
VERIFY_PATH = "/verify"
CLOSE_PATH = "/close_session"


def session_key(request: Request) -> str:
    """The session of a request: the capture key of its rollout, else the ``x-session-id`` header.

    With checkpointing on the middleware has already refused requests without a rollout,
    so the capture key is always there; with it off the caller passes back the
    ``session`` of its seed reply in ``x-session-id``.
    """
    episode = current_episode()
    if episode is not None:
        return episode.capture_key
    given = request.headers.get(SESSION_HEADER)
    if given:
        return given
    from fastapi import HTTPException

    raise HTTPException(status_code=400, detail=f"name the session in the {SESSION_HEADER} header")


def seed_session_key(request: Request) -> str:
    """The session a ``/seed_session`` starts: the rollout's capture key, the given header, or a new id."""
    episode = current_episode()
    if episode is not None:
        return episode.capture_key
    return request.headers.get(SESSION_HEADER) or uuid.uuid4().hex


class CheckpointedResources:
    """Base of a resources server's state: its declarations and session hooks.

    ``checkpoint_mode`` and ``checkpoint_verify`` are properties of the code, declared as
    class attributes, never configuration. Only ``exported`` servers must override
    :meth:`export_session_states` and :meth:`restore_session_states`.
    """

    checkpoint_mode: ClassVar[CheckpointMode] = "restart_only"
    checkpoint_verify: ClassVar[CheckpointVerify] = "wait"

    #: set when a :class:`ResourcesParticipant` wraps this server (checkpointing on)
    checkpoint_participant: ResourcesParticipant | None = None

    async def export_session_states(self, session_ids: list[str]) -> dict[str, Any]:
        """State of each of these sessions the server still holds; one left out was dropped.

        The states are stored as they are, after this returns: return copies (or state no
        request will mutate until resume).
        """
        return {}

    async def restore_session_states(self, states: dict[str, Any]) -> None:
        """Install restored states, keyed by the next attempt's capture key."""
        if states:
            raise NotImplementedError(f"{type(self).__name__} cannot restore session states")

    async def park_session_states(self, session_ids: list[str]) -> None:
        """The controller stops after this checkpoint: free what these exported sessions hold
        outside the process (sandboxes). Their state was stored; default: nothing to free."""

    async def retire_session_state(self, session_id: str) -> None:
        """Free a session's state; a session the server does not hold is not an error."""

    def checkpoint_session_started(self, session_id: str) -> None:
        """Tell the participant a session began outside ``/seed_session`` (e.g. a tool call)."""
        if self.checkpoint_participant is not None:
            self.checkpoint_participant.session_started(session_id)

    def checkpoint_session_ended(self, session_id: str) -> None:
        """Tell the participant a session ended outside ``/verify`` and ``/close_session``."""
        if self.checkpoint_participant is not None:
            self.checkpoint_participant.session_ended(session_id)


class ResourcesParticipant(Participant):
    """The checkpoint side of one resources server (see the module notes)."""

    kind = "resources"

    def __init__(self, server: CheckpointedResources, instance: str = "resources-0") -> None:
        mode, verify = server.checkpoint_mode, server.checkpoint_verify
        if mode not in get_args(CheckpointMode):
            raise ValueError(
                f"{type(server).__name__}.checkpoint_mode {mode!r} is not one of {get_args(CheckpointMode)}"
            )
        if verify not in get_args(CheckpointVerify):
            raise ValueError(
                f"{type(server).__name__}.checkpoint_verify {verify!r} is not one of {get_args(CheckpointVerify)}"
            )
        if mode == "exported":
            for hook in ("export_session_states", "restore_session_states"):
                if getattr(type(server), hook) is getattr(CheckpointedResources, hook):
                    raise TypeError(f"{type(server).__name__} declares checkpoint_mode 'exported' but lacks {hook}")
        self.server = server
        self.instance = instance
        self.mode: CheckpointMode = mode
        self.verify: CheckpointVerify = verify
        server.checkpoint_participant = self
        self._gate = AdmissionGate()
        # live sessions that belong to checkpoints (insertion ordered), and those seeded while closed
        self._sessions: dict[str, None] = {}
        self._late: dict[str, None] = {}
        # sessions a replay /verify ended while closed: they leave on resume
        self._ending: set[str] = set()
        # restored sessions no request has touched yet (the only ones delete_restored frees)
        self._untouched: set[str] = set()
        # every admitted request (waiting or running) by capture key, and the blocking ones
        self._tasks: dict[str, set[asyncio.Task[None]]] = {}
        self._blocking: dict[asyncio.Task[None], str] = {}
        self._waiting = 0
        self._running = 0
        self._listeners: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ wiring

    @property
    def middleware(self) -> type[ResourcesMiddleware]:
        """The ASGI middleware ``install_checkpointing`` adds (``participant=self``)."""
        return ResourcesMiddleware

    @property
    def closed(self) -> bool:
        """True while a checkpoint (or a restore) holds admission closed."""
        return self._gate.closed

    # ------------------------------------------------------------------ sessions

    def session_started(self, key: str) -> None:
        """A session began outside ``/seed_session`` (a blocking request): it is an ordinary session."""
        if key not in self._sessions and key not in self._late:
            self._sessions[key] = None

    def session_ended(self, key: str) -> None:
        """A session ended: stop tracking it at once."""
        self._forget(key)

    def _seeded(self, key: str) -> None:
        self._ending.discard(key)
        if key in self._sessions:
            return
        if self._gate.closed:
            self._late[key] = None
        else:
            self._sessions[key] = None

    def _ended(self, key: str, *, replay: bool) -> None:
        if replay and self._gate.closed and key in self._sessions:
            self._ending.add(key)  # part of this checkpoint until resume: the verify may replay
            return
        self._forget(key)

    def _forget(self, key: str) -> None:
        self._sessions.pop(key, None)
        self._late.pop(key, None)
        self._ending.discard(key)
        self._untouched.discard(key)

    # ------------------------------------------------------------------ requests (the middleware)

    def _track(self, key: str, task: asyncio.Task[None]) -> None:
        self._tasks.setdefault(key, set()).add(task)
        self._untouched.discard(key)

    def _untrack(self, key: str, task: asyncio.Task[None]) -> None:
        tasks = self._tasks.get(key)
        if tasks is not None:
            tasks.discard(task)
            if not tasks:
                del self._tasks[key]

    async def _admit(self) -> None:
        """Wait while admission is closed; a waiting request is not in flight."""
        if not self._gate.closed:
            return
        self._waiting += 1
        try:
            await self._gate.until_open()
        finally:
            self._waiting -= 1

    def _start(self, key: str, task: asyncio.Task[None], *, blocking: bool) -> None:
        self._running += 1
        if blocking:
            self._blocking[task] = key

    def _finish(self, task: asyncio.Task[None]) -> None:
        self._running -= 1
        if self._blocking.pop(task, None) is not None:
            self._notify()

    def _notify(self) -> None:
        for listener in self._listeners:
            listener()

    # ------------------------------------------------------------------ the Participant interface

    async def close_admission(self, checkpoint_id: str) -> None:
        """New non-replay-safe requests wait; requests in flight go on."""
        self._gate.close()

    async def open_admission(self) -> None:
        """Wake waiting requests; late sessions become ordinary, replay-ended ones leave."""
        if not self._gate.open():
            return
        for key in sorted(self._ending):
            self._forget(key)
        self._sessions.update(self._late)
        self._late.clear()

    def ready(self) -> bool:
        """No request in flight blocks (restart_only servers never block). O(1)."""
        return not self._blocking

    def blocker_count(self) -> int:
        """How many requests in flight block readiness."""
        return len(self._blocking)

    def blockers(self, limit: int) -> list[str]:
        """Capture keys of at most ``limit`` blocking requests (each key once)."""
        keys: dict[str, None] = {}
        for key in self._blocking.values():
            if len(keys) >= limit:
                break
            keys[key] = None
        return list(keys)

    def restarts(self) -> list[str]:
        """A restart_only server's live sessions (not those seeded while closed)."""
        return list(self._sessions) if self.mode == "restart_only" else []

    def live_work(self) -> list[str]:
        """Sessions held and requests in flight (a restore refuses to run over them)."""
        return sorted({*self._sessions, *self._late, *self._tasks})

    def counts(self) -> dict[str, int]:
        """Sessions, late sessions, requests running / blocking / waiting for resume, restarts."""
        return {
            "sessions": len(self._sessions),
            "late_sessions": len(self._late),
            "running": self._running,
            "blocking": len(self._blocking),
            "waiting": self._waiting,
            "restarts": len(self._sessions) if self.mode == "restart_only" else 0,
        }

    def add_readiness_listener(self, callback: Callable[[], None]) -> None:
        """Called whenever a blocking request finishes."""
        self._listeners.append(callback)

    async def export(self, scope: list[str] | None) -> Iterable[dict[str, Any]]:
        """``{"episode_id", "state"}`` of every scoped session still held (exported mode only; None: all)."""
        if self.mode != "exported":
            return []
        ids = list(self._sessions) if scope is None else [key for key in dict.fromkeys(scope) if key in self._sessions]
        if not ids:
            return []
        states = await self.server.export_session_states(ids)
        records = []
        for key in ids:
            if key in states:
                records.append({"episode_id": key, "state": states[key]})
            else:
                self._forget(key)  # the server dropped it
        return records

    async def install(self, records: list[dict[str, Any]], scope: list[str], manifest: Manifest) -> None:
        """Hand restored states to ``restore_session_states``; they are live sessions from now on.

        The hook takes every state at once: when it raises something that is no gymckpt
        error, the restore is ``invalid_checkpoint_state`` naming the first episodes handed over.
        """
        if self.mode != "exported":
            return
        states = {record["episode_id"]: record.get("state") for record in records}
        if not states:
            return
        try:
            await self.server.restore_session_states(states)
        except GymckptError:
            raise
        except Exception as exc:
            raise InvalidCheckpointState(
                f"restore_session_states refused the restored states of {first_keys(list(states))}: "
                f"{type(exc).__name__}: {exc}",
                participant=f"{self.kind}/{self.instance}",
            ) from exc
        for key in states:
            self._sessions[key] = None
            self._untouched.add(key)

    async def retire(self, episode_ids: list[str]) -> None:
        """Stop the requests of these attempts and earlier ones, wait, free their sessions."""
        covered = AttemptsUpTo(episode_ids)
        tasks = [task for key, keyed in list(self._tasks.items()) if covered.covers(key) for task in keyed]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        victims = dict.fromkeys(
            chain((key for key in chain(self._sessions, self._late, self._ending) if covered.covers(key)), episode_ids)
        )
        for key in victims:
            await self.server.retire_session_state(key)
            self._forget(key)

    async def delete_restored(self, episode_ids: list[str]) -> None:
        """Free restored sessions a commit left out that no request has touched since the restore.

        A touched one belongs to a running replacement attempt and stays; nothing is refused.
        """
        for key in episode_ids:
            if key in self._untouched:
                await self.server.retire_session_state(key)
                self._forget(key)

    def status_extra(self) -> dict[str, Any]:
        """``mode`` and ``verify`` (the reference's names), as declared in code."""
        return {"mode": self.mode, "verify": self.verify}

    async def park_exported(self, records: list[dict[str, Any]]) -> None:
        """The controller stops: ``park_session_states`` frees outside compute of exported sessions still held."""
        if self.mode != "exported":
            return
        held = [key for record in records if (key := record["episode_id"]) in self._sessions]
        if held:
            await self.server.park_session_states(held)


class _Reply:
    __slots__ = ("started", "status")

    def __init__(self) -> None:
        self.started = False
        self.status = 0


class ResourcesMiddleware:
    """Fencing, admission, in-flight counting and session lifecycle of each data request.

    Applies to the request as a whole (one POST per tool call); it sits inside the rollout
    prefix middleware, so it sees the stripped path and the request's episode.
    """

    def __init__(self, app: Any, participant: ResourcesParticipant) -> None:
        self.app = app
        self.participant = participant
        verify = [(VERIFY_HEADER.encode(), participant.verify.encode())]
        if participant.mode == "restart_only":
            verify.append((RESTART_HEADER.encode(), b"1"))
        self.seed_headers = verify

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        participant = self.participant
        path = scope.get("path", "")
        if scope["type"] != "http" or is_unfenced(path) or path in participant.exempt_paths:
            await self.app(scope, receive, send)
            return
        episode = current_episode()
        try:
            if episode is None:
                raise RolloutIdRequired(
                    "with checkpointing on, a resources call must carry its rollout: /ng-rollout/<capture key>/…"
                )
            key = episode.capture_key
            participant.check_attempt(key)
        except GymckptError as exc:
            await _error(exc, scope, receive, send)
            return
        reply = _Reply()
        task = asyncio.create_task(self._handle(key, path, scope, receive, send, reply))
        participant._track(key, task)
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            # a retire stopped it: the attempt is stale
            if not reply.started:
                await _error(StaleAttempt(f"attempt {key!r} was retired while this request ran"), scope, receive, send)

    async def _handle(self, key: str, path: str, scope: Any, receive: Any, send: Any, reply: _Reply) -> None:
        participant = self.participant
        task = asyncio.current_task()
        assert task is not None
        try:
            replay_safe = path == SEED_PATH or (path == VERIFY_PATH and participant.verify == "replay")
            # a restart_only server's rollouts run through a checkpoint; only new seeds wait
            waits = path == SEED_PATH if participant.mode == "restart_only" else not replay_safe
            if waits:
                await participant._admit()
                try:
                    participant.check_attempt(key)  # a retire may have marked it while the request waited
                except GymckptError as exc:
                    await _error(exc, scope, receive, send)
                    return
            participant._start(key, task, blocking=not replay_safe and participant.mode != "restart_only")
            seed = path == SEED_PATH

            async def send_reply(message: Any) -> None:
                if message["type"] == "http.response.start":
                    reply.started = True
                    reply.status = message["status"]
                    if seed:
                        message = dict(message)
                        message["headers"] = [*message.get("headers", []), *self.seed_headers]
                await send(message)

            try:
                await self.app(scope, receive, send_reply)
            finally:
                participant._finish(task)
            if reply.status < 400:
                if seed:
                    participant._seeded(key)
                elif path in (VERIFY_PATH, CLOSE_PATH):
                    participant._ended(key, replay=replay_safe)
        finally:
            participant._untrack(key, task)


async def _error(exc: GymckptError, scope: Any, receive: Any, send: Any) -> None:
    response = error_response(exc)
    await response(scope, receive, send)
