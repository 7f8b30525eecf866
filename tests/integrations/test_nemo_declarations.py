"""A NeMo Gym server declares where its session state lives, in code or in its config; no hooks, no mixin.

The servers here are NeMo Gym ``SimpleResourcesServer`` subclasses in a module of the test's
own (imported from the directory the server starts in): one declares its state in code
(pydantic ``ClassVar`` attributes; mixing gymckpt's ``CheckpointedResources`` into a pydantic
model is what failed before), one keeps no state for a seeded session (an export that would
leave it out is an error, never an empty success). Config mistakes are one line, exit 2.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from gymckpt.control.coordination import Coordinator
from gymckpt.errors import CoordinationError
from tests.support import REPO

from .nemo_support import TOKEN, NeMoServer, nemo_python, verify_body
from .test_nemo_counter import WAIT

if TYPE_CHECKING:
    from pathlib import Path

SERVERS_MODULE = '''
from typing import ClassVar, Dict

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field

from nemo_gym.base_resources_server import BaseSeedSessionResponse, BaseVerifyRequest, SimpleResourcesServer
from nemo_gym.server_utils import SESSION_ID_KEY


class Notes(BaseModel):
    lines: list[str] = []


class NoteRequest(BaseModel):
    line: str


class NotebookServer(SimpleResourcesServer):
    """Declares its session state in code: gymckpt exports it through the attribute's type."""

    checkpoint_mode: ClassVar[str] = "exported"
    checkpoint_session_state: ClassVar[str] = "notebooks"
    notebooks: Dict[str, Notes] = Field(default_factory=dict)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/note")(self.note)
        return app

    async def seed_session(self, request: Request) -> BaseSeedSessionResponse:
        self.notebooks.setdefault(request.session[SESSION_ID_KEY], Notes())
        return BaseSeedSessionResponse()

    async def note(self, request: Request, body: NoteRequest) -> Notes:
        notes = self.notebooks.setdefault(request.session[SESSION_ID_KEY], Notes())
        notes.lines.append(body.line)
        return notes

    async def verify(self, request: Request, body: BaseVerifyRequest) -> dict:
        notes = self.notebooks.get(request.session[SESSION_ID_KEY], Notes())
        return {**body.model_dump(), "reward": float(len(notes.lines))}


class ForgetfulServer(SimpleResourcesServer):
    """Declares exported state but its seed makes none: a checkpoint must not succeed with the session left out."""

    checkpoint_session_state: ClassVar[str] = "states"
    states: Dict[str, int] = Field(default_factory=dict)

    async def verify(self, request: Request, body: BaseVerifyRequest) -> dict:
        return {**body.model_dump(), "reward": 0.0}


class PlainServer(SimpleResourcesServer):
    """Declares nothing: restart_only unless its config says more."""

    async def verify(self, request: Request, body: BaseVerifyRequest) -> dict:
        return {**body.model_dump(), "reward": 0.0}
