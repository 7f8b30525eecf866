"""What a controller reads back from the control routes: replies in gymckpt's shape or the reference's.

A reply that does not fit its model, and every non-2xx reply, becomes a typed error
carrying ``server``, ``wire_code`` (None without an ``{"error": {"code"}}`` envelope) and
``http_status``: the class of its wire code, :class:`~gymckpt.errors.InvalidRequest` for
FastAPI's bare ``{"detail": [...]}`` 422, :class:`~gymckpt.errors.ServerCallFailed` otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import orjson
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, model_validator

from gymckpt import errors
from gymckpt.identity import episode_key
from gymckpt.store.layout import MANIFEST_NAME

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["ParticipantCommit", "ParticipantRestore", "ReplyKey", "counter", "failed", "parser", "reply_error"]


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
