"""The controller's control calls: one request to one server, and one operation fanned out to many.

:class:`ControlCalls` is the transport half of :class:`~gymckpt.control.coordination.Coordinator`:
its own aiohttp pool, each reply read within its route's bound and typed by its wire code, a
call resent once when the server closed its reused connection (:data:`RESENT_OPERATIONS`), and a
fan-out's failures gathered into one :class:`~gymckpt.errors.CoordinationError`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
import orjson
from opentelemetry.trace import SpanKind

from gymckpt import errors, telemetry, transport
from gymckpt.control.replies import failed, reply_error
from gymckpt.control.routes import CONTROL_PREFIX
from gymckpt.control.settings import CheckpointSettings, GymckptSettings, load_settings
from gymckpt.gc_pause import paused_gc

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from gymckpt.control.coordination_results import ParticipantInfo

__all__ = ["RESENT_OPERATIONS", "ControlCalls", "connection_failed", "encode_body", "pool_options"]

#: extra seconds a call may take past its deadline so the server's own deadline reply arrives
_REPLY_SLACK = 5.0
#: the control calls sent once more when the server closed their reused connection before replying.
#: Each answers a repeat with the same body as the first: status reads; prepare waits for the
#: first one's close; renew extends the lease to the same deadline; commit and restore return
#: the remembered result (C6); a repeated resume is a no-op reply (C7); retire marks again and
#: frees only what is left (C9); forget drops marks already dropped (its count then reads 0:
#: the count is informational, the state the same).
RESENT_OPERATIONS = frozenset({"status", "prepare", "renew", "commit", "resume", "restore", "retire", "forget"})

#: the reference stack's names of the control pool sizes: top-level keys of its global config
_REFERENCE_POOL_KEYS = {
    "global_aiohttp_control_connector_limit": "connector_limit",
    "global_aiohttp_control_connector_limit_per_host": "connector_limit_per_host",
}

T = TypeVar("T")


def encode_body(body: dict[str, Any]) -> bytes:
    """A request body, encoded once for every server of an operation."""
    return orjson.dumps(body)


def connection_failed(exc: BaseException) -> bool:
    """A failure to connect or a dropped connection (worth another try), not a silent server."""
    cause = exc.__cause__
    return isinstance(cause, aiohttp.ClientConnectionError) and not isinstance(cause, TimeoutError)


def pool_options(settings: CheckpointSettings | GymckptSettings | Mapping[str, Any]) -> dict[str, Any]:
    """Coordinator arguments from a settings object (see :meth:`~gymckpt.control.coordination.Coordinator.from_settings`)."""
    reference: dict[str, int] = {}
    if isinstance(settings, CheckpointSettings):
        block = settings
    elif isinstance(settings, GymckptSettings):
        block = settings.checkpoint
    elif isinstance(settings, Mapping):
        block = load_settings(dict(settings)).checkpoint
        for name, option in _REFERENCE_POOL_KEYS.items():
            if name in settings:
                value = settings[name]
                if type(value) is not int or value < 0:
                    raise ValueError(f"{name} must be an integer >= 0, not {value!r}")
                reference[option] = value
    else:
        raise TypeError(
            f"settings must be CheckpointSettings, GymckptSettings or a mapping, not {type(settings).__name__}"
        )
    options: dict[str, Any] = {
        "token": block.token,
        "connector_limit": block.control_connector_limit,
        "connector_limit_per_host": block.control_connector_limit_per_host,
        "storage_options": dict(block.storage_options),
    }
    for option, value in reference.items():
        name = f"control_{option}"
        if name in block.model_fields_set and getattr(block, name) != value:
            raise ValueError(f"checkpoint.{name} ({getattr(block, name)}) and its reference name disagree ({value})")
        options[option] = value
    return options


class ControlCalls:
    """Control requests to the servers: what :class:`~gymckpt.control.coordination.Coordinator` sends through."""

    servers: list[str]
    #: the participants the last discover found, by URL
    kinds: dict[str, ParticipantInfo]
    #: each operation's reply bound in bytes
    reply_limits: dict[str, int]
    _headers: dict[str, str]
    _limits: tuple[int, int]
    _session: aiohttp.ClientSession | None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            limit, per_host = self._limits
            self._session = transport.client_session(limit=limit, limit_per_host=per_host, headers=self._headers)
        return self._session

    async def close(self) -> None:
        """Close the control connection pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- one call

    def _traced(self, checkpoint_id: str) -> dict[str, Any]:
        """The attributes of a coordination operation's span: the controller, the participants."""
        return {
            "kind": "controller",
            "instance": "coordination",
            "checkpoint_id": checkpoint_id,
            "participants": len(self.kinds) or len(self.servers),
        }

    async def _call(self, url: str, op: str, body: bytes | None, *, timeout: float) -> dict[str, Any]:
        """One control request; a failure is typed by the reply's wire code (ServerCallFailed without one).

        A CLIENT span ``gym.checkpoint.coordinate.<op>.call`` whose trace context the server continues.
        """
        endpoint = f"{url}{CONTROL_PREFIX}/{op}"
        client_timeout = aiohttp.ClientTimeout(total=max(timeout, 0.1))
        with telemetry.step(f"coordinate.{op}.call", span_kind=SpanKind.CLIENT, server=url) as call:
            headers = telemetry.inject({})
            method = "GET" if body is None else "POST"
            try:
                async with transport.request(
                    self._client(),
                    method,
                    endpoint,
                    resend=op in RESENT_OPERATIONS,
                    data=body,
                    timeout=client_timeout,
                    headers=headers,
                ) as response:
                    status = response.status
                    raw = await transport.read_bounded(response, self.reply_limits[op])
            except errors.ReplyTooLarge as exc:
                exc.server = url  # type: ignore[attr-defined]
                exc.http_status = exc.downstream_status  # type: ignore[attr-defined]
                raise
            except TimeoutError as exc:
                raise failed(url, f"{op} got no reply within {timeout:.1f} s") from exc
            except aiohttp.ClientError as exc:
                raise failed(url, f"{op} failed: {exc}") from exc
            call.set(status=status)
        if status >= 400:
            raise reply_error(url, op, status, raw)
        try:
            payload = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise failed(url, f"{op} replied {status} with a body that is not JSON") from exc
        if not isinstance(payload, dict):
            raise failed(url, f"{op} replied {status} with a JSON {type(payload).__name__}, not an object")
        return payload

    async def _fan_out(
        self,
        op: str,
        urls: Iterable[str],
        encoded: bytes | Mapping[str, bytes],
        deadline_ts: float,
        parse: Callable[[str, str, dict[str, Any]], T] | None = None,
    ) -> dict[str, T]:
        """The same encoded body (or each server's own) to every server at once; then one CoordinationError for all.

        The cyclic GC of this process is paused meanwhile (:func:`~gymckpt.gc_pause.paused_gc`): a
        trainer's large heap would otherwise add a full collection to a checkpoint's control calls.
        """
        urls = list(urls)
        timeout = deadline_ts - time.time() + _REPLY_SLACK

        async def one(url: str) -> Any:
            body = encoded if isinstance(encoded, bytes) else encoded[url]
            reply = await self._call(url, op, body, timeout=timeout)
            return reply if parse is None else parse(url, op, reply)

        with paused_gc():
            outcomes = await asyncio.gather(*(one(url) for url in urls), return_exceptions=True)
        causes: dict[str, BaseException] = {}
        for url, outcome in zip(urls, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, Exception):
                    raise outcome  # a cancellation or an interrupt is no server's failure
                causes[url] = outcome
        if causes:
            raise errors.CoordinationError(op, causes)
        return dict(zip(urls, outcomes, strict=True))  # type: ignore[arg-type]
