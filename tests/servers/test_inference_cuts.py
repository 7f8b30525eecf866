"""The fake inference backend's generation-cut contract: token store, cut route, continuation, auth."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from gymckpt.servers.inference import (
    GENERATION_CUT_ROUTE,
    GENERATION_CUT_SCHEMA_VERSION,
    MAX_CUT_PREFIXES,
    GenerationCutInventory,
    InferenceBackend,
    InferenceConfig,
    build_inference_app,
    generate_tokens,
    inventory_digest,
    prefix_digest,
)

from .model_support import TIMEOUT, bounded, run

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

STAGING = "/ng-control/v1/staging"
STAGING_DELETE = "/ng-control/v1/staging/delete"
DECODING = "/ng-control/v1/decoding"
SEED, PROMPT = 7, "hello"
#: long enough that a generation held mid-way by pause() cannot finish before its cut
N = 40


@asynccontextmanager
async def _backend(
    token_delay_seconds: float = 0.002, **config: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, InferenceBackend]]:
    app = build_inference_app(InferenceConfig(token_delay_seconds=token_delay_seconds, **config))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://inference", timeout=TIMEOUT) as client:
        yield client, app.state.backend
    app.state.backend.resume()


def _body(call_id: str, *, prompt: str = PROMPT, seed: int = SEED, max_tokens: int = N, **extra: Any) -> dict[str, Any]:
    return {"call_id": call_id, "prompt": prompt, "seed": seed, "max_tokens": max_tokens, **extra}


def _prefix(model_call_id: str, rollout_id: str = "r", attempt: int = 0) -> dict[str, Any]:
    return {
        "ticket_id": uuid.uuid4().hex,
        "rollout_id": rollout_id,
        "attempt": attempt,
        "model_call_id": model_call_id,
        "admitted_at": 1_700_000_000.25,
    }


def _inventory(prefixes: list[dict[str, Any]], checkpoint_id: str = "ck-1", server_name: str = "policy") -> dict:
    return {
        "checkpoint_id": checkpoint_id,
        "server_name": server_name,
        "active_prefixes": prefixes,
        "inventory_digest": inventory_digest(checkpoint_id, server_name, prefixes),
    }


async def _cut(client: httpx.AsyncClient, *prefixes: dict[str, Any], **headers: str) -> dict[str, Any]:
    reply = await client.post(GENERATION_CUT_ROUTE, json=_inventory(list(prefixes)), headers=headers)
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


def _continuation(ack: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """The ``ng_capture`` a replacement call carries to continue ``ack``'s cut."""
    cut = {
        "schema_version": GENERATION_CUT_SCHEMA_VERSION,
        "source_capture_key": f"{ack['rollout_id']}-a{ack['attempt']}",
        "source_model_call_id": ack["model_call_id"],
        "staging_keys": ack["staging_keys"],
        "prefix_token_count": ack["prefix_token_count"],
        "prefix_digest": ack["prefix_digest"],
        "effective_output_limit": ack["effective_output_limit"],
        "terminal_finish_reason": ack["terminal_finish_reason"],
        "terminal_stop_reason": ack["terminal_stop_reason"],
        **changes,
    }
    return {"rollout_id": ack["rollout_id"], "mode": "text", "generation_cut": cut}


async def _decoding(backend: InferenceBackend, call_id: str, at_least: int) -> None:
    await backend.wait_until(lambda: (backend.progress(call_id) or 0) >= at_least, timeout=TIMEOUT)


