"""NeMo Gym's MCP tool sessions bound by gymckpt: the per-rollout token is checked against the rollout prefix.

An ``MCPResourcesServer`` of the test's own hands each rollout a signed session token on
``/seed_session``; its ``@gym_tool`` receives the session id the token names. A token of
another rollout is refused (409 ``session_rollout_mismatch``); after a restore the old token
reaches the restored state of the replacement attempt. The key tokens and cookies are signed
with survives a restart under another config name (NeMo Gym's own derives from the name).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import aiohttp

from gymckpt.control.coordination import Coordinator

from .nemo_support import TOKEN, NeMoServer, nemo_python
from .test_nemo_counter import WAIT

if TYPE_CHECKING:
    from pathlib import Path

TALLY_MODULE = '''
from typing import ClassVar, Dict

from fastapi import Request
from pydantic import Field

from nemo_gym.base_resources_server import BaseVerifyRequest, MCPResourcesServer, MCPServerMetadata, gym_tool
from nemo_gym.server_utils import SESSION_ID_KEY


class TallyServer(MCPResourcesServer):
    checkpoint_session_state: ClassVar[str] = "tallies"
    tallies: Dict[str, int] = Field(default_factory=dict)

    async def seed_session(self, request: Request) -> MCPServerMetadata:
        self.tallies.setdefault(request.session[SESSION_ID_KEY], 0)
        return self.build_mcp_session_metadata(request)

    @gym_tool
    async def add(self, session_id: str, n: int) -> int:
        """Add n to the session's tally."""
        self.tallies[session_id] = self.tallies.get(session_id, 0) + n
        return self.tallies[session_id]

    async def verify(self, request: Request, body: BaseVerifyRequest) -> dict:
        return {**body.model_dump(), "reward": 0.0}
'''
HEADER = "X-NeMo-Gym-Session-Token"


def tally_config(root: Path, name: str = "tally") -> dict[str, Any]:
    return {
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "allowed_roots": [str(root)]},
        "nemo_gym": {"serve": name},
        name: {"resources_servers": {"tally_servers": {"entrypoint": "app.py", "domain": "agent"}}},
    }


def install_tally(root: Path) -> None:
    """The test's MCP resources server, as a NeMo Gym resources server package under ``root``."""
    package = root / "resources_servers" / "tally_servers"
    package.mkdir(parents=True)
    (root / "resources_servers" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "app.py").write_text(TALLY_MODULE)


async def seed(session: aiohttp.ClientSession, server: NeMoServer, key: str) -> str:
    async with session.post(f"{server.url}/ng-rollout/{key}/seed_session", json={}) as reply:
        body = await reply.json()
        assert reply.status == 200, body
        return str(body["headers"][HEADER])


async def add(session: aiohttp.ClientSession, server: NeMoServer, key: str, token: str, n: int) -> tuple[int, Any]:
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "add", "arguments": {"n": n}}}
    headers = {HEADER: token, "Accept": "application/json, text/event-stream"}
    async with session.post(f"{server.url}/ng-rollout/{key}/mcp", json=call, headers=headers) as reply:
        return reply.status, await reply.json(content_type=None)


def tally(reply: Any) -> int:
    result = reply["result"]
    assert not result.get("isError"), reply
    return int(result["content"][0]["text"])


def test_an_mcp_token_is_bound_to_its_rollout_and_survives_a_restore(tmp_path: Path) -> None:
    install_tally(tmp_path)
    server = NeMoServer("tally", tmp_path, nemo_python())
    server.write_config(tally_config(tmp_path))

    async def scenario() -> None:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            server.start()
            await server.wait_up(session)
            mine, theirs = await seed(session, server, "mine"), await seed(session, server, "theirs")
            status, reply = await add(session, server, "mine", mine, 2)
            assert (status, tally(reply)) == (200, 2), reply
            status, reply = await add(session, server, "theirs", mine, 5)  # rollout mine's token, theirs' prefix
            assert status == 409 and reply["error"]["code"] == "session_rollout_mismatch", reply
            status, reply = await add(session, server, "theirs", theirs, 1)
            assert (status, tally(reply)) == (200, 1), reply
            directory = str(tmp_path / "ckpt")
            async with Coordinator([server.url], token=TOKEN, probe_timeout=WAIT) as gym:
                assert (await gym.discover(require_model=False)).ok
                prepared = await gym.prepare("c1", time.time() + WAIT)
                commits = await gym.commit("c1", time.time() + WAIT, directory, prepared.continued(["mine"]))
                await gym.publish(directory, commits)
            server.kill()
            server.start()
            await server.wait_up(session)
            async with Coordinator([server.url], token=TOKEN, probe_timeout=WAIT) as gym:
                assert (await gym.discover(require_model=False)).ok
                await gym.restore("r1", time.time() + WAIT, directory, ["mine"])
                await gym.resume("r1", time.time() + WAIT)
            status, reply = await add(session, server, "mine-a1", mine, 3)  # the pre-crash token
            assert (status, tally(reply)) == (200, 5), reply

    try:
        asyncio.run(asyncio.wait_for(scenario(), 3 * WAIT))
    finally:
        server.close()


def test_a_restart_under_another_config_name_keeps_the_signing_key(tmp_path: Path) -> None:
    """A token and a cookie handed out before the rename are still read after it: another rollout's is refused."""
    install_tally(tmp_path)
    python = nemo_python()
    first = NeMoServer("tally", tmp_path, python)
    first.write_config(tally_config(tmp_path))
    renamed = NeMoServer("renamed", tmp_path, python)
    renamed.write_config(tally_config(tmp_path, name="renamed"))

    async def scenario() -> None:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            first.start()
            await first.wait_up(session)
            async with session.post(f"{first.url}/ng-rollout/mine/seed_session", json={}) as reply:
                assert reply.status == 200, await reply.text()
                token = str((await reply.json())["headers"][HEADER])
                cookie = reply.cookies["TallyServer___tally"].value  # NeMo Gym names the cookie after the config
            first.kill()
            renamed.start()
            await renamed.wait_up(session)
            status, reply = await add(session, renamed, "theirs", token, 5)  # rollout mine's token, theirs' prefix
            assert status == 409 and reply["error"]["code"] == "session_rollout_mismatch", reply
            headers = {"Cookie": f"TallyServer___renamed={cookie}"}  # its value, under the renamed server's name
            async with session.post(f"{renamed.url}/ng-rollout/theirs/seed_session", json={}, headers=headers) as got:
                body = await got.json()
                assert got.status == 409 and body["error"]["code"] == "session_rollout_mismatch", body
            status, reply = await add(session, renamed, "mine", token, 2)
            assert (status, tally(reply)) == (200, 2), reply

    try:
        asyncio.run(asyncio.wait_for(scenario(), 3 * WAIT))
    finally:
        first.close()
        renamed.close()
