"""A participant with controllable episodes, for control-plane tests.

Every call is recorded in :attr:`FakeParticipant.calls` when it starts (and ``*_done``
when it ends), every blocking point is an :class:`asyncio.Event` gate the test opens,
and every call can be made to fail. ``started[name]`` is an :class:`asyncio.Event` set
when the call ``name`` starts, so a test can await "the plane reached this point"
instead of sleeping.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import Any

from gymckpt.control.participant import Participant

__all__ = ["FakeClock", "FakeParticipant", "drain", "wait"]

#: every wait in these tests is bounded by this many seconds
WAIT = 10.0


async def wait(awaitable: Any, timeout: float = WAIT) -> Any:
    """Await ``awaitable``, bounded (a hang fails the test instead of blocking the run)."""
    return await asyncio.wait_for(awaitable, timeout)


async def drain(rounds: int = 50) -> None:
    """Let every ready task run until it blocks (pure event-loop scheduling, no time passes)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class FakeClock:
    """An injectable epoch clock the test moves by hand.

    It runs at the real rate from where the test put it, so a deadline a few hundredths
    of a second ahead still passes while the test jumps the clock over lease times.
    """

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds

    def set(self, epoch: float) -> None:
        """Put the clock at ``epoch`` now."""
        self.offset = epoch - time.time()


class FakeParticipant(Participant):
    """Episodes are keys with a state; a test decides which are busy (blocking) and what fails."""

    def __init__(self, kind: str = "environment", instance: str = "env-0") -> None:
        self.kind = kind
        self.instance = instance
        self.state: dict[str, dict[str, Any]] = {}
        self.busy: set[str] = set()
        self.restart_keys: set[str] = set()
        self.admission_open = True
        self.listeners: list[Any] = []
        self.calls: list[tuple[str, Any]] = []
        self.started: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        # failures: raised by the call of that name (close fails after closing, "part way")
        self.fail_export: BaseException | None = None
        self.fail_install: BaseException | None = None
        self.fail_close: BaseException | None = None
        self.fail_open: BaseException | None = None
        self.fail_retire: BaseException | None = None
        self.fail_delete: BaseException | None = None
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
        self.installed: list[dict[str, Any]] = []
        self.installed_scope: list[str] = []
        self.retired: list[list[str]] = []
        self.deleted: list[list[str]] = []
        self.blocker_limits: list[int] = []
        self.extra_status: dict[str, Any] = {}
        self.extra_manifest: dict[str, Any] = {}
        self.extra_commit_reply: dict[str, Any] = {}

    # --- controllable episodes

    def start(self, key: str, state: dict[str, Any] | None = None, *, busy: bool = False) -> None:
        self.state[key] = state if state is not None else {"step": 0}
        if busy:
            self.busy.add(key)

    def finish_step(self, key: str, state: dict[str, Any] | None = None) -> None:
        """End ``key``'s step; a new ``state`` replaces (never mutates) the exported one."""
        if state is not None:
            self.state[key] = state
        self.busy.discard(key)
        self.notify()

    def make_busy(self, key: str) -> None:
        self.busy.add(key)
        self.notify()

    def notify(self) -> None:
        for listener in self.listeners:
            listener()

    def count(self, name: str) -> int:
        """How many times the call ``name`` started."""
        return sum(1 for call, _ in self.calls if call == name)

    def names(self) -> list[str]:
        return [call for call, _ in self.calls]

    def _enter(self, name: str, arg: Any = None) -> None:
        self.calls.append((name, arg))
        self.started[name].set()

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

    def add_readiness_listener(self, callback: Any) -> None:
        self.listeners.append(callback)

    async def export(self, scope: list[str]) -> list[dict[str, Any]]:
        self._enter("export", list(scope))
        if self.export_gate is not None:
            await self.export_gate.wait()
        if self.fail_export is not None:
            raise self.fail_export
        records = [{"episode_id": key, "state": self.state[key]} for key in scope if key in self.state]
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
        for key in episode_ids:
            self.state.pop(key, None)
            self.busy.discard(key)
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

    def manifest_extra(self) -> dict[str, Any]:
        return dict(self.extra_manifest)

    def commit_reply_extra(self) -> dict[str, Any]:
        return dict(self.extra_commit_reply)

    def status_extra(self) -> dict[str, Any]:
        return dict(self.extra_status)