def test_a_cut_mid_generation_then_a_continuation_gives_the_uncut_tokens() -> None:
    async def main() -> None:
        async with _backend() as (client, backend):
            original = asyncio.create_task(client.post("/generate", json=_body("r-a0:0")))
            await _decoding(backend, "r-a0:0", 3)
            backend.pause()
            receipt = await _cut(client, _prefix("r-a0:0"))
            [ack] = receipt["prefixes"]
            k = ack["prefix_token_count"]
            key = "__generation_cut__/r/r-a0:0"
            assert 3 <= k < N
            assert ack["disposition"] == "durable_prefix"
            assert ack["cut_kind"] == "active_prefix"
            assert ack["staging_keys"] == [key]
            assert ack["prefix_digest"] == prefix_digest(generate_tokens(SEED, PROMPT, k))
            assert ack["effective_output_limit"] == N - k
            assert ack["terminal_finish_reason"] is None and ack["terminal_stop_reason"] is None
            assert len(ack["frozen_buffer_id"]) == 32 and int(ack["frozen_buffer_id"], 16) >= 0
            staged = backend.staged[key]
            assert list(staged.tokens) == generate_tokens(SEED, PROMPT, k)
            assert not staged.complete
            assert (staged.seed, staged.max_tokens) == (SEED, N)
            assert staged.prompt_sha256 == hashlib.sha256(PROMPT.encode()).hexdigest()
            assert backend.progress("r-a0:0") is not None  # frozen at the cut, not gone
            backend.resume()
            released = await client.post(GENERATION_CUT_ROUTE + "/release", json={"checkpoint_id": "ck-1"})
            assert released.json() == {"released": 1}  # the checkpoint resumed: it decodes on
            first = (await bounded(original)).json()
            assert first["tokens"] == generate_tokens(SEED, PROMPT, N)
            assert (first["generated"], first["continued_from"]) == (N, 0)
            assert first["staging_key"] == "__calls__/r-a0:0"

            body = _body("r-a1:0", ng_capture=_continuation(ack))
            reply = await bounded(client.post("/generate", json=body))
            assert reply.status_code == 200, reply.text
            second = reply.json()
            assert second["tokens"] == generate_tokens(SEED, PROMPT, N) == first["tokens"]
            assert second["text"] == first["text"]
            assert (second["generated"], second["continued_from"]) == (N - k, k)
            assert second["staging_key"] == "__calls__/r-a1:0"
            log = (await client.get("/calls")).json()
            assert [(c["call_id"], c["generated"], c["continued_from"]) for c in log] == [
                ("r-a0:0", N, 0),
                ("r-a1:0", N - k, k),
            ]
            assert log[1]["tokens"] == first["tokens"]
            assert log[1]["staging_key"] == "__calls__/r-a1:0"
            assert backend.staged["__calls__/r-a1:0"].complete

    run(main)


def test_a_cut_generation_is_frozen_until_released_and_a_later_cut_is_longer() -> None:
    async def main() -> None:
        async with _backend() as (client, backend):
            original = asyncio.create_task(client.post("/generate", json=_body("r-a0:0")))
            await _decoding(backend, "r-a0:0", 2)
            backend.pause()
            first = (await _cut(client, _prefix("r-a0:0")))["prefixes"][0]
            backend.resume()
            other = await client.post(GENERATION_CUT_ROUTE + "/release", json={"checkpoint_id": "another"})
            assert other.json() == {"released": 0}  # only the cut's own checkpoint releases it
            assert backend.progress("r-a0:0") == first["prefix_token_count"]
            released = await client.post(GENERATION_CUT_ROUTE + "/release", json={"checkpoint_id": "ck-1"})
            assert released.json() == {"released": 1}
            await _decoding(backend, "r-a0:0", first["prefix_token_count"] + 2)
            backend.pause()
            second = (await _cut(client, _prefix("r-a0:0")))["prefixes"][0]
            assert second["cut_kind"] == "active_prefix"
            assert N > second["prefix_token_count"] > first["prefix_token_count"]
            assert second["staging_keys"] == first["staging_keys"]
            assert list(backend.staged[second["staging_keys"][0]].tokens) == generate_tokens(
                SEED, PROMPT, second["prefix_token_count"]
            )
            backend.resume()
            await client.post(GENERATION_CUT_ROUTE + "/release", json={"checkpoint_id": "ck-1"})
            reply = (await bounded(original)).json()
            assert reply["tokens"] == generate_tokens(SEED, PROMPT, N)
            assert [c["call_id"] for c in backend.calls] == ["r-a0:0"]

    run(main)


def test_a_completed_call_cuts_as_a_terminal_completion_and_continues_at_once() -> None:
    async def main() -> None:
        async with _backend() as (client, backend):
            done = (await bounded(client.post("/generate", json=_body("r-a0:1", max_tokens=5)))).json()
            [ack] = (await _cut(client, _prefix("r-a0:1")))["prefixes"]
            assert ack["disposition"] == "durable_prefix"
            assert ack["cut_kind"] == "terminal_completion"
            assert ack["prefix_token_count"] == 5
            assert ack["prefix_digest"] == prefix_digest(done["tokens"])
            assert ack["terminal_finish_reason"] == "length"
            assert ack["effective_output_limit"] == 1
            assert ack["staging_keys"] == ["__generation_cut__/r/r-a0:1"]
            assert list(backend.staged["__generation_cut__/r/r-a0:1"].tokens) == done["tokens"]

            backend.pause()  # no decoding happens: the reply cannot wait on a token
            body = _body("r-a1:1", max_tokens=5, ng_capture=_continuation(ack))
            reply = (await bounded(client.post("/generate", json=body))).json()
            assert reply["tokens"] == done["tokens"] == generate_tokens(SEED, PROMPT, 5)
            assert (reply["generated"], reply["continued_from"]) == (0, 5)
            assert backend.calls[-1]["call_id"] == "r-a1:1"
            assert backend.calls[-1]["generated"] == 0

    run(main)


