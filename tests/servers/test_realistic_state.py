"""Realistic rollout state (issue 27 item 1): what each reference server's records carry, and its knobs.

The inference backend's logprobs, decoding steps and turn counts; the model's ledger rows
(token ids and logprobs) and cut prefixes; the agent's conversation with the model's
reasoning; the environment's task; the counter's tool output; the stack's size knobs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from gymckpt.demo.launch import TurnTrigger, in_flight_at_turn, past_first_turn
from gymckpt.participants.environment import EnvironmentParticipant, task_digest
from gymckpt.servers.counter import CounterConfig, build_counter_app, tool_output
from gymckpt.servers.inference import (
    InferenceConfig,
    build_inference_app,
    call_turn,
    generate_tokens,
    token_logprobs,
)
from gymckpt.servers.model import chat_completion, token_words
from gymckpt.servers.token_codec import (
    TOKEN_ENCODING,
    pack_logprobs,
    pack_token_ids,
    unpack_logprobs,
    unpack_token_ids,
)
from gymckpt.stack.harness import StateSizes, default_stack_spec, prompt_text, task_for
from gymckpt.store import open_store

from .model_support import TIMEOUT, bounded, inference_server, model_server, run

if TYPE_CHECKING:
    from pathlib import Path

TOOLS = [{"type": "function", "name": "increment"}]
QUESTION = [{"role": "user", "content": "count to three"}]


def _generate_body(call_id: str, max_tokens: int) -> dict[str, Any]:
    return {"call_id": call_id, "prompt": "p", "seed": 7, "max_tokens": max_tokens}


# ----------------------------------------------------------------------------- inference backend


def test_decoding_steps_of_several_tokens_give_the_tokens_of_one_at_a_time_and_their_logprobs() -> None:
    async def main() -> None:
        replies = []
        for per_step in (1, 5):
            app = build_inference_app(InferenceConfig(token_delay_seconds=0.0, tokens_per_step=per_step))
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://inference") as client:
                reply = await client.post("/generate", json=_generate_body("r:0", 12))
                assert reply.status_code == 200, reply.text
                replies.append(reply.json())
        one, five = replies
        assert one["tokens"] == five["tokens"] == generate_tokens(7, "p", 12)
        assert one["logprobs"] == five["logprobs"] == token_logprobs(7, hashlib.sha256(b"p").hexdigest(), 12)
        assert len(one["logprobs"]) == 12 and all(value <= 0 for value in one["logprobs"])
        # a longer generation extends a shorter one: logprobs too
        assert token_logprobs(7, "x", 20)[:12] == token_logprobs(7, "x", 12)

    run(main)


def test_turns_count_each_rollout_at_the_latest_turn_a_call_of_it_started() -> None:
    assert call_turn("12-0:0") == ("12-0", 1)
    assert call_turn("12-0-a1:2") == ("12-0-a1", 3)
    assert call_turn("anonymous") is None and call_turn("r:x") is None

    async def main() -> None:
        app = build_inference_app(InferenceConfig(token_delay_seconds=0.0))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://inference") as client:
            for call_id in ("a:0", "a:1", "b:0", "c:0", "c:1", "c:2", "a:1"):
                assert (await client.post("/generate", json=_generate_body(call_id, 1))).status_code == 200
            assert (await client.get("/turns")).json() == {"rollouts_by_turn": {"1": 1, "2": 1, "3": 1}}

    run(main)


def test_a_cut_ack_carries_the_prefix_token_ids_and_their_logprobs(tmp_path: Path) -> None:
    async def main() -> None:
        async with inference_server() as inference, model_server(inference.url) as model:
            inference.backend.tokens_per_step = 4
            inference.backend.token_delay_seconds = 0.001
            inference.backend.pause()
            call = asyncio.create_task(model.respond("r", {"model": "policy", "input": QUESTION, "tools": TOOLS}))
            await inference.backend.wait_until(lambda: inference.backend.progress("r:0") == 0, TIMEOUT)
            inference.backend.resume()
            await inference.backend.wait_until(lambda: (inference.backend.progress("r:0") or 0) >= 4, TIMEOUT)
            prepared = await model.control("prepare", checkpoint_id="c1")
            assert prepared.status_code == 200, prepared.text
            staged = inference.backend.staged["__generation_cut__/r/r:0"]
            committed = await model.control(
                "commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path / "cut"), episode_ids=["r"]
            )
            assert committed.status_code == 200, committed.text
            (record,) = open_store(str(tmp_path / "cut")).read_participant("", kind="model", instance="model-0")
            (cut,) = record["generation_cuts"]
            prefix = cut["prefix"]
            assert unpack_token_ids(prefix["token_ids"]) == list(staged.tokens) and len(staged.tokens) % 4 == 0
            expected = token_logprobs(staged.seed, staged.prompt_sha256, len(staged.tokens))
            assert unpack_logprobs(prefix["logprobs"]) == expected and prefix["encoding"] == TOKEN_ENCODING
            assert cut["continuation"]["prefix_token_count"] == len(staged.tokens)
            assert (await model.control("resume", checkpoint_id="c1")).status_code == 200
            assert (await bounded(call)).status_code == 200

    run(main)


# ----------------------------------------------------------------------------- model server


def test_ledger_rows_hold_token_ids_and_logprobs_and_replies_their_reasoning(tmp_path: Path) -> None:
    async def main() -> None:
        async with (
            inference_server() as inference,
            model_server(inference.url, max_tokens=24, reasoning=True) as model,
        ):
            reply = await model.respond("r", {"model": "policy", "input": QUESTION, "tools": TOOLS})
            assert reply.status_code == 200, reply.text
            body = reply.json()
            reasoning, call = body["output"]
            (logged,) = inference.backend.calls
            assert reasoning["type"] == "reasoning"
            assert reasoning["summary"][0]["text"] == token_words(logged["tokens"])
            assert len(reasoning["summary"][0]["text"].split()) == 24
            assert call["type"] == "function_call"
            assert chat_completion(body)["choices"][0]["finish_reason"] == "tool_calls"  # reasoning skipped
            assert (await model.control("prepare", checkpoint_id="c1")).status_code == 200
            committed = await model.control(
                "commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path / "c"), episode_ids=["r"]
            )
            assert committed.status_code == 200, committed.text
        (record,) = open_store(str(tmp_path / "c")).read_participant("", kind="model", instance="model-0")
        (row,) = record["rows"]
        assert unpack_token_ids(row["token_ids"]) == list(logged["tokens"]) and row["tokens"] == 24
        assert unpack_logprobs(row["logprobs"]) == token_logprobs(logged["seed"], logged["prompt_sha256"], 24)
        assert row["encoding"] == TOKEN_ENCODING

    run(main)


# ----------------------------------------------------------------------------- environment, counter


def test_the_environment_record_holds_the_task_and_keeps_it_through_a_restore() -> None:
    async def main() -> None:
        task = task_for(5, prompt_chars=300)
        participant = EnvironmentParticipant("environment-0")
        episode = participant.begin_run("5-0", task)
        await episode.step("replay", _async({"stage": "invoke_agent"}), boundary=lambda result: result)
        (record,) = await participant.export(["5-0"])
        assert record == {
            "episode_id": "5-0",
            "task_digest": task_digest(task),
            "boundary": {"stage": "invoke_agent"},
            "task": task,
        }
        fresh = EnvironmentParticipant("environment-0")
        restored = {**record, "episode_id": "5-0-a1"}
        await fresh.install([restored], ["5-0-a1"], None)  # type: ignore[arg-type]
        (again,) = await fresh.export(["5-0-a1"])  # a restored episode not continued yet is exported again
        assert again["task"] == task
        # a record in the reference's shape (no task) still installs
        await fresh.install([{"episode_id": "6-0-a1", "task_digest": "0" * 64, "boundary": None}], ["6-0-a1"], None)  # type: ignore[arg-type]

    run(main)


def _async(value: Any) -> Any:
    async def result() -> Any:
        return value

    return result


def test_the_counter_answers_a_tool_output_of_the_configured_length() -> None:
    async def main() -> None:
        app = build_counter_app(CounterConfig(output_chars=300))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://counter") as client:
            await client.post("/seed_session", json={}, headers={"x-session-id": "s"})
            reply = (await client.post("/increment", json={"n": 2}, headers={"x-session-id": "s"})).json()
        assert reply["count"] == 2 and reply["output"] == tool_output(2, 2, 300) and len(reply["output"]) == 300
        assert tool_output(2, 2, 300) != tool_output(3, 2, 300)

    run(main)


# ----------------------------------------------------------------------------- knobs


def test_prompts_are_deterministic_padded_text_of_the_asked_length() -> None:
    assert prompt_text(3) == "count for task 3" == task_for(3)["task_input"]["prompt"]
    assert prompt_text(3, 800) == prompt_text(3, 800) != prompt_text(4, 800)
    assert len(prompt_text(3, 800)) == 800 and prompt_text(3, 800).startswith("count for task 3.")
    assert len(json.dumps(task_for(3, prompt_chars=800))) > 800


def test_state_sizes_reach_the_servers_configs() -> None:
    def configs(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {server["name"]: server.get("config", {}) for server in spec["servers"]}

    compact = configs(default_stack_spec(token="t"))
    assert compact["inference"] == {"token_delay_seconds": 0.01}
    assert "max_tokens" not in compact["model"] and "reasoning" not in compact["model"]
    assert compact["resources"] == {}
    sized = configs(default_stack_spec(token="t", sizes=StateSizes(tool_output_chars=123, generation_tokens=64)))
    assert sized["inference"]["tokens_per_step"] == StateSizes().tokens_per_step
    assert sized["model"]["max_tokens"] == 64 and sized["model"]["reasoning"] is True
    assert sized["resources"] == {"output_chars": 123}
    assert StateSizes.compact().generation_tokens == 8


def test_the_turn_trigger_counts_rollouts_in_flight_at_a_turn() -> None:
    # 10 at turn 1, 30 at turn 2, 60 at turn 4 (of which 50 finished)
    by_turn = {"1": 10, "2": 30, "4": 60}
    assert in_flight_at_turn(by_turn, 2, finished=50) == 40
    assert in_flight_at_turn(by_turn, 1, finished=50) == 50
    assert in_flight_at_turn({}, 2, finished=3) == 0
    assert past_first_turn({"agent turn 1": 5, "agent turn 2": 3, "agent turn 4": 2, "verifying": 1, "x": 9}) == 6
    assert TurnTrigger.of(3) == TurnTrigger(turn=3) and TurnTrigger.of(None) is None
    assert TurnTrigger.of({"turn": 2, "share": 0.7}) == TurnTrigger(2, 0.7)
    with pytest.raises(TypeError):
        TurnTrigger.of("2")
    with pytest.raises(ValueError):
        TurnTrigger(turn=0)
    with pytest.raises(ValueError):
        TurnTrigger(share=1.0)


def test_packed_token_ids_and_logprobs_come_back_exactly() -> None:
    tokens = [0, 1, 31_999, 2**31 - 1, -(2**31)]
    logprobs = [-0.0, -1e-300, -123.456789, float("-inf"), -0.1 - 0.2]
    assert unpack_token_ids(pack_token_ids(tokens)) == tokens
    assert [value.hex() for value in unpack_logprobs(pack_logprobs(logprobs))] == [value.hex() for value in logprobs]
    assert len(pack_token_ids(list(range(128)))) == 684  # 4 bytes a token, base64
    with pytest.raises(OverflowError):
        pack_token_ids([2**31])
    with pytest.raises(ValueError):
        unpack_token_ids("not base64!")
