"""Big sessions end to end: sandbox sessions of 350 KB in a real server process, checkpointed through the
control plane, SIGKILLed, restored into a fresh process, and compared with uninterrupted ones.

A short version of bench_scale's scenario (b) (no timing, no memory assertion): one ``gymckpt serve
sandbox`` process group (one, then two uvicorn workers) behind a kept socket, driven over HTTP
through the rollout prefix, and a :class:`~gymckpt.control.coordination.Coordinator`.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from gymckpt.control.coordination import Coordinator
from gymckpt.identity import rollout_path
from gymckpt.servers.sandbox import DEFAULT_SESSION_BYTES, run_command, seed_state, session_digest
from gymckpt.stack.supervisor import load_stack
from gymckpt.store import open_store, verify
from gymckpt.workers.routing import COOKIE_NAME

if TYPE_CHECKING:
    from pathlib import Path

    from gymckpt.stack.supervisor import Stack

TOKEN = "big-sessions-token"
SESSIONS = 20
#: the bound of every phase, in seconds
WAIT = 120.0


def uninterrupted(key: str, index: int) -> dict[str, Any]:
    """The state rollout ``index``'s session has after its steps, computed without any server."""
    state = seed_state(key, DEFAULT_SESSION_BYTES, 32)
    state["files"]["notes.md"] = f"rollout {index}\n"
    for command in steps(index):
        output, code = run_command(state, command)
        state["history"].append({"command": command, "exit_code": code, "output": output})
    return state


def steps(index: int) -> list[str]:
    return ["ls", f"sha256sum src/pkg_0/module_{index % 32}.py", f"rm src/pkg_3/module_{24 + index % 8}.py"]


class Sandbox:
    """The sandbox server's HTTP side: each session's calls carry the cookie of the worker that owns it."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http = http
        self.url = url
        self.cookies: dict[str, str] = {}

    async def post(self, key: str, path: str, body: Any = None) -> tuple[int, Any]:
        cookie = self.cookies.get(key)
        headers = {"Cookie": f"{COOKIE_NAME}={cookie}"} if cookie else None
        async with self.http.post(f"{self.url}{rollout_path(key, path)}", json=body, headers=headers) as response:
            given = response.cookies.get(COOKIE_NAME)
            if given is not None:
                self.cookies[key] = given.value
            return response.status, await response.json()

    async def ok(self, key: str, path: str, body: Any = None) -> Any:
        status, reply = await self.post(key, path, body)
        assert status == 200, (key, path, reply)
        return reply

    async def play(self, key: str, index: int) -> None:
        await self.ok(key, "/seed_session", {"task_input": {}})
        await self.ok(key, "/write_file", {"path": "notes.md", "content": f"rollout {index}\n"})
        for command in steps(index):
            await self.ok(key, "/run_command", {"command": command})


async def coordinator(stack: Stack) -> Coordinator:
    """A discovered coordinator of the sandbox server, once each of its workers linked."""
    gym = Coordinator([stack.urls["sandbox"]], token=TOKEN, probe_timeout=WAIT)
    try:
        found = await gym.discover(require_model=False)
        assert found.ok, found.problems
        deadline = time.monotonic() + WAIT
        while (status := await gym.status(stack.urls["sandbox"])).get("workers", 1) < status.get("expected_workers", 1):
            assert time.monotonic() < deadline, status
            assert stack.servers["sandbox"].alive
            await asyncio.sleep(0.05)  # polls the status above, within the deadline
    except BaseException:
        await gym.close()
        raise
    return gym


@pytest.mark.parametrize("workers", [1, 2])
def test_big_sessions_are_checkpointed_killed_restored_and_equal(tmp_path: Path, workers: int) -> None:
    directory = str(tmp_path / "checkpoints" / "big-1")
    spec = {
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "allowed_roots": [str(tmp_path / "checkpoints")]},
        "workers": workers,
        "servers": [{"name": "sandbox", "kind": "sandbox"}],
    }
    keys = [f"{index}-0" for index in range(SESSIONS)]
    expected = {key: uninterrupted(key, index) for index, key in enumerate(keys)}

    async def scenario(stack: Stack) -> None:
        async with (
            aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as before,
            aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as after,
        ):
            sandbox = Sandbox(before, stack.urls["sandbox"])
            gym = await coordinator(stack)
            try:
                await asyncio.gather(*(sandbox.play(key, index) for index, key in enumerate(keys)))
                for key in keys:
                    assert (await sandbox.ok(key, "/digest"))["sha256"] == session_digest(expected[key]), key
                prepared = await gym.prepare("big-1", time.time() + WAIT)
                assert prepared.prepared, prepared.blockers()
                commits = await gym.commit("big-1", time.time() + WAIT, directory, keys)
                await gym.publish(directory, commits)
            finally:
                await gym.close()
            (reply,) = commits.values()
            assert reply.record_count == SESSIONS
            assert reply.records_bytes > SESSIONS * DEFAULT_SESSION_BYTES * 0.9  # each rollout removed one of 32 files
            instances.append(reply.instance)

            stack.kill(["sandbox"])  # SIGKILL of the process group: no session survives in memory
            stack.start(["sandbox"])
            sandbox.http = after  # new connections: none to the killed process is reused
            gym = await coordinator(stack)
            try:
                restored = await gym.restore("big-1", time.time() + WAIT, directory, keys)
                (restore_reply,) = restored.values()
                assert restore_reply.restored == sorted(f"{key}-a1" for key in keys)
                await gym.resume("big-1", time.time() + WAIT)
            finally:
                await gym.close()
            for index, key in enumerate(keys):
                attempt = f"{key}-a1"
                assert (await sandbox.ok(attempt, "/digest"))["sha256"] == session_digest(expected[key]), attempt
                read = await sandbox.ok(attempt, "/read_file", {"path": "notes.md"})
                assert read["content"] == f"rollout {index}\n"
                status, stale = await sandbox.post(key, "/digest")
                assert status == 409 and stale["error"]["code"] == "stale_attempt", (key, stale)
            verified = await sandbox.ok(
                "0-0-a1", "/verify", {"response": "", "expected_sha256": session_digest(expected["0-0"])}
            )
            assert verified == {"reward": 1.0}

    instances: list[str] = []
    stack = load_stack(spec, workdir=tmp_path / "stack")
    try:
        stack.start()
        asyncio.run(asyncio.wait_for(scenario(stack), 4 * WAIT))
    finally:
        stack.close()
    with open_store(directory) as store:
        stored = {
            record["episode_id"]: record["state"]
            for record in store.read_participant("", kind="resources", instance=instances[0])
        }
    assert stored == expected  # the checkpoint holds exactly the uninterrupted sessions, key order included
    assert all(list(stored[key]["files"]) == list(expected[key]["files"]) for key in keys)
    report = verify(directory)
    assert report.ok, report.errors
