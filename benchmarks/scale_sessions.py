"""Scenario (b) of bench_scale: big sessions (the sandbox kind) checkpointed end to end, crashed, restored.

One ``gymckpt serve sandbox`` server (``workers`` uvicorn workers) runs as a real process
group behind a kept socket (:class:`~gymckpt.stack.supervisor.Stack`) and a
:class:`~gymckpt.control.coordination.Coordinator` drives its control routes:

1. ``sessions`` rollouts each seed a sandbox session of ``session_bytes`` (HTTP, through the
   rollout prefix), write a file and run two commands; each session's digest is read back.
2. prepare, commit every session, publish; SIGKILL of the server's process group.
3. A fresh process on the same port, restore of every session (installed under attempt 1),
   resume; every restored session's digest is read back.
4. Every digest before the crash and after the restore must equal the one an uninterrupted
   session gives (computed here from :mod:`gymckpt.servers.sandbox`'s pure functions).

Commit and restore are each bracketed by a :class:`~benchmarks.scale_memory.MemoryWindow`:
the server's RSS before, and its peak during, against the bound issue 27 sets.

:class:`SessionsPhases` runs these phases against any stack that answers ``urls`` and
``servers``: here a local one; :mod:`benchmarks.ray_sessions` places the same server on a
Ray node and loses that node instead of SIGKILLing the process.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from benchmarks.machine import write_fsync_seconds
from benchmarks.scale_memory import MemoryWindow, PhaseMemory
from benchmarks.scale_sampling import participant_lines
from gymckpt.control.coordination import Coordinator
from gymckpt.identity import capture_key, rollout_path
from gymckpt.servers.sandbox import DEFAULT_SESSION_BYTES, run_command, seed_state, session_digest
from gymckpt.stack.supervisor import load_stack
from gymckpt.workers.routing import COOKIE_NAME

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

    from gymckpt.stack.ray import RayStack
    from gymckpt.stack.supervisor import Stack

__all__ = [
    "SessionsPhases",
    "SessionsRun",
    "expected_digest",
    "run_sessions_scenario",
    "session_steps",
    "sessions_spec",
]

#: the server's name in the stack
SERVER = "sandbox"
#: HTTP calls in flight at once while sessions are made and read back
CONCURRENCY = 64
#: files a seeded session holds
FILES = 32


@dataclass
class SessionsRun:
    """What scenario (b) did and measured."""

    sessions: int
    session_bytes: int
    workers: int
    ok: bool = False
    error: str = ""
    lost: int = 0
    differing: int = 0
    create_seconds: float = 0.0
    prepare_seconds: float = 0.0
    commit_seconds: float = 0.0
    #: the same bytes written to a new file beside the checkpoint and fsynced, right after the commit
    #: (0: not measured, the checkpoint is not on a local path)
    write_fsync_seconds: float = 0.0
    restore_seconds: float = 0.0
    #: from the crash to a fresh server answering (before the restore)
    restart_seconds: float = 0.0
    #: on Ray: the node the server was placed on, first and after the loss
    nodes: list[str] = field(default_factory=list)
    records: int = 0
    bytes_written: int = 0
    #: the participant's own commit and restore with their steps, from its INFO lines
    participant_lines: dict[str, dict[str, str]] = field(default_factory=dict)
    #: the server's memory around the commit and the restore
    memory: dict[str, dict[str, PhaseMemory]] = field(default_factory=dict)


def session_steps(index: int) -> tuple[dict[str, Any], list[str]]:
    """The file a rollout writes into its session and the commands it runs."""
    note = {"path": "notes/plan.md", "content": f"# rollout {index}\n\nstep 1: look around\n"}
    return note, ["sha256sum src/pkg_0/module_0.py", f"echo turn {index} done"]


def expected_digest(rollout_id: str, index: int, session_bytes: int, files: int = FILES) -> str:
    """The digest of rollout ``index``'s session after its steps, as an uninterrupted run leaves it."""
    state = seed_state(rollout_id, session_bytes, files)
    note, commands = session_steps(index)
    state["files"][note["path"]] = note["content"]
    for command in commands:
        output, code = run_command(state, command)
        state["history"].append({"command": command, "exit_code": code, "output": output})
    return session_digest(state)


def sessions_spec(token: str, workdir: Path, *, session_bytes: int, workers: int) -> dict[str, Any]:
    """The stack of scenario (b): one sandbox server, checkpoints allowed under ``workdir``."""
    return {
        "checkpoint": {"enabled": True, "control_auth_token": token, "allowed_roots": [str(workdir)]},
        "workers": workers,
        "servers": [
            {
                "name": SERVER,
                "kind": "sandbox",
                "config": {"session_bytes": session_bytes, "files_per_session": FILES},
            }
        ],
    }


