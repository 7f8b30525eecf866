"""The README's "Add checkpointing to your own FastAPI server", run as written against examples/.

Every shell line of that section runs in a fresh workspace (tests/docs_support.py): the
servers it starts (``gymckpt serve --app examples.tool_server:app --workers 2``, ``gymckpt
stack up examples/stack.yaml``, ``gymckpt serve --app examples.agent_server:app --workers
2``) are real processes on free ports, each waited for by polling ``/health`` with a deadline; the README's own ``curl``
lines run with only the ports replaced, and each reply is checked against
:data:`EXPECTED`, in order, so a line added, removed or changed in the README fails here
until the expectation follows. Every process is stopped at the end, passed or failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from .docs_support import EMBEDDING_SECTION, EXAMPLES, README, REPO, Result, Workspace, code_blocks

pytestmark = pytest.mark.timeout(420)

Check = Callable[[Result, Workspace], None]


def ok(**fields: Any) -> Check:
    """HTTP 200 and a JSON object holding these fields."""

    def check(result: Result, ws: Workspace) -> None:
        assert result.status == 200, (result.status, result.body)
        assert isinstance(result.body, dict), result.body
        for name, value in fields.items():
            assert result.body.get(name) == value, (name, result.body)

    return check


def error(status: int, code: str) -> Check:
    def check(result: Result, ws: Workspace) -> None:
        assert result.status == status, (result.status, result.body)
        assert result.body["error"]["code"] == code, result.body

    return check


def both(*checks: Check) -> Check:
    def check(result: Result, ws: Workspace) -> None:
        for each in checks:
            each(result, ws)

    return check


def coordinated_status_of(kind: str, instance: str, workers: int) -> Check:
    """The status of a server with several workers: its coordinator answers for all (some may still be starting)."""

    def check(result: Result, ws: Workspace) -> None:
        ok(kind=kind, instance=instance, phase="idle", checkpoint_id=None, expected_workers=workers)(result, ws)
        assert 1 <= result.body["workers"] <= workers, result.body

    return check


def prepared(result: Result, ws: Workspace) -> None:
    ok(phase="prepared")(result, ws)
    assert result.body["report"]["ready"] is True, result.body


def committed(directory: str, manifest: str, episodes: list[str]) -> Check:
    """A commit reply naming its manifest, and that manifest on disk agreeing with it."""

    def check(result: Result, ws: Workspace) -> None:
        ok(phase="committed", manifest_path=manifest, record_count=len(episodes), episode_ids=episodes)(result, ws)
        assert result.body["checkpoint_dir"] == str((ws.root / directory).resolve())
        on_disk = json.loads((ws.root / directory / manifest).read_text())
        assert result.body["manifest"] == on_disk
        assert on_disk["episode_ids"] == episodes
        assert on_disk["records_sha256"] in result.body["records_file"]
        assert (ws.root / directory / manifest).parent.joinpath(result.body["records_file"]).is_file()

    return check


def verified(result: Result, ws: Workspace) -> None:
    assert result.kind == "gymckpt"
    assert "0 error(s)" in result.output and "OK" in result.output, result.output


def agent_record(result: Result, ws: Workspace) -> None:
    (line,) = result.output.splitlines()
    record = json.loads(line)
    assert record["episode_id"] == "task-8" and record["kind"] == "session"
    assert record["state"]["resources_url"] == f"http://127.0.0.1:{ws.port('8001')}"
    messages = record["boundary"]["messages"]
    assert messages[0] == {"role": "user", "content": "take notes"}
    assert [message.get("role") for message in messages].count("tool") == 3
    assert record["boundary"]["reply"]["tool_calls"] == 3


def answered(result: Result, ws: Workspace) -> None:
    ok(tool_calls=3)(result, ws)
    assert result.body["output_text"].startswith("answer "), result.body


def server(result: Result, ws: Workspace) -> None:
    assert result.kind == "server"


# (a piece of the documented line, its check), in the README's order
EXPECTED: list[tuple[str, Check]] = [
    ("gymckpt serve --app examples.tool_server:app --workers 2 --port 8001", server),
    ("localhost:8001/health", ok(status="ok")),
    ("$CTL/status", coordinated_status_of("resources", "notes-0", 2)),
    ("/ng-rollout/task-7/seed_session", ok(session="task-7")),
    ("/ng-rollout/task-7/add_note", ok(notes=[{"text": "buy milk"}])),
    ("localhost:8001/add_note", error(400, "rollout_id_required")),
    ("$CTL/prepare", prepared),
    ("$CTL/commit", committed("checkpoints/notes-1", "gym/resources/notes-0/manifest.json", ["task-7"])),
    ("$CTL/resume", ok(phase="idle", idempotent=False, checkpoint_id="notes-1")),
    ("gymckpt verify ./checkpoints/notes-1", verified),
    ("gymckpt serve --app examples.tool_server:app --workers 2 --port 8001", server),  # the crash: fresh processes
    ("$CTL/restore", ok(phase="restored", source_checkpoint_id="notes-1", restored=["task-7-a1"])),
    ("$CTL/resume", ok(phase="idle", idempotent=False, checkpoint_id="notes-1")),
    ("/ng-rollout/task-7-a1/add_note", ok(notes=[{"text": "buy milk"}, {"text": "call mom"}])),
    ("/ng-rollout/task-7/add_note", error(409, "stale_attempt")),
    ("/ng-rollout/task-7-a1/verify", ok(reward=1.0)),
    ("gymckpt stack up examples/stack.yaml", server),
    ("gymckpt serve --app examples.agent_server:app --workers 2", server),
    ("localhost:8002/health", ok(status="ok")),
    ("localhost:8002/ng-control/v1/checkpoint/status", coordinated_status_of("agent", "notes-agent-0", 2)),
    ("localhost:8001/ng-rollout/task-8/seed_session", ok(session="task-8")),
    ("localhost:8002/ng-rollout/task-8/v1/responses", answered),
    ("localhost:8001/ng-rollout/task-8/verify", ok(reward=1.0)),
    ("localhost:8002/ng-control/v1/checkpoint/prepare", prepared),
    (
        "localhost:8002/ng-control/v1/checkpoint/commit",
        committed("checkpoints/agent-1", "gym/agent/notes-agent-0/manifest.json", ["task-8"]),
    ),
    ("localhost:8002/ng-control/v1/checkpoint/resume", ok(phase="idle", checkpoint_id="agent-1")),
    ("gymckpt inspect ./checkpoints/agent-1 --dump agent/notes-agent-0", agent_record),
]


def section_blocks() -> list:
    return [block for block in code_blocks(README) if block.section == EMBEDDING_SECTION]


def test_the_readme_embedding_section_runs_as_written(tmp_path: Path) -> None:
    blocks = [block for block in section_blocks() if block.lang == "sh"]
    assert blocks, f"the README has no shell blocks under '## {EMBEDDING_SECTION}'"
    assert not [block.where for block in blocks if block.not_run], "every line of this section must run"
    ws = Workspace(tmp_path)
    try:
        for block in blocks:
            ws.run_block(block)
        results = ws.results
        documented = [result.line for result in results]
        assert len(results) == len(EXPECTED), "\n".join(documented)
        for result, (piece, check) in zip(results, EXPECTED, strict=True):
            assert piece in result.line, (piece, result.line)
            try:
                check(result, ws)
            except AssertionError as exc:
                raise AssertionError(f"{result.line}\n→ {result.status} {result.output[:2000]}\n{exc}") from exc
    except Exception as exc:
        raise AssertionError(f"{exc}{ws.server_logs()}") from exc
    finally:
        ws.close()


def test_the_readme_shows_the_example_settings_as_they_are() -> None:
    """The settings block under "A tool server" is examples/tool_server.yaml, and each example's settings load."""
    from gymckpt.control.settings import load_settings

    shown = [block.text for block in section_blocks() if block.lang == "yaml"]
    assert len(shown) == 1
    assert shown[0].strip() in (EXAMPLES / "tool_server.yaml").read_text()
    for name in ("tool_server.yaml", "agent_server.yaml", "stack.yaml"):
        data = yaml.safe_load((EXAMPLES / name).read_text())
        block = load_settings(data).checkpoint
        assert block.enabled and block.token and block.allowed_roots == ["./checkpoints"], name


