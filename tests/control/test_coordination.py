"""Coordination (K1–K6) against real uvicorn server processes on 127.0.0.1.

Every server is ``tests/control/coord_server.py`` in its own process group: one participant
per server (kinds environment, model, agent, resources), gymckpt's control plane and
routes, configured through environment variables. Each server appends one line per control
operation to a log file shared by all of them (``O_APPEND``), so the tests read the order
in which the servers ran prepare, resume, retire, … on their side. Checkpoints go to a
local directory all processes share.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gymckpt import errors
from gymckpt.control.coordination import (
    KIND_ORDER,
    Coordinator,
    PrepareResult,
    runs_to_await,
)
from gymckpt.control.models import PrepareReply, PrepareReport
from gymckpt.errors import ServerCallFailed
from gymckpt.store import open_store, verify
from gymckpt.testing.net import free_port
from gymckpt.testing.time import run_bounded

from ..support import kill_group, start_uvicorn

TOKEN = "coord-test-token"
READY_TIMEOUT = 30.0
#: per-test bound: no coordination call may hang a test
CALL_BOUND = 20.0

INSTANCES = {"environment": "env-0", "model": "model-0", "agent": "agent-0", "resources": "res-0"}
#: what each server holds at start; "r4" is a rollout the agent cannot capture (a restart)
EPISODES = {
    "environment": ["r1", "r2", "r3", "r4"],
    "model": ["r1", "r2"],
    "agent": ["r1", "r2", "r3", "r4"],
    "resources": ["r2", "r3"],
}
RESTARTS = {"agent": ["r4"]}
ALL_KEYS = ["r1", "r2", "r3", "r4"]


@dataclass
class Server:
    kind: str
    instance: str
    url: str
    process: subprocess.Popen[bytes]
    stderr: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)

    def kill(self) -> None:
        kill_group(self.process, timeout=10)


def _drain(server: Server) -> None:
    """Read the server's stderr to the end (so it never blocks on a full pipe)."""
    assert server.process.stderr is not None
    for raw in server.process.stderr:
        line = raw.decode(errors="replace")
        server.stderr.append(line)
        if "Uvicorn running on" in line:
            server.ready.set()
    server.ready.set()  # EOF: the process ended; start() reports it