def run_sessions_scenario(
    *,
    sessions: int,
    session_bytes: int = DEFAULT_SESSION_BYTES,
    workers: int = 1,
    root: Path,
    console: Console,
    timeout: float = 600.0,
    keep: bool = False,
) -> SessionsRun:
    """Run scenario (b) under ``root`` (checkpoints, configs, logs); the figures, ``ok`` when every session
    came back equal."""
    run = SessionsRun(sessions=sessions, session_bytes=session_bytes, workers=workers)
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-scale-b-{workers}w-", dir=root))
    token = secrets.token_urlsafe(16)
    stack = load_stack(
        sessions_spec(token, workdir, session_bytes=session_bytes, workers=workers), workdir=workdir, keep_workdir=True
    )

    def crash() -> str:
        stack.kill([SERVER])
        stack.start([SERVER])
        return "SIGKILL of the sandbox server's process group; a fresh process on the same socket restores"

    try:
        asyncio.run(SessionsPhases(run, stack, token, workdir, console, timeout, start=stack.start, crash=crash).run())
    except Exception as exc:  # a failed phase: one line, the logs kept
        run.error = " ".join(f"{type(exc).__name__}: {exc}".split())
    finally:
        stack.close()
    run.participant_lines = participant_lines([server.log_path for server in stack.servers.values()])
    run.ok = not run.error and not run.lost and not run.differing
    if run.ok and not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    elif not run.ok:
        console.print(f"kept for a look: {workdir}", highlight=False)
    return run


