"""Several uvicorn workers per Gym server, as real processes: restores onto another worker count,
a worker lost while a checkpoint is open, and a session cookie from before a crash.

One stack for the module; each test starts its Gym servers with the worker count it needs
(``gymckpt serve KIND --workers N``) and crashes them by SIGKILL of each server's process
group (its main process and every worker). The continued rollouts must give the result of
an uninterrupted run and make exactly the model calls the checkpoint had not completed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.errors import CoordinationError, ExportFailed, InvalidPhase
from gymckpt.workers.routing import COOKIE_NAME

from .conftest import WAIT, E2EStack, e2e_stack, next_key

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

GYM = ("environment", "model", "agent", "resources")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2EStack]:
    with e2e_stack(tmp_path_factory.mktemp("worker-counts"), references=range(4), workers=2) as running:
        yield running


@pytest.fixture
def e2e(stack: E2EStack) -> Iterator[E2EStack]:
    yield stack
    stack.end_test()


async def worker_counts(e2e: E2EStack) -> dict[str, int]:
    """How many workers each Gym server has linked to its coordinator."""
    return {name: (await e2e.status(name)).get("workers", 1) for name in GYM}


async def every_worker_linked(e2e: E2EStack, workers: int) -> None:
    """Wait (bounded) until every Gym server has ``workers`` workers linked (they start one by one)."""
    for name in GYM:
        await e2e.poll_status(name, lambda status: status.get("workers") == workers, f"{workers} linked workers")


@pytest.mark.parametrize(("before", "after"), [(1, 3), (3, 2), (2, 1)], ids=["1-to-3", "3-to-2", "2-to-1"])
def test_a_restore_onto_another_worker_count_continues_every_rollout_exactly(
    e2e: E2EStack, tmp_path: Path, before: int, after: int
) -> None:
    e2e.fresh(workers=before)

    async def scenario() -> None:
        gym = await e2e.coordinator()
        if before > 1:
            await every_worker_linked(e2e, before)
            assert await worker_counts(e2e) == dict.fromkeys(GYM, before)
        keys = {f"w{before}{after}-{index}": index for index in range(4)}
        runs = e2e.start(keys)
        await e2e.wait_for_calls(dict.fromkeys(keys, 1), runs)
        cut = await e2e.checkpoint(gym, f"counts-{before}-{after}", tmp_path / "ckpt", runs)
        assert cut.committed, "no rollout was in flight at the checkpoint"
        owners = cut.outcome.commits
        resources = next(reply for reply in owners.values() if reply.kind == "resources")
        if before > 1:  # sessions of a server with several workers name their owner
            assert resources.manifest["session_owners"], resources.manifest
        await e2e.crash(runs, cut.committed)
        await e2e.restore(cut, workers=after)
        if after > 1:
            counts = await worker_counts(e2e)
            assert counts == dict.fromkeys(GYM, after), counts
            placed = (await e2e.status("resources"))["session_placements"]
            assert placed == len([key for key in cut.records.get("resources", {}) if key in cut.committed])
        await e2e.continue_committed(cut)

    e2e.run(scenario())


def _kill_one_worker(status: dict[str, Any]) -> int:
    pid = status["worker_pids"][0]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return int(pid)


def test_a_worker_killed_while_a_checkpoint_is_open_blocks_the_checkpoint_until_resume(
    e2e: E2EStack, tmp_path: Path
) -> None:
    e2e.fresh(workers=2)

    async def scenario() -> None:
        gym = await e2e.coordinator()
        await every_worker_linked(e2e, 2)
        keys = {f"lost-{index}": index for index in range(2)}
        runs = e2e.start(keys)
        await e2e.wait_for_calls(dict.fromkeys(keys, 1), runs)
        prepared = await gym.prepare("lost-1", time.time() + WAIT)
        assert prepared.ready, prepared
        killed = _kill_one_worker(await e2e.status("agent"))
        # uvicorn's supervisor starts a new worker; the checkpoint stays blocked all the same
        status = await e2e.poll_status(
            "agent",
            lambda status: killed not in status["worker_pids"] and status["workers"] == 2,
            "a replacement worker linked",
        )
        assert "agent-worker-lost" in status["report"]["blockers"], status
        assert status["report"]["ready"] is False
        # the agent's log says so as a warning (uvicorn's supervisor logs it at INFO, among lines left out)
        log = e2e.harness.stack.servers["agent"].log_path.read_text()
        died = [line for line in log.splitlines() if f"Child process [{killed}] died" in line]
        assert len(died) == 1 and " WARNING " in died[0] and "calls it was serving are lost" in died[0], died
        assert "Waiting for application startup" not in log
        agent_url = e2e.urls["agent"]
        again = await gym.prepare("lost-1", time.time() + 3)
        assert "agent-worker-lost" in again.replies[agent_url].report.blockers, again
        with pytest.raises(CoordinationError) as refused:
            await gym.commit("lost-1", time.time() + WAIT, str(tmp_path / "ckpt"), list(keys))
        assert isinstance(refused.value.causes.get(agent_url), (InvalidPhase, ExportFailed)), refused.value.failures
        assert not list((tmp_path / "ckpt").glob("gym/agent/*/manifest.json"))
        await gym.resume("lost-1", time.time() + WAIT)
        status = await e2e.status("agent")
        assert "agent-worker-lost" not in status["report"]["blockers"], status
        # the next checkpoint is whole again
        await e2e.settle(runs.values())
        assert (await gym.prepare("lost-2", time.time() + WAIT)).ready
        commits = await gym.commit("lost-2", time.time() + WAIT, str(tmp_path / "ckpt2"), [])
        assert {reply.kind for reply in commits.values()} == set(GYM)
        await gym.resume("lost-2", time.time() + WAIT)

    e2e.run(scenario())


def test_a_session_cookie_from_before_the_crash_reaches_the_worker_that_holds_the_session_now(
    e2e: E2EStack, tmp_path: Path
) -> None:
    e2e.fresh(workers=2)

    async def scenario() -> None:
        gym = await e2e.coordinator()
        await every_worker_linked(e2e, 2)
        client = e2e.client()
        base = e2e.urls["resources"]
        key = "cookie-0"
        async with client.post(f"{base}/ng-rollout/{key}/seed_session", json={"task_input": {}}) as response:
            assert response.status == 200
            cookie = response.cookies[COOKIE_NAME].value
        for _ in range(3):
            async with client.post(
                f"{base}/ng-rollout/{key}/increment", json={"n": 2}, headers={"Cookie": f"{COOKIE_NAME}={cookie}"}
            ) as response:
                assert response.status == 200
        cut_runs: dict[str, Any] = {key: None}
        outcome = await e2e.harness.checkpoint(gym, "cookie-1", str(tmp_path / "ckpt"), list(cut_runs))
        committed = {reply.kind: reply for reply in outcome.commits.values()}
        assert committed["resources"].episode_ids == [key]
        await asyncio.to_thread(e2e.kill)
        e2e.harness.restart(workers=3)
        gym = await e2e.coordinator()
        await gym.restore("cookie-1", time.time() + WAIT, str(tmp_path / "ckpt"), [key])
        await gym.resume("cookie-1", time.time() + WAIT)
        continued = next_key(key)
        status = await e2e.status("resources")
        old_owner = cookie.split(".", 1)[0]
        assert old_owner in status["session_aliases"], status
        # the old cookie, on whichever worker takes each request, reaches the restored session: 6 + 1 each time
        counts = []
        for _ in range(6):
            async with client.post(
                f"{base}/ng-rollout/{continued}/increment",
                json={"n": 1},
                headers={"Cookie": f"{COOKIE_NAME}={cookie}"},
            ) as response:
                assert response.status == 200, await response.text()
                counts.append((await response.json())["count"])
        assert counts == [7, 8, 9, 10, 11, 12]

    e2e.run(scenario())
