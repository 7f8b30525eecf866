"""NeMo Gym's SimpleAgent + NeMo Gym's stateful counter + gymckpt's policy model and inference backend.

Every server is a real process: the agent and the counter are NeMo Gym's own code (Python
3.12, nemo-gym 0.4.0) served by configuration (``gymckpt serve --app
gymckpt.integrations.nemo_gym:app``); the policy model and the inference backend are
gymckpt's. 32 rollouts run through the agent's ``/run`` at once; mid-conversation a
checkpoint is committed and published, every Gym server (model, agent, counter) is SIGKILLed,
fresh processes restore it, and each rollout's replacement attempt is sent to ``/run`` again.
The agent's journal answers the calls made before the checkpoint; the conversation goes on.

Checked against an uninterrupted run of the same tasks: every rollout's reward and its
final counter are the same, and no model call whose reply the agent had received before
the checkpoint is made again (the inference backend's log holds each prompt of a rollout
once, except the one call in flight at the checkpoint, asked again by the replacement), and
every generation the policy model cut at the checkpoint is continued by the replacement's
call from its cut prefix (the backend's log: ``continued_from`` > 0), never started over.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from gymckpt.control.coordination import Coordinator
from gymckpt.identity import EpisodeId
from gymckpt.store import open_store

from .nemo_support import TOKEN, NeMoServer, kill_all, nemo_python

if TYPE_CHECKING:
    from collections.abc import Iterable

WAIT = 240.0
ROLLOUTS = 32
TOOL = {
    "type": "function",
    "name": "increment_counter",
    "description": "add count to the counter",
    "parameters": {
        "type": "object",
        "properties": {"count": {"type": "integer", "description": "how much"}},
        "required": ["count"],
        "additionalProperties": False,
    },
    "strict": True,
}

pytestmark = pytest.mark.slow


def _stack_configs(root: Path, servers: dict[str, NeMoServer]) -> None:
    checkpoint = {"enabled": True, "control_auth_token": TOKEN, "allowed_roots": [str(root)]}
    instances = {
        "counter": {
            "resources_servers": {
                "example_session_state_mgmt": {
                    "entrypoint": "app.py",
                    "domain": "agent",
                    "host": "127.0.0.1",
                    "port": servers["counter"].port,
                }
            }
        },
        "simple_agent": {
            "responses_api_agents": {
                "simple_agent": {
                    "entrypoint": "app.py",
                    "host": "127.0.0.1",
                    "port": servers["agent"].port,
                    "resources_server": {"type": "resources_servers", "name": "counter"},
                    "model_server": {"type": "responses_api_models", "name": "policy_model"},
                    "max_steps": 10,
                }
            }
        },
        "policy_model": {
            "responses_api_models": {
                "gymckpt_policy": {"entrypoint": "app.py", "host": "127.0.0.1", "port": servers["model"].port}
            }
        },
    }
    servers["counter"].write_config(
        {
            "checkpoint": checkpoint,
            "nemo_gym": {"serve": "counter", "session_state": "session_id_to_counter"},
            **instances,
        }
    )
    servers["agent"].write_config({"checkpoint": checkpoint, "nemo_gym": {"serve": "simple_agent"}, **instances})
    servers["inference"].write_config({"checkpoint": checkpoint, "token_delay_seconds": 0.05})
    servers["model"].write_config(
        {"checkpoint": checkpoint, "inference_url": servers["inference"].url, "tool_turns": 3, "instance": "policy"}
    )


def row(index: int, rollout_id: str, expected_count: int, attempt: int = 0) -> dict[str, Any]:
    """A NeMo Gym dataset row for the agent's /run: the prompt, the counter's tool, its seed and expectation."""
    return {
        "responses_create_params": {"input": [{"role": "user", "content": f"count for task {index}"}], "tools": [TOOL]},
        "initial_count": index,
        "expected_count": expected_count,
        "_ng_rollout_id": rollout_id,
        "_ng_attempt_index": attempt,
    }


class Stack:
    def __init__(self, root: Path) -> None:
        python = nemo_python()
        here = Path(sys.executable)
        self.root = root
        self.servers = {
            "inference": NeMoServer("inference", root, here, kind="inference"),
            "model": NeMoServer("model", root, here, kind="model"),
            "counter": NeMoServer("counter", root, python),
            "agent": NeMoServer("agent", root, python),
        }
        self.gym = [self.servers[name] for name in ("model", "counter", "agent")]
        _stack_configs(root, self.servers)
        self.session = aiohttp.ClientSession(
            cookie_jar=aiohttp.DummyCookieJar(), timeout=aiohttp.ClientTimeout(total=WAIT)
        )

    async def start(self, names: list[str], workers: int = 1) -> None:
        """Start ``names``, each Gym server with ``workers`` workers (the inference backend, no Gym server, one)."""
        count = {name: 1 if name == "inference" else workers for name in names}
        for name in names:
            self.servers[name].start(workers=count[name])
        for name in names:
            path = "/health" if name in ("inference", "model") else "/"
            await self.servers[name].wait_up(self.session, path=path, workers=count[name])

    def coordinator(self) -> Coordinator:
        return Coordinator([server.url for server in self.gym], token=TOKEN, probe_timeout=WAIT)

    async def run(self, body: dict[str, Any]) -> dict[str, Any]:
        async with self.session.post(self.servers["agent"].url + "/run", json=body) as reply:
            data = await reply.json()
            assert reply.status == 200, (body["_ng_rollout_id"], data, self.servers["agent"].log_tail())
            return data  # type: ignore[no-any-return]

    async def counter_of(self, key: str) -> int:
        url = f"{self.servers['counter'].url}/ng-rollout/{key}/get_counter_value"
        async with self.session.post(url, json={}) as reply:
            return int((await reply.json())["count"])

    async def model_calls(self) -> list[dict[str, Any]]:
        async with self.session.get(self.servers["inference"].url + "/calls") as reply:
            return await reply.json()  # type: ignore[no-any-return]

    async def decoding(self, *, paused: bool) -> list[dict[str, Any]]:
        """Hold the inference backend's generations before their next token, or let them go on; those decoding."""
        url = self.servers["inference"].url + "/ng-control/v1/decoding"
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with self.session.post(url, json={"paused": paused}, headers=headers) as reply:
            assert reply.status == 200, await reply.text()
            return (await reply.json())["generations"]  # type: ignore[no-any-return]

    async def close(self, tasks: Iterable[asyncio.Task[Any]] = ()) -> None:
        """Cancel ``tasks`` (the rollouts still running) and wait for them, then stop every server."""
        tasks = list(tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.session.close()
        for server in self.servers.values():
            server.close()


def counted(index: int, result: dict[str, Any]) -> int:
    """The counter a rollout's tool calls leave: its initial count plus every increment the model asked for."""
    calls = [item for item in result["response"]["output"] if item.get("type") == "function_call"]
    assert calls, result
    return index + sum(json.loads(call["arguments"])["count"] for call in calls)


def _rollout_of(call: dict[str, Any]) -> str:
    return EpisodeId.from_capture_key(str(call["call_id"]).rsplit(":", 1)[0]).rollout_id


def _cuts(root: Path, checkpoint: str) -> dict[str, tuple[str, int]]:
    """The policy model's cuts at ``checkpoint``: rollout → (the cut call's prompt digest, its prefix's tokens)."""
    store = open_store(str(root))
    try:
        manifest = store.read_manifest(checkpoint, kind="model", instance="policy")
        records = list(store.read_records(manifest))
    finally:
        store.close()
    return {
        EpisodeId.from_capture_key(record["episode_id"]).rollout_id: (
            cut["request_digest"],
            int(cut["continuation"]["prefix_token_count"]),
        )
        for record in records
        for cut in record["generation_cuts"]
    }


async def _until(condition: Any, what: str, seconds: float = WAIT) -> None:
    deadline = time.monotonic() + seconds
    while not await condition():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        await asyncio.sleep(0.05)


def _crash_and_continue(tmp_path: Path, *, workers: int, restore_workers: int) -> None:
    async def scenario() -> None:
        stack = Stack(tmp_path)
        runs: dict[str, asyncio.Task[dict[str, Any]]] = {}
        try:
            await stack.start(["inference", "model", "counter", "agent"], workers=workers)
            # the uninterrupted run: each task's final counter, and the reward its expectation then gets
            reference = await asyncio.gather(*(stack.run(row(index, f"ref-{index}", -1)) for index in range(ROLLOUTS)))
            assert all(result["reward"] == 0.0 for result in reference)
            counters = {index: counted(index, result) for index, result in enumerate(reference)}
            if workers == 1:  # with several workers only the rollout's routing cookie finds its worker
                assert counters == {index: await stack.counter_of(f"ref-{index}") for index in range(ROLLOUTS)}
            expected = {index: counters[index] + (index % 2) for index in range(ROLLOUTS)}  # odd ones expect wrong
            rewards = {index: float(index % 2 == 0) for index in range(ROLLOUTS)}
            mark = len(await stack.model_calls())

            keys = {f"run-{index}": index for index in range(ROLLOUTS)}
            runs = {
                key: asyncio.create_task(stack.run(row(index, key, expected[index]))) for key, index in keys.items()
            }

            async def mid_conversation() -> bool:  # every rollout has received a model reply and is going on
                made = collections.Counter(_rollout_of(call) for call in (await stack.model_calls())[mark:])
                return all(made[key] >= 2 for key in keys)

            await _until(mid_conversation, "every rollout two model calls in")

            async def held_mid_generation() -> bool:  # decoding paused while a generation has tokens and more to make
                held = await stack.decoding(paused=True)
                if any(0 < generation["tokens"] < generation["max_tokens"] for generation in held):
                    return True
                await stack.decoding(paused=False)
                return False

            # on a loaded machine every generation may be between tokens 0 and max at no one moment by chance
            await _until(held_mid_generation, "a generation held mid-way")
            directory = str(tmp_path / "ckpt-agent")
            async with stack.coordinator() as gym:
                assert (await gym.discover()).ok
                prepared = await gym.prepare("ckpt-agent", time.time() + WAIT)
                assert prepared.prepared, prepared.blockers()
                finished = {key for key, task in runs.items() if task.done()}
                scope = prepared.continued([key for key in keys if key not in finished])
                commits = await gym.commit("ckpt-agent", time.time() + WAIT, directory, scope)
                await gym.publish(directory, commits)
            await stack.decoding(paused=False)
            results = {key: runs[key].result() for key in finished}
            kill_all(stack.gym)
            await asyncio.gather(*runs.values(), return_exceptions=True)  # their connections died with the agent
            before_restore = len(await stack.model_calls())

            await stack.start(["model", "counter", "agent"], workers=restore_workers)
            async with stack.coordinator() as gym:
                assert (await gym.discover()).ok
                await gym.restore("restore-agent", time.time() + WAIT, directory, scope)
                await gym.resume("restore-agent", time.time() + WAIT)
            attempts = {EpisodeId.from_capture_key(key).next_attempt().capture_key: key for key in scope}
            continued = await asyncio.gather(
                *(stack.run(row(keys[key], key, expected[keys[key]], attempt=1)) for key in attempts.values())
            )
            results.update({attempt: result for attempt, result in zip(attempts, continued, strict=True)})

            for key, index in keys.items():
                final = next(attempt for attempt in (f"{key}-a1", key) if attempt in results)
                # the counter's own /verify compared its state with the expectation: the reward says it matched
                assert results[final]["reward"] == rewards[index], (final, results[final]["reward"])
                assert counted(index, results[final]) == counters[index], final
                if restore_workers == 1 and final != key:  # a rollout finished before the crash kept no state
                    assert await stack.counter_of(final) == counters[index], final
            log = await stack.model_calls()
            # the policy model's cuts: the replacement's same call continues each from its prefix (an empty
            # prefix, cut before its first token, is generated from the start: there is nothing to continue)
            cuts = _cuts(tmp_path, "ckpt-agent")
            assert any(prefix for _, prefix in cuts.values()), f"no generation was mid-way at the checkpoint: {cuts}"
            for rollout, (prompt, prefix) in cuts.items():
                (replacement,) = [
                    call
                    for call in log[before_restore:]
                    if _rollout_of(call) == rollout and call["prompt_sha256"] == prompt
                ]
                assert int(replacement["continued_from"]) == prefix, (rollout, prefix, replacement["call_id"])
            made_again = 0
            for key in keys:
                prompts = collections.Counter(call["prompt_sha256"] for call in log[mark:] if _rollout_of(call) == key)
                twice = [prompt for prompt, count in prompts.items() if count > 1]
                assert len(twice) <= 1, f"{key}: completed model calls made again: {twice}"
                made_again += len(twice)
            assert len(log) > before_restore  # the replacements went on talking to the model
            print(
                f"scope {len(scope)} finished {len(finished)} made_again {made_again} calls {len(log) - mark} "
                f"after {len(log) - before_restore} cuts {len(cuts)}"
            )
        finally:
            await stack.close(runs.values())

    asyncio.run(asyncio.wait_for(scenario(), 6 * WAIT))


def test_simple_agent_and_stateful_counter_continue_after_sigkill(tmp_path: Path) -> None:
    _crash_and_continue(tmp_path, workers=1, restore_workers=1)


def test_two_workers_per_server_restored_onto_three(tmp_path: Path) -> None:
    _crash_and_continue(tmp_path, workers=2, restore_workers=3)


def test_turn_loops_called_directly_continue_after_sigkill(tmp_path: Path) -> None:
    """A trainer that calls the agent's ``/v1/responses`` under the rollout prefix (no ``/run``, no seed)."""

    async def scenario() -> None:
        stack = Stack(tmp_path)
        loops: dict[str, asyncio.Task[dict[str, Any]]] = {}

        async def turn_loop(key: str, index: int) -> dict[str, Any]:
            url = f"{stack.servers['agent'].url}/ng-rollout/{key}/v1/responses"
            async with stack.session.post(url, json=row(index, key, 0)["responses_create_params"]) as reply:
                data = await reply.json()
                assert reply.status == 200, (key, data)
                return data  # type: ignore[no-any-return]

        def counted_loop(result: dict[str, Any]) -> int:
            return counted(0, {"response": result})

        try:
            await stack.start(["inference", "model", "counter", "agent"])
            reference = await asyncio.gather(*(turn_loop(f"ref-{index}", index) for index in range(8)))
            counters = [counted_loop(result) for result in reference]
            assert counters == [await stack.counter_of(f"ref-{index}") for index in range(8)]
            mark = len(await stack.model_calls())
            keys = {f"loop-{index}": index for index in range(8)}
            loops = {key: asyncio.create_task(turn_loop(key, index)) for key, index in keys.items()}

            async def mid_conversation() -> bool:
                made = collections.Counter(_rollout_of(call) for call in (await stack.model_calls())[mark:])
                return all(made[key] >= 2 for key in keys)

            await _until(mid_conversation, "every turn loop two model calls in")
            directory = str(tmp_path / "ckpt-loops")
            async with stack.coordinator() as gym:
                assert (await gym.discover()).ok
                prepared = await gym.prepare("ckpt-loops", time.time() + WAIT)
                assert prepared.prepared, prepared.blockers()
                scope = prepared.continued([key for key, task in loops.items() if not task.done()])
                commits = await gym.commit("ckpt-loops", time.time() + WAIT, directory, scope)
                await gym.publish(directory, commits)
            assert scope
            kill_all(stack.gym)
            await asyncio.gather(*loops.values(), return_exceptions=True)
            await stack.start(["model", "counter", "agent"])
            async with stack.coordinator() as gym:
                assert (await gym.discover()).ok
                await gym.restore("restore-loops", time.time() + WAIT, directory, scope)
                await gym.resume("restore-loops", time.time() + WAIT)
            for key in scope:
                attempt = EpisodeId.from_capture_key(key).next_attempt().capture_key
                result = await turn_loop(attempt, keys[key])
                assert counted_loop(result) == counters[keys[key]], attempt  # the whole conversation, as uninterrupted
                assert await stack.counter_of(attempt) == counters[keys[key]], attempt
            log = await stack.model_calls()
            for key in scope:
                prompts = collections.Counter(call["prompt_sha256"] for call in log[mark:] if _rollout_of(call) == key)
                assert sum(1 for count in prompts.values() if count > 1) <= 1, key
        finally:
            await stack.close(loops.values())

    asyncio.run(asyncio.wait_for(scenario(), 6 * WAIT))
