"""The policy model's other routes (``/v1/chat/completions``, ``/v1/messages``) share its gating, and an
auxiliary model (``checkpoint_policy: false``) is no participant: discover skips it."""

from __future__ import annotations

import asyncio
import json

from gymckpt.control.coordination import Coordinator
from gymckpt.control.routes import CONTROL_PREFIX
from gymckpt.testing.net import serve_in_loop
from gymckpt.testing.time import bounded

from .model_support import TIMEOUT, TOKEN, inference_server, model_server, run

QUESTION = [{"role": "user", "content": "Add a few."}]
TOOLS_CHAT = [{"type": "function", "function": {"name": "increment", "parameters": {}}}]
TOOLS_PLAIN = [{"type": "function", "name": "increment"}]


def test_chat_completions_and_messages_answer_the_policys_reply_in_their_shapes() -> None:
    async def main() -> None:
        async with inference_server() as inference, model_server(inference.url) as model:
            responses = (await model.respond("r", {"input": QUESTION, "tools": TOOLS_PLAIN})).json()
            (call,) = responses["output"]
            chat = await model.client.post(
                "/ng-rollout/c/v1/chat/completions", json={"messages": QUESTION, "tools": TOOLS_CHAT}
            )
            assert chat.status_code == 200, chat.text
            (choice,) = chat.json()["choices"]
            assert choice["finish_reason"] == "tool_calls"
            (tool_call,) = choice["message"]["tool_calls"]
            assert tool_call["function"] == {"name": call["name"], "arguments": call["arguments"]}
            anthropic = await model.client.post(
                "/ng-rollout/m/v1/messages", json={"messages": QUESTION, "tools": TOOLS_PLAIN}
            )
            assert anthropic.status_code == 200, anthropic.text
            (block,) = anthropic.json()["content"]
            assert (block["type"], block["name"], block["input"]) == (
                "tool_use",
                call["name"],
                json.loads(call["arguments"]),
            )
            final = await model.client.post("/ng-rollout/m/v1/messages", json={"messages": QUESTION})
            assert final.json()["stop_reason"] == "end_turn"
            assert final.json()["content"][0]["text"].startswith("answer ")
            # every call is a ledger row of its own attempt
            assert sorted(model.participant.ledger) == ["c", "m", "r"]

    run(main)


def test_a_chat_call_while_a_checkpoint_is_open_waits_for_resume() -> None:
    async def main() -> None:
        async with inference_server() as inference, model_server(inference.url) as model:
            participant = model.participant
            assert (await model.control("prepare", checkpoint_id="c1")).json()["phase"] == "prepared"
            waiting = asyncio.create_task(
                model.client.post("/ng-rollout/w/v1/chat/completions", json={"messages": QUESTION})
            )
            await participant.wait_until(lambda: participant.counts()["waiting"] == 1, TIMEOUT)
            assert inference.gate.arrivals == 0  # nothing generated while open for the checkpoint
            assert (await model.control("resume", checkpoint_id="c1")).status_code == 200
            reply = await bounded(waiting)
            assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "stop"

    run(main)


def test_an_auxiliary_model_keeps_serving_and_discover_skips_it() -> None:
    async def main() -> None:
        async with inference_server() as inference, model_server(inference.url, checkpoint_policy=False) as judge:
            assert judge.app.state.participant is None
            status = await judge.client.get(f"{CONTROL_PREFIX}/status", headers={"Authorization": f"Bearer {TOKEN}"})
            assert status.status_code == 404
            reply = await judge.client.post("/v1/chat/completions", json={"messages": QUESTION})
            assert reply.status_code == 200
            async with serve_in_loop(judge.app) as url:
                coordinator = Coordinator([url], token=TOKEN)
                try:
                    found = await coordinator.discover(require_model=False)
                finally:
                    await coordinator.close()
            assert found.skipped == [url] and found.participants == [] and found.ok

    run(main)
