"""Injected storage failures during a local commit give a typed error and leave no manifest.

The failures are injected one layer below the local backend, into the ``os`` module
(ENOSPC and EIO from ``os.write`` and ``os.fsync`` at the first and at the n-th call,
including every directory fsync, from the ``os.link`` that publishes the manifest, and from the
one that asks, before the first records byte, whether the filesystem has ``link()`` at all).
Only calls that touch the store's directory are counted or failed. After each failure:
the error is a :class:`~gymckpt.errors.StorageError` (an ``OSError``) with the injected
errno, no ``manifest.json`` exists, no temporary file is left (the abort path could
clean up), no ``records-<sha256>.jsonl`` holds bytes that hash to another name, and a
retry without the failure commits and verifies.

The read-only directory is real: the tests run as root, which ignores permission bits,
so ``unprivileged_commit.py`` drops to ``nobody`` before committing into a root-owned
directory of mode 0555.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt import errors
from gymckpt.store import open_store, verify
from gymckpt.store._local import TEMP_PREFIX
from gymckpt.store.manifest import MANIFEST_NAME
from gymckpt.testing.values import same_records, sample_records

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from gymckpt.store import CheckpointStore
    from gymckpt.store.manifest import Manifest

PARTICIPANT_DIR = "ck/gym/environment/env-0"
RECORDS = sample_records(60, payload=500)
#: small chunks so the records file takes several writes (~45 KB in 4 KiB chunks)
CHUNK_SIZE = 4096
RECORDS_FILE = re.compile(r"^records-([0-9a-f]{64})\.jsonl$")
HELPER = Path(__file__).with_name("unprivileged_commit.py")
ERRNOS = [pytest.param(errno.ENOSPC, id="ENOSPC"), pytest.param(errno.EIO, id="EIO")]


def _open(root: Path) -> CheckpointStore:
    store = open_store(str(root))
    store.chunk_size = CHUNK_SIZE
    return store


def _commit(root: Path) -> Manifest:
    return _open(root).write_participant(
        "ck", kind="environment", instance="env-0", checkpoint_id="ck-1", records=iter(RECORDS)
    )


class OsHooks:
    """Wraps os functions; counts (and fails) only the calls that touch ``root``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
        self.monkeypatch = monkeypatch
        self.root = str(root)
        self.lock = threading.Lock()  # the records are written on a worker thread
        self.trace: list[tuple[str, str]] = []

    def _where(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The store-relative path a call touches, or None if it is outside the store."""
        target = args[0]
        if isinstance(target, int):  # write, fsync, close take a file descriptor
            try:
                target = os.readlink(f"/proc/self/fd/{target}")
            except OSError:
                return None
        target = os.fspath(target)
        directory = kwargs.get("dir_fd", kwargs.get("src_dir_fd"))
        if directory is not None and not os.path.isabs(target):  # a name relative to a directory descriptor
            try:
                target = os.path.join(os.readlink(f"/proc/self/fd/{directory}"), target)
            except OSError:
                return None
        if target != self.root and not target.startswith(self.root + os.sep):
            return None
        return os.path.relpath(target, self.root)

    def wrap(self, name: str, before: Callable[[str, int, tuple[Any, ...]], Any] | None = None) -> None:
        """Record every call of ``os.<name>`` on the store; ``before(path, n, args)`` runs
        first for the n-th such call (1-based) and may raise or return a result to use."""
        real = getattr(os, name)
        calls = 0

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            where = self._where(name, args, kwargs)
            if where is None:
                return real(*args, **kwargs)
            with self.lock:
                calls += 1
                number = calls
                self.trace.append((name, where))
            if before is not None and (result := before(where, number, args)) is not None:
                return result
            return real(*args, **kwargs)

        self.monkeypatch.setattr(os, name, wrapper)

    def fail(self, name: str, nth: int, error: int) -> list[str]:
        """Make the ``nth`` call of ``os.<name>`` on the store raise ``OSError(error)``; returns
        the list the failed call's path is appended to."""
        failed: list[str] = []

        def before(where: str, number: int, args: tuple[Any, ...]) -> None:
            if number == nth:
                failed.append(where)
                raise OSError(error, os.strerror(error))

        self.wrap(name, before)
        return failed


def _trace_commit(monkeypatch: pytest.MonkeyPatch, root: Path) -> list[tuple[str, str]]:
    """The (operation, store-relative path) sequence of a clean commit."""
    with monkeypatch.context() as patch:
        hooks = OsHooks(patch, root)
        for name in ("open", "write", "fsync", "close", "rename", "link", "unlink", "mkdir"):
            hooks.wrap(name)
        _commit(root)
    return hooks.trace


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, str]]:
    with pytest.MonkeyPatch.context() as patch:
        return _trace_commit(patch, tmp_path_factory.mktemp("trace") / "store")


def _temp_files(trace: list[tuple[str, str]]) -> list[str]:
    """The temporary files in the order they were opened: the records file's, then the manifest's."""
    found: list[str] = []
    for operation, path in trace:
        if operation == "open" and os.path.basename(path).startswith(TEMP_PREFIX) and path not in found:
            found.append(path)
    assert len(found) == 2, f"expected a records and a manifest temporary file: {found}"
    return found


