"""The journal of an agent's calls: each call through ``ServerClient`` is a step, and its boundary.

Durable execution's replay (as Temporal and DBOS do it): an agent activation (a ``/run``, a
``/v1/responses``) is keyed by the digest of its input; every call it makes to another
server is journaled with its request digest and its reply (status, the headers that matter,
the body). The journal is the episode's boundary. After a restore the agent's own code runs
again from the same input; its calls are answered from the journal, in order, as long as
they match, and only the rest are sent. An agent that asks otherwise than its journal holds
(it is not deterministic in its replies) is :class:`~gymckpt.errors.ReplayDiverged`.

Boundaries are lazy: a :class:`JournalSnapshot` is a length into the append-only lists,
made into JSON only at export.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from typing import Any

import orjson

from gymckpt.errors import ReplayDiverged

__all__ = [
    "KEPT_HEADERS",
    "Activation",
    "Journal",
    "JournalBook",
    "JournalSnapshot",
    "RecordedResponse",
    "input_digest",
    "request_digest",
]

#: reply headers a journal keeps: cookies, the content type, gymckpt's and NeMo Gym's own
KEPT_HEADERS = ("set-cookie", "content-type")
_KEPT_PREFIXES = ("x-ng-",)


def _canonical(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)


def _without_ids(body: Any) -> Any:
    """``body`` without its ``_ng_`` fields (rollout and attempt ids: a replacement attempt's differ)."""
    if isinstance(body, dict):
        return {key: value for key, value in body.items() if not str(key).startswith("_ng_")}
    return body


def input_digest(body: Any) -> str:
    """The sha256 of an activation's input; the ``_ng_`` fields are left out."""
    return hashlib.sha256(_canonical(_without_ids(body))).hexdigest()


def request_digest(server: str, method: str, path: str, body: Any) -> str:
    """The sha256 of one call: where it goes and its JSON body (``_ng_`` fields left out)."""
    return hashlib.sha256(
        _canonical({"server": server, "method": method, "path": path, "body": _without_ids(body)})
    ).hexdigest()


@dataclass
class Activation:
    """One activation's journaled calls: ``{"request_sha256", "server", "path", "status", "headers", "body"}``."""

    input_sha256: str
    calls: list[dict[str, Any]] = field(default_factory=list)

    def as_json(self, length: int | None = None) -> dict[str, Any]:
        return {"input_sha256": self.input_sha256, "calls": self.calls[: len(self.calls) if length is None else length]}


@dataclass(frozen=True, slots=True)
class JournalSnapshot:
    """A lazy boundary: the first ``count`` activations, the last of them cut at ``last_calls``."""

    activations: list[Activation]
    count: int
    last_calls: int

    def __call__(self) -> dict[str, Any]:
        done = [activation.as_json() for activation in self.activations[: self.count - 1]]
        if self.count:
            done.append(self.activations[self.count - 1].as_json(self.last_calls))
        return {"activations": done}


class Journal:
    """One episode's journal: its activations, and where a replay of the current one stands."""

    def __init__(self, activations: list[Activation] | None = None) -> None:
        self.activations: list[Activation] = activations or []
        self.current: Activation | None = None
        #: how many of the current activation's journaled calls were answered again (a replay)
        self.position = 0

    @classmethod
    def from_boundary(cls, boundary: object) -> Journal:
        """The journal a materialised boundary holds (None: an empty one)."""
        if boundary is None:
            return cls()
        if not isinstance(boundary, dict) or not isinstance(boundary.get("activations"), list):
            raise ValueError("an agent journal boundary must be an object with an 'activations' list")
        activations = []
        for entry in boundary["activations"]:
            if not isinstance(entry, dict) or not isinstance(entry.get("calls"), list):
                raise ValueError("a journaled activation must be an object with a 'calls' list")
            activations.append(Activation(str(entry["input_sha256"]), list(entry["calls"])))
        return cls(activations)

    def begin(self, digest: str) -> None:
        """An activation of input ``digest`` starts: the journaled one of that input is replayed, else a new one."""
        for activation in reversed(self.activations):
            if activation.input_sha256 == digest:
                self.current = activation
                break
        else:
            self.current = Activation(digest)
            self.activations.append(self.current)
        self.position = 0

    def replayed(self, digest: str, server: str, path: str) -> dict[str, Any] | None:
        """The journaled reply of the next call when it is still being replayed, else None (send it)."""
        current = self.current
        if current is None or self.position >= len(current.calls):
            return None
        entry = current.calls[self.position]
        if entry.get("request_sha256") != digest:
            raise ReplayDiverged(
                f"call {self.position + 1} of the restored activation went to {server}{path}, but the journal holds "
                f"one to {entry.get('server')}{entry.get('path')} with another request there: the agent is not "
                "deterministic in its replies"
            )
        self.position += 1
        return entry

    def record(self, entry: dict[str, Any]) -> JournalSnapshot:
        """Journal a completed call of the current activation; the boundary after it."""
        current = self.current
        assert current is not None, "a call journaled outside an activation"
        current.calls.append(entry)
        self.position = len(current.calls)
        return self.snapshot()

    def snapshot(self) -> JournalSnapshot:
        count = len(self.activations)
        return JournalSnapshot(self.activations, count, len(self.activations[-1].calls) if count else 0)


class JournalBook:
    """The journals of the episodes this process serves, by capture key."""

    def __init__(self) -> None:
        self._journals: dict[str, Journal] = {}

    def open(self, key: str, restored_boundary: object | None) -> Journal:
        """The journal of ``key``: the one held, else the restored boundary's, else a new one."""
        journal = self._journals.get(key)
        if journal is None:
            journal = self._journals[key] = Journal.from_boundary(restored_boundary)
        return journal

    def drop(self, key: str) -> None:
        self._journals.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._journals

    # --- the agent session hooks (the journal is the boundary: a session has no state besides)

    async def export_agent_sessions(self, keys: list[str]) -> dict[str, Any]:
        """Every held session, with no state of its own: its journal is its boundary."""
        return {key: {} for key in keys}

    async def restore_agent_sessions(self, states: Any) -> None:
        """Nothing to install: a restored session's journal comes from its boundary when it runs."""

    async def retire_agent_session(self, key: str) -> None:
        """Forget the session's journal."""
        self.drop(key)


def entry_of(
    digest: str, server: str, path: str, status: int, headers: list[tuple[str, str]], body: bytes
) -> dict[str, Any]:
    """A journal entry: the reply kept as text (base64 when it is not UTF-8)."""
    kept = [
        [name, value]
        for name, value in headers
        if name.lower() in KEPT_HEADERS or name.lower().startswith(_KEPT_PREFIXES)
    ]
    try:
        text, encoding = body.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        text, encoding = base64.b64encode(body).decode("ascii"), "base64"
    return {
        "request_sha256": digest,
        "server": server,
        "path": path,
        "status": status,
        "headers": kept,
        "body": text,
        "body_encoding": encoding,
    }


class _Content:
    def __init__(self, body: bytes) -> None:
        self._body = body

    async def read(self, n: int = -1) -> bytes:
        return self._body


class RecordedResponse:
    """What NeMo Gym's code reads of an aiohttp ``ClientResponse``, from a reply already read whole.

    ``status``, ``ok``, ``headers``, ``cookies``, ``read()``, ``text()``, ``json()``,
    ``content.read()``, ``raise_for_status()`` (with NeMo Gym's ``response_content``),
    ``release()``: a journaled reply answers the same as the call it stands for.
    """

    def __init__(self, url: str, method: str, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        from multidict import CIMultiDict, CIMultiDictProxy

        self.url = url
        self.method = method
        self.status = status
        self.reason = ""
        self.headers = CIMultiDictProxy(CIMultiDict(headers))
        self._body = body
        self.content = _Content(body)
        self.cookies: SimpleCookie = SimpleCookie()
        for name, value in headers:
            if name.lower() == "set-cookie":
                self.cookies.load(value)

    @classmethod
    def from_entry(cls, url: str, method: str, entry: dict[str, Any]) -> RecordedResponse:
        body = entry.get("body") or ""
        raw = base64.b64decode(body) if entry.get("body_encoding") == "base64" else str(body).encode("utf-8")
        headers = [(str(name), str(value)) for name, value in entry.get("headers") or []]
        return cls(url, method, int(entry["status"]), headers, raw)

    @property
    def ok(self) -> bool:
        return self.status < 400

    @property
    def request_info(self) -> Any:
        from aiohttp import RequestInfo
        from multidict import CIMultiDict, CIMultiDictProxy
        from yarl import URL

        return RequestInfo(URL(self.url), self.method, CIMultiDictProxy(CIMultiDict()), URL(self.url))

    async def read(self) -> bytes:
        return self._body

    async def text(self, encoding: str = "utf-8") -> str:
        return self._body.decode(encoding)

    async def json(self, **_: Any) -> Any:
        return orjson.loads(self._body)

    def raise_for_status(self) -> None:
        if self.ok:
            return
        from aiohttp import ClientResponseError

        error = ClientResponseError(
            self.request_info, (), status=self.status, message=self.reason, headers=self.headers
        )
        error.response_content = self._body  # type: ignore[attr-defined]  # NeMo Gym's raise_for_status sets it
        raise error

    def release(self) -> None:
        """Nothing to release: the reply was read whole."""

    def close(self) -> None:
        """Nothing to close."""
