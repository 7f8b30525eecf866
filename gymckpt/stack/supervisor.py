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
can start it again with another count. An entry names either a ``kind:`` or an ``app:`` of
your own (``module:attr``, started as ``gymckpt serve --app module:attr``, imported from the
directory the stack starts in); an app's ``config:`` is its settings file (the stack's
``checkpoint:`` block included), e.g.
``{name: notes, app: "examples.tool_server:app", workers: 2}``. The servers inherit this process's environment:
``GYMCKPT_LOG_LEVEL``, ``GYMCKPT_KEEP_ALIVE`` and ``GYMCKPT_POOL_LIMIT`` reach each of them
(``gymckpt stack up --log-level … --keep-alive …`` sets the first two).

A stack file is checked whole before any socket opens or server starts: a key that looks
like one a stack file (or its entries) may hold (``chekpoint:``, ``Checkpoint:``,
``server:``, ``ap:``) is refused with a did-you-mean, as are a ``"{name}"`` that names no
server, each server's config (:func:`~gymckpt.stack.kinds.load_config`; an app's
``checkpoint:`` block), an entry with both ``kind:`` and ``app:`` or neither, and an app
whose module is not to be found (it is not imported: its own errors come when it starts);
every error is a :class:`~gymckpt.errors.SettingsError` naming the file and the key path.

The servers' configs (with the control token) and logs go to the stack's working
directory: a temporary ``gymckpt-stack-*`` one unless ``workdir`` is given, removed when
the stack closes unless ``keep_workdir``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gymckpt.control.settings import load_settings, misspelled_keys, misspellings, read_yaml_file
from gymckpt.errors import AppNotLoadable, SettingsError
from gymckpt.stack.apps import check_app_spec
from gymckpt.stack.kinds import KINDS, NOT_GYM, config_fields, load_config
from gymckpt.transport import LISTEN_BACKLOG

__all__ = [
    "APP_KIND",
    "ENTRY_KEYS",
    "STACK_KEYS",
    "WORKDIR_PREFIX",
    "ServerProcess",
    "Stack",
    "StackEntry",
    "checked_stack",
    "load_stack",
    "server_configs",
]

logger = logging.getLogger(__name__)

