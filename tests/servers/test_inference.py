"""The fake inference backend: deterministic tokens, the completed-call log, generations in flight."""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp
import httpx

from gymckpt.control.routes import CONTROL_PREFIX
from gymckpt.servers.inference import InferenceConfig, build_inference_app, generate_tokens, prefix_digest, token_text

from .model_support import bounded, inference_server, run


def _client(token_delay_seconds: float = 0.0, **config: object) -> httpx.AsyncClient:
    app = build_inference_app(InferenceConfig(token_delay_seconds=token_delay_seconds, **config))  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://inference", timeout=30)


def _body(call_id: str, prompt: str = "hello", seed: int = 7, max_tokens: int = 6) -> dict[str, object]:
    return {"call_id": call_id, "prompt": prompt, "seed": seed, "max_tokens": max_tokens}


def test_tokens_are_a_deterministic_function_of_seed_and_prompt() -> None:
    async def main() -> None:
        async with _client(token_delay_seconds=0.001) as client:
            first = (await client.post("/generate", json=_body("a"))).json()
            again = (await client.post("/generate", json=_body("b"))).json()
            other_seed = (await client.post("/generate", json=_body("c", seed=8))).json()
            other_prompt = (await client.post("/generate", json=_body("d", prompt="hello!"))).json()
            longer = (await client.post("/generate", json=_body("e", max_tokens=12))).json()
        assert first["call_id"] == "a"
        assert len(first["tokens"]) == 6
        assert first["text"] == token_text(first["tokens"]) == " ".join(map(str, first["tokens"]))
        assert again["tokens"] == first["tokens"] == generate_tokens(7, "hello", 6)
        assert other_seed["tokens"] != first["tokens"]
        assert other_prompt["tokens"] != first["tokens"]
        assert longer["tokens"][:6] == first["tokens"]  # a longer generation extends a shorter one

    run(main)


def test_the_same_tokens_in_another_backend() -> None:
    async def main() -> None:
        async with _client() as one, _client() as two:
            a = (await one.post("/generate", json=_body("x", prompt="p", seed=123456789))).json()
            b = (await two.post("/generate", json=_body("y", prompt="p", seed=123456789))).json()
        assert a["tokens"] == b["tokens"]

    run(main)


def test_calls_log_lists_completed_calls_in_order_and_reset_empties_it_and_the_turns() -> None:
    async def main() -> None:
        async with _client() as client:
            assert (await client.get("/calls")).json() == []
            await client.post("/generate", json=_body("r:0", prompt="one", seed=1, max_tokens=3))
            await client.post("/generate", json=_body("r:1", prompt="two", seed=2, max_tokens=0))
            calls = (await client.get("/calls")).json()
            assert calls == [
                {
                    "call_id": "r:0",
                    "prompt_sha256": hashlib.sha256(b"one").hexdigest(),
                    "seed": 1,
                    "tokens": generate_tokens(1, "one", 3),
                    "staging_key": "__calls__/r:0",
                    "generated": 3,
                    "continued_from": 0,
                },
                {
                    "call_id": "r:1",
                    "prompt_sha256": hashlib.sha256(b"two").hexdigest(),
                    "seed": 2,
                    "tokens": [],
                    "staging_key": "__calls__/r:1",
                    "generated": 0,
                    "continued_from": 0,
                },
            ]
            assert (await client.get("/turns")).json() == {"rollouts_by_turn": {"2": 1}}
            assert (await client.post("/calls/reset")).json() == {"cleared": 2}
            assert (await client.get("/calls")).json() == []
            # the turns are forgotten with the log: a run after the reset counts only its own rollouts
            assert (await client.get("/turns")).json() == {"rollouts_by_turn": {}}

    run(main)


def test_invalid_requests_are_refused() -> None:
    async def main() -> None:
        async with _client() as client:
            assert (await client.post("/generate", json={"call_id": "a", "prompt": "p"})).status_code == 422
            assert (await client.post("/generate", json=_body("a", max_tokens=-1))).status_code == 422
            assert (await client.post("/generate", json={**_body("a"), "extra": 1})).status_code == 422
            assert (await client.get("/calls")).json() == []

    run(main)


def test_not_a_participant_even_with_a_checkpoint_block() -> None:
    async def main() -> None:
        async with _client(checkpoint={"enabled": True, "control_auth_token": "t"}) as client:
            reply = await client.get(f"{CONTROL_PREFIX}/status", headers={"Authorization": "Bearer t"})
            assert reply.status_code == 404
            assert (await client.post("/ng-rollout/r/generate", json=_body("a"))).status_code == 404

    run(main)


def test_generations_are_in_flight_together_and_a_disconnected_one_is_not_logged() -> None:
    async def main() -> None:
        async with inference_server(token_delay_seconds=0.01) as inference, aiohttp.ClientSession() as session:

            async def generate(call_id: str, max_tokens: int) -> dict[str, object]:
                async with session.post(f"{inference.url}/generate", json=_body(call_id, max_tokens=max_tokens)) as r:
                    return await r.json()  # type: ignore[no-any-return]

            backend = inference.backend
            # long enough that neither finishes on its own while the test runs
            slow = [asyncio.create_task(generate(f"slow-{n}", 1_000_000)) for n in range(2)]
            await backend.wait_until(lambda: len(backend.in_flight) == 2, timeout=30)
            assert sorted(backend.in_flight.values()) == ["slow-0", "slow-1"]
            for task in slow:
                task.cancel()  # the client goes away: aiohttp closes the connection
            await asyncio.gather(*slow, return_exceptions=True)
            await backend.wait_until(lambda: not backend.in_flight, timeout=30)
            assert backend.abandoned == 2
            assert backend.calls == []
            reply = await bounded(generate("quick", 3))
            assert reply["tokens"] == generate_tokens(7, "hello", 3)
            assert [call["call_id"] for call in backend.calls] == ["quick"]

    run(main)


def test_draw_tokens_is_randranges_stream() -> None:
    """The decoder's fast draws are exactly ``randrange(VOCAB_SIZE)``'s: the tokens stay what they were."""
    from gymckpt.servers.inference_tokens import VOCAB_SIZE, draw_tokens, token_stream

    expected = token_stream(7, "a prompt")
    assert draw_tokens(token_stream(7, "a prompt"), 5_000) == [expected.randrange(VOCAB_SIZE) for _ in range(5_000)]


def test_generate_replies_carry_the_digest_of_their_tokens() -> None:
    async def main() -> None:
        async with _client() as client:
            reply = (await client.post("/generate", json=_body("d", max_tokens=30))).json()
            assert reply["text"] == token_text(reply["tokens"])
            assert reply["tokens_digest"] == prefix_digest(reply["tokens"])

    run(main)