'''


def write_servers(directory: Path) -> None:
    (directory / "my_servers").mkdir()
    (directory / "my_servers" / "__init__.py").write_text("")
    (directory / "my_servers" / "app.py").write_text(SERVERS_MODULE)


def config(root: Path, server_class: str, **block: Any) -> dict[str, Any]:
    return {
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "allowed_roots": [str(root)]},
        "nemo_gym": {"serve": "notes", "server_class": server_class, **block},
        # a server of the user's own: its module is found from the directory the server starts in
        "notes": {"resources_servers": {"my_servers": {"entrypoint": "app.py", "domain": "agent"}}},
    }


async def checkpoint(server: NeMoServer, directory: str, keys: list[str]) -> None:
    async with Coordinator([server.url], token=TOKEN, probe_timeout=WAIT) as gym:
        assert (await gym.discover(require_model=False)).ok
        prepared = await gym.prepare("c1", time.time() + WAIT)
        commits = await gym.commit("c1", time.time() + WAIT, directory, prepared.continued(keys))
        await gym.publish(directory, commits)


@pytest.fixture
def user_servers(tmp_path: Path) -> Path:
    # NeMo Gym resolves resources_servers.<directory> as a package: the user's lives beside the config
    (tmp_path / "resources_servers").mkdir()
    (tmp_path / "resources_servers" / "__init__.py").write_text("")
    write_servers(tmp_path / "resources_servers")
    return tmp_path


def test_state_declared_in_code_is_exported_and_restored_through_its_type(user_servers: Path) -> None:
    server = NeMoServer("notes", user_servers, nemo_python())
    server.write_config(config(user_servers, "NotebookServer"))

    async def scenario() -> None:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            server.start()
            await server.wait_up(session)
            for line in ("a", "b"):
                async with session.post(f"{server.url}/ng-rollout/book/note", json={"line": line}) as reply:
                    assert reply.status == 200, await reply.text()
            directory = str(user_servers / "ckpt")
            await checkpoint(server, directory, ["book"])  # a session a tool call started is one too
            server.kill()
            server.start()
            await server.wait_up(session)
            async with Coordinator([server.url], token=TOKEN, probe_timeout=WAIT) as gym:
                assert (await gym.discover(require_model=False)).ok
                (reply,) = (await gym.restore("r1", time.time() + WAIT, directory, ["book"])).values()
                assert reply.restored == ["book-a1"]
                await gym.resume("r1", time.time() + WAIT)
            async with session.post(f"{server.url}/ng-rollout/book-a1/note", json={"line": "c"}) as reply:
                assert (await reply.json()) == {"lines": ["a", "b", "c"]}  # a Notes model, restored as one
            async with session.post(f"{server.url}/ng-rollout/book-a1/verify", json=verify_body(0)) as reply:
                assert (await reply.json())["reward"] == 3.0

    try:
        asyncio.run(asyncio.wait_for(scenario(), 3 * WAIT))
    finally:
        server.close()


def test_an_export_that_would_leave_out_a_tracked_session_fails_the_commit(user_servers: Path) -> None:
    server = NeMoServer("notes", user_servers, nemo_python())
    server.write_config(config(user_servers, "ForgetfulServer"))

    async def scenario() -> None:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            server.start()
            await server.wait_up(session)
            async with session.post(f"{server.url}/ng-rollout/lost/seed_session", json={}) as reply:
                assert reply.status == 200
            with pytest.raises(CoordinationError) as failed:
                await checkpoint(server, str(user_servers / "ckpt"), ["lost"])
            assert "export_failed" in str(failed.value) and "lost" in str(failed.value), failed.value

    try:
        asyncio.run(asyncio.wait_for(scenario(), 2 * WAIT))
    finally:
        server.close()


@pytest.mark.parametrize(
    ("server_class", "block", "message"),
    [
        ("PlainServer", {"sessions": "exported"}, "nemo_gym.session_state: required with sessions: exported"),
        ("PlainServer", {"session_state": "nowhere"}, "nemo_gym.session_state: PlainServer has no field 'nowhere'"),
        (
            "NotebookServer",
            {"sessions": "stateless"},
            "nemo_gym.sessions: 'stateless', but NotebookServer.checkpoint_mode declares 'exported'",
        ),
    ],
)
def test_a_declaration_that_cannot_be_used_is_one_line_at_startup(
    user_servers: Path, server_class: str, block: dict[str, Any], message: str
) -> None:
    server = NeMoServer("notes", user_servers, nemo_python())
    server.write_config(config(user_servers, server_class, **block))
    try:
        server.start()
        assert server.process is not None
        assert server.process.wait(timeout=WAIT) == 2
        assert message in server.log_path.read_text(), server.log_tail()
    finally:
        server.close()


def test_several_instances_and_no_serve_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "two.yaml"
    path.write_text(
        "checkpoint: {enabled: true, control_auth_token: t}\n"
        "a: {resources_servers: {example_session_state_mgmt: {entrypoint: app.py, domain: agent}}}\n"
        "b: {resources_servers: {example_session_state_mgmt: {entrypoint: app.py, domain: agent}}}\n"
    )
    done = subprocess.run(
        [
            str(nemo_python()),
            "-m",
            "gymckpt",
            "serve",
            "--app",
            "gymckpt.integrations.nemo_gym:app",
            "--config",
            str(path),
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},  # this checkout's gymckpt, as the servers get it
    )
    assert done.returncode == 2, done.stderr
    assert "nemo_gym.serve: required: the instance this process serves (one of a, b)" in done.stderr + done.stdout
