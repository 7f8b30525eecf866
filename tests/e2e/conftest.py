"""The process-level end-to-end suite: the reference stack as real processes on loopback.

Every server of the stack (inference, model, resources, agent, environment) is a real
``gymckpt serve`` process in its own process group (:class:`~gymckpt.stack.harness.RolloutHarness`).
A crash is SIGKILL of every Gym server's process group; the inference backend survives
it, so its ``/calls`` log tells which model calls a restore made again. A restore always
goes through :class:`~gymckpt.control.coordination.Coordinator` into freshly started
processes.

One stack per module, started once: before each test every Gym server is killed and
started again (fresh processes, same ports) and the inference log is emptied, so tests do
not see each other's state. Each module's stack is closed (every process killed) when the
module ends, whether its tests passed or not.

Catching rollouts in flight, without sleeps: generations are slow (``token_delay_seconds``)
and a test waits for an event the stack exposes, within a bound (:data:`WAIT`):

- the inference backend's ``/calls`` log: :meth:`E2EStack.wait_for_calls` polls it; each
  poll awaits the HTTP round trip itself, nothing else paces the loop;
- a control plane's ``status`` (phase, blockers): polled the same way;
- :class:`ResourcesGate`: a pass-through HTTP proxy in this process, in front of the
  resources server, that holds the ``/verify`` of chosen rollouts and signals their arrival
  (used where a verification must be in flight at a checkpoint; a verification has no
  latency of its own to catch it by).

"Exact model calls after the restore": a rollout's calls are read from the ``/calls`` log
by their call id (``<capture key>:<tool results so far>``) as ``(prompt_sha256, seed)``
pairs. Each module first runs every task it uses once, uninterrupted, as a reference. The
calls a checkpoint recorded as completed are recomputed from its records (the prompt is the
canonical JSON of the conversation before each model output), and the continued attempt
must make exactly the reference calls after them: none of the recorded ones again. The one
call that may appear both before the crash and after the restore is a generation the
backend finished but whose response was still undelivered at the checkpoint: the model
server holds such responses and exports nothing for them (P4), so the agent calls again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

from gymckpt.control.coordination import Coordinator, runs_to_await
from gymckpt.control.routes import CONTROL_PREFIX
from gymckpt.identity import EpisodeId
from gymckpt.servers.model import canonical_prompt
from gymckpt.stack.harness import TOOLS, RolloutHarness, default_stack_spec, task_for
from gymckpt.store import open_store, verify

if TYPE_CHECKING:
    from collections.abc import Coroutine, Iterable, Iterator
    from pathlib import Path

    from gymckpt.stack.harness import CheckpointOutcome

TOKEN = "e2e-token"
#: the bound of any single wait (seconds)
WAIT = 60.0
#: the bound of one whole scenario (seconds)
SCENARIO = 180.0
#: seconds between generated tokens: a model call (8 tokens) takes ~0.16 s
TOKEN_DELAY = 0.02

Pair = tuple[str, int]
#: the order of a crash's SIGKILLs: callers before the servers they call
_CALLERS_FIRST = {"environment": 0, "agent": 1, "model": 2, "counter": 3, "weather": 3}


# ----------------------------------------------------------------------------- model calls


def key_of(call: dict[str, Any]) -> str:
    """The capture key a logged model call was made for (its call id is ``<key>:<n>``)."""
    return str(call["call_id"]).rsplit(":", 1)[0]


def pair_of(call: dict[str, Any]) -> Pair:
    return (call["prompt_sha256"], call["seed"])


def calls_of(log: list[dict[str, Any]], key: str) -> list[Pair]:
    """The ``(prompt_sha256, seed)`` of every logged call of ``key``, in completion order."""
    return [pair_of(call) for call in log if key_of(call) == key]


def prompt_pair(items: list[dict[str, Any]]) -> Pair:
    """The ``(prompt_sha256, seed)`` the model server asks of the backend for this input."""
    digest = hashlib.sha256(canonical_prompt(items).encode()).hexdigest()
    return (digest, int(digest[:8], 16))


def recorded_pairs(messages: list[dict[str, Any]]) -> list[Pair]:
    """The model calls a conversation records: one per model output, on the messages before it."""
    return [
        prompt_pair(messages[:index])
        for index, message in enumerate(messages)
        if message.get("type") == "function_call" or message.get("role") == "assistant"
    ]


def next_key(key: str) -> str:
    """The capture key of the attempt that replaces ``key``."""
    return EpisodeId.from_capture_key(key).next_attempt().capture_key


def rollout_of(key: str) -> str:
    return EpisodeId.from_capture_key(key).rollout_id


@dataclass
class Reference:
    """A task run once, uninterrupted: its model calls and its result."""

    pairs: list[Pair]
    result: dict[str, Any]


# ----------------------------------------------------------------------------- the gate


class ResourcesGate:
    """A pass-through HTTP proxy in front of the resources server that can hold ``/verify`` requests.

    Runs on this process's event loop. Every request is forwarded unchanged (path with its
    rollout prefix, body, status, ``x-ng-*`` headers, and the session cookies a server with
    several workers routes by). A ``/verify`` of a held rollout
    waits until :meth:`release` (forwarded) or :meth:`drop` (answered 503, never forwarded:
    its caller died in a crash). :attr:`verifies` lists the capture key of every ``/verify``.
    """

    def __init__(self) -> None:
        self.upstream = ""
        self.verifies: list[str] = []
        self._hold: set[str] = set()
        self._held: dict[str, asyncio.Future[bool]] = {}
        self._waiters: list[asyncio.Future[None]] = []
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        # a connection per request: none outlives a crash of the resources server
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=SCENARIO)
        )
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def close(self) -> None:
        self.drop()
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def hold(self, keys: Iterable[str]) -> None:
        """Hold the next ``/verify`` of each of these capture keys."""
        self._hold.update(keys)

    def held(self) -> set[str]:
        return set(self._held)

    async def wait_held(self, keys: Iterable[str]) -> None:
        """Wait (at most :data:`WAIT`) until a ``/verify`` of each key is held here: in flight for its caller."""
        wanted = set(keys)

        async def until() -> None:
            while not wanted <= set(self._held):
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
                await waiter

        try:
            await asyncio.wait_for(until(), WAIT)
        except TimeoutError:
            raise AssertionError(f"no /verify of {sorted(wanted - set(self._held))} arrived within {WAIT} s") from None

    def release(self) -> None:
        """Forward every held ``/verify``; hold nothing more."""
        self._settle(forward=True)

    def drop(self) -> None:
        """Answer every held ``/verify`` with 503 without forwarding it; hold nothing more."""
        self._settle(forward=False)

    def reset(self) -> None:
        self.drop()
        self.verifies.clear()

    def _settle(self, *, forward: bool) -> None:
        self._hold.clear()
        for future in self._held.values():
            if not future.done():
                future.set_result(forward)

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        path = request.rel_url.path
        key = path.split("/")[2] if path.startswith("/ng-rollout/") else ""
        if path.endswith("/verify"):
            self.verifies.append(key)
            if key in self._hold:
                self._hold.discard(key)
                future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
                self._held[key] = future
                self._notify()
                try:
                    forward = await asyncio.wait_for(future, SCENARIO)
                finally:
                    self._held.pop(key, None)
                if not forward:
                    return web.json_response({"error": {"code": "dropped", "detail": key}}, status=503)
        assert self._session is not None
        headers = CIMultiDict((name, value) for name, value in request.headers.items() if _passed(name, ("cookie",)))
        headers.setdefault("Content-Type", "application/json")
        async with self._session.request(
            request.method, self.upstream + str(request.rel_url), data=body, headers=headers
        ) as upstream:
            payload = await upstream.read()
            passed = CIMultiDict(
                (name, value) for name, value in upstream.headers.items() if _passed(name, ("set-cookie",))
            )
            return web.Response(status=upstream.status, body=payload, headers=passed)


def _passed(name: str, cookies: tuple[str, ...]) -> bool:
    """What the gate passes through: ``x-ng-*`` and session headers, the content type, and the cookies."""
    lowered = name.lower()
    return lowered.startswith(("x-ng-", "x-nemo-gym-")) or lowered == "content-type" or lowered in cookies


# ----------------------------------------------------------------------------- a checkpoint, as the controller sees it


@dataclass
class Cut:
    """One checkpoint taken with rollouts in flight, and the controller's view of it."""

    outcome: CheckpointOutcome
    #: every rollout's run (None: not started, in flight for the controller)
    runs: dict[str, asyncio.Task[dict[str, Any]] | None]
    #: rollouts whose /run replied before the checkpoint (body by capture key)
    finished: dict[str, dict[str, Any]]
    #: rollouts the environment exported (the continued ones)
    committed: list[str]
    #: rollouts some server reported as restarts
    restarts: set[str]
    #: records per participant kind, by capture key
    records: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)

    @property
    def checkpoint_id(self) -> str:
        return self.outcome.checkpoint_id

    @property
    def directory(self) -> str:
        return self.outcome.directory

    def stage(self, key: str) -> str | None:
        """The environment boundary's stage of ``key`` (None: no boundary, it starts over)."""
        boundary = self.records["environment"][key]["boundary"]
        return None if boundary is None else boundary["stage"]

    def recorded(self, key: str, reference: Reference) -> list[Pair]:
        """The model calls of ``key`` the checkpoint records as completed."""
        agent = self.records.get("agent", {}).get(key)
        if agent is not None:
            boundary = agent.get("boundary") or {}
            conversation = boundary.get("conversation") if agent.get("kind") == "run" else boundary
            return recorded_pairs((conversation or {}).get("messages") or [])
        if key in self.records["environment"] and self.stage(key) in ("close_agent", "verify", "done"):
            # the agent's reply is in the environment's boundary (the agent session is closed)
            assert self.records["environment"][key]["boundary"]["agent"]["output_text"] == reference.result["response"]
            return list(reference.pairs)
        return []