class Fleet:
    """Starts coord_server processes and kills their process groups at teardown."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.servers: list[Server] = []

    def start(
        self,
        kind: str,
        instance: str,
        *,
        episodes: list[str] = (),  # type: ignore[assignment]
        restarts: list[str] = (),  # type: ignore[assignment]
        behaviours: list[str] = (),  # type: ignore[assignment]
        export_delay: float = 0.0,
    ) -> Server:
        port = free_port()
        env = dict(os.environ)
        env.update(
            COORD_KIND=kind,
            COORD_INSTANCE=instance,
            COORD_TOKEN=TOKEN,
            COORD_LOG=str(self.log),
            COORD_EPISODES=",".join(episodes),
            COORD_RESTARTS=",".join(restarts),
            COORD_BEHAVIOURS=",".join(behaviours),
            COORD_EXPORT_DELAY=str(export_delay),
        )
        process = start_uvicorn(
            ["tests.control.coord_server:app", "--host", "127.0.0.1", "--port", str(port), "--no-access-log"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        server = Server(kind, instance, f"http://127.0.0.1:{port}", process)
        self.servers.append(server)
        threading.Thread(target=_drain, args=(server,), daemon=True).start()
        return server

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        for server in self.servers:
            if not server.ready.wait(max(deadline - time.monotonic(), 0.0)):
                raise AssertionError(f"{server.kind} server not up in {READY_TIMEOUT} s:\n{''.join(server.stderr)}")
            if server.process.poll() is not None:
                raise AssertionError(f"{server.kind} server exited:\n{''.join(server.stderr)}")

    def start_standard(
        self, behaviours: dict[str, list[str]] | None = None, *, holding: bool = True, **options: Any
    ) -> list[Server]:
        """One server per kind, holding EPISODES (a fresh process after a crash holds nothing)."""
        behaviours = behaviours or {}
        started = [
            self.start(
                kind,
                INSTANCES[kind],
                episodes=EPISODES[kind] if holding else [],
                restarts=RESTARTS.get(kind, []),
                behaviours=behaviours.get(kind, []),
                **options,
            )
            for kind in KIND_ORDER
        ]
        self.wait_ready()
        return started

    def kill_all(self) -> None:
        for server in self.servers:
            server.kill()


@pytest.fixture
def fleet(tmp_path: Path):
    """A fresh fleet per test (servers started on demand), killed at teardown."""
    created = Fleet(tmp_path / "control.log")
    try:
        yield created
    finally:
        created.kill_all()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory):
    """Four servers (one per kind) shared by the tests that leave them idle."""
    root = tmp_path_factory.mktemp("coordination")
    created = Fleet(root / "control.log")
    try:
        created.start_standard(export_delay=0.3)
        yield created
    finally:
        created.kill_all()


class LogCursor:
    """The log lines written since the cursor was made."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.offset = log.stat().st_size if log.exists() else 0

    def lines(self) -> list[tuple[str, str, str]]:
        with self.log.open("rb") as stream:
            stream.seek(self.offset)
            data = stream.read().decode()
        parsed = []
        for line in data.splitlines():
            kind, instance, op = line.split(" ", 2)
            parsed.append((kind, instance, op))
        return parsed

    def ops(self, *, kind: str | None = None) -> list[str]:
        return [op for line_kind, _, op in self.lines() if kind is None or line_kind == kind]


#: run one coroutine on a fresh loop, bounded so nothing can hang the test
run = functools.partial(run_bounded, timeout=CALL_BOUND)


def deadline(seconds: float = 10.0) -> float:
    return time.time() + seconds


def urls(servers: list[Server]) -> list[str]:
    return [server.url for server in servers]


async def _get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def _post_json(url: str) -> Any:
    async with aiohttp.ClientSession() as session, session.post(url) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def _status(coordinator: Coordinator, url: str) -> dict[str, Any]:
    return await coordinator._call(url, "status", None, timeout=5.0)


def _first_index(lines: list[tuple[str, str, str]], kind: str, op: str) -> int:
    return next(i for i, line in enumerate(lines) if line[0] == kind and line[2] == op)


# --- discover (K1)


def test_discover_finds_every_participant_with_its_kind(shared: Fleet) -> None:
    async def scenario() -> Any:
        async with Coordinator(urls(shared.servers), token=TOKEN, probe_timeout=2.0, probe_retries=2) as coordinator:
            return await coordinator.discover(), dict(coordinator.kinds)

    result, kinds = run(scenario())
    assert result.ok, result.problems
    assert [(info.kind, info.instance) for info in result.participants] == [
        (kind, INSTANCES[kind]) for kind in KIND_ORDER
    ]
    assert {url: info.kind for url, info in kinds.items()} == {server.url: server.kind for server in shared.servers}


