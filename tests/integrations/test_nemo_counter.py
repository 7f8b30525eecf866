"""NeMo Gym's own stateful counter (``example_session_state_mgmt``), served by configuration only.

One real process (Python 3.12, nemo-gym 0.4.0) runs ``gymckpt serve --app
gymckpt.integrations.nemo_gym:app --config counter.yaml``: NeMo Gym's YAML with a
``checkpoint:`` block and a ``nemo_gym:`` block that declares where the counter's state
lives. Rollouts seed and count through the rollout prefix, a checkpoint is committed, the
process is SIGKILLed, a fresh one restores, and each rollout's replacement attempt goes on
counting, with or without the cookie it had before the crash.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from gymckpt.control.coordination import Coordinator
from gymckpt.identity import EpisodeId
from gymckpt.store import verify

from .nemo_support import TOKEN, NeMoServer, nemo_python, verify_body

if TYPE_CHECKING:
    from pathlib import Path

COOKIE = "StatefulCounterResourcesServer___counter"
WAIT = 120.0


def counter_config(
    root: Path, *, name: str = "counter", declare: bool = True, exempt: list[str] | None = None
) -> dict[str, Any]:
    checkpoint: dict[str, Any] = {"enabled": True, "control_auth_token": TOKEN, "allowed_roots": [str(root)]}
    if exempt:
        checkpoint["exempt_paths"] = exempt
    config: dict[str, Any] = {"checkpoint": checkpoint}
    if declare:
        config["nemo_gym"] = {"serve": name, "session_state": "session_id_to_counter"}
    config[name] = {
        "resources_servers": {
            "example_session_state_mgmt": {"entrypoint": "app.py", "domain": "agent", "host": "127.0.0.1"}
        }
    }
    return config


@pytest.fixture
def counter(tmp_path: Path) -> Any:
    server = NeMoServer("counter", tmp_path, nemo_python())
    server.write_config(counter_config(tmp_path))
    yield server
    server.close()


async def post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], cookie: str | None = None
) -> tuple[int, Any, str | None]:
    headers = {"Cookie": f"{COOKIE}={cookie}"} if cookie else {}
    async with session.post(url, json=body, headers=headers) as reply:
        given = reply.cookies.get(COOKIE)
        return reply.status, await reply.json(), given.value if given is not None else None


def prefixed(server: NeMoServer, key: str, path: str) -> str:
    return f"{server.url}/ng-rollout/{key}{path}"


async def seed_and_count(session: aiohttp.ClientSession, server: NeMoServer, keys: dict[str, int]) -> dict[str, str]:
    """Seed each rollout at its index and add 2; the cookie each got."""
    cookies = {}
    for key, index in keys.items():
        status, _, cookie = await post(session, prefixed(server, key, "/seed_session"), {"initial_count": index})
        assert status == 200 and cookie, (key, status)
        status, body, cookie = await post(session, prefixed(server, key, "/increment_counter"), {"count": 2}, cookie)
        assert (status, body) == (200, {"success": True}), key
        cookies[key] = cookie or cookies.get(key, "")
    return cookies


def test_the_stateful_counter_survives_sigkill_with_or_without_its_old_cookie(
    counter: NeMoServer, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            counter.start()
            await counter.wait_up(session)
            keys = {f"count-{index}": index for index in range(8)}
            cookies = await seed_and_count(session, counter, keys)
            gym = Coordinator([counter.url], token=TOKEN, probe_timeout=WAIT)
            try:
                assert (await gym.discover(require_model=False)).ok
                directory = str(tmp_path / "ckpt-1")
                prepared = await gym.prepare("ckpt-1", time.time() + WAIT)
                assert prepared.prepared, prepared.blockers()
                scope = prepared.continued(list(keys))
                commits = await gym.commit("ckpt-1", time.time() + WAIT, directory, scope)
                (commit,) = commits.values()
                assert commit.record_count == len(keys)  # every bound session, never 0 records and no error
                await gym.publish(directory, commits)
            finally:
                await gym.close()
            assert verify(directory).ok

            counter.kill()
            counter.start()
            await counter.wait_up(session)
            gym = Coordinator([counter.url], token=TOKEN, probe_timeout=WAIT)
            try:
                assert (await gym.discover(require_model=False)).ok
                restored = await gym.restore("restore-1", time.time() + WAIT, directory, scope)
                (reply,) = restored.values()
                replacements = {EpisodeId.from_capture_key(key).next_attempt().capture_key: key for key in scope}
                assert sorted(reply.restored) == sorted(replacements)
                await gym.resume("restore-1", time.time() + WAIT)
            finally:
                await gym.close()

            for number, (attempt, key) in enumerate(sorted(replacements.items())):
                cookie = cookies[key] if number % 2 == 0 else None  # half keep their pre-crash cookie
                status, body, _ = await post(
                    session, prefixed(counter, attempt, "/increment_counter"), {"count": 3}, cookie
                )
                assert (status, body) == (200, {"success": True}), (attempt, body)
                expected = keys[key] + 5
                status, body, _ = await post(session, prefixed(counter, attempt, "/get_counter_value"), {}, cookie)
                assert body == {"count": expected}, (attempt, cookie is not None)
                status, body, _ = await post(
                    session, prefixed(counter, attempt, "/verify"), verify_body(expected), cookie
                )
                assert status == 200 and body["reward"] == 1.0, (attempt, body)

    asyncio.run(asyncio.wait_for(scenario(), 4 * WAIT))


def test_a_cookie_of_another_rollout_or_attempt_is_refused_and_liveness_needs_no_rollout(
    counter: NeMoServer,
) -> None:
    async def scenario() -> None:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            counter.start()
            await counter.wait_up(session)
            cookies = await seed_and_count(session, counter, {"mine": 10, "theirs": 20})
            # r1's cookie with r2's prefix: refused, and r2's state untouched
            status, body, _ = await post(
                session, prefixed(counter, "theirs", "/get_counter_value"), {}, cookies["mine"]
            )
            assert status == 409 and body["error"]["code"] == "session_rollout_mismatch", body
            status, body, _ = await post(
                session, prefixed(counter, "theirs", "/get_counter_value"), {}, cookies["theirs"]
            )
            assert body == {"count": 22}
            # the cookie of an attempt this one does not continue (no restore made it): refused
            status, body, _ = await post(
                session, prefixed(counter, "mine-a1", "/get_counter_value"), {}, cookies["mine"]
            )
            assert status == 409 and body["error"]["code"] == "session_rollout_mismatch", body
            # NeMo Gym's liveness and metrics routes need no rollout; a tool call does
            async with session.get(counter.url + "/") as reply:
                assert reply.status == 200, await reply.text()
            async with session.post(counter.url + "/aggregate_metrics", json={"verify_responses": []}) as reply:
                assert reply.status != 400, await reply.text()
            status, body, _ = await post(session, counter.url + "/get_counter_value", {})
            assert status == 400 and body["error"]["code"] == "rollout_id_required", body

    asyncio.run(asyncio.wait_for(scenario(), 2 * WAIT))


def test_exempt_paths_are_configurable(tmp_path: Path) -> None:
    server = NeMoServer("counter", tmp_path, nemo_python())
    server.write_config(counter_config(tmp_path, exempt=["/get_counter_value"]))

    async def scenario() -> None:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            server.start()
            await server.wait_up(session)
            status, body, _ = await post(session, server.url + "/get_counter_value", {})
            assert (status, body) == (200, {"count": 0})

    try:
        asyncio.run(asyncio.wait_for(scenario(), 2 * WAIT))
    finally:
        server.close()


def test_a_restore_into_a_server_under_another_config_name_is_refused_never_silently_empty(tmp_path: Path) -> None:
    python = nemo_python()
    first = NeMoServer("counter", tmp_path, python)
    first.write_config(counter_config(tmp_path, name="counter"))
    renamed = NeMoServer("renamed", tmp_path, python)
    renamed.write_config(counter_config(tmp_path, name="renamed"))

    async def scenario() -> None:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            first.start()
            await first.wait_up(session)
            await seed_and_count(session, first, {"named": 1})
            directory = str(tmp_path / "ckpt-1")
            async with Coordinator([first.url], token=TOKEN, probe_timeout=WAIT) as gym:
                assert (await gym.discover(require_model=False)).ok
                prepared = await gym.prepare("ckpt-1", time.time() + WAIT)
                commits = await gym.commit("ckpt-1", time.time() + WAIT, directory, prepared.continued(["named"]))
                await gym.publish(directory, commits)
            first.kill()
            renamed.start()
            await renamed.wait_up(session)
            async with Coordinator([renamed.url], token=TOKEN, probe_timeout=WAIT) as gym:
                assert (await gym.discover(require_model=False)).ok
                with pytest.raises(Exception) as failed:
                    await gym.restore("restore-1", time.time() + WAIT, directory, ["named"])
            assert "invalid_checkpoint_state" in repr(failed.value) or "renamed" in str(failed.value), failed.value

    try:
        asyncio.run(asyncio.wait_for(scenario(), 3 * WAIT))
    finally:
        first.close()
        renamed.close()


def test_the_checkpoint_block_of_the_nemo_gym_file_is_what_the_server_reads(tmp_path: Path) -> None:
    """The control routes answer only the file's token: the block was read from NeMo Gym's own YAML."""
    server = NeMoServer("counter", tmp_path, nemo_python())
    server.write_config(counter_config(tmp_path))

    async def scenario() -> None:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            server.start()
            await server.wait_up(session)
            status_url = server.url + "/ng-control/v1/checkpoint/status"
            async with session.get(status_url, headers={"Authorization": "Bearer wrong"}) as reply:
                assert reply.status == 401
            async with session.get(status_url, headers={"Authorization": f"Bearer {TOKEN}"}) as reply:
                status = await reply.json()
            assert (status["kind"], status["instance"], status["mode"]) == ("resources", "counter", "exported"), (
                json.dumps(status)
            )

    try:
        asyncio.run(asyncio.wait_for(scenario(), 2 * WAIT))
    finally:
        server.close()
