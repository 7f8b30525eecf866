"""What a controller reads back from the control routes: replies in gymckpt's shape or the reference's.

A reply that does not fit its model, and every non-2xx reply, becomes a typed error
carrying ``server``, ``wire_code`` (None without an ``{"error": {"code"}}`` envelope) and
``http_status``: the class of its wire code, :class:`~gymckpt.errors.InvalidRequest` for
FastAPI's bare ``{"detail": [...]}`` 422, :class:`~gymckpt.errors.ServerCallFailed` otherwise.

Every reply is read within its route's bound (:data:`CONTROL_REPLY_LIMITS`, read by
:func:`gymckpt.transport.read_bounded`); a longer one fails that server's call with
:class:`~gymckpt.errors.ReplyTooLarge`. The bounds are sized for :data:`REPLY_EPISODES`
episodes of the longest ids, from what each route lists per episode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import orjson
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, model_validator

from gymckpt import errors
from gymckpt.identity import MAX_ROLLOUT_ID_LENGTH, episode_key
from gymckpt.store.layout import MANIFEST_NAME, MAX_MANIFEST_BYTES

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "COMMIT_EPISODE_BYTES",
    "CONTROL_REPLY_LIMITS",
    "EPISODE_BYTES",
    "REPLY_BASE_BYTES",
    "REPLY_EPISODES",
    "ParticipantCommit",
    "ParticipantRestore",
    "ReplyKey",
    "counter",
    "failed",
    "parser",
    "reply_error",
]

#: the episodes a control reply's bound is sized for: twice the 16,384 rollouts a trainer keeps in flight
REPLY_EPISODES = 32_768
#: one episode in one list of a reply: the longest capture key (MAX_ROLLOUT_ID_LENGTH + 11 characters)
#: quoted, with its comma, or the reference's ``{"rollout_id", "attempt"}`` object of it
EPISODE_BYTES = MAX_ROLLOUT_ID_LENGTH + 64
#: a reply's fixed part: its other fields, a report's counts, a participant's small extras, an error's detail
REPLY_BASE_BYTES = 1 << 20
#: an episode's share of a commit reply besides the manifest: its key in ``episode_ids`` and in
#: ``staging_keys_by_episode``, and its model records' staged keys, listed there and in ``staging_keys``
COMMIT_EPISODE_BYTES = 4096


def _lists(count: int) -> int:
    """A reply's fixed part and ``count`` lists that may name every episode (restarts are never capped)."""
    return REPLY_BASE_BYTES + count * REPLY_EPISODES * EPISODE_BYTES


#: each control route's reply bound in bytes, from the lists it may carry
CONTROL_REPLY_LIMITS: dict[str, int] = {
    # report.restarts, report.blockers (at most 100), restored_pending, restored_generation_cuts
    "status": _lists(4),
    # report.restarts, report.blockers
    "prepare": _lists(2),
    "renew": REPLY_BASE_BYTES,
    "resume": REPLY_BASE_BYTES,
    # the manifest object (as the store bounds a manifest), then every episode's own share
    "commit": REPLY_BASE_BYTES + MAX_MANIFEST_BYTES + REPLY_EPISODES * COMMIT_EPISODE_BYTES,
    # restored
    "restore": _lists(1),
    # retired
    "retire": _lists(1),
    # forgotten (rollout ids)
    "forget": _lists(1),
}


def _reply_key(value: object) -> object:
    """A key in a reply: servers send capture keys; an object is read as one too."""
    return episode_key(value) if isinstance(value, dict) else value


ReplyKey = Annotated[str, BeforeValidator(_reply_key)]