def test_discover_reports_unreachable_servers_within_the_probe_timeout(shared: Fleet, fleet: Fleet) -> None:
    """Down, silent (raw socket and a hanging uvicorn), wrong token and unknown kind: reported, not waited on."""
    silent = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept_and_never_answer() -> None:
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                connection, _ = silent.accept()
            except OSError:
                continue
            held.append(connection)

    acceptor = threading.Thread(target=accept_and_never_answer, daemon=True)
    acceptor.start()
    hanging = fleet.start("agent", "hanging-0", behaviours=["hang_status"])
    strange = fleet.start("sandbox", "sandbox-0")
    fleet.wait_ready()
    down = f"http://127.0.0.1:{free_port()}"
    silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    good = urls(shared.servers)
    servers = [*good, down, silent_url, hanging.url, strange.url]
    probe_timeout = 1.0

    async def scenario() -> tuple[Any, float]:
        async with Coordinator(servers, token=TOKEN, probe_timeout=probe_timeout, probe_retries=3) as coordinator:
            started = time.monotonic()
            result = await asyncio.wait_for(coordinator.discover(), 10.0)
            return result, time.monotonic() - started

    async def wrong_token() -> Any:
        async with Coordinator(good[:1], token="not-the-token", probe_timeout=1.0, probe_retries=3) as coordinator:
            return await asyncio.wait_for(coordinator.discover(), 10.0)

    try:
        result, elapsed = run(scenario())
        refused = run(wrong_token())
    finally:
        stop.set()
        acceptor.join(5)
        for connection in held:
            connection.close()
        silent.close()
    assert [info.url for info in result.participants] == good
    assert set(result.problems) == {down, silent_url, hanging.url, strange.url}
    assert not result.ok
    assert "no reply within" in result.problems[silent_url]
    assert "no reply within" in result.problems[hanging.url]
    assert "sandbox" in result.problems[strange.url]
    assert down in result.problems[down]
    # the silent servers are probed once each (concurrently): about one probe timeout in all
    assert elapsed < probe_timeout * 2 + 1.0, elapsed
    assert refused.participants == []
    assert "bearer token" in refused.problems[good[0]]


# --- order (K2)


def test_prepare_in_kind_order_and_resume_in_reverse(shared: Fleet) -> None:
    cursor = LogCursor(shared.log)

    async def scenario() -> PrepareResult:
        async with Coordinator(urls(shared.servers), token=TOKEN) as coordinator:
            assert (await coordinator.discover()).ok
            prepared = await coordinator.prepare("order-1", deadline())
            await coordinator.resume("order-1", deadline())
            return prepared

    prepared = run(scenario())
    assert prepared.ready
    lines = cursor.lines()
    ops = [(kind, op) for kind, _, op in lines]
    # participants: close in kind order, reopen in reverse
    assert [kind for kind, op in ops if op == "close_admission"] == list(KIND_ORDER)
    assert [kind for kind, op in ops if op == "open_admission"] == list(reversed(KIND_ORDER))
    # each kind's prepare finished before the next kind's began; the same for resume in reverse
    for earlier, later in itertools.pairwise(KIND_ORDER):
        assert _first_index(lines, earlier, "prepare:end") < _first_index(lines, later, "prepare:begin")
        assert _first_index(lines, later, "resume:end") < _first_index(lines, earlier, "resume:begin")
    # every prepare precedes every resume
    last_prepare = max(i for i, (_, op) in enumerate(ops) if op == "prepare:end")
    first_resume = min(i for i, (_, op) in enumerate(ops) if op == "resume:begin")
    assert last_prepare < first_resume


def test_retire_and_forget_run_callers_before_callees(shared: Fleet) -> None:
    cursor = LogCursor(shared.log)

    async def scenario() -> tuple[int, int, list[dict[str, Any]]]:
        async with Coordinator(urls(shared.servers), token=TOKEN) as coordinator:
            assert (await coordinator.discover()).ok
            retired = await coordinator.retire(["gone-a2"], checkpoint_id="retire-1", deadline_ts=deadline())
            statuses = [await _status(coordinator, url) for url in coordinator.servers]
            forgotten = await coordinator.forget(["gone"], checkpoint_id="retire-1", deadline_ts=deadline())
            return retired, forgotten, statuses

    retired, forgotten, statuses = run(scenario())
    assert retired == 4
    assert forgotten == 4
    assert all(status["retired_rollouts"] >= 1 for status in statuses)
    lines = cursor.lines()
    # groups: (environment), (agent), (model, resources): each group ends before the next begins
    for op in ("retire", "forget"):
        env_end = _first_index(lines, "environment", f"{op}:end")
        agent_begin = _first_index(lines, "agent", f"{op}:begin")
        agent_end = _first_index(lines, "agent", f"{op}:end")
        assert env_end < agent_begin
        assert agent_end < _first_index(lines, "model", f"{op}:begin")
        assert agent_end < _first_index(lines, "resources", f"{op}:begin")