def test_the_receipt_echoes_the_inventory_and_acks_every_ticket_once_in_order() -> None:
    async def main() -> None:
        async with _backend() as (client, backend):
            await bounded(client.post("/generate", json=_body("done", max_tokens=3)))
            live = asyncio.create_task(client.post("/generate", json=_body("live")))
            await _decoding(backend, "live", 1)
            backend.pause()
            prefixes = [_prefix("unknown", rollout_id="r1"), _prefix("live", "r2", 3), _prefix("done", "r3", 1)]
            receipt = await _cut(client, *prefixes)
            assert receipt["checkpoint_id"] == "ck-1"
            assert receipt["inventory"] == _inventory(prefixes)
            assert receipt["inventory_digest"] == _inventory(prefixes)["inventory_digest"]
            assert len(receipt["cut_id"]) == 32 and len(receipt["backend_snapshot_id"]) == 32
            acks = receipt["prefixes"]
            assert [a["ticket_id"] for a in acks] == [p["ticket_id"] for p in prefixes]
            for ack, sent in zip(acks, prefixes, strict=True):
                assert {name: ack[name] for name in sent} == sent
            failure, active, terminal = acks
            assert failure["disposition"] == "durable_failure"
            assert failure["staging_keys"] == []
            for name in ("cut_kind", "frozen_buffer_id", "prefix_token_count", "prefix_digest"):
                assert failure[name] is None
            assert failure["effective_output_limit"] is None and failure["terminal_finish_reason"] is None
            assert active["cut_kind"] == "active_prefix"
            assert active["staging_keys"] == ["__generation_cut__/r2/live"]
            assert terminal["cut_kind"] == "terminal_completion"
            assert terminal["staging_keys"] == ["__generation_cut__/r3/done"]
            assert not any(key.startswith("__generation_cut__/r1/") for key in backend.staged)
            backend.resume()
            await client.post(GENERATION_CUT_ROUTE + "/release", json={"checkpoint_id": "ck-1"})
            await bounded(live)

            empty = await _cut(client)
            assert empty["prefixes"] == [] and empty["inventory"]["active_prefixes"] == []

    run(main)


def test_a_retried_call_in_flight_twice_cuts_the_latest() -> None:
    async def main() -> None:
        async with _backend() as (client, backend):
            older = asyncio.create_task(client.post("/generate", json=_body("r-a0:0", prompt="first")))
            await _decoding(backend, "r-a0:0", 1)
            newer = asyncio.create_task(client.post("/generate", json=_body("r-a0:0", prompt="second")))
            await backend.wait_until(lambda: list(backend.in_flight.values()) == ["r-a0:0"] * 2, timeout=TIMEOUT)
            backend.pause()
            [ack] = (await _cut(client, _prefix("r-a0:0")))["prefixes"]
            staged = backend.staged[ack["staging_keys"][0]]
            assert staged.prompt_sha256 == hashlib.sha256(b"second").hexdigest()
            assert list(staged.tokens) == generate_tokens(SEED, "second", ack["prefix_token_count"])
            backend.resume()
            await client.post(GENERATION_CUT_ROUTE + "/release", json={"checkpoint_id": "ck-1"})
            await bounded(asyncio.gather(older, newer))

    run(main)


def test_an_inventory_with_a_wrong_digest_or_a_bad_field_is_refused() -> None:
    async def main() -> None:
        async with _backend() as (client, backend):
            good = _inventory([_prefix("a"), _prefix("b")])
            reordered = {**good, "active_prefixes": good["active_prefixes"][::-1]}
            bad_ticket = _inventory([{**_prefix("a"), "ticket_id": "not-a-uuid"}])
            bad_rollout = _inventory([_prefix("a", rollout_id="-r")])
            negative = _inventory([_prefix("a", attempt=-1)])
            for body in (
                {**good, "inventory_digest": "0" * 64},
                {**good, "checkpoint_id": "ck-2"},
                reordered,
                bad_ticket,
                bad_rollout,
                negative,
                {**good, "extra": 1},
                {**good, "inventory_digest": "short"},
            ):
                reply = await client.post(GENERATION_CUT_ROUTE, json=body)
                assert reply.status_code == 422, body
                assert reply.json()["error"]["code"] == "invalid_request"
            not_json = await client.post(GENERATION_CUT_ROUTE, content=b"{", headers={"content-type": "text/plain"})
            assert not_json.status_code == 422
            assert not_json.json()["error"]["code"] == "invalid_request"
            assert backend.staged == {}
            # an integral admitted_at, digested as sent, is accepted
            sent = [{**_prefix("a"), "admitted_at": 1_700_000_000}]
            assert (await client.post(GENERATION_CUT_ROUTE, json=_inventory(sent))).status_code == 200

    run(main)


