"""A participant with controllable episodes, for control-plane tests."""

from __future__ import annotations

import asyncio
from typing import Any

from gymckpt.control.participant import Participant


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
        self.fail_export: Exception | None = None
        self.fail_install: Exception | None = None
        self.fail_close: Exception | None = None
        self.export_gate: asyncio.Event | None = None
        self.install_gate: asyncio.Event | None = None
        self.retire_gate: asyncio.Event | None = None
        self.installed: list[dict[str, Any]] = []
        self.installed_scope: list[str] = []
        self.retired: list[list[str]] = []
        self.deleted: list[list[str]] = []

    # controllable episodes
    def start(self, key: str, state: dict[str, Any] | None = None, *, busy: bool = False) -> None:
        self.state[key] = state if state is not None else {"step": 0}
        if busy:
            self.busy.add(key)

    def finish_step(self, key: str) -> None:
        self.busy.discard(key)
        self.notify()

    def make_busy(self, key: str) -> None:
        self.busy.add(key)
        self.notify()

    def notify(self) -> None:
        for listener in self.listeners:
            listener()

    # the interface
    async def close_admission(self) -> None:
        self.calls.append(("close", None))
        if self.fail_close is not None:
            raise self.fail_close
        self.admission_open = False

    async def open_admission(self) -> None:
        self.calls.append(("open", None))
        self.admission_open = True

    def ready(self) -> bool:
        return not self.busy

    def blocker_count(self) -> int:
        return len(self.busy)

    def blockers(self, limit: int) -> list[str]:
        return sorted(self.busy)[:limit]

    def restarts(self) -> list[str]:
        return sorted(self.restart_keys)

    def counts(self) -> dict[str, int]:
        return {"live": len(self.state), "busy": len(self.busy)}

    def add_readiness_listener(self, callback: Any) -> None:
        self.listeners.append(callback)

    async def export(self, scope: list[str]) -> list[dict[str, Any]]:
        self.calls.append(("export", list(scope)))
        if self.export_gate is not None:
            await self.export_gate.wait()
        if self.fail_export is not None:
            raise self.fail_export
        return [{"episode_id": key, "state": self.state[key]} for key in scope if key in self.state]

    async def install(self, records: list[dict[str, Any]], scope: list[str]) -> None:
        self.calls.append(("install", list(scope)))
        if self.install_gate is not None:
            await self.install_gate.wait()
        if self.fail_install is not None:
            raise self.fail_install
        self.installed = records
        self.installed_scope = scope
        for record in records:
            self.state[record["episode_id"]] = record["state"]

    async def retire(self, episode_ids: list[str]) -> None:
        self.calls.append(("retire", list(episode_ids)))
        if self.retire_gate is not None:
            await self.retire_gate.wait()
        self.retired.append(list(episode_ids))
        for key in episode_ids:
            self.state.pop(key, None)
            self.busy.discard(key)

    async def delete_restored(self, episode_ids: list[str]) -> None:
        self.calls.append(("delete_restored", list(episode_ids)))
        self.deleted.append(list(episode_ids))
        for key in episode_ids:
            self.state.pop(key, None)
