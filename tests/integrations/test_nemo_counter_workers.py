"""NeMo Gym's stateful counter on two uvicorn workers, restored onto three: the public factory, no private module.

The rollouts keep every cookie a reply sets (NeMo Gym's session cookie and gymckpt's
routing cookie), as NeMo Gym's agents pass them on; after the restore half of them send
their pre-crash cookies (an old owner, aliased to a live worker) and half send none (the
restore placed their sessions).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import aiohttp

from gymckpt.control.coordination import Coordinator
from gymckpt.identity import EpisodeId

from .nemo_support import TOKEN, NeMoServer, nemo_python, verify_body
from .test_nemo_counter import WAIT, counter_config

if TYPE_CHECKING:
    from pathlib import Path


async def post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], jar: dict[str, str] | None
) -> tuple[int, Any]:
    headers = {"Cookie": "; ".join(f"{name}={value}" for name, value in jar.items())} if jar else {}
    async with session.post(url, json=body, headers=headers) as reply:
        if jar is not None:
            jar.update({name: morsel.value for name, morsel in reply.cookies.items()})
        return reply.status, await reply.json()


def test_two_workers_restored_onto_three(tmp_path: Path) -> None:
    server = NeMoServer("counter", tmp_path, nemo_python())
    server.write_config(counter_config(tmp_path))

    async def scenario() -> None:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            server.start(workers=2)
            await server.wait_up(session, workers=2)
            keys = {f"w-{index}": index for index in range(12)}
            jars: dict[str, dict[str, str]] = {key: {} for key in keys}
            for key, index in keys.items():
                url = f"{server.url}/ng-rollout/{key}"
                assert (await post(session, url + "/seed_session", {"initial_count": index}, jars[key]))[0] == 200
                assert (await post(session, url + "/increment_counter", {"count": 2}, jars[key])) == (
                    200,
                    {"success": True},
                )
            directory = str(tmp_path / "ckpt-w")
            async with Coordinator([server.url], token=TOKEN, probe_timeout=WAIT) as gym:
                assert (await gym.discover(require_model=False)).ok
                prepared = await gym.prepare("ckpt-w", time.time() + WAIT)
                assert prepared.prepared, prepared.blockers()
                scope = prepared.continued(list(keys))
                commits = await gym.commit("ckpt-w", time.time() + WAIT, directory, scope)
                assert sum(commit.record_count for commit in commits.values()) == len(keys)
                await gym.publish(directory, commits)

            server.kill()
            server.start(workers=3)
            await server.wait_up(session, workers=3)
            async with Coordinator([server.url], token=TOKEN, probe_timeout=WAIT) as gym:
                assert (await gym.discover(require_model=False)).ok
                await gym.restore("restore-w", time.time() + WAIT, directory, scope)
                await gym.resume("restore-w", time.time() + WAIT)

            for number, key in enumerate(sorted(keys)):
                attempt = EpisodeId.from_capture_key(key).next_attempt().capture_key
                jar = jars[key] if number % 2 == 0 else {}
                url = f"{server.url}/ng-rollout/{attempt}"
                assert (await post(session, url + "/increment_counter", {"count": 3}, jar)) == (200, {"success": True})
                expected = keys[key] + 5
                status, body = await post(session, url + "/verify", verify_body(expected), jar)
                assert status == 200 and body["reward"] == 1.0, (attempt, number % 2 == 0, body)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 4 * WAIT))
    finally:
        server.close()
