"""Restore onto another worker count: which live worker installs which session record (pure).

Session records (state that spans requests) are grouped: by their ``owner`` (the routing id
of the worker that held them at commit), else one group per ``session_id`` (sessions of a
server that ran one worker, so their cookies name no owner). Every owner the manifest lists
in ``session_owners`` gets a group even without records, so its old cookies are aliased too.

Groups are placed largest first (record count descending, then group key), each on the live
worker with the smallest (records so far, groups so far, worker index): one old owner's
sessions land on one worker, and the load stays even (max − min ≤ the largest group).

The result carries ``aliases`` (old owner → new routing id), ``placements`` (session id →
routing id: the owner-less sessions, plus the manifest's ``placed_sessions`` re-pointed to
their owner's new worker) and the records of owner-less sessions with ``owner`` set to the
worker they were placed on. Whole-episode records are never placed: a ``held`` predicate
sets them aside in :attr:`Placement.held`.

With nothing to place (no session records, no listed owners) the workers are not looked at,
so a server whose workers do not route (an environment server) can restore held records.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from gymckpt.errors import ControlError, InvalidCheckpointState, ManifestFieldInvalid

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

__all__ = ["WHOLE_EPISODE", "Placement", "is_routing_id", "is_whole_episode", "place_records", "whole_episode_rule"]

_ROUTING_ID = re.compile(r"[0-9a-f]{32}")

Record = dict[str, Any]
#: ("owner", routing id) or ("session", session id); "owner" sorts first on equal counts
GroupKey = tuple[str, str]


def is_routing_id(value: object) -> bool:
    """True for a worker's routing id: 32 lowercase hex digits (a uuid4's ``hex``)."""
    return isinstance(value, str) and _ROUTING_ID.fullmatch(value) is not None


def _run_record(record: dict[str, Any]) -> bool:
    return record.get("kind") == "run"


def _every_record(record: dict[str, Any]) -> bool:
    return True


def _no_record(record: dict[str, Any]) -> bool:
    return False


#: kind → which of its records are whole-episode state (held by the coordinator, claimed by one
#: worker); every other record is a session that spans requests (placed on a worker, routed to it)
WHOLE_EPISODE: dict[str, Callable[[dict[str, Any]], bool]] = {
    "environment": _every_record,
    "agent": _run_record,
    "resources": _no_record,
    # a model record is the capture ledger of one episode: placed like a session, and its calls
    # routed to the worker that holds it
    "model": _no_record,
}


def whole_episode_rule(kind: str) -> bool | Callable[[dict[str, Any]], bool]:
    """A kind's rule of :data:`WHOLE_EPISODE` as a constant where it is one: ``True`` (every record is
    whole-episode, unknown kinds too), ``False`` (none is), else its predicate."""
    rule = WHOLE_EPISODE.get(kind, _every_record)
    if rule is _every_record:
        return True
    if rule is _no_record:
        return False
    return rule


def is_whole_episode(kind: str, record: dict[str, Any]) -> bool:
    """True for a record of state that lives inside one request (unknown kinds: every record)."""
    return WHOLE_EPISODE.get(kind, _every_record)(record)


@dataclass(frozen=True)
class Placement:
    """Where a restore installs each session record, and the routing tables every worker gets.

    ``records`` has an entry for every live worker (empty when it installs nothing), in
    group key order (owners, then sessions), each group's records in their input order.
    """

    records: Mapping[int, tuple[Record, ...]]
    aliases: Mapping[str, str]
    placements: Mapping[str, str]
    held: tuple[Record, ...] = ()


def place_records(
    records: Iterable[Record],
    workers: Mapping[int, str | None],
    *,
    session_owners: Iterable[str] = (),
    placed_sessions: Iterable[str] = (),
    held: Callable[[Record], bool] | None = None,
) -> Placement:
    """Place restored ``records`` on the live ``workers`` (index → routing id).

    ``session_owners`` and ``placed_sessions`` are the manifest's extras; ``held`` picks the
    whole-episode records, which are returned unplaced. The input records are not modified.
    """
    owners = _string_list(session_owners, "session_owners")
    placed = set(_string_list(placed_sessions, "placed_sessions"))
    kept: list[Record] = []
    groups: dict[GroupKey, list[Record]] = {}
    for record in records:
        if held is not None and held(record):
            kept.append(record)
        else:
            groups.setdefault(_group_key(record), []).append(record)
    for owner in owners:
        if not is_routing_id(owner):
            raise ManifestFieldInvalid(f"session_owners lists {owner!r}, which is not a routing id")
        groups.setdefault(("owner", owner), [])
    if not groups:
        return _result({index: [] for index in workers}, {}, {}, kept)
    routing = _routing_ids(workers)
    assigned = _assign(groups, sorted(routing))
    return _tables(groups, assigned, routing, placed, kept)


def _string_list(values: Iterable[str], field: str) -> list[str]:
    """``values`` as a list, refused unless it is a collection of strings (a manifest field)."""
    listed = [] if isinstance(values, (str, bytes)) else list(values)
    if isinstance(values, (str, bytes)) or not all(isinstance(value, str) for value in listed):
        raise ManifestFieldInvalid(f"the manifest's {field} is not a list of strings")
    return listed


def _group_key(record: Record) -> GroupKey:
    """The record's group: its owner, else its session id; neither is damage."""
    episode_id = record.get("episode_id")
    owner = record.get("owner")
    if owner is not None:
        if not is_routing_id(owner):
            raise InvalidCheckpointState(f"the record of {episode_id!r} names owner {owner!r}, not a routing id")
        return ("owner", owner)
    session_id = record.get("session_id")
    if isinstance(session_id, str) and session_id:
        return ("session", session_id)
    if session_id is not None:
        raise InvalidCheckpointState(f"the record of {episode_id!r} has session_id {session_id!r}, not a string")
    raise InvalidCheckpointState(
        f"the record of {episode_id!r} names neither a session owner nor a session id, "
        "so no worker can be chosen to hold it"
    )


