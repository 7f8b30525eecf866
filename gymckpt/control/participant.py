"""The interface a server kind implements to take part in checkpoints.

The control plane owns phases, leases and storage; a participant knows its own
executions: how to close and reopen admission, whether it is ready, what blocks it, what
it exports and installs, and how to stop and free an attempt. It also owns its attempt
fence (:attr:`Participant.fence`, the retire marks its requests are checked against),
which the plane marks and forgets through and which can be handed to other processes.

Seams a server with several workers uses: :meth:`Participant.bind` and
:attr:`Participant.middleware` (what ``install_checkpointing`` wires), the checkpoint id
given to :meth:`Participant.close_admission`, the manifest given to
:meth:`Participant.install`, :meth:`Participant.forget`, and
:meth:`Participant.claim_restored` for restored whole-episode state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from gymckpt.control.marks import RetireMarks

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable

    from gymckpt.control.plane import ControlPlane
    from gymckpt.store.manifest import Manifest

__all__ = ["Participant"]


class Participant(ABC):
    """One server's side of a checkpoint (kinds: environment, model, agent, resources)."""

    #: ``environment``, ``model``, ``agent`` or ``resources``
    kind: str
    #: unique among the participants of one kind
    instance: str
    #: the control plane driving this participant, once :meth:`bind` was called (checkpointing on)
    plane: ControlPlane | None = None
    #: an ASGI middleware class ``install_checkpointing`` adds (``participant=self``), or None
    middleware: ClassVar[type | None] = None
    #: paths its middleware serves without a rollout (never fenced, counted or held), beside
    #: :data:`~gymckpt.participants.rollout.UNFENCED_PATHS`: the block's ``exempt_paths`` and an integration's
    exempt_paths: frozenset[str] = frozenset()
    #: where restored whole-episode state of another process waits (a worker's coordinator):
    #: ``await claim_source(key)`` gives its record once, else None (see :meth:`take_restored`)
    claim_source: Callable[[str], Awaitable[dict[str, Any] | None]] | None = None

    @property
    def fence(self) -> RetireMarks:
        """The attempt fence: rollouts retired up to an attempt, until forgotten.

        The control plane marks (retire, restore) and forgets through it; requests are
        checked against it (:meth:`check_attempt`); ``snapshot``/``update`` replicate it.
        """
        fence = self.__dict__.get("_fence")
        if fence is None:
            fence = self.__dict__["_fence"] = RetireMarks()
        return fence  # type: ignore[no-any-return]

    def bind(self, plane: ControlPlane) -> None:
        """Called once by ``install_checkpointing`` with the plane that drives this participant."""
        self.plane = plane

    def check_attempt(self, key: str) -> None:
        """Raise :class:`~gymckpt.errors.StaleAttempt` for work of a retired attempt."""
        self.fence.check(key)

    def note_deadline(self, deadline_ts: float | None) -> None:
        """The deadline of the control call about to run (a prepare's, before :meth:`close_admission`).

        Default: ignored. The policy model bounds its generation cuts by it; a coordinator of
        several workers bounds its messages by it.
        """

    @abstractmethod
    async def close_admission(self, checkpoint_id: str) -> None:
        """Stop admitting new work for checkpoint (or restore) ``checkpoint_id``; running work
        goes on to its next boundary."""

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
    async def export(self, scope: list[str] | None) -> Iterable[dict[str, Any]]:
        """Records (first key ``episode_id``) of the episodes in ``scope`` this server holds (None: all).

        Called once per checkpoint, after prepare; the records are stored as they are,
        never copied, so the state they reference must stay put until resume.
        """

    @abstractmethod
    async def install(self, records: list[dict[str, Any]], scope: list[str], manifest: Manifest) -> None:
        """Install restored records; ``scope`` holds every next-attempt key the restore continues
        (records are already keyed by their next-attempt capture key); ``manifest`` is the one
        they were read by (its extra fields, e.g. which worker owned which session)."""

    async def take_restored(self, key: str) -> bool:
        """Install ``key``'s restored whole-episode record from :attr:`claim_source`, if it holds one.

        Called by a server before it starts (or continues) the episode of ``key``; True when a
        record was taken and installed here. Without a claim source (one process) nothing happens.
        """
        source = self.claim_source
        if source is None:
            return False
        record = await source(key)
        if record is None:
            return False
        await self.install([record], [key], None)  # type: ignore[arg-type]
        return True

    def claim_restored(self, key: str) -> bool:
        """Take restored whole-episode state of ``key`` for the request that continues it.

        True exactly once per restored key (for the first request of its replacement
        attempt); False when nothing restored waits under ``key`` or it was claimed already.
        Default: nothing is restored as whole-episode state.
        """
        return False

    async def check_forget(self, rollout_ids: list[str]) -> None:
        """Raise (e.g. :class:`~gymckpt.errors.RetireIncomplete`) when these rollouts cannot be
        forgotten yet; called before any mark is forgotten. Default: always possible."""

    async def forget(self, rollout_ids: list[str]) -> None:
        """The fence forgot these rollouts (every attempt may run again); default: nothing to do."""

    @abstractmethod
    async def retire(self, episode_ids: list[str]) -> None:
        """Stop the running work of these attempts and earlier ones, wait for it, free its state."""

    async def delete_restored(self, episode_ids: list[str]) -> None:
        """Delete restored episodes a commit's scope left out (default: :meth:`retire`).

        Must leave nothing that would refuse the attempt later: the controller may still
        start the rollout over as that attempt.
        """
        await self.retire(episode_ids)

    def live_work(self) -> list[str] | Awaitable[list[str]]:
        """Capture keys of the work this process already serves (a restore refuses to run over it).

        Default: none; a participant that holds episodes or sessions lists them. A coordinator
        of several workers returns an awaitable (it asks them).
        """
        return []

    async def park_exported(self, records: list[dict[str, Any]]) -> None:
        """The controller stops after this checkpoint (commit ``stop``): free what the exported
        episodes hold outside this process. Called once, after the write is durable; a failure
        is logged and the commit still succeeds. Default: nothing to free."""

    def manifest_extra(self) -> dict[str, Any]:
        """Extra manifest fields of this participant's commit."""
        return {}

    def commit_reply_extra(self) -> dict[str, Any]:
        """Extra fields of the commit reply (e.g. the model's ``staging_keys``)."""
        return {}

    def status_extra(self) -> dict[str, Any]:
        """Extra fields of the status reply (e.g. a resources server's ``mode`` and ``verify``)."""
        return {}
