"""A running reference stack and the controller's side of it: rollouts, checkpoints, crashes.

The demo and the process-level tests drive the stack through this: ``/run`` calls to the
environment server, coordination (:class:`~gymckpt.control.coordination.Coordinator`) for
prepare, commit, publish, resume and restore, and SIGKILL of every Gym server's process
group for a crash. The inference backend is not a Gym server: it survives a crash, and
its call log tells which model calls a restore made again.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from gymckpt.control.coordination import Coordinator
from gymckpt.servers.stack import Stack, load_stack

if TYPE_CHECKING:
    from pathlib import Path

    from gymckpt.control.coordination import PrepareResult
    from gymckpt.control.models import CommitReply

__all__ = ["CheckpointOutcome", "RolloutHarness", "default_stack_spec", "task_for"]

TOOLS = [{"type": "function", "name": "increment"}]


def default_stack_spec(
    *,
    token: str,
    storage_options: dict[str, Any] | None = None,
    agent_session_hooks: bool = True,
    token_delay_seconds: float = 0.01,
    tool_turns: int = 3,
    resources: str = "counter",
    allowed_roots: list[str] | None = None,
) -> dict[str, Any]:
    """The reference stack: inference, model, a resources server, the agent, the environment."""
    checkpoint: dict[str, Any] = {"enabled": True, "control_auth_token": token}
    if storage_options:
        checkpoint["storage_options"] = storage_options
    if allowed_roots:
        checkpoint["allowed_roots"] = allowed_roots
    return {
        "checkpoint": checkpoint,
        "servers": [
            {"name": "inference", "kind": "inference", "config": {"token_delay_seconds": token_delay_seconds}},
            {"name": "model", "kind": "model", "config": {"inference_url": "{inference}", "tool_turns": tool_turns}},
            {"name": "resources", "kind": resources},
            {
                "name": "agent",
                "kind": "agent",
                "config": {"model_url": "{model}", "session_hooks": agent_session_hooks},
            },
            {
                "name": "environment",
                "kind": "environment",
                "config": {"agent_url": "{agent}", "resources_url": "{resources}"},
            },
        ],
    }


def task_for(index: int) -> dict[str, Any]:
    """The task of rollout ``index``: a prompt and the counter's tool."""
    return {
        "task_id": {"taskset": "counter-demo", "task_id": f"task-{index}"},
        "task_input": {"prompt": f"count for task {index}", "tools": TOOLS},
    }


@dataclass
class CheckpointOutcome:
    """What one checkpoint did."""

    checkpoint_id: str
    directory: str
    prepared: PrepareResult
    scope: list[str]
    commits: dict[str, CommitReply]
    prepare_seconds: float
    commit_seconds: float
    published: dict[str, Any] = field(default_factory=dict)

    @property
    def bytes_written(self) -> int:
        return sum(reply.records_bytes for reply in self.commits.values())


class RolloutHarness:
    """A stack of real server processes and the controller that drives them."""

    def __init__(self, stack: Stack, token: str) -> None:
        self.stack = stack
        self.token = token
        self.gym_servers = [name for name, server in stack.servers.items() if server.kind != "inference"]
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def start(cls, spec: dict[str, Any], *, workdir: Path | None = None) -> RolloutHarness:
        """Open the stack's sockets and start every server."""
        token = str((spec.get("checkpoint") or {}).get("control_auth_token", ""))
        stack = load_stack(spec, workdir=workdir)
        try:
            stack.start()
        except BaseException:
            stack.close()
            raise
        return cls(stack, token)

    @property
    def urls(self) -> dict[str, str]:
        return self.stack.urls

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

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # no connection limit: every rollout's /run is in flight at once, as a trainer's are
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300)
            )
        return self._session

    async def run(self, episode_id: str, task: dict[str, Any]) -> dict[str, Any]:
        """One ``/run`` of the environment server; the reply body (a result or a failure)."""
        url = f"{self.urls['environment']}/run"
        async with self._client().post(url, json={"episode_id": episode_id, "task": task}) as response:
            body = await response.json()
            body.setdefault("status", response.status)
            return body  # type: ignore[no-any-return]

    async def model_calls(self) -> list[dict[str, Any]]:
        """Every generation the inference backend completed, in order."""
        async with self._client().get(f"{self.urls['inference']}/calls") as response:
            return await response.json()  # type: ignore[no-any-return]

    async def reset_model_calls(self) -> None:
        async with self._client().post(f"{self.urls['inference']}/calls/reset") as response:
            await response.read()

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
        if not prepared.ready:
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
        """SIGKILL every Gym server's process group (the inference backend survives)."""
        self.stack.kill(self.gym_servers)

    def restart(self) -> None:
        """Start fresh processes of every Gym server on the same ports."""
        self.stack.start(self.gym_servers)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        await asyncio.to_thread(self.stack.close)
