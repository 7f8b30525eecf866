"""Servers as real processes: `gymckpt serve` on a kept socket, SIGKILL of the process group, restart."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
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


def _environment_stack(downstream: str) -> dict[str, Any]:
    """A stack of one environment server whose agent and resources server are ``downstream``."""
    return {
        "checkpoint": {"enabled": True, "control_auth_token": "t"},
        "servers": [
            {"name": "env", "kind": "environment", "config": {"agent_url": downstream, "resources_url": downstream}}
        ],
    }


def test_a_killed_server_restarts_on_the_same_port(tmp_path: Any) -> None:
    fake = FakeDownstream()
    with serve(fake.app) as downstream:
        spec = _environment_stack(downstream)
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


def _queued_run(url: str, key: str) -> socket.socket:
    """A raw connection with a whole ``/run`` request written: it waits in the server's backlog."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"episode_id": key, "task": TASK}).encode()
    client = socket.create_connection((host, int(port)), timeout=60)
    head = (
        f"POST /run HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    client.sendall(head.encode() + body)
    return client


@pytest.mark.parametrize("drop_backlog", [True, False])
def test_a_crash_that_drops_the_backlog_keeps_queued_requests_from_the_fresh_process(
    tmp_path: Any, drop_backlog: bool
) -> None:
    """A request that waited in the listening socket's backlog when its server was killed reaches the next
    process unless the kill renews the socket (what RolloutHarness.crash does: a node's loss takes it along)."""
    fake = FakeDownstream()
    with serve(fake.app) as downstream:
        spec = _environment_stack(downstream)
        with load_stack(spec, workdir=tmp_path) as stack:
            stack.start()
            url = stack.urls["env"]
            assert asyncio.run(_run(url, "first"))["result"]["reward"] == 1.0
            group = stack.servers["env"].process.pid  # type: ignore[union-attr]
            os.killpg(group, signal.SIGSTOP)  # it accepts nothing more: the next connection waits in the backlog
            queued = _queued_run(url, "queued")
            try:
                stack.kill(["env"], drop_backlog=drop_backlog)
                stack.start()
                assert stack.urls["env"] == url
                assert asyncio.run(_run(url, "after"))["result"]["reward"] == 1.0  # accepted after any queued one
                try:
                    answer = queued.recv(4096)
                except ConnectionResetError:
                    answer = b""
            finally:
                queued.close()
        served = {path.split("/")[2] for _, path in fake.calls if path.startswith("/ng-rollout/")}
        if drop_backlog:
            assert answer == b"" and served == {"first", "after"}, (answer, served)
        else:  # the socket kept across the kill: the fresh process served a request sent to the dead one
            assert answer.startswith(b"HTTP/1.1 200") and served == {"first", "queued", "after"}, (answer, served)
