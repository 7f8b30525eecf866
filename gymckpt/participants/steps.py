"""Episode steps: the episode registry of one participant.

An episode runs as a sequence of steps and records a boundary after each one. The
control plane drives admission: :meth:`EpisodeRegistry.close` when a checkpoint closes
it, :meth:`EpisodeRegistry.open` on resume.

- A step never starts while admission is closed; the episode parks before it (not a
  blocker) and that time does not count against its deadline.
- A ``wait`` step in flight when admission closes blocks the checkpoint until it
  completes, then records the boundary after it and parks there before returning.
- A ``replay`` step in flight never blocks: the boundary before it is exported and the
  step runs again after a crash. If it ends while admission is closed, the episode stays
  at the boundary before it and parks holding the result; on reopening the boundary of
  the result is recorded and the step returns.
- An episode being retired blocks a checkpoint whatever its state and is never exported
  until it ends. A restart never blocks and is never exported.

Readiness is a running count updated on each transition (O(1)); blockers and restarts are
kept in insertion-ordered dicts, so listing them costs only what is listed. Listeners are
notified only while admission is closed, whenever the blocker count changes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from enum import StrEnum
from typing import TYPE_CHECKING, TypeVar

from gymckpt.participants.signal import AdmissionGate

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Collection, Iterator
    from types import TracebackType

__all__ = [
    "Episode",
    "EpisodeEnded",
    "EpisodeRegistry",
    "EpisodeState",
    "StepMode",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class StepMode(StrEnum):
    """What happens to a step in flight when a checkpoint closes admission."""

    #: the checkpoint waits for the step; the episode parks at the boundary after it
    WAIT = "wait"
    #: the checkpoint does not wait; the boundary before it is exported and it runs again after a crash
    REPLAY = "replay"


class EpisodeState(StrEnum):
    """Where an episode is between and within its steps."""

    #: between steps, at its boundary
    IDLE = "idle"
    #: waiting for admission to reopen: before a step, after a wait step, or holding a replay result
    PARKED = "parked"
    RUNNING_WAIT = "running_wait"
    RUNNING_REPLAY = "running_replay"


class EpisodeEnded(RuntimeError):
    """A step was asked of an episode whose task already ended."""


class Episode:
    """One live episode attempt, keyed by its capture key. Create through :meth:`EpisodeRegistry.begin`."""

    __slots__ = (
        "_busy",
        "_ended",
        "_park_depth",
        "_park_since",
        "_parked_total",
        "_registry",
        "_restart",
        "_retiring",
        "_state",
        "boundary",
        "key",
        "restored",
    )

    def __init__(self, registry: EpisodeRegistry, key: str, boundary: object | None, restored: bool) -> None:
        self._registry = registry
        self.key = key
        #: the last recorded boundary; None when there is none yet (the episode starts over)
        self.boundary: object | None = boundary
        #: True for the replacement attempt of a restored episode
        self.restored = restored
        self._state = EpisodeState.IDLE
        self._restart = False
        self._retiring = False
        self._ended = False
        self._busy = False
        self._parked_total = 0.0
        self._park_depth = 0
        self._park_since = 0.0

    def __repr__(self) -> str:
        flags = "".join(
            f" {name}"
            for name, on in (("restart", self._restart), ("retiring", self._retiring), ("ended", self._ended))
            if on
        )
        return f"<Episode {self.key!r} {self._state.value}{flags}>"

    # ----------------------------------------------------------------- state, read only

    @property
    def state(self) -> EpisodeState:
        """Where the episode is now."""
        return self._state

    @property
    def restart(self) -> bool:
        """True once the episode was marked a restart (never blocks, never exported)."""
        return self._restart

    @property
    def retiring(self) -> bool:
        """True once a retire began; stays until the episode ends."""
        return self._retiring

    @property
    def ended(self) -> bool:
        """True once :meth:`end` ran; the registry no longer tracks the episode."""
        return self._ended

    @property
    def blocking(self) -> bool:
        """Whether this episode keeps a checkpoint from being ready."""
        return self._retiring or (not self._restart and self._state is EpisodeState.RUNNING_WAIT)

    @property
    def parked_seconds(self) -> float:
        """Total time parked for checkpoints, including a park in progress."""
        if self._park_depth:
            return self._parked_total + (self._registry._now() - self._park_since)
        return self._parked_total

    def remaining(self, deadline: float) -> float:
        """Time left until ``deadline`` (registry clock), not counting time parked since the episode began."""
        return deadline - self._registry._now() + self.parked_seconds

    # ----------------------------------------------------------------- steps

    async def step(
        self,
        mode: StepMode | str,
        run: Callable[[], Awaitable[T]],
        *,
        boundary: Callable[[T], object],
    ) -> T:
        """Run one step: park while admission is closed, await ``run()``, record ``boundary(result)``.

        Only one step of an episode runs at a time. If ``run()`` raises or the step is
        cancelled before its boundary is recorded, the boundary stays the one before it.
        """
        mode = StepMode(mode)
        if self._ended:
            raise EpisodeEnded(f"episode {self.key!r} has ended")
        if self._busy:
            raise RuntimeError(f"episode {self.key!r} is already in a step")
        registry = self._registry
        self._busy = True
        try:
            await self._park()
            if self._ended:
                raise EpisodeEnded(f"episode {self.key!r} ended while parked before a step")
            registry._apply(
                self, state=EpisodeState.RUNNING_WAIT if mode is StepMode.WAIT else EpisodeState.RUNNING_REPLAY
            )
            try:
                result = await run()
            except BaseException:
                registry._apply(self, state=EpisodeState.IDLE)
                raise
            if mode is StepMode.WAIT:
                try:
                    if not self._ended:
                        self.boundary = boundary(result)
                finally:
                    registry._apply(self, state=EpisodeState.IDLE)
                await self._park()  # at the boundary after the step
                return result
            try:
                await self._park()  # holding the result, still at the boundary before the step
                if not self._ended:
                    self.boundary = boundary(result)
            finally:
                if self._state is not EpisodeState.IDLE:
                    registry._apply(self, state=EpisodeState.IDLE)
            return result
        finally:
            self._busy = False

    @property
    def closed(self) -> bool:
        """True while a checkpoint holds its registry's admission closed."""
        return self._registry.closed

    async def park(self) -> None:
        """Wait at the current boundary while admission is closed (e.g. before returning a result)."""
        if self._busy:
            raise RuntimeError(f"episode {self.key!r} is in a step")
        self._busy = True
        try:
            await self._park()
        finally:
            self._busy = False

    async def mark_restart(self) -> None:
        """Make the episode a restart; waits while admission is closed. Idempotent.

        Do not await this inside a running ``wait`` step: the step blocks the checkpoint
        while this waits for it to end.
        """
        registry = self._registry
        if self._ended or self._restart:
            return
        if registry.closed:
            self._park_enter()
            try:
                await registry._wait_open()
            finally:
                self._park_exit()
        if not self._ended:
            registry._apply(self, restart=True)

    def end(self) -> None:
        """The episode's task ended: deregister it. Idempotent."""
        if not self._ended:
            self._registry._remove(self)

    def __enter__(self) -> Episode:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.end()

    # ----------------------------------------------------------------- internals

    async def _park(self) -> None:
        registry = self._registry
        if not registry.closed or self._ended:
            return
        registry._apply(self, state=EpisodeState.PARKED)
        self._park_enter()
        try:
            await registry._wait_open()
        finally:
            self._park_exit()
            registry._apply(self, state=EpisodeState.IDLE)

    def _park_enter(self) -> None:
        if self._park_depth == 0:
            self._park_since = self._registry._now()
        self._park_depth += 1

    def _park_exit(self) -> None:
        self._park_depth -= 1
        if self._park_depth == 0:
            self._parked_total += self._registry._now() - self._park_since


