"""What tests of this repository share and a user's tests would not: the repo, wire error codes,
server processes, and the storage a test takes as a parameter.

What a user testing their own server would want too lives in :mod:`gymckpt.testing`
(``time``: the fake clock and bounded waits; ``net``: free ports and uvicorn in process;
``participant``: the fake participant).

Storage as a parameter: a test that touches storage but is about the layer above it takes
the ``storage`` fixture (tests/conftest.py), a :class:`Storage` on one backend, and is
marked :data:`each_backend` (local and memory) or :data:`each_backend_and_s3` (and S3,
on the session's moto server)::

    @each_backend
    def test_verify(storage):
        storage.open("ck").write_participant("", ...)
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.store import CheckpointStore, open_store
from gymckpt.store._memory import MemoryBackend, clear_memory_stores

if TYPE_CHECKING:
    from collections.abc import Iterator

    from gymckpt.testing.moto import MotoEndpoint

__all__ = [
    "ALL_BACKENDS",
    "BACKENDS",
    "REPO",
    "S3_BUCKET",
    "Storage",
    "each_backend",
    "each_backend_and_s3",
    "error_code",
    "kill_group",
    "signal_group",
    "start_uvicorn",
    "uvicorn_port",
    "storage_on",
]

#: the repository's root (what ``python -m`` of ``tests.…`` and ``gymckpt`` needs on its path)
REPO = Path(__file__).resolve().parents[1]


# --- wire errors


def error_code(response: Any) -> str:
    """The code of a wire error reply, which must be exactly ``{"error": {"code", "detail"}}``."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "detail"}, body
    assert isinstance(body["error"]["detail"], str)
    return body["error"]["code"]  # type: ignore[no-any-return]


# --- server processes


def signal_group(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the process group ``pid`` leads, if it is still there."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_group(process: subprocess.Popen[Any], timeout: float) -> None:
    """SIGKILL the process group ``process`` leads (unless it ended), then reap it."""
    if process.poll() is None:
        signal_group(process.pid, signal.SIGKILL)
    process.wait(timeout=timeout)


#: uvicorn's line once it listens; it names the port it bound, also for ``--port 0``
_LISTENING = re.compile(r"Uvicorn running on https?://[^\s:]+:(\d+)")


def uvicorn_port(output: str) -> int | None:
    """The port uvicorn said it listens on in ``output``; None before it said so.

    Servers a test starts bind port 0 and report it here: a port picked beforehand and
    released may be bound by another test's server in between, which would then answer.
    """
    found = _LISTENING.search(output)
    return int(found.group(1)) if found else None


def start_uvicorn(args: list[str], *, env: dict[str, str], stdout: Any, stderr: Any) -> subprocess.Popen[bytes]:
    """``python -m uvicorn <args>`` from the repo (on its ``PYTHONPATH``), in a process group of its own."""
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))}
    return subprocess.Popen(
        [sys.executable, "-m", "uvicorn", *args],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
    )


# --- storage as a parameter

#: the backends a test above the store runs on
BACKENDS = ("local", "memory")
#: and S3, on the session's moto server
ALL_BACKENDS = (*BACKENDS, "s3")
each_backend = pytest.mark.parametrize("storage", BACKENDS, indirect=True)
each_backend_and_s3 = pytest.mark.parametrize("storage", ALL_BACKENDS, indirect=True)
#: the bucket S3 storage lives in (made afresh, on an emptied endpoint, for every test)
S3_BUCKET = "gymckpt-storage"


