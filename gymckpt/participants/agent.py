"""The agent participant: agent sessions and legacy ``/run`` episodes as checkpointable episodes.

An agent server runs each piece of work as an *activation* through :meth:`run`: one
``/v1/responses`` turn loop of a session, or one legacy ``/run`` (an episode of its own).
Every activation runs its steps through an :class:`AgentActivation`, on top of
:class:`~gymckpt.participants.steps.EpisodeRegistry`:

- A session is idle (no activation), running (a step in flight) or at a boundary (parked).
  A running activation parks at its next boundary once a checkpoint closes admission.
- A model call is a ``replay`` step (:meth:`AgentActivation.model_call`): it never blocks a
  checkpoint, the boundary before it is exported and it runs again after a crash. So a
  session waiting on a model call counts as parked at its last boundary (the policy model
  server holds the undelivered response anyway).
- A tool call to a resources server is a ``wait`` step (:meth:`AgentActivation.tool_call`):
  the checkpoint waits for it. Tool calls change resources state (a counter increments) and
  resources servers are prepared after agents, so a tool call in flight completes and
  its effect is in the resources checkpoint; replaying it after a restore would apply it
  twice. Waiting keeps the agent's boundary and the resources state the same cut.
- Boundaries are lazy snapshots: a step's ``boundary`` callback returns a cheap reference
  (for instance a message count into an append-only list). A boundary that is callable is
  called once, at export, for its JSON state; nothing is serialised per step.

With the session hooks (:class:`AgentSessionHooks`) an agent gets an
:class:`AgentSessionParticipant`: a record per exported episode
``{"episode_id", "kind": "session", "state", "boundary"}`` (``state`` from
``export_agent_sessions``, called once for every session in scope) or
``{"episode_id", "kind": "run", "boundary"}`` for a legacy run, whose boundary carries
everything. Restored episodes are installed under the replacement attempt; one whose
replacement has not started yet is exported again by the next checkpoint.

Without the hooks an agent gets a :class:`RestartOnlyAgentParticipant`: its activations are
restarts (reported in ``restarts()``, never blocking, never exported); after a crash those
rollouts start over.

With checkpointing on, work without a rollout id is refused (:class:`RolloutIdRequired`),
and requests of a retired attempt with ``stale_attempt`` (via the bound control plane).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from gymckpt.errors import (
    CheckpointParked,
    GymckptError,
    InvalidCheckpointState,
    RolloutIdRequired,
    SessionBusy,
    StaleAttempt,
)
from gymckpt.identity import AttemptsUpTo, EpisodeId, first_keys
from gymckpt.participants.registry_participant import RegistryParticipant
from gymckpt.participants.steps import EpisodeEnded, EpisodeRegistry, StepMode

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable, Mapping

    from gymckpt.participants.steps import Episode
    from gymckpt.store.manifest import Manifest

__all__ = [
    "HOOKS",
    "RUN",
    "SESSION",
    "AgentActivation",
    "AgentSessionHooks",
    "AgentSessionParticipant",
    "PlainActivation",
    "RestartOnlyAgentParticipant",
    "agent_participant",
    "has_session_hooks",
    "materialize",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: an episode that is an agent session (``/v1/responses`` activations until ``/close_session``)
SESSION = "session"
#: an episode that is one legacy ``/run`` call
RUN = "run"
#: the session hooks an agent implements to be checkpointed (all three, all coroutines)
HOOKS = ("export_agent_sessions", "restore_agent_sessions", "retire_agent_session")


@runtime_checkable
class AgentSessionHooks(Protocol):
    """What an agent implements to have its sessions exported and restored."""

    async def export_agent_sessions(self, keys: list[str]) -> Mapping[str, Any]:
        """The JSON state of each session in ``keys`` it still holds (all at once); a missing key was dropped.

        The state must stay unchanged until resume (records are stored as they are).
        """
        ...

    async def restore_agent_sessions(self, states: Mapping[str, Any]) -> None:
        """Install restored sessions: ``{next-attempt key: {"state": …, "boundary": …}}``."""
        ...

    async def retire_agent_session(self, key: str) -> None:
        """Free the session of ``key`` (a no-op for a key it does not hold)."""
        ...


def has_session_hooks(agent: object) -> bool:
    """True when ``agent`` implements every session hook as a coroutine function."""
    return agent is not None and all(inspect.iscoroutinefunction(getattr(agent, name, None)) for name in HOOKS)


def materialize(boundary: object) -> object:
    """The JSON state of a boundary: a callable one is a lazy snapshot and is called."""
    return boundary() if callable(boundary) else boundary


async def _nothing() -> None:
    return None


class PlainActivation:
    """An activation whose steps are not checkpointed: run, apply the boundary, return.

    Used with checkpointing off and by restart-only agents, so an agent's turn loop is the
    same code either way.
    """

    def __init__(self, key: str | None) -> None:
        #: the capture key of the episode (None with checkpointing off and no rollout id)
        self.key = key

    @property
    def restored(self) -> bool:
        """True when the episode was restored (it continues from :attr:`boundary`)."""
        return False

    @property
    def boundary(self) -> object | None:
        """The episode's last boundary: the restored one (a JSON value) until a step records another."""
        return None

    async def step(
        self, mode: StepMode | str, run: Callable[[], Awaitable[T]], *, boundary: Callable[[T], object]
    ) -> T:
        """Await ``run()`` and apply ``boundary(result)``."""
        result = await run()
        boundary(result)
        return result

    async def model_call(self, run: Callable[[], Awaitable[T]], *, boundary: Callable[[T], object]) -> T:
        """A policy model call: a ``replay`` step."""
        return await self.step(StepMode.REPLAY, run, boundary=boundary)

    async def tool_call(self, run: Callable[[], Awaitable[T]], *, boundary: Callable[[T], object]) -> T:
        """A tool call to a resources server: a ``wait`` step."""
        return await self.step(StepMode.WAIT, run, boundary=boundary)

    async def record(self, apply: Callable[[], object]) -> None:
        """Record a boundary without a downstream call (``apply()`` changes state, returns the boundary)."""
        await self.step(StepMode.WAIT, _nothing, boundary=lambda _: apply())

    async def mark_restart(self) -> None:
        """Make the episode a restart; nothing to do without checkpointing."""