class _Reply(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


#: the manifest fields a commit reply takes from its manifest when it does not carry them itself (and that
#: a flat reply, gymckpt's before its wire-conformance work, carried instead of the manifest object)
_MANIFEST_FIELDS = ("kind", "instance", "checkpoint_id", "records_file", "record_count", "records_bytes")


class ParticipantCommit(_Reply):
    """One participant's commit reply, in gymckpt's shape or the reference's.

    The reference sends ``{phase, manifest, episode_ids}`` (plus participant extras such
    as the model's ``staging_keys``, kept as extra fields); gymckpt adds ``kind``,
    ``instance``, ``manifest_path``, ``manifest_sha256``, ``records_bytes`` and more. What a
    reply lacks is taken from its manifest; ``manifest_path`` defaults to the layout's
    ``gym/<kind>/<instance>/manifest.json``. ``manifest_sha256`` and ``records_bytes`` are
    None when neither the reply nor its manifest carries them.
    """

    phase: str
    manifest: dict[str, Any]
    episode_ids: list[ReplyKey]
    kind: str
    instance: str
    checkpoint_id: str
    records_file: str
    record_count: int
    records_bytes: int | None = None
    manifest_path: str
    manifest_sha256: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _fill_from_manifest(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        manifest = data.get("manifest")
        if isinstance(manifest, str):  # the flat shape: ``manifest`` was the manifest's path
            data.setdefault("manifest_path", manifest)
            manifest = data["manifest"] = {name: data[name] for name in _MANIFEST_FIELDS if name in data}
        if isinstance(manifest, dict):
            for name in _MANIFEST_FIELDS:
                if name not in data and name in manifest:
                    data[name] = manifest[name]
            if (
                "manifest_path" not in data
                and isinstance(data.get("kind"), str)
                and isinstance(data.get("instance"), str)
            ):
                data["manifest_path"] = f"gym/{data['kind']}/{data['instance']}/{MANIFEST_NAME}"
        return data


class ParticipantRestore(_Reply):
    """One participant's restore reply: the checkpoint it read, and the attempts it installed (capture keys)."""

    phase: str
    source_checkpoint_id: str
    restored: list[ReplyKey]


def parser(model: type[BaseModel]) -> Callable[[str, str, dict[str, Any]], Any]:
    """Validate a reply as ``model``; a reply that does not fit is that server's failure."""

    def parse(url: str, operation: str, reply: dict[str, Any]) -> Any:
        try:
            return model.model_validate(reply)
        except ValidationError as exc:
            raise failed(url, f"{operation} reply does not fit {model.__name__}: {exc}") from exc

    return parse


def counter(count_field: str, list_field: str) -> Callable[[str, str, dict[str, Any]], int]:
    """Read ``{count_field: n}`` (gymckpt, the design texts) or ``{list_field: [...]}`` (reference code)."""

    def parse(url: str, operation: str, reply: dict[str, Any]) -> int:
        count = reply.get(count_field)
        if type(count) is int:
            return count
        listed = reply.get(list_field)
        if isinstance(listed, list):
            return len(listed)
        raise failed(url, f"{operation} reply has neither {count_field} nor {list_field}: {reply!r:.200}")

    return parse


def failed(url: str, detail: str) -> errors.ServerCallFailed:
    failure = errors.ServerCallFailed(f"{url}: {detail}")
    failure.server = url  # type: ignore[attr-defined]
    failure.wire_code = None  # type: ignore[attr-defined]
    failure.http_status = None  # type: ignore[attr-defined]
    return failure


def reply_error(url: str, operation: str, status: int, raw: bytes) -> errors.GymckptError:
    """The typed error of a non-2xx reply: by its wire code, or FastAPI's bare 422 as InvalidRequest."""
    try:
        payload: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        payload = None
    envelope = payload.get("error") if isinstance(payload, dict) else None
    code: str | None = None
    if isinstance(envelope, dict) and "code" in envelope:
        code = str(envelope["code"])
        cls = errors.error_for_code(code) or errors.ServerCallFailed
        detail = str(envelope.get("detail", ""))
    elif status == 422 and isinstance(payload, dict) and "detail" in payload:
        # FastAPI's own validation reply (a reference server's): no envelope, the status says it
        cls = errors.InvalidRequest
        detail = orjson.dumps(payload["detail"]).decode()[:500]
    else:
        cls = errors.ServerCallFailed
        detail = repr(raw[:200]) if payload is None else orjson.dumps(payload).decode()[:200]
    raised = cls(f"{url}: {operation} answered {status}{f' {code}' if code else ''}: {detail}")
    raised.server = url  # type: ignore[attr-defined]
    raised.wire_code = code  # type: ignore[attr-defined]
    raised.http_status = status  # type: ignore[attr-defined]
    return raised
