"""The interface a server kind implements to take part in checkpoints.

The control plane owns phases, fencing, leases, marks and storage; a participant only
knows its own executions: how to close and reopen admission, whether it is ready, what
blocks it, what it exports and installs, and how to stop and free an attempt.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

__all__ = ["Participant"]


class Participant(ABC):
    """One server's side of a checkpoint (kinds: environment, model, agent, resources)."""

    #: ``environment``, ``model``, ``agent`` or ``resources``
    kind: str
    #: unique among the participants of one kind
    instance: str

    @abstractmethod
    async def close_admission(self) -> None:
        """Stop admitting new work; running work goes on to its next boundary."""

    @abstractmethod
    async def open_admission(self) -> None:
        """Admit work again and wake what parked."""

    @abstractmethod
    def ready(self) -> bool:
        """True when every live execution is at a boundary: a cheap running count."""

    @abstractmethod
    def blocker_count(self) -> int:
        """How many executions block readiness."""

    @abstractmethod
    def blockers(self, limit: int) -> list[str]:
        """Capture keys of at most ``limit`` blocking executions (listed on demand, for a reply)."""

    def restarts(self) -> list[str]:
        """Capture keys of rollouts this server cannot capture (never blocked, never exported)."""
        return []

    def counts(self) -> dict[str, int]:
        """Counters for the prepare report and status."""
        return {}

    @abstractmethod
    def add_readiness_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever readiness may have changed while admission is closed."""

    @abstractmethod
    async def export(self, scope: list[str]) -> Iterable[dict[str, Any]]:
        """Records (first key ``episode_id``) of the episodes in ``scope`` this server holds.

        Called once per checkpoint, after prepare; the records are stored as they are,
        never copied, so the state they reference must stay put until resume.
        """

    @abstractmethod
    async def install(self, records: list[dict[str, Any]], scope: list[str]) -> None:
        """Install restored records; ``scope`` holds every next-attempt key the restore continues
        (records are already keyed by their next-attempt capture key)."""

    @abstractmethod
    async def retire(self, episode_ids: list[str]) -> None:
        """Stop the running work of these attempts and earlier ones, wait for it, free its state."""

    async def delete_restored(self, episode_ids: list[str]) -> None:
        """Delete restored episodes a commit's scope left out (default: :meth:`retire`).

        Must leave nothing that would refuse the attempt later: the controller may still
        start the rollout over as that attempt.
        """
        await self.retire(episode_ids)

    def manifest_extra(self) -> dict[str, Any]:
        """Extra manifest fields of this participant's commit."""
        return {}

    def commit_reply_extra(self) -> dict[str, Any]:
        """Extra fields of the commit reply (e.g. the model's ``staging_keys``)."""
        return {}

    def status_extra(self) -> dict[str, Any]:
        """Extra fields of the status reply (e.g. a resources server's ``checkpoint_verify``)."""
        return {}
