"""Crash worker for ``test_crash_consistency.py`` (a helper program, not a test module).

Started once per test module as ``python crash_worker.py``. It imports gymckpt once,
stays single-threaded, and serves one JSON request per stdin line with one JSON reply per
stdout line. For each request it ``fork()``s a child that commits a participant with the
OS functions of the local backend wrapped by a thread-safe operation counter; when the
counter reaches ``kill_at`` the child sends itself a real ``SIGKILL`` *before* that
operation runs (for ``os.write`` optionally after writing only the first part of the
buffer: a torn write). ``kill_at: null`` is a dry run that counts the operations and
returns their names.

Request::

    {"root": "/tmp/.../p17", "checkpoint_dir": "ck", "kind": "environment", "instance": "env-0",
     "checkpoint_id": "ck-1", "count": 360, "payload": 900, "chunk_size": 1024,
     "kill_at": 17, "torn": 0.4, "timeout": 60}

Reply::

    {"pid": 123, "status": 9, "signaled": true, "signal": 9, "exit_code": null,
     "timed_out": false, "child": {"outcome": "committed", "ops": 290, "trace": [...]} | null}

``child`` is what the child reported through a pipe before it exited normally; a killed
child reports nothing. Every wait is bounded by ``timeout`` seconds; a child that
overruns it is killed and the reply says ``timed_out``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

from gymckpt.store import CheckpointStore
from gymckpt.store._local import LocalBackend
from gymckpt.testing.values import sample_records

if TYPE_CHECKING:
    from collections.abc import Iterator

#: the os functions the local backend's commit path uses (os.makedirs calls os.mkdir through
#: the module's globals, so a recursive makedirs counts each level it visits)
WRAPPED = ("open", "write", "fsync", "fdatasync", "close", "rename", "replace", "link", "unlink", "mkdir", "makedirs")
#: a child that exits normally after being armed would be a bug in this worker: make it loud
_NOT_KILLED_EXIT = 117
#: the worker exits when its parent sent nothing for this long (or closed its stdin)
IDLE_TIMEOUT = 600.0

_REAL = {name: getattr(os, name) for name in WRAPPED}
_RECORDS: dict[tuple[int, int], list[dict[str, Any]]] = {}


def _records(count: int, payload: int) -> list[dict[str, Any]]:
    key = (count, payload)
    if key not in _RECORDS:
        _RECORDS[key] = sample_records(count, payload=payload)
    return _RECORDS[key]


class _Armed:
    """Counts every wrapped os call of the process; kills it at call number ``kill_at`` (1-based)."""

    def __init__(self, kill_at: int | None, torn: float | None) -> None:
        self.kill_at = kill_at
        self.torn = torn
        self.count = 0
        self.trace: list[str] = []
        self.lock = threading.Lock()

    def install(self) -> None:
        for name in WRAPPED:
            setattr(os, name, self._wrap(name, _REAL[name]))

    def _wrap(self, name: str, real: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                self.count += 1
                self.trace.append(name)
                due = self.count == self.kill_at
            if due:
                if name == "write" and self.torn is not None:
                    fd, data = args[0], memoryview(args[1])
                    _REAL["write"](fd, data[: int(len(data) * self.torn)])  # a torn write: only a prefix lands
                os.kill(os.getpid(), signal.SIGKILL)
                os._exit(_NOT_KILLED_EXIT)  # unreachable: SIGKILL to oneself is fatal before kill() returns
            return real(*args, **kwargs)

        return wrapper


def _child(request: dict[str, Any], report_fd: int) -> None:
    """Runs in the forked child; never returns."""
    outcome: dict[str, Any]
    armed = _Armed(request["kill_at"], request.get("torn"))
    try:
        records = _records(request["count"], request["payload"])
        store = CheckpointStore(LocalBackend(request["root"]), chunk_size=request["chunk_size"])
        armed.install()
        manifest = store.write_participant(
            request["checkpoint_dir"],
            kind=request["kind"],
            instance=request["instance"],
            checkpoint_id=request["checkpoint_id"],
            records=iter(records),
        )
        with armed.lock:
            outcome = {"outcome": "committed", "ops": armed.count, "trace": armed.trace, "manifest": manifest.path}
    except BaseException as exc:
        with armed.lock:
            outcome = {
                "outcome": "error",
                "ops": armed.count,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
    for name, real in _REAL.items():  # report with the real functions, never counted
        setattr(os, name, real)
    data = (json.dumps(outcome) + "\n").encode()
    view = memoryview(data)
    while view:
        view = view[os.write(report_fd, view) :]
    os._exit(0)


def _read_until_eof(fd: int, deadline: float) -> tuple[bytes, bool]:
    """Read ``fd`` until EOF or the deadline; returns (data, reached_eof)."""
    chunks = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return b"".join(chunks), False
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks), True
        chunks.append(chunk)


def _reap(pid: int, pidfd: int, deadline: float) -> tuple[int, bool]:
    """Wait for the child until the deadline, then SIGKILL it; returns (wait status, timed_out)."""
    ready, _, _ = select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))
    timed_out = not ready
    if timed_out:
        os.kill(pid, signal.SIGKILL)
        ready, _, _ = select.select([pidfd], [], [], 30.0)
        if not ready:
            raise RuntimeError(f"child {pid} survived SIGKILL for 30 s")
    _, status = os.waitpid(pid, 0)  # the child has exited: this returns at once
    return status, timed_out


def serve_one(request: dict[str, Any]) -> dict[str, Any]:
    if request["kill_at"] is None:
        request["kill_at"] = -1  # a dry run: the counter never reaches it
    timeout = float(request.get("timeout", 60))
    _records(request["count"], request["payload"])  # build once here so every child inherits them
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            _child(request, write_fd)
        finally:
            os._exit(70)
    os.close(write_fd)
    deadline = time.monotonic() + timeout
    pidfd = os.pidfd_open(pid)
    try:
        data, eof = _read_until_eof(read_fd, deadline)
        status, timed_out = _reap(pid, pidfd, deadline if eof else time.monotonic())
    finally:
        os.close(pidfd)
        os.close(read_fd)
    child = json.loads(data) if data.strip() else None
    return {
        "pid": pid,
        "status": status,
        "signaled": os.WIFSIGNALED(status),
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "timed_out": timed_out or not eof,
        "child": child,
    }


def _requests(idle_timeout: float) -> Iterator[str]:
    """Lines from stdin until EOF, or until none came for ``idle_timeout`` seconds."""
    buffer = b""
    while True:
        while b"\n" in buffer:
            line, _, buffer = buffer.partition(b"\n")
            yield line.decode()
        ready, _, _ = select.select([0], [], [], idle_timeout)
        if not ready:
            print(f"crash worker: no request for {idle_timeout} s, exiting", file=sys.stderr)
            return
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return
        buffer += chunk


def main() -> int:
    if threading.active_count() != 1:
        print(f"crash worker must be single-threaded, has {threading.active_count()} threads", file=sys.stderr)
        return 2
    for line in _requests(IDLE_TIMEOUT):
        if not line.strip():
            continue
        try:
            reply = serve_one(json.loads(line))
        except Exception:
            reply = {"worker_error": traceback.format_exc()}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
