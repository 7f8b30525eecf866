"""The environment server and participant (P1): stages as steps, checkpoint, restore, continue."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from typing import Any

import httpx
import orjson
import pytest

from gymckpt.control.routes import CONTROL_PREFIX
from gymckpt.errors import InvalidCheckpointState
from gymckpt.participants.environment import EnvironmentParticipant, task_digest
from gymckpt.servers.environment import EnvironmentConfig, build_environment_app
from gymckpt.store import open_store
from gymckpt.testing.net import serve

from .env_support import FakeDownstream

TOKEN = "env-token"
TASK = {"task_id": {"taskset": "demo", "task_id": "t1"}, "task_input": {"prompt": "count"}}


@pytest.fixture
def fake() -> Any:
    downstream = FakeDownstream()
    with serve(downstream.app) as url:
        downstream.url = url  # type: ignore[attr-defined]
        yield downstream
        for gate in downstream.gates.values():
            gate.set()


def _config(fake: Any, enabled: bool) -> EnvironmentConfig:
    block = {"enabled": True, "control_auth_token": TOKEN} if enabled else {"enabled": False}
    return EnvironmentConfig(agent_url=fake.url, resources_url=fake.url, checkpoint=block)


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://env", timeout=60)


async def _control(client: httpx.AsyncClient, op: str, **body: Any) -> httpx.Response:
    body.setdefault("deadline_ts", time.time() + 30)
    return await client.post(f"{CONTROL_PREFIX}/{op}", json=body, headers={"Authorization": f"Bearer {TOKEN}"})


async def _status(client: httpx.AsyncClient) -> dict[str, Any]:
    reply = await client.get(f"{CONTROL_PREFIX}/status", headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


async def _entered(fake: Any, name: str) -> None:
    assert await asyncio.to_thread(fake.entered[name].wait, 30), f"{name} never started"


def test_checkpointing_off_installs_nothing_and_calls_without_prefix(fake: Any) -> None:
    async def main() -> None:
        async with _client(build_environment_app(_config(fake, False))) as client:
            reply = await client.post("/run", json={"episode_id": "r", "task": TASK})
            assert reply.json()["result"] == {"reward": 1.0, "response": "answer 7"}
            assert (await client.get(f"{CONTROL_PREFIX}/status")).status_code == 404
        assert [path for _, path in fake.calls] == ["/seed_session", "/v1/responses", "/close_session", "/verify"]

    asyncio.run(main())


def test_checkpointing_on_sends_every_call_for_the_episode(fake: Any) -> None:
    async def main() -> None:
        async with _client(build_environment_app(_config(fake, True))) as client:
            reply = await client.post("/run", json={"episode_id": "r-a2", "task": TASK})
            assert reply.json() == {
                "episode_id": {"rollout_id": "r", "attempt": 2},
                "task_id": TASK["task_id"],
                "result": {"reward": 1.0, "response": "answer 7"},
            }
        assert [path for _, path in fake.calls] == [
            "/ng-rollout/r-a2/seed_session",
            "/ng-rollout/r-a2/v1/responses",
            "/ng-rollout/r-a2/close_session",
            "/ng-rollout/r-a2/verify",
        ]

    asyncio.run(main())


def test_a_checkpoint_during_the_agent_call_continues_after_a_crash(fake: Any, tmp_path: Any) -> None:
    fake.gates["agent"] = threading.Event()
    fake.entered["agent"] = threading.Event()
    checkpoint_dir = str(tmp_path / "ckpt")

    async def before_crash() -> None:
        async with _client(build_environment_app(_config(fake, True))) as client:
            run = asyncio.create_task(client.post("/run", json={"episode_id": "r", "task": TASK}))
            await _entered(fake, "agent")
            prepared = (await _control(client, "prepare", checkpoint_id="c1")).json()
            assert prepared["phase"] == "prepared"  # the agent call replays: it does not block
            commit = await _control(
                client, "commit", checkpoint_id="c1", checkpoint_dir=checkpoint_dir, episode_ids=["r"]
            )
            assert commit.status_code == 200, commit.text
            run.cancel()  # the crash: the episode never finishes here

    asyncio.run(before_crash())
    (record,) = open_store(checkpoint_dir).read_participant("", kind="environment", instance="environment-0")
    assert record["boundary"]["stage"] == "invoke_agent"
    fake.gates["agent"].set()
    fake.calls.clear()

    async def after_crash() -> None:
        async with _client(build_environment_app(_config(fake, True))) as client:
            restored = await _control(
                client, "restore", checkpoint_id="c1", checkpoint_dir=checkpoint_dir, episode_ids=["r"]
            )
            assert restored.json()["restored"] == ["r-a1"]
            assert (await _control(client, "resume", checkpoint_id="c1")).status_code == 200
            reply = await client.post("/run", json={"episode_id": "r-a1", "task": TASK})
            assert reply.json()["result"] == {"reward": 1.0, "response": "answer 7"}
            stale = await client.post("/run", json={"episode_id": "r", "task": TASK})
            assert stale.status_code == 409 and stale.json()["error"]["code"] == "stale_attempt"

    asyncio.run(after_crash())
    # seeding completed before the checkpoint: it is not made again
    assert [path for _, path in fake.calls] == [
        "/ng-rollout/r-a1/v1/responses",
        "/ng-rollout/r-a1/close_session",
        "/ng-rollout/r-a1/verify",
    ]


def test_a_wait_step_in_flight_blocks_prepare_until_it_finishes(fake: Any) -> None:
    fake.gates["close"] = threading.Event()
    fake.entered["close"] = threading.Event()

    async def main() -> None:
        async with _client(build_environment_app(_config(fake, True))) as client:
            run = asyncio.create_task(client.post("/run", json={"episode_id": "w", "task": TASK}))
            await _entered(fake, "close")
            prepared = (await _control(client, "prepare", checkpoint_id="c2", deadline_ts=time.time() + 0.2)).json()
            assert prepared["phase"] == "preparing"
            assert prepared["report"]["blockers"] == ["w"]
            fake.gates["close"].set()
            prepared = (await _control(client, "prepare", checkpoint_id="c2")).json()
            assert prepared["phase"] == "prepared"
            assert not run.done()  # parked after the wait step: no reply while prepared
            assert (await _control(client, "resume", checkpoint_id="c2")).status_code == 200
            assert (await asyncio.wait_for(run, 30)).json()["result"]["reward"] == 1.0

    asyncio.run(main())


def test_a_new_episode_while_a_checkpoint_is_open_is_parked_and_runs_after_resume(fake: Any) -> None:
    async def main() -> None:
        async with _client(build_environment_app(_config(fake, True))) as client:
            assert (await _control(client, "prepare", checkpoint_id="p1")).json()["phase"] == "prepared"
            parked = await client.post("/run", json={"episode_id": {"rollout_id": "n", "attempt": 0}, "task": TASK})
            assert (parked.status_code, parked.json()["error"]["code"]) == (409, "checkpoint_parked")
            assert fake.calls == []  # refused before any step
            status = await _status(client)
            assert status["report"]["counts"].get("live", 0) == 0
            assert (await _control(client, "resume", checkpoint_id="p1")).status_code == 200
            reply = await client.post("/run", json={"episode_id": {"rollout_id": "n", "attempt": 0}, "task": TASK})
            assert reply.status_code == 200, reply.text
            assert reply.json()["episode_id"] == {"rollout_id": "n", "attempt": 0}

    asyncio.run(main())


def test_a_step_a_downstream_parked_is_called_again_when_the_environment_reopens(fake: Any) -> None:
    """The agent refused with checkpoint_parked while the checkpoint was open: the episode waits
    at its boundary and makes the call again after resume (the caller retries, as the code says)."""
    fake.gates["agent"] = threading.Event()
    fake.entered["agent"] = threading.Event()

    async def main() -> None:
        async with _client(build_environment_app(_config(fake, True))) as client:
            run = asyncio.create_task(client.post("/run", json={"episode_id": "q", "task": TASK}))
            await _entered(fake, "agent")
            assert (await _control(client, "prepare", checkpoint_id="p2")).json()["phase"] == "prepared"
            fake.park_agent = 1
            fake.gates["agent"].set()  # the agent answers checkpoint_parked while the environment is closed
            status: dict[str, Any] = {}
            give_up = time.monotonic() + 30
            while time.monotonic() < give_up:  # until the refused step has parked the episode again
                status = (
                    await client.get(f"{CONTROL_PREFIX}/status", headers={"Authorization": f"Bearer {TOKEN}"})
                ).json()
                if fake.park_agent == 0 and status["report"]["counts"].get("parked") == 1:
                    break
                await asyncio.sleep(0)  # a yield to the run in this loop, not a pause
            assert status["report"]["counts"].get("parked") == 1, status
            assert not run.done()
            assert [name for name, _ in fake.calls].count("agent") == 1
            assert (await _control(client, "resume", checkpoint_id="p2")).status_code == 200
            reply = await asyncio.wait_for(run, 30)
            assert reply.json()["result"] == {"reward": 1.0, "response": "answer 7"}
            assert [name for name, _ in fake.calls].count("agent") == 2

    asyncio.run(main())


def test_a_step_a_downstream_parked_while_the_environment_is_open_is_called_again(fake: Any) -> None:
    fake.park_agent = 2

    async def main() -> None:
        async with _client(build_environment_app(_config(fake, True))) as client:
            reply = await client.post("/run", json={"episode_id": "o", "task": TASK})
            assert reply.json()["result"] == {"reward": 1.0, "response": "answer 7"}
            assert [name for name, _ in fake.calls].count("agent") == 3

    asyncio.run(main())


def test_a_continued_attempt_must_bring_the_same_task(fake: Any, tmp_path: Any) -> None:
    fake.gates["agent"] = threading.Event()
    fake.entered["agent"] = threading.Event()
    checkpoint_dir = str(tmp_path / "ckpt")

    async def before_crash() -> None:
        async with _client(build_environment_app(_config(fake, True))) as client:
            run = asyncio.create_task(client.post("/run", json={"episode_id": "m", "task": TASK}))
            await _entered(fake, "agent")
            await _control(client, "prepare", checkpoint_id="c3")
            await _control(client, "commit", checkpoint_id="c3", checkpoint_dir=checkpoint_dir, episode_ids=["m"])
            run.cancel()

    asyncio.run(before_crash())
    fake.gates["agent"].set()

    async def after_crash() -> None:
        async with _client(build_environment_app(_config(fake, True))) as client:
            await _control(client, "restore", checkpoint_id="c3", checkpoint_dir=checkpoint_dir, episode_ids=["m"])
            await _control(client, "resume", checkpoint_id="c3")
            other = {**TASK, "task_input": {"prompt": "something else"}}
            reply = await client.post("/run", json={"episode_id": "m-a1", "task": other})
            assert reply.status_code == 422 and reply.json()["error"]["code"] == "invalid_checkpoint_state"

    asyncio.run(after_crash())


def test_retire_stops_a_running_episode_and_refuses_its_attempt(fake: Any) -> None:
    fake.gates["agent"] = threading.Event()
    fake.entered["agent"] = threading.Event()

    async def main() -> None:
        async with _client(build_environment_app(_config(fake, True))) as client:
            run = asyncio.create_task(client.post("/run", json={"episode_id": "x", "task": TASK}))
            await _entered(fake, "agent")
            retired = await _control(client, "retire", checkpoint_id="c4", episode_ids=["x"])
            assert retired.json()["retired_count"] == 1
            reply = (await asyncio.wait_for(run, 30)).json()
            assert reply["failure"] == {"failure_reason": "retired", "terminal": True}
            again = await client.post("/run", json={"episode_id": "x", "task": TASK})
            assert again.json()["error"]["code"] == "stale_attempt"
            status = await _status(client)
            assert status["report"]["counts"]["live"] == 0

    asyncio.run(main())


def test_the_task_digest_is_the_references_and_gymckpts_older_digest_still_continues() -> None:
    """sha256 of ``json.dumps(task, sort_keys=True, separators=(",", ":"))``, ASCII escapes included."""
    task = {"task_id": {"taskset": "démo", "task_id": "t"}, "task_input": {"prompt": "ünïcode ✓", "x": 0.1}}
    reference = hashlib.sha256(json.dumps(task, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert task_digest(task) == reference
    older = hashlib.sha256(orjson.dumps(task, option=orjson.OPT_SORT_KEYS)).hexdigest()
    assert older != reference  # the two encodings differ on non-ASCII text

    async def continues(digest: str, given: dict[str, Any]) -> bool:
        participant = EnvironmentParticipant("env-0")
        await participant.install([{"episode_id": "r-a1", "task_digest": digest, "boundary": None}], ["r-a1"], None)  # type: ignore[arg-type]
        try:
            participant.begin_run("r-a1", given)
        except InvalidCheckpointState:
            return False
        return True

    assert asyncio.run(continues(reference, task))
    assert asyncio.run(continues(older, task))
    assert not asyncio.run(continues(reference, {**task, "task_input": {"prompt": "other"}}))
    assert not asyncio.run(continues(older, {**task, "task_input": {"prompt": "other"}}))