def test_an_inventory_names_at_most_the_limit_of_prefixes() -> None:
    prefix = {**_prefix("a"), "ticket_id": "0" * 32}
    too_many = [prefix] * (MAX_CUT_PREFIXES + 1)
    with pytest.raises(ValueError, match="active_prefixes"):
        GenerationCutInventory.model_validate(
            {"checkpoint_id": "c", "server_name": "s", "active_prefixes": too_many, "inventory_digest": "0" * 64}
        )


@pytest.mark.parametrize(
    ("case", "what"),
    [
        ("prompt", "prompt_sha256"),
        ("seed", "seed"),
        ("digest", "prefix_digest"),
        ("count", "prefix_token_count"),
        ("missing", "no staged prefix"),
    ],
)
def test_a_continuation_that_does_not_match_its_prefix_is_refused(case: str, what: str) -> None:
    async def main() -> None:
        async with _backend() as (client, backend):
            await bounded(client.post("/generate", json=_body("r-a0:0", max_tokens=4)))
            [ack] = (await _cut(client, _prefix("r-a0:0")))["prefixes"]
            ack = {**ack, "terminal_finish_reason": None}  # so a match would generate
            body = _body("r-a1:0", ng_capture=_continuation(ack))
            cut = body["ng_capture"]["generation_cut"]
            if case == "prompt":
                body["prompt"] = "hello!"
            elif case == "seed":
                body["seed"] = SEED + 1
            elif case == "digest":
                cut["prefix_digest"] = prefix_digest([1, 2, 3])
            elif case == "count":
                cut["prefix_token_count"] = 3
            else:
                cut["staging_keys"] = ["__generation_cut__/r/elsewhere"]
            calls, staged = list(backend.calls), backend.staging_keys()
            reply = await bounded(client.post("/generate", json=body))
            assert reply.status_code == 409, reply.text
            error = reply.json()["error"]
            assert error["code"] == "generation_cut_mismatch"
            assert what in error["detail"]
            assert backend.calls == calls and backend.staging_keys() == staged
            assert backend.in_flight == {} and backend.abandoned == 0

    run(main)


def test_a_malformed_continuation_is_refused_and_extra_capture_fields_are_allowed() -> None:
    async def main() -> None:
        async with _backend() as (client, backend):
            await bounded(client.post("/generate", json=_body("r-a0:0", max_tokens=4)))
            [ack] = (await _cut(client, _prefix("r-a0:0")))["prefixes"]
            capture = _continuation(ack)
            extra_inside = {**capture, "generation_cut": {**capture["generation_cut"], "extra": 1}}
            no_keys = {**capture, "generation_cut": {**capture["generation_cut"], "staging_keys": []}}
            for ng_capture in (extra_inside, no_keys):
                reply = await client.post("/generate", json=_body("r-a1:0", max_tokens=4, ng_capture=ng_capture))
                assert reply.status_code == 422
            assert [c["call_id"] for c in backend.calls] == ["r-a0:0"]
            capture["prev_len"] = 0  # other admission fields pass through
            reply = await bounded(client.post("/generate", json=_body("r-a1:0", max_tokens=4, ng_capture=capture)))
            assert reply.status_code == 200
            assert reply.json()["tokens"] == generate_tokens(SEED, PROMPT, 4)
            plain = await bounded(client.post("/generate", json=_body("r-a2:0", max_tokens=2, ng_capture={})))
            assert plain.json()["continued_from"] == 0

    run(main)


def test_the_staging_store_lists_and_deletes_keys() -> None:
    async def main() -> None:
        async with _backend() as (client, _):
            assert (await client.get(STAGING)).json() == {"keys": []}
            await client.post("/generate", json=_body("b", max_tokens=1))
            await client.post("/generate", json=_body("a", max_tokens=0))
            assert (await client.get(STAGING)).json() == {"keys": ["__calls__/a", "__calls__/b"]}
            reply = await client.post(STAGING_DELETE, json={"keys": ["__calls__/a", "__calls__/missing"]})
            assert reply.json() == {"deleted": 1}
            assert (await client.get(STAGING)).json() == {"keys": ["__calls__/b"]}
            [ack] = (await _cut(client, _prefix("a")))["prefixes"]
            assert ack["disposition"] == "durable_failure"  # its tokens are gone from the store
            refused = await client.post(STAGING_DELETE, json={"keys": "__calls__/b"})
            assert refused.status_code == 422 and refused.json()["error"]["code"] == "invalid_request"
            assert (await client.get(STAGING)).json() == {"keys": ["__calls__/b"]}

    run(main)


