"""An app of your own served as a reference server is: ``gymckpt serve --app module:attr`` (issue 25, item 4).

The acceptance: ``examples.tool_server:app`` with two workers, as a real stack entry
(``app:``, started as ``gymckpt serve --app … --workers 2`` on a kept socket), holds
sessions on both workers, is checkpointed by a Coordinator (prepare, commit, publish),
SIGKILLed (its whole process group), started fresh and restored: every session continues
under its next attempt with the checkpoint's notes, reached with the cookie from before the
crash or with none, and the old attempt is refused.

Bad input is one line and exit 2 (a module not importable, an attribute it lacks, neither an
app nor a factory, KIND and --app both or neither), and a stack file's ``app:`` entries are
checked whole before anything starts. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
import yaml

from gymckpt.control.coordination import Coordinator
from gymckpt.errors import SettingsError
from gymckpt.stack import load_stack
from gymckpt.workers.routing import COOKIE_NAME, OWNER_HEADER

from ..support import REPO

if TYPE_CHECKING:
    from pathlib import Path

    from gymckpt.stack.supervisor import Stack

pytestmark = pytest.mark.timeout(300)

TOKEN = "serve-app-token"
APP = "examples.tool_server:app"
#: the bound of every wait for servers, in seconds
WAIT = 90.0
#: seed requests made at most while looking for a session on each worker
MAX_SEEDS = 64


def _spec(root: Path, workers: int = 2) -> dict[str, Any]:
    return {
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "allowed_roots": [str(root)]},
        "servers": [{"name": "notes", "app": APP, "workers": workers}],
    }


@pytest.fixture
def repo_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The servers import ``examples.tool_server`` from the repository, wherever the tests run from."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])))
    monkeypatch.chdir(REPO)


def _owner(value: str) -> str:
    """The routing id a signed session value names (``<owner>.<session>.<mac>``)."""
    return value.split(".", 1)[0]


class Client:
    """One rollout's calls to the tool server: its own cookie, as a caller keeps it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.cookie: str | None = None

    async def post(self, path: str, body: Any, *, cookie: bool = True, owner: str | None = None) -> tuple[int, Any]:
        headers = {}
        if cookie and self.cookie is not None:
            headers["Cookie"] = f"{COOKIE_NAME}={self.cookie}"
        if owner is not None:
            headers[OWNER_HEADER] = owner
        async with (
            aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(), timeout=aiohttp.ClientTimeout(total=60)) as http,
            http.post(f"{self.url}{path}", json=body, headers=headers) as reply,
        ):
            stamped = reply.cookies.get(COOKIE_NAME)
            if stamped is not None:
                self.cookie = stamped.value
            return reply.status, await reply.json()


async def _every_worker_linked(gym: Coordinator, url: str, workers: int) -> None:
    deadline = time.monotonic() + WAIT
    while True:
        found = await gym.discover(require_model=False)
        if found.ok and (await gym.status(url)).get("workers") == workers:
            return
        assert time.monotonic() < deadline, f"{workers} workers did not link within {WAIT} s"
        await asyncio.sleep(0.2)  # the next poll of this bounded wait


async def _sessions_on_both_workers(url: str) -> dict[str, Client]:
    """Sessions ``r0``, ``r1``, … until two workers hold some (bounded); then one more on each, by owner."""
    clients: dict[str, Client] = {}
    owners: set[str] = set()
    while len(owners) < 2:
        assert len(clients) < MAX_SEEDS, f"every one of {len(clients)} sessions landed on one worker"
        key = f"r{len(clients)}"
        client = clients[key] = Client(url)
        status, body = await client.post(f"/ng-rollout/{key}/seed_session", {})
        assert (status, body) == (200, {"session": key})
        assert client.cookie is not None, "a rollout reply of a server with several workers stamps its owner"
        owners.add(_owner(client.cookie))
    for owner in sorted(owners):  # one session named to each worker, without a cookie
        key = f"r{len(clients)}"
        client = clients[key] = Client(url)
        status, _ = await client.post(f"/ng-rollout/{key}/seed_session", {}, owner=owner)
        assert status == 200 and client.cookie is not None and _owner(client.cookie) == owner
    return clients