class EpisodeRegistry:
    """The live episodes of one participant, their admission and readiness."""

    def __init__(self, *, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._episodes: dict[str, Episode] = {}
        self._blockers: dict[str, Episode] = {}
        self._restarts: dict[str, Episode] = {}
        self._state_counts: dict[EpisodeState, int] = dict.fromkeys(EpisodeState, 0)
        self._retiring = 0
        self._gate = AdmissionGate()
        self._listeners: list[Callable[[], None]] = []

    # ----------------------------------------------------------------- admission

    @property
    def closed(self) -> bool:
        """True while a checkpoint holds admission closed."""
        return self._gate.closed

    def close(self) -> None:
        """A checkpoint closes admission: no step starts or returns until :meth:`open`. Idempotent."""
        self._gate.close()

    def open(self) -> None:
        """Resume: reopen admission and wake parked episodes. Idempotent."""
        self._gate.open()

    async def _wait_open(self) -> None:
        await self._gate.until_open()

    # ----------------------------------------------------------------- readiness

    def ready(self) -> bool:
        """True when no episode blocks a checkpoint. O(1)."""
        return not self._blockers

    def blocker_count(self) -> int:
        """How many episodes block a checkpoint. O(1)."""
        return len(self._blockers)

    def blockers(self, limit: int = 100) -> list[str]:
        """Capture keys of at most ``limit`` blocking episodes."""
        if limit <= 0:
            return []
        keys: list[str] = []
        for key in self._blockers:
            keys.append(key)
            if len(keys) >= limit:
                break
        return keys

    def restarts(self) -> list[str]:
        """Capture keys of every live restart (not capped)."""
        return list(self._restarts)

    def counts(self) -> dict[str, int]:
        """Running counts: live, idle, parked, running_wait, running_replay, restarts, retiring, blockers."""
        counts = {"live": len(self._episodes)}
        counts.update((state.value, n) for state, n in self._state_counts.items())
        counts["restarts"] = len(self._restarts)
        counts["retiring"] = self._retiring
        counts["blockers"] = len(self._blockers)
        return counts

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when readiness may have changed; only while admission is closed."""
        self._listeners.append(callback)

    def remove_listener(self, callback: Callable[[], None]) -> None:
        """Stop calling ``callback``; no error if it was not added."""
        with contextlib.suppress(ValueError):
            self._listeners.remove(callback)

    # ----------------------------------------------------------------- episodes

    def begin(self, key: str, *, restored_boundary: object | None = None, restored: bool = False) -> Episode:
        """Register a new live episode; a restored one starts at ``restored_boundary``.

        Allowed while admission is closed: the episode parks before its first step.
        """
        if key in self._episodes:
            raise ValueError(f"episode {key!r} is already live")
        episode = Episode(self, key, restored_boundary, restored)
        self._episodes[key] = episode
        self._state_counts[EpisodeState.IDLE] += 1
        return episode

    def get(self, key: str) -> Episode | None:
        """The live episode with this capture key, if any."""
        return self._episodes.get(key)

    def live_keys(self) -> list[str]:
        """Capture keys of every live episode."""
        return list(self._episodes)

    def export(self, scope: Collection[str] | None) -> dict[str, object | None]:
        """Boundary to continue from (None: start over) of each live, exportable episode in ``scope`` (None: all).

        Restarts and retiring episodes are left out, as are keys that are not live. Meant to
        be called while admission is closed and :meth:`ready`; an episode running a replay
        step (or holding its result) exports the boundary before that step.
        """
        exported: dict[str, object | None] = {}
        episodes = self._episodes
        for key in episodes if scope is None else scope:
            episode = episodes.get(key)
            if episode is not None and not episode._restart and not episode._retiring:
                exported[key] = episode.boundary
        return exported

    def mark_retiring(self, key: str) -> Episode | None:
        """Mark the episode as being retired until it ends; None if it is not live."""
        episode = self._episodes.get(key)
        if episode is not None:
            self._apply(episode, retiring=True)
        return episode

    @contextlib.contextmanager
    def retiring(self, key: str) -> Iterator[Episode | None]:
        """Mark the episode as being retired for a retire's stop-and-wait.

        The mark stays after the block until the episode ends: a retire cut short leaves an
        episode that blocks the next checkpoint and is never exported.
        """
        yield self.mark_retiring(key)

    # ----------------------------------------------------------------- bookkeeping

    def _apply(
        self,
        episode: Episode,
        *,
        state: EpisodeState | None = None,
        restart: bool | None = None,
        retiring: bool | None = None,
    ) -> None:
        """Change an episode's state or flags and keep every count in step. O(1)."""
        if episode._ended:
            if state is not None:
                episode._state = state
            return
        was_blocking = episode.blocking
        if state is not None and state is not episode._state:
            self._state_counts[episode._state] -= 1
            self._state_counts[state] += 1
            episode._state = state
        if retiring is not None and retiring != episode._retiring:
            self._retiring += 1 if retiring else -1
            episode._retiring = retiring
        if restart is not None:
            episode._restart = restart
        if restart is not None or retiring is not None:
            if episode._restart and not episode._retiring:
                self._restarts[episode.key] = episode
            else:
                self._restarts.pop(episode.key, None)
        if episode.blocking != was_blocking:
            if was_blocking:
                del self._blockers[episode.key]
            else:
                self._blockers[episode.key] = episode
            if self.closed:
                self._notify()

    def _remove(self, episode: Episode) -> None:
        was_blocking = episode.blocking
        self._state_counts[episode._state] -= 1
        if episode._retiring:
            self._retiring -= 1
        self._restarts.pop(episode.key, None)
        self._blockers.pop(episode.key, None)
        del self._episodes[episode.key]
        episode._ended = True
        if was_blocking and self.closed:
            self._notify()

    def _notify(self) -> None:
        for callback in list(self._listeners):
            try:
                callback()
            except Exception:
                logger.exception("episode readiness listener %r failed", callback)
