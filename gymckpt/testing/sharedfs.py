"""A real shared filesystem for tests: MooseFS in a network namespace of its own, mounted twice.

MooseFS refuses loopback addresses, so :class:`MooseFS` makes a network namespace
(``ip netns add gymckpt-<hex>``) holding only ``lo`` with a test-owned ``10.x.y.z/32`` on
it, and runs a master and one chunkserver there with every file under one base directory.
Each :meth:`MooseFS.mount` is its own ``mfsmount`` process (its own client, its own caches,
its own session with the master), started in that namespace through
``nsenter --net`` so the mount itself lands in the caller's mount namespace (``ip netns
exec`` would make a private one). Two mounts of the same export are two hosts' views::

    with MooseFS(tmp_path / "mfs") as mfs:
        a, b = mfs.mount("a"), mfs.mount("b")
        ...   # write through a.path, read through b.path

:meth:`MooseFS.close` always unmounts, stops every daemon and deletes the namespace, also
after a failure, and lets a stopped chunkserver run again first (a writer waiting on it
would keep its mount busy). :func:`missing_requirements` says what this needs (root, the
Debian packages, ``/dev/fuse``); :func:`s3fs_mount` mounts an S3 bucket with ``s3fs``.

Needs root. Traffic stays inside the namespace; only :func:`s3fs_mount` talks to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = [
    "DEFAULT_MOUNT_OPTIONS",
    "MooseFS",
    "Mount",
    "SharedFsError",
    "SharedFsUnavailable",
    "missing_requirements",
    "s3fs_mount",
]

#: program → the Debian package that ships it
PROGRAMS = {
    "mfsmaster": "moosefs-master",
    "mfschunkserver": "moosefs-chunkserver",
    "mfsmount": "moosefs-client",
    "mfssetgoal": "moosefs-client",
    "ip": "iproute2",
    "nsenter": "util-linux",
    "umount": "mount",
}
#: an empty filesystem's metadata, which a new master starts from (moosefs-master ships it)
EMPTY_METADATA = Path("/var/lib/mfs/metadata.mfs.empty")
#: mfsioretries=5: I/O the master cannot place (its chunkserver gone, or dropped after MATOCS_TIMEOUT,
#: 10 s, when it hangs) fails after ~2 s of retries instead of ~2 minutes (30, the default);
#: mfstimeout=5: a write to a chunkserver that is connected but does not answer fails with EIO.
#: Neither bounds a write that needs a new chunk while the only chunkserver is gone: MooseFS 3.0
#: makes it wait until one is back (see tests/sharedfs/test_faults.py).
DEFAULT_MOUNT_OPTIONS = ("mfstimeout=5", "mfsioretries=5", "mfsnice=0")
MASTER_CLIENT_PORT = 9421
MASTER_CHUNKSERVER_PORT = 9420
START_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
_TCP_LISTEN, _TCP_ESTABLISHED = "0A", "01"


class SharedFsUnavailable(RuntimeError):
    """This machine cannot run the shared filesystem; the message says exactly what is missing."""


class SharedFsError(RuntimeError):
    """The shared filesystem did not start, or did not answer in time (its logs are named)."""


def missing_requirements(which: Callable[[str], str | None] = shutil.which) -> list[str]:
    """What this machine lacks to run :class:`MooseFS`, one line each (empty when nothing)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root: network namespaces, FUSE mounts and the MooseFS daemons need it")
    absent = sorted({package for program, package in PROGRAMS.items() if which(program) is None})
    if absent:
        programs = sorted(program for program, package in PROGRAMS.items() if package in absent)
        missing.append(f"the Debian packages {' '.join(absent)} (for {', '.join(programs)})")
    elif not EMPTY_METADATA.is_file():
        missing.append(f"{EMPTY_METADATA} (shipped by the Debian package moosefs-master)")
    if not Path("/dev/fuse").exists():
        missing.append("/dev/fuse (the fuse kernel module)")
    return missing


