"""Supervise a stack of reference servers as real processes: start, SIGKILL, restart, from YAML or a dict.

Each server of a stack runs in its own process group on a listening socket the stack
opened and keeps: connections made before the server is up wait in the socket's
backlog, and a server killed (SIGKILL of its process group, as a node failure takes a
server's workers with it) and started again serves the same port.

A stack file::

    host: 127.0.0.1
    checkpoint: {enabled: true, control_auth_token: secret, allowed_roots: [./checkpoints]}   # every Gym server
    servers:
      - {name: inference, kind: inference}
      - {name: model, kind: model, config: {inference_url: "{inference}"}}
      - {name: counter, kind: counter, workers: 2}
      - {name: agent, kind: agent, config: {model_url: "{model}"}}
      - {name: env, kind: environment, config: {agent_url: "{agent}", resources_url: "{counter}"}}

``"{name}"`` in a config value is replaced by that server's base URL; ``workers: N`` runs a
server as N uvicorn workers (``gymckpt serve KIND --workers N``), and :meth:`Stack.start`
can start it again with another count. The servers inherit this process's environment:
``GYMCKPT_LOG_LEVEL``, ``GYMCKPT_KEEP_ALIVE`` and ``GYMCKPT_POOL_LIMIT`` reach each of them
(``gymckpt stack up --log-level … --keep-alive …`` sets the first two).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gymckpt.control.settings import read_yaml_file
from gymckpt.stack.kinds import KINDS, NOT_GYM, config_fields
from gymckpt.transport import LISTEN_BACKLOG

__all__ = ["ServerProcess", "Stack", "load_stack"]

#: how often :meth:`ServerProcess.reap` looks whether a killed server's process group is empty, in seconds
_GROUP_POLL_SECONDS = 0.01


@dataclass
class ServerProcess:
    """One server of a stack: its listening socket (kept across restarts) and its process."""

    name: str
    kind: str
    config: dict[str, Any]
    sock: socket.socket
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    #: uvicorn worker processes (``--workers``)
    workers: int = 1

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def start(self, config_dir: Path) -> None:
        """Start the server in a new process group on the kept socket."""
        config_file = config_dir / f"{self.name}.yaml"
        config_file.write_text(yaml.safe_dump(self.config))
        fd = self.sock.fileno()
        log = self.log_path.open("ab")
        try:
            self.process = subprocess.Popen(
                [
                    *(sys.executable, "-m", "gymckpt", "serve", self.kind),
                    *("--fd", str(fd), "--config", str(config_file), "--workers", str(self.workers)),
                ],
                pass_fds=(fd,),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()

    def signal_kill(self) -> None:
        """SIGKILL the server's whole process group (reap it with :meth:`reap`)."""
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def reap(self, timeout: float = 30.0) -> None:
        """Wait for a killed server's process, and every process of its group (its workers), to be gone.

        A server's workers are its children: once it is gone, whoever adopted them reaps
        them, so the group empties a moment later; this waits for that too (bounded).
        """
        if self.process is None:
            return
        deadline = time.monotonic() + timeout
        pgid = self.process.pid
        self.process.wait(timeout=timeout)
        self.process = None
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            except PermissionError:  # the group id was reused by another user's process
                return
            time.sleep(_GROUP_POLL_SECONDS)

    def kill(self, timeout: float = 30.0) -> None:
        """SIGKILL the server's whole process group and reap it."""
        self.signal_kill()
        self.reap(timeout)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class Stack:
    """A set of servers started from a stack spec, killable and restartable as a whole."""

    servers: dict[str, ServerProcess] = field(default_factory=dict)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gymckpt-stack-")))

    @property
    def urls(self) -> dict[str, str]:
        return {name: server.url for name, server in self.servers.items()}

    def start(self, names: list[str] | None = None, *, workers: dict[str, int] | int | None = None) -> None:
        """Start (or restart) the named servers, all by default; ``workers`` changes their worker counts first."""
        for name in names or list(self.servers):
            server = self.servers[name]
            if workers is not None:
                server.workers = workers if isinstance(workers, int) else workers.get(name, server.workers)
            if not server.alive:
                server.start(self.workdir)

    def kill(self, names: list[str] | None = None) -> None:
        """SIGKILL the named servers' process groups at once (all by default); their sockets stay open.

        Every group is signalled before any is reaped, so no server outlives another and
        answers for it: a node failure takes them all at the same moment.
        """
        chosen = [self.servers[name] for name in names or list(self.servers)]
        for server in chosen:
            server.signal_kill()
        for server in chosen:
            server.reap()

    def close(self) -> None:
        """Kill every server and close the sockets."""
        self.kill()
        for server in self.servers.values():
            server.sock.close()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def load_stack(spec: str | Path | dict[str, Any], *, workdir: Path | None = None) -> Stack:
    """Open every server's socket and resolve ``{name}`` URLs; nothing is started yet.

    A file YAML cannot parse raises ``ValueError("<file>: invalid YAML at line L, column C: …")``.
    """
    if isinstance(spec, dict):
        data: Any = spec
    else:
        data = read_yaml_file(spec)
    if not isinstance(data, dict) or not isinstance(data.get("servers"), list):
        raise ValueError("a stack file is a mapping with a 'servers' list")
    host = str(data.get("host", "127.0.0.1"))
    checkpoint = data.get("checkpoint")
    default_workers = data.get("workers", 1)  # a stack-wide default for entries without their own
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)  # the servers' configs and logs go there
    stack = Stack() if workdir is None else Stack(workdir=workdir)
    entries = []
    for entry in data["servers"]:
        name, kind = entry.get("name"), entry.get("kind")
        if not name or kind not in KINDS:
            raise ValueError(f"stack entry {entry!r} needs a name and a kind among {', '.join(KINDS)}")
        if name in stack.servers:
            raise ValueError(f"two servers are named {name!r}")
        # the servers' own backlog: connects made while a server (re)starts wait here
        sock = socket.create_server((host, int(entry.get("port", 0))), backlog=LISTEN_BACKLOG)
        sock.set_inheritable(True)
        log_path = stack.workdir / f"{name}.log"
        workers = entry.get("workers", default_workers)
        if type(workers) is not int or workers < 1:
            raise ValueError(f"stack entry {name!r}: workers must be a positive integer, not {workers!r}")
        stack.servers[name] = ServerProcess(name, kind, {}, sock, log_path, workers=workers)
        entries.append((name, kind, dict(entry.get("config") or {})))
    urls = stack.urls
    for name, kind, config in entries:
        resolved = _resolve(config, urls)
        if checkpoint is not None and kind not in NOT_GYM and "checkpoint" not in resolved:
            resolved["checkpoint"] = checkpoint
        if "instance" in config_fields(kind):
            resolved.setdefault("instance", name)
        stack.servers[name].config = resolved
    return stack


def _resolve(value: Any, urls: dict[str, str]) -> Any:
    if isinstance(value, str):
        return value.format_map(urls) if "{" in value else value
    if isinstance(value, dict):
        return {key: _resolve(item, urls) for key, item in value.items()}
    if isinstance(value, list):
        return [_resolve(item, urls) for item in value]
    return value
