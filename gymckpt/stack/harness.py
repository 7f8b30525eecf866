"""A running reference stack and the controller's side of it: rollouts, checkpoints, crashes.

The demo and the process-level tests drive the stack through this: ``/run`` calls to the
environment server, coordination (:class:`~gymckpt.control.coordination.Coordinator`) for
prepare, commit, publish, resume and restore, and SIGKILL of every Gym server's process
group for a crash. The inference backend is not a Gym server: it survives a crash, and
its call log tells which model calls a restore made again.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from gymckpt import transport
from gymckpt.control.coordination import Coordinator
from gymckpt.stack.supervisor import Stack, load_stack

if TYPE_CHECKING:
    from pathlib import Path

    from gymckpt.control.coordination import DiscoverResult, ParticipantCommit, ParticipantRestore, PrepareResult

__all__ = [
    "CheckpointOutcome",
    "STACK_IDLE_SECONDS",
    "RestoreOutcome",
    "RolloutHarness",
    "StackNotReady",
    "StateSizes",
    "default_stack_spec",
    "prompt_text",
    "task_for",
]

TOOLS = [{"type": "function", "name": "increment"}]
#: how long the reference stack's servers keep an idle pooled connection to one another, in seconds (at
#: most half the servers' keep-alive; :func:`default_stack_spec`)
STACK_IDLE_SECONDS = 30.0


@dataclass(frozen=True)
class StateSizes:
    """How much state each rollout carries: the knobs behind realistic records.

    The defaults give at least the reference's bytes per exported rollout once most are past
    their first turn (environment ≥ 0.9 KB, agent ≥ 1.9 KB, model ≥ 2.7 KB);
    :meth:`compact` is the small stack of the unit and process tests. All content is
    deterministic (derived from the task index and the generation), so an uninterrupted and a
    restored run give the same results.
    """

    #: characters of each task's prompt (:func:`prompt_text`): in the environment's and the agent's records
    prompt_chars: int = 800
    #: characters of each tool call's output (the counter's ``output_chars``): in the agent's conversation
    tool_output_chars: int = 320
    #: tokens of each model call (the model's ``max_tokens``): the ledger rows' token ids and logprobs
    generation_tokens: int = 96
    #: tokens the inference backend makes per decoding step (a step takes ``token_delay_seconds``)
    tokens_per_step: int = 12
    #: whether the model's replies carry a reasoning item (a word per token) that joins the conversation
    reasoning: bool = True

    @classmethod
    def compact(cls) -> StateSizes:
        """The small stack: short prompts, no tool output, 8 tokens a call one at a time, no reasoning."""
        return cls(prompt_chars=0, tool_output_chars=0, generation_tokens=8, tokens_per_step=1, reasoning=False)


def default_stack_spec(
    *,
    token: str,
    storage_options: dict[str, Any] | None = None,
    agent_session_hooks: bool = True,
    token_delay_seconds: float = 0.01,
    tool_turns: int = 3,
    resources: str = "counter",
    allowed_roots: list[str] | None = None,
    workers: int = 1,
    sizes: StateSizes | None = None,
    data_pool_limit: int | None = None,
    resources_pool_limit: int | None = None,
    pool_idle_seconds: float | None = None,
    inference_pool_limit: int | None = None,
) -> dict[str, Any]:
    """The reference stack: inference, model, a resources server, the agent, the environment.

    ``workers``: uvicorn workers of each Gym server (the inference backend runs one).
    ``sizes``: how much state a rollout carries (default :meth:`StateSizes.compact`; the
    prompt length is the tasks' own, :func:`task_for`). ``data_pool_limit``: each Gym
    server's outbound data connections, per host and in all (default: the servers' own,
    :func:`~gymckpt.transport.downstream_pool_limit`); how many rollouts can be inside the
    agent at once. ``resources_pool_limit``: the agent's and the environment's calls to the
    resources server (short ones: tool calls, seed, verify) on a pool of their own at this
    bound, so their idle connections are not held beside a full data pool. ``pool_idle_seconds``:
    how long each Gym server keeps an idle pooled connection (``data_connector_idle_seconds``).
    Every server of this stack is gymckpt's, so the default is :data:`STACK_IDLE_SECONDS`, at most
    half their keep-alive (``GYMCKPT_KEEP_ALIVE``, 75 s), not the transport's 4 s for servers of
    unknown keep-alive: a rollout's wave idles longer than 4 s, and its next wave then opened a
    connection per call (at 16,000 rollouts: 7.5 % more CPU, 7 % longer).
    ``inference_pool_limit``: the model server's connections to the inference backend, in all
    (each of its workers takes its share; default: ``data_pool_limit``): how many generations
    decode at once, as an inference engine's batch bounds them. The calls beyond wait in the
    model server's pool, costing its event loop nothing until they go out.
    """
    if pool_idle_seconds is None:
        pool_idle_seconds = min(STACK_IDLE_SECONDS, transport.server_keep_alive() / 2)
    sizes = sizes if sizes is not None else StateSizes.compact()
    model: dict[str, Any] = {"inference_url": "{inference}", "tool_turns": tool_turns}
    if sizes.generation_tokens != 8:
        model["max_tokens"] = sizes.generation_tokens
    if sizes.reasoning:
        model["reasoning"] = True
    inference: dict[str, Any] = {"token_delay_seconds": token_delay_seconds}
    if sizes.tokens_per_step != 1:
        inference["tokens_per_step"] = sizes.tokens_per_step
    resources_server: dict[str, Any] = {"name": "resources", "kind": resources}
    if sizes.tool_output_chars and resources == "counter":
        resources_server["config"] = {"output_chars": sizes.tool_output_chars}
    pools: dict[str, Any] = {"data_connector_idle_seconds": pool_idle_seconds}
    if data_pool_limit is not None:
        limits = {"data_connector_limit": data_pool_limit, "data_connector_limit_per_host": data_pool_limit}
        resources_server["config"] = {**resources_server.get("config", {}), **limits}
        pools.update(limits)
    model.update(pools)
    if inference_pool_limit is not None:
        share = -(-inference_pool_limit // max(workers, 1))  # the server's bound, split over its workers
        model.update(data_connector_limit=share, data_connector_limit_per_host=share)
    calling_resources: dict[str, Any] = dict(pools)
    if resources_pool_limit is not None:
        calling_resources["data_connector_limit_by_url"] = {"{resources}": resources_pool_limit}
    checkpoint: dict[str, Any] = {"enabled": True, "control_auth_token": token}
    if storage_options:
        checkpoint["storage_options"] = storage_options
    if allowed_roots:
        checkpoint["allowed_roots"] = allowed_roots
    return {
        "checkpoint": checkpoint,
        "workers": workers,
        "servers": [
            {"name": "inference", "kind": "inference", "workers": 1, "config": inference},
            {"name": "model", "kind": "model", "config": model},
            resources_server,
            {
                "name": "agent",
                "kind": "agent",
                "config": {"model_url": "{model}", "session_hooks": agent_session_hooks, **calling_resources},
            },
            {
                "name": "environment",
                "kind": "environment",
                "config": {"agent_url": "{agent}", "resources_url": "{resources}", **calling_resources},
            },
        ],
    }


def prompt_text(index: int, chars: int = 0) -> str:
    """The prompt of task ``index``: ``"count for task <index>"``, padded to ``chars`` characters with
    text derived from the index (each 64 characters a sha256 of it), so every run builds the same task."""
    head = f"count for task {index}"
    if chars <= len(head):
        return head
    parts = [head, "."]
    size = len(head) + 1
    block = 0
    while size < chars:
        digest = hashlib.sha256(f"task {index} block {block}".encode()).hexdigest()
        words = " " + " ".join(digest[i : i + 8] for i in range(0, 64, 8))
        parts.append(words)
        size += len(words)
        block += 1
    return "".join(parts)[:chars]


def task_for(index: int, *, prompt_chars: int = 0) -> dict[str, Any]:
    """The task of rollout ``index``: a prompt (``prompt_chars`` long, at least its head) and the counter's tool."""
    return {
        "task_id": {"taskset": "counter-demo", "task_id": f"task-{index}"},
        "task_input": {"prompt": prompt_text(index, prompt_chars), "tools": TOOLS},
    }