def install_hint(missing: list[str]) -> str:
    """One message naming everything missing and the command that installs the packages."""
    packages = "moosefs-master moosefs-chunkserver moosefs-client s3fs"
    return (
        "the shared-filesystem tests need: "
        + "; ".join(missing)
        + f". As root: DEBIAN_FRONTEND=noninteractive apt-get install -y {packages} (or .ci/sharedfs-deps)"
    )


def _run(command: list[str], *, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise SharedFsError(f"{' '.join(command)} did not finish in {timeout} s") from exc
    if check and done.returncode != 0:
        raise SharedFsError(
            f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}"
        )
    return done


def poll(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.02) -> None:
    """Return once ``condition()`` holds; :class:`SharedFsError` naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise SharedFsError(f"{what}: not so after {timeout} s")
        time.sleep(interval)


def bounded(call: Callable[[], object], timeout: float, what: str) -> None:
    """Run ``call`` in a thread and wait at most ``timeout`` s: I/O on a FUSE mount can block for ever.

    A call still blocked is left behind (its thread is a daemon); tearing the mount down ends it.
    """
    failure: list[BaseException] = []

    def target() -> None:
        try:
            call()
        except BaseException as exc:  # reported to the caller below
            failure.append(exc)

    thread = threading.Thread(target=target, name=f"sharedfs-{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise SharedFsError(f"{what}: still blocked after {timeout} s")
    if failure:
        raise SharedFsError(f"{what}: {failure[0]!r}") from failure[0]


def _tcp_states(pid: int) -> set[tuple[int, int, str]]:
    """``(local port, remote port, state)`` of the TCP sockets in ``pid``'s network namespace."""
    found = set()
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, state = fields[1], fields[2], fields[3]
            found.add((int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16), state))
    return found


def _mount_points() -> set[str]:
    """Mount points of this mount namespace (octal escapes in /proc/self/mountinfo decoded)."""
    points = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        raw = line.split()[4]
        points.add(raw.encode().decode("unicode_escape"))
    return points


def _unmount(path: Path) -> None:
    """Unmount ``path`` if it is mounted; lazily (detached now, gone once unused) if it is busy."""
    if str(path) in _mount_points() and _run(["umount", str(path)], check=False, timeout=STOP_TIMEOUT).returncode:
        _run(["umount", "-l", str(path)], timeout=STOP_TIMEOUT)


