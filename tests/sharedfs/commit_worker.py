"""Commit worker for the shared-filesystem tests (a helper program, not a test module).

Started as ``python commit_worker.py``; it imports gymckpt once, stays single-threaded and
serves requests on stdin, one JSON line each, in two steps:

1. a request line: it forks a child that opens the store and builds the records, then waits;
   the worker replies ``{"ready": <child pid>}``;
2. a ``go`` line: the child commits (several workers told ``go`` back to back start together,
   a barrier); the worker replies with the outcome.

Request::

    {"root": "/mnt/a/t1", "checkpoint_dir": "ck", "kind": "environment", "instance": "env-0",
     "checkpoint_id": "ck-1", "count": 20, "payload": 100, "prefix": "r", "chunk_size": 1024,
     "kill_at": 7,                 # the child SIGKILLs itself before its 7th os operation
     "kill_after": 0.004,          # or: the worker SIGKILLs the child 4 ms after go
     "signal_at": {"pid": 123, "signal": 19, "after_records": 10},  # signal another process mid-commit
     "observe_root": "/mnt/b/t1",  # after the commit returned, read its manifest through here at once
     "timeout": 60}

Reply to ``go``::

    {"pid": 1, "signaled": true, "signal": 9, "exit_code": null, "timed_out": false, "seconds": 0.01,
     "child": {"outcome": "committed", "manifest": "ck/gym/…/manifest.json", "manifest_sha256": "…",
               "ops": 41, "observed": {"visible": true, "same_bytes": true, "seconds": 0.0002}}
              | {"outcome": "error", "type": "StorageError", "types": [...], "errno": 5, "error": "…"}
              | null}

A child that was killed reports nothing (``child`` null). Every wait is bounded by ``timeout``;
a child that overruns it is killed and the reply says ``timed_out``.
"""

from __future__ import annotations

import hashlib
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

#: the os functions a local commit goes through (kill points count these)
WRAPPED = ("open", "write", "fsync", "close", "rename", "replace", "link", "unlink", "mkdir", "makedirs")
_REAL = {name: getattr(os, name) for name in WRAPPED}
#: the worker exits when its parent sent nothing for this long (or closed its stdin)
IDLE_TIMEOUT = 600.0
_NOT_KILLED_EXIT = 117


