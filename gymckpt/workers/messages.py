"""The messages between a server's coordinator and its workers, and their timeouts: one table.

Every message travels on the worker's one :class:`~gymckpt.workers.channel.Channel` as
``{"id", "kind", "body"}`` and is answered with the reply body below (or a typed error).
Episode ids are capture keys; a report is a :class:`~gymckpt.control.models.PrepareReport`
as JSON.

Worker → coordinator:

- ``register {pid, routing_id | null, reads_store}`` → the join state ``{accepting, generation, request,
  marks, routes, holding}``: ``request`` is ``{checkpoint_id, deadline_ts}`` while a checkpoint
  is open (else null), ``marks`` the fence's snapshot (rollout id → highest retired attempt),
  ``routes`` the routing tables ``{aliases, placements}``, ``holding`` whether the
  coordinator holds restored whole-episode records (else a worker need not claim).
  ``reads_store``: the worker opens a restore's checkpoint directory itself (``install_share``).
- ``claim {episode_id}`` → ``{record | null}``: the restored whole-episode record of that key,
  to exactly one claimer; refused with ``checkpoint_parked`` while a checkpoint is open.
- ``report {generation, seq, report}`` → ``{kept}``: kept only for the current generation,
  while closed, and with a ``seq`` above the worker's last one.
- ``control {operation, body, trace}`` (a control route's request, :data:`CONTROL_OPERATIONS`) →
  ``{reply, steps}``: the control reply as JSON (or its error) and the seconds of the plane's
  steps by name, which the worker's route logs as a single-process server logs its own.
- ``export_chunk {stream, episode_ids: […]}`` and the lines as bytes (a blob frame, one line
  per id, each ending with its newline) → ``{}``: the next chunk of the lines ``send_records``
  asked for (about :data:`~gymckpt.workers.streams.CHUNK_BYTES`), answered once the store's
  writer took it; the next is sent after the answer. Each record is encoded once
  (:func:`gymckpt.store.codec.encode_record`), a session's line stamped with the ``owner`` of
  the export reply. The store's writer copies a chunk's lines as one run
  (:class:`gymckpt.store.encoded.EncodedRun`). Refused once that write no longer reads.

Coordinator → worker (each replies ``{}`` unless noted):

- ``close {checkpoint_id, deadline_ts | null, generation}`` → ``{seq, report}``, the
  worker's first report of that generation.
- ``open {}``.
- ``mark {episode_ids}``: refuse these attempts (and earlier ones) until forget.
- ``retire {episode_ids}``: stop and free them (sent after ``mark``).
- ``check_forget {rollout_ids}``: ``{}``, or a refusal such as ``retire_incomplete``.
- ``forget {rollout_ids}``.
- ``export {episode_ids | null, stream}`` → ``{records: [[episode_id, owner], …], reply_extra}``:
  the worker exports (and keeps what it exported) and names each record, ``owner`` its routing
  id for a session record (null otherwise); no state moves. Refused with ``invalid_phase`` by a
  worker no longer ready.
- ``send_records {export, stream, skip[, append_to]}`` → ``{count}``: the lines of the records
  export ``export`` named, but those at a position in ``skip``, as ``export_chunk`` messages of
  ``stream`` before the reply, ``count`` of them in all (sent while the store writes them;
  again for a retried write). With ``append_to`` (the coordinator's ``/proc/<pid>/fd/<n>`` entry
  of a local records file), the worker appends the lines to that file itself instead →
  ``{appended: true, count, bytes}``, or ``{appended: false}`` when it cannot open it (nothing
  appended; the coordinator then asks again without ``append_to``).
- ``install_chunk {stream, records: [line, …]}``: the next chunk of this worker's share of a
  restore, each record's line as text; kept (decoded) until ``install`` names the stream.
- ``install_share {stream, checkpoint_dir, manifest, share: [[stored id, key, position, owner | null], …]}``
  → ``{count}``: the worker reads the records file itself (verified whole, as the coordinator
  reads it) and keeps its share, decoded under each key and prepared as ``install_chunk``
  would carry it, until ``install`` names the stream. Sent instead of the chunks when every
  worker registered ``reads_store`` and the file is gymckpt's own.
- ``install {stream, count, scope, manifest, marks, routes, holding}``: install the ``count``
  records of ``stream``, all at once; ``manifest`` is ``{path, raw}`` (the stored bytes as text)
  or null, ``marks`` the fence's snapshot (the restore's marks), ``routes`` and ``holding`` as
  in the join state.
- ``routes {aliases, placements}``: replace the worker's routing tables.
- ``status {}`` → ``{report}``: the worker's readiness now (asked for a status reply while
  admission is open, when no numbered reports are taken).
- ``live_work {}`` → ``{episode_ids}``.
- ``park {episode_ids}``: the exported episodes among these (commit ``stop``).
- ``delete_restored {episode_ids}``.

Timeouts: :data:`MESSAGE_TIMEOUT_SECONDS` for the fast messages; a message that does work
bounded by a control call's deadline waits ``max(0, deadline_ts - now)`` plus
:data:`REPLY_GRACE_SECONDS` (:func:`deadline_timeout`); ``export``, ``send_records``,
``install_chunk``, ``install_share`` and ``install`` wait as long as the control plane does (its deadline ends
the caller's wait, a resume the export); an ``export_chunk`` waits
:data:`MESSAGE_TIMEOUT_SECONDS`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Final, NamedTuple

from gymckpt.control.models import (
    CommitReply,
    CommitRequest,
    ControlRequest,
    ForgetReply,
    ForgetRequest,
    PrepareReply,
    RenewReply,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    RetireReply,
    RetireRequest,
    StatusReply,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from pydantic import BaseModel

__all__ = [
    "CONTROL_OPERATIONS",
    "FROM_WORKER",
    "MESSAGE_TIMEOUT_SECONDS",
    "REPLY_GRACE_SECONDS",
    "REPORT_POLL_SECONDS",
    "TO_WORKER",
    "ControlOperation",
    "Message",
    "deadline_timeout",
]

#: the timeout of a message that does no slow work (register, report, open, mark, check_forget, live_work), in seconds
MESSAGE_TIMEOUT_SECONDS = 30.0
#: how far past a control call's own deadline its sender waits for the reply, in seconds
REPLY_GRACE_SECONDS = 10.0
#: how often a closed worker re-checks its readiness (some changes notify nobody), in seconds
REPORT_POLL_SECONDS = 0.5


class Message:
    """Every message kind (the tables above), as the plain strings the frames carry."""

    # worker → coordinator
    REGISTER: Final = "register"
    REPORT: Final = "report"
    CONTROL: Final = "control"
    CLAIM: Final = "claim"
    EXPORT_CHUNK: Final = "export_chunk"
    # coordinator → worker
    CLOSE: Final = "close"
    OPEN: Final = "open"
    MARK: Final = "mark"
    RETIRE: Final = "retire"
    CHECK_FORGET: Final = "check_forget"
    ROUTES: Final = "routes"
    STATUS: Final = "status"
    FORGET: Final = "forget"
    EXPORT: Final = "export"
    SEND_RECORDS: Final = "send_records"
    INSTALL: Final = "install"
    INSTALL_CHUNK: Final = "install_chunk"
    INSTALL_SHARE: Final = "install_share"
    LIVE_WORK: Final = "live_work"
    PARK: Final = "park"
    DELETE_RESTORED: Final = "delete_restored"


FROM_WORKER = frozenset({Message.REGISTER, Message.REPORT, Message.CONTROL, Message.CLAIM, Message.EXPORT_CHUNK})
TO_WORKER = frozenset(
    {
        Message.CLOSE,
        Message.OPEN,
        Message.MARK,
        Message.RETIRE,
        Message.CHECK_FORGET,
        Message.ROUTES,
        Message.STATUS,
        Message.FORGET,
        Message.EXPORT,
        Message.SEND_RECORDS,
        Message.INSTALL,
        Message.INSTALL_CHUNK,
        Message.INSTALL_SHARE,
        Message.LIVE_WORK,
        Message.PARK,
        Message.DELETE_RESTORED,
    }
)


class ControlOperation(NamedTuple):
    """A control route as a ``control`` message carries it: its request model (None: no body) and reply model."""

    request: type[BaseModel] | None
    reply: type[BaseModel]


#: every control route a worker forwards, by the operation name the ``control`` message carries
CONTROL_OPERATIONS: dict[str, ControlOperation] = {
    "status": ControlOperation(None, StatusReply),
    "prepare": ControlOperation(ControlRequest, PrepareReply),
    "renew": ControlOperation(ControlRequest, RenewReply),
    "commit": ControlOperation(CommitRequest, CommitReply),
    "restore": ControlOperation(RestoreRequest, RestoreReply),
    "resume": ControlOperation(ControlRequest, ResumeReply),
    "retire": ControlOperation(RetireRequest, RetireReply),
    "forget": ControlOperation(ForgetRequest, ForgetReply),
}


def deadline_timeout(deadline_ts: float | None, *, clock: Callable[[], float] = time.time) -> float:
    """How long to wait for the reply to work bounded by ``deadline_ts`` (None: a fast message's time), plus the grace."""
    if deadline_ts is None:
        return MESSAGE_TIMEOUT_SECONDS + REPLY_GRACE_SECONDS
    return max(0.0, deadline_ts - clock()) + REPLY_GRACE_SECONDS