def _stop_process(process: subprocess.Popen[bytes], timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM, then SIGKILL if it has not exited after ``timeout`` s."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(STOP_TIMEOUT)


@dataclass
class Mount:
    """One ``mfsmount`` client: a host's view of the filesystem at :attr:`path`."""

    name: str
    path: Path
    options: tuple[str, ...]
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def mounted(self) -> bool:
        return str(self.path) in _mount_points()


@dataclass
class MooseFS:
    """A MooseFS master and chunkserver in a namespace of their own, with files under ``base``.

    Parameters
    ----------
    base:
        An empty directory of the caller's (a test's temporary directory); configuration,
        metadata, chunks, logs and mount points go there.
    mount_options:
        ``-o`` options every mount gets before its own (:data:`DEFAULT_MOUNT_OPTIONS`).
    """

    base: Path
    mount_options: tuple[str, ...] = DEFAULT_MOUNT_OPTIONS
    namespace: str = field(default_factory=lambda: f"gymckpt-{secrets.token_hex(4)}")
    address: str = field(
        default_factory=lambda: f"10.{secrets.randbelow(256)}.{secrets.randbelow(256)}.{1 + secrets.randbelow(254)}"
    )
    mounts: dict[str, Mount] = field(default_factory=dict)
    master: subprocess.Popen[bytes] | None = None
    chunkserver: subprocess.Popen[bytes] | None = None
    _namespace_made: bool = False
    _chunkserver_stopped: bool = False

    # --- lifecycle

    def __enter__(self) -> MooseFS:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> MooseFS:
        """Make the namespace, write the configuration, start the master and the chunkserver.

        Raises :class:`SharedFsUnavailable` when this machine cannot (see
        :func:`missing_requirements`), :class:`SharedFsError` when a daemon does not come up.
        Whatever was started is stopped again when this raises.
        """
        missing = missing_requirements()
        if missing:
            raise SharedFsUnavailable(install_hint(missing))
        try:
            self.base.mkdir(parents=True, exist_ok=True)
            self._make_namespace()
            self._write_configuration()
            self._start_master()
            self.start_chunkserver()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> list[str]:
        """Unmount everything, stop the daemons, delete the namespace; never raises.

        Returns what could not be cleaned up (empty when everything went).
        """
        problems: list[str] = []
        if self.chunkserver is not None and self._chunkserver_stopped:
            self.continue_chunkserver()
        for name in list(self.mounts):
            try:
                self.unmount(name)
            except Exception as exc:  # go on: the daemons and the namespace must still go
                problems.append(f"mount {name}: {exc}")
        for process in (self.chunkserver, self.master):
            if process is not None:
                try:
                    _stop_process(process)
                except Exception as exc:
                    problems.append(f"process {process.pid}: {exc}")
        self.chunkserver = self.master = None
        if self._namespace_made:
            done = _run(["ip", "netns", "delete", self.namespace], check=False)
            if done.returncode != 0:
                problems.append(f"namespace {self.namespace}: {done.stderr.strip()}")
            self._namespace_made = False
        return problems + self.leftovers()

    def leftovers(self) -> list[str]:
        """Mounts under :attr:`base`, processes naming it, and the namespace, if still there."""
        found = [f"mounted: {point}" for point in sorted(_mount_points()) if point.startswith(str(self.base))]
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if str(self.base) in command:
                    found.append(f"process {entry.name}: {command.strip()}")
        if Path("/run/netns", self.namespace).exists():
            found.append(f"network namespace {self.namespace}")
        return found

    # --- the daemons

    def _in_namespace(self, *command: str) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.namespace}", *command]

    def _make_namespace(self) -> None:
        done = _run(["ip", "netns", "add", self.namespace], check=False)
        if done.returncode != 0:
            raise SharedFsUnavailable(
                f"cannot create a network namespace ({done.stderr.strip()}): the shared-filesystem tests "
                "need root with CAP_SYS_ADMIN (a container must allow network namespaces)"
            )
        self._namespace_made = True
        self._path("namespace").write_text(self.namespace)  # for a test that checks it is gone afterwards
        _run(self._in_namespace("ip", "addr", "add", f"{self.address}/32", "dev", "lo"))
        _run(self._in_namespace("ip", "link", "set", "lo", "up"))

    def _path(self, *parts: str) -> Path:
        return self.base.joinpath(*parts)

    def _write_configuration(self) -> None:
        for directory in ("etc", "master", "chunkserver", "hdd", "logs", "mounts"):
            self._path(directory).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(EMPTY_METADATA, self._path("master", "metadata.mfs"))
        common = "WORKING_USER = root\nWORKING_GROUP = root\nNICE_LEVEL = 0\nDISABLE_OOM_KILLER = 0\n"
        self._path("etc", "mfsmaster.cfg").write_text(
            common
            + f"DATA_PATH = {self._path('master')}\n"
            + f"EXPORTS_FILENAME = {self._path('etc', 'mfsexports.cfg')}\n"
            + f"TOPOLOGY_FILENAME = {self._path('etc', 'mfstopology.cfg')}\n"
            + "".join(f"{kind}_LISTEN_HOST = {self.address}\n" for kind in ("MATOML", "MATOCS", "MATOCL"))
        )
        # only this namespace's own address may mount, read-write, root as root
        self._path("etc", "mfsexports.cfg").write_text(f"{self.address} / rw,alldirs,maproot=0:0\n")
        self._path("etc", "mfstopology.cfg").write_text("")
        self._path("etc", "mfschunkserver.cfg").write_text(
            common
            + f"DATA_PATH = {self._path('chunkserver')}\n"
            + f"HDD_CONF_FILENAME = {self._path('etc', 'mfshdd.cfg')}\n"
            + f"MASTER_HOST = {self.address}\nBIND_HOST = {self.address}\nCSSERV_LISTEN_HOST = {self.address}\n"
        )
        self._path("etc", "mfshdd.cfg").write_text(f"{self._path('hdd')}\n")

    def _daemon(self, name: str, *command: str) -> subprocess.Popen[bytes]:
        with self._path("logs", f"{name}.log").open("ab") as log:
            return subprocess.Popen(
                self._in_namespace(*command), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )

    def _alive(self, process: subprocess.Popen[bytes] | None, name: str) -> bool:
        if process is None or process.poll() is not None:
            log = self._path("logs", f"{name}.log")
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise SharedFsError(f"{name} exited ({process.returncode if process else None}); its log:\n{tail}")
        return True

    def _start_master(self) -> None:
        self.master = self._daemon("mfsmaster", "mfsmaster", "-f", "-c", str(self._path("etc", "mfsmaster.cfg")))
        master = self.master
        poll(
            lambda: (
                self._alive(master, "mfsmaster") and (MASTER_CLIENT_PORT, 0, _TCP_LISTEN) in _tcp_states(master.pid)
            ),
            START_TIMEOUT,
            f"mfsmaster listening on {self.address}:{MASTER_CLIENT_PORT}",
        )

    def chunkserver_connected(self) -> bool:
        """True when a chunkserver holds a connection to the master's chunkserver port."""
        assert self.master is not None, "the master is not running"
        return any(
            local == MASTER_CHUNKSERVER_PORT and state == _TCP_ESTABLISHED
            for local, _, state in _tcp_states(self.master.pid)
        )

    def start_chunkserver(self) -> None:
        """Start the chunkserver (again) and wait until the master has it."""
        assert self.chunkserver is None or self.chunkserver.poll() is not None, "the chunkserver is running"
        config = str(self._path("etc", "mfschunkserver.cfg"))
        self.chunkserver = self._daemon("mfschunkserver", "mfschunkserver", "-f", "-c", config)
        self._chunkserver_stopped = False
        chunkserver = self.chunkserver
        poll(
            lambda: self._alive(chunkserver, "mfschunkserver") and self.chunkserver_connected(),
            START_TIMEOUT,
            "the chunkserver connected to the master",
        )

    def stop_chunkserver(self) -> None:
        """SIGSTOP the chunkserver: it keeps its connections and answers nothing (a hung server)."""
        assert self.chunkserver is not None
        os.kill(self.chunkserver.pid, signal.SIGSTOP)
        self._chunkserver_stopped = True

    def continue_chunkserver(self) -> None:
        """SIGCONT a stopped chunkserver."""
        assert self.chunkserver is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.chunkserver.pid, signal.SIGCONT)
        self._chunkserver_stopped = False

    def kill_chunkserver(self) -> None:
        """SIGKILL the chunkserver and wait until it is gone (its connections closed)."""
        assert self.chunkserver is not None
        self.chunkserver.kill()
        self.chunkserver.wait(STOP_TIMEOUT)
        self._chunkserver_stopped = False

    # --- mounts

    def mount(self, name: str, *options: str, timeout: float = START_TIMEOUT) -> Mount:
        """Mount the export's root at ``base/mounts/<name>`` with its own ``mfsmount``; wait until it serves."""
        assert name not in self.mounts, f"{name} is mounted"
        path = self._path("mounts", name)
        path.mkdir(parents=True, exist_ok=True)
        every = (*self.mount_options, *options)
        log = self._path("logs", f"mfsmount-{name}.log")
        command = ["mfsmount", "-f", str(path), "-H", self.address, "-o", ",".join(every)]
        with log.open("ab") as output:
            process = subprocess.Popen(
                self._in_namespace(*command), stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT
            )
        mount = Mount(name=name, path=path, options=every, process=process, log=log)
        self.mounts[name] = mount
        poll(lambda: self._alive(process, f"mfsmount-{name}") and mount.mounted(), timeout, f"{path} mounted")
        if len(self.mounts) == 1:
            # one copy of each chunk (there is one chunkserver), and deleted files leave at once
            _run(self._in_namespace("mfssetgoal", "-r", "1", str(path)))
            _run(self._in_namespace("mfssettrashtime", "-r", "0", str(path)))
        self.wait_writable(name, timeout)
        return mount

    def wait_writable(self, name: str, timeout: float = START_TIMEOUT) -> None:
        """Wait until a file written and fsynced through mount ``name`` reads back (bounded)."""
        probe = self.mounts[name].path / f".sharedfs-probe-{secrets.token_hex(4)}"
        deadline = time.monotonic() + timeout

        def write_once() -> bool:
            """True once the probe is written and read back; False while the master has no space yet."""
            try:
                with open(probe, "wb") as stream:
                    stream.write(b"probe")
                    stream.flush()
                    os.fsync(stream.fileno())
            except OSError as exc:
                # a chunkserver that just connected reports its disks a moment later: until then the
                # master has no space for a chunk, and the write fails with ENOSPC
                if exc.errno != errno.ENOSPC or time.monotonic() >= deadline:
                    raise
                probe.unlink(missing_ok=True)
                return False
            if probe.read_bytes() != b"probe":
                raise SharedFsError(f"{probe} read back other bytes")
            probe.unlink()
            return True

        def write_and_read() -> None:
            poll(write_once, timeout, f"the master took a chunk through {self.mounts[name].path}", interval=0.05)

        bounded(write_and_read, timeout, f"a write through {self.mounts[name].path}")

    def kill_mount(self, name: str) -> None:
        """SIGKILL mount ``name``'s ``mfsmount``: its path stays mounted and answers ENOTCONN."""
        process = self.mounts[name].process
        process.kill()
        process.wait(STOP_TIMEOUT)

    def unmount(self, name: str) -> None:
        """Unmount ``name`` (lazily if it is busy) and stop its ``mfsmount``."""
        mount = self.mounts.pop(name)
        _unmount(mount.path)
        _stop_process(mount.process)
        poll(lambda: not mount.mounted(), STOP_TIMEOUT, f"{mount.path} unmounted")

    def remount(self, name: str) -> Mount:
        """Unmount ``name`` (a killed client's too) and mount it again with the same options."""
        options = self.mounts[name].options[len(self.mount_options) :]
        self.unmount(name)
        return self.mount(name, *options)


