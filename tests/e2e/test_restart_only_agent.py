"""An agent without session hooks is restart-only: its rollouts are reported as restarts and start over.

Every Gym server runs two uvicorn workers.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from .conftest import WAIT, E2EStack, calls_of, e2e_stack, next_key

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2EStack]:
    with e2e_stack(
        tmp_path_factory.mktemp("restart-only"), references=range(4), agent_session_hooks=False, workers=2
    ) as running:
        yield running


def test_a_restart_only_agents_rollouts_are_restarts_and_start_over(e2e: E2EStack, tmp_path: Path) -> None:
    async def scenario() -> None:
        gym = await e2e.coordinator()
        keys = {f"restart-{index}": index for index in range(4)}
        runs = e2e.start(keys)
        await e2e.wait_for_calls(dict.fromkeys(keys, 1), runs)
        cut = await e2e.checkpoint(gym, "restart-1", tmp_path / "ckpt", runs)
        in_flight = set(keys) - set(cut.finished)
        assert in_flight, "every rollout finished before the checkpoint"
        assert cut.restarts == in_flight, "the agent's rollouts were not reported as restarts"
        assert cut.outcome.scope == [] and cut.committed == []
        assert all(reply.record_count == 0 for reply in cut.outcome.commits.values()), "a restart was exported"

        await e2e.crash(runs, in_flight)  # restarts never reply while Gym is prepared either
        await e2e.restore(cut)  # nothing to install: the scope is empty
        restarted = sorted(in_flight)
        bodies = await asyncio.wait_for(
            asyncio.gather(*(e2e.harness.run(next_key(key), e2e.task(key)) for key in restarted)), WAIT
        )
        log = await e2e.harness.model_calls()
        for key, body in zip(restarted, bodies, strict=True):
            attempt = next_key(key)
            e2e.assert_result(attempt, body)
            reference = e2e.expected(key).pairs
            before = calls_of(log, key)
            assert before and before == reference[: len(before)], key
            assert calls_of(log, attempt) == reference, f"{attempt} did not start over from its input"

    e2e.run(scenario())
