"""Fixtures of the shared-filesystem tests: one MooseFS per test process, two mounts, commit workers.

- ``moosefs``: :class:`~gymckpt.testing.sharedfs.MooseFS` for the session, mounted at ``a``
  and ``b`` (two clients: two hosts' views). Where this machine cannot run it (not root, the
  Debian packages missing) the tests are skipped with a message saying what is needed, and
  fail instead when ``CI`` or ``GYMCKPT_REQUIRE_SHAREDFS`` is set. Its teardown fails the
  session if a mount, a daemon or the namespace is left behind.
- ``hosts``: for one test, a fresh directory seen through both mounts (:class:`Hosts`),
  with both mounts and the chunkserver healthy when the test starts.
- ``workers``: two :class:`CommitWorker` processes, one per mount.
- ``observations``: a dict a test fills with what it saw; printed (``-s``) and written to
  ``sharedfs-observations.json`` under the session's temporary directory.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.store import CheckpointStore
from gymckpt.store._local import LocalBackend
from gymckpt.testing.sharedfs import MooseFS, SharedFsUnavailable, install_hint, missing_requirements
from tests.support import LineWorker

if TYPE_CHECKING:
    from collections.abc import Iterator

WORKER = Path(__file__).with_name("commit_worker.py")
PROJECT = Path(__file__).resolve().parents[2]
#: small commits: a kill point is one of ~40 os operations, and a hundred kills take seconds
CHUNK_SIZE = 1024
PARTICIPANT = {"kind": "environment", "instance": "env-0", "checkpoint_id": "ck-1"}


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") or os.environ.get("GYMCKPT_REQUIRE_SHAREDFS"):
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def moosefs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooseFS]:
    missing = missing_requirements()
    if missing:
        _unavailable(install_hint(missing))
    mfs = MooseFS(tmp_path_factory.mktemp("moosefs"))
    try:
        mfs.start()
    except SharedFsUnavailable as exc:
        _unavailable(str(exc))
    try:
        mfs.mount("a")
        mfs.mount("b")
        yield mfs
    finally:
        left = mfs.close()
    assert not left, f"the shared filesystem's teardown left: {left}"


@dataclass
class Hosts:
    """One test's directory ``name`` at the root of the export, seen through mount A and mount B."""

    mfs: MooseFS
    name: str

    @property
    def a(self) -> Path:
        return self.mfs.mounts["a"].path / self.name

    @property
    def b(self) -> Path:
        return self.mfs.mounts["b"].path / self.name

    def store(self, host: str) -> CheckpointStore:
        """A store rooted at this test's directory through mount ``host`` ("a" or "b")."""
        return CheckpointStore(LocalBackend(str(getattr(self, host))), chunk_size=CHUNK_SIZE)


@pytest.fixture
def hosts(moosefs: MooseFS) -> Hosts:
    """A fresh directory, with both mounts serving and the chunkserver running (an earlier test may have broken them)."""
    if moosefs.chunkserver is None or moosefs.chunkserver.poll() is not None:
        moosefs.start_chunkserver()
    moosefs.continue_chunkserver()
    for name in ("a", "b"):
        mount = moosefs.mounts.get(name)
        if mount is None:
            moosefs.mount(name)
        elif mount.process.poll() is not None or not mount.mounted():
            moosefs.remount(name)
        moosefs.wait_writable(name)
    directory = f"t-{secrets.token_hex(4)}"
    (moosefs.mounts["a"].path / directory).mkdir()
    return Hosts(moosefs, directory)


class CommitWorker(LineWorker):
    """The test's side of ``commit_worker.py``: a request, ``ready``, then ``go`` and the outcome."""

    name = "commit worker"

    def __init__(self, log: Path) -> None:
        super().__init__(WORKER, log, cwd=PROJECT)

    def prepare(self, root: Path, checkpoint_dir: str, *, timeout: float = 60.0, **fields: Any) -> int:
        """Fork a child that will commit ``fields`` (see the worker's docstring) into ``root``; its pid."""
        request = {
            "root": str(root),
            "checkpoint_dir": checkpoint_dir,
            **PARTICIPANT,
            "count": 20,
            "payload": 100,
            "chunk_size": CHUNK_SIZE,
            "timeout": timeout,
            **fields,
        }
        reply = self._send(json.dumps(request), timeout + 30)
        assert "ready" in reply, reply
        self.timeout = timeout
        return int(reply["ready"])

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()

    def outcome(self) -> dict[str, Any]:
        reply = json.loads(self._read_line(self.timeout + 60))
        assert "worker_error" not in reply, reply["worker_error"]
        return reply

    def commit(self, root: Path, checkpoint_dir: str, **fields: Any) -> dict[str, Any]:
        self.prepare(root, checkpoint_dir, **fields)
        self.go()
        return self.outcome()

    def _send(self, line: str, timeout: float) -> dict[str, Any]:
        self._write_line(line)
        return json.loads(self._read_line(timeout))


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[tuple[CommitWorker, CommitWorker]]:
    """Two commit workers (one to commit through each mount, or any other split a test wants)."""
    pair = (CommitWorker(tmp_path / "worker-1.log"), CommitWorker(tmp_path / "worker-2.log"))
    try:
        yield pair
    finally:
        for worker in pair:
            worker.close()


@pytest.fixture(scope="session")
def _observations_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    everything: dict[str, Any] = {}
    yield everything
    if everything:
        path = tmp_path_factory.getbasetemp() / "sharedfs-observations.json"
        path.write_text(json.dumps(everything, indent=2, sort_keys=True))
        print(f"\nshared-filesystem observations: {path}")


@pytest.fixture
def observations(request: pytest.FixtureRequest, _observations_file: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """What this test saw (counts, timings): printed at its end and kept in the session's JSON file."""
    seen: dict[str, Any] = {}
    yield seen
    if seen:
        _observations_file[request.node.name] = seen
        print(f"\n{request.node.name}: {json.dumps(seen, sort_keys=True)}")
