"""A seeded random sequence of operations over one real counter server whose worker count changes at every restart.

One ``gymckpt serve counter --workers N`` deployment (a :class:`~gymckpt.stack.Stack` of one
server, kept for the module; every test starts it afresh and kills it in a ``finally``) is
driven by a ``random.Random(seed)`` through at least 200 operations, chosen by weight among
those that apply:

- ``seed``: a new session; ``step``: increment a live session by a random ``n``;
- ``end``: ``/close_session`` or ``/verify`` of the model's count (reward 1.0);
- ``checkpoint``: prepare, commit with the live sessions as the scope, resume; the committed
  sessions and counts become the last checkpoint;
- ``crash``: SIGKILL of the server's whole process group, a start with another worker count
  (1..3), restore of the last checkpoint (nothing when there is none), resume. The model's
  live sessions become the last checkpoint's under their next-attempt keys, with their
  committed counts: steps after the last checkpoint are lost by design;
- ``retire``: retire one live session; its next increments are refused (409 ``stale_attempt``).

A plain model (dicts) predicts every reply. After each operation, where it applies:

- every increment returns the model's count + ``n``, so the first one of a restored session
  returns its committed count + ``n``: nothing lost, nothing run twice past its boundary;
- a commit's ``episode_ids`` and the records read back from the store are exactly the scope,
  each record holding the model's ``{"count", "calls"}``; the directory verifies;
- a restore's ``restored`` lists exactly the next-attempt keys of the last checkpoint;
- the status is idle, its ``workers`` is the chosen count and it holds the model's sessions.

The seed is in the test id; a failure prints the seed, the operation log and the server log's tail.
No sleeps: every wait is a bounded poll whose pace is its own round trip.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from gymckpt.control.routes import CONTROL_PREFIX
from gymckpt.identity import EpisodeId
from gymckpt.stack import load_stack
from gymckpt.store import open_store, verify
from gymckpt.workers.routing import COOKIE_NAME

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from gymckpt.stack import Stack

TOKEN = "random-workers-token"
NAME = "counter"
INSTANCE = "counter-0"
#: the bound of any single request or wait (seconds)
WAIT = 60.0
#: the bound of one whole run (seconds)
RUN_BOUND = 240.0
WORKER_COUNTS = (1, 2, 3)
#: relative weights of the operations (among those that apply)
WEIGHTS = {"seed": 20, "step": 45, "end": 8, "checkpoint": 10, "crash": 2, "retire": 5}
#: operations that need a live session
NEED_LIVE = frozenset({"step", "end", "retire"})
#: server log lines shown with a failure
LOG_TAIL = 40


def next_key(key: str) -> str:
    """The capture key of the attempt that replaces ``key`` (``r7`` → ``r7-a1`` → ``r7-a2``)."""
    return EpisodeId.from_capture_key(key).next_attempt().capture_key


@dataclass
class Deployment:
    """The module's one-server stack and the directory checkpoints may be written under."""

    stack: Stack
    root: Path

    @property
    def url(self) -> str:
        return self.stack.urls[NAME]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("random-workers")
    (root / "stack").mkdir()
    spec = {
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "allowed_roots": [str(root)]},
        "servers": [{"name": NAME, "kind": "counter", "workers": 1, "config": {"instance": INSTANCE}}],
    }
    stack = load_stack(spec, workdir=root / "stack")
    try:
        yield Deployment(stack, root)
    finally:
        stack.close()


@dataclass
class Live:
    """A live session as the model sees it."""

    count: int = 0
    calls: int = 0
    cookie: str | None = None
    #: restored by the last crash and not incremented since
    restored: bool = False


@dataclass
class Saved:
    """The last checkpoint: its id, directory and committed ``(count, calls)`` by capture key."""

    checkpoint_id: str
    directory: str
    sessions: dict[str, tuple[int, int]]