def _routing_ids(workers: Mapping[int, str | None]) -> dict[int, str]:
    """Every live worker's routing id; refused when there is none or one is missing."""
    if not workers:
        raise ControlError("restoring sessions requires at least one live worker")
    lacking = sorted(index for index, routing_id in workers.items() if not is_routing_id(routing_id))
    if lacking:
        raise ControlError(
            f"restoring sessions requires workers that route sessions; worker(s) {lacking} have no routing id"
        )
    return {index: str(routing_id) for index, routing_id in workers.items()}


def _assign(groups: Mapping[GroupKey, list[Record]], indexes: list[int]) -> dict[GroupKey, int]:
    """Largest group first, each to the worker with the smallest (records, groups, index)."""
    load = [(0, 0, index) for index in indexes]  # sorted, so already a heap
    assigned: dict[GroupKey, int] = {}
    for key in sorted(groups, key=lambda key: (-len(groups[key]), key)):
        placed_records, placed_groups, index = heapq.heappop(load)
        assigned[key] = index
        heapq.heappush(load, (placed_records + len(groups[key]), placed_groups + 1, index))
    return assigned


def _tables(
    groups: Mapping[GroupKey, list[Record]],
    assigned: Mapping[GroupKey, int],
    routing: Mapping[int, str],
    placed: set[str],
    kept: list[Record],
) -> Placement:
    by_worker: dict[int, list[Record]] = {index: [] for index in sorted(routing)}
    aliases: dict[str, str] = {}
    placements: dict[str, str] = {}
    for key in sorted(assigned, key=lambda key: (assigned[key], key)):
        kind, name = key
        new_owner = routing[assigned[key]]
        if kind == "owner":
            aliases[name] = new_owner
            by_worker[assigned[key]].extend(groups[key])
            for record in groups[key]:
                session_id = record.get("session_id")
                if isinstance(session_id, str) and session_id in placed:
                    placements[session_id] = new_owner
        else:
            placements[name] = new_owner
            by_worker[assigned[key]].extend({**record, "owner": new_owner} for record in groups[key])
    return _result(by_worker, dict(sorted(aliases.items())), dict(sorted(placements.items())), kept)


def _result(
    by_worker: Mapping[int, list[Record]], aliases: dict[str, str], placements: dict[str, str], kept: list[Record]
) -> Placement:
    return Placement(
        records=MappingProxyType({index: tuple(by_worker[index]) for index in sorted(by_worker)}),
        aliases=MappingProxyType(aliases),
        placements=MappingProxyType(placements),
        held=tuple(kept),
    )