# --- commit and publish (K2, K3, K5)


def test_commit_everywhere_then_publish_and_verify(shared: Fleet, tmp_path: Path) -> None:
    checkpoint_dir = tmp_path / "ckpt-commit"
    cursor = LogCursor(shared.log)

    async def scenario() -> tuple[Any, Any, dict[str, Any]]:
        async with Coordinator(urls(shared.servers), token=TOKEN) as coordinator:
            assert (await coordinator.discover()).ok
            prepared = await coordinator.prepare("commit-1", deadline())
            assert prepared.ready
            scope = prepared.continued(ALL_KEYS)
            try:
                commits = await coordinator.commit("commit-1", deadline(), str(checkpoint_dir), scope)
                # a retried commit returns the same result
                again = await coordinator.commit("commit-1", deadline(), str(checkpoint_dir), reversed(scope))
                assert again == commits
                document = await coordinator.publish(str(checkpoint_dir), commits)
            finally:
                await coordinator.resume("commit-1", deadline())
            return prepared, commits, document

    prepared, commits, document = run(scenario())
    assert prepared.restarts() == {"r4"}
    assert prepared.continued(ALL_KEYS) == ["r1", "r2", "r3"]
    by_kind = {shared.servers[i].kind: commits[shared.servers[i].url] for i in range(4)}
    for kind, reply in by_kind.items():
        expected = sorted(set(EPISODES[kind]) & {"r1", "r2", "r3"})
        assert reply.episode_ids == expected, kind
        assert reply.record_count == len(expected)
        manifest = checkpoint_dir / reply.manifest
        assert manifest.is_file()
        assert reply.manifest == f"gym/{kind}/{INSTANCES[kind]}/manifest.json"
    assert sorted(p.relative_to(checkpoint_dir).as_posix() for p in checkpoint_dir.rglob("manifest.json")) == sorted(
        f"gym/{kind}/{INSTANCES[kind]}/manifest.json" for kind in KIND_ORDER
    )
    assert (checkpoint_dir / "gym" / "checkpoint.json").is_file()
    assert {entry["kind"] for entry in document["participants"]} == set(KIND_ORDER)
    report = verify(str(checkpoint_dir))
    assert report.ok, report.findings
    assert not report.warnings, report.warnings
    with open_store(str(checkpoint_dir)) as store:
        index = store.read_index("")
        assert index.checkpoint_id == "commit-1"
        assert len(index.participants) == 4
    # the commits ran concurrently: every export started before any commit finished
    lines = cursor.lines()
    export_starts = [i for i, line in enumerate(lines) if line[2].startswith("export")]
    commit_ends = [i for i, line in enumerate(lines) if line[2] == "commit:end"]
    assert len(export_starts) == 4
    assert max(export_starts) < min(commit_ends)


def test_publish_refuses_a_partial_set_of_commits(shared: Fleet, tmp_path: Path) -> None:
    checkpoint_dir = tmp_path / "ckpt-partial"

    async def scenario() -> None:
        async with Coordinator(urls(shared.servers), token=TOKEN) as coordinator:
            assert (await coordinator.discover()).ok
            prepared = await coordinator.prepare("partial-1", deadline())
            try:
                commits = await coordinator.commit(
                    "partial-1", deadline(), str(checkpoint_dir), prepared.continued(ALL_KEYS)
                )
                commits.pop(shared.servers[0].url)
                with pytest.raises(errors.InvalidPhase):
                    await coordinator.publish(str(checkpoint_dir), commits)
            finally:
                await coordinator.resume("partial-1", deadline())

    run(scenario())
    assert not (checkpoint_dir / "gym" / "checkpoint.json").exists()


