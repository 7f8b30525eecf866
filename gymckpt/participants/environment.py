"""The environment participant: episodes as steps with boundaries, continued after a restore.

Record: ``{"episode_id", "task_digest", "boundary", "task"}`` (``task``: the task itself, as the
``/run`` gave it; a record without one, the reference's, is read too). The replacement attempt's ``/run``
continues from the restored boundary, and its task must hash to the recorded digest. A
restored episode whose replacement has not started yet stays live (idle at its restored
boundary), so the next checkpoint exports it again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import TYPE_CHECKING, Any

import orjson

from gymckpt.errors import CheckpointConflict, CheckpointParked, InvalidCheckpointState
from gymckpt.identity import AttemptsUpTo
from gymckpt.participants.registry_participant import RegistryParticipant
from gymckpt.participants.steps import EpisodeRegistry

if TYPE_CHECKING:
    from gymckpt.participants.steps import Episode
    from gymckpt.store.manifest import Manifest

__all__ = ["EnvironmentParticipant", "task_digest"]

#: how many episodes a retire stops at once
_RETIRE_CONCURRENCY = 64


def task_digest(task: Any) -> str:
    """sha256 of the task's canonical JSON, as the reference stack computes it: what a continued attempt must match.

    Sorted keys, no spaces, ASCII with ``\\u`` escapes (``json.dumps(sort_keys=True,
    separators=(",", ":"))``), so an episode checkpointed by either stack continues on the other.
    """
    return hashlib.sha256(json.dumps(task, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _legacy_task_digest(task: Any) -> str:
    """The digest gymckpt recorded before it took the reference's (orjson, UTF-8): still accepted."""
    return hashlib.sha256(orjson.dumps(task, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _task_matches(task: Any, digest: str, recorded: str | None) -> bool:
    return recorded == digest or (recorded is not None and recorded == _legacy_task_digest(task))


class EnvironmentParticipant(RegistryParticipant):
    """Tracks every live episode of an environment server and its task."""

    kind = "environment"

    def __init__(self, instance: str) -> None:
        self.instance = instance
        self.registry = EpisodeRegistry()
        self._digests: dict[str, str] = {}
        #: each live episode's task, as its ``/run`` gave it (or its restored record held it)
        self._task_of: dict[str, Any] = {}
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._continued: set[str] = set()

    # --- episodes, for the server's /run

    async def start_run(self, key: str, task: Any) -> Episode:
        """:meth:`begin_run`, after taking ``key``'s restored record from another process if one waits there.

        On a server with several workers the coordinator holds restored episodes: the worker
        that receives the replacement ``/run`` claims its record (exactly one claim gets it;
        while a checkpoint is open the claim is ``checkpoint_parked``, like a new episode).
        """
        self.check_attempt(key)
        if self.registry.get(key) is None:
            await self.take_restored(key)
        return self.begin_run(key, task)

    def begin_run(self, key: str, task: Any) -> Episode:
        """The episode a ``/run`` of ``key`` runs: a restored one to continue, or a new one.

        Raises StaleAttempt for a retired attempt, InvalidCheckpointState when a restored
        episode's task differs, CheckpointConflict when the attempt is already running, and
        CheckpointParked for a new episode while a checkpoint is open (the caller retries it).
        """
        self.check_attempt(key)
        digest = task_digest(task)
        episode = self.registry.get(key)
        if episode is not None:
            if (
                episode.restored
                and key not in self._continued
                and not _task_matches(task, digest, self._digests.get(key))
            ):
                raise InvalidCheckpointState(
                    f"the task of {key!r} differs from the one its checkpoint recorded", participant=self.participant
                )
            if not self.claim_restored(key):
                raise CheckpointConflict(f"episode {key!r} is already running on this server")
        else:
            if self.registry.closed:
                raise CheckpointParked(f"a checkpoint is open: episode {key!r} cannot start now; retry it after resume")
            episode = self.registry.begin(key)
            self._digests[key] = digest
            self._task_of[key] = task
        return episode

    def claim_restored(self, key: str) -> bool:
        """The first ``/run`` of a restored episode's replacement attempt takes it (once)."""
        episode = self.registry.get(key)
        if episode is None or not episode.restored or key in self._continued:
            return False
        self._continued.add(key)
        return True

    def track(self, key: str, task: asyncio.Task[Any]) -> None:
        """The task running ``key``'s episode: a retire cancels it and waits for it."""
        self._tasks[key] = task

    def end_run(self, key: str, episode: Episode) -> None:
        """The ``/run`` of ``key`` returned (or failed): forget the episode."""
        episode.end()
        self._tasks.pop(key, None)
        self._digests.pop(key, None)
        self._task_of.pop(key, None)
        self._continued.discard(key)

    def status_extra(self) -> dict[str, Any]:
        """``restored_pending``: restored episodes whose replacement ``/run`` has not arrived yet."""
        pending = sorted(
            key
            for key in self.registry.live_keys()
            if key not in self._continued and (episode := self.registry.get(key)) is not None and episode.restored
        )
        return {"restored_pending": pending}

    @property
    def participant(self) -> str:
        return f"{self.kind}/{self.instance}"

    # --- the Participant interface

    async def export(self, scope: list[str] | None) -> list[dict[str, Any]]:
        digests, tasks = self._digests, self._task_of
        return [
            {"episode_id": key, "task_digest": digests[key], "boundary": boundary, "task": tasks.get(key)}
            for key, boundary in self.registry.export(scope).items()
        ]

    async def install(self, records: list[dict[str, Any]], scope: list[str], manifest: Manifest) -> None:
        """Every record is checked before any is installed: a bad one fails the restore naming its episode."""
        for record in records:
            key = record["episode_id"]
            digest = record.get("task_digest")
            if not isinstance(digest, str) or "boundary" not in record:
                raise InvalidCheckpointState(
                    f"environment record of {key!r} lacks task_digest or boundary", participant=self.participant
                )
        for record in records:
            key = record["episode_id"]
            if self.registry.get(key) is None:
                self.registry.begin(key, restored_boundary=record["boundary"], restored=True)
                self._digests[key] = record["task_digest"]
                self._task_of[key] = record.get("task")

    async def retire(self, episode_ids: list[str]) -> None:
        covered = AttemptsUpTo(episode_ids)
        doomed = [key for key in self.registry.live_keys() if covered.covers(key)]
        gate = asyncio.Semaphore(_RETIRE_CONCURRENCY)

        async def stop(key: str) -> None:
            async with gate:
                await self._stop(key)

        await asyncio.gather(*(stop(key) for key in doomed))

    async def _stop(self, key: str) -> None:
        episode = self.registry.mark_retiring(key)
        task = self._tasks.get(key)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})
        if episode is not None:
            self.end_run(key, episode)

    async def delete_restored(self, episode_ids: list[str]) -> None:
        for key in episode_ids:
            episode = self.registry.get(key)
            if episode is not None and episode.restored and key not in self._continued:
                self.end_run(key, episode)