class SessionsPhases:
    """The phases of scenario (b) against a stack that is local (:class:`~gymckpt.stack.supervisor.Stack`)
    or placed on Ray (:class:`~gymckpt.stack.ray.RayStack`): ``start`` brings the server up the first
    time, ``crash`` loses it and brings a fresh one up (blocking calls, run off the event loop; it
    returns what it did, in one line). The server's URL is read afresh after each."""

    def __init__(
        self,
        run: SessionsRun,
        stack: Stack | RayStack,
        token: str,
        workdir: Path,
        console: Console,
        timeout: float,
        *,
        start: Callable[[], object],
        crash: Callable[[], str],
    ) -> None:
        self.figures = run
        self.stack = stack
        self.token = token
        self.directory = str(workdir / "checkpoints" / "sessions-1")
        self.console = console
        self.timeout = timeout
        self.start = start
        self.crash = crash
        self.keys = [f"{index}-0" for index in range(run.sessions)]
        #: capture key → the session cookie naming the worker that owns it (one jar would mix every session's)
        self.cookies: dict[str, str] = {}

    @property
    def url(self) -> str:
        return self.stack.urls[SERVER]

    async def run(self) -> None:
        """The phases of the module notes; the figures go to the run given."""
        run = self.figures
        await asyncio.to_thread(self.start)
        gym = await self._up()
        try:
            async with self._client() as http:
                began = time.perf_counter()
                await self._each(http, self.keys, self._create)
                before = await self._digests(http, self.keys)
                run.create_seconds = time.perf_counter() - began
            self._say(f"{run.sessions:,} sessions of {run.session_bytes:,} bytes made in {run.create_seconds:.1f} s")
            await self._checkpoint(gym)
        finally:
            await gym.close()
        began = time.perf_counter()
        self._say(await asyncio.to_thread(self.crash))
        gym = await self._up()
        run.restart_seconds = time.perf_counter() - began
        try:
            await self._restore(gym)
        finally:
            await gym.close()
        async with self._client() as http:  # new connections: none to the killed process is reused
            after = await self._digests(http, [capture_key(key, 1) for key in self.keys])
        expected = await asyncio.to_thread(
            lambda: [expected_digest(key, index, run.session_bytes) for index, key in enumerate(self.keys)]
        )
        run.lost = sum(1 for digest in after if digest is None)
        run.differing = sum(
            1
            for want, first, last in zip(expected, before, after, strict=True)
            if last is not None and (first != want or last != want)
        )

    def _client(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=CONCURRENCY),
            cookie_jar=aiohttp.DummyCookieJar(),  # the session cookies are kept per session in :attr:`cookies`
            timeout=aiohttp.ClientTimeout(total=self.timeout),
        )

    async def _up(self) -> Coordinator:
        """A discovered coordinator once the server answers and every worker linked."""
        deadline = time.monotonic() + self.timeout
        server = self.stack.servers[SERVER]
        gym = Coordinator([self.url], token=self.token, probe_timeout=self.timeout)
        try:
            probe = asyncio.create_task(gym.discover(require_model=False))
            while not probe.done():  # the kept socket accepts at once: watch the process meanwhile
                if not server.alive or time.monotonic() > deadline:
                    probe.cancel()
                    await asyncio.gather(probe, return_exceptions=True)
                    raise RuntimeError(f"the sandbox server did not come up; see {server.log_path}")
                await asyncio.wait({probe}, timeout=0.1)
            found = probe.result()
            if not found.ok:
                raise RuntimeError(f"the sandbox server did not come up: {found.problems}")
            while (status := await gym.status(self.url)).get("workers", 1) < status.get("expected_workers", 1):
                if time.monotonic() > deadline or not server.alive:
                    raise RuntimeError("the sandbox server's workers did not all link to its coordinator")
                await asyncio.sleep(0.1)  # polls the status above, within the deadline
        except BaseException:
            await gym.close()
            raise
        return gym

    async def _checkpoint(self, gym: Coordinator) -> None:
        run = self.figures
        window = MemoryWindow()
        began = time.perf_counter()
        prepared = await gym.prepare("sessions-1", time.time() + self.timeout)
        run.prepare_seconds = time.perf_counter() - began
        if not prepared.prepared:
            raise RuntimeError(f"prepare did not get ready: {prepared.blockers()}")
        window.begin(self._pids())
        began = time.perf_counter()
        commits = await gym.commit("sessions-1", time.time() + self.timeout, self.directory, self.keys)
        run.commit_seconds = time.perf_counter() - began
        run.memory["commit"] = window.end()
        await gym.publish(self.directory, commits)
        (reply,) = commits.values()
        run.records, run.bytes_written = reply.record_count or 0, reply.records_bytes or 0
        for memory in run.memory["commit"].values():
            memory.records_bytes = run.bytes_written
        self._say(
            f"prepare {run.prepare_seconds:.3f} s, commit {run.commit_seconds:.3f} s: "
            f"{run.records:,} records, {run.bytes_written:,} bytes; published"
        )
        if "://" not in self.directory:
            beside = os.path.dirname(self.directory)
            run.write_fsync_seconds = await asyncio.to_thread(write_fsync_seconds, beside, run.bytes_written)
            self._say(f"the same bytes written and fsynced alone, beside it: {run.write_fsync_seconds:.3f} s")

    async def _restore(self, gym: Coordinator) -> None:
        run = self.figures
        window = MemoryWindow()
        window.begin(self._pids())
        began = time.perf_counter()
        await gym.restore("sessions-1", time.time() + self.timeout, self.directory, self.keys)
        run.restore_seconds = time.perf_counter() - began
        run.memory["restore"] = window.end()
        for memory in run.memory["restore"].values():
            memory.records_bytes = run.bytes_written
        await gym.resume("sessions-1", time.time() + self.timeout)
        self._say(f"restore {run.restore_seconds:.3f} s (installed under attempt 1), resumed")

    def _pids(self) -> dict[str, int]:
        """The server's process (its group's leader, on a Ray node of this machine), for the memory windows."""
        server = self.stack.servers[SERVER]
        pid = server.process.pid if server.process is not None else getattr(server, "leader_pid", 0)
        return {SERVER: pid} if pid else {}

    async def _each(self, http: aiohttp.ClientSession, keys: list[str], one: Any) -> list[Any]:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def bounded(index: int, key: str) -> Any:
            async with gate:
                return await one(http, index, key)

        return await asyncio.gather(*(bounded(index, key) for index, key in enumerate(keys)))

    async def _post(self, http: aiohttp.ClientSession, key: str, path: str, body: Any = None) -> dict[str, Any]:
        """One call of ``key``'s session, carrying the session cookie its worker gave it (several workers)."""
        cookie = self.cookies.get(key)
        headers = {"Cookie": f"{COOKIE_NAME}={cookie}"} if cookie else None
        async with http.post(f"{self.url}{rollout_path(key, path)}", json=body, headers=headers) as response:
            given = response.cookies.get(COOKIE_NAME)
            if given is not None:
                self.cookies[key] = given.value
            if response.status != 200:
                raise RuntimeError(f"{path} of {key} answered {response.status}: {(await response.text())[:200]}")
            return await response.json()  # type: ignore[no-any-return]

    async def _create(self, http: aiohttp.ClientSession, index: int, key: str) -> None:
        await self._post(http, key, "/seed_session", {"task_input": {}})
        note, commands = session_steps(index)
        await self._post(http, key, "/write_file", note)
        for command in commands:
            await self._post(http, key, "/run_command", {"command": command})

    async def _digests(self, http: aiohttp.ClientSession, keys: list[str]) -> list[str | None]:
        async def one(http: aiohttp.ClientSession, index: int, key: str) -> str | None:
            try:
                reply = await self._post(http, key, "/digest")
            except RuntimeError:
                return None
            return str(reply["sha256"]) if reply.get("files") else None  # an empty tree: the session was lost

        return await self._each(http, keys, one)

    def _say(self, text: str) -> None:
        self.console.print(f"[b]scenario b[/]: {text}")