@dataclass
class Storage:
    """A fresh place for a test's checkpoints on one backend: ``local``, ``memory`` or ``s3``.

    :meth:`url` names a location in it (a directory, a ``memory://`` or ``s3://`` URL) that
    a store, a control plane or the command line opens; :meth:`read`, :meth:`write` and
    :meth:`files` touch what is stored there directly (files, the memory store's dict,
    boto3), never through the backend under test. A ``memory://`` URL names a store of its
    own: a location's files are seen through that URL only, not through one above it.
    """

    kind: str
    root: str
    #: what :func:`~gymckpt.store.open_store` needs besides the URL (S3: the endpoint and credentials)
    storage_options: dict[str, Any] = field(default_factory=dict)
    endpoint: MotoEndpoint | None = None

    @property
    def plane_options(self) -> dict[str, Any]:
        """What a :class:`~gymckpt.control.plane.ControlPlane` needs to reach this storage."""
        if self.kind == "memory":  # not a scheme a request may name by default
            return {"allowed_roots": [self.root]}
        if self.kind == "s3":
            return {"storage_options": dict(self.storage_options)}
        return {}

    def url(self, *parts: str) -> str:
        """The location ``parts`` below the root."""
        if self.kind == "local":
            return str(Path(self.root, *parts))
        return "/".join([self.root, *parts])

    def open(self, *parts: str) -> CheckpointStore:
        """A store at :meth:`url` of ``parts``."""
        return open_store(self.url(*parts), **self.storage_options)

    def _s3_key(self, location: str, path: str) -> str:
        prefix = location.removeprefix(f"s3://{S3_BUCKET}/").strip("/")
        return f"{prefix}/{path}" if path else prefix

    def read(self, location: str, path: str) -> bytes:
        """The bytes stored at ``path`` under ``location``."""
        if self.kind == "local":
            return Path(location, path).read_bytes()
        if self.kind == "memory":
            return MemoryBackend(location).files[path]
        assert self.endpoint is not None
        reply = self.endpoint.client().get_object(Bucket=S3_BUCKET, Key=self._s3_key(location, path))
        return reply["Body"].read()  # type: ignore[no-any-return]

    def write(self, location: str, path: str, data: bytes) -> None:
        """Replace what is stored at ``path`` under ``location`` by ``data``."""
        if self.kind == "local":
            Path(location, path).write_bytes(data)
        elif self.kind == "memory":
            MemoryBackend(location).files[path] = data
        else:
            assert self.endpoint is not None
            self.endpoint.client().put_object(Bucket=S3_BUCKET, Key=self._s3_key(location, path), Body=data)

    def files(self, location: str) -> list[str]:
        """Every file stored under ``location``, as sorted paths relative to it."""
        if self.kind == "local":
            root = Path(location)
            return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())
        if self.kind == "memory":
            return sorted(MemoryBackend(location).files)
        assert self.endpoint is not None
        prefix = self._s3_key(location, "") + "/"
        paginator = self.endpoint.client().get_paginator("list_objects_v2")
        keys = [
            item["Key"]
            for page in paginator.paginate(Bucket=S3_BUCKET, Prefix=prefix)
            for item in page.get("Contents", [])
        ]
        return sorted(key.removeprefix(prefix) for key in keys)


def storage_on(kind: str, tmp_path: Path, endpoint: MotoEndpoint | None = None) -> Iterator[Storage]:
    """A fresh :class:`Storage` of ``kind`` (the ``storage`` fixture's body); cleaned up after."""
    if kind == "local":
        yield Storage("local", str(tmp_path))
    elif kind == "memory":
        clear_memory_stores()
        try:
            yield Storage("memory", f"memory://{tmp_path.name}")
        finally:
            clear_memory_stores()
    elif kind == "s3":
        assert endpoint is not None, "s3 storage needs the moto endpoint"
        endpoint.reset()
        endpoint.create_bucket(S3_BUCKET)
        yield Storage("s3", f"s3://{S3_BUCKET}/{tmp_path.name}", endpoint.storage_options(), endpoint)
    else:
        raise ValueError(f"no storage of kind {kind!r}: one of {ALL_BACKENDS}")


class LineWorker:
    """A worker script run as a child process, spoken to in lines on its stdin and stdout, with bounded waits.

    Its stderr goes to ``log``; a wait that runs out, or a worker that exits, fails the test
    with the tail of that log.
    """

    #: how the failure messages name the worker
    name = "worker"

    def __init__(self, script: Path, log: Path, *, cwd: Path) -> None:
        self.log = log
        self._stderr = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, cwd=cwd
        )
        self._buffer = b""

    def _write_line(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def _read_line(self, timeout: float) -> bytes:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"the {self.name} sent nothing for {timeout} s; its log: {self.stderr()}")
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise AssertionError(f"the {self.name} exited ({self.proc.poll()}); its log: {self.stderr()}")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def stderr(self) -> str:
        self._stderr.flush()
        return self.log.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._stderr.close()


def read_reply(sock: socket.socket) -> bytes:
    """One HTTP reply (head and Content-Length body) from a raw socket, each recv bounded by its timeout."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, data
        body += chunk
    return head + b"\r\n\r\n" + body


def prune_while_verifying(
    monkeypatch: pytest.MonkeyPatch, verify_module: Any, when: str, root: Any, oldest: str, current: str
) -> list[str]:
    """Make the collector prune ``oldest`` the first time verify's ``when`` reads it; what it pruned goes in the list."""
    original = getattr(verify_module, when)
    pruned: list[str] = []

    def prune_first(backend: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
        path = target if isinstance(target, str) else target.path
        if not pruned and path.startswith(f"{oldest}/"):
            pruned.extend(root.prune(2, current=current))
        return original(backend, target, *args, **kwargs)

    monkeypatch.setattr(verify_module, when, prune_first)
    return pruned