class AgentActivation(PlainActivation):
    """An activation of a checkpointed episode: its steps park, block and record as P3 says."""

    def __init__(self, key: str, episode: Episode) -> None:
        super().__init__(key)
        self.episode = episode

    @property
    def restored(self) -> bool:
        return self.episode.restored

    @property
    def boundary(self) -> object | None:
        return self.episode.boundary

    async def step(
        self, mode: StepMode | str, run: Callable[[], Awaitable[T]], *, boundary: Callable[[T], object]
    ) -> T:
        """One episode step (:meth:`Episode.step`): parks while closed, records ``boundary(result)``."""
        return await self.episode.step(mode, run, boundary=boundary)

    async def mark_restart(self) -> None:
        """Make the episode a restart (a seed reply said so); waits while a checkpoint is open."""
        await self.episode.mark_restart()


class _AgentParticipantBase(RegistryParticipant):
    """Admission, readiness, activations and retire, shared by both agent participants."""

    kind = "agent"

    def __init__(self, *, instance: str = "agent-0", now: Callable[[], float] = time.monotonic) -> None:
        self.instance = instance
        self.registry = EpisodeRegistry(now=now)
        #: kind of each live episode (SESSION or RUN)
        self._kinds: dict[str, str] = {}
        #: the activation task running for each key (one at a time)
        self._active: dict[str, asyncio.Task[Any]] = {}

    # ----------------------------------------------------------------- wiring

    def kind_of(self, key: str) -> str | None:
        """SESSION or RUN for a live episode, else None."""
        return self._kinds.get(key)

    # ----------------------------------------------------------------- admission, readiness

    def counts(self) -> dict[str, int]:
        counts = super().counts()
        counts["activations"] = len(self._active)
        return counts

    def status_extra(self) -> dict[str, Any]:
        """``accepting``: whether a new session may start now (False while a checkpoint is open)."""
        return {"accepting": not self.registry.closed}

    # ----------------------------------------------------------------- activations

    async def run(self, key: str | None, body: Callable[[PlainActivation], Awaitable[T]], *, kind: str = SESSION) -> T:
        """Run one activation of ``key``'s episode (a session turn loop, or a legacy run).

        Refuses work without a rollout id (``rollout_id_required``), of a retired attempt
        (``stale_attempt``) and a second activation of a busy session (``session_busy``). A
        session's episode lives on after the activation until :meth:`close_session`; a
        run's ends with it. The body runs in a task of its own, so a retire can stop it;
        its caller then gets ``stale_attempt``.
        """
        if kind not in (SESSION, RUN):
            raise ValueError(f"unknown activation kind {kind!r}")
        if key is None:
            raise RolloutIdRequired(
                "agent work needs a rollout id with checkpointing on: call /ng-rollout/<capture key>/… "
                "or give _ng_rollout_id (or _ng_task_index and _ng_rollout_index)"
            )
        EpisodeId.from_capture_key(key)  # a malformed key is invalid_rollout_id
        self.check_attempt(key)
        if key in self._active:
            raise SessionBusy(f"{key!r} already runs an activation")
        episode = self.registry.get(key)
        if episode is None:
            if self.registry.closed:
                raise CheckpointParked(f"a checkpoint is open: {kind} {key!r} cannot start now; retry it after resume")
            episode = self.registry.begin(key)
            self._kinds[key] = kind
        elif self._kinds.get(key) != kind:
            raise SessionBusy(f"{key!r} is a live {self._kinds.get(key)}, not a {kind}")
        task = asyncio.create_task(self._activate(key, episode, body), name=f"gymckpt-agent-{key}")
        self._active[key] = task
        # a done callback, not a finally: a task cancelled before it first ran never enters its body
        task.add_done_callback(lambda done: self._activation_done(key, kind, episode, done))
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or not current.cancelling()):
                raise StaleAttempt(f"attempt {key!r} was retired while it ran") from None
            raise
        except EpisodeEnded as exc:
            raise StaleAttempt(f"attempt {key!r} was retired while it ran") from exc

    async def _activate(self, key: str, episode: Episode, body: Callable[[PlainActivation], Awaitable[T]]) -> T:
        await self._before(episode)
        return await body(self._activation(key, episode))

    def _activation_done(self, key: str, kind: str, episode: Episode, task: asyncio.Task[Any]) -> None:
        if self._active.get(key) is task:
            del self._active[key]
        if kind == RUN and self.registry.get(key) is episode:
            self._end(key)  # a legacy run is an episode of its own

    async def _before(self, episode: Episode) -> None:
        """Called before each activation's body."""

    def _activation(self, key: str, episode: Episode) -> PlainActivation:
        return AgentActivation(key, episode)

    async def close_session(self, key: str | None) -> None:
        """``/close_session``: the session ends (a no-op for a session that is not live)."""
        if key is None:
            raise RolloutIdRequired("closing an agent session needs a rollout id with checkpointing on")
        EpisodeId.from_capture_key(key)
        self.check_attempt(key)
        if key in self._active:
            raise SessionBusy(f"{key!r} runs an activation; it cannot be closed now")
        if self._kinds.get(key) == SESSION:
            self._end(key)

    def _end(self, key: str) -> None:
        episode = self.registry.get(key)
        if episode is not None:
            episode.end()
        self._kinds.pop(key, None)

    # ----------------------------------------------------------------- retire

    def _earlier_or_same(self, keys: Iterable[str]) -> list[str]:
        """Live keys of the same rollouts as ``keys``, at or before their attempts."""
        covered = AttemptsUpTo(keys)
        return sorted(key for key in set(self.registry.live_keys()).union(self._active) if covered.covers(key))

    async def retire(self, episode_ids: list[str]) -> None:
        """Stop the activations of these attempts and earlier ones, wait, call the retire hook, free."""
        targets = self._earlier_or_same(episode_ids)
        kinds = {key: self._kinds.get(key, SESSION) for key in set(targets).union(episode_ids)}
        for key in targets:
            self.registry.mark_retiring(key)
        tasks = [task for key in targets if (task := self._active.get(key)) is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for key in sorted(kinds):
            if kinds[key] == SESSION:
                await self._retire_hook(key)
            self._end(key)

    async def _retire_hook(self, key: str) -> None:
        """Free the agent's own state of ``key``."""

    @property
    def _participant_name(self) -> str:
        return f"{self.kind}/{self.instance}"


class AgentSessionParticipant(_AgentParticipantBase):
    """An agent with session hooks: sessions and legacy runs are exported and restored."""

    def __init__(
        self, hooks: AgentSessionHooks, *, instance: str = "agent-0", now: Callable[[], float] = time.monotonic
    ) -> None:
        if not has_session_hooks(hooks):
            raise TypeError(f"{type(hooks).__name__} lacks the agent session hooks {', '.join(HOOKS)}")
        super().__init__(instance=instance, now=now)
        self.hooks = hooks

    async def export(self, scope: list[str] | None) -> list[dict[str, Any]]:
        """One record per live, exportable episode in ``scope``; session states come from one hook call."""
        boundaries = self.registry.export(scope)
        kinds = self._kinds
        sessions = [key for key in boundaries if kinds.get(key) == SESSION]
        states = await self.hooks.export_agent_sessions(sessions) if sessions else {}
        records: list[dict[str, Any]] = []
        for key, boundary in boundaries.items():
            if kinds.get(key) == SESSION:
                if key not in states:
                    logger.info("agent session %s was dropped by the agent; not exported", key)
                    continue
                records.append(
                    {"episode_id": key, "kind": SESSION, "state": states[key], "boundary": materialize(boundary)}
                )
            else:
                records.append({"episode_id": key, "kind": RUN, "boundary": materialize(boundary)})
        return records

    async def install(self, records: list[dict[str, Any]], scope: list[str], manifest: Manifest) -> None:
        """Install sessions (through ``restore_agent_sessions``) and runs under their next-attempt keys."""
        begun: list[str] = []
        states: dict[str, dict[str, Any]] = {}
        try:
            for record in records:
                key = record["episode_id"]
                kind = record.get("kind", SESSION)
                if kind not in (SESSION, RUN):
                    raise InvalidCheckpointState(
                        f"agent record {key!r} has an unknown kind {kind!r}", participant=self._participant_name
                    )
                boundary = record.get("boundary")
                episode = self.registry.get(key)
                if episode is not None and episode.restored and key not in self._active:
                    episode.boundary = boundary  # a retried restore: install again
                    self._kinds[key] = kind
                elif episode is None:
                    self.registry.begin(key, restored_boundary=boundary, restored=True)
                    self._kinds[key] = kind
                    begun.append(key)
                else:
                    raise InvalidCheckpointState(
                        f"agent episode {key!r} is already live; it cannot be restored",
                        participant=self._participant_name,
                    )
                if kind == SESSION:
                    states[key] = {"state": record.get("state"), "boundary": boundary}
            if states:
                try:
                    await self.hooks.restore_agent_sessions(states)
                except GymckptError:
                    raise
                except Exception as exc:
                    raise InvalidCheckpointState(
                        f"restore_agent_sessions refused the restored sessions of {first_keys(list(states))}: "
                        f"{type(exc).__name__}: {exc}",
                        participant=self._participant_name,
                    ) from exc
        except BaseException:
            for key in begun:
                self._end(key)
            raise

    async def _retire_hook(self, key: str) -> None:
        await self.hooks.retire_agent_session(key)


class RestartOnlyAgentParticipant(_AgentParticipantBase):
    """An agent without session hooks: every rollout it serves is a restart, never blocking or exported.

    ``free(key)``, if given, is awaited when a retire frees ``key`` (the agent's own cleanup).
    """

    def __init__(
        self,
        *,
        instance: str = "agent-0",
        free: Callable[[str], Awaitable[None]] | None = None,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(instance=instance, now=now)
        self._free = free

    async def _retire_hook(self, key: str) -> None:
        if self._free is not None:
            await self._free(key)

    async def _before(self, episode: Episode) -> None:
        await episode.mark_restart()  # waits while a checkpoint is open

    def _activation(self, key: str, episode: Episode) -> PlainActivation:
        return PlainActivation(key)

    async def export(self, scope: list[str] | None) -> list[dict[str, Any]]:
        """Nothing: a restart-only agent's rollouts start over."""
        return []

    async def install(self, records: list[dict[str, Any]], scope: list[str], manifest: Manifest) -> None:
        """Nothing to install (it never exports); stray records are ignored."""
        if records:
            logger.warning("a restart-only agent ignores %d restored records", len(records))


def agent_participant(
    agent: object | None, *, instance: str = "agent-0"
) -> AgentSessionParticipant | RestartOnlyAgentParticipant:
    """The participant of ``agent``: session-checkpointed with the hooks, restart-only without."""
    if has_session_hooks(agent):
        return AgentSessionParticipant(agent, instance=instance)  # type: ignore[arg-type]
    return RestartOnlyAgentParticipant(instance=instance)
