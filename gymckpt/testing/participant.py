"""A participant with controllable episodes, for tests of the control plane and of what drives it.

:class:`FakeParticipant` implements :class:`~gymckpt.control.participant.Participant` over
a dict of episodes (capture key → state) the test starts, keeps busy and finishes by hand:

- every call is recorded in :attr:`FakeParticipant.calls` when it starts (and ``*_done``
  when it ends); ``started[name]`` is an :class:`asyncio.Event` set when the call ``name``
  starts, so a test can await "the plane reached this point" instead of sleeping;
- every blocking point is an :class:`asyncio.Event` gate (``export_gate``, ``install_gate``,
  …) the call waits on while the test holds it;
- every call can be made to fail (``fail_export``, ``fail_install``, …);
- ``retire`` frees exactly the keys it names, or (``frees_earlier_attempts=True``) each
  key's attempt and every earlier attempt of its rollout, as a real server does.

Subclass it where a test needs other behaviour, e.g. logging every operation::

    class LoggingParticipant(FakeParticipant):
        async def export(self, scope):
            log.append(("export", scope))
            return await super().export(scope)
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from gymckpt.control.participant import Participant
from gymckpt.identity import split_capture_key

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

__all__ = ["FakeParticipant", "freed_by_retire"]


def freed_by_retire(held: Iterable[str], retired: Iterable[str]) -> list[str]:
    """The keys of ``held`` a retire of ``retired`` frees: each retired key's attempt and every
    earlier attempt of its rollout (capture keys ``<rollout>`` and ``<rollout>-a<n>``)."""
    limits: dict[str, int] = {}
    for key in retired:
        rollout, attempt = split_capture_key(key)
        limits[rollout] = max(attempt, limits.get(rollout, -1))
    freed = []
    for key in held:
        rollout, attempt = split_capture_key(key)
        if attempt <= limits.get(rollout, -1):
            freed.append(key)
    return freed


class FakeParticipant(Participant):
    """Episodes are keys with a state; a test decides which are busy (blocking) and what fails."""

    def __init__(
        self, kind: str = "environment", instance: str = "env-0", *, frees_earlier_attempts: bool = False
    ) -> None:
        self.kind = kind
        self.instance = instance
        #: retire frees every earlier attempt of a retired key's rollout too (else exactly the keys named)
        self.frees_earlier_attempts = frees_earlier_attempts
        self.state: dict[str, Any] = {}
        self.busy: set[str] = set()
        self.restart_keys: set[str] = set()
        self.admission_open = True
        self.listeners: list[Callable[[], None]] = []
        self.calls: list[tuple[str, Any]] = []
        self.started: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        # failures: raised by the call of that name (close fails after closing, "part way")
        self.fail_export: BaseException | None = None
        self.fail_install: BaseException | None = None
        self.fail_close: BaseException | None = None
        self.fail_open: BaseException | None = None
        self.fail_retire: BaseException | None = None
        self.fail_delete: BaseException | None = None
        self.fail_forget: BaseException | None = None
        self.fail_park: BaseException | None = None
        #: the open_admission failure is raised once, then cleared
        self.fail_open_once = False
        #: set whenever admission reopened successfully
        self.opened = asyncio.Event()
        # gates: the call waits until the test sets the event
        self.export_gate: asyncio.Event | None = None
        self.install_gate: asyncio.Event | None = None
        self.retire_gate: asyncio.Event | None = None
        self.delete_gate: asyncio.Event | None = None
        self.open_gate: asyncio.Event | None = None
        self.close_gate: asyncio.Event | None = None
        self.forget_gate: asyncio.Event | None = None
        #: what the last install installed (records, scope) and the manifest they were read by
        self.installed: list[dict[str, Any]] = []
        self.installed_scope: list[str] = []
        self.installed_manifest: Any = None
        self.retired: list[list[str]] = []
        self.deleted: list[list[str]] = []
        self.forgotten: list[list[str]] = []
        self.blocker_limits: list[int] = []
        self.extra_status: dict[str, Any] = {}
        self.extra_manifest: dict[str, Any] = {}
        self.extra_commit_reply: dict[str, Any] = {}

    # --- controllable episodes

    def start(self, key: str, state: Any = None, *, busy: bool = False) -> None:
        """Hold episode ``key`` (state ``{"step": 0}`` unless given); ``busy``: a step is in flight."""
        self.state[key] = state if state is not None else {"step": 0}
        if busy:
            self.busy.add(key)

    def finish_step(self, key: str, state: Any = None) -> None:
        """End ``key``'s step; a new ``state`` replaces (never mutates) the exported one."""
        if state is not None:
            self.state[key] = state
        self.busy.discard(key)
        self.notify()

    def make_busy(self, key: str) -> None:
        """A step of ``key`` is in flight (readiness may regress)."""
        self.busy.add(key)
        self.notify()

    def notify(self) -> None:
        """Tell the readiness listeners that readiness may have changed."""
        for listener in self.listeners:
            listener()

    # --- what was called

    def count(self, name: str) -> int:
        """How many times the call ``name`` started."""
        return sum(1 for call, _ in self.calls if call == name)

    def names(self) -> list[str]:
        """Every call's name, in order (``*_done`` entries included)."""
        return [call for call, _ in self.calls]

    def arguments(self, name: str) -> list[Any]:
        """The argument of every call ``name`` that started, in order."""
        return [argument for call, argument in self.calls if call == name]

    def _enter(self, name: str, arg: Any = None) -> None:
        self.calls.append((name, arg))
        self.started[name].set()

    def free(self, key: str) -> None:
        """Drop ``key``'s episode (a retire or a deletion freed it)."""
        self.state.pop(key, None)
        self.busy.discard(key)

    # --- the interface

    async def close_admission(self, checkpoint_id: str) -> None:
        self._enter("close")
        self.admission_open = False
        if self.close_gate is not None:
            await self.close_gate.wait()
        if self.fail_close is not None:
            raise self.fail_close
        self.calls.append(("close_done", None))

    async def open_admission(self) -> None:
        self._enter("open")
        if self.open_gate is not None:
            await self.open_gate.wait()
        if self.fail_open is not None:
            failure = self.fail_open
            if self.fail_open_once:
                self.fail_open = None
            raise failure
        self.admission_open = True
        self.opened.set()
        self.calls.append(("open_done", None))

    def ready(self) -> bool:
        return not self.busy

    def blocker_count(self) -> int:
        return len(self.busy)

    def blockers(self, limit: int) -> list[str]:
        self.blocker_limits.append(limit)
        return sorted(self.busy)[:limit]

    def restarts(self) -> list[str]:
        return sorted(self.restart_keys)

    def counts(self) -> dict[str, int]:
        return {"live": len(self.state), "busy": len(self.busy)}

    def add_readiness_listener(self, callback: Callable[[], None]) -> None:
        self.listeners.append(callback)

    async def export(self, scope: list[str] | None) -> list[dict[str, Any]]:
        self._enter("export", None if scope is None else list(scope))
        if self.export_gate is not None:
            await self.export_gate.wait()
        if self.fail_export is not None:
            raise self.fail_export
        keys = list(self.state) if scope is None else scope
        records = [{"episode_id": key, "state": self.state[key]} for key in keys if key in self.state]
        self.calls.append(("export_done", None))
        return records

    async def install(self, records: list[dict[str, Any]], scope: list[str], manifest: Any = None) -> None:
        self._enter("install", list(scope))
        if self.install_gate is not None:
            await self.install_gate.wait()
        if self.fail_install is not None:
            raise self.fail_install
        self.installed = records
        self.installed_scope = scope
        self.installed_manifest = manifest
        for record in records:
            self.state[record["episode_id"]] = record["state"]
        self.calls.append(("install_done", None))

    async def retire(self, episode_ids: list[str]) -> None:
        self._enter("retire", list(episode_ids))
        if self.retire_gate is not None:
            await self.retire_gate.wait()
        if self.fail_retire is not None:
            raise self.fail_retire
        self.retired.append(list(episode_ids))
        freed = freed_by_retire(list(self.state), episode_ids) if self.frees_earlier_attempts else episode_ids
        for key in freed:
            self.free(key)
        self.calls.append(("retire_done", None))

    async def delete_restored(self, episode_ids: list[str]) -> None:
        self._enter("delete_restored", list(episode_ids))
        if self.delete_gate is not None:
            await self.delete_gate.wait()
        if self.fail_delete is not None:
            raise self.fail_delete
        self.deleted.append(list(episode_ids))
        for key in episode_ids:
            self.state.pop(key, None)
        self.calls.append(("delete_restored_done", None))

    async def forget(self, rollout_ids: list[str]) -> None:
        self._enter("forget", list(rollout_ids))
        if self.forget_gate is not None:
            await self.forget_gate.wait()
        if self.fail_forget is not None:
            raise self.fail_forget
        self.forgotten.append(list(rollout_ids))
        self.calls.append(("forget_done", None))

    def live_work(self) -> list[str]:
        return sorted(self.state)

    async def park_exported(self, records: list[dict[str, Any]]) -> None:
        self._enter("park", [record["episode_id"] for record in records])
        if self.fail_park is not None:
            raise self.fail_park

    def manifest_extra(self) -> dict[str, Any]:
        return dict(self.extra_manifest)

    def commit_reply_extra(self) -> dict[str, Any]:
        return dict(self.extra_commit_reply)

    def status_extra(self) -> dict[str, Any]:
        return dict(self.extra_status)
