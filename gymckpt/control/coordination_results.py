"""What the controller's coordination gives back: participants found, prepare results, episode ids.

Re-exported by :mod:`gymckpt.control.coordination`, where :class:`~gymckpt.control.coordination.Coordinator`
makes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gymckpt import errors
from gymckpt.control.models import Phase
from gymckpt.identity import EpisodeId, episode_key

if TYPE_CHECKING:
    from collections.abc import Iterable

    from gymckpt.control.models import PrepareReply

__all__ = [
    "DiscoverResult",
    "EpisodeLike",
    "ParticipantInfo",
    "PrepareResult",
    "reported_roots",
    "runs_to_await",
    "scope_keys",
]

#: an episode id as callers give it: a capture key, an :class:`EpisodeId`, or ``{"rollout_id", "attempt"}``
EpisodeLike = str | EpisodeId | Mapping[str, Any]


# --- episode ids


def _key_of(episode: object) -> str:
    """The capture key of an episode id a caller gave (validated)."""
    if isinstance(episode, Mapping) and not isinstance(episode, dict):
        episode = dict(episode)
    return episode_key(episode)


def scope_keys(episode_ids: Iterable[EpisodeLike]) -> list[str]:
    """Sorted, de-duplicated capture keys."""
    return sorted({_key_of(episode) for episode in episode_ids})


# --- results


@dataclass(frozen=True)
class ParticipantInfo:
    """One server's participant, as discover found it."""

    url: str
    kind: str
    instance: str
    #: the optional restore fields the server checks (its status's ``restore_checks``; none: a reference server)
    restore_checks: frozenset[str] = frozenset()
    #: where its checkpoint directories may lie (its status's ``allowed_roots``, resolved by the server):
    #: None allows any; meaningful only when :attr:`roots_reported`
    allowed_roots: tuple[str, ...] | None = None
    #: whether its status says ``allowed_roots`` (a reference server's does not)
    roots_reported: bool = False


@dataclass
class DiscoverResult:
    """Participants that answered, servers that are not participants, and servers that failed (with why).

    ``skipped`` lists servers whose status route answered 404: they take no part in
    checkpoints (an auxiliary model, a relay) and are not a problem. ``problems`` maps each
    failed server (and ``"deployment"`` when no model participant answered) to a text;
    ``causes`` holds the same failures as exceptions.
    """

    participants: list[ParticipantInfo] = field(default_factory=list)
    problems: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    causes: dict[str, BaseException] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return not self.problems

    def _report(self, server: str, cause: BaseException) -> None:
        self.causes[server] = cause
        self.problems[server] = str(cause) or type(cause).__name__

    def raise_for_problems(self) -> DiscoverResult:
        """Raise one :class:`~gymckpt.errors.CoordinationError` naming every problem; else return self."""
        if self.causes:
            raise errors.CoordinationError("discover", self.causes)
        return self


@dataclass
class PrepareResult:
    """The prepare replies so far, and whether every participant is prepared.

    ``prepared`` is False when some stage answered a phase other than ``prepared``;
    ``stopped_at`` names that stage's kind, and the stages after it were never called.
    """

    prepared: bool
    replies: dict[str, PrepareReply]
    stopped_at: str | None = None

    @property
    def ready(self) -> bool:
        """The same as :attr:`prepared`."""
        return self.prepared

    def blockers(self) -> dict[str, list[str]]:
        """Blocking capture keys of every server not prepared (each list capped by the server at 100)."""
        return {url: reply.report.blockers for url, reply in self.replies.items() if reply.phase != Phase.PREPARED}

    def restarts(self) -> set[str]:
        """Every episode some server cannot capture (capture keys): never exported; after a crash it starts over."""
        return {key for reply in self.replies.values() for key in reply.report.restarts}

    def continued(self, episode_ids: Iterable[EpisodeLike]) -> list[str]:
        """The commit scope: the episodes the controller continues, restarts left out (sorted capture keys)."""
        restarts = self.restarts()
        return [key for key in scope_keys(episode_ids) if key not in restarts]


def runs_to_await(outstanding: Iterable[str], *, committed: Iterable[str], restarts: Iterable[str]) -> list[str]:
    """The outstanding ``/run`` calls to wait for before building the checkpoint's rollout set.

    Only those whose episode is neither committed nor a restart: restarts keep running
    through the checkpoint, and committed episodes continue from their records.
    """
    skip = set(committed) | set(restarts)
    return sorted(key for key in outstanding if key not in skip)


def reported_roots(status: dict[str, Any]) -> tuple[bool, tuple[str, ...] | None]:
    """Whether a status says its ``allowed_roots`` (null: any; a list of strings), and what it says.

    A status without the key (a reference server's) or with a value of another shape says nothing.
    """
    roots = status.get("allowed_roots", ())
    if roots is None:
        return True, None
    if isinstance(roots, list) and roots and all(isinstance(root, str) for root in roots):
        return True, tuple(roots)
    return False, None
