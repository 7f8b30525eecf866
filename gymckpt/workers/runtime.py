"""The runtime directory of a server process: where the Unix sockets of its workers live.

One directory per process, ``/tmp/gymckpt-<pid>-<8 hex>/``, mode 0700 (under /tmp because
an AF_UNIX path holds at most :data:`MAX_SOCKET_PATH` bytes). Sockets in it are named
``<prefix>-<8 hex>.sock`` (:func:`socket_path`) and made 0600 right after they are bound
(:func:`restrict_socket`). The directory is removed at exit by the process that created it
only: a forked child that inherits the exit hook leaves it alone.

Creating one first removes stale ones (:func:`remove_stale_dirs`): same uid, a name of this
form, a pid that no longer exists, and no socket inside that accepts a connection. A probe
that times out or fails otherwise counts as alive; age never decides.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import shutil
import socket
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gymckpt.errors import GymckptError

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "DEFAULT_ROOT",
    "InvalidSocketPath",
    "MAX_SOCKET_PATH",
    "PROBE_SECONDS",
    "RuntimeDir",
    "create_runtime_dir",
    "process_runtime_dir",
    "remove_stale_dirs",
    "restrict_socket",
    "socket_path",
]

DEFAULT_ROOT = Path("/tmp")
#: the longest path an AF_UNIX socket can be bound to (sun_path holds 108 bytes with its NUL)
MAX_SOCKET_PATH = 107
#: how long a stale directory's socket gets to accept a probe connection, in seconds
PROBE_SECONDS = 0.5
DIR_PREFIX = "gymckpt"
_DIR_NAME = re.compile(rf"{DIR_PREFIX}-(\d+)-[0-9a-f]{{8}}")
_CREATE_ATTEMPTS = 16


class InvalidSocketPath(GymckptError, ValueError):
    """A socket path that cannot be bound: longer than AF_UNIX allows, or a prefix that is not a name."""


@dataclass(frozen=True)
class RuntimeDir:
    """A runtime directory and the pid that created it (the only one that removes it)."""

    path: Path
    creator: int
    getpid: Callable[[], int] = field(default=os.getpid, repr=False, compare=False)

    def remove(self) -> bool:
        """Remove the directory and its sockets when called by its creator; True if it did."""
        if self.getpid() != self.creator:
            return False
        shutil.rmtree(self.path, ignore_errors=True)
        return True


def _pid_alive(pid: int) -> bool:
    """True unless ``pid`` surely names no process (a pid this module cannot judge counts as alive)."""
    if pid <= 0:
        return True  # os.kill(0, …) would signal our own process group
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _socket_accepts(path: Path, timeout: float) -> bool:
    """True unless a connection to ``path`` is refused (nothing listens) or its file is gone."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(os.fspath(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True  # a timeout, a full backlog, a path too long: maybe alive
    return True


def _any_socket_accepts(directory: Path, timeout: float) -> bool:
    with os.scandir(directory) as entries:
        sockets = [Path(entry.path) for entry in entries if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode)]
    return any(_socket_accepts(path, timeout) for path in sockets)


def remove_stale_dirs(
    root: Path = DEFAULT_ROOT,
    *,
    probe_seconds: float = PROBE_SECONDS,
    pid_alive: Callable[[int], bool] = _pid_alive,
) -> list[Path]:
    """Remove the runtime directories under ``root`` left by dead processes of this uid; return them."""
    removed: list[Path] = []
    try:
        with os.scandir(root) as listing:
            entries = list(listing)
    except OSError:
        return removed
    for entry in entries:
        match = _DIR_NAME.fullmatch(entry.name)
        if match is None:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or pid_alive(int(match[1])):
                continue
            if _any_socket_accepts(Path(entry.path), probe_seconds):
                continue
        except OSError:
            continue  # gone meanwhile, or unreadable: not ours to judge
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(Path(entry.path))
    return removed


def create_runtime_dir(
    root: Path = DEFAULT_ROOT,
    *,
    getpid: Callable[[], int] = os.getpid,
    remove_at_exit: bool = True,
) -> RuntimeDir:
    """Create a fresh runtime directory under ``root`` (mode 0700), after removing stale ones."""
    remove_stale_dirs(root)
    pid = getpid()
    for _ in range(_CREATE_ATTEMPTS):
        path = root / f"{DIR_PREFIX}-{pid}-{secrets.token_hex(4)}"
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            continue
        path.chmod(0o700)  # mkdir's mode passes through the umask
        runtime = RuntimeDir(path, pid, getpid)
        if remove_at_exit:
            atexit.register(runtime.remove)
        return runtime
    raise FileExistsError(f"no free runtime directory name under {root} after {_CREATE_ATTEMPTS} attempts")


_process_lock = threading.Lock()
_process_dir: RuntimeDir | None = None


def process_runtime_dir() -> RuntimeDir:
    """This process's runtime directory under /tmp, created on first use (a forked child gets its own)."""
    global _process_dir  # noqa: PLW0603 - one directory per process
    with _process_lock:
        if _process_dir is None or _process_dir.creator != os.getpid():
            _process_dir = create_runtime_dir()
        return _process_dir


def socket_path(directory: Path, prefix: str) -> Path:
    """A fresh socket path ``<directory>/<prefix>-<8 hex>.sock``; :class:`InvalidSocketPath` past the AF_UNIX limit."""
    if not prefix or "/" in prefix or "\0" in prefix:
        raise InvalidSocketPath(f"socket prefix {prefix!r} must be a non-empty name without '/'")
    path = directory / f"{prefix}-{secrets.token_hex(4)}.sock"
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise InvalidSocketPath(f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes")
    return path


def restrict_socket(path: Path) -> None:
    """Make a just-bound socket readable and writable by its owner only (0600)."""
    os.chmod(path, 0o600)