@dataclass
class RandomRun:
    """One seeded run against the deployment, with its model and operation log."""

    deployment: Deployment
    seed: int
    operations: int
    directory: Path
    rng: random.Random = field(init=False)
    workers: int = 0
    live: dict[str, Live] = field(default_factory=dict)
    last: Saved | None = None
    log: list[str] = field(default_factory=list)
    seen: Counter[str] = field(default_factory=Counter)
    _http: aiohttp.ClientSession | None = None
    _ids: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    # --- http

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            # a connection per request (none outlives a crash); cookies are kept by hand, per session
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True),
                timeout=aiohttp.ClientTimeout(total=WAIT),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def rollout(
        self, key: str, route: str, body: dict[str, Any], *, cookie: bool = True
    ) -> tuple[int, dict[str, Any]]:
        """POST ``/ng-rollout/<key>/<route>`` (with the session's cookie); keep the cookie its reply sets."""
        session = self.live.get(key)
        headers = {}
        if cookie and session is not None and session.cookie is not None:
            headers["Cookie"] = f"{COOKIE_NAME}={session.cookie}"
        url = f"{self.deployment.url}/ng-rollout/{key}/{route}"
        async with self.http.post(url, json=body, headers=headers) as response:
            payload = await response.json()
            stamped = response.cookies.get(COOKIE_NAME)
            if stamped is not None and session is not None:
                session.cookie = stamped.value
            return response.status, payload

    async def control(self, operation: str, body: dict[str, Any]) -> dict[str, Any]:
        """A control call that must succeed; its reply body."""
        url = f"{self.deployment.url}{CONTROL_PREFIX}/{operation}"
        body = {**body, "deadline_ts": time.time() + WAIT}
        async with self.http.post(url, json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as response:
            payload = await response.json()
            assert response.status == 200, (operation, body, response.status, payload)
            return payload  # type: ignore[no-any-return]

    async def status(self) -> dict[str, Any]:
        url = f"{self.deployment.url}{CONTROL_PREFIX}/status"
        async with self.http.get(url, headers={"Authorization": f"Bearer {TOKEN}"}) as response:
            payload = await response.json()
            assert response.status == 200, payload
            return payload  # type: ignore[no-any-return]

    # --- the deployment

    async def start(self, workers: int) -> None:
        """Start the server with ``workers`` workers; wait (bounded) until every one has linked."""
        self.deployment.stack.start([NAME], workers=workers)
        self.workers = workers
        deadline = time.monotonic() + WAIT
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            status = await self.status()  # each poll awaits its round trip: nothing else paces the loop
            if linked(status) == workers:
                return
        raise AssertionError(f"{workers} workers never linked within {WAIT} s: {status}")

    async def kill(self) -> None:
        """SIGKILL the server's process group and reap it (in a thread: the loop goes on)."""
        await asyncio.to_thread(self.deployment.stack.kill, [NAME])

    # --- the run

    async def run(self) -> None:
        await self.kill()
        await self.start(self.rng.choice(WORKER_COUNTS))
        self.note(f"start workers={self.workers}")
        for index in range(self.operations):
            choices = [op for op in WEIGHTS if self.live or op not in NEED_LIVE]
            operation = self.rng.choices(choices, weights=[WEIGHTS[op] for op in choices])[0]
            self.seen[operation] += 1
            await getattr(self, f"op_{operation}")(index)
            await self.check_status()

    def note(self, line: str) -> None:
        self.log.append(line)

    def pick(self) -> str:
        return self.rng.choice(sorted(self.live))

    async def op_seed(self, index: int) -> None:
        self._ids += 1
        key = f"s{self._ids}"
        self.live[key] = Live()
        status, body = await self.rollout(key, "seed_session", {"task_input": {}})
        self.note(f"{index} seed {key} -> {status} {body}")
        assert status == 200, body
        assert body == {"session": key}

    async def op_step(self, index: int) -> None:
        key = self.pick()
        session = self.live[key]
        n = self.rng.randint(1, 9)
        status, body = await self.rollout(key, "increment", {"n": n})
        first = " (first after restore)" if session.restored else ""
        self.note(f"{index} step {key} +{n} -> {status} {body}; model {session.count}{first}")
        assert status == 200, body
        # for a restored session's first increment: the committed count + n (nothing lost, nothing run twice)
        assert body == {"count": session.count + n}, (key, session)
        if session.restored:
            self.seen["first increment after restore"] += 1
        session.count += n
        session.calls += 1
        session.restored = False

    async def op_end(self, index: int) -> None:
        key = self.pick()
        session = self.live[key]
        if self.rng.random() < 0.5:
            status, body = await self.rollout(key, "close_session", {})
            self.note(f"{index} close {key} -> {status} {body}")
            assert (status, body) == (200, {"closed": True})
        else:
            status, body = await self.rollout(key, "verify", {"response": "", "expected": session.count})
            self.note(f"{index} verify {key} expected {session.count} -> {status} {body}")
            assert (status, body) == (200, {"reward": 1.0}), (key, session)
        del self.live[key]

    async def op_checkpoint(self, index: int) -> None:
        checkpoint_id = f"ck-{self.seed}-{index}"
        directory = str(self.directory / checkpoint_id)
        scope = sorted(self.live)
        ids = {"checkpoint_id": checkpoint_id}
        self.note(f"{index} checkpoint {checkpoint_id} scope {scope}")
        prepared = await self.control("prepare", ids)
        assert prepared["phase"] == "prepared", prepared
        assert prepared["report"]["ready"] is True, prepared
        commit = await self.control("commit", {**ids, "checkpoint_dir": directory, "episode_ids": scope})
        self.note(f"{index}   committed {commit['episode_ids']}")
        assert commit["phase"] == "committed", commit
        assert (commit["kind"], commit["instance"]) == ("resources", INSTANCE), commit
        assert commit["episode_ids"] == scope, "the commit left out (or added) an episode of its scope"
        expected = {key: {"count": self.live[key].count, "calls": self.live[key].calls} for key in scope}
        assert read_states(directory) == expected, "the checkpoint's records are not the committed sessions"
        report = verify(directory)
        assert report.ok, report.errors
        resumed = await self.control("resume", ids)
        assert (resumed["phase"], resumed["idempotent"]) == ("idle", False), resumed
        self.last = Saved(
            checkpoint_id, directory, {key: (self.live[key].count, self.live[key].calls) for key in scope}
        )

    async def op_crash(self, index: int) -> None:
        workers = self.rng.choice([count for count in WORKER_COUNTS if count != self.workers])
        self.note(f"{index} crash workers {self.workers}->{workers}")
        self.seen[f"crash {self.workers}->{workers}"] += 1
        await self.kill()
        await self.start(workers)
        last = self.last
        if last is None:
            resumed = await self.control("resume", {"checkpoint_id": f"nothing-{self.seed}-{index}"})
            assert resumed["idempotent"] is True, resumed
            self.live = {}
            self.note(f"{index}   nothing to restore")
            return
        ids = {"checkpoint_id": last.checkpoint_id}
        scope = sorted(last.sessions)
        restored = await self.control("restore", {**ids, "checkpoint_dir": last.directory, "episode_ids": scope})
        self.note(f"{index}   restore {last.checkpoint_id} {scope} -> {restored}")
        assert restored["phase"] == "restored", restored
        assert restored["source_checkpoint_id"] == last.checkpoint_id, restored
        assert restored["restored"] == sorted(next_key(key) for key in scope), "restored other keys than committed"
        resumed = await self.control("resume", ids)
        assert (resumed["phase"], resumed["idempotent"]) == ("idle", False), resumed
        self.live = {
            next_key(key): Live(count=count, calls=calls, restored=True)
            for key, (count, calls) in last.sessions.items()
        }
        if scope:
            self.seen["restore of sessions"] += 1

    async def op_retire(self, index: int) -> None:
        key = self.pick()
        self.note(f"{index} retire {key}")
        retired = await self.control("retire", {"checkpoint_id": f"retire-{self.seed}-{index}", "episode_ids": [key]})
        assert retired["retired"] == [key], retired
        # with the session's cookie (its owner), then without (whichever worker takes it): refused both times
        refusals = [await self.rollout(key, "increment", {"n": 1}, cookie=cookie) for cookie in (True, False)]
        self.note(f"{index}   retired {retired['retired']}; increments -> {refusals}")
        for status, body in refusals:
            assert status == 409, body
            assert body["error"]["code"] == "stale_attempt", body
        self.seen["retired attempt refused"] += 1
        del self.live[key]

    async def check_status(self) -> None:
        status = await self.status()
        assert status["phase"] == "idle", status
        assert linked(status) == self.workers, status
        assert status["report"]["counts"]["sessions"] == len(self.live), ("the server holds other sessions", status)

    def server_log(self) -> str:
        path = self.deployment.stack.servers[NAME].log_path
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return "\n".join(lines[-LOG_TAIL:]) or "(empty)"


def linked(status: dict[str, Any]) -> int:
    """How many workers a status reports, once all it expects have linked (-1 before; one process: 1)."""
    workers = int(status.get("workers", 1))
    return workers if workers == int(status.get("expected_workers", workers)) else -1


def read_states(directory: str) -> dict[str, Any]:
    """The counter's records in ``directory``: state by capture key."""
    store = open_store(directory)
    try:
        records = list(store.read_participant("", kind="resources", instance=INSTANCE))
    finally:
        store.close()
    states = {record["episode_id"]: record["state"] for record in records}
    assert len(states) == len(records), "a session has two records"
    return states


@pytest.mark.parametrize(
    ("seed", "operations"),
    [
        pytest.param(1, 200, id="seed-1-200-ops"),
        pytest.param(7, 300, id="seed-7-300-ops", marks=pytest.mark.slow),
    ],
)
def test_a_random_sequence_over_changing_worker_counts_matches_the_model(
    deployment: Deployment, seed: int, operations: int
) -> None:
    directory = deployment.root / f"seed-{seed}"
    directory.mkdir()
    run = RandomRun(deployment, seed, operations, directory)

    async def scenario() -> None:
        try:
            await asyncio.wait_for(run.run(), RUN_BOUND)
        finally:
            await run.close()
            await run.kill()

    try:
        asyncio.run(scenario())
        # the run exercised what it checks (deterministic for a seed)
        for needed in (*WEIGHTS, "restore of sessions", "first increment after restore", "retired attempt refused"):
            assert run.seen[needed] > 0, f"seed {seed} never ran {needed!r}: {dict(run.seen)}"
    except BaseException as exc:
        report = f"seed {seed}; operation log:\n" + "\n".join(run.log) + f"\nserver log (tail):\n{run.server_log()}"
        print(report)
        exc.add_note(f"seed {seed}, {len(run.log)} operations logged (printed above); last: {run.log[-5:]}")
        raise
    print(f"seed {seed}: {dict(run.seen)}")