# ----------------------------------------------------------------------------- the module's stack


class E2EStack:
    """A module's running stack, its event loop, its references, and the controller's helpers."""

    def __init__(self, runner: asyncio.Runner, harness: RolloutHarness, gate: ResourcesGate | None) -> None:
        self.runner = runner
        self.harness = harness
        self.gate = gate
        self.reference: dict[int, Reference] = {}
        #: task index of every rollout id a test started
        self.index: dict[str, int] = {}
        self._coordinators: list[Coordinator] = []
        self._tasks: list[asyncio.Task[Any]] = []
        self._session: aiohttp.ClientSession | None = None

    # --- running

    def run(self, scenario: Coroutine[Any, Any, Any]) -> Any:
        """Run one scenario on the module's loop, within :data:`SCENARIO` seconds."""
        return self.runner.run(asyncio.wait_for(scenario, SCENARIO))

    @property
    def urls(self) -> dict[str, str]:
        return self.harness.urls

    def client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # a connection per request: none outlives a crash of the server it went to
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=SCENARIO)
            )
        return self._session

    async def coordinator(self, servers: Iterable[str] | None = None) -> Coordinator:
        """A discovered coordinator of every Gym server (or of the named ones)."""
        names = list(servers) if servers is not None else self.harness.gym_servers
        if servers is None:
            gym = self.harness.coordinator()
        else:
            gym = Coordinator([self.urls[name] for name in names], token=self.harness.token)
        gym.probe_timeout = WAIT  # a restarted server answers once it has started; its socket holds the probe
        self._coordinators.append(gym)
        found = await gym.discover(require_model=servers is None)  # some servers only: perhaps no model among them
        assert found.ok, found.problems
        return gym

    async def status(self, name: str) -> dict[str, Any]:
        """A Gym server's checkpoint status."""
        async with self.client().get(
            f"{self.urls[name]}{CONTROL_PREFIX}/status", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as response:
            assert response.status == 200, await response.text()
            return await response.json()  # type: ignore[no-any-return]

    async def poll_status(self, name: str, predicate: Any, what: str) -> dict[str, Any]:
        """Poll a server's status until ``predicate(status)``; each poll awaits its HTTP round trip."""
        deadline = time.monotonic() + WAIT
        while True:
            status = await self.status(name)
            if predicate(status):
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} never reached {what} within {WAIT} s: {status}")

    async def wait_for_calls(
        self, minimum: dict[str, int], runs: dict[str, asyncio.Task[dict[str, Any]]]
    ) -> list[dict[str, Any]]:
        """Wait until each key has at least ``minimum[key]`` completed model calls (or its run ended).

        Polls the inference backend's ``/calls``; each poll awaits its HTTP round trip.
        """
        deadline = time.monotonic() + WAIT
        while True:
            log = await self.harness.model_calls()
            counts: dict[str, int] = {}
            for call in log:
                counts[key_of(call)] = counts.get(key_of(call), 0) + 1
            if all(counts.get(key, 0) >= n or runs[key].done() for key, n in minimum.items()):
                return log
            if time.monotonic() > deadline:
                raise AssertionError(f"model calls never reached {minimum} within {WAIT} s: {counts}")

    # --- rollouts

    def task(self, key: str) -> dict[str, Any]:
        return task_for(self.index[rollout_of(key)])

    def expected(self, key: str) -> Reference:
        return self.reference[self.index[rollout_of(key)]]

    def start(self, rollouts: dict[str, int]) -> dict[str, asyncio.Task[dict[str, Any]]]:
        """Start one environment ``/run`` per capture key (task index as given)."""
        runs = {}
        for key, index in rollouts.items():
            self.index[rollout_of(key)] = index
            runs[key] = asyncio.create_task(self.harness.run(key, task_for(index)), name=f"run-{key}")
        self._tasks.extend(runs.values())
        return runs

    def legacy_row(self, key: str, *, resources_url: str | None = None) -> dict[str, Any]:
        """The flat row of a legacy agent ``/run`` of ``key`` (same input as the environment's task)."""
        episode = EpisodeId.from_capture_key(key)
        index = self.index[episode.rollout_id]
        task = task_for(index)
        return {
            "_ng_rollout_id": episode.rollout_id,
            "_ng_attempt_index": episode.attempt,
            "_ng_task_index": index,
            "_ng_rollout_index": 0,
            "responses_create_params": {
                "input": [{"role": "user", "content": task["task_input"]["prompt"]}],
                "tools": TOOLS,
            },
            "task_input": task["task_input"],
            "resources_url": resources_url or self.urls["resources"],
        }

    async def run_legacy(self, key: str) -> dict[str, Any]:
        """One legacy agent ``/run`` of ``key``; the reply body with its status."""
        async with self.client().post(f"{self.urls['agent']}/run", json=self.legacy_row(key)) as response:
            body = await response.json()
            body["status"] = response.status
            return body  # type: ignore[no-any-return]

    def start_legacy(self, rollouts: dict[str, int]) -> dict[str, asyncio.Task[dict[str, Any]]]:
        runs = {}
        for key, index in rollouts.items():
            self.index[rollout_of(key)] = index
            runs[key] = asyncio.create_task(self.run_legacy(key), name=f"legacy-{key}")
        self._tasks.extend(runs.values())
        return runs

    async def settle(self, runs: Iterable[asyncio.Task[Any]]) -> None:
        await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), WAIT)

    async def make_references(self, indices: Iterable[int]) -> None:
        """Run each task once, uninterrupted, and keep its calls and result."""
        keys = {f"ref-{index}": index for index in indices}
        runs = self.start(keys)
        bodies = await asyncio.wait_for(asyncio.gather(*runs.values()), WAIT)
        log = await self.harness.model_calls()
        for (key, index), body in zip(keys.items(), bodies, strict=True):
            assert "result" in body, body
            pairs = calls_of(log, key)
            assert pairs, f"the reference run {key} made no model call"
            self.reference[index] = Reference(pairs, body["result"])

    # --- the controller's side

    async def checkpoint(
        self,
        gym: Coordinator,
        checkpoint_id: str,
        directory: Path | str,
        runs: dict[str, asyncio.Task[dict[str, Any]] | None],
        *,
        exported_by: str = "environment",
    ) -> Cut:
        """Checkpoint the rollouts not yet replied (prepare, commit, publish; no resume) and check the contract.

        ``runs`` maps each rollout's capture key to its run (None: not started yet, but in
        flight for the controller). Every rollout either replied before the checkpoint or
        was exported by ``exported_by`` (or reported as a restart); none of the exported
        ones has replied.
        """
        in_flight = [key for key, run in runs.items() if run is None or not run.done()]
        outcome = await self.harness.checkpoint(gym, checkpoint_id, str(directory), in_flight, deadline_seconds=WAIT)
        commits = {reply.kind: reply for reply in outcome.commits.values()}
        committed = list(commits[exported_by].episode_ids)
        restarts = outcome.prepared.restarts()
        # K6: a run neither exported nor a restart ended before the checkpoint; its reply may still be on its way
        outstanding = [key for key, run in runs.items() if run is None or not run.done()]
        for key in runs_to_await(outstanding, committed=committed, restarts=restarts):
            run = runs[key]
            assert run is not None, f"{key} was not exported, yet it had not started"
            await asyncio.wait_for(asyncio.shield(run), WAIT)
        finished = {key: run.result() for key, run in runs.items() if run is not None and run.done()}
        assert set(finished) | set(committed) | (restarts & set(runs)) == set(runs), "a rollout was lost"
        assert not set(finished) & set(committed), "an exported rollout replied while Gym was prepared"
        assert not set(finished) & restarts
        assert not set(committed) & restarts, "a restart was exported"
        assert set(committed) <= set(outcome.scope)
        for kind, reply in commits.items():
            assert set(reply.episode_ids) <= set(committed), f"{kind} exported a rollout {exported_by} did not"
        for key, body in finished.items():
            self.assert_result(key, body)
        store = open_store(str(directory))
        records: dict[str, dict[str, dict[str, Any]]] = {}
        try:
            for reply in outcome.commits.values():
                records[reply.kind] = {
                    record["episode_id"]: record
                    for record in store.read_participant("", kind=reply.kind, instance=reply.instance)
                }
        finally:
            store.close()
        report = verify(str(directory))
        assert report.ok, report.errors
        return Cut(outcome, runs, finished, committed, restarts, records)

    def assert_result(self, key: str, body: dict[str, Any]) -> None:
        """A run's body carries the result its task gives when uninterrupted."""
        expected = self.expected(key).result
        if "_ng_rollout_id" in body or "episode_id" not in body:  # a legacy agent /run
            assert body.get("status") == 200, body
            assert body["reward"] == expected["reward"], (key, body)
            assert body["response"]["output_text"] == expected["response"], (key, body)
        else:
            assert "result" in body, (key, body)
            assert body["result"] == expected, (key, body)

    async def crash(self, runs: dict[str, asyncio.Task[dict[str, Any]]], unanswered: Iterable[str]) -> None:
        """SIGKILL every Gym server's process group; the runs of ``unanswered`` die without a reply."""
        unanswered = list(unanswered)
        for key in unanswered:
            assert not runs[key].done(), f"{key} replied while Gym was prepared: {runs[key].result()}"
        await asyncio.to_thread(self.kill)
        if self.gate is not None:
            self.gate.drop()
        for key in unanswered:
            with pytest.raises(aiohttp.ClientError):
                await asyncio.wait_for(runs[key], WAIT)

    def kill(self) -> None:
        """The crash: SIGKILL every Gym server's process group, callers first, then reap them (``harness.crash``).

        Every group is signalled before any is reaped, environment and agent before the
        servers they call: a server killed alone first would let its callers notice and
        reply failures before they die (``Stack.kill`` kills and reaps one server at a
        time, in the spec's order: model first).
        """
        servers = sorted(self.harness.stack.servers.values(), key=lambda server: _CALLERS_FIRST.get(server.kind, 9))
        for server in servers:
            if server.name in self.harness.gym_servers and server.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.process.pid, signal.SIGKILL)
        self.harness.crash()

    async def restore(
        self, cut: Cut, *, servers: Iterable[str] | None = None, workers: int | None = None
    ) -> Coordinator:
        """Start fresh Gym processes (``workers`` each: another count), restore ``cut`` through the
        coordinator (on ``servers``, all by default), resume."""
        self.harness.restart(workers=workers)
        gym = await self.coordinator(servers)
        replies = await gym.restore(cut.checkpoint_id, time.time() + WAIT, cut.directory, cut.committed)
        for url, reply in replies.items():
            # each server lists the attempts it installed: those of its records in the scope (same URLs after a restart)
            expected = sorted(next_key(key) for key in cut.outcome.commits[url].episode_ids if key in cut.committed)
            assert reply.phase == "restored", (url, reply)
            assert reply.restored == expected, (url, reply)
        await gym.resume(cut.checkpoint_id, time.time() + WAIT)
        return gym

    def assert_continued_exactly(
        self, log: list[dict[str, Any]], cut: Cut, key: str, continued: str, *, first: str | None = None
    ) -> list[Pair]:
        """``continued`` made exactly the reference calls ``key`` had not completed at ``cut``.

        ``first`` is the attempt that made the recorded calls (``key`` by default: a key
        restored and checkpointed again before it ran made none). Returns the recorded calls.
        """
        reference = self.expected(key).pairs
        recorded = cut.recorded(key, self.expected(key))
        done = len(recorded)
        assert recorded == reference[:done], f"{key}: the checkpoint records calls the task does not make"
        before = calls_of(log, first or key)
        # at most one more: a generation in flight at the checkpoint whose response was never delivered (P4)
        assert before in (reference[:done], reference[: done + 1]), f"{key}: calls before the crash {before}"
        after = calls_of(log, continued)
        assert not set(recorded) & set(after), f"{continued} made a completed call again"
        assert after == reference[done:], f"{continued}: calls after the restore {after}, expected {reference[done:]}"
        return recorded

    async def continue_committed(self, cut: Cut, *, legacy: bool = False) -> list[dict[str, Any]]:
        """Run the replacement attempt of every exported rollout; check results and exact calls; return the log."""
        continued = {key: next_key(key) for key in cut.committed}
        if legacy:
            runs = [self.run_legacy(attempt) for attempt in continued.values()]
        else:
            runs = [self.harness.run(attempt, self.task(attempt)) for attempt in continued.values()]
        bodies = await asyncio.wait_for(asyncio.gather(*runs), WAIT)
        for attempt, body in zip(continued.values(), bodies, strict=True):
            self.assert_result(attempt, body)
        log = await self.harness.model_calls()
        for key, attempt in continued.items():
            self.assert_continued_exactly(log, cut, key, attempt)
        for key in cut.finished:  # finished before the checkpoint: each call once, never continued
            assert calls_of(log, key) == self.expected(key).pairs, key
            assert not calls_of(log, next_key(key)), key
        return log

    # --- between tests

    def fresh(self, *, workers: int | None = None) -> None:
        """Fresh Gym processes (``workers`` each, else as many as before) and an empty inference log."""
        self.runner.run(asyncio.wait_for(self._fresh(workers), WAIT))

    async def _fresh(self, workers: int | None) -> None:
        # in a thread, so this loop notices the killed servers' connections closing
        await asyncio.to_thread(self.kill)
        self.harness.restart(workers=workers)
        if self.gate is not None:
            self.gate.reset()
        await self.harness.reset_model_calls()

    def end_test(self) -> None:
        """Cancel the runs a test left and close its coordinators."""
        tasks, self._tasks = self._tasks, []
        coordinators, self._coordinators = self._coordinators, []

        async def close() -> None:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for gym in coordinators:
                await gym.close()

        self.runner.run(asyncio.wait_for(close(), WAIT))


