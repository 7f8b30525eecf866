"""The shared-filesystem fixture: two real clients of one MooseFS, what each sees of the other, and when,
and a teardown that leaves nothing behind even when the test failed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.store._local import LocalBackend
from gymckpt.testing import sharedfs
from gymckpt.testing.sharedfs import MASTER_CLIENT_PORT, install_hint, missing_requirements

from .conftest import PROJECT

if TYPE_CHECKING:
    from gymckpt.testing.sharedfs import MooseFS

    from .conftest import Hosts

pytestmark = pytest.mark.slow

ROUNDS = 50
#: a third client that keeps what it looked up for 30 s: the caches the default mounts do without
CACHING_OPTIONS = ("mfsnegentrycacheto=30", "mfsentrycacheto=30", "mfsattrcacheto=30", "mfsdirentrycacheto=30")


def _fuse_mounts() -> dict[str, tuple[str, str, int]]:
    """mount point → (filesystem type, source, device number) from /proc/self/mountinfo."""
    found = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        separator = fields.index("-")
        major, minor = fields[2].split(":")
        found[fields[4]] = (fields[separator + 1], fields[separator + 2], os.makedev(int(major), int(minor)))
    return found


def test_the_two_mounts_are_two_clients(moosefs: MooseFS, hosts: Hosts) -> None:
    """Two mfsmount processes, two FUSE superblocks (two kernel caches), two sessions with the master."""
    a, b = moosefs.mounts["a"], moosefs.mounts["b"]
    assert a.pid != b.pid
    for mount in (a, b):
        command = Path(f"/proc/{mount.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert command.startswith("mfsmount") and str(mount.path) in command, command
    mounts = _fuse_mounts()
    for mount in (a, b):
        kind, source, _ = mounts[str(mount.path)]
        assert kind == "fuse" and source.replace("\\043", "#") == f"mfs#{moosefs.address}:{MASTER_CLIENT_PORT}"
    assert mounts[str(a.path)][2] != mounts[str(b.path)][2] == os.stat(b.path).st_dev
    assert moosefs.master is not None
    sessions = [
        state
        for local, _, state in sharedfs._tcp_states(moosefs.master.pid)
        if local == MASTER_CLIENT_PORT and state == sharedfs._TCP_ESTABLISHED
    ]
    assert len(sessions) >= 2, f"the master should hold a connection per client: {sessions}"
    (hosts.a / "hello").write_bytes(b"written through a")
    assert (hosts.b / "hello").read_bytes() == b"written through a"


def test_what_each_mount_sees_of_the_other_and_when(
    moosefs: MooseFS, hosts: Hosts, observations: dict[str, Any]
) -> None:
    """A name A creates (the manifest's way: a fsynced temporary file linked to it) after B looked for it
    is there for B at once, bytes and listing, with the default options; a client that caches lookups
    (C, 30 s) keeps answering "absent", which also shows each mount is a client of its own."""
    caching = moosefs.mount("c", *CACHING_OPTIONS)
    try:
        a, b, c = (LocalBackend(str(root)) for root in (hosts.a, hosts.b, caching.path / hosts.name))
        counts = {"b_exists": 0, "b_same_bytes": 0, "b_listed": 0, "c_exists": 0, "c_listed": 0}
        for index in range(ROUNDS):
            name = f"m{index}.json"
            data = f"manifest {index}".encode() * 10
            assert not b.exists(name) and not c.exists(name)  # each client has now looked the name up
            assert a.create_if_absent(name, data)
            counts["b_exists"] += b.exists(name)
            counts["b_same_bytes"] += b.exists(name) and b.read_bytes(name) == data
            counts["b_listed"] += name in b.list_dir("")
            counts["c_exists"] += c.exists(name)
            counts["c_listed"] += name in c.list_dir("")
        a.replace("LATEST", b"one")
        c_before = c.read_bytes("LATEST").decode()
        a.replace("LATEST", b"two")
        replaced = {"b": b.read_bytes("LATEST").decode(), "c": c.read_bytes("LATEST").decode(), "c_before": c_before}
    finally:
        moosefs.unmount("c")
    observations.update(rounds=ROUNDS, seen_at_once=counts, caching_options=list(CACHING_OPTIONS), replace=replaced)
    assert counts["b_exists"] == counts["b_same_bytes"] == counts["b_listed"] == ROUNDS, counts
    assert replaced["b"] == "two"
    # the caching client: stale "absent" answers prove it is a separate client with caches of its own
    assert counts["c_exists"] < ROUNDS, counts


def test_missing_requirements_name_the_packages() -> None:
    """Without MooseFS's programs the message names each Debian package and the command that installs them."""
    missing = missing_requirements(which=lambda program: None if program.startswith("mfs") else f"/bin/{program}")
    message = install_hint(missing)
    for package in ("moosefs-master", "moosefs-chunkserver", "moosefs-client"):
        assert package in message
    assert "apt-get install -y" in message and ".ci/sharedfs-deps" in message
    assert missing_requirements() == [], "this machine has everything (the session fixture started MooseFS)"


FAILING_TEST = textwrap.dedent(
    """
    import os, threading

    def test_fails_with_a_writer_blocked(moosefs):
        moosefs.stop_chunkserver()
        path = moosefs.mounts["a"].path / "blocked"

        def write():
            with open(path, "wb") as stream:
                stream.write(b"x" * 100000)
                os.fsync(stream.fileno())  # waits on the stopped chunkserver

        threading.Thread(target=write, daemon=True).start()
        assert False, "this test fails on purpose"
    """
)


def test_teardown_leaves_nothing_after_a_failing_test(tmp_path: Path) -> None:
    """A test that fails with the chunkserver stopped and a writer blocked on it still leaves no mount,
    no daemon and no namespace: the session fixture's teardown is run by a pytest of its own here."""
    test_file = tmp_path / "test_failing.py"
    test_file.write_text(FAILING_TEST)
    base = tmp_path / "base"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.sharedfs.conftest",
            f"--basetemp={base}",
            "--rootdir",
            str(tmp_path),
            str(test_file),
        ],
        cwd=PROJECT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(PROJECT)},
    )
    assert done.returncode == 1 and "1 failed" in done.stdout, done.stdout + done.stderr
    assert "this test fails on purpose" in done.stdout
    assert "teardown left" not in done.stdout, done.stdout
    mounts = [point for point in _fuse_mounts() if point.startswith(str(base))]
    assert mounts == []
    processes = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if str(base).encode() in command:
                processes.append(command.replace(b"\0", b" ").decode(errors="replace"))
    assert processes == []
    namespace = (base / "moosefs0" / "namespace").read_text()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split()
    assert namespace.startswith("gymckpt-") and namespace not in listed
    assert not Path("/run/netns", namespace).exists()