#: the keys a stack file's top level holds (others are left alone unless they look like one of these)
STACK_KEYS = frozenset({"host", "checkpoint", "workers", "servers", "ray"})  # ray: gymckpt.stack.ray's block
#: the keys of one ``servers:`` entry (the same rule)
ENTRY_KEYS = frozenset({"name", "kind", "app", "port", "workers", "config"})
#: the ``kind`` of an ``app:`` entry's :class:`ServerProcess` (its ``app`` names the app)
APP_KIND = "app"
#: the name of a stack's temporary working directory starts so (in the system's temporary directory)
WORKDIR_PREFIX = "gymckpt-stack-"

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
    #: an app of your own (``module:attr``, ``gymckpt serve --app``); ``kind`` is then :data:`APP_KIND`
    app: str | None = None

    @property
    def label(self) -> str:
        """What the server runs: its kind, or its app's ``module:attr``."""
        return self.app or self.kind

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
        what = ("--app", self.app) if self.app is not None else (self.kind,)
        try:
            self.process = subprocess.Popen(
                [
                    *(sys.executable, "-m", "gymckpt", "serve", *what),
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

    def renew_socket(self) -> None:
        """A new listening socket on the same address: what waited in the old one's backlog is reset.

        Connections the killed process never accepted would otherwise reach the next one with
        their requests, as if sent to it; a crashed node's socket takes them with it.
        """
        address = self.sock.getsockname()[:2]
        self.sock.close()  # Linux resets every connection still in its accept queue
        self.sock = socket.create_server(address, backlog=LISTEN_BACKLOG)
        self.sock.set_inheritable(True)

    def kill(self, timeout: float = 30.0) -> None:
        """SIGKILL the server's whole process group and reap it."""
        self.signal_kill()
        self.reap(timeout)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Stack:
    """A set of servers started from a stack spec, killable and restartable as a whole.

    ``workdir`` holds the servers' configs (the control token among them) and logs; without
    one, a temporary ``gymckpt-stack-*`` directory is made, and :meth:`close` removes it
    unless ``keep_workdir``. A ``workdir`` given is the caller's and stays.
    """

    def __init__(
        self,
        servers: dict[str, ServerProcess] | None = None,
        workdir: Path | None = None,
        *,
        keep_workdir: bool = False,
    ) -> None:
        self.servers: dict[str, ServerProcess] = servers if servers is not None else {}
        #: whether :meth:`close` removes :attr:`workdir` (a temporary one made here, unless kept)
        self.removes_workdir = workdir is None and not keep_workdir
        self.workdir: Path = workdir if workdir is not None else Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX))
        self._closed = False
        self._started = False

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
                self._started = True
                server.start(self.workdir)

    def kill(self, names: list[str] | None = None, *, drop_backlog: bool = False) -> None:
        """SIGKILL the named servers' process groups at once (all by default); their sockets stay open.

        Every group is signalled before any is reaped, so no server outlives another and
        answers for it: a node failure takes them all at the same moment. ``drop_backlog``:
        the sockets are renewed (:meth:`ServerProcess.renew_socket`), so no connection the
        killed processes never accepted reaches the next ones, as after a real node's loss.
        """
        chosen = [self.servers[name] for name in names or list(self.servers)]
        for server in chosen:
            server.signal_kill()
        for server in chosen:
            server.reap()
        if drop_backlog:
            for server in chosen:
                server.renew_socket()

    def close(self) -> None:
        """Kill every server, close the sockets, and remove a temporary workdir (unless kept).

        Once servers were started, one INFO line says where their logs are, or that they were removed.
        """
        try:
            self.kill()
        finally:
            for server in self.servers.values():
                server.sock.close()
            if not self._closed:
                self._closed = True
                self._leave_workdir()

    def _leave_workdir(self) -> None:
        if self.removes_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if not self._started:  # nothing ran (a refused stack file): nothing to say
            return
        if self.removes_workdir:
            logger.info(
                "stack stopped; its servers' logs and configs (with the control token) in %s were removed "
                "(keep_workdir, or gymckpt stack up --keep-workdir, keeps them)",
                self.workdir,
            )
        else:
            logger.info("stack stopped; its servers' logs are in %s", self.workdir)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def load_stack(spec: str | Path | dict[str, Any], *, workdir: Path | None = None, keep_workdir: bool = False) -> Stack:
    """Check the whole spec, open every server's socket and resolve ``{name}`` URLs; nothing is started yet.

    Every mistake is a :class:`~gymckpt.errors.SettingsError` (a ``ValueError``) naming the
    file and the key path (``stack.yaml: servers[1].config.modl_url: unknown key; did you
    mean 'model_url'?``), raised before any server starts; a file YAML cannot parse is
    ``"<file>: invalid YAML at line L, column C: …"``. ``workdir`` (made if missing) holds
    the servers' configs and logs; without it a temporary directory does, removed when the
    stack closes unless ``keep_workdir``.
    """
    path, data, entries, checkpoint = checked_stack(spec)
    host = str(data.get("host", "127.0.0.1"))
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)  # the servers' configs and logs go there
    stack = Stack(workdir=workdir, keep_workdir=keep_workdir)
    try:
        for name, kind, app, port, workers, _ in entries:
            # the servers' own backlog: connects made while a server (re)starts wait here
            sock = socket.create_server((host, port), backlog=LISTEN_BACKLOG)
            sock.set_inheritable(True)
            log = stack.workdir / f"{name}.log"
            stack.servers[name] = ServerProcess(name, kind, {}, sock, log, workers=workers, app=app)
        for name, resolved in server_configs(entries, checkpoint, stack.urls, path).items():
            stack.servers[name].config = resolved
    except BaseException:  # a refused entry, an interrupt: nothing of this stack stays open or on disk
        stack.close()
        raise
    return stack


#: one checked ``servers:`` entry: ``(name, kind, app, port, workers, config)``
StackEntry = tuple[str, str, str | None, int, int, dict[str, Any]]


def checked_stack(spec: str | Path | dict[str, Any]) -> tuple[str, dict[str, Any], list[StackEntry], Any]:
    """``(path, data, entries, checkpoint block)`` of a stack file or dict, every key checked (see :func:`load_stack`)."""
    path = "" if isinstance(spec, dict) else str(spec)
    data: Any = spec if isinstance(spec, dict) else read_yaml_file(spec)
    entries = _checked_entries(data, path)
    checkpoint = data.get("checkpoint")
    if checkpoint is not None:
        _check_block(checkpoint, path)
    return path, data, entries, checkpoint


def server_configs(
    entries: list[StackEntry], checkpoint: Any, urls: dict[str, str], path: str = ""
) -> dict[str, dict[str, Any]]:
    """Each server's config with ``"{name}"`` resolved to ``urls``, the stack's checkpoint block added, checked.

    A config the server would refuse is a :class:`~gymckpt.errors.SettingsError` naming the entry.
    """
    configs = {}
    for index, (name, kind, app, _, _, config) in enumerate(entries):
        where = f"servers[{index}].config"
        resolved = _resolve(config, urls, path, where)
        if checkpoint is not None and kind not in NOT_GYM and "checkpoint" not in resolved:
            resolved["checkpoint"] = checkpoint
        if app is None and "instance" in config_fields(kind):
            resolved.setdefault("instance", name)
        try:
            # what the server will read: refused here, before any starts (an app: its checkpoint: block)
            if app is not None:
                load_settings(resolved)
            else:
                load_config(kind, resolved)
        except SettingsError as exc:
            prefix = f"{where}."
            raise SettingsError([(prefix + key, why) for key, why in exc.problems], path=path) from None
        configs[name] = resolved
    return configs


