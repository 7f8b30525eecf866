"""Coordination (K1–K6) against real uvicorn servers on 127.0.0.1.

Most servers are ``tests/control/coord_server.py`` in its own process group: one participant
per server (kinds environment, model, agent, resources), gymckpt's control plane and
routes, configured through environment variables. Each server appends one line per control
operation to a log file shared by all of them (``O_APPEND``), so the tests read the order
in which the servers ran prepare, resume, retire, … on their side. Checkpoints go to a
local directory all processes share.

The reference-shaped servers (``coord_server.build_reference_app``: episode ids as objects
only, the reference's replies) and a server without control routes run under uvicorn in a
thread of the test's process (:func:`gymckpt.testing.net.serve`); the tests read the
bodies they received from their state.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import json
import os
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from gymckpt import errors
from gymckpt.control import coordination
from gymckpt.control.coordination import (
    KIND_ORDER,
    NO_POLICY_MODEL,
    Coordinator,
    ParticipantCommit,
    ParticipantRestore,
    PrepareResult,
    runs_to_await,
)
from gymckpt.control.models import PrepareReply, PrepareReport
from gymckpt.control.settings import CheckpointSettings, load_settings
from gymckpt.errors import CoordinationError, ServerCallFailed
from gymckpt.identity import EpisodeId
from gymckpt.store import open_store, verify
from gymckpt.testing.net import refused_url, serve
from gymckpt.testing.time import run_bounded

from ..support import kill_group, start_uvicorn, uvicorn_port
from .coord_server import ReferenceState, build_non_participant_app, build_reference_app

if TYPE_CHECKING:
    from collections.abc import Iterator

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
    process: subprocess.Popen[bytes]
    stderr: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    #: the port the server bound itself (port 0) and reported; known once ready
    port: int | None = None

    @property
    def url(self) -> str:
        assert self.port is not None, f"the {self.kind} server has not said where it listens yet"
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        kill_group(self.process, timeout=10)


def _drain(server: Server) -> None:
    """Read the server's stderr to the end (so it never blocks on a full pipe); note its port."""
    assert server.process.stderr is not None
    for raw in server.process.stderr:
        line = raw.decode(errors="replace")
        server.stderr.append(line)
        port = uvicorn_port(line)
        if port is not None and server.port is None:
            server.port = port
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
            ["tests.control.coord_server:app", "--host", "127.0.0.1", "--port", "0", "--no-access-log"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        server = Server(kind, instance, process)
        self.servers.append(server)
        threading.Thread(target=_drain, args=(server,), daemon=True).start()
        return server

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        for server in self.servers:
            if not server.ready.wait(max(deadline - time.monotonic(), 0.0)):
                raise AssertionError(f"{server.kind} server not up in {READY_TIMEOUT} s:\n{''.join(server.stderr)}")
            if server.process.poll() is not None or server.port is None:
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
    assert result.skipped == []
    assert result.raise_for_problems() is result
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
    refusing = contextlib.ExitStack()
    down = refusing.enter_context(refused_url())
    silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    good = urls(shared.servers)
    servers = [*good, down, silent_url, hanging.url, strange.url]
    probe_timeout = 1.0

    async def scenario() -> tuple[Any, float]:
        async with Coordinator(
            servers, token=TOKEN, probe_timeout=probe_timeout, probe_retries=3, probe_backoff=0.01
        ) as coordinator:
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
        refusing.close()
    assert [info.url for info in result.participants] == good
    assert set(result.problems) == {down, silent_url, hanging.url, strange.url}
    assert not result.ok
    assert "no reply within" in result.problems[silent_url]
    assert "no reply within" in result.problems[hanging.url]
    assert "unknown participant kind 'sandbox'" in result.problems[strange.url]
    assert down in result.problems[down]
    # the silent servers are probed once each (concurrently): about one probe timeout in all
    assert elapsed < probe_timeout * 2 + 1.0, elapsed
    assert refused.participants == []
    assert "bearer token" in refused.problems[good[0]]
    assert isinstance(refused.causes[good[0]], errors.Unauthorized)
    # all of them as one error
    with pytest.raises(CoordinationError) as raised:
        result.raise_for_problems()
    assert raised.value.operation == "discover"
    assert sorted(raised.value.failures) == sorted(result.problems)
    assert raised.value.failures == result.problems
    assert str(raised.value).startswith("checkpoint discover failed on 4 participant(s): ")


def test_discover_skips_a_server_without_control_routes(shared: Fleet) -> None:
    """A status route answering 404 is no participant: skipped, not a problem, and never called again."""
    with serve(build_non_participant_app()) as other:

        async def scenario() -> tuple[Any, dict[str, Any], list[str]]:
            servers = [*urls(shared.servers), other]
            async with Coordinator(servers, token=TOKEN, probe_timeout=5.0) as coordinator:
                found = await coordinator.discover()
                prepared = await coordinator.prepare("skip-1", deadline())
                resumed = await coordinator.resume("skip-1", deadline())
                return found, {"prepared": prepared.prepared, "resumed": sorted(resumed)}, coordinator.skipped

        found, outcome, skipped = run(scenario())
    assert found.ok, found.problems
    assert found.skipped == [other] == skipped
    assert other not in found.problems
    assert [info.url for info in found.participants] == urls(shared.servers)
    # prepare and resume went to the four participants only (the other server would have answered 404)
    assert outcome == {"prepared": True, "resumed": sorted(urls(shared.servers))}


class _RecordingPauses(Coordinator):
    """A coordinator that records discover's pauses instead of sleeping them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pauses: list[float] = []

    async def _pause(self, seconds: float) -> None:
        self.pauses.append(seconds)


class _ClosingListener:
    """A socket that accepts every connection and closes it at once (a server dropping connections)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            connection.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def test_discover_tries_a_dropped_connection_again_after_a_pause_that_doubles(shared: Fleet) -> None:
    listener = _ClosingListener()

    async def scenario(**options: Any) -> tuple[Any, list[float]]:
        async with _RecordingPauses([listener.url], token=TOKEN, probe_timeout=30.0, **options) as coordinator:
            return await coordinator.discover(), coordinator.pauses

    try:
        # one try: how many connections aiohttp makes for it (it may retry a dropped GET once itself)
        single, no_pauses = run(scenario(probe_retries=1))
        per_try = listener.accepted
        found, pauses = run(scenario())
        tried_by_default = listener.accepted - per_try
        capped, capped_pauses = run(scenario(probe_retries=5, probe_backoff=0.25, probe_backoff_max=0.6))
        tried_capped = listener.accepted - per_try - tried_by_default
    finally:
        listener.close()
    assert per_try in (1, 2)
    assert no_pauses == []
    assert list(single.problems) == [listener.url]
    # three tries in all, the first pause 0.5 s, then doubled
    assert tried_by_default == 3 * per_try
    assert pauses == [0.5, 1.0]
    assert listener.url in found.problems[listener.url]
    assert isinstance(found.causes[listener.url], ServerCallFailed)
    assert tried_capped == 5 * per_try
    assert capped_pauses == [0.25, 0.5, 0.6, 0.6]
    assert list(capped.problems) == [listener.url]


def test_discover_reports_a_deployment_without_a_policy_model(shared: Fleet) -> None:
    without_model = [server.url for server in shared.servers if server.kind != "model"]

    async def scenario() -> tuple[Any, Any]:
        async with Coordinator(without_model, token=TOKEN, probe_timeout=5.0) as coordinator:
            return await coordinator.discover(), await coordinator.discover(require_model=False)

    found, partial = run(scenario())
    assert found.problems == {"deployment": NO_POLICY_MODEL}
    assert [info.kind for info in found.participants] == ["environment", "agent", "resources"]
    with pytest.raises(CoordinationError) as raised:
        found.raise_for_problems()
    assert raised.value.failures == {"deployment": "no policy model takes part in checkpoints"}
    assert partial.ok, partial.problems


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
    assert prepared.prepared and prepared.ready
    assert prepared.stopped_at is None
    assert sorted(prepared.replies) == sorted(urls(shared.servers))
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


def test_retire_and_forget_of_nothing_make_no_call(shared: Fleet) -> None:
    cursor = LogCursor(shared.log)

    async def scenario() -> list[int]:
        async with Coordinator(urls(shared.servers), token=TOKEN) as coordinator:
            # not even discovered: nothing to call anyway
            counts = [
                await coordinator.retire([], checkpoint_id="none-1", deadline_ts=deadline()),
                await coordinator.forget(iter(()), checkpoint_id="none-1", deadline_ts=deadline()),
            ]
            assert (await coordinator.discover()).ok
            counts.append(await coordinator.retire(set(), checkpoint_id="none-1", deadline_ts=deadline()))
            counts.append(await coordinator.forget([], checkpoint_id="none-1", deadline_ts=deadline()))
            return counts

    assert run(scenario()) == [0, 0, 0, 0]
    assert [op for op in cursor.ops() if not op.startswith("status")] == []


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
        assert (reply.kind, reply.instance, reply.checkpoint_id) == (kind, INSTANCES[kind], "commit-1")
        assert reply.manifest_path == f"gym/{kind}/{INSTANCES[kind]}/manifest.json"
        # the reply's manifest is the object written; its sha256 is the file's
        written = (checkpoint_dir / reply.manifest_path).read_bytes()
        assert json.loads(written) == reply.manifest
        assert reply.manifest["episode_ids"] == expected
        assert reply.manifest_sha256 == hashlib.sha256(written).hexdigest()
        assert reply.records_bytes == reply.manifest["records_bytes"]
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
                with pytest.raises(CoordinationError) as caught:
                    await coordinator.commit("restart-1", deadline(), str(tmp_path / "ckpt"), ALL_KEYS)
                agent = shared.servers[2].url
                assert caught.value.operation == "commit"
                assert list(caught.value.causes) == [agent]
                cause = caught.value.causes[agent]
                assert isinstance(cause, errors.RestartInScope)
                assert (cause.server, cause.wire_code, cause.http_status) == (agent, "restart_in_scope", 409)  # type: ignore[attr-defined]
                assert str(caught.value).startswith(f"checkpoint commit failed on 1 participant(s): {agent}: ")
            finally:
                await coordinator.resume("restart-1", deadline())

    run(scenario())


# --- PrepareResult and runs_to_await (K3, K6)


def test_prepare_stops_at_the_first_stage_not_prepared(shared: Fleet, tmp_path: Path) -> None:
    """A model step in flight: agent and resources are never asked (their admission stays open)."""
    model = next(server for server in shared.servers if server.kind == "model")
    later = [server for server in shared.servers if server.kind in ("agent", "resources")]
    cursor = LogCursor(shared.log)

    async def scenario() -> dict[str, Any]:
        async with Coordinator(urls(shared.servers), token=TOKEN) as coordinator:
            assert (await coordinator.discover()).ok
            await _post_json(f"{model.url}/begin/r2")  # a step in flight on the model server
            try:
                blocked = await coordinator.prepare("blocked-1", time.time() + 0.5)
                admission = {
                    server.kind: (await _get_json(f"{server.url}/episodes"))["admission_open"]
                    for server in shared.servers
                }
                # the controller aborts: resume everyone; the stages never asked answer it as a no-op
                aborted = await coordinator.resume("blocked-1", deadline())
                await _post_json(f"{model.url}/finish/r2")
                ready = await coordinator.prepare("blocked-2", deadline())
                commits = await coordinator.commit(
                    "blocked-2", deadline(), str(tmp_path / "ckpt"), ready.continued(ALL_KEYS)
                )
            finally:
                await _post_json(f"{model.url}/finish/r2")
                await coordinator.resume("blocked-2", deadline())
            return {"blocked": blocked, "admission": admission, "aborted": aborted, "ready": ready, "commits": commits}

    outcome = run(scenario())
    blocked, ready = outcome["blocked"], outcome["ready"]
    assert not blocked.prepared and not blocked.ready
    assert blocked.stopped_at == "model"
    assert set(blocked.replies) == {server.url for server in shared.servers if server.kind in ("environment", "model")}
    assert blocked.blockers() == {model.url: ["r2"]}
    assert blocked.replies[model.url].phase == "preparing"
    assert blocked.replies[model.url].report.blocker_count == 1
    assert blocked.restarts() == set()  # the agent, which reports r4, was never asked
    lines = cursor.lines()
    blocked_part = lines[: _first_index(lines, "resources", "resume:begin")]
    assert not [
        line
        for line in blocked_part
        if line[0] in ("agent", "resources") and line[2] != "status:begin" and line[2] != "status:end"
    ]
    assert outcome["admission"] == {"environment": False, "model": False, "agent": True, "resources": True}
    assert {url: reply["idempotent"] for url, reply in outcome["aborted"].items()} == {
        server.url: server in later for server in shared.servers
    }
    assert ready.prepared
    assert ready.blockers() == {}
    assert ready.restarts() == {"r4"}
    assert ready.continued(["r3", "r4", "r1", "r3", "x9"]) == ["r1", "r3", "x9"]
    # the model's r2 finished its step before the cut
    assert outcome["commits"][model.url].episode_ids == ["r1", "r2"]


def _reply(ready: bool, blockers: list[str] = (), restarts: list[str] = ()) -> PrepareReply:  # type: ignore[assignment]
    return PrepareReply(
        phase="prepared" if ready else "preparing",
        report=PrepareReport(
            ready=ready, blockers=list(blockers), blocker_count=len(blockers), restarts=list(restarts)
        ),
    )


def test_prepare_result_and_runs_to_await_as_documented() -> None:
    result = PrepareResult(
        False,
        {
            "http://a": _reply(True, restarts=["r4", "r5-a1"]),
            "http://b": _reply(False, blockers=["r2"], restarts=["r4"]),
            "http://c": _reply(True),
        },
    )
    assert not result.ready
    assert result.blockers() == {"http://b": ["r2"]}
    assert result.restarts() == {"r4", "r5-a1"}
    assert result.continued(["r1", "r2", "r4", "r5-a1", "r5", "r1"]) == ["r1", "r2", "r5"]
    # episode ids as objects or EpisodeId as well; keys come back
    assert result.continued([{"rollout_id": "r5", "attempt": 1}, {"rollout_id": "r6"}, EpisodeId("r7", 2)]) == [
        "r6",
        "r7-a2",
    ]
    assert result.continued([]) == []
    assert PrepareResult(True, {"http://a": _reply(True)}).ready
    # a reply not prepared is a blocker entry even when it names no key (its list is what the server sent)
    assert PrepareResult(False, {"http://a": _reply(False)}).blockers() == {"http://a": []}
    # blocker lists are as the server capped them; the count says how many there were
    capped = PrepareResult(
        False,
        {
            "http://a": PrepareReply(
                phase="preparing",
                report=PrepareReport(ready=False, blockers=[f"k{i}" for i in range(100)], blocker_count=250),
            )
        },
    )
    assert len(capped.blockers()["http://a"]) == 100
    # K6: wait only for outstanding runs that are neither committed nor restarts
    assert runs_to_await(["r1", "r2", "r3", "r4"], committed=["r1"], restarts=["r4"]) == ["r2", "r3"]
    assert runs_to_await(["b", "a"], committed=[], restarts=[]) == ["a", "b"]
    assert runs_to_await([], committed=["a"], restarts=["b"]) == []
    assert runs_to_await(["a-a1", "a"], committed=["a"], restarts=[]) == ["a-a1"]
    assert runs_to_await(iter(["x", "y"]), committed=iter(["y"]), restarts=iter(["x"])) == []


def test_commit_and_restore_replies_of_every_shape_parse() -> None:
    """The reference's ``{phase, manifest, episode_ids}``, gymckpt's reply with its extra keys, the old flat one."""
    manifest = {
        "schema_version": 1,
        "kind": "model",
        "instance": "m0",
        "checkpoint_id": "c1",
        "records_file": "records-" + "0" * 64 + ".jsonl",
        "records_sha256": "0" * 64,
        "record_count": 2,
    }
    reference = ParticipantCommit.model_validate(
        {
            "phase": "committed",
            "manifest": manifest,
            "episode_ids": ["a", {"rollout_id": "b", "attempt": 1}],
            "staging_keys": [],
        }
    )
    assert (reference.kind, reference.instance, reference.checkpoint_id) == ("model", "m0", "c1")
    assert reference.episode_ids == ["a", "b-a1"]
    assert reference.record_count == 2
    assert reference.records_bytes is None and reference.manifest_sha256 is None
    assert reference.manifest_path == "gym/model/m0/manifest.json"
    assert reference.model_extra == {"staging_keys": []}
    gymckpt_reply = ParticipantCommit.model_validate(
        {
            "phase": "committed",
            "manifest": {**manifest, "records_bytes": 10, "episode_ids": ["a", "b-a1"], "writer": "gymckpt x"},
            "episode_ids": ["a", "b-a1"],
            "kind": "model",
            "instance": "m0",
            "manifest_path": "gym/model/m0/manifest.json",
            "manifest_sha256": "f" * 64,
            "records_bytes": 10,
            "checkpoint_dir": "/x",
        }
    )
    assert (gymckpt_reply.records_bytes, gymckpt_reply.manifest_sha256) == (10, "f" * 64)
    assert gymckpt_reply.model_extra == {"checkpoint_dir": "/x"}
    flat = ParticipantCommit.model_validate(
        {
            "phase": "committed",
            "kind": "env",
            "instance": "e0",
            "checkpoint_id": "c1",
            "checkpoint_dir": "/x",
            "manifest": "gym/env/e0/manifest.json",
            "manifest_sha256": "e" * 64,
            "records_file": "records-x.jsonl",
            "record_count": 1,
            "records_bytes": 5,
            "episode_ids": ["a"],
        }
    )
    assert flat.manifest_path == "gym/env/e0/manifest.json"
    assert flat.manifest["record_count"] == 1 and flat.kind == "env"
    with pytest.raises(ValueError, match="manifest"):
        ParticipantCommit.model_validate({"phase": "committed", "episode_ids": []})
    restored = ParticipantRestore.model_validate(
        {"phase": "restored", "source_checkpoint_id": "c1", "restored": ["a-a1", {"rollout_id": "b", "attempt": 2}]}
    )
    assert restored.restored == ["a-a1", "b-a2"]


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
    for server in fresh:
        # each server lists the attempts it installed a record for
        installed = [f"{key}-a1" for key in scope if key in EPISODES[server.kind]]
        assert restored[server.url].restored == installed, server.kind
        assert restored[server.url].source_checkpoint_id == "source-1"
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
            with pytest.raises(CoordinationError) as caught:
                await coordinator.restore("source-2", deadline(), str(checkpoint_dir), scope)
            statuses = [await _status(coordinator, url) for url in coordinator.servers]
            held = [await _get_json(f"{url}/episodes") for url in coordinator.servers]
            return caught.value, statuses, held

    raised, statuses, held = run(scenario())
    # the restore's error, naming the failing server with its typed error; not a cleanup error
    assert raised.operation == "restore"
    assert list(raised.causes) == [failing.url]
    error = raised.causes[failing.url]
    assert isinstance(error, errors.StorageError), repr(error)
    assert error.wire_code == "storage_error"  # type: ignore[attr-defined]
    assert error.server == failing.url  # type: ignore[attr-defined]
    assert "injected restore failure" in str(error)
    assert "injected restore failure" in raised.failures[failing.url]
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
            with pytest.raises(CoordinationError) as failed:
                await coordinator.restore("source-3", deadline(), str(checkpoint_dir), scope)
            assert [type(cause) for cause in failed.value.causes.values()] == [errors.StorageError]
        async with Coordinator(urls(good), token=TOKEN) as retry:
            assert (await retry.discover()).ok
            try:
                outcome: Any = await retry.restore("source-3", deadline(), str(checkpoint_dir), scope)
            except CoordinationError as exc:
                outcome = exc
            statuses = [await _status(retry, url) for url in retry.servers]
            return outcome, statuses

    outcome, statuses = run(scenario())
    if isinstance(outcome, BaseException):
        for cause in outcome.causes.values():
            assert isinstance(cause, errors.StaleCheckpoint | errors.CheckpointConflict | errors.InvalidPhase), cause
    else:
        # a reply claiming "restored" must match what the servers are in
        assert {status["phase"] for status in statuses} == {"restored"}, (outcome, statuses)


def _causes(raised: CoordinationError) -> dict[str, type]:
    return {server: type(cause) for server, cause in raised.causes.items()}


def test_control_calls_need_the_token_and_report_typed_errors(shared: Fleet) -> None:
    everyone = urls(shared.servers)
    environment = everyone[0]

    async def scenario() -> None:
        async with Coordinator(urls(shared.servers[:1]), token="wrong") as coordinator:
            with pytest.raises(errors.Unauthorized):
                await coordinator._call(environment, "status", None, timeout=5.0)
        async with Coordinator(everyone, token=TOKEN) as coordinator:
            assert (await coordinator.discover()).ok
            # one error naming every failing server, each cause typed by its wire code
            with pytest.raises(CoordinationError) as raised:
                await coordinator.commit("never-prepared", deadline(), "/tmp/never", ["r1"])
            assert raised.value.operation == "commit"
            assert _causes(raised.value) == dict.fromkeys(sorted(everyone), errors.InvalidPhase)
            assert list(raised.value.failures) == sorted(everyone)
            assert str(raised.value).startswith("checkpoint commit failed on 4 participant(s): ")
            await coordinator.prepare("typed-1", deadline())
            try:
                # the first stage fails: no later stage is asked
                with pytest.raises(CoordinationError) as raised:
                    await coordinator.prepare("typed-2", deadline())
                assert _causes(raised.value) == {environment: errors.CheckpointConflict}
                with pytest.raises(CoordinationError) as raised:
                    await coordinator.retire(["r1"], checkpoint_id="typed-1", deadline_ts=deadline())
                assert _causes(raised.value) == {environment: errors.InvalidPhase}
            finally:
                await coordinator.resume("typed-1", deadline())
            with pytest.raises(CoordinationError) as raised:
                await coordinator.prepare("typed-1", deadline())
            assert _causes(raised.value) == {environment: errors.StaleCheckpoint}
        with refused_url() as down:
            async with Coordinator([*everyone, down], token=TOKEN) as partial:
                await partial.discover()
                with pytest.raises(ServerCallFailed):
                    await partial._call(partial.servers[-1], "status", None, timeout=2.0)
                # a server that failed discover is not silently left out
                with pytest.raises(errors.InvalidPhase, match="not discovered"):
                    await partial.prepare("typed-3", deadline())

    run(scenario())


def test_a_restore_failing_on_two_servers_names_both(shared: Fleet, fleet: Fleet, tmp_path: Path) -> None:
    checkpoint_dir = tmp_path / "ckpt-restore-two"
    scope = _checkpoint_from(shared, checkpoint_dir, "source-4")
    fresh = fleet.start_standard(behaviours={"model": ["fail_restore"], "resources": ["fail_restore"]}, holding=False)
    failing = sorted(server.url for server in fresh if server.kind in ("model", "resources"))

    async def scenario() -> tuple[CoordinationError, list[dict[str, Any]]]:
        async with Coordinator(urls(fresh), token=TOKEN) as coordinator:
            assert (await coordinator.discover()).ok
            with pytest.raises(CoordinationError) as raised:
                await coordinator.restore("source-4", deadline(), str(checkpoint_dir), scope)
            return raised.value, [await _status(coordinator, url) for url in coordinator.servers]

    raised, statuses = run(scenario())
    assert _causes(raised) == dict.fromkeys(failing, errors.StorageError)
    assert str(raised).startswith("checkpoint restore failed on 2 participant(s): ")
    assert {status["phase"] for status in statuses} == {"idle"}


def test_resume_goes_through_every_stage_and_raises_every_failure_at_the_end(fleet: Fleet) -> None:
    servers = fleet.start_standard()
    agent = next(server for server in servers if server.kind == "agent")
    others = [server for server in servers if server is not agent]
    cursor = LogCursor(fleet.log)

    async def scenario() -> tuple[CoordinationError, list[dict[str, Any]]]:
        async with Coordinator(urls(servers), token=TOKEN) as coordinator:
            assert (await coordinator.discover()).ok
            assert (await coordinator.prepare("resume-1", deadline())).prepared
            agent.kill()
            with pytest.raises(CoordinationError) as raised:
                await coordinator.resume("resume-1", deadline())
            return raised.value, [await _status(coordinator, server.url) for server in others]

    raised, statuses = run(scenario())
    assert raised.operation == "resume"
    assert _causes(raised) == {agent.url: ServerCallFailed}
    assert {status["phase"] for status in statuses} == {"idle"}
    resumed = [kind for kind, _, op in cursor.lines() if op == "open_admission"]
    assert resumed == ["resources", "model", "environment"]


# --- the wire: object ids, each body encoded once, the reference's shapes


@contextlib.contextmanager
def reference_fleet(*, holding: bool = True) -> Iterator[tuple[dict[str, str], dict[str, ReferenceState], str]]:
    """One reference-shaped server per kind and a server without control routes, each under uvicorn in a thread.

    Yields each kind's URL, each kind's :class:`ReferenceState`, and the other server's URL.
    """
    with contextlib.ExitStack() as servers:
        found: dict[str, str] = {}
        held: dict[str, ReferenceState] = {}
        for kind in KIND_ORDER:
            app = build_reference_app(
                kind,
                INSTANCES[kind],
                TOKEN,
                episodes=EPISODES[kind] if holding else [],
                restarts=RESTARTS.get(kind, []),
            )
            found[kind] = servers.enter_context(serve(app, graceful_shutdown=5.0))
            held[kind] = app.state.reference
        other = servers.enter_context(serve(build_non_participant_app(), graceful_shutdown=5.0))
        yield found, held, other


def _received(held: ReferenceState, op: str) -> list[Any]:
    return [body for received, body in held.requests if received == op]


def _objects(*keys: str) -> list[dict[str, Any]]:
    return [EpisodeId.from_capture_key(key).to_wire() for key in keys]


def test_the_coordinator_drives_servers_that_speak_only_the_reference_shapes(tmp_path: Path) -> None:
    """discover, prepare (stopping early, then ready), commit(stop=True), publish, resume; restore, retire, forget."""
    checkpoint_dir = tmp_path / "ckpt-reference"
    with reference_fleet() as (url_of, held, other):
        servers = [*url_of.values(), other]

        async def checkpoint() -> dict[str, Any]:
            async with Coordinator(servers, token=TOKEN, probe_timeout=10.0) as gym:
                found = await gym.discover()
                held["model"].busy.add("r2")
                blocked = await gym.prepare("ref-0", deadline())
                aborted = await gym.resume("ref-0", deadline())
                held["model"].busy.clear()
                prepared = await gym.prepare("ref-1", deadline())
                scope = prepared.continued(ALL_KEYS)
                commits = await gym.commit("ref-1", deadline(), str(checkpoint_dir), scope, stop=True)
                document = await gym.publish(str(checkpoint_dir), commits)
                resumed = await gym.resume("ref-1", deadline())
                return {
                    "found": found,
                    "blocked": blocked,
                    "aborted": aborted,
                    "prepared": prepared,
                    "scope": scope,
                    "commits": commits,
                    "document": document,
                    "resumed": resumed,
                }

        outcome = run(checkpoint())
    found, blocked, prepared = outcome["found"], outcome["blocked"], outcome["prepared"]
    assert found.ok, found.problems
    assert found.skipped == [other]
    assert [info.kind for info in found.participants] == list(KIND_ORDER)
    # prepare stopped at the model: agent and resources saw a resume of ref-0 but never its prepare
    assert (blocked.prepared, blocked.stopped_at, blocked.blockers()) == (False, "model", {url_of["model"]: ["r2"]})
    for kind in ("agent", "resources"):
        assert [body["checkpoint_id"] for body in _received(held[kind], "prepare")] == ["ref-1"], kind
    assert {url: reply["idempotent"] for url, reply in outcome["aborted"].items()} == {
        url_of["environment"]: False,
        url_of["model"]: False,
        url_of["agent"]: True,
        url_of["resources"]: True,
    }
    assert prepared.prepared and prepared.restarts() == {"r4"}
    assert outcome["scope"] == ["r1", "r2", "r3"]
    # the commit body: episode ids as objects, stop sent
    for kind in KIND_ORDER:
        (body,) = _received(held[kind], "commit")
        assert body["episode_ids"] == _objects("r1", "r2", "r3")
        assert body["stop"] is True
        assert body["checkpoint_dir"] == str(checkpoint_dir)
    # the reference's commit reply: kind and instance from the manifest, no sha256, extras kept
    for kind, url in url_of.items():
        reply = outcome["commits"][url]
        assert set(reply.model_dump()) >= {"phase", "manifest", "episode_ids"}
        assert (reply.kind, reply.instance, reply.checkpoint_id) == (kind, INSTANCES[kind], "ref-1")
        assert reply.manifest_sha256 is None
        assert reply.manifest_path == f"gym/{kind}/{INSTANCES[kind]}/manifest.json"
        assert reply.episode_ids == sorted(set(EPISODES[kind]) & {"r1", "r2", "r3"})
        assert reply.model_extra == ({"staging_keys": []} if kind == "model" else {})
    assert {entry["kind"] for entry in outcome["document"]["participants"]} == set(KIND_ORDER)
    assert verify(str(checkpoint_dir)).ok
    assert {reply["idempotent"] for reply in outcome["resumed"].values()} == {False}

    with reference_fleet(holding=False) as (url_of, held, other):

        async def restore() -> tuple[dict[str, Any], int, int]:
            async with Coordinator([*url_of.values(), other], token=TOKEN, probe_timeout=10.0) as gym:
                assert (await gym.discover()).ok
                restored = await gym.restore("ref-1", deadline(), str(checkpoint_dir), outcome["scope"])
                await gym.resume("ref-1", deadline())
                retired = await gym.retire(
                    ["r1-a1", {"rollout_id": "r2", "attempt": 1}, EpisodeId("r3", 1)],
                    checkpoint_id="retire-ref",
                    deadline_ts=deadline(),
                )
                forgotten = await gym.forget(
                    ["r2", "r1", "r2", "r3"], checkpoint_id="retire-ref", deadline_ts=deadline()
                )
                return restored, retired, forgotten

        restored, retired, forgotten = run(restore())
    for kind, url in url_of.items():
        (body,) = _received(held[kind], "restore")
        assert body["episode_ids"] == _objects("r1", "r2", "r3")
        assert restored[url].restored == [f"{key}-a1" for key in ("r1", "r2", "r3") if key in EPISODES[kind]]
        assert restored[url].source_checkpoint_id == "ref-1"
        (body,) = _received(held[kind], "retire")
        assert body["episode_ids"] == _objects("r1-a1", "r2-a1", "r3-a1")
        (body,) = _received(held[kind], "forget")
        assert body["rollout_ids"] == ["r1", "r2", "r3"]
    # counts from the reference's lists: three attempts, three rollouts, on four servers
    assert (retired, forgotten) == (12, 12)


def test_a_reference_servers_bare_422_is_a_typed_failure_with_its_status() -> None:
    """FastAPI's own ``{"detail": [...]}`` (no envelope): InvalidRequest, with the status, not a crash."""
    with reference_fleet() as (url_of, _held, _other):
        environment = url_of["environment"]

        async def scenario() -> tuple[BaseException, CoordinationError]:
            async with Coordinator(list(url_of.values()), token=TOKEN, probe_timeout=10.0) as gym:
                key_body = json.dumps({"checkpoint_id": "x", "deadline_ts": deadline(), "episode_ids": ["r1"]})
                with pytest.raises(errors.InvalidRequest) as direct:
                    await gym._call(environment, "retire", key_body.encode(), timeout=5.0)
                assert (await gym.discover()).ok
                with pytest.raises(CoordinationError) as fanned:
                    await gym.prepare("not a valid id!", deadline())
                return direct.value, fanned.value

        direct, fanned = run(scenario())
    # a capture-key string is refused by a reference server: why the bodies carry objects
    assert (direct.http_status, direct.wire_code, direct.server) == (422, None, environment)  # type: ignore[attr-defined]
    assert str(direct).startswith(f"{environment}: retire answered 422: ")
    assert '"loc":["body","episode_ids",0]' in str(direct)
    assert _causes(fanned) == {environment: errors.InvalidRequest}
    assert "answered 422" in fanned.failures[environment]


def test_each_operation_encodes_its_body_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    encoded: list[dict[str, Any]] = []
    original = coordination.encode_body

    def counting(body: dict[str, Any]) -> bytes:
        encoded.append(body)
        return original(body)

    monkeypatch.setattr(coordination, "encode_body", counting)
    with reference_fleet() as (url_of, held, _other):

        async def scenario() -> dict[str, int]:
            async with Coordinator(list(url_of.values()), token=TOKEN, probe_timeout=10.0) as gym:
                assert (await gym.discover()).ok
                counts = {}
                for name, operation in (
                    ("prepare", gym.prepare("enc-1", deadline())),
                    ("commit", gym.commit("enc-1", deadline(), str(tmp_path / "ckpt"), ["r1", "r2"])),
                    ("resume", gym.resume("enc-1", deadline())),
                    ("retire", gym.retire(["r1-a1"], checkpoint_id="enc-2", deadline_ts=deadline())),
                    ("forget", gym.forget(["r1"], checkpoint_id="enc-2", deadline_ts=deadline())),
                ):
                    before = len(encoded)
                    await operation
                    counts[name] = len(encoded) - before
                return counts

        counts = run(scenario())
    # prepare and resume run four stages, retire and forget three groups: still one encoding each
    assert counts == dict.fromkeys(("prepare", "commit", "resume", "retire", "forget"), 1)
    for op in ("prepare", "commit", "resume", "retire", "forget"):
        bodies = [_received(held[kind], op) for kind in KIND_ORDER]
        assert all(received == bodies[0] for received in bodies), op
        assert len(bodies[0]) == 1, op


# --- settings (K4: the control pool's size)


def test_from_settings_sizes_the_control_pool_and_takes_the_token(shared: Fleet) -> None:
    settings = CheckpointSettings(
        enabled=True,
        control_auth_token=TOKEN,
        control_connector_limit=3,
        control_connector_limit_per_host=2,
    )

    async def pool_of(coordinator: Coordinator) -> tuple[int, int]:
        async with coordinator:
            connector = coordinator._client().connector
            assert connector is not None
            return connector.limit, connector.limit_per_host

    async def scenario() -> tuple[Any, tuple[int, int], float]:
        async with Coordinator.from_settings(urls(shared.servers), settings, probe_timeout=5.0) as coordinator:
            connector = coordinator._client().connector
            assert connector is not None
            return await coordinator.discover(), (connector.limit, connector.limit_per_host), coordinator.probe_timeout

    found, limits, probe_timeout = run(scenario())
    assert found.ok, found.problems  # the token came from the settings
    assert limits == (3, 2)
    assert probe_timeout == 5.0  # an override
    loaded = load_settings({"checkpoint": {"enabled": True, "control_auth_token": TOKEN, "control_connector_limit": 4}})
    assert run(pool_of(Coordinator.from_settings([], loaded))) == (4, 0)
    # a config mapping: the checkpoint block, and the reference stack's top-level names
    config = {
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "storage_options": {"anon": True}},
        "global_aiohttp_control_connector_limit": 7,
        "global_aiohttp_control_connector_limit_per_host": 1,
    }
    from_config = Coordinator.from_settings([], config)
    assert run(pool_of(from_config)) == (7, 1)
    assert from_config.storage_options == {"anon": True}
    agreeing = {**config, "checkpoint": {**config["checkpoint"], "control_connector_limit": 7}}
    assert run(pool_of(Coordinator.from_settings([], agreeing))) == (7, 1)
    clashing = {**config, "checkpoint": {**config["checkpoint"], "control_connector_limit": 3}}
    with pytest.raises(ValueError, match="control_connector_limit"):
        Coordinator.from_settings([], clashing)
    with pytest.raises(ValueError, match="global_aiohttp_control_connector_limit"):
        Coordinator.from_settings([], {**config, "global_aiohttp_control_connector_limit": -1})
    with pytest.raises(ValueError, match="control_auth_token"):
        Coordinator.from_settings([], CheckpointSettings())
    assert run(pool_of(Coordinator.from_settings([], CheckpointSettings(), token="given"))) == (0, 0)
    with pytest.raises(TypeError):
        Coordinator.from_settings([], "checkpoint.yaml")