def _nth_write(trace: list[tuple[str, str]], position: str) -> int:
    writes = [path for operation, path in trace if operation == "write"]
    records_temp, manifest_temp = _temp_files(trace)
    records_writes = [index for index, path in enumerate(writes, 1) if path == records_temp]
    assert len(records_writes) >= 5, f"the records file should take several writes: {len(records_writes)}"
    return {
        "first-records-chunk": records_writes[0],
        "middle-records-chunk": records_writes[len(records_writes) // 2],
        "last-records-chunk": records_writes[-1],
        "manifest": writes.index(manifest_temp) + 1,
    }[position]


def _manifest_link(trace: list[tuple[str, str]]) -> int:
    """The trace index of the link that publishes the manifest: the last one (the first asks whether link() works)."""
    return max(index for index, (operation, _) in enumerate(trace) if operation == "link")


def _nth_link(trace: list[tuple[str, str]], which: str) -> int:
    """1-based: the probe's link (of the records' temporary file, before its first byte), or the manifest's."""
    links = [path for operation, path in trace if operation == "link"]
    records_temp, manifest_temp = _temp_files(trace)
    assert links == [records_temp, manifest_temp], (
        f"one probe of the records' temporary file, then the manifest's: {links}"
    )
    return {"probe": 1, "manifest": 2}[which]


def _nth_fsync(trace: list[tuple[str, str]], target: str) -> int:
    fsyncs = [path for operation, path in trace if operation == "fsync"]
    records_temp, manifest_temp = _temp_files(trace)
    link = _manifest_link(trace)
    after_link = [path for operation, path in trace[link:] if operation == "fsync"]
    assert after_link == [PARTICIPANT_DIR], f"one directory fsync should follow the manifest link: {after_link}"
    return {
        "records-file": fsyncs.index(records_temp) + 1,
        "participant-dir": fsyncs.index(PARTICIPANT_DIR) + 1,
        "kind-dir": fsyncs.index("ck/gym/environment") + 1,
        "gym-dir": fsyncs.index("ck/gym") + 1,
        "checkpoint-dir": fsyncs.index("ck") + 1,
        "store-root": fsyncs.index(".") + 1,
        "manifest-file": fsyncs.index(manifest_temp) + 1,
        "participant-dir-after-manifest-link": len(fsyncs),
    }[target]


def _files(root: Path) -> list[Path]:
    return sorted(path for path in root.rglob("*") if path.is_file())


def _assert_clean_failure(root: Path) -> None:
    """No manifest, no temporary file, every records file named after its bytes' digest."""
    files = _files(root)
    assert not [path for path in files if path.name == MANIFEST_NAME], f"a manifest exists: {files}"
    leftovers = [path for path in files if path.name.startswith(TEMP_PREFIX)]
    assert not leftovers, f"temporary files left behind: {leftovers}"
    for path in files:
        match = RECORDS_FILE.match(path.name)
        if match:
            assert hashlib.sha256(path.read_bytes()).hexdigest() == match.group(1), f"{path} is misnamed"


def _assert_retry_commits(root: Path) -> None:
    manifest = _commit(root)
    report = verify(str(root / "ck"))
    assert report.ok, report.errors
    assert {finding.code for finding in report.warnings} <= {"checkpoint_unpublished"}, report.warnings
    restored = list(_open(root).read_participant("ck", kind="environment", instance="env-0"))
    assert same_records(restored, RECORDS)
    assert manifest.record_count == len(RECORDS)


def _assert_storage_error(raised: pytest.ExceptionInfo[errors.StorageError], error: int) -> None:
    assert isinstance(raised.value, OSError)
    assert isinstance(raised.value, errors.GymckptError)
    assert raised.value.errno == error, raised.value
    assert raised.value.code == "storage_error"


def test_the_trace_names_every_step(trace: list[tuple[str, str]]) -> None:
    """The positions the failures below are injected at exist in a clean commit."""
    operations = [operation for operation, _ in trace]
    assert operations.count("link") == 2 and operations.count("rename") == 1
    assert _nth_link(trace, "manifest") == 2
    assert _nth_fsync(trace, "participant-dir-after-manifest-link") == operations.count("fsync")
    assert _nth_write(trace, "manifest") == operations.count("write")


@pytest.mark.parametrize("error", ERRNOS)
@pytest.mark.parametrize("position", ["first-records-chunk", "middle-records-chunk", "last-records-chunk", "manifest"])
def test_write_failure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, trace: list[tuple[str, str]], position: str, error: int
) -> None:
    root = tmp_path / "store"
    nth = _nth_write(trace, position)
    failed = OsHooks(monkeypatch, root).fail("write", nth, error)
    with pytest.raises(errors.StorageError) as raised:
        _commit(root)
    assert len(failed) == 1, f"the write to fail (call {nth}) was not reached"
    _assert_storage_error(raised, error)
    _assert_clean_failure(root)
    monkeypatch.undo()
    _assert_retry_commits(root)