def _check_block(checkpoint: Any, path: str) -> None:
    """The stack's ``checkpoint:`` block, checked once (each Gym server gets it)."""
    try:
        load_settings({"checkpoint": checkpoint})
    except SettingsError as exc:
        raise SettingsError(exc.problems, path=path) from None


def _checked_entries(data: Any, path: str) -> list[StackEntry]:
    """``(name, kind, app, port, workers, config)`` of each entry; every mistake of the file at once."""
    if not isinstance(data, dict):
        raise SettingsError("a stack file is a mapping with a 'servers' list", path=path)
    problems = misspelled_keys(data, STACK_KEYS)
    if not isinstance(data.get("servers"), list):
        if "servers" not in {key for key, _ in problems} | set(misspellings(data, STACK_KEYS).values()):
            problems.append(("servers", "required: a list of servers, each with a name and a kind"))
        raise SettingsError(problems, path=path)
    default_workers = data.get("workers", 1)  # a stack-wide default for entries without their own
    if type(default_workers) is not int or default_workers < 1:
        problems.append(("workers", "must be a positive integer"))
    entries = []
    names: set[str] = set()
    for index, entry in enumerate(data["servers"]):
        where = f"servers[{index}]"
        if not isinstance(entry, dict):
            problems.append((where, "must be a mapping with a name and a kind"))
            continue
        problems.extend(misspelled_keys(entry, ENTRY_KEYS, prefix=f"{where}."))
        name, kind, app = entry.get("name"), entry.get("kind"), entry.get("app")
        if not isinstance(name, str) or not name:
            problems.append((f"{where}.name", "required: the server's name"))
        elif name in names:
            problems.append((f"{where}.name", f"two servers are named {name!r}"))
        if "app" in entry:
            problems.extend(_app_problems(entry, where))
            kind = APP_KIND
        elif kind not in KINDS:
            meant = misspellings({kind: None}, KINDS).get(kind) if isinstance(kind, str) else None
            hint = f"; did you mean {meant!r}?" if meant else ""
            either = f"one of {', '.join(KINDS)}; or app: module:attr, an app of your own"
            problems.append((f"{where}.kind", f"{kind!r} is no server kind{hint} ({either})"))
        port, workers = _port(entry.get("port", 0)), entry.get("workers", default_workers)
        if port is None:
            problems.append((f"{where}.port", "must be a port number, 0 to 65535 (0: a free one)"))
        if type(workers) is not int or workers < 1:
            problems.append((f"{where}.workers", "must be a positive integer"))
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            problems.append((f"{where}.config", "must be a mapping (the server's config)"))
        if isinstance(name, str) and name:
            names.add(name)
        config = dict(config) if isinstance(config, dict) else {}
        entries.append((name, kind, app if isinstance(app, str) else None, port or 0, workers, config))
    if problems:
        raise SettingsError(problems, path=path)
    return entries


def _app_problems(entry: dict[str, Any], where: str) -> list[tuple[str, str]]:
    """What is wrong with an ``app:`` entry: a ``kind:`` beside it, an app that is no ``module:attr`` to be found."""
    problems = []
    if "kind" in entry:
        problems.append((where, "give a kind or an app, not both"))
    app = entry["app"]
    if not isinstance(app, str):
        problems.append((f"{where}.app", "must be module:attr, an app of your own (e.g. examples.tool_server:app)"))
        return problems
    try:
        check_app_spec(app)  # found, not imported: the app's own code runs in its server's process
    except AppNotLoadable as exc:
        problems.append((f"{where}.app", str(exc).removeprefix(f"--app {app!r}: ").removeprefix(f"--app {app}: ")))
    return problems


def _port(value: Any) -> int | None:
    """A port number (as an int or its digits), None when it is none."""
    if isinstance(value, bool):
        return None
    try:
        port = int(value)
    except (TypeError, ValueError):
        return None
    return port if 0 <= port <= 65535 else None


def _resolve(value: Any, urls: dict[str, str], path: str = "", where: str = "") -> Any:
    """``value`` with each ``"{name}"`` (in a string, or a mapping's key) replaced by that server's URL;
    one that names no server is refused."""
    if isinstance(value, str):
        if "{" not in value:
            return value
        try:
            return value.format_map(urls)
        except KeyError as exc:
            missing = str(exc.args[0])
            meant = misspellings({missing: None}, urls).get(missing)
            hint = f"; did you mean {'{' + meant + '}'!r}?" if meant else ""
            why = f"{'{' + missing + '}'!r} names no server of this stack{hint} (servers: {', '.join(urls)})"
        except (ValueError, IndexError, AttributeError):
            why = "a '{' or '}' that is no \"{name}\" of a server (write a literal one as '{{' or '}}')"
        raise SettingsError([(where, why)], path=path) from None
    if isinstance(value, dict):  # keys too: a bound by server, {"{resources}": 1000}
        return {
            _resolve(key, urls, path, f"{where}.{key}"): _resolve(item, urls, path, f"{where}.{key}")
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_resolve(item, urls, path, f"{where}[{index}]") for index, item in enumerate(value)]
    return value
