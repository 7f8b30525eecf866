"""NeMo Gym servers as real processes for the integration tests: Python 3.12 with nemo-gym 0.4.0.

The interpreter is ``GYMCKPT_NEMO_PYTHON``, else the repository's ``.venv-nemo/bin/python``
(``.ci/nemo-gym-venv`` builds it). Without it the tests are skipped saying what to run; where
``GYMCKPT_REQUIRE_NEMO_GYM`` is set (CI) they fail instead.

Each server listens on a socket the test opened and keeps (``gymckpt serve --fd``), in a
process group of its own: SIGKILL of the group and a fresh process serve the same port.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.support import REPO, kill_group

__all__ = [
    "NEMO_APP",
    "REQUIRE_ENV",
    "TOKEN",
    "NeMoServer",
    "nemo_python",
    "verify_body",
]

#: the factory every NeMo Gym server is served with
NEMO_APP = "gymckpt.integrations.nemo_gym:app"
#: the interpreter variable, and the variable that makes a missing one a failure (CI)
PYTHON_ENV = "GYMCKPT_NEMO_PYTHON"
REQUIRE_ENV = "GYMCKPT_REQUIRE_NEMO_GYM"
TOKEN = "nemo-gym-test-token"
#: how long a server may take to come up (importing NeMo Gym takes seconds on a loaded machine)
START_SECONDS = 120.0


def nemo_python() -> Path:
    """The Python 3.12 with NeMo Gym; skips (fails in CI) when there is none."""
    named = os.environ.get(PYTHON_ENV, "").strip()
    python = Path(named) if named else REPO / ".venv-nemo" / "bin" / "python"
    if python.exists():
        return python
    why = (
        f"no Python with NeMo Gym at {python}: run .ci/nemo-gym-venv (it needs a Python 3.12, e.g. "
        f"`pyenv install 3.12`) or set {PYTHON_ENV}"
    )
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{REQUIRE_ENV} is set: {why}")
    pytest.skip(why)


def listening_socket() -> socket.socket:
    sock = socket.create_server(("127.0.0.1", 0), backlog=1024)
    sock.set_inheritable(True)
    return sock


@dataclass
class NeMoServer:
    """One server of a test stack: a kept socket, a config file, and its current process."""

    name: str
    workdir: Path
    python: Path
    sock: socket.socket = field(default_factory=listening_socket)
    app: str = NEMO_APP
    kind: str | None = None  # a gymckpt reference kind (model, inference) instead of the app
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.workdir / f"{self.name}.yaml"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def write_config(self, config: dict[str, Any]) -> None:
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))

    def start(self, *, workers: int = 1, env: dict[str, str] | None = None) -> None:
        """A fresh process serving the kept socket."""
        fd = self.sock.fileno()
        what = [self.kind] if self.kind is not None else ["--app", self.app]
        environ = {**os.environ, **(env or {})}
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH", "")]))
        self.starts += 1
        with self.log_path.open("ab") as log:
            log.write(f"--- start {self.starts} ---\n".encode())
            self.process = subprocess.Popen(
                [
                    str(self.python),
                    *("-m", "gymckpt", "serve", *what),
                    *("--config", str(self.config_path), "--fd", str(fd), "--workers", str(workers)),
                ],
                cwd=self.workdir,
                env=environ,
                pass_fds=(fd,),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self) -> None:
        """SIGKILL the server's process group (every worker) and reap it."""
        if self.process is not None:
            kill_group(self.process, timeout=30)

    def close(self) -> None:
        self.kill()
        self.sock.close()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return f"\n--- {self.name} log:\n" + "\n".join(text[-lines:])

    async def wait_up(self, session: aiohttp.ClientSession, *, path: str = "/", workers: int = 1) -> None:
        """Until ``path`` answers 200 (and every worker linked to the coordinator); fails when the process exits."""
        deadline = time.monotonic() + START_SECONDS
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.process.returncode}{self.log_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} did not answer within {START_SECONDS} s{self.log_tail()}")
            try:
                async with session.get(self.url + path, timeout=aiohttp.ClientTimeout(total=5)) as reply:
                    if reply.status == 200 and await self._workers_linked(session, workers):
                        return
            except (TimeoutError, aiohttp.ClientError):
                pass
            await asyncio.sleep(0.2)

    async def _workers_linked(self, session: aiohttp.ClientSession, workers: int) -> bool:
        if workers <= 1:
            return True
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with session.get(self.url + "/ng-control/v1/checkpoint/status", headers=headers) as reply:
            status = await reply.json()
        return bool(status.get("workers", 1) >= status.get("expected_workers", 1))


def kill_all(servers: list[NeMoServer]) -> None:
    """SIGKILL every server's process group at once (as a node failure would)."""
    for server in servers:
        if server.process is not None and server.process.poll() is None:
            try:
                os.killpg(server.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for server in servers:
        server.kill()


def verify_body(expected_count: int) -> dict[str, Any]:
    """A NeMo Gym ``/verify`` body of the stateful counter: a minimal valid response and the expected count."""
    return {
        "responses_create_params": {"input": [{"role": "user", "content": "count"}]},
        "response": {
            "id": "resp_test",
            "created_at": 0,
            "model": "test",
            "object": "response",
            "output": [],
            "parallel_tool_calls": False,
            "tool_choice": "auto",
            "tools": [],
        },
        "expected_count": expected_count,
    }
