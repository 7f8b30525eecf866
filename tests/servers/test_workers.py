"""A checkpointing server started by plain uvicorn with several workers (no gymckpt coordinator) refuses to start.

The real check: ``uvicorn --factory gymckpt.stack:app_from_env --workers 2`` as a
subprocess must never answer and must end, its output naming the missing coordinator and
``gymckpt serve KIND --workers N``, which starts one; the same command with ``--workers 1`` serves ``/health``.
Every wait is bounded; between attempts the test waits on the process itself.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn
import uvicorn._subprocess
from fastapi.testclient import TestClient

from gymckpt.participants.install import SeveralWorkersError, uvicorn_worker_count
from gymckpt.servers.counter import CounterConfig, build_counter_app
from gymckpt.stack.serving import WORKER_HEALTHCHECK_ENV, WorkerDeaths, worker_healthcheck_seconds

from ..support import kill_group, start_uvicorn, uvicorn_port
from .resources_support import config

#: the bound of a server's start (or of its refusal to start), in seconds
START_BOUND = 60.0
MESSAGE = "but no checkpoint coordinator"


class Uvicorn:
    """``uvicorn --factory`` of a checkpointing counter server, in its own process group."""

    def __init__(self, workers: int, log: Path) -> None:
        self.log = log
        env = {key: value for key, value in os.environ.items() if key != "WEB_CONCURRENCY"}
        env.update(
            GYMCKPT_SERVER_KIND="counter",
            GYMCKPT_CHECKPOINT__ENABLED="true",
            GYMCKPT_CHECKPOINT__CONTROL_AUTH_TOKEN="workers-test-token",
        )
        with log.open("wb") as out:
            self.process = start_uvicorn(
                [
                    "--factory",
                    "gymckpt.stack:app_from_env",
                    "--workers",
                    str(workers),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def health(self) -> int | None:
        """The status of ``GET /health``; None before uvicorn listens or when nobody answers within half a second.

        The port is the one uvicorn bound itself and named in its output.
        """
        port = uvicorn_port(self.output())
        if port is None:
            return None
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).status_code
        except httpx.HTTPError:
            return None

    def exited_within(self, seconds: float) -> bool:
        try:
            self.process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self) -> None:
        kill_group(self.process, timeout=30)


@pytest.fixture
def servers(tmp_path: Path):
    started: list[Uvicorn] = []

    def start(workers: int) -> Uvicorn:
        server = Uvicorn(workers, tmp_path / f"uvicorn-{len(started)}.log")
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()


def test_two_uvicorn_workers_refuse_to_serve_a_checkpointing_app(servers: Any) -> None:
    server = servers(2)
    deadline = time.monotonic() + START_BOUND
    answers: list[int] = []
    while server.process.poll() is None and time.monotonic() < deadline:
        status = server.health()
        if status is not None:
            answers.append(status)
        server.exited_within(0.2)
    assert server.process.poll() is not None, f"uvicorn --workers 2 still runs:\n{server.output()}"
    assert 200 not in answers, answers
    output = server.output()
    assert MESSAGE in output, output
    assert "gymckpt serve KIND --workers 2" in output, output


def test_one_uvicorn_worker_serves_health(servers: Any) -> None:
    server = servers(1)
    deadline = time.monotonic() + START_BOUND
    status = None
    while time.monotonic() < deadline:
        status = server.health()
        if status == 200 or server.exited_within(0.2):
            break
    assert status == 200, f"uvicorn --workers 1 did not serve /health:\n{server.output()}"
    assert MESSAGE not in server.output()


# --- the detection, in process


def _worker(monkeypatch: pytest.MonkeyPatch, cfg: uvicorn.Config) -> None:
    """Make this process look like a worker uvicorn's multiprocess supervisor spawned with ``cfg``."""
    fake = SimpleNamespace(_target=uvicorn._subprocess.subprocess_started, _kwargs={"config": cfg})
    monkeypatch.setattr(multiprocessing, "current_process", lambda: fake)


def test_the_worker_count_comes_from_the_supervisors_config_or_web_concurrency(monkeypatch) -> None:
    assert uvicorn_worker_count() == 1  # the test process is no uvicorn worker
    _worker(monkeypatch, uvicorn.Config("x:app", workers=3))
    assert uvicorn_worker_count() == 3
    monkeypatch.setenv("WEB_CONCURRENCY", "4")
    _worker(monkeypatch, uvicorn.Config("x:app"))
    assert uvicorn_worker_count() == 4
    _worker(monkeypatch, uvicorn.Config("x:app", workers=1, reload=True))  # --reload runs one worker
    assert uvicorn_worker_count() == 1
    monkeypatch.setattr(multiprocessing, "current_process", lambda: SimpleNamespace(_target=print, _kwargs={}))
    assert uvicorn_worker_count() == 1


def test_the_lifespan_startup_refuses_several_workers_only_with_checkpointing_on(monkeypatch) -> None:
    _worker(monkeypatch, uvicorn.Config("x:app", workers=2))
    app = build_counter_app(config(CounterConfig, enabled=True))
    with pytest.raises(SeveralWorkersError, match=MESSAGE), TestClient(app):
        pass
    off = build_counter_app(config(CounterConfig, enabled=False))
    with TestClient(off) as http:
        assert http.get("/health").json() == {"status": "ok"}


def _record(level: int, message: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("uvicorn.error", level, __file__, 1, message, args, None)


def test_a_worker_the_supervisor_found_dead_is_a_warning_and_its_other_info_lines_are_dropped(monkeypatch) -> None:
    monkeypatch.setenv(WORKER_HEALTHCHECK_ENV, "42")
    deaths = WorkerDeaths()
    died = _record(logging.INFO, "Child process [%s] died", 4242)
    assert deaths.filter(died)
    assert (died.levelno, died.levelname) == (logging.WARNING, "WARNING")
    assert died.getMessage().startswith("Child process [4242] died: ")
    assert "within 42 s" in died.getMessage() and "lost" in died.getMessage()
    assert not deaths.filter(_record(logging.INFO, "Started server process [%d]", 7))
    assert not deaths.filter(_record(logging.INFO, "Waiting for application startup."))
    warning = _record(logging.WARNING, "Invalid HTTP request received.")
    assert deaths.filter(warning) and warning.getMessage() == "Invalid HTTP request received."


def test_the_health_check_timeout_is_a_minute_unless_the_variable_sets_it(monkeypatch) -> None:
    monkeypatch.delenv(WORKER_HEALTHCHECK_ENV, raising=False)
    assert worker_healthcheck_seconds() == 60
    monkeypatch.setenv(WORKER_HEALTHCHECK_ENV, "7")
    assert worker_healthcheck_seconds() == 7
    for bad in ("0", "-3", "1.5", "soon"):
        monkeypatch.setenv(WORKER_HEALTHCHECK_ENV, bad)
        with pytest.raises(ValueError, match=WORKER_HEALTHCHECK_ENV):
            worker_healthcheck_seconds()
