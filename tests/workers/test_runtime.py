"""The runtime directory: 0700, sockets 0600, removed by its creator only, stale ones only when surely dead."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from gymckpt.testing.time import bounded
from gymckpt.workers.runtime import (
    MAX_SOCKET_PATH,
    InvalidSocketPath,
    create_runtime_dir,
    remove_stale_dirs,
    restrict_socket,
    socket_path,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A short directory under /tmp: pytest's own can be too long for an AF_UNIX path (under pytest-xdist)."""
    path = Path(tempfile.mkdtemp(prefix="gr-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _dead_pid() -> int:
    """The pid of a child that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    return child.pid


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _stale_dir(root: Path, pid: int, suffix: str) -> Path:
    path = root / f"gymckpt-{pid}-{suffix}"
    path.mkdir(mode=0o700)
    return path


def _dead_socket(path: Path) -> Path:
    """A socket file nothing listens on any more (bound, then closed without unlinking)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(os.fspath(path))
    return path


def test_the_directory_is_named_for_this_pid_and_is_0700_whatever_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o777)
    try:
        runtime = create_runtime_dir(tmp_path, remove_at_exit=False)
    finally:
        os.umask(previous)
    assert runtime.path.parent == tmp_path
    assert re.fullmatch(rf"gymckpt-{os.getpid()}-[0-9a-f]{{8}}", runtime.path.name)
    assert runtime.creator == os.getpid()
    assert runtime.path.is_dir()
    assert _mode(runtime.path) == 0o700
    other = create_runtime_dir(tmp_path, remove_at_exit=False)
    assert other.path != runtime.path
    assert runtime.path.is_dir()  # this pid is alive: a second directory leaves the first alone


async def test_a_socket_path_is_fresh_and_its_bound_socket_is_made_0600(tmp_path: Path) -> None:
    runtime = create_runtime_dir(tmp_path, remove_at_exit=False)
    path = socket_path(runtime.path, "env")  # a short prefix: tmp_path is long already
    assert path.parent == runtime.path
    assert re.fullmatch(r"env-[0-9a-f]{8}\.sock", path.name)
    assert socket_path(runtime.path, "env") != path
    server = await asyncio.start_unix_server(lambda reader, writer: writer.close(), os.fspath(path))
    try:
        restrict_socket(path)
        info = path.lstat()
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o600
        _, writer = await bounded(asyncio.open_unix_connection(os.fspath(path)))  # still reachable by its owner
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("prefix", ["", "a/b", "nul\0"])
def test_a_socket_prefix_must_be_a_plain_name(tmp_path: Path, prefix: str) -> None:
    with pytest.raises(InvalidSocketPath):
        socket_path(tmp_path, prefix)


def test_a_socket_path_past_the_af_unix_limit_is_refused_and_the_real_ones_fit(tmp_path: Path) -> None:
    longest_real = Path(f"/tmp/gymckpt-{2**22}-0123abcd")  # the largest Linux pid
    assert len(os.fsencode(socket_path(longest_real, "environment"))) <= MAX_SOCKET_PATH
    deep = tmp_path / ("d" * max(1, MAX_SOCKET_PATH - len(os.fsencode(tmp_path))))
    with pytest.raises(InvalidSocketPath):
        socket_path(deep, "policy")


def test_only_the_creating_pid_removes_the_directory(tmp_path: Path) -> None:
    pid = [4242]
    runtime = create_runtime_dir(tmp_path, getpid=lambda: pid[0], remove_at_exit=False)
    assert runtime.path.name.startswith("gymckpt-4242-")
    _dead_socket(runtime.path / "c-00000000.sock")
    pid[0] = 4243  # a forked child, which inherited the exit hook
    assert runtime.remove() is False
    assert (runtime.path / "c-00000000.sock").exists()
    pid[0] = 4242
    assert runtime.remove() is True
    assert not runtime.path.exists()


def test_at_exit_the_creator_removes_the_directory_and_a_forked_child_does_not(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, sys
        from pathlib import Path
        from gymckpt.workers.runtime import create_runtime_dir

        runtime = create_runtime_dir(Path({os.fspath(tmp_path)!r}))
        print(runtime.path, flush=True)
        child = os.fork()
        if child == 0:
            sys.exit(0)  # runs the inherited exit hooks
        os.waitpid(child, 0)
        print(runtime.path.is_dir(), flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    path, after_child = done.stdout.split()
    assert Path(path).parent == tmp_path
    assert after_child == "True"
    assert not Path(path).exists()


def test_stale_cleanup_removes_only_a_dead_pids_directory_whose_sockets_accept_nothing(tmp_path: Path) -> None:
    dead = _dead_pid()
    stale = _stale_dir(tmp_path, dead, "aaaaaaaa")
    _dead_socket(stale / "c-11111111.sock")
    (stale / "note").write_text("left behind")
    listening_dir = _stale_dir(tmp_path, dead, "bbbbbbbb")
    alive_dir = _stale_dir(tmp_path, os.getpid(), "cccccccc")
    unlike = [_stale_dir(tmp_path, dead, "zzzzzzzz"), tmp_path / f"other-{dead}-dddddddd"]
    unlike[1].mkdir()
    not_a_dir = tmp_path / f"gymckpt-{dead}-eeeeeeee"
    not_a_dir.write_text("a file")
    link = tmp_path / f"gymckpt-{dead}-ffffffff"
    link.symlink_to(alive_dir)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(os.fspath(listening_dir / "c-22222222.sock"))
        listener.listen()
        removed = remove_stale_dirs(tmp_path)
    assert removed == [stale]
    assert not stale.exists()
    for kept in (listening_dir, alive_dir, *unlike, not_a_dir, link):
        assert kept.exists() or kept.is_symlink(), kept


def test_a_new_directory_removes_the_stale_ones_first(tmp_path: Path) -> None:
    stale = _stale_dir(tmp_path, _dead_pid(), "0123abcd")
    _dead_socket(stale / "policy-0123abcd.sock")
    runtime = create_runtime_dir(tmp_path, remove_at_exit=False)
    assert not stale.exists()
    assert sorted(tmp_path.iterdir()) == [runtime.path]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another uid needs root")
def test_stale_cleanup_keeps_another_uids_directory(tmp_path: Path) -> None:
    foreign = _stale_dir(tmp_path, _dead_pid(), "abcdef01")
    os.chown(foreign, 65534, 65534)
    assert remove_stale_dirs(tmp_path) == []
    assert foreign.is_dir()


def test_the_process_directory_is_made_once_per_process_under_tmp_and_removed_at_exit() -> None:
    script = textwrap.dedent(
        """
        import os
        from gymckpt.workers.runtime import process_runtime_dir

        first = process_runtime_dir()
        assert process_runtime_dir() is first
        reader, writer = os.pipe()
        child = os.fork()
        if child == 0:
            os.write(writer, str(process_runtime_dir().path).encode())
            os._exit(0)
        os.close(writer)
        print(first.path, os.read(reader, 4096).decode(), flush=True)
        os.waitpid(child, 0)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    parent_dir, child_dir = (Path(path) for path in done.stdout.split())
    try:
        assert parent_dir.parent == Path("/tmp")
        assert child_dir.parent == Path("/tmp")
        assert parent_dir != child_dir
        assert not parent_dir.exists()  # removed at the parent's exit
        assert child_dir.is_dir()  # the child left with os._exit, as after a crash: a stale directory
    finally:
        shutil.rmtree(child_dir, ignore_errors=True)
