"""A participant whose readiness is an :class:`~gymckpt.participants.steps.EpisodeRegistry`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gymckpt.control.participant import Participant

if TYPE_CHECKING:
    from collections.abc import Callable

    from gymckpt.participants.steps import EpisodeRegistry

__all__ = ["RegistryParticipant"]


class RegistryParticipant(Participant):
    """Admission and readiness delegated to ``self.registry`` (subclasses create it)."""

    registry: EpisodeRegistry

    async def close_admission(self, checkpoint_id: str) -> None:
        self.registry.close()

    async def open_admission(self) -> None:
        self.registry.open()

    def ready(self) -> bool:
        return self.registry.ready()

    def blocker_count(self) -> int:
        return self.registry.blocker_count()

    def blockers(self, limit: int) -> list[str]:
        return self.registry.blockers(limit)

    def restarts(self) -> list[str]:
        return self.registry.restarts()

    def counts(self) -> dict[str, int]:
        return self.registry.counts()

    def add_readiness_listener(self, callback: Callable[[], None]) -> None:
        self.registry.add_listener(callback)

    def live_work(self) -> list[str]:
        """Every live episode (a restore refuses to run over them)."""
        return sorted(self.registry.live_keys())