def test_short_write_then_enospc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The way a full disk usually shows: a short write, then ENOSPC on the rest."""
    root = tmp_path / "store"
    real_write = os.write

    def before(where: str, number: int, args: tuple[Any, ...]) -> int | None:
        if number == 3:
            fd, data = args
            return real_write(fd, memoryview(data)[: len(data) // 2])
        if number == 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return None

    OsHooks(monkeypatch, root).wrap("write", before)
    with pytest.raises(errors.StorageError) as raised:
        _commit(root)
    _assert_storage_error(raised, errno.ENOSPC)
    _assert_clean_failure(root)
    monkeypatch.undo()
    _assert_retry_commits(root)


@pytest.mark.parametrize("error", ERRNOS)
@pytest.mark.parametrize(
    "target",
    [
        "records-file",
        "participant-dir",
        "kind-dir",
        "gym-dir",
        "checkpoint-dir",
        "store-root",
        "manifest-file",
        "participant-dir-after-manifest-link",
    ],
)
def test_fsync_failure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, trace: list[tuple[str, str]], target: str, error: int
) -> None:
    root = tmp_path / "store"
    nth = _nth_fsync(trace, target)
    failed = OsHooks(monkeypatch, root).fail("fsync", nth, error)
    with pytest.raises(errors.StorageError) as raised:
        _commit(root)
    assert len(failed) == 1, f"the fsync to fail (call {nth}) was not reached"
    _assert_storage_error(raised, error)
    _assert_clean_failure(root)
    monkeypatch.undo()
    _assert_retry_commits(root)


@pytest.mark.parametrize("error", [*ERRNOS, pytest.param(errno.EMLINK, id="EMLINK")])
@pytest.mark.parametrize("which", ["probe", "manifest"])
def test_link_failure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, trace: list[tuple[str, str]], which: str, error: int
) -> None:
    """A link() failing with an error that is no refusal of link() itself: the storage failed."""
    root = tmp_path / "store"
    failed = OsHooks(monkeypatch, root).fail("link", _nth_link(trace, which), error)
    with pytest.raises(errors.StorageError) as raised:
        _commit(root)
    directory, _, name = failed[0].rpartition("/")
    assert len(failed) == 1 and directory == PARTICIPANT_DIR and name.startswith(TEMP_PREFIX), failed
    _assert_storage_error(raised, error)
    _assert_clean_failure(root)
    monkeypatch.undo()
    _assert_retry_commits(root)


@pytest.mark.parametrize("error", [*ERRNOS, pytest.param(errno.EROFS, id="EROFS")])
def test_records_rename_failure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, error: int) -> None:
    root = tmp_path / "store"
    OsHooks(monkeypatch, root).fail("rename", 1, error)
    expected = errors.UnusableDirectory if error == errno.EROFS else errors.StorageError
    with pytest.raises(expected) as raised:
        _commit(root)
    if expected is errors.StorageError:
        _assert_storage_error(raised, error)  # type: ignore[arg-type]
    else:
        assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == error
    _assert_clean_failure(root)
    monkeypatch.undo()
    _assert_retry_commits(root)


# --- a real read-only directory


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user can enter (pytest's own tmp_path is root-only, mode 0700)."""
    base = Path(tempfile.mkdtemp(prefix="gymckpt-readonly-"))
    try:
        base.chmod(0o755)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _commit_unprivileged(root: Path) -> dict[str, Any]:
    """Run ``unprivileged_commit.py`` (as root it drops to nobody itself; otherwise as we are)."""
    completed = subprocess.run(
        [sys.executable, str(HELPER), str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["euid"] != 0, "the commit must not run as root, which ignores permission bits"
    if os.geteuid() == 0:
        assert result["uid"] == 65534
    assert result["listable"] is not None, f"the store directory must be reachable: {result}"
    return result


@pytest.mark.parametrize("read_only", ["store-root", "participant-dir"])
def test_read_only_directory_gives_unusable_directory(shared_dir: Path, read_only: str) -> None:
    root = shared_dir / "store"
    root.mkdir()
    if read_only == "participant-dir":
        (root / PARTICIPANT_DIR).mkdir(parents=True)
        for directory in (root / "ck", root / "ck/gym", root / "ck/gym/environment"):
            directory.chmod(0o755)
        (root / PARTICIPANT_DIR).chmod(0o555)
    else:
        root.chmod(0o555)
    result = _commit_unprivileged(root)
    assert result["outcome"] == "error", result
    assert result["error_class"] == "UnusableDirectory", result
    assert result["cause_errno"] == errno.EACCES, result
    assert "GymckptError" in result["error_bases"]
    files = _files(shared_dir)
    assert files == [], f"a failed commit left files: {files}"


def test_writable_directory_commits_as_the_same_user(shared_dir: Path) -> None:
    """The control: the same unprivileged commit succeeds when the directory is writable."""
    root = shared_dir / "store"
    root.mkdir()
    root.chmod(0o777)
    result = _commit_unprivileged(root)
    assert result["outcome"] == "committed", result
    assert verify(str(root / "ck")).ok
