"""Verification in flight at a checkpoint: waited for or replayed, as the resources server declares.

The counter declares ``checkpoint_verify = "wait"``, the weather server ``"replay"``. A
verification has no latency of its own, so :class:`~tests.e2e.conftest.ResourcesGate` (a
pass-through proxy in front of the resources server) holds the ``/verify`` of chosen
rollouts: it is in flight for the environment until the test releases it. Every Gym server
runs two uvicorn workers (the gate passes the session cookies they route by).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import pytest

from .conftest import WAIT, E2EStack, calls_of, e2e_stack, fresh, next_key

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


@pytest.fixture(scope="module")
def counter_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2EStack]:
    with e2e_stack(tmp_path_factory.mktemp("gated-counter"), references=range(3), gate=True, workers=2) as running:
        yield running


@pytest.fixture(scope="module")
def weather_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2EStack]:
    # the weather tool does not take the policy's {"n": …} arguments: no tool turns, one model call per rollout
    with e2e_stack(
        tmp_path_factory.mktemp("gated-weather"),
        references=range(2),
        gate=True,
        resources="weather",
        tool_turns=0,
        workers=2,
    ) as running:
        yield running


@pytest.fixture
def counter(counter_stack: E2EStack) -> Iterator[E2EStack]:
    with fresh(counter_stack) as running:
        yield running


@pytest.fixture
def weather(weather_stack: E2EStack) -> Iterator[E2EStack]:
    with fresh(weather_stack) as running:
        yield running


async def _blocked_prepare(e2e: E2EStack, checkpoint_id: str, blockers: list[str]) -> None:
    """Prepare while ``blockers`` verify (a wait step): the environment reports them until the gate releases."""
    gym = await e2e.coordinator()
    prepare = asyncio.create_task(gym.prepare(checkpoint_id, time.time() + WAIT))
    status = await e2e.poll_status(
        "environment",
        lambda status: status["phase"] == "preparing" and sorted(status["report"]["blockers"]) == blockers,
        f"preparing with blockers {blockers}",
    )
    assert status["report"]["blocker_count"] == len(blockers)
    assert not prepare.done(), "prepare did not wait for the verification in flight"
    assert e2e.gate is not None
    e2e.gate.release()
    prepared = await asyncio.wait_for(prepare, WAIT)
    assert prepared.ready, prepared.blockers()


def test_a_verification_in_flight_is_waited_for_when_declared_wait(counter: E2EStack, tmp_path: Path) -> None:
    """No crash: prepare waits for the verification, the episode parks after it, resume releases it once."""
    e2e = counter
    assert e2e.gate is not None

    async def scenario() -> None:
        keys = {"wait-0": 0, "wait-1": 1}
        e2e.gate.hold(keys)
        runs = e2e.start(keys)
        await e2e.gate.wait_held(keys)
        await _blocked_prepare(e2e, "verify-wait", sorted(keys))

        gym = await e2e.coordinator()
        cut = await e2e.checkpoint(gym, "verify-wait", tmp_path / "ckpt", runs)  # prepare again: already prepared
        assert sorted(cut.committed) == sorted(keys)
        for key in keys:
            boundary = cut.records["environment"][key]["boundary"]
            assert boundary["stage"] == "done" and boundary["reward"] == e2e.expected(key).result["reward"]
            assert not runs[key].done(), f"{key} replied while Gym was prepared"

        await gym.resume("verify-wait", time.time() + WAIT)
        for key, body in zip(keys, await asyncio.wait_for(asyncio.gather(*runs.values()), WAIT), strict=True):
            e2e.assert_result(key, body)
        assert sorted(e2e.gate.verifies) == sorted(keys), "a verification ran again"
        log = await e2e.harness.model_calls()
        for key in keys:
            assert calls_of(log, key) == e2e.expected(key).pairs

    e2e.run(scenario())


def test_an_episode_finishing_during_prepare_is_neither_lost_nor_redone(counter: E2EStack, tmp_path: Path) -> None:
    """Its verification ends while prepare waits for it: it is exported finished, and after a crash its
    replacement returns the recorded result without a model call or a verification; the others continue."""
    e2e = counter
    assert e2e.gate is not None

    async def scenario() -> None:
        e2e.gate.hold(["during-0"])
        runs = e2e.start({"during-0": 0})
        await e2e.gate.wait_held(["during-0"])
        runs |= e2e.start({"during-1": 1, "during-2": 2})
        await e2e.wait_for_calls({"during-1": 1, "during-2": 1}, runs)
        await _blocked_prepare(e2e, "during-prepare", ["during-0"])

        gym = await e2e.coordinator()
        cut = await e2e.checkpoint(gym, "during-prepare", tmp_path / "ckpt", runs)
        assert "during-0" in cut.committed, "the episode that finished during prepare was lost"
        assert cut.stage("during-0") == "done"

        await e2e.crash(runs, cut.committed)
        await e2e.restore(cut)
        log = await e2e.continue_committed(cut)
        assert not calls_of(log, "during-0-a1")
        assert e2e.gate.verifies.count("during-0") == 1
        assert "during-0-a1" not in e2e.gate.verifies, "the finished episode verified again"
        for key in cut.committed:
            if key != "during-0":
                assert e2e.gate.verifies.count(next_key(key)) == 1

    e2e.run(scenario())


def test_a_verification_in_flight_is_replayed_when_declared_replay(weather: E2EStack, tmp_path: Path) -> None:
    """The checkpoint does not wait for a replay verification: it exports the boundary before it, and the
    replacement attempt verifies again (and makes no model call)."""
    e2e = weather
    assert e2e.gate is not None

    async def scenario() -> None:
        keys = {"replay-0": 0, "replay-1": 1}
        e2e.gate.hold(keys)
        runs = e2e.start(keys)
        await e2e.gate.wait_held(keys)
        gym = await e2e.coordinator()
        cut = await e2e.checkpoint(gym, "verify-replay", tmp_path / "ckpt", runs)
        assert e2e.gate.held() == set(keys), "the verifications were not in flight during the checkpoint"
        assert sorted(cut.committed) == sorted(keys)
        for key in keys:
            assert cut.stage(key) == "verify"  # the boundary before the verification
            assert cut.records["environment"][key]["boundary"]["verify_mode"] == "replay"

        await e2e.crash(runs, cut.committed)
        await e2e.restore(cut)
        log = await e2e.continue_committed(cut)
        for key in keys:
            assert not calls_of(log, next_key(key))
            assert e2e.gate.verifies.count(key) == 1
            assert e2e.gate.verifies.count(next_key(key)) == 1, "the verification was not replayed"

    e2e.run(scenario())
