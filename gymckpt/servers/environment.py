"""A single-turn environment server: seed, invoke the agent, close it, verify, return.

Each stage is an episode step with a boundary after it, so a checkpoint taken mid-episode
continues from the last completed stage after a crash: seeding and the agent invocation
replay, closing the agent waits, verification uses the mode the resources server reported
on its seed reply (``x-ng-checkpoint-verify``), and its result is recorded before return.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import Request  # noqa: TC002 - FastAPI resolves handler annotations at runtime
from starlette.responses import Response  # noqa: TC002 - FastAPI resolves handler annotations at runtime

from gymckpt.control.responses import error_response
from gymckpt.errors import DownstreamError, GymckptError
from gymckpt.identity import EpisodeId, episode_key
from gymckpt.participants.environment import EnvironmentParticipant
from gymckpt.participants.rollout import episode_context
from gymckpt.participants.steps import StepMode
from gymckpt.servers.base import Downstream, ServerConfig, build_app
from gymckpt.servers.json_body import FastJSONResponse, read_json_object

if TYPE_CHECKING:
    from fastapi import FastAPI

    from gymckpt.participants.steps import Episode

__all__ = ["EnvironmentConfig", "build_environment_app", "run_stages"]


class EnvironmentConfig(ServerConfig):
    """Where the environment's agent and resources servers are."""

    instance: str = "environment-0"
    agent_url: str
    resources_url: str


async def run_stages(
    config: EnvironmentConfig,
    downstream: Downstream,
    episode_id: EpisodeId,
    task: dict[str, Any],
    episode: Episode | None,
) -> dict[str, Any]:
    """Run the episode from its boundary (``episode.boundary``; the start when None) to its result."""
    state: dict[str, Any] = dict(episode.boundary) if episode is not None and episode.boundary else {"stage": "seed"}
    task_input = task.get("task_input", {})

    async def step(mode: StepMode | str, run: Any, after: Any) -> None:
        nonlocal state
        if episode is None:
            state = after(await run())
            return
        for attempt in range(_PARKED_RETRIES):
            try:
                await episode.step(mode, run, boundary=after)
                break
            except DownstreamError as exc:
                if exc.wire_code != "checkpoint_parked" or attempt == _PARKED_RETRIES - 1:
                    raise
                await _until_reopened(episode, attempt)
        state = dict(episode.boundary)  # type: ignore[arg-type]

    with episode_context(episode_id):
        if state["stage"] == "seed":

            async def seed() -> dict[str, Any]:
                reply, headers = await downstream.post(
                    config.resources_url, "/seed_session", {"task_input": task_input}
                )
                return {"session": reply, "verify_mode": headers.get("x-ng-checkpoint-verify", "wait")}

            await step(StepMode.REPLAY, seed, lambda seeded: {"stage": "invoke_agent", **seeded})
        if state["stage"] == "invoke_agent":
            seeded = dict(state)

            async def invoke() -> dict[str, Any]:
                body = {
                    "input": [{"role": "user", "content": str(task_input.get("prompt", ""))}],
                    "resources_url": config.resources_url,
                    "tools": task_input.get("tools", []),
                }
                reply, _ = await downstream.post(config.agent_url, "/v1/responses", body)
                return reply

            await step(StepMode.REPLAY, invoke, lambda reply: {**seeded, "stage": "close_agent", "agent": reply})
        if state["stage"] == "close_agent":
            invoked = dict(state)

            async def close() -> dict[str, Any]:
                # a wait step: on the awaited lane, never queued behind the long /v1/responses calls
                reply, _ = await downstream.post(config.agent_url, "/close_session", {}, awaited=True)
                return reply

            await step(StepMode.WAIT, close, lambda _: {**invoked, "stage": "verify"})
        if state["stage"] == "verify":
            closed = dict(state)
            agent = closed.get("agent", {})

            mode = StepMode.REPLAY if closed.get("verify_mode") == "replay" else StepMode.WAIT

            async def verify() -> dict[str, Any]:
                body = {"response": agent.get("output_text", ""), "expected": agent.get("expected")}
                reply, _ = await downstream.post(config.resources_url, "/verify", body, awaited=mode is StepMode.WAIT)
                return reply

            await step(mode, verify, lambda reply: {**closed, "stage": "done", "reward": reply.get("reward")})
    return {"reward": state.get("reward"), "response": state.get("agent", {}).get("output_text")}


#: how often a step refused with ``checkpoint_parked`` (a downstream closed for a checkpoint) is tried again
_PARKED_RETRIES = 40


async def _until_reopened(episode: Episode, attempt: int) -> None:
    """Wait to call again after a downstream refused with ``checkpoint_parked``.

    The environment closes first and reopens last, so its own admission normally reopens
    after the downstream's: the episode parks until then. If it is open (the downstream
    closed on its own), a short backoff, doubling to 2 s.
    """
    if episode.closed:
        await episode.park()
    else:
        await asyncio.sleep(min(0.05 * 2**attempt, 2.0))


def build_environment_app(config: EnvironmentConfig) -> FastAPI:
    """The environment server's app; checkpointing installed only when the config enables it."""
    participant = EnvironmentParticipant(config.instance) if config.checkpoint.enabled else None
    app, _, downstream = build_app("gymckpt environment", config, participant)

    @app.post("/run")
    async def run(request: Request) -> Response:
        body = await read_json_object(request)  # orjson: a cheap route's body costs more through FastAPI
        key = body.get("episode_id")
        task = body.get("task") or {}
        task_id = task.get("task_id")
        try:
            episode_id = EpisodeId.from_capture_key(episode_key(key))
            episode = await participant.start_run(episode_id.capture_key, task) if participant is not None else None
        except GymckptError as exc:
            return error_response(exc)
        work = asyncio.create_task(run_stages(config, downstream, episode_id, task, episode))
        if participant is not None and episode is not None:
            participant.track(episode_id.capture_key, work)
        try:
            result = await work
        except asyncio.CancelledError:
            if work.cancelled() and not _cancelling():
                return _failure(episode_id, task_id, "retired", terminal=True)
            raise
        except DownstreamError as exc:
            return _failure(episode_id, task_id, str(exc), terminal=False)
        finally:
            if work.done():
                downstream.forget_episode(episode_id)
            if participant is not None and episode is not None and work.done():
                participant.end_run(episode_id.capture_key, episode)
        return FastJSONResponse({"episode_id": episode_id.to_wire(), "task_id": task_id, "result": result})

    return app


def _cancelling() -> bool:
    current = asyncio.current_task()
    return current is not None and current.cancelling() > 0


def _failure(episode_id: EpisodeId, task_id: Any, reason: str, *, terminal: bool) -> Response:
    return FastJSONResponse(
        {
            "episode_id": episode_id.to_wire(),
            "task_id": task_id,
            "failure": {"failure_reason": reason, "terminal": terminal},
        }
    )
