"""Every server says at startup, in one line at the default log level, where it listens and whether
checkpointing is on, with which allowed roots, never the token (issue 25, item 2)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi import FastAPI

from gymckpt.control.settings import CheckpointSettings
from gymckpt.participants.install import STARTUP_LINE_ENV, install_checkpointing
from gymckpt.participants.model import ModelParticipant
from gymckpt.stack.kinds import load_config
from gymckpt.stack.serving import listening_url, startup_line

from ..support import REPO, kill_group

TOKEN = "startup-line-token-0123456789"
#: the bound of every wait here
WAIT = 60.0
#: what the line says, whichever way checkpointing is
MARK = "server listening on "


@contextmanager
def served(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[tuple[str, Path]]:
    """``gymckpt serve counter ARGS`` on a socket bound here, at the default log level, until it answers /health;
    its URL and its log (stdout and stderr)."""
    listening = socket.create_server(("127.0.0.1", 0))
    listening.set_inheritable(True)
    host, port = listening.getsockname()
    environment = {key: value for key, value in os.environ.items() if not key.startswith("GYMCKPT_")}
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gymckpt", "serve", "counter", "--fd", str(listening.fileno()), *args],
            pass_fds=(listening.fileno(),),
            cwd=tmp_path,
            env={**environment, "PYTHONPATH": str(REPO), **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        # the line is logged before uvicorn starts: once /health answers, it is there
        with socket.create_connection((host, port), timeout=WAIT) as client:
            client.sendall(b"GET /health HTTP/1.1\r\nHost: s\r\nConnection: close\r\n\r\n")
            reply = b""
            deadline = time.monotonic() + WAIT
            while time.monotonic() < deadline and (chunk := client.recv(65536)):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 200 "), (reply, log.read_text(errors="replace"))
        yield f"http://{host}:{port}", log
    finally:
        kill_group(process, WAIT)
        listening.close()


def lines_of(log: Path) -> list[str]:
    text = log.read_text(errors="replace")
    assert TOKEN not in text
    assert "Traceback" not in text, text
    return [line for line in text.splitlines() if MARK in line]


def test_a_server_with_checkpointing_on_says_where_it_listens_and_its_roots(tmp_path: Path) -> None:
    roots = tmp_path / "ckpts"
    config = tmp_path / "counter.yaml"
    config.write_text(
        f"checkpoint:\n  enabled: true\n  control_auth_token: {TOKEN}\n  allowed_roots: [./ckpts, s3://bucket/run]\n"
    )
    with served(tmp_path, "--config", str(config)) as (url, log):
        (line,) = lines_of(log)
    assert " INFO " in line
    assert line.endswith(
        f"counter server listening on {url}, checkpointing on, allowed roots {os.path.realpath(roots)}, s3://bucket/run"
    ), line
    (line,) = lines_of(log)  # and no second one after it served


def test_a_server_with_checkpointing_off_says_so(tmp_path: Path) -> None:
    with served(tmp_path) as (url, log):
        (line,) = lines_of(log)
    assert line.endswith(f"counter server listening on {url}, checkpointing off"), line


def test_a_server_with_several_workers_says_it_once_from_its_main_process(tmp_path: Path) -> None:
    env = {"GYMCKPT_CHECKPOINT__ENABLED": "true", "GYMCKPT_CHECKPOINT__CONTROL_AUTH_TOKEN": TOKEN}
    with served(tmp_path, "--workers", "2", env=env) as (url, log):
        pass
    (line,) = lines_of(log)
    assert line.endswith(
        f"counter server listening on {url} with 2 workers, checkpointing on, any root (checkpoint.allowed_roots unset)"
    ), line


def test_the_line_of_servers_that_take_no_part(tmp_path: Path) -> None:
    inference = load_config("inference", {"checkpoint": {"enabled": True, "control_auth_token": TOKEN}})
    assert startup_line("inference", inference, "http://h:1").endswith("checkpointing off (not a Gym server)")
    judge = load_config(
        "model",
        {
            "inference_url": "http://h:2",
            "checkpoint_policy": False,
            "checkpoint": {"enabled": True, "control_auth_token": TOKEN},
        },
    )
    assert "checkpointing off (checkpoint_policy: false" in startup_line("model", judge, "http://h:1")


def test_the_listening_url_of_an_inherited_socket_and_of_a_host() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
        assert listening_url("0.0.0.0", 1, listening.fileno()) == f"http://127.0.0.1:{port}"
        assert listening.fileno() >= 0  # still open: the descriptor is the server's
    assert listening_url("::1", 8000) == "http://[::1]:8000"


def test_your_own_server_says_whether_checkpointing_is_on_once_at_install(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(STARTUP_LINE_ENV, raising=False)
    caplog.set_level(logging.INFO, logger="gymckpt.participants")
    on = CheckpointSettings(enabled=True, control_auth_token=TOKEN, allowed_roots=[str(tmp_path)])
    install_checkpointing(FastAPI(title="tools"), ModelParticipant(), on)
    install_checkpointing(FastAPI(title="tools"), ModelParticipant(), CheckpointSettings())
    lines = [record.getMessage() for record in caplog.records if record.name == "gymckpt.participants"]
    assert lines == [
        f"tools: checkpointing on, allowed roots {os.path.realpath(tmp_path)}",
        "tools: checkpointing off",
    ]
    caplog.clear()
    monkeypatch.setenv(STARTUP_LINE_ENV, "1")  # gymckpt serve logged its own line, with the address
    install_checkpointing(FastAPI(title="tools"), ModelParticipant(), on)
    assert [record for record in caplog.records if record.name == "gymckpt.participants"] == []