async def _control_statuses(client: httpx.AsyncClient, headers: dict[str, str]) -> list[int]:
    return [
        (await client.get(STAGING, headers=headers)).status_code,
        (await client.post(STAGING_DELETE, json={"keys": []}, headers=headers)).status_code,
        (await client.post(GENERATION_CUT_ROUTE, json=_inventory([_prefix("x")]), headers=headers)).status_code,
        (await client.post(DECODING, json={"paused": False}, headers=headers)).status_code,
    ]


@pytest.mark.parametrize("enabled", [False, True])
def test_with_a_token_every_control_route_needs_it(enabled: bool) -> None:
    async def main() -> None:
        checkpoint = {"enabled": enabled, "control_auth_token": "secret"}
        async with _backend(checkpoint=checkpoint) as (client, _):
            assert await _control_statuses(client, {}) == [401] * 4
            assert await _control_statuses(client, {"Authorization": "Bearer wrong"}) == [401] * 4
            unknown = await client.get("/ng-control/v1/anything")
            assert unknown.status_code == 401
            assert unknown.json()["error"]["code"] == "unauthorized"
            assert unknown.headers["www-authenticate"] == "Bearer"
            assert await _control_statuses(client, {"Authorization": "Bearer secret"}) == [200] * 4
            assert (await client.post("/generate", json=_body("g", max_tokens=1))).status_code == 200
            assert (await client.get("/calls")).status_code == 200
            assert (await client.post("/calls/reset")).status_code == 200

    run(main)


def test_without_a_token_the_control_routes_are_open() -> None:
    async def main() -> None:
        async with _backend() as (client, _):
            assert await _control_statuses(client, {}) == [200] * 4

    run(main)


def test_the_generations_still_decoding_are_listed_with_the_cut_that_froze_them() -> None:
    async def main() -> None:
        async with _backend() as (client, backend):
            assert (await client.get(f"{GENERATION_CUT_ROUTE.rsplit('/', 1)[0]}/generations")).json() == {
                "generations": []
            }
            original = asyncio.create_task(client.post("/generate", json=_body("r-a0:0")))
            await _decoding(backend, "r-a0:0", 2)
            backend.pause()
            [ack] = (await _cut(client, _prefix("r-a0:0")))["prefixes"]
            listed = (await client.get(f"{GENERATION_CUT_ROUTE.rsplit('/', 1)[0]}/generations")).json()
            assert listed == {
                "generations": [
                    {"call_id": "r-a0:0", "tokens": ack["prefix_token_count"], "max_tokens": N, "frozen_by": "ck-1"}
                ]
            }
            backend.resume()
            await client.post(GENERATION_CUT_ROUTE + "/release", json={"checkpoint_id": "ck-1"})
            await bounded(original)

    run(main)


def test_decoding_paused_over_http_holds_a_generation_mid_way_until_let_go() -> None:
    async def main() -> None:
        async with _backend() as (client, backend):
            original = asyncio.create_task(client.post("/generate", json=_body("r-a0:0")))
            await _decoding(backend, "r-a0:0", 2)
            paused = (await client.post(DECODING, json={"paused": True})).json()
            assert paused["paused"] is True
            [held] = paused["generations"]
            assert held["call_id"] == "r-a0:0" and 2 <= held["tokens"] < N
            # a generation started while paused makes no token either
            later = asyncio.create_task(client.post("/generate", json=_body("r-a0:1")))
            await backend.wait_until(lambda: backend.progress("r-a0:1") is not None, timeout=TIMEOUT)
            with pytest.raises(TimeoutError):  # a hundred token delays, and not one token more
                await backend.wait_until(
                    lambda: backend.progress("r-a0:0") != held["tokens"] or backend.progress("r-a0:1") != 0,
                    timeout=0.2,
                )
            assert not original.done()
            going = (await client.post(DECODING, json={"paused": False})).json()
            assert going["paused"] is False
            assert {generation["call_id"] for generation in going["generations"]} == {"r-a0:0", "r-a0:1"}
            assert [len((await bounded(task)).json()["tokens"]) for task in (original, later)] == [N, N]
            assert (await client.post(DECODING, json={"paused": "maybe"})).status_code == 422

    run(main)
