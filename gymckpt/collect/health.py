"""What makes a collection fail loudly: its checkpoint directory checked first, failures said short, a verdict.

- :func:`check_checkpoint_dir`: before the first row is sent, the ``--checkpoint-dir`` is
  checked against every server's ``allowed_roots`` (its status lists them, each resolved by
  the server) with the servers' own rule, :func:`~gymckpt.control.allowed_roots.check_allowed`;
  a refusal is one line naming the setting, the option and the servers grouped by their roots.
  A server whose status does not list them (a reference server) is skipped: its refusal comes
  at the first checkpoint.
- :func:`failure_line`, :func:`not_prepared_line`: a failed checkpoint as one short line (the
  operation, the wire code and status, the first cause cut short, the servers as a count and
  their kinds).
- :func:`checkpoint_shortfall`: whether too few of the checkpoints asked for were published
  (then ``gymckpt collect`` exits with status 3).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gymckpt.control.allowed_roots import check_allowed
from gymckpt.control.models import Phase
from gymckpt.errors import CheckpointDirNotAllowed, CoordinationError

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from gymckpt.control.coordination import ParticipantInfo, PrepareResult

__all__ = [
    "DEFAULT_MIN_CHECKPOINT_SUCCESS",
    "check_checkpoint_dir",
    "checkpoint_shortfall",
    "failure_line",
    "not_prepared_line",
]

#: the default of ``--min-checkpoint-success``: at least half the checkpoints asked for are published
DEFAULT_MIN_CHECKPOINT_SUCCESS = 0.5
#: how much of a failure's first cause its line keeps (a server's detail can run to kilobytes)
CAUSE_CHARACTERS = 160


def check_checkpoint_dir(participants: Iterable[ParticipantInfo], checkpoint_dir: str) -> list[str]:
    """Refuse ``checkpoint_dir`` if a server would (:class:`~gymckpt.errors.CheckpointDirNotAllowed`, one line).

    The check is the servers' own (:func:`~gymckpt.control.allowed_roots.check_allowed`),
    run here against the roots each server's status lists; a local path is resolved on
    this machine, as the servers resolve it on theirs (the same path on a shared
    filesystem). Returns the URLs of the servers that list no roots (not checked).
    """
    unchecked: list[str] = []
    refused: dict[tuple[str, ...] | None, list[str]] = {}
    for info in participants:
        if not info.roots_reported:
            unchecked.append(info.url)
            continue
        try:
            check_allowed(checkpoint_dir, None if info.allowed_roots is None else list(info.allowed_roots))
        except CheckpointDirNotAllowed:
            refused.setdefault(info.allowed_roots, []).append(info.url)
    if refused:
        groups = "; ".join(
            f"{_servers(urls)} {'allows' if len(urls) == 1 else 'allow'} {_roots(roots)}"
            for roots, urls in refused.items()
        )
        raise CheckpointDirNotAllowed(
            f"--checkpoint-dir {checkpoint_dir} is outside the servers' checkpoint.allowed_roots: {groups}. "
            "Choose a --checkpoint-dir below them, or add it to checkpoint.allowed_roots in the servers' settings"
        )
    return unchecked


def _servers(urls: list[str]) -> str:
    return urls[0] if len(urls) == 1 else f"{len(urls)} servers ({', '.join(urls)})"


def _roots(roots: tuple[str, ...] | None) -> str:
    if roots is None:  # refused for its scheme alone
        return "local paths and file:// or s3:// URLs only (checkpoint.allowed_roots unset)"
    return ", ".join(roots)


def failure_line(checkpoint_id: str, exc: BaseException, kinds: Mapping[str, str]) -> str:
    """``checkpoint <id> failed: commit on 4 servers (environment, model…): 403 <code>: <first cause…>``.

    ``kinds`` maps a server's URL to its kind. The URLs themselves are left out (the summary
    of the discover named them): only their count and kinds, and for each distinct cause
    past the first, only a count.
    """
    if not isinstance(exc, CoordinationError) or not exc.causes:
        return f"checkpoint {checkpoint_id} failed: {_cut(_first_line(str(exc) or type(exc).__name__))}"
    grouped: dict[str, list[str]] = {}
    for server, cause in exc.causes.items():
        grouped.setdefault(_cause_text(server, cause), []).append(server)
    (text, servers), *others = sorted(grouped.items(), key=lambda item: -len(item[1]))
    named = sorted({kinds.get(server, "?") for server in servers}, key=_kind_rank)
    where = f"{len(servers)} server{'s' if len(servers) != 1 else ''} ({', '.join(named)})"
    more = f" (and {len(others)} other cause{'s' if len(others) != 1 else ''})" if others else ""
    return f"checkpoint {checkpoint_id} failed: {exc.operation} on {where}: {text}{more}"


def not_prepared_line(checkpoint_id: str, prepared: PrepareResult) -> str:
    """A checkpoint whose prepare did not finish in time, as one line: the stage, and how many rows blocked it."""
    waiting = [reply.report.blocker_count for reply in prepared.replies.values() if reply.phase != Phase.PREPARED]
    return (
        f"checkpoint {checkpoint_id} failed: prepare: the {prepared.stopped_at or '?'} servers were not ready "
        f"before the deadline ({sum(waiting)} blocking rows on {len(waiting)} server{'s' if len(waiting) != 1 else ''})"
    )


def _kind_rank(kind: str) -> tuple[int, str]:
    order = ("environment", "model", "agent", "resources")
    return (order.index(kind) if kind in order else len(order), kind)


def _cause_text(server: str, cause: BaseException) -> str:
    """``403 checkpoint_dir_not_allowed: <detail cut short>``, the server's own address left out."""
    text = _first_line(str(cause) or type(cause).__name__).removeprefix(f"{server}: ")
    code, status = getattr(cause, "wire_code", None), getattr(cause, "http_status", None)
    if code:
        _, found, detail = text.partition(f" {code}: ")  # "<operation> answered <status> <code>: <detail>"
        text = f"{status} {code}: {detail}" if found else f"{code}: {text}"
    return _cut(text.replace(server, "<server>"))


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _cut(text: str) -> str:
    """At most :data:`CAUSE_CHARACTERS`: the head and the tail (where an OS error says why), the middle elided."""
    if len(text) <= CAUSE_CHARACTERS:
        return text
    head = CAUSE_CHARACTERS * 2 // 5
    return f"{text[:head]}…{text[head - CAUSE_CHARACTERS + 1 :]}"


def checkpoint_shortfall(taken: int, failed: int, min_success: float) -> str | None:
    """Why the checkpoints fell short, or None: none was published, or fewer than ``min_success`` of them.

    Only checkpoints that were attempted count (``taken + failed``); with none attempted
    there is no verdict. ``min_success`` is a fraction in [0, 1]; at least one checkpoint
    must be published whatever it is.
    """
    attempted = taken + failed
    if attempted == 0:
        return None
    if taken == 0:
        return f"none of the {attempted} checkpoints attempted was published"
    if taken < min_success * attempted:
        return (
            f"{taken} of {attempted} checkpoints attempted were published, fewer than "
            f"--min-checkpoint-success {min_success:g} of them"
        )
    return None