@contextlib.contextmanager
def e2e_stack(workdir: Path, *, references: Iterable[int], gate: bool = False, **spec: Any) -> Iterator[E2EStack]:
    """Start a stack (``default_stack_spec(**spec)``), run the references, yield; kill everything after."""
    runner = asyncio.Runner()
    resources_gate = ResourcesGate() if gate else None
    harness: RolloutHarness | None = None
    try:
        stack_spec = default_stack_spec(token=TOKEN, token_delay_seconds=TOKEN_DELAY, **spec)
        if resources_gate is not None:
            url = runner.run(resources_gate.start())
            for server in stack_spec["servers"]:
                if server["kind"] == "environment":
                    server["config"]["resources_url"] = url
        harness = RolloutHarness.start(stack_spec, workdir=workdir)
        if resources_gate is not None:
            resources_gate.upstream = harness.urls["resources"]
        stack = E2EStack(runner, harness, resources_gate)
        try:
            runner.run(asyncio.wait_for(stack.make_references(references), WAIT))
            yield stack
        finally:
            stack.end_test()
            if stack._session is not None:
                runner.run(stack._session.close())
    finally:
        if harness is not None:
            runner.run(harness.close())
        if resources_gate is not None:
            runner.run(resources_gate.close())
        runner.close()


@contextlib.contextmanager
def fresh(stack: E2EStack) -> Iterator[E2EStack]:
    """``stack`` with fresh Gym processes; open coordinators and stray tasks are closed after."""
    stack.fresh()
    try:
        yield stack
    finally:
        stack.end_test()


@pytest.fixture
def e2e(stack: E2EStack) -> Iterator[E2EStack]:
    """The module's stack with fresh Gym processes; open coordinators and stray tasks are closed after."""
    with fresh(stack) as running:
        yield running
