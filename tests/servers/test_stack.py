"""Servers as real processes: `gymckpt serve` on a kept socket, SIGKILL of the process group, restart."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from gymckpt.stack import load_stack
from gymckpt.testing.net import serve

from .env_support import FakeDownstream

TASK = {"task_id": {"taskset": "demo", "task_id": "t1"}, "task_input": {"prompt": "count"}}


async def _run(url: str, key: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session,
        session.post(f"{url}/run", json={"episode_id": key, "task": TASK}) as response,
    ):
        return await response.json()


def test_a_killed_server_restarts_on_the_same_port(tmp_path: Any) -> None:
    fake = FakeDownstream()
    with serve(fake.app) as downstream:
        spec = {
            "checkpoint": {"enabled": True, "control_auth_token": "t"},
            "servers": [
                {"name": "env", "kind": "environment", "config": {"agent_url": downstream, "resources_url": downstream}}
            ],
        }
        workdir = tmp_path / "not" / "made" / "yet"  # made for the servers' configs and logs
        with load_stack(spec, workdir=workdir) as stack:
            stack.start()
            assert stack.servers["env"].log_path.parent == workdir and (workdir / "env.yaml").is_file()
            url = stack.urls["env"]
            assert asyncio.run(_run(url, "a"))["result"]["reward"] == 1.0
            pid = stack.servers["env"].process.pid  # type: ignore[union-attr]
            stack.kill()
            assert not stack.servers["env"].alive
            stack.start()
            assert stack.servers["env"].process.pid != pid  # type: ignore[union-attr]
            assert stack.urls["env"] == url
            assert asyncio.run(_run(url, "b"))["result"]["reward"] == 1.0
        assert [path for _, path in fake.calls][-4:] == [
            "/ng-rollout/b/seed_session",
            "/ng-rollout/b/v1/responses",
            "/ng-rollout/b/close_session",
            "/ng-rollout/b/verify",
        ]


def test_a_stack_file_with_an_unknown_kind_is_refused(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="kind"):
        load_stack({"servers": [{"name": "x", "kind": "nope"}]}, workdir=tmp_path)
