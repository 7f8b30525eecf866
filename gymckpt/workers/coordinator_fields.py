"""The coordinator's pure helpers: merged commit reply extras, session ids as placement sees them,
manifest fields and reply fields of the workers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gymckpt.errors import InvalidCheckpointState
from gymckpt.workers.placement import is_routing_id

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gymckpt.store.manifest import Manifest

__all__ = [
    "manifest_body",
    "merged_reply_extra",
    "owner_aliases",
    "string_list",
    "with_session_id",
    "without_session_id",
]


def merged_reply_extra(replies: Mapping[int, Any]) -> dict[str, Any]:
    """Every worker's ``reply_extra`` merged: lists joined (strings: sorted, once each), maps merged key by
    key the same way (``staging_keys_by_episode``), any other field the first worker's."""
    merged: dict[str, Any] = {}
    for index in sorted(replies):
        extra = replies[index].get("reply_extra") if isinstance(replies[index], dict) else None
        for name, value in (extra if isinstance(extra, dict) else {}).items():
            merged[name] = _merge_value(merged[name], value) if name in merged else value
    return {name: _tidy(value) for name, value in merged.items()}


def _merge_value(old: Any, new: Any) -> Any:
    if isinstance(old, list) and isinstance(new, list):
        return [*old, *new]
    if isinstance(old, dict) and isinstance(new, dict):
        return {**old, **{key: _merge_value(old[key], value) if key in old else value for key, value in new.items()}}
    return old


def _tidy(value: Any) -> Any:
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return sorted(set(value))
    if isinstance(value, dict):
        return {key: _tidy(item) for key, item in sorted(value.items())}
    return value


def with_session_id(record: dict[str, Any]) -> dict[str, Any]:
    """A session record as placement groups it: gymckpt's sessions are keyed by their capture key."""
    if record.get("owner") is None and "session_id" not in record:
        return {**record, "session_id": record["episode_id"]}
    return record


def without_session_id(record: dict[str, Any]) -> dict[str, Any]:
    if record.get("session_id") == record.get("episode_id"):
        return {name: value for name, value in record.items() if name != "session_id"}
    return record


def owner_aliases(value: object) -> dict[str, str]:
    """The manifest's ``owner_aliases``: routing id pairs only (anything else is ignored, never routed)."""
    if not isinstance(value, dict):
        return {}
    return {old: new for old, new in value.items() if is_routing_id(old) and is_routing_id(new)}


def string_list(reply: object, name: str, who: str) -> list[str]:
    values = reply.get(name) if isinstance(reply, dict) else None
    if not isinstance(values, list) or not all(isinstance(value, str) for value in values):
        raise InvalidCheckpointState(f"{who} replied without a list of strings {name!r}")
    return values


def manifest_body(manifest: Manifest | None) -> dict[str, str] | None:
    """The manifest as its stored bytes (a worker parses them again), or None."""
    if manifest is None or not manifest.raw:
        return None
    try:
        return {"path": manifest.path, "raw": manifest.raw.decode("utf-8")}
    except UnicodeDecodeError:
        return None