def test_commit_with_a_restart_in_scope_is_refused(shared: Fleet, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Coordinator(urls(shared.servers), token=TOKEN) as coordinator:
            assert (await coordinator.discover()).ok
            await coordinator.prepare("restart-1", deadline())
            try:
                with pytest.raises(errors.RestartInScope) as caught:
                    await coordinator.commit("restart-1", deadline(), str(tmp_path / "ckpt"), ALL_KEYS)
                assert caught.value.server == shared.servers[2].url  # type: ignore[attr-defined]
            finally:
                await coordinator.resume("restart-1", deadline())

    run(scenario())


# --- PrepareResult and runs_to_await (K3, K6)


def test_prepare_result_reports_blockers_and_restarts(shared: Fleet, tmp_path: Path) -> None:
    model = next(server for server in shared.servers if server.kind == "model")

    async def scenario() -> tuple[PrepareResult, PrepareResult, dict[str, Any]]:
        async with Coordinator(urls(shared.servers), token=TOKEN) as coordinator:
            assert (await coordinator.discover()).ok
            await _post_json(f"{model.url}/begin/r2")  # a step in flight on the model server
            try:
                blocked = await coordinator.prepare("blocked-1", time.time() + 0.5)
                await _post_json(f"{model.url}/finish/r2")
                ready = await coordinator.prepare("blocked-1", deadline())
                commits = await coordinator.commit(
                    "blocked-1", deadline(), str(tmp_path / "ckpt"), ready.continued(ALL_KEYS)
                )
            finally:
                await _post_json(f"{model.url}/finish/r2")
                await coordinator.resume("blocked-1", deadline())
            return blocked, ready, commits

    blocked, ready, commits = run(scenario())
    assert not blocked.ready
    assert blocked.blockers() == {model.url: ["r2"]}
    assert blocked.replies[model.url].phase == "preparing"
    assert blocked.replies[model.url].report.blocker_count == 1
    assert all(reply.phase == "prepared" for url, reply in blocked.replies.items() if url != model.url)
    assert blocked.restarts() == {"r4"}
    assert ready.ready
    assert ready.blockers() == {}
    assert ready.continued(["r3", "r4", "r1", "r3", "x9"]) == ["r1", "r3", "x9"]
    # the model's r2 finished its step before the cut: the committed state is step 2
    assert commits[model.url].episode_ids == ["r1", "r2"]


def _reply(ready: bool, blockers: list[str] = (), restarts: list[str] = ()) -> PrepareReply:  # type: ignore[assignment]
    return PrepareReply(
        phase="prepared" if ready else "preparing",
        report=PrepareReport(
            ready=ready, blockers=list(blockers), blocker_count=len(blockers), restarts=list(restarts)
        ),
    )


def test_prepare_result_and_runs_to_await_as_documented() -> None:
    result = PrepareResult(
        {
            "http://a": _reply(True, restarts=["r4", "r5-a1"]),
            "http://b": _reply(False, blockers=["r2"], restarts=["r4"]),
            "http://c": _reply(True),
        }
    )
    assert not result.ready
    assert result.blockers() == {"http://b": ["r2"]}
    assert result.restarts() == {"r4", "r5-a1"}
    assert result.continued(["r1", "r2", "r4", "r5-a1", "r5", "r1"]) == ["r1", "r2", "r5"]
    assert result.continued([]) == []
    assert PrepareResult({"http://a": _reply(True)}).ready
    assert PrepareResult({}).ready
    # blocker lists are as the server capped them; the count says how many there were
    capped = PrepareResult(
        {
            "http://a": PrepareReply(
                phase="preparing",
                report=PrepareReport(ready=False, blockers=[f"k{i}" for i in range(100)], blocker_count=250),
            )
        }
    )
    assert len(capped.blockers()["http://a"]) == 100
    # K6: wait only for outstanding runs that are neither committed nor restarts
    assert runs_to_await(["r1", "r2", "r3", "r4"], committed=["r1"], restarts=["r4"]) == ["r2", "r3"]
    assert runs_to_await(["b", "a"], committed=[], restarts=[]) == ["a", "b"]
    assert runs_to_await([], committed=["a"], restarts=["b"]) == []
    assert runs_to_await(["a-a1", "a"], committed=["a"], restarts=[]) == ["a-a1"]
    assert runs_to_await(iter(["x", "y"]), committed=iter(["y"]), restarts=iter(["x"])) == []


# --- the reserved control pool (K4)


def test_control_calls_complete_while_data_calls_hold_every_connection(shared: Fleet, tmp_path: Path) -> None:
    env = next(server for server in shared.servers if server.kind == "environment")
    held = 6

    async def scenario() -> list[Any]:
        data = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=held, limit_per_host=held))

        async def call(method: str, url: str) -> Any:
            async with data.request(method, url) as response:
                assert response.status == 200, await response.text()
                return await response.json()

        async with Coordinator(urls(shared.servers), token=TOKEN, connector_limit=2) as coordinator:
            try:
                assert (await coordinator.discover()).ok
                # half the pool: slow calls that block until released
                slow = [asyncio.create_task(call("POST", f"{env.url}/slow")) for _ in range(held // 2)]
                prepared = await coordinator.prepare("pool-1", deadline())
                assert prepared.ready
                # the other half: /run calls that park while admission is closed
                parked = [asyncio.create_task(call("POST", f"{env.url}/run/p{i}")) for i in range(held - held // 2)]
                await asyncio.wait_for(_get_json(f"{env.url}/wait_parked/{len(parked)}"), 10)
                # the data pool is exhausted: one more data call cannot even get a connection
                queued = asyncio.create_task(call("GET", f"{env.url}/episodes"))
                done, _ = await asyncio.wait([queued, *slow, *parked], timeout=0.3)
                assert not done, "every data call should still be waiting"
                # control still gets through: commit, publish, resume
                scope = prepared.continued(ALL_KEYS)
                checkpoint_dir = str(tmp_path / "ckpt-pool")
                commits = await asyncio.wait_for(coordinator.commit("pool-1", deadline(), checkpoint_dir, scope), 10)
                await asyncio.wait_for(coordinator.publish(checkpoint_dir, commits), 10)
                statuses = [await _status(coordinator, url) for url in coordinator.servers]
                assert {status["phase"] for status in statuses} == {"committed"}
                assert not queued.done()
                await asyncio.wait_for(coordinator.resume("pool-1", deadline()), 10)
                # resume woke the parked runs; releasing frees the slow ones
                await _post_json(f"{env.url}/release")
                return await asyncio.wait_for(asyncio.gather(*slow, *parked, queued), 10)
            finally:
                await data.close()

    bodies = run(scenario())
    assert bodies[: held // 2] == [{"released": True}] * (held // 2)
    assert [body["key"] for body in bodies[held // 2 : held]] == [f"p{i}" for i in range(held - held // 2)]
    assert verify(str(tmp_path / "ckpt-pool")).ok


# --- restore (K2: all or nothing)


def _checkpoint_from(shared: Fleet, checkpoint_dir: Path, checkpoint_id: str) -> list[str]:
    """Commit and publish a checkpoint of the shared fleet; return its scope."""

    async def scenario() -> list[str]:
        async with Coordinator(urls(shared.servers), token=TOKEN) as coordinator:
            assert (await coordinator.discover()).ok
            prepared = await coordinator.prepare(checkpoint_id, deadline())
            scope = prepared.continued(ALL_KEYS)
            try:
                commits = await coordinator.commit(checkpoint_id, deadline(), str(checkpoint_dir), scope)
                await coordinator.publish(str(checkpoint_dir), commits)
            finally:
                await coordinator.resume(checkpoint_id, deadline())
            return scope

    scope = run(scenario())
    assert verify(str(checkpoint_dir)).ok
    return scope


def test_restore_on_fresh_servers_installs_the_next_attempts(shared: Fleet, fleet: Fleet, tmp_path: Path) -> None:
    checkpoint_dir = tmp_path / "ckpt-restore"
    scope = _checkpoint_from(shared, checkpoint_dir, "source-1")
    shared_state = {server.kind: run(_get_json(f"{server.url}/episodes"))["state"] for server in shared.servers}
    fresh = fleet.start_standard(holding=False)
    cursor = LogCursor(fleet.log)

    async def scenario() -> tuple[Any, list[dict[str, Any]], list[dict[str, Any]], list[Any]]:
        async with Coordinator(urls(fresh), token=TOKEN) as coordinator:
            assert (await coordinator.discover()).ok
            restored = await coordinator.restore("source-1", deadline(), str(checkpoint_dir), scope)
            during = [await _status(coordinator, url) for url in coordinator.servers]
            await coordinator.resume("source-1", deadline())
            after = [await _status(coordinator, url) for url in coordinator.servers]
            held = [await _get_json(f"{url}/episodes") for url in coordinator.servers]
            return restored, during, after, held

    restored, during, after, held = run(scenario())
    assert all(reply.restored == [f"{key}-a1" for key in scope] for reply in restored.values())
    assert all(reply.source_checkpoint_id == "source-1" for reply in restored.values())
    assert {status["phase"] for status in during} == {"restored"}
    assert {status["phase"] for status in after} == {"idle"}
    assert all(status["retired_rollouts"] == len(scope) for status in after)
    for server, episodes in zip(fresh, held, strict=True):
        for key in scope:
            if key in shared_state[server.kind]:
                assert episodes["state"][f"{key}-a1"] == shared_state[server.kind][key]
        assert not any(episodes["refused"][f"{key}-a1"] for key in scope if f"{key}-a1" in episodes["state"])
    for server in fresh:
        ops = cursor.ops(kind=server.kind)
        assert ops.index(f"install {','.join(f'{key}-a1' for key in scope)}") < ops.index("open_admission")


def test_restore_failure_retires_replacements_resumes_everyone_and_raises_its_error(
    shared: Fleet, fleet: Fleet, tmp_path: Path
) -> None:
    checkpoint_dir = tmp_path / "ckpt-restore-fail"
    scope = _checkpoint_from(shared, checkpoint_dir, "source-2")
    fresh = fleet.start_standard(behaviours={"model": ["fail_restore"]}, holding=False)
    failing = next(server for server in fresh if server.kind == "model")
    good = [server for server in fresh if server is not failing]
    replacements = [f"{key}-a1" for key in scope]
    cursor = LogCursor(fleet.log)

    async def scenario() -> tuple[BaseException, list[dict[str, Any]], list[dict[str, Any]]]:
        async with Coordinator(urls(fresh), token=TOKEN) as coordinator:
            assert (await coordinator.discover()).ok
            with pytest.raises(errors.GymckptError) as caught:
                await coordinator.restore("source-2", deadline(), str(checkpoint_dir), scope)
            statuses = [await _status(coordinator, url) for url in coordinator.servers]
            held = [await _get_json(f"{url}/episodes") for url in coordinator.servers]
            return caught.value, statuses, held

    error, statuses, held = run(scenario())
    # the failing server's typed error, not a cleanup error
    assert isinstance(error, errors.StorageError), repr(error)
    assert error.wire_code == "storage_error"  # type: ignore[attr-defined]
    assert error.server == failing.url  # type: ignore[attr-defined]
    assert "injected restore failure" in str(error)
    assert {status["phase"] for status in statuses} == {"idle"}
    for server in good:
        ops = cursor.ops(kind=server.kind)
        install = ops.index(f"install {','.join(replacements)}")
        retire = ops.index(f"retire {','.join(replacements)}")
        resume = ops.index("resume:begin")
        assert install < retire < resume < ops.index("open_admission", resume)
    for server, episodes in zip(fresh, held, strict=True):
        assert not any(key in episodes["state"] for key in replacements), server.kind
        assert episodes["admission_open"]
    # retired callers before callees, then resumed in reverse kind order
    lines = cursor.lines()
    assert _first_index(lines, "environment", "retire:end") < _first_index(lines, "agent", "retire:begin")
    resumed = [kind for kind, _, op in lines if op == "resume:begin"]
    assert resumed == list(reversed(KIND_ORDER))


def test_restore_retried_after_its_rollback_is_stale(shared: Fleet, fleet: Fleet, tmp_path: Path) -> None:
    """C4: a late call naming a resumed checkpoint is stale_checkpoint.

    After a failed coordinated restore rolled back (retire + resume), the good servers
    have resumed the restore's id. Retrying that restore there must not report a
    restore that no longer exists (its state was retired and its attempts are refused).
    """
    checkpoint_dir = tmp_path / "ckpt-restore-retry"
    scope = _checkpoint_from(shared, checkpoint_dir, "source-3")
    fresh = fleet.start_standard(behaviours={"resources": ["fail_restore"]}, holding=False)
    good = [server for server in fresh if server.kind != "resources"]

    async def scenario() -> tuple[Any, list[dict[str, Any]]]:
        async with Coordinator(urls(fresh), token=TOKEN) as coordinator:
            assert (await coordinator.discover()).ok
            with pytest.raises(errors.StorageError):
                await coordinator.restore("source-3", deadline(), str(checkpoint_dir), scope)
        async with Coordinator(urls(good), token=TOKEN) as retry:
            assert (await retry.discover()).ok
            try:
                outcome: Any = await retry.restore("source-3", deadline(), str(checkpoint_dir), scope)
            except errors.GymckptError as exc:
                outcome = exc
            statuses = [await _status(retry, url) for url in retry.servers]
            return outcome, statuses

    outcome, statuses = run(scenario())
    if isinstance(outcome, BaseException):
        assert isinstance(outcome, errors.StaleCheckpoint | errors.CheckpointConflict | errors.InvalidPhase), outcome
    else:
        # a reply claiming "restored" must match what the servers are in
        assert {status["phase"] for status in statuses} == {"restored"}, (outcome, statuses)


def test_control_calls_need_the_token_and_report_typed_errors(shared: Fleet) -> None:
    async def scenario() -> None:
        async with Coordinator(urls(shared.servers[:1]), token="wrong") as coordinator:
            with pytest.raises(errors.Unauthorized):
                await coordinator._call(shared.servers[0].url, "status", None, timeout=5.0)
        async with Coordinator(urls(shared.servers), token=TOKEN) as coordinator:
            assert (await coordinator.discover()).ok
            with pytest.raises(errors.InvalidPhase):
                await coordinator.commit("never-prepared", deadline(), "/tmp/never", ["r1"])
            await coordinator.prepare("typed-1", deadline())
            try:
                with pytest.raises(errors.CheckpointConflict):
                    await coordinator.prepare("typed-2", deadline())
                with pytest.raises(errors.InvalidPhase):
                    await coordinator.retire(["r1"], checkpoint_id="typed-1", deadline_ts=deadline())
            finally:
                await coordinator.resume("typed-1", deadline())
            with pytest.raises(errors.StaleCheckpoint):
                await coordinator.prepare("typed-1", deadline())
        async with Coordinator([*urls(shared.servers), f"http://127.0.0.1:{free_port()}"], token=TOKEN) as partial:
            await partial.discover()
            with pytest.raises(ServerCallFailed):
                await partial._call(partial.servers[-1], "status", None, timeout=2.0)

    run(scenario())
