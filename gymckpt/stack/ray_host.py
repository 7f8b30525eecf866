"""The Ray actor that holds one server of a :class:`~gymckpt.stack.ray.RayStack` on its node.

One :class:`HostActor` per server, placed in its bundle of the stack's placement group: it binds
a free port on its node's address, starts the server's whole process group (``gymckpt serve …
--fd N --workers W``) under a :mod:`gymckpt.stack.lifeline` whose stdin only the actor holds,
answers ``wait_exit`` when the group's leader exits, and SIGKILLs the group on ``stop``.
Imported by the Ray workers that run it (and by :mod:`gymckpt.stack.ray`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ray
import yaml

from gymckpt.stack.lifeline import group_members
from gymckpt.transport import LISTEN_BACKLOG

__all__ = ["STOP_TIMEOUT", "HostActor"]

#: seconds an actor's stop may take before the actor is killed anyway
STOP_TIMEOUT = 30.0


class HostActor:
    """The Ray actor that holds one server on its node: its socket, its process group, its log."""

    def __init__(self, name: str, cwd: str, environment: dict[str, str], log_dir: str | None = None) -> None:
        """``log_dir``: where this server's directory (its config and log) goes, made if missing
        (None: the node's temp dir). A server stopped has it removed; one that died keeps it."""
        self.name = name
        self.node_id = ray.get_runtime_context().get_node_id()
        self.ip = ray.util.get_node_ip_address()
        self.sock = socket.create_server((self.ip, 0), backlog=LISTEN_BACKLOG)
        self.sock.set_inheritable(True)
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"gymckpt-ray-{name}-", dir=log_dir))
        self.log_path = self.workdir / f"{name}.log"
        self.cwd = cwd if Path(cwd).is_dir() else str(self.workdir)
        self.environment = environment
        self.process: subprocess.Popen[bytes] | None = None
        self._lifeline: int | None = None
        self._started = threading.Event()

    def where(self) -> dict[str, Any]:
        """Where the server will listen: node id, node address, URL, this actor's pid, the log's path."""
        port = self.sock.getsockname()[1]
        return {
            "node_id": self.node_id,
            "ip": self.ip,
            "url": f"http://{self.ip}:{port}",
            "actor_pid": os.getpid(),
            "log": str(self.log_path),
        }

    def start(self, what: list[str], config: dict[str, Any], workers: int) -> int:
        """Start the server's process group on the bound socket, under a lifeline; its leader's pid."""
        config_file = self.workdir / f"{self.name}.yaml"
        config_file.write_text(yaml.safe_dump(config))
        fd = self.sock.fileno()
        serve = [sys.executable, "-m", "gymckpt", "serve", *what, "--fd", str(fd), "--config", str(config_file)]
        command = [sys.executable, "-m", "gymckpt.stack.lifeline", "--keep-fd", str(fd), "--", *serve]
        read_end, self._lifeline = os.pipe()
        try:
            with self.log_path.open("ab") as log:
                self.process = subprocess.Popen(
                    [*command, "--workers", str(workers)],
                    stdin=read_end,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(fd,),
                    start_new_session=True,
                    cwd=self.cwd,
                    env={**os.environ, **self.environment},
                )
        finally:
            os.close(read_end)
        self._started.set()
        return self.process.pid

    def wait_exit(self) -> int:
        """Block until the server's process group leader exits; its status (an actor's death fails this call)."""
        self._started.wait()
        assert self.process is not None
        return self.process.wait()

    def stop(self) -> None:
        """SIGKILL the server's whole process group, wait until it is empty, remove the files (bounded)."""
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None
        if self.process is not None:
            pgid = self.process.pid
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(STOP_TIMEOUT)
            deadline = time.monotonic() + STOP_TIMEOUT
            while group_members(pgid) and time.monotonic() < deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                time.sleep(0.02)
        self.sock.close()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def remove_files(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)
