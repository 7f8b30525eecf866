"""Commit across workers: every worker's exported records into one records list (pure).

Records are anything with an ``episode_id`` (a worker's record named before its line moves,
:class:`~gymckpt.workers.streams.LineRef`, or a pre-encoded
:class:`~gymckpt.store.encoded.EncodedRecord`) and leave as the same objects: nothing is
decoded or encoded. Two rules keep one copy of each state:

- **One copy per session.** A restored session can be seeded again on another worker, so
  copies are grouped by ``session_id`` (records without one belong to their worker alone and
  are never merged). The first *live* copy is kept, meaning one whose session is not in its
  worker's ``unclaimed`` set, else the first copy. Every other copy that is unclaimed on its
  worker is listed in ``delete_unclaimed``; a second live copy is logged as an error.
- **One copy per episode id**, by the same rule, because the store refuses duplicates. The
  coordinator's held whole-episode records take part as unclaimed copies, so a worker's copy
  wins over them; a dropped held copy is logged as an error.

Copies are taken in worker index order, each worker's in its reply order, then the held
records that are in scope. Everything is one pass per rule: O(records).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Hashable, Mapping, Sequence, Set

__all__ = ["ExportedRecord", "Gathered", "Keyed", "WorkerExport", "gather_exports"]

logger = logging.getLogger(__name__)


class Keyed(Protocol):
    """A record as gathering sees it: its capture key."""

    @property
    def episode_id(self) -> str: ...


class ExportedRecord(NamedTuple):
    """One exported record and the routing facts the coordinator needs without decoding it."""

    record: Keyed
    session_id: str | None = None
    owner: str | None = None


@dataclass(frozen=True)
class WorkerExport:
    """One worker's export reply: its lines, and its restored sessions no request used yet."""

    records: Sequence[ExportedRecord]
    unclaimed: Set[str] = frozenset()

    def __post_init__(self) -> None:
        # a reply's list becomes a set once, so each record's look-up is O(1)
        object.__setattr__(self, "unclaimed", frozenset(self.unclaimed))


@dataclass(frozen=True)
class Gathered:
    """What a commit across workers stores, and the stale copies to delete on their workers."""

    records: tuple[Keyed, ...]
    #: (worker index, session id) of each stale unclaimed copy, in gathering order
    delete_unclaimed: tuple[tuple[int, str], ...]
    session_owners: tuple[str, ...]
    placed_sessions: tuple[str, ...]

    def manifest_extra(self) -> dict[str, list[str]]:
        """The manifest's multi-worker fields: ``session_owners`` and ``placed_sessions``."""
        return {"session_owners": list(self.session_owners), "placed_sessions": list(self.placed_sessions)}


class _Copy(NamedTuple):
    worker: int | None  # None: held by the coordinator
    exported: ExportedRecord
    live: bool


def gather_exports(
    exports: Mapping[int, WorkerExport],
    *,
    held: Sequence[Keyed] = (),
    scope: Collection[str] | None = None,
    placements: Mapping[str, str] | Collection[str] = (),
) -> Gathered:
    """One records list from every worker's ``exports`` (worker index → reply).

    ``held`` are the coordinator's unclaimed whole-episode records, keyed by their
    replacement attempt; they are appended when ``scope`` is None or names them.
    ``placements`` is the current placement table (its keys become ``placed_sessions``).
    """
    copies = [
        _Copy(index, exported, exported.session_id not in exports[index].unclaimed)
        for index in sorted(exports)
        for exported in exports[index].records
    ]
    in_scope = None if scope is None else set(scope)
    copies.extend(
        _Copy(None, ExportedRecord(record), live=False)
        for record in held
        if in_scope is None or record.episode_id in in_scope
    )
    stale: dict[tuple[int, str], None] = {}
    copies = _one_copy(copies, lambda copy: copy.exported.session_id, "session", stale)
    copies = _one_copy(copies, lambda copy: copy.exported.record.episode_id, "episode", stale)
    owners = {copy.exported.owner for copy in copies if copy.exported.owner}
    return Gathered(
        records=tuple(copy.exported.record for copy in copies),
        delete_unclaimed=tuple(stale),
        session_owners=tuple(sorted(owners)),
        placed_sessions=tuple(sorted(placements)),
    )


def _one_copy(
    copies: list[_Copy], key_of: Callable[[_Copy], Hashable | None], what: str, stale: dict[tuple[int, str], None]
) -> list[_Copy]:
    """``copies`` with one per key (None: never merged): the first live, else the first."""
    chosen: dict[Hashable, int] = {}
    for position, copy in enumerate(copies):
        key = key_of(copy)
        if key is None:
            continue
        best = chosen.setdefault(key, position)
        if copy.live and not copies[best].live:
            chosen[key] = position
    kept = []
    for position, copy in enumerate(copies):
        key = key_of(copy)
        if key is None or chosen[key] == position:
            kept.append(copy)
        else:
            _drop(copy, copies[chosen[key]], key, what, stale)
    return kept


def _drop(copy: _Copy, winner: _Copy, key: Hashable, what: str, stale: dict[tuple[int, str], None]) -> None:
    """Account for a copy left out: delete it on its worker if unused there, log it if live."""
    session_id = copy.exported.session_id
    if copy.worker is None:
        logger.error(
            "%s %r is held by the coordinator and exported by worker %s; the worker's copy is kept",
            what,
            key,
            winner.worker,
        )
    elif copy.live:
        logger.error(
            "%s %r was exported live by workers %s and %s; only worker %s's copy is kept",
            what,
            key,
            winner.worker,
            copy.worker,
            winner.worker,
        )
    elif session_id is not None and (copy.worker, session_id) != (winner.worker, winner.exported.session_id):
        stale[(copy.worker, session_id)] = None