def test_with_checkpointing_off_the_tool_server_installs_nothing() -> None:
    """``GYMCKPT_CHECKPOINT__ENABLED=false``: no control routes, no rollout prefix; the session is a header."""
    script = """
import os, sys
from fastapi.testclient import TestClient
sys.path.insert(0, sys.argv[1])
from examples.tool_server import create_app
app = create_app()
assert not [path for path in app.openapi()["paths"] if path.startswith("/ng-control/")]
with TestClient(app) as client:
    assert client.get("/ng-control/v1/checkpoint/status").status_code == 404
    assert client.post("/ng-rollout/t-1/seed_session").status_code == 404
    headers = {"x-session-id": "s1"}
    assert client.post("/seed_session", headers=headers).json() == {"session": "s1"}
    assert client.post("/add_note", json={"text": "x"}, headers=headers).json() == {"notes": [{"text": "x"}]}
    assert client.post("/verify", json={"expected": 1}, headers=headers).json() == {"reward": 1.0}
print("off: nothing installed")
"""
    env = {key: value for key, value in os.environ.items() if not key.startswith("GYMCKPT_")}
    env["GYMCKPT_CHECKPOINT__ENABLED"] = "false"
    done = subprocess.run(
        [sys.executable, "-c", script, str(REPO)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "off: nothing installed" in done.stdout
