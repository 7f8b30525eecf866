"""The policy model server and its participant (P4): the policy, holds, waits, streams, retire."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.control.routes import CONTROL_PREFIX
from gymckpt.errors import ControlError, InvalidCheckpointState
from gymckpt.identity import EpisodeId
from gymckpt.participants.model import ModelParticipant
from gymckpt.servers.inference import generate_tokens
from gymckpt.store import open_store

from ..support import error_code
from .model_support import (
    TIMEOUT,
    TOKEN,
    AsgiCall,
    Model,
    bounded,
    inference_server,
    model_server,
    parse_sse,
    run,
)

if TYPE_CHECKING:
    from pathlib import Path

TOOLS = [{"type": "function", "name": "increment"}, {"type": "function", "name": "other"}]
QUESTION = [{"role": "user", "content": "count to three"}]
REQUEST: dict[str, Any] = {"model": "policy", "input": QUESTION, "tools": TOOLS}
#: the counts of a model participant with no call
IDLE = {"waiting": 0, "in_flight": 0, "held": 0, "streaming": 0, "cut": 0, "cut_failed": 0, "cut_skipped": 0}


def _expected_tokens(items: list[dict[str, Any]], max_tokens: int = 8) -> list[int]:
    """The tokens the documented policy asks for: seed = int(sha256(json of input)[:8], 16)."""
    prompt = json.dumps(items, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return generate_tokens(int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16), prompt, max_tokens)


def _tool_result(call: dict[str, Any]) -> dict[str, Any]:
    """The tool result an agent appends after a function call (the counter's reply)."""
    n = json.loads(call["arguments"])["n"]
    return {"role": "tool", "call_id": call["call_id"], "content": json.dumps({"count": n})}


async def _conversation(model: Model, key: str | None, *, tools: list[dict[str, Any]] = TOOLS) -> list[dict[str, Any]]:
    """Run the turn loop an agent runs (model call, tool result, …) until a final message."""
    items: list[dict[str, Any]] = list(QUESTION)
    replies = []
    for _ in range(10):
        response = await model.respond(key, {"model": "policy", "input": items, "tools": tools})
        assert response.status_code == 200, response.text
        reply = response.json()
        replies.append(reply)
        item = reply["output"][0]
        if item["type"] != "function_call":
            return replies
        items = [*items, item, _tool_result(item)]
    raise AssertionError("the policy never answered a final message")


def test_the_policy_is_deterministic_tool_calls_then_a_final_message() -> None:
    async def main() -> None:
        async with inference_server() as inference:
            async with model_server(inference.url) as model:
                first = await _conversation(model, "r")
            async with model_server(inference.url) as model:
                second = await _conversation(model, "other-rollout-a2")
            assert first == second  # same input, same output: on another server and for another rollout
            assert [reply["output"][0]["type"] for reply in first] == ["function_call"] * 3 + ["message"]
            items: list[dict[str, Any]] = list(QUESTION)
            for reply in first[:3]:
                call = reply["output"][0]
                assert call["name"] == "increment"
                assert json.loads(call["arguments"]) == {"n": _expected_tokens(items)[0] % 5 + 1}
                assert reply["usage"]["output_tokens"] == 8
                items = [*items, call, _tool_result(call)]
            message = first[3]["output"][0]
            assert message["role"] == "assistant"
            assert message["content"][0]["type"] == "output_text"
            assert message["content"][0]["text"].startswith("answer ")
            assert len(message["content"][0]["text"].split()) == 5
            # the backend's log: one completed call per model call, named <capture key>:<tool results so far>
            call_ids = [call["call_id"] for call in inference.backend.calls]
            assert call_ids == [*(f"r:{n}" for n in range(4)), *(f"other-rollout-a2:{n}" for n in range(4))]
            assert list(inference.backend.calls[0]["tokens"]) == _expected_tokens(list(QUESTION))

    run(main)


def test_without_tools_or_tool_turns_the_first_answer_is_final() -> None:
    async def main() -> None:
        async with inference_server() as inference:
            async with model_server(inference.url) as model:
                replies = await _conversation(model, "r", tools=[])
            async with model_server(inference.url, tool_turns=0, max_tokens=4) as model:
                direct = await _conversation(model, "r")
        tokens = _expected_tokens(list(QUESTION))
        assert [reply["output"][0]["content"][0]["text"] for reply in replies] == [
            "answer " + " ".join(map(str, tokens[:4]))
        ]
        assert direct[0]["output"][0]["content"][0]["text"] == replies[0]["output"][0]["content"][0]["text"]
        assert direct[0]["usage"]["output_tokens"] == 4

    run(main)


def test_a_generation_in_flight_is_held_until_resume_and_does_not_block(tmp_path: Path) -> None:
    async def main() -> None:
        async with inference_server() as inference, model_server(inference.url) as model:
            expected = (await model.respond("warm", REQUEST)).json()
            gate, participant = inference.gate, model.participant
            gate.close()
            call = asyncio.create_task(model.respond("r", REQUEST))
            await gate.until(lambda g: g.arrivals == 2)
            assert participant.counts()["in_flight"] == 1

            prepared = (await model.control("prepare", checkpoint_id="c1")).json()
            assert prepared["phase"] == "prepared"
            assert prepared["report"]["ready"] is True  # a generation in flight is no blocker
            assert prepared["report"]["counts"]["in_flight"] == 1

            gate.open()  # the generation completes while admission is closed: its reply is held
            await participant.wait_until(lambda: participant.counts()["held"] == 1, TIMEOUT)
            assert [c["call_id"] for c in inference.backend.calls] == ["warm:0", "r:0"]
            assert not call.done()
            assert participant.ready()
            status = (await model.client.get(f"{CONTROL_PREFIX}/status", headers=_auth())).json()
            # the cut at prepare failed (the gate kept the generation from the backend), but the generation
            # completed while held: the checkpoint keeps it whole, as a terminal cut
            assert status["report"]["counts"] == {**IDLE, "held": 1, "cut": 1}

            committed = await model.control(
                "commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path / "ckpt"), episode_ids=["r"]
            )
            assert committed.status_code == 200, committed.text
            assert committed.json()["record_count"] == 1
            assert not call.done()
            (record,) = open_store(str(tmp_path / "ckpt")).read_participant("", kind="model", instance="model-0")
            (cut,) = record["generation_cuts"]
            assert record["rows"] == []  # an undelivered call leaves no ledger row
            assert cut["continuation"]["terminal_finish_reason"] == "length"
            assert cut["continuation"]["staging_keys"] == ["__calls__/r:0"]
            assert cut["continuation"]["prefix_token_count"] == 8

            assert (await model.control("resume", checkpoint_id="c1")).status_code == 200
            response = await bounded(call)
            assert response.status_code == 200
            assert response.json() == expected
            assert participant.counts() == IDLE

    run(main)


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def test_a_new_call_while_closed_waits_for_resume() -> None:
    async def main() -> None:
        async with inference_server() as inference, model_server(inference.url) as model:
            participant = model.participant
            prepared = (await model.control("prepare", checkpoint_id="c1")).json()
            assert prepared["phase"] == "prepared"

            call = asyncio.create_task(model.respond("r", REQUEST))
            await participant.wait_until(lambda: participant.counts()["waiting"] == 1, TIMEOUT)
            assert inference.gate.arrivals == 0  # it has not asked the backend for anything
            assert participant.ready()
            assert not call.done()
            # still admitted after a retried prepare: the call is not refused, it waits
            assert (await model.control("prepare", checkpoint_id="c1")).json()["report"]["ready"] is True

            assert (await model.control("resume", checkpoint_id="c1")).status_code == 200
            response = await bounded(call)
            assert response.status_code == 200
            assert response.json()["output"][0]["type"] == "function_call"
            assert [c["call_id"] for c in inference.backend.calls] == ["r:0"]

    run(main)


def test_a_streamed_reply_in_flight_blocks_readiness_until_it_ends() -> None:
    async def main() -> None:
        async with inference_server() as inference, model_server(inference.url) as model:
            participant = model.participant
            expected = (await model.respond("plain", REQUEST)).json()
            stream = AsgiCall(
                model.app, "/ng-rollout/s/v1/responses", {**REQUEST, "stream": True}, pause_after_first_chunk=True
            )
            streaming = asyncio.create_task(stream.run())
            await bounded(stream.first_chunk.wait())  # bytes are on their way; the reader is slow
            assert not participant.ready()
            assert participant.counts()["streaming"] == 1

            # prepare cannot finish while the stream is on the wire: it reports the stream as the blocker
            preparing = asyncio.create_task(model.control("prepare", checkpoint_id="c1"))
            await participant.wait_until(lambda: not participant.admission_open, TIMEOUT)
            status = (await model.client.get(f"{CONTROL_PREFIX}/status", headers=_auth())).json()
            assert status["phase"] == "preparing"
            report = status["report"]
            assert (report["ready"], report["blockers"], report["blocker_count"]) == (False, ["s"], 1)
            assert report["counts"]["streaming"] == 1
            assert not preparing.done()

            stream.resume()
            await bounded(streaming)
            prepared = (await bounded(preparing)).json()
            assert prepared["phase"] == "prepared"
            assert prepared["report"]["ready"] is True
            assert (await model.control("resume", checkpoint_id="c1")).status_code == 200

            assert stream.status == 200
            events = parse_sse(stream.data)
            tokens = _expected_tokens(list(QUESTION))
            assert [name for name, _ in events] == ["response.token"] * 8 + ["response.completed"]
            assert [data["token"] for _, data in events[:-1]] == tokens
            assert events[-1][1]["response"] == expected  # the same reply as without streaming
            assert participant.counts()["streaming"] == 0

    run(main)


def test_a_streamed_reply_not_started_is_held_before_its_first_byte() -> None:
    async def main() -> None:
        async with inference_server() as inference, model_server(inference.url) as model:
            participant = model.participant
            inference.gate.close()
            stream = AsgiCall(model.app, "/ng-rollout/s/v1/responses", {**REQUEST, "stream": True})
            streaming = asyncio.create_task(stream.run())
            await inference.gate.until(lambda g: g.arrivals == 1)
            assert (await model.control("prepare", checkpoint_id="c1")).json()["phase"] == "prepared"
            inference.gate.open()
            await participant.wait_until(lambda: participant.counts()["held"] == 1, TIMEOUT)
            assert not stream.started.is_set()  # not a byte sent: the reply is undelivered
            assert participant.ready()
            assert (await model.control("resume", checkpoint_id="c1")).status_code == 200
            await bounded(streaming)
            assert stream.status == 200
            assert parse_sse(stream.data)[-1][0] == "response.completed"

    run(main)


def test_retire_stops_a_call_in_flight_and_refuses_the_attempt_until_forgotten() -> None:
    async def main() -> None:
        async with inference_server() as inference, model_server(inference.url) as model:
            participant, gate = model.participant, inference.gate
            gate.close()
            doomed = asyncio.create_task(model.respond("r", REQUEST))
            other = asyncio.create_task(model.respond("q", REQUEST))
            await gate.until(lambda g: g.arrivals == 2)
            retired = await model.control("retire", checkpoint_id="ret-1", episode_ids=["r"])
            assert retired.json()["retired_count"] == 1
            response = await bounded(doomed)
            assert response.status_code == 409
            assert error_code(response) == "stale_attempt"
            assert participant.calls_of("r") == []
            assert not other.done()

            gate.open()
            assert (await bounded(other)).status_code == 200
            await gate.until(lambda g: g.finished == 2)
            # the retired call's generation lost its client: it is not in the log
            assert [c["call_id"] for c in inference.backend.calls] == ["q:0"]

            later = await model.respond("r", REQUEST)
            assert (later.status_code, error_code(later)) == (409, "stale_attempt")
            assert (await model.respond("r-a1", REQUEST)).status_code == 200  # the next attempt runs
            forgot = await model.control("forget", checkpoint_id="fgt-1", rollout_ids=["r"])
            assert forgot.json() == {"forgotten_count": 1, "forgotten": ["r"]}
            assert (await model.respond("r", REQUEST)).status_code == 200
            assert participant.counts() == IDLE

    run(main)


def test_retire_cancels_and_frees_waiting_calls_of_a_restore(tmp_path: Path) -> None:
    """A restore (on a fresh server) closes admission and allows retire: the waiting calls of the attempt end."""

    async def main() -> None:
        ckpt = str(tmp_path / "ckpt")
        async with inference_server() as inference:
            async with model_server(inference.url) as source:
                assert (await source.control("prepare", checkpoint_id="c0")).status_code == 200
                committed = await source.control("commit", checkpoint_id="c0", checkpoint_dir=ckpt, episode_ids=["x"])
                assert committed.status_code == 200, committed.text
                await source.control("resume", checkpoint_id="c0")

            async with model_server(inference.url) as model:
                participant = model.participant
                restored = await model.control("restore", checkpoint_id="c0", checkpoint_dir=ckpt, episode_ids=["x"])
                assert restored.status_code == 200, restored.text
                assert restored.json()["restored"] == []  # no call was delivered or cut: no records
                earlier = asyncio.create_task(model.respond("h", REQUEST))
                waiting = asyncio.create_task(model.respond("h-a1", REQUEST))
                survivor = asyncio.create_task(model.respond("x-a1", REQUEST))
                await participant.wait_until(lambda: participant.counts()["waiting"] == 3, TIMEOUT)

                retired = await model.control("retire", checkpoint_id="c0", episode_ids=["h-a1"])
                assert retired.json()["retired_count"] == 1
                for task in (earlier, waiting):
                    response = await bounded(task)
                    assert (response.status_code, error_code(response)) == (409, "stale_attempt")
                assert participant.calls_of("h") == participant.calls_of("h-a1") == []
                assert participant.counts() == {**IDLE, "waiting": 1}
                later = await model.respond("h-a1", REQUEST)
                assert (later.status_code, error_code(later)) == (409, "stale_attempt")

                assert (await model.control("resume", checkpoint_id="c0")).status_code == 200
                assert (await bounded(survivor)).status_code == 200
                assert participant.counts() == IDLE

    run(main)


def test_a_restore_on_a_model_server_that_has_served_calls_is_refused(tmp_path: Path) -> None:
    async def main() -> None:
        ckpt = str(tmp_path / "ckpt")
        async with inference_server() as inference:
            async with model_server(inference.url) as source:
                assert (await source.control("prepare", checkpoint_id="c0")).status_code == 200
                await source.control("commit", checkpoint_id="c0", checkpoint_dir=ckpt, episode_ids=["x"])
                await source.control("resume", checkpoint_id="c0")
            async with model_server(inference.url) as model:
                assert (await model.respond("served", REQUEST)).status_code == 200
                refused = await model.control("restore", checkpoint_id="c0", checkpoint_dir=ckpt, episode_ids=["x"])
                assert (refused.status_code, error_code(refused)) == (409, "checkpoint_error")
                assert "freshly started" in refused.text
                assert model.participant.ledger == {"served": [model.participant.ledger["served"][0]]}

    run(main)


def test_a_call_without_a_rollout_prefix_is_admitted_and_never_exported(tmp_path: Path) -> None:
    """An evaluation or probe call on the policy server: answered, but belongs to no episode."""

    async def main() -> None:
        async with inference_server() as inference, model_server(inference.url) as model:
            response = await model.respond(None, REQUEST)
            assert response.status_code == 200, response.text
            assert model.participant.counts() == IDLE
            assert model.participant.ledger == {}
            assert (await model.control("prepare", checkpoint_id="c1")).json()["phase"] == "prepared"
            committed = await model.control("commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path / "ck"))
            assert committed.json()["record_count"] == 0
            assert committed.json()["staging_keys"] == []

    run(main)


def test_checkpointing_off_installs_nothing_and_answers_the_same() -> None:
    async def main() -> None:
        async with inference_server() as inference:
            async with model_server(inference.url) as on:
                with_prefix = await _conversation(on, "r")
            async with model_server(inference.url, enabled=False) as off:
                assert off.app.state.participant is None
                assert off.app.state.plane is None
                status = await off.client.get(f"{CONTROL_PREFIX}/status", headers=_auth())
                assert status.status_code == 404
                assert (await off.respond("r", REQUEST)).status_code == 404  # no prefix route either
                without = await _conversation(off, None)
                streamed = AsgiCall(off.app, "/v1/responses", {**REQUEST, "stream": True})
                await bounded(streamed.run())
        assert without == with_prefix
        assert parse_sse(streamed.data)[-1][1]["response"] == with_prefix[0]
        assert [c["call_id"] for c in inference.backend.calls][4:8] == [f"anonymous:{n}" for n in range(4)]

    run(main)


def test_an_unreachable_backend_is_a_502() -> None:
    async def main() -> None:
        async with inference_server() as inference:
            url = inference.url
        async with model_server(url) as model:  # the backend is gone
            response = await model.respond("r", REQUEST)
            assert (response.status_code, error_code(response)) == (502, "inference_failed")
            assert model.participant.counts()["in_flight"] == 0

    run(main)


def test_the_participant_exports_its_ledger_and_installs_records_only_when_fresh() -> None:
    async def main() -> None:
        participant = ModelParticipant("model-7")
        assert participant.kind == "model"
        assert await participant.export(["a", "b"]) == []
        row = {"model_call_id": "a-a1:0", "request_digest": "d", "staging_key": "__calls__/a-a1:0", "tokens": 8}
        cut = {
            "model_call_id": "a-a1:1",
            "request_digest": "e",
            "continuation": {"staging_keys": ["__generation_cut__/a/a-a1:1"], "prefix_token_count": 3},
        }
        await participant.install([{"episode_id": "a-a1", "rows": [row], "generation_cuts": [cut]}], ["a-a1"], None)
        assert participant.ledger == {"a-a1": [row]}
        assert participant.status_extra() == {"restored_generation_cuts": ["a-a1"], "replayed_calls": 0}
        exported = await participant.export(["a-a1", "b-a1"])
        assert exported == [{"episode_id": "a-a1", "rows": [row], "generation_cuts": [cut]}]
        assert participant.commit_reply_extra() == {
            "staging_keys": ["__calls__/a-a1:0", "__generation_cut__/a/a-a1:1"],
            "staging_keys_by_episode": {"a-a1": ["__calls__/a-a1:0", "__generation_cut__/a/a-a1:1"]},
        }
        with pytest.raises(InvalidCheckpointState, match="more than one"):
            await participant.install([{"episode_id": "b-a1", "generation_cuts": [cut, cut]}], ["b-a1"], None)
        with pytest.raises(InvalidCheckpointState, match="malformed"):
            await participant.install([{"episode_id": "b-a1", "generation_cuts": [{"x": 1}]}], ["b-a1"], None)
        participant.admit(None)  # any call makes it a server that has served
        with pytest.raises(ControlError, match="freshly started"):
            await participant.install([], ["c-a1"], None)
        assert participant.restarts() == []

    run(main)


def test_the_participant_holds_a_stream_then_counts_it_as_a_blocker() -> None:
    async def main() -> None:
        participant = ModelParticipant()
        notified: list[bool] = []
        participant.add_readiness_listener(lambda: notified.append(participant.ready()))
        call = participant.admit(EpisodeId("r", 2), stream=True)
        await participant.respond(call, lambda: asyncio.sleep(0))
        await participant.close_admission("c-test")
        gate = asyncio.create_task(participant.start_stream(call))
        await participant.wait_until(lambda: participant.counts()["held"] == 1, TIMEOUT)
        assert participant.ready()
        assert notified == []
        await participant.open_admission()
        await bounded(gate)
        assert participant.counts()["streaming"] == 1
        await participant.close_admission("c-test")
        assert (participant.ready(), participant.blockers(10), participant.blocker_count()) == (False, ["r-a2"], 1)
        assert participant.blockers(0) == []
        participant.finish(call)
        assert participant.ready()
        assert notified == [True]  # readiness changed while admission was closed
        assert participant.calls_of("r-a2") == []

    run(main)