async def _checkpoint_kill_restore(stack: Stack, directory: Path) -> None:
    url = stack.urls["notes"]
    async with Coordinator([url], token=TOKEN, probe_timeout=WAIT) as gym:
        await _every_worker_linked(gym, url, 2)
        clients = await _sessions_on_both_workers(url)
        notes: dict[str, list[dict[str, Any]]] = {}
        for index, (key, client) in enumerate(clients.items()):
            notes[key] = [{"n": n} for n in range(index % 3 + 1)]
            for note in notes[key]:
                status, body = await client.post(f"/ng-rollout/{key}/add_note", note)
                assert status == 200, body
            assert body == {"notes": notes[key]}
        prepared = await gym.prepare("app-1", time.time() + 60)
        assert prepared.prepared, prepared.blockers()
        commits = await gym.commit("app-1", time.time() + 60, str(directory), sorted(clients))
        (reply,) = commits.values()
        assert sorted(reply.episode_ids) == sorted(clients)
        owners = set(reply.manifest["session_owners"])
        assert len(owners) == 2, reply.manifest["session_owners"]  # both workers' records in one manifest
        await gym.publish(str(directory), commits)
        await gym.resume("app-1", time.time() + 60)
        # after the checkpoint: not in it, so not restored
        assert (await clients["r0"].post("/ng-rollout/r0/add_note", {"after": True}))[0] == 200

    stack.kill()  # SIGKILL of the server's process group: its main process and both workers
    assert not stack.servers["notes"].alive
    stack.start()
    async with Coordinator([url], token=TOKEN, probe_timeout=WAIT) as gym:
        await _every_worker_linked(gym, url, 2)
        replies = await gym.restore("app-1", time.time() + 60, str(directory), sorted(clients))
        (restored,) = replies.values()
        assert sorted(restored.restored) == sorted(f"{key}-a1" for key in clients)
        await gym.resume("app-1", time.time() + 60)
        for index, (key, client) in enumerate(sorted(clients.items())):
            # half with the cookie from before the crash (its owner is gone: routed by the restore's
            # aliases), half with none (routed by the restored key's placement)
            with_cookie = index % 2 == 0
            status, body = await client.post(f"/ng-rollout/{key}-a1/add_note", {"more": key}, cookie=with_cookie)
            assert (status, body) == (200, {"notes": [*notes[key], {"more": key}]}), (key, with_cookie)
            status, body = await client.post(f"/ng-rollout/{key}/add_note", {"late": True})
            assert (status, body["error"]["code"]) == (409, "stale_attempt"), body
            status, body = await client.post(f"/ng-rollout/{key}-a1/verify", {"expected": len(notes[key]) + 1})
            assert (status, body) == (200, {"reward": 1.0}), key
        status = await gym.status(url)
        assert status["workers"] == 2 and len(status["worker_pids"]) == 2, status