@contextlib.contextmanager
def s3fs_mount(bucket: str, path: Path, *, endpoint_url: str, key: str, secret: str) -> Iterator[Path]:
    """Mount ``bucket`` at ``path`` with Debian's ``s3fs`` (path-style requests to ``endpoint_url``).

    Unmounted again on exit, also after a failure. Raises :class:`SharedFsUnavailable` when
    ``s3fs`` is missing (Debian package s3fs) and :class:`SharedFsError` when it does not mount.
    """
    if shutil.which("s3fs") is None or os.geteuid() != 0:
        raise SharedFsUnavailable(install_hint(["root and the Debian package s3fs (for s3fs)"]))
    path.mkdir(parents=True, exist_ok=True)
    secrets_file = path.parent / f".{path.name}.passwd"
    secrets_file.write_text(f"{key}:{secret}\n")
    secrets_file.chmod(0o600)
    log = path.parent / f"{path.name}.s3fs.log"
    options = [f"url={endpoint_url}", "use_path_request_style", f"passwd_file={secrets_file}", "retries=2"]
    command = ["s3fs", bucket, str(path), "-f", *(part for option in options for part in ("-o", option))]
    with log.open("ab") as output:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT)
    try:

        def ready() -> bool:
            if process.poll() is not None:
                raise SharedFsError(f"s3fs exited {process.returncode}: {log.read_text(errors='replace')[-2000:]}")
            return str(path) in _mount_points()

        poll(ready, START_TIMEOUT, f"{path} mounted by s3fs")
        yield path
    finally:
        _unmount(path)
        _stop_process(process)
        secrets_file.unlink(missing_ok=True)
