"""The model server's generation-cut client against a real inference backend on loopback."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import pytest

from gymckpt import transport
from gymckpt.errors import DownstreamError, ReplyTooLarge
from gymckpt.servers import model_cut_client
from gymckpt.servers.inference import InferenceConfig, build_inference_app
from gymckpt.servers.model_cut_client import GenerationCutClient
from gymckpt.testing.net import refused_url, serve


def _prefix(number: int) -> dict[str, Any]:
    return {
        "ticket_id": uuid.uuid4().hex,
        "rollout_id": f"r{number}",
        "attempt": 0,
        "model_call_id": f"r{number}-a0:0",
        "admitted_at": 1_700_000_000.5,
    }


def _cut(url: str, prefixes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    async def main() -> dict[str, dict[str, Any]]:
        client = GenerationCutClient(url, "", server_name="policy")
        try:
            return await asyncio.wait_for(client.cut("ck-1", prefixes), 30)
        finally:
            await client.close()

    return asyncio.run(main())


def test_a_cut_reads_and_checks_its_receipt_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    readers: list[int] = []
    read = model_cut_client._read_receipt

    def noted(raw: bytes) -> Any:
        readers.append(threading.get_ident())
        return read(raw)

    monkeypatch.setattr(model_cut_client, "_read_receipt", noted)
    prefixes = [_prefix(number) for number in range(50)]
    with serve(build_inference_app(InferenceConfig())) as url:
        acks = _cut(url, prefixes)
    # every ticket answered once (no generation decodes here: each a durable failure)
    assert sorted(acks) == sorted(prefix["ticket_id"] for prefix in prefixes)
    assert {ack["disposition"] for ack in acks.values()} == {"durable_failure"}
    assert len(readers) == 1 and readers[0] != threading.get_ident()  # not the thread of the loop that awaited it


def test_a_receipt_over_the_reply_bound_fails_the_cut_naming_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(transport.REPLY_LIMIT_ENV, "1000")
    with (
        serve(build_inference_app(InferenceConfig())) as url,
        pytest.raises(ReplyTooLarge, match="bound of 1000") as refused,
    ):
        _cut(url, [_prefix(number) for number in range(20)])
    assert (refused.value.limit, refused.value.downstream_status) == (1000, 200)  # typed as every bounded reply


def test_a_backend_that_is_not_there_fails_the_cut_as_no_reply() -> None:
    with refused_url() as url, pytest.raises(DownstreamError, match="gave no reply") as failure:
        _cut(url, [_prefix(1)])
    assert failure.value.downstream_status == 0