def test_serve_app_with_two_workers_checkpoints_and_restores(
    tmp_path: Path, repo_on_path: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the servers inherit this process's environment: an earlier in-process `--log-level warning` (a CLI
    # test in the same test worker) would hide the INFO startup lines this test reads
    monkeypatch.setenv("GYMCKPT_LOG_LEVEL", "info")
    with load_stack(_spec(tmp_path), workdir=tmp_path / "stack") as stack:
        stack.start()
        try:
            asyncio.run(_checkpoint_kill_restore(stack, tmp_path / "ckpt"))
        except BaseException as exc:
            log = stack.servers["notes"].log_path
            raise AssertionError(f"{exc}\n--- notes log:\n{log.read_text()[-4000:]}") from exc
        log = stack.servers["notes"].log_path.read_text()
    # the command the stack ran, and the server's one startup line per start
    started = [line for line in log.splitlines() if f"{APP} (notes tool server, resources/notes-0) listening" in line]
    assert len(started) == 2, log
    assert "with 2 workers, checkpointing on, allowed roots" in started[0], started[0]


# --- one line, exit 2


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    clean = {key: value for key, value in os.environ.items() if not key.startswith(("GYMCKPT_", "OTEL_"))}
    return subprocess.run(
        [sys.executable, "-m", "gymckpt", "serve", *args],
        cwd=REPO,
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,  # a command that started serving instead of refusing fails here
        stdin=subprocess.DEVNULL,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--app", "examples.no_such_server:app"], "no module named 'examples.no_such_server'"),
        (["--app", "examples.tool_server:nope"], "has no attribute 'nope'"),
        (["--app", "examples.tool_server:SETTINGS"], "not a FastAPI app or a factory"),
        (["--app", "examples.tool_server:session_of"], "a factory is called with no arguments"),
        (["--app", "examples.tool_server"], "give the app as module:attr"),
        (["counter", "--app", APP], "not both"),
        ([], "or --app MODULE:ATTR"),
    ],
    ids=["not-importable", "no-attribute", "not-an-app", "factory-with-arguments", "no-colon", "both", "neither"],
)
def test_an_app_that_is_no_app_is_one_line_and_exit_2(args: list[str], expected: str) -> None:
    result = _serve(*args, "--port", "0")
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0], lines[0]
    assert result.returncode == 2
    assert result.stdout == ""


def test_the_apps_own_settings_mistake_names_its_file_and_key(tmp_path: Path) -> None:
    bad = tmp_path / "notes.yaml"
    bad.write_text("chekpoint:\n  enabled: true\n")
    result = _serve("--app", APP, "--config", str(bad), "--port", "0")
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert f"{bad}: chekpoint: unknown key; did you mean 'checkpoint'?" in line, line


# --- stack files


def test_a_stack_files_app_entries_are_checked_before_anything_starts(tmp_path: Path, repo_on_path: None) -> None:
    cases = {
        "servers[0].ap": {"name": "a", "ap": APP},  # a typo of the key: did-you-mean
        "servers[0]: give a kind or an app, not both": {"name": "a", "kind": "counter", "app": APP},
        "servers[0].app: no module named 'examples.nowhere'": {"name": "a", "app": "examples.nowhere:app"},
        "servers[0].app: give the app as module:attr": {"name": "a", "app": "examples.tool_server"},
        "servers[0].config.chekpoint: unknown key": {"name": "a", "app": APP, "config": {"chekpoint": {}}},
    }
    for expected, entry in cases.items():
        with pytest.raises(SettingsError) as caught:
            load_stack({"servers": [entry]}, workdir=tmp_path / "refused")
        assert expected in str(caught.value), (expected, str(caught.value))
    assert "did you mean 'app'" in str(_refusal({"name": "a", "ap": APP}, tmp_path))


def _refusal(entry: dict[str, Any], tmp_path: Path) -> SettingsError:
    with pytest.raises(SettingsError) as caught:
        load_stack({"servers": [entry]}, workdir=tmp_path / "refused")
    return caught.value


def test_an_app_entry_gets_the_stacks_checkpoint_block_and_is_served_with_app(
    tmp_path: Path, repo_on_path: None
) -> None:
    """The app entries examples/stack.yaml shows in its comment, beside its servers: a stack that loads."""
    text = (REPO / "examples" / "stack.yaml").read_text()
    shown = [line.split("#", 1)[1].strip() for line in text.splitlines() if line.startswith("#   - {")]
    assert len(shown) == 2, shown
    spec = yaml.safe_load(text)
    spec["servers"].extend(yaml.safe_load("\n".join(shown)))
    for entry in spec["servers"]:
        entry["port"] = 0  # the documented ports may be taken here
    with load_stack(spec, workdir=tmp_path / "stack") as stack:
        notes, agent = stack.servers["notes"], stack.servers["agent2"]
        assert (notes.kind, notes.app, notes.label, notes.workers) == ("app", APP, APP, 2)
        assert notes.config["checkpoint"]["control_auth_token"] == "example-token"
        assert agent.config["model_url"] == stack.urls["model"]  # "{model}" resolved, as for a kind
        assert "instance" not in notes.config  # an app names its participant itself