@dataclass
class CheckpointOutcome:
    """What one checkpoint did."""

    checkpoint_id: str
    directory: str
    prepared: PrepareResult
    scope: list[str]
    commits: dict[str, ParticipantCommit]
    prepare_seconds: float
    commit_seconds: float
    published: dict[str, Any] = field(default_factory=dict)

    @property
    def bytes_written(self) -> int:
        """The records' bytes, as far as the replies say (a reference server's reply does not)."""
        return sum(reply.records_bytes or 0 for reply in self.commits.values())


@dataclass
class RestoreOutcome:
    """What one restore did: each Gym server's reply (none for an empty scope), and how long it took."""

    replies: dict[str, ParticipantRestore]
    restore_seconds: float


#: how often :meth:`RolloutHarness.wait_ready` asks a server with several workers whether all have linked
WORKER_POLL_SECONDS = 0.1
#: connections of the reads that watch the rollouts (the inference backend's call log and turns)
OBSERVER_POOL = 4


class StackNotReady(RuntimeError):
    """The stack did not come up: why, and the servers whose process exited (none: it did not answer)."""

    def __init__(self, reason: str, exited: list[str] | None = None) -> None:
        super().__init__(reason)
        self.exited = list(exited or [])


class RolloutHarness:
    """A stack of real server processes and the controller that drives them.

    ``request_timeout`` bounds each HTTP request the harness itself makes (``/run``, the
    inference backend's ``/calls``), in seconds.
    """

    def __init__(self, stack: Stack, token: str, *, request_timeout: float = 300.0) -> None:
        self.stack = stack
        self.token = token
        self.request_timeout = request_timeout
        self.gym_servers = [name for name, server in stack.servers.items() if server.kind != "inference"]
        self._session: aiohttp.ClientSession | None = None
        #: the inference backend's log and turn counts, read on a pool of their own (:meth:`_observer`)
        self._observing: aiohttp.ClientSession | None = None

    # --- starting

    @classmethod
    def load(
        cls, spec: dict[str, Any], *, workdir: Path | None = None, request_timeout: float = 300.0
    ) -> RolloutHarness:
        """Open the stack's sockets (importing its servers' modules, which is slow); no server starts yet."""
        token = str((spec.get("checkpoint") or {}).get("control_auth_token", ""))
        return cls(load_stack(spec, workdir=workdir), token, request_timeout=request_timeout)

    @classmethod
    def start(
        cls, spec: dict[str, Any], *, workdir: Path | None = None, request_timeout: float = 300.0
    ) -> RolloutHarness:
        """Open the stack's sockets and start every server."""
        harness = cls.load(spec, workdir=workdir, request_timeout=request_timeout)
        harness.start_servers()
        return harness

    @classmethod
    async def open(
        cls, spec: dict[str, Any], *, workdir: Path | None = None, request_timeout: float = 300.0
    ) -> RolloutHarness:
        """:meth:`start` from a running event loop.

        The slow part (loading the servers' modules) runs off the loop; the processes are
        started in the loop's thread, so an interrupt cannot leave processes nobody kills.
        """
        harness = await asyncio.to_thread(cls.load, spec, workdir=workdir, request_timeout=request_timeout)
        harness.start_servers()
        return harness

    def start_servers(self) -> None:
        """Start every server; if one cannot start, kill the ones started and close the sockets."""
        try:
            self.stack.start()
        except BaseException:
            self.stack.close()
            raise

    @property
    def urls(self) -> dict[str, str]:
        return self.stack.urls

    @property
    def pids(self) -> dict[str, int]:
        """Each started server's process id (also its process group's), by name."""
        return {name: server.process.pid for name, server in self.stack.servers.items() if server.process is not None}

    def exited(self) -> list[str]:
        """The servers whose process is not running (exited, killed, or not started)."""
        return [name for name, server in self.stack.servers.items() if not server.alive]

    def coordinator(self, *, probe_timeout: float = 60.0) -> Coordinator:
        """A coordinator for every Gym server (call ``discover()`` before using it).

        The probe timeout is long: a server just restarted behind its kept socket accepts
        connections at once but answers only when its process has started.
        """
        options = self.stack.servers["environment"].config.get("checkpoint", {}).get("storage_options")
        return Coordinator(
            [self.urls[name] for name in self.gym_servers],
            token=self.token,
            storage_options=options,
            probe_timeout=probe_timeout,
        )

    async def wait_ready(self, *, timeout: float = 60.0) -> Coordinator:
        """A discovered coordinator of every Gym server, once they all answer and so does the inference backend.

        Watches the processes meanwhile: a server whose process exits, no answer within
        ``timeout`` seconds, or a discovery that fails raises :class:`StackNotReady` (the
        coordinator is closed then). ``timeout`` is the coordinator's probe timeout too.
        """
        gym = self.coordinator(probe_timeout=timeout)
        try:
            await self._until_ready(gym, timeout)
        except BaseException:
            await gym.close()
            raise
        return gym

    async def _until_ready(self, gym: Coordinator, timeout: float) -> None:
        async def up() -> DiscoverResult:
            found = await gym.discover()
            if found.ok:
                async with transport.request(self._observer(), "GET", f"{self.urls['inference']}/calls") as response:
                    await transport.read_bounded(response, transport.data_reply_limit())
                await every_worker_registered([info.url for info in found.participants])
            return found

        async def every_worker_registered(urls: list[str]) -> None:
            """A server with several workers is ready once each of them linked to its coordinator."""
            while True:
                statuses = await asyncio.gather(*(gym.status(url) for url in urls))
                if all(status.get("workers", 1) >= status.get("expected_workers", 1) for status in statuses):
                    return
                await asyncio.sleep(WORKER_POLL_SECONDS)

        probe = asyncio.create_task(up())
        deadline = time.monotonic() + timeout
        try:
            while not probe.done():
                exited = self.exited()
                if exited or time.monotonic() > deadline:
                    why = f"{', '.join(exited)} exited" if exited else f"no answer within {timeout:.0f} s"
                    raise StackNotReady(why, exited)
                await asyncio.wait({probe}, timeout=0.1)
        finally:
            if not probe.done():
                probe.cancel()
                await asyncio.gather(probe, return_exceptions=True)
        try:
            found = probe.result()
        except Exception as exc:
            raise StackNotReady(str(exc)) from exc
        if not found.ok:
            raise StackNotReady(str(found.problems))

    def log_tails(self, names: list[str] | None = None, lines: int = 12) -> str:
        """The last ``lines`` of the named servers' logs; none named: of every log showing an error.

        Each tail starts on a new line under a ``--- <name> log`` header (empty: nothing to show),
        to append to an error message.
        """
        tails = []
        for name in names or list(self.stack.servers):
            try:
                text = self.stack.servers[name].log_path.read_text(errors="replace").splitlines()
            except OSError:
                continue
            if text and (names or any("Error" in line or "Traceback" in line for line in text)):
                tails.append(f"\n--- {name} log (last {lines} lines):\n" + "\n".join(text[-lines:]))
        return "".join(tails)

    # --- rollouts

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # a pool as large as the descriptors allow (transport.pool_limit): every rollout's /run
            # is in flight at once, as a trainer's are, up to that bound (aiohttp's default of 100
            # would hold /run calls beyond the 100th back in the client)
            self._session = transport.client_session(timeout=aiohttp.ClientTimeout(total=self.request_timeout))
        return self._session

    def _observer(self) -> aiohttp.ClientSession:
        """The session of the reads that watch the rollouts (call log, turns), apart from the ``/run`` pool.

        With every connection of that pool held by a ``/run`` that waits at a checkpoint, a read
        queued behind them would wait until the rollouts go on, and they do not before the crash.
        """
        if self._observing is None or self._observing.closed:
            self._observing = transport.client_session(
                limit=OBSERVER_POOL,
                limit_per_host=OBSERVER_POOL,
                timeout=aiohttp.ClientTimeout(total=self.request_timeout),
            )
        return self._observing

    async def _close_sessions(self) -> None:
        for session in (self._session, self._observing):
            if session is not None:
                await session.close()
        self._session = self._observing = None

    async def run(self, episode_id: str, task: dict[str, Any]) -> dict[str, Any]:
        """One ``/run`` of the environment server; the reply body (a result or a failure), with its HTTP status.

        A body that is not a JSON object comes back as ``{"body": ..., "status": ...}``. A
        ``/run`` is never sent twice (a second one of a running episode is refused). A reply
        beyond :func:`~gymckpt.transport.data_reply_limit` raises
        :class:`~gymckpt.errors.ReplyTooLarge`, read no further.
        """
        url = f"{self.urls['environment']}/run"
        sent = {"episode_id": episode_id, "task": task}
        async with transport.request(self._client(), "POST", url, resend=False, json=sent) as response:
            body = await transport.read_bounded_json(response, transport.data_reply_limit())
            if not isinstance(body, dict):
                body = {"body": body}
            body.setdefault("status", response.status)
            return body

    async def model_calls(self) -> list[dict[str, Any]]:
        """Every generation the inference backend completed, in order."""
        async with transport.request(self._observer(), "GET", f"{self.urls['inference']}/calls") as response:
            return await transport.read_bounded_json(response, transport.data_reply_limit())  # type: ignore[no-any-return]

    async def model_call_count(self) -> int:
        """How many generations the inference backend has completed (its log's length: it only grows)."""
        async with transport.request(self._observer(), "GET", f"{self.urls['inference']}/calls/count") as response:
            body = await transport.read_bounded_json(response, transport.data_reply_limit())
        return int(body["count"])

    async def rollouts_by_turn(self) -> dict[str, int]:
        """How many rollout attempts stand at each turn (``"1"``: first model call), as the inference backend counts."""
        async with transport.request(self._observer(), "GET", f"{self.urls['inference']}/turns") as response:
            body = await transport.read_bounded_json(response, transport.data_reply_limit())
        counts = body.get("rollouts_by_turn") if isinstance(body, dict) else None
        return {str(name): int(count) for name, count in counts.items()} if isinstance(counts, dict) else {}

    async def reset_model_calls(self) -> None:
        """Empty the inference backend's call log and forget the turns it counted (:meth:`rollouts_by_turn`)."""
        # clearing twice leaves the log as clearing once: safe to send again
        async with transport.request(
            self._observer(), "POST", f"{self.urls['inference']}/calls/reset", resend=True
        ) as response:
            await transport.read_bounded(response, transport.data_reply_limit())

    # --- checkpoint, crash, restore

    async def checkpoint(
        self,
        gym: Coordinator,
        checkpoint_id: str,
        directory: str,
        in_flight: list[str],
        *,
        deadline_seconds: float = 120.0,
        publish: bool = True,
    ) -> CheckpointOutcome:
        """Prepare, commit the continued in-flight episodes, publish (no resume)."""
        began = time.perf_counter()
        prepared = await gym.prepare(checkpoint_id, time.time() + deadline_seconds)
        prepare_seconds = time.perf_counter() - began
        if not prepared.prepared:
            raise RuntimeError(f"prepare of {checkpoint_id} did not get ready: {prepared.blockers()}")
        scope = prepared.continued(in_flight)
        began = time.perf_counter()
        commits = await gym.commit(checkpoint_id, time.time() + deadline_seconds, directory, scope)
        commit_seconds = time.perf_counter() - began
        outcome = CheckpointOutcome(checkpoint_id, directory, prepared, scope, commits, prepare_seconds, commit_seconds)
        if publish:
            outcome.published = await gym.publish(directory, commits)
        return outcome

    def crash(self) -> None:
        """SIGKILL every Gym server's process group (the inference backend survives).

        Their listening sockets are renewed: a request that waited in a backlog at the crash is
        reset, never served by the fresh processes as if sent to them.
        """
        self.stack.kill(self.gym_servers, drop_backlog=True)

    def restart(self, *, workers: dict[str, int] | int | None = None) -> None:
        """Start fresh processes of every Gym server on the same ports (``workers``: new worker counts)."""
        self.stack.start(self.gym_servers, workers=workers)

    async def restore(
        self,
        gym: Coordinator,
        checkpoint_id: str,
        directory: str,
        scope: list[str],
        *,
        deadline_seconds: float = 120.0,
    ) -> RestoreOutcome:
        """Restore the episodes of ``scope`` from ``directory`` on every Gym server (no resume).

        An empty scope makes no call. The replacement attempts are installed under the
        next attempt index (``<rollout>-a1`` for a first attempt).
        """
        began = time.perf_counter()
        replies = await gym.restore(checkpoint_id, time.time() + deadline_seconds, directory, scope) if scope else {}
        return RestoreOutcome(replies, time.perf_counter() - began)

    # --- ending

    async def detach(self) -> dict[str, int]:
        """Leave every server running; close this side's HTTP sessions. Returns :attr:`pids`."""
        await self._close_sessions()
        return self.pids

    async def close(self) -> None:
        await self._close_sessions()
        await asyncio.to_thread(self.stack.close)
