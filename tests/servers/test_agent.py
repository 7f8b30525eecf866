"""The simple agent and its participant (P3, D1): the turn loop, checkpoints, restore, retire.

The agent app runs in the test's loop behind httpx's ASGI transport; its model and
resources calls go over real HTTP to fake servers in threads (tests/servers/agent_support.py).
Every wait is bounded; holds and events, not sleeps, order what happens.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.participants.agent import (
    AgentSessionParticipant,
    RestartOnlyAgentParticipant,
    agent_participant,
    has_session_hooks,
)
from gymckpt.testing.time import drain

from ..support import error_code
from .agent_support import (
    TOKEN,
    TOOLS,
    AgentClient,
    Fakes,
    agent_config,
    arun,
    fake_servers,
    records,
    until,
    user,
    wait_event,
)

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

PROMPT = user("count to three")
AUTH_HEADERS = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def fakes() -> Iterator[Fakes]:
    with fake_servers(tool_turns=2) as served:
        yield served


def _function_call(n: int, results: int) -> dict[str, Any]:
    return {"type": "function_call", "name": "increment", "arguments": f'{{"n": {n}}}', "call_id": f"call_{results}"}


async def _baseline(fakes: Fakes, key: str = "base") -> tuple[dict[str, Any], list[str]]:
    """An uninterrupted activation: its reply and the input digests of its model calls, in order."""
    async with AgentClient(agent_config(fakes)) as agent:
        response = await agent.responses(key, PROMPT)
        assert response.status_code == 200, response.text
        assert (await agent.close_session(key)).status_code == 200
    return response.json(), [call["input_sha256"] for call in fakes.model.where(key=key)]


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# ---------------------------------------------------------------- the turn loop


def test_turn_loop_with_rollout_prefix(fakes: Fakes) -> None:
    async def main() -> None:
        async with AgentClient(agent_config(fakes)) as agent:
            response = await agent.responses("r1", PROMPT)
            assert response.status_code == 200, response.text
            reply = response.json()
            assert reply["turns"] == 3  # two tool calls, then the final message
            assert reply["expected"] == 1 + 2
            assert reply["output_text"].startswith("answer 2 ")

            model_calls = fakes.model.where()
            assert [call["path"] for call in model_calls] == ["/ng-rollout/r1/v1/responses"] * 3
            assert [call["tool_results"] for call in model_calls] == [0, 1, 2]
            tool_calls = fakes.resources.where(op="increment")
            assert [call["path"] for call in tool_calls] == ["/ng-rollout/r1/increment"] * 2
            assert [call["body"] for call in tool_calls] == [{"n": 1}, {"n": 2}]
            assert fakes.resources.counts["r1"] == reply["expected"]

            # the session lives on until /close_session
            assert agent.participant.registry.live_keys() == ["r1"]
            assert agent.participant.counts()["idle"] == 1
            session = agent.agent.sessions["r1"]
            assert session.conversation.messages[:1] == PROMPT
            assert session.conversation.messages[1] == _function_call(1, 0)
            assert session.conversation.messages[2]["role"] == "tool"
            closed = await agent.close_session("r1")
            assert closed.json() == {"closed": True}
            assert agent.participant.registry.live_keys() == []
            assert agent.agent.sessions == {}

    arun(main())


def test_checkpointing_off_installs_nothing_and_calls_without_prefix(fakes: Fakes) -> None:
    async def main() -> None:
        reply_on, _ = await _baseline(fakes, "on")
        async with AgentClient(agent_config(fakes, checkpoint=False)) as agent:
            assert agent.participant is None
            assert agent.app.state.plane is None
            status = await agent.client.get("/ng-control/v1/checkpoint/status")
            assert status.status_code == 404
            response = await agent.responses(None, PROMPT)
            assert response.status_code == 200, response.text
            assert response.json() == reply_on  # the same replies with checkpointing off
            assert [call["path"] for call in fakes.model.where(key=None)] == ["/v1/responses"] * 3
            assert [call["path"] for call in fakes.resources.where(key=None)] == ["/increment"] * 2
            assert agent.agent.sessions == {}  # no rollout context: a session of its own
            assert (await agent.close_session(None)).json() == {"closed": True}

            # a legacy /run with checkpointing off: no prefix either
            row = {"_ng_rollout_id": "L", "responses_create_params": {"input": PROMPT, "tools": TOOLS}}
            run = await agent.run(row)
            assert run.status_code == 200, run.text
            assert run.json()["reward"] == 1.0
            assert [call["path"] for call in fakes.resources.where(key=None, op="seed_session")] == ["/seed_session"]

    arun(main())


@pytest.mark.parametrize("session_hooks", [True, False])
def test_agent_work_without_a_rollout_id_is_refused(fakes: Fakes, session_hooks: bool) -> None:
    async def main() -> None:
        async with AgentClient(agent_config(fakes, session_hooks=session_hooks)) as agent:
            response = await agent.responses(None, PROMPT)
            assert response.status_code == 400
            assert error_code(response) == "rollout_id_required"
            closed = await agent.close_session(None)
            assert closed.status_code == 400
            assert error_code(closed) == "rollout_id_required"
            run = await agent.run({"responses_create_params": {"input": PROMPT, "tools": TOOLS}})
            assert run.status_code == 400
            assert error_code(run) == "rollout_id_required"
            bad = await agent.run({"_ng_rollout_id": "x-a1", "_ng_attempt_index": 1})
            assert bad.status_code == 400
            assert error_code(bad) == "invalid_rollout_id"
            assert fakes.model.where() == []

    arun(main())


# ---------------------------------------------------------------- checkpoints while the loop runs


def test_checkpoint_while_waiting_on_a_model_call_is_ready_and_exports_the_boundary_before(
    fakes: Fakes, tmp_path: Path
) -> None:
    async def main() -> None:
        held = fakes.model.hold(key="r", tool_results=1)  # the second model call
        async with AgentClient(agent_config(fakes)) as agent:
            task = asyncio.create_task(agent.responses("r", PROMPT))
            await wait_event(held.entered)
            prepared = await agent.checkpoint("c1", str(tmp_path / "c1"), ["r"])
            assert prepared["phase"] == "prepared"
            assert prepared["report"]["blocker_count"] == 0
            assert prepared["report"]["counts"]["running_replay"] == 1
            assert not task.done()

            record = records(str(tmp_path / "c1"))["r"]
            assert list(record) == ["episode_id", "kind", "state", "boundary"]
            assert record["kind"] == "session"
            assert record["state"] == {"resources_url": fakes.resources_url, "tools": TOOLS}
            boundary = record["boundary"]
            # the session's messages so far: the input, the first call and its result
            assert boundary["messages"][:2] == [*PROMPT, _function_call(1, 0)]
            assert boundary["messages"][2]["role"] == "tool"
            assert len(boundary["messages"]) == 3
            assert boundary["activation"]["turns"] == 1
            assert boundary["expected"] == 1
            assert boundary["pending_call"] is None
            assert boundary["last"] is None

            await agent.resume("c1")
            held.release.set()
            response = await asyncio.wait_for(task, 15)
            assert response.status_code == 200, response.text
            assert response.json()["turns"] == 3

    arun(main())


def test_checkpoint_waits_for_a_tool_call_then_the_session_parks(fakes: Fakes, tmp_path: Path) -> None:
    async def main() -> None:
        held = fakes.resources.hold(key="r", op="increment")  # the first tool call
        async with AgentClient(agent_config(fakes)) as agent:
            participant = agent.participant
            task = asyncio.create_task(agent.responses("r", PROMPT))
            await wait_event(held.entered)
            prepare = asyncio.create_task(agent.control("prepare", "c1"))
            await until(lambda: participant.registry.closed)
            await drain()
            assert not prepare.done()  # the checkpoint waits for the tool call
            assert not participant.ready()
            assert participant.blockers(100) == ["r"]

            held.release.set()
            prepared = (await asyncio.wait_for(prepare, 15)).json()
            assert prepared["phase"] == "prepared"
            assert prepared["report"]["ready"]
            assert prepared["report"]["counts"]["parked"] == 1  # at the boundary after the tool call
            await drain()
            assert len(fakes.model.where(key="r")) == 1  # the next model call waits for resume

            committed = await agent.control("commit", "c1", checkpoint_dir=str(tmp_path / "c1"), episode_ids=["r"])
            assert committed.status_code == 200, committed.text
            boundary = records(str(tmp_path / "c1"))["r"]["boundary"]
            assert len(boundary["messages"]) == 3
            assert boundary["messages"][2]["content"] == '{"count":1}'
            assert boundary["expected"] == 1

            await agent.resume("c1")
            response = await asyncio.wait_for(task, 15)
            assert response.json()["expected"] == 3
            assert len(fakes.model.where(key="r")) == 3

    arun(main())


def test_session_woken_by_resume_stays_parked_when_a_new_checkpoint_closed_first(fakes: Fakes) -> None:
    async def main() -> None:
        held = fakes.model.hold(key="w", tool_results=0)
        async with AgentClient(agent_config(fakes)) as agent:
            participant = agent.participant
            task = asyncio.create_task(agent.responses("w", PROMPT))
            await wait_event(held.entered)
            await participant.close_admission("c-test")
            held.release.set()
            # the replay step's result came back while closed: parked, still at the boundary before it
            await until(lambda: participant.counts()["parked"] == 1)

            await participant.open_admission()
            await participant.close_admission("c-test")  # before the woken session ran
            await drain()
            assert participant.counts()["parked"] == 1
            assert len(fakes.model.where(key="w")) == 1
            exported = await participant.export(["w"])
            assert exported[0]["boundary"]["messages"] == PROMPT
            assert exported[0]["boundary"]["activation"]["turns"] == 0

            await participant.open_admission()
            response = await asyncio.wait_for(task, 15)
            assert response.status_code == 200, response.text
            assert response.json()["turns"] == 3

    arun(main())


# ---------------------------------------------------------------- restore


def test_restored_session_continues_under_the_next_attempt(fakes: Fakes, tmp_path: Path) -> None:
    async def main() -> None:
        baseline, baseline_calls = await _baseline(fakes)
        first, second = str(tmp_path / "c1"), str(tmp_path / "c2")

        held = fakes.model.hold(key="r", tool_results=1)
        async with AgentClient(agent_config(fakes)) as crashed:
            task = asyncio.create_task(crashed.responses("r", PROMPT))
            await wait_event(held.entered)
            await crashed.checkpoint("c1", first, ["r"])
            await _cancel(task)  # the agent process dies with its checkpoint open
        held.release.set()
        completed_before = [call["input_sha256"] for call in fakes.model.where(key="r")][:-1]
        assert completed_before == baseline_calls[:1]
        fakes.resources.rename("r", "r-a1")  # the counter's own restore

        async with AgentClient(agent_config(fakes)) as agent:
            assert await agent.restore("c1", first, ["r"]) == ["r-a1"]
            assert agent.participant.registry.get("r-a1").restored
            await agent.resume("c1")

            # a restored session whose replacement has not started yet is exported again
            await agent.checkpoint("c2", second, ["r-a1"])
            await agent.resume("c2")
            again = records(second)["r-a1"]
            assert again["boundary"] == records(first)["r"]["boundary"]
            assert again["state"] == records(first)["r"]["state"]

            response = await agent.responses("r-a1", PROMPT)
            assert response.status_code == 200, response.text
            assert response.json() == baseline
            continued = [call["input_sha256"] for call in fakes.model.where(key="r-a1")]
            assert continued == baseline_calls[1:]  # only the remaining model calls
            assert not set(completed_before) & set(continued)
            assert [call["body"] for call in fakes.resources.where(key="r-a1", op="increment")] == [{"n": 2}]
            assert fakes.resources.counts["r-a1"] == baseline["expected"]

            stale = await agent.responses("r", PROMPT)
            assert stale.status_code == 409
            assert error_code(stale) == "stale_attempt"

    arun(main())


def test_restored_completed_activation_is_replayed_without_model_calls(fakes: Fakes, tmp_path: Path) -> None:
    async def main() -> None:
        directory = str(tmp_path / "c1")
        async with AgentClient(agent_config(fakes)) as crashed:
            done = await crashed.responses("d", PROMPT)
            assert done.status_code == 200
            await crashed.checkpoint("c1", directory, ["d"])
        boundary = records(directory)["d"]["boundary"]
        assert boundary["activation"] is None
        assert boundary["last"]["reply"] == done.json()

        async with AgentClient(agent_config(fakes)) as agent:
            await agent.restore("c1", directory, ["d"])
            await agent.resume("c1")
            # the environment replays its invoke-agent step: the same reply, no model call
            again = await agent.responses("d-a1", PROMPT)
            assert again.json() == done.json()
            assert fakes.model.where(key="d-a1") == []
            # a later, different activation of the session goes on from the restored conversation
            more = await agent.responses("d-a1", user("and again"))
            assert more.status_code == 200
            calls = fakes.model.where(key="d-a1")
            assert calls[0]["tool_results"] == 2  # the restored history came along
            assert (await agent.close_session("d-a1")).status_code == 200

    arun(main())


# ---------------------------------------------------------------- legacy /run


def _row(rollout_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "_ng_rollout_id": rollout_id,
        "responses_create_params": {"input": PROMPT, "tools": TOOLS},
        "task_input": {"target": 3},
        **extra,
    }


def test_legacy_run_is_exported_and_continues_with_its_verify_mode(fakes: Fakes, tmp_path: Path) -> None:
    async def main() -> None:
        directory = str(tmp_path / "c1")
        fakes.resources.verify_mode = "replay"
        held = fakes.model.hold(key="L", tool_results=1)
        async with AgentClient(agent_config(fakes)) as crashed:
            task = asyncio.create_task(crashed.run(_row("L")))
            await wait_event(held.entered)
            prepared = await crashed.checkpoint("c1", directory, ["L"])
            assert prepared["report"]["counts"]["running_replay"] == 1
            await _cancel(task)
        held.release.set()
        record = records(directory)["L"]
        assert list(record) == ["episode_id", "kind", "boundary"]
        assert record["kind"] == "run"
        assert record["boundary"]["seeded"] is True
        assert record["boundary"]["verify_mode"] == "replay"  # from the seed reply's header
        assert record["boundary"]["verify"] is None
        assert len(record["boundary"]["conversation"]["messages"]) == 3
        assert [call["body"] for call in fakes.resources.where(key="L", op="seed_session")] == [
            {"task_input": {"target": 3}}
        ]
        fakes.resources.rename("L", "L-a1")
        fakes.resources.verify_mode = "wait"  # the restored episode keeps the mode it was told

        held_verify = fakes.resources.hold(key="L-a1", op="verify")
        async with AgentClient(agent_config(fakes)) as agent:
            assert await agent.restore("c1", directory, ["L"]) == ["L-a1"]
            await agent.resume("c1")
            other = _row("L", _ng_attempt_index=1)
            other["responses_create_params"] = {"input": user("something else"), "tools": TOOLS}
            mismatch = await agent.run(other)
            assert mismatch.status_code == 409
            assert error_code(mismatch) == "restored_input_mismatch"
            assert agent.participant.registry.get("L-a1") is not None  # the restored episode is kept
            task = asyncio.create_task(agent.run(_row("L", _ng_attempt_index=1)))
            await wait_event(held_verify.entered)
            # verify in flight runs in replay mode: the checkpoint does not wait for it
            prepared = await agent.control("prepare", "c2")
            report = prepared.json()["report"]
            assert report["ready"], report
            assert report["counts"]["running_replay"] == 1
            await agent.resume("c2")
            held_verify.release.set()
            response = await asyncio.wait_for(task, 15)
            assert response.status_code == 200, response.text
            result = response.json()
            assert result["reward"] == 1.0  # the count came back with the counter's restore
            assert result["response"]["turns"] == 3
            assert result["response"]["expected"] == 3
            assert fakes.resources.where(key="L-a1", op="seed_session") == []  # not seeded again
            assert [call["tool_results"] for call in fakes.model.where(key="L-a1")] == [1, 2]
            assert agent.participant.registry.live_keys() == []  # a run is an episode of its own

    arun(main())


def test_legacy_run_verify_in_wait_mode_blocks_the_checkpoint(fakes: Fakes) -> None:
    async def main() -> None:
        held = fakes.resources.hold(key="V", op="verify")
        async with AgentClient(agent_config(fakes)) as agent:
            participant = agent.participant
            task = asyncio.create_task(agent.run(_row("V")))
            await wait_event(held.entered)
            await participant.close_admission("c-test")
            assert participant.blockers(100) == ["V"]
            held.release.set()
            await until(participant.ready)
            await participant.open_admission()
            response = await asyncio.wait_for(task, 15)
            assert response.json()["reward"] == 1.0

    arun(main())


def test_legacy_run_marked_restart_by_its_seed_reply(fakes: Fakes) -> None:
    async def main() -> None:
        fakes.resources.restart = True
        held = fakes.model.hold(key="R", tool_results=0)
        async with AgentClient(agent_config(fakes)) as agent:
            participant = agent.participant
            task = asyncio.create_task(agent.run(_row("R")))
            await wait_event(held.entered)
            assert participant.restarts() == ["R"]
            assert await participant.export(["R"]) == []
            held.release.set()
            assert (await asyncio.wait_for(task, 15)).status_code == 200
            assert participant.restarts() == []

    arun(main())


# ---------------------------------------------------------------- restart-only agents


def test_restart_only_agent_reports_restarts_and_exports_nothing(fakes: Fakes, tmp_path: Path) -> None:
    async def main() -> None:
        held = fakes.model.hold(key="x", tool_results=1)
        async with AgentClient(agent_config(fakes, session_hooks=False)) as crashed:
            assert isinstance(crashed.participant, RestartOnlyAgentParticipant)
            task = asyncio.create_task(crashed.responses("x", PROMPT))
            await wait_event(held.entered)
            prepared = await crashed.control("prepare", "c1")
            report = prepared.json()["report"]
            assert report["ready"]
            assert report["blocker_count"] == 0
            assert report["restarts"] == ["x"]
            refused = await crashed.control("commit", "c1", checkpoint_dir=str(tmp_path / "c1"), episode_ids=["x"])
            assert refused.status_code == 409
            assert error_code(refused) == "restart_in_scope"
            assert await crashed.participant.export(["x"]) == []
            committed = await crashed.control("commit", "c1", checkpoint_dir=str(tmp_path / "c1"), episode_ids=[])
            assert committed.json()["record_count"] == 0
            await _cancel(task)
        held.release.set()

        # after the crash the rollout starts over as its next attempt
        async with AgentClient(agent_config(fakes, session_hooks=False)) as agent:
            assert await agent.restore("c1", str(tmp_path / "c1"), []) == []
            await agent.resume("c1")
            response = await agent.responses("x-a1", PROMPT)
            assert response.status_code == 200
            assert [call["tool_results"] for call in fakes.model.where(key="x-a1")] == [0, 1, 2]
            assert agent.participant.restarts() == ["x-a1"]  # until the session closes
            await agent.close_session("x-a1")
            assert agent.participant.restarts() == []

    arun(main())


def test_participant_choice_follows_the_hooks() -> None:
    class Hooks:
        async def export_agent_sessions(self, keys: list[str]) -> dict[str, Any]:
            return {}

        async def restore_agent_sessions(self, states: Any) -> None:
            return None

        async def retire_agent_session(self, key: str) -> None:
            return None

    class Partial:
        async def export_agent_sessions(self, keys: list[str]) -> dict[str, Any]:
            return {}

    assert has_session_hooks(Hooks())
    assert not has_session_hooks(Partial())
    assert isinstance(agent_participant(Hooks()), AgentSessionParticipant)
    assert isinstance(agent_participant(Partial()), RestartOnlyAgentParticipant)
    assert isinstance(agent_participant(None), RestartOnlyAgentParticipant)
    with pytest.raises(TypeError):
        AgentSessionParticipant(Partial())  # type: ignore[arg-type]


# ---------------------------------------------------------------- retire


def test_retire_stops_the_attempt_and_later_requests_are_stale(fakes: Fakes) -> None:
    async def main() -> None:
        held = fakes.model.hold(key="z", tool_results=0)
        async with AgentClient(agent_config(fakes)) as agent:
            participant = agent.participant
            idle = await agent.responses("y", PROMPT)  # a finished activation, session still open
            assert idle.status_code == 200
            task = asyncio.create_task(agent.responses("z", PROMPT))
            await wait_event(held.entered)

            retired = await agent.control("retire", "retire-1", episode_ids=["z", "y-a2"])
            assert retired.status_code == 200, retired.text
            assert retired.json()["retired_count"] == 2
            response = await asyncio.wait_for(task, 15)
            assert response.status_code == 409
            assert error_code(response) == "stale_attempt"
            # the attempts and the earlier attempts of the same rollouts are freed
            assert participant.registry.live_keys() == []
            assert agent.agent.sessions == {}

            for key in ("z", "y", "y-a1", "y-a2"):
                stale = await agent.responses(key, PROMPT)
                assert stale.status_code == 409, key
                assert error_code(stale) == "stale_attempt"
            assert error_code(await agent.close_session("z")) == "stale_attempt"
            later = await agent.responses("z-a1", PROMPT)
            assert later.status_code == 200, later.text

    arun(main())


def test_a_second_activation_of_a_busy_session_is_refused(fakes: Fakes) -> None:
    async def main() -> None:
        held = fakes.model.hold(key="b", tool_results=0)
        async with AgentClient(agent_config(fakes)) as agent:
            task = asyncio.create_task(agent.responses("b", PROMPT))
            await wait_event(held.entered)
            busy = await agent.responses("b", PROMPT)
            assert busy.status_code == 409
            assert error_code(busy) == "session_busy"
            assert error_code(await agent.close_session("b")) == "session_busy"
            held.release.set()
            assert (await asyncio.wait_for(task, 15)).status_code == 200

    arun(main())


def test_an_activation_cancelled_before_it_ran_frees_its_session() -> None:
    class Hooks:
        async def export_agent_sessions(self, keys: list[str]) -> dict[str, Any]:
            return {key: {} for key in keys}

        async def restore_agent_sessions(self, states: Any) -> None:
            return None

        async def retire_agent_session(self, key: str) -> None:
            return None

    async def main() -> None:
        participant = AgentSessionParticipant(Hooks())

        async def body(activation: Any) -> str:
            await activation.record(lambda: "after")
            return "done"

        for kind in ("session", "run"):
            outer = asyncio.ensure_future(participant.run("k", body, kind=kind))
            await asyncio.sleep(0)  # the outer call started its activation task, which has not run yet
            outer.cancel()
            await asyncio.gather(outer, return_exceptions=True)
            await drain()
            assert participant.counts()["activations"] == 0
            assert await participant.run("k", body, kind=kind) == "done"
            live = participant.registry.live_keys()
            assert live == (["k"] if kind == "session" else [])
            if kind == "session":
                assert participant.registry.get("k").boundary == "after"
                await participant.close_session("k")

    arun(main())


@pytest.mark.parametrize("session_hooks", [True, False])
def test_a_new_session_while_a_checkpoint_is_open_is_parked(fakes: Fakes, session_hooks: bool) -> None:
    """A new agent session (or legacy run) while closed is 409 checkpoint_parked; a live one parks instead."""

    async def main() -> None:
        async with AgentClient(agent_config(fakes, session_hooks=session_hooks)) as agent:
            status = await agent.client.get("/ng-control/v1/checkpoint/status", headers=AUTH_HEADERS)
            assert status.json()["accepting"] is True
            prepared = await agent.control("prepare", "p1")
            assert prepared.json()["phase"] == "prepared", prepared.text
            status = await agent.client.get("/ng-control/v1/checkpoint/status", headers=AUTH_HEADERS)
            assert status.json()["accepting"] is False
            refused = await agent.responses("fresh", PROMPT)
            assert (refused.status_code, error_code(refused)) == (409, "checkpoint_parked")
            assert fakes.model.where(key="fresh") == []  # refused before any model call
            assert agent.participant.registry.get("fresh") is None
            await agent.resume("p1")
            assert (await agent.responses("fresh", PROMPT)).status_code == 200

    arun(main())
