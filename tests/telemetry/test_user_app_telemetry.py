"""A server of your own logs and traces its checkpoints by itself (issue 25, item 4).

A user's app (a module written here) calls ``install_checkpointing`` and nothing else of
gymckpt's telemetry or logging, and runs under plain ``uvicorn`` as a real process. With
``OTEL_TRACES_EXPORTER=console`` its output holds the checkpoint spans of a
prepare/commit/resume cycle; with ``GYMCKPT_LOG_LEVEL=info`` its INFO lines (the
checkpointing line, one per operation). A logging setup the app made itself is never
overridden: gymckpt's lines go through the app's handler, and a level the app gave the
``gymckpt`` logger stands. Every wait is bounded (the server's start, its stop).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from typing import TYPE_CHECKING

import httpx
import pytest

from ..support import kill_group, start_uvicorn, uvicorn_port

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.timeout(180)

TOKEN = "user-app-telemetry-token"
#: the bound of the server's start and of its stop, in seconds
WAIT = 60.0
#: the timestamp gymckpt's own handler puts first on each line
STAMP = r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3}"

APP = """
import logging

from fastapi import FastAPI

from gymckpt.control.settings import load_settings
from gymckpt.participants.install import install_checkpointing
from gymckpt.participants.resources import CheckpointedResources, ResourcesParticipant

{logging_setup}
settings = load_settings(
    {{"checkpoint": {{"enabled": True, "control_auth_token": "{token}", "allowed_roots": ["{root}"]}}}}
)
app = FastAPI(title="my tools")
install_checkpointing(app, ResourcesParticipant(CheckpointedResources(), instance="tools-0"), settings)
"""


def _run_cycle(tmp_path: Path, env: dict[str, str], logging_setup: str = "") -> str:
    """Start the app under uvicorn, prepare/commit/resume once, stop it (SIGINT); all it wrote."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "my_tools.py").write_text(
        APP.format(logging_setup=logging_setup, token=TOKEN, root=tmp_path / "checkpoints")
    )
    clean = {key: value for key, value in os.environ.items() if not key.startswith(("GYMCKPT_", "OTEL_"))}
    clean["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), clean.get("PYTHONPATH", "")]))
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        process = start_uvicorn(
            ["my_tools:app", "--host", "127.0.0.1", "--port", "0"],
            env={**clean, "PYTHONUNBUFFERED": "1", **env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + WAIT
        port = None
        while port is None:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"uvicorn did not listen within {WAIT} s:\n{log.read_text()}"
            port = uvicorn_port(log.read_text())
            if port is None:
                try:
                    process.wait(timeout=0.1)  # the next look at its output, bounded by the deadline
                except subprocess.TimeoutExpired:
                    pass
        control = f"http://127.0.0.1:{port}/ng-control/v1/checkpoint"
        headers = {"Authorization": f"Bearer {TOKEN}"}
        body = {"checkpoint_id": "ck-1", "deadline_ts": time.time() + 60}
        for operation, extra in (
            ("prepare", {}),
            ("commit", {"checkpoint_dir": str(tmp_path / "checkpoints" / "ck-1"), "episode_ids": []}),
            ("resume", {}),
        ):
            reply = httpx.post(f"{control}/{operation}", json={**body, **extra}, headers=headers, timeout=30)
            assert reply.status_code == 200, (operation, reply.text)
        process.send_signal(signal.SIGINT)  # Ctrl-C: the exporter flushes at exit
        process.wait(timeout=WAIT)
    finally:
        kill_group(process, timeout=WAIT)
    return log.read_text()


def test_a_user_app_exports_the_checkpoint_spans_and_logs_info_lines(tmp_path: Path) -> None:
    output = _run_cycle(tmp_path, {"OTEL_TRACES_EXPORTER": "console", "GYMCKPT_LOG_LEVEL": "info"})
    spans = set(re.findall(r'"name": "(gym\.checkpoint\.[a-z_.]+)"', output))
    expected = {
        "gym.checkpoint.prepare",
        "gym.checkpoint.wait_ready",
        "gym.checkpoint.commit",
        "gym.checkpoint.export",
        "gym.checkpoint.write",
        "gym.checkpoint.resume",
    }
    assert expected <= spans, (sorted(spans), output[-3000:])
    assert re.search(r'"service\.name": "gymckpt-resources"', output), output[-3000:]
    # gymckpt's own handler (nobody else set logging up): its timestamped INFO lines
    assert re.search(rf"^{STAMP} INFO gymckpt\.participants: my tools: checkpointing on", output, re.M), output
    for operation in ("prepare", "commit", "resume"):
        assert re.search(rf"^{STAMP} INFO gymckpt\.telemetry: {operation} ck-1 resources/tools-0: ok", output, re.M), (
            operation,
            output,
        )


def test_a_logging_setup_the_app_made_is_never_overridden(tmp_path: Path) -> None:
    """The app's handler and format carry gymckpt's lines; gymckpt adds no handler of its own."""
    setup = 'logging.basicConfig(level=logging.INFO, format="APP %(levelname)s %(name)s | %(message)s")'
    output = _run_cycle(tmp_path / "own-format", {}, logging_setup=setup)
    assert re.search(r"^APP INFO gymckpt\.telemetry \| commit ck-1 resources/tools-0: ok", output, re.M), output
    assert not re.search(rf"^{STAMP} INFO gymckpt\.", output, re.M), output  # no second handler, no duplicate

    quiet = 'logging.basicConfig(level=logging.INFO)\nlogging.getLogger("gymckpt").setLevel(logging.WARNING)'
    output = _run_cycle(tmp_path / "quiet", {"GYMCKPT_LOG_LEVEL": "info"}, logging_setup=quiet)
    assert "commit ck-1" not in output, output  # the level the app gave the gymckpt logger stands
    assert "Uvicorn running on" in output, output  # the app's own setup works as it did