def _arm(kill_at: int, trace: list[str]) -> None:
    """SIGKILL this process before its ``kill_at``-th wrapped os call (1-based)."""
    count = [0]

    def wrap(name: str, real: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            trace.append(name)
            if count[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
                os._exit(_NOT_KILLED_EXIT)
            return real(*args, **kwargs)

        return wrapper

    for name in WRAPPED:
        setattr(os, name, wrap(name, _REAL[name]))


def _disarm() -> None:
    for name, real in _REAL.items():
        setattr(os, name, real)


def _records(request: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The request's records, built now; ``signal_at`` sends its signal once that many were handed out."""
    records = sample_records(request["count"], prefix=request.get("prefix", "r"), payload=request["payload"])
    hook = request.get("signal_at")

    def handed_out() -> Iterator[dict[str, Any]]:
        for index, record in enumerate(records):
            if hook is not None and index == hook["after_records"]:
                os.kill(hook["pid"], hook["signal"])
            yield record

    return handed_out()


def _observe(request: dict[str, Any], manifest_path: str, raw: bytes) -> dict[str, Any]:
    """Read the just-committed manifest through the other mount, at once."""
    started = time.monotonic()
    try:
        with open(os.path.join(request["observe_root"], manifest_path), "rb") as stream:
            seen = stream.read()
    except FileNotFoundError:
        return {"visible": False, "same_bytes": False, "seconds": time.monotonic() - started}
    return {"visible": True, "same_bytes": seen == raw, "seconds": time.monotonic() - started}


def _child(request: dict[str, Any], ready_fd: int, go_fd: int, report_fd: int) -> None:
    """Runs in the forked child; never returns."""
    trace: list[str] = []
    try:
        store = CheckpointStore(LocalBackend(request["root"]), chunk_size=request["chunk_size"])
        records = _records(request)
        os.write(ready_fd, b"r")
        if os.read(go_fd, 1) != b"g":
            os._exit(71)
        if request.get("kill_at") is not None:
            _arm(request["kill_at"], trace)
        manifest = store.write_participant(
            request["checkpoint_dir"],
            kind=request["kind"],
            instance=request["instance"],
            checkpoint_id=request["checkpoint_id"],
            records=records,
        )
        _disarm()
        outcome: dict[str, Any] = {
            "outcome": "committed",
            "manifest": manifest.path,
            "manifest_sha256": hashlib.sha256(manifest.raw).hexdigest(),
            "ops": len(trace),
            "trace": trace,
        }
        if request.get("observe_root"):
            outcome["observed"] = _observe(request, manifest.path, manifest.raw)
    except BaseException as exc:
        _disarm()
        outcome = {
            "outcome": "error",
            "type": type(exc).__name__,
            "types": [klass.__name__ for klass in type(exc).__mro__],
            "errno": getattr(exc, "errno", None),
            "error": str(exc),
            "traceback": traceback.format_exc(),
            "ops": len(trace),
        }
    view = memoryview((json.dumps(outcome) + "\n").encode())
    while view:
        view = view[os.write(report_fd, view) :]
    os._exit(0)


def _read_until_eof(fd: int, deadline: float) -> tuple[bytes, bool]:
    chunks = []
    while (remaining := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks), True
            chunks.append(chunk)
    return b"".join(chunks), False


class _Pending:
    """One forked child between its request and its ``go``."""

    def __init__(self, request: dict[str, Any]) -> None:
        self.request = request
        ready_r, ready_w = os.pipe()
        self.go_r, self.go_w = os.pipe()
        self.report_r, report_w = os.pipe()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                for fd in (ready_r, self.go_w, self.report_r):
                    os.close(fd)
                _child(request, ready_w, self.go_r, report_w)
            finally:
                os._exit(70)
        for fd in (ready_w, self.go_r, report_w):
            os.close(fd)
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)
        self.timeout = float(request.get("timeout", 60))
        self.ready = _read_byte(ready_r, time.monotonic() + self.timeout) == b"r"
        os.close(ready_r)

    def go(self) -> dict[str, Any]:
        started = time.monotonic()
        deadline = started + self.timeout
        os.write(self.go_w, b"g")
        os.close(self.go_w)
        kill_after = self.request.get("kill_after")
        if kill_after is not None:
            done, _, _ = select.select([self.pidfd], [], [], kill_after)
            if not done:
                os.kill(self.pid, signal.SIGKILL)
        data, eof = _read_until_eof(self.report_r, deadline)
        os.close(self.report_r)
        done, _, _ = select.select([self.pidfd], [], [], max(0.0, deadline - time.monotonic()) if eof else 0)
        timed_out = not done
        if timed_out:
            os.kill(self.pid, signal.SIGKILL)
            done, _, _ = select.select([self.pidfd], [], [], 30.0)  # a child in D state waits for its mount
        status = os.waitpid(self.pid, 0)[1] if done else None
        os.close(self.pidfd)
        return {
            "pid": self.pid,
            "signaled": status is not None and os.WIFSIGNALED(status),
            "signal": os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None,
            "exit_code": os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else None,
            "timed_out": timed_out or not eof,
            "seconds": time.monotonic() - started,
            "child": json.loads(data) if data.strip() else None,
        }


def _read_byte(fd: int, deadline: float) -> bytes:
    """One byte from ``fd`` before the deadline (empty at EOF or when it passed)."""
    ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
    return os.read(fd, 1) if ready else b""


def _lines(idle_timeout: float) -> Iterator[str]:
    buffer = b""
    while True:
        while b"\n" in buffer:
            line, _, buffer = buffer.partition(b"\n")
            yield line.decode()
        ready, _, _ = select.select([0], [], [], idle_timeout)
        if not ready:
            return
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return
        buffer += chunk


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> int:
    if threading.active_count() != 1:
        print("the commit worker must be single-threaded", file=sys.stderr)
        return 2
    pending: _Pending | None = None
    for line in _lines(IDLE_TIMEOUT):
        if not line.strip():
            continue
        try:
            if line.strip() == "go":
                assert pending is not None, "go without a request"
                current, pending = pending, None
                _reply(current.go())
            else:
                assert pending is None, "a request while another waits for go"
                pending = _Pending(json.loads(line))
                _reply({"ready": pending.pid} if pending.ready else {"worker_error": "the child did not get ready"})
        except Exception:
            _reply({"worker_error": traceback.format_exc()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
