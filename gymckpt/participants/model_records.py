"""The records a policy model participant exports and installs: their shape, checked before anything is installed.

A record is ``{"episode_id", "rows", "generation_cuts"}``: the ledger rows of the episode's
delivered calls and at most one cut (see :mod:`gymckpt.participants.model`).
"""

from __future__ import annotations

from typing import Any

from gymckpt.errors import InvalidCheckpointState

__all__ = ["CheckedRecord", "checked_records", "is_cut", "staging_keys_of"]

#: a record that passed :func:`checked_records`: its key, its rows and its cut (None: none)
CheckedRecord = tuple[str, list[dict[str, Any]], dict[str, Any] | None]


def checked_records(records: list[dict[str, Any]], participant: str) -> list[CheckedRecord]:
    """Each record's key, rows and cut; :class:`InvalidCheckpointState` names the first malformed one."""
    checked: list[CheckedRecord] = []
    for record in records:
        key = record["episode_id"]
        rows, cuts = record.get("rows", []), record.get("generation_cuts", [])
        if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
            raise InvalidCheckpointState(
                f"model record {key!r}: rows must be a list of objects", participant=participant
            )
        if not isinstance(cuts, list) or len(cuts) > 1:
            raise InvalidCheckpointState(
                f"model record {key!r} has more than one undelivered cut", participant=participant
            )
        cut = cuts[0] if cuts else None
        if cut is not None and not is_cut(cut):
            raise InvalidCheckpointState(
                f"model record {key!r} has a malformed generation cut", participant=participant
            )
        checked.append((key, rows, cut))
    return checked


def is_cut(cut: object) -> bool:
    """Whether ``cut`` is a generation cut a replacement call can continue: its request digest and staged prefix."""
    if not isinstance(cut, dict) or not isinstance(cut.get("request_digest"), str):
        return False
    continuation = cut.get("continuation")
    return (
        isinstance(continuation, dict)
        and isinstance(continuation.get("staging_keys"), list)
        and bool(continuation["staging_keys"])
        and type(continuation.get("prefix_token_count")) is int
    )


def staging_keys_of(record: dict[str, Any]) -> list[str]:
    """The staged token-store keys a model record refers to: its rows' and its cut's, sorted."""
    keys = {row["staging_key"] for row in record.get("rows", []) if isinstance(row.get("staging_key"), str)}
    for cut in record.get("generation_cuts", []):
        keys.update(str(key) for key in cut.get("continuation", {}).get("staging_keys", []))
    return sorted(keys)
