"""The policy model server's client of the inference backend's generation cuts (its control routes)."""

from __future__ import annotations

import asyncio
import http.client
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from gymckpt import transport
from gymckpt.errors import DownstreamError, ReplyTooLarge
from gymckpt.servers.base import server_workers
from gymckpt.servers.inference_wire import GENERATION_CUT_ROUTE, inventory_digest
from gymckpt.servers.json_body import parse_json

__all__ = ["GenerationCutClient"]


def _read_receipt(raw: bytes) -> Any:
    """A cut receipt (megabytes for thousands of calls; numbers only of the backend's own making): orjson,
    the standard library for anything orjson refuses."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return parse_json(raw)


#: how long the cut's own connection may wait for a byte, in seconds (a caller's deadline stops waiting for the
#: thread sooner; the thread then ends with its socket)
CUT_SOCKET_SECONDS = 60.0


def _post_blocking(url: str, body: bytes, headers: dict[str, str], limit: int, seconds: float) -> tuple[int, bytes]:
    """POST ``body`` on a connection of its own, in the calling thread; the status and the reply (at most ``limit``
    bytes, else :class:`~gymckpt.errors.ReplyTooLarge`, as :func:`gymckpt.transport.read_bounded` refuses one)."""
    parts = urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname or "", parts.port, timeout=seconds)
    try:
        connection.request("POST", parts.path or "/", body=body, headers=headers)
        response = connection.getresponse()
        length = response.getheader("Content-Length")
        said = int(length) if length is not None and length.isdigit() else 0
        raw = b"" if said > limit else response.read(limit + 1)  # Content-Length alone may refuse it
        if said > limit or len(raw) > limit:
            raise ReplyTooLarge(
                f"{url} answered {response.status} with more than the bound of {limit} bytes",
                url=url,
                downstream_status=response.status,
                limit=limit,
                received=len(raw),
            )
        return response.status, raw
    except (OSError, http.client.HTTPException) as exc:
        raise DownstreamError(f"{url} gave no reply: {type(exc).__name__}: {exc}", url=url) from exc
    finally:
        connection.close()


class GenerationCutClient:
    """Asks the inference backend to cut undelivered generations (``POST /ng-control/v1/generation-cut``).

    Never queued behind the very generations it cuts: a cut is sent and its receipt read and
    checked in a thread, on a new connection of its own (so never a stale one), and the event
    loop only waits for the result. At 9,000 calls the receipt is about 10 MB: read by a
    saturated event loop, a loop turn per piece, it took most of the cut's time. The receipt
    is checked: the inventory echoed and every ticket acknowledged once. A release goes on a
    pool of its own and is sent once more when its reused connection was closed before the
    reply (:func:`gymckpt.transport.request`): a repeated release finds nothing left frozen.
    """

    def __init__(self, inference_url: str, token: str, *, server_name: str) -> None:
        self.url = inference_url.rstrip("/") + GENERATION_CUT_ROUTE
        self.token = token
        self.server_name = server_name
        self._session: aiohttp.ClientSession | None = None

    async def cut(self, checkpoint_id: str, prefixes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """``{ticket_id: ack}`` for ``prefixes``; raises when the backend fails or its receipt does not match."""
        ordered = sorted(prefixes, key=lambda prefix: prefix["ticket_id"])
        body = {
            "checkpoint_id": checkpoint_id,
            "server_name": self.server_name,
            "active_prefixes": ordered,
            "inventory_digest": inventory_digest(checkpoint_id, self.server_name, ordered),
        }
        # in a thread, on a connection of its own: a receipt of megabytes read by this server's event loop
        # takes a loop turn per piece, and at a checkpoint that loop is the busiest of the stack
        return await asyncio.to_thread(self._cut_blocking, body, ordered, CUT_SOCKET_SECONDS)

    def _cut_blocking(self, body: dict[str, Any], ordered: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
        status, raw = _post_blocking(
            self.url, orjson.dumps(body), self._headers(), transport.data_reply_limit(), seconds
        )
        if status >= 400:
            raise DownstreamError.answered(self.url, status, raw)
        receipt = _read_receipt(raw)
        del raw
        if not isinstance(receipt, dict) or receipt.get("inventory_digest") != body["inventory_digest"]:
            raise DownstreamError(f"{self.url} answered a receipt for another inventory")
        acks = receipt.get("prefixes")
        tickets = [ack.get("ticket_id") for ack in acks] if isinstance(acks, list) else None
        if tickets is None or sorted(tickets) != [prefix["ticket_id"] for prefix in ordered]:
            raise DownstreamError(f"{self.url} did not acknowledge every ticket exactly once")
        return {ack["ticket_id"]: ack for ack in acks}

    async def release(self, checkpoint_id: str) -> None:
        """The checkpoint resumed: the generations it cut decode on."""
        async with transport.request(
            self._client(),
            "POST",
            self.url + "/release",
            resend=True,
            json={"checkpoint_id": checkpoint_id},
            headers=self._headers(),
        ) as response:
            raw = await transport.read_bounded(response, transport.data_reply_limit())
            if response.status >= 400:
                raise DownstreamError.answered(self.url + "/release", response.status, raw)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            bound = transport.downstream_pool_limit(workers=server_workers())
            self._session = transport.client_session(
                limit=bound, limit_per_host=bound, timeout=aiohttp.ClientTimeout(total=None)
            )
        return self._session

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
