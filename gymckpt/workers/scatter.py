"""Restore across workers: place the scope's records, then send each worker its share as the file is read.

The records are read twice, each time streamed and verified by the store (off the event
loop), and never held together in the coordinator:

1. :func:`survey`: whole-episode records are kept (encoded once: the coordinator holds them
   until a worker claims one); of every other record only what placement reads
   (``episode_id``, ``owner``, ``session_id``). :func:`plan_scatter` places them
   (:func:`~gymckpt.workers.placement.place_records`): each record's worker, its position in
   that worker's share, and the owner stamped on a session record that had none.
2. :func:`scatter`: each record is prepared as placement would hand it over (owner stamped,
   a ``session_id`` equal to its key dropped), encoded once and added to its worker's next
   chunk; a chunk of about :data:`~gymckpt.workers.streams.CHUNK_BYTES` is sent at once
   (``install_chunk {stream, records: [[position, line], …]}``); a worker's next chunk waits
   for the answer to its previous one (:class:`ChunkSender`). The coordinator holds one
   record and a chunk or two per worker.

Nothing is installed until every chunk arrived (the caller then sends ``install``): a
damaged file or a worker lost on the way fails the restore with nothing installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gymckpt.errors import InvalidCheckpointState
from gymckpt.store.codec import EncodedRecord, encoded
from gymckpt.workers.coordinator_fields import owner_aliases, with_session_id, without_session_id
from gymckpt.workers.placement import place_records
from gymckpt.workers.streams import CHUNK_BYTES

if TYPE_CHECKING:
    import concurrent.futures
    from collections.abc import Callable, Iterable, Mapping

__all__ = ["ChunkSender", "ScatterPlan", "plan_scatter", "scatter", "survey"]

#: the fields of a session record placement reads
_PLACED_FIELDS = ("episode_id", "owner", "session_id")


@dataclass
class ScatterPlan:
    """Where each restored session record goes, and the routing tables every worker gets."""

    #: episode id → (worker index, position in its share, owner to stamp or None)
    targets: dict[str, tuple[int, int, str | None]] = field(default_factory=dict)
    #: worker index → records in its share (every live worker, 0 included)
    counts: dict[int, int] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    placements: dict[str, str] = field(default_factory=dict)


def survey(
    records: Iterable[dict[str, Any]], holds: Callable[[dict[str, Any]], bool]
) -> tuple[dict[str, EncodedRecord], list[dict[str, Any]]]:
    """The first read: whole-episode records encoded (to hold), and what placement reads of the others."""
    held: dict[str, EncodedRecord] = {}
    placed: list[dict[str, Any]] = []
    for record in records:
        if holds(record):
            held[record["episode_id"]] = encoded(record)
        else:
            placed.append(with_session_id({name: record[name] for name in _PLACED_FIELDS if name in record}))
        del record
    return held, placed


def plan_scatter(
    placed: list[dict[str, Any]], routing: Mapping[int, str | None], extra: Mapping[str, Any]
) -> ScatterPlan:
    """Place the surveyed session records on the live workers (``routing``: index → routing id);
    ``extra`` is the manifest's (``session_owners``, ``placed_sessions``, ``owner_aliases``)."""
    owners = {record["episode_id"]: record.get("owner") for record in placed}
    placement = place_records(
        placed,
        routing,
        session_owners=extra.get("session_owners") or (),
        placed_sessions=extra.get("placed_sessions") or (),
    )
    plan = ScatterPlan(aliases=dict(placement.aliases), placements=dict(placement.placements))
    for old, current in owner_aliases(extra.get("owner_aliases")).items():
        if current in plan.aliases:
            plan.aliases[old] = plan.aliases[current]
    for index, share in placement.records.items():
        plan.counts[index] = len(share)
        routing_id = routing.get(index)
        for position, record in enumerate(share):
            key = record["episode_id"]
            stamp = record.get("owner") if owners.get(key) is None else None
            plan.targets[key] = (index, position, stamp)
            if routing_id:
                plan.placements[key] = routing_id
    return plan


def _prepared(record: dict[str, Any], stamp: str | None) -> dict[str, Any]:
    """The record as placement hands it to its worker (what a worker installs)."""
    placed = with_session_id(record)
    if stamp is not None:
        placed = {**placed, "owner": stamp}
    return without_session_id(placed)


class ChunkSender:
    """Sends chunks with ``submit(index, chunk)`` (a future of its answer), one unanswered per worker:
    a worker's next chunk waits for the answer to its previous one, so a worker decodes while
    the file is read on."""

    def __init__(self, submit: Callable[[int, list[list[Any]]], concurrent.futures.Future[None]]) -> None:
        self.submit = submit
        self.unanswered: dict[int, concurrent.futures.Future[None]] = {}

    def __call__(self, index: int, chunk: list[list[Any]]) -> None:
        previous = self.unanswered.pop(index, None)
        if previous is not None:
            previous.result()
        self.unanswered[index] = self.submit(index, chunk)

    def finish(self, *, failed: bool) -> None:
        """Wait for every answer; the first failure raises, unless the stream ``failed`` already."""
        unanswered, self.unanswered = self.unanswered, {}
        for index in sorted(unanswered):
            try:
                unanswered[index].result()
            except Exception:
                if not failed:
                    raise


def scatter(
    records: Iterable[dict[str, Any]],
    plan: ScatterPlan,
    send: Callable[[int, list[list[Any]]], None],
    limit: int = CHUNK_BYTES,
) -> int:
    """The second read: every planned record to its worker, ``send(index, chunk)`` per full chunk,
    the rest at the end (a :class:`ChunkSender` is waited for before this returns); returns the
    records sent."""
    failed = True
    try:
        sent = _scatter(records, plan, send, limit)
        failed = False
    finally:
        if isinstance(send, ChunkSender):
            send.finish(failed=failed)
    return sent


def _scatter(
    records: Iterable[dict[str, Any]], plan: ScatterPlan, send: Callable[[int, list[list[Any]]], None], limit: int
) -> int:
    pending: dict[int, list[list[Any]]] = {}
    sizes: dict[int, int] = {}
    sent = 0
    for record in records:
        target = plan.targets.get(record["episode_id"])
        if target is None:
            continue  # a held record
        index, position, stamp = target
        _, line = encoded(_prepared(record, stamp))
        del record
        pending.setdefault(index, []).append([position, line.decode("utf-8")])
        sizes[index] = sizes.get(index, 0) + len(line)
        sent += 1
        if sizes[index] >= limit:
            send(index, pending.pop(index))
            sizes[index] = 0
    for index in sorted(pending):
        send(index, pending.pop(index))
    if sent != len(plan.targets):
        raise InvalidCheckpointState(
            f"the records file gave {sent} of the {len(plan.targets)} session records its first read placed"
        )
    return sent
