"""The policy model server's client of the inference backend's generation cuts (its control routes)."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from gymckpt import transport
from gymckpt.errors import DownstreamError
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


class GenerationCutClient:
    """Asks the inference backend to cut undelivered generations (``POST /ng-control/v1/generation-cut``).

    On a connection pool of its own, so a cut is never queued behind the very generations it
    cuts. The receipt is checked: the inventory echoed and every ticket acknowledged once.
    A cut or release whose reused connection the backend closed before replying is sent once
    more (:func:`gymckpt.transport.request`): both are idempotent for one checkpoint id (a
    repeated cut stages the same frozen prefixes again and is checked like the first; a
    repeated release finds nothing left frozen).
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
        async with transport.request(
            self._client(), "POST", self.url, resend=True, data=orjson.dumps(body), headers=self._headers()
        ) as response:
            raw = await transport.read_bounded(response, transport.data_reply_limit())
            if response.status >= 400:
                raise DownstreamError.answered(self.url, response.status, raw)
        receipt = _read_receipt(raw)
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
