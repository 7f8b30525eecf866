"""The Ray tests' controller: run inside the cluster's network namespace, write what it saw as JSON.

``python -m tests.ray.scenario NAME REQUEST.json RESULT.json``: NAME is one of :data:`SCENARIOS`;
the request carries the cluster's address, its id and node ids (to kill a node: every process
marked with it, see :mod:`gymckpt.testing.raycluster`) and the scenario's parameters. The result
holds what the test asserts on, or ``{"error": ..., "traceback": ...}``. A scenario closes
everything it placed, also when it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from gymckpt.control.coordination import runs_to_await
from gymckpt.demo.report import compare_results, result_of
from gymckpt.identity import capture_key, split_capture_key
from gymckpt.stack.harness import RolloutHarness, default_stack_spec, task_for
from gymckpt.testing.raycluster import RayCluster

TOKEN = "ray-token"
#: the bound of any one wait in a scenario (seconds)
WAIT = 120.0


def _log_dir(request: dict[str, Any]) -> str:
    """Where the scenario's servers keep their configs and logs: in the cluster's own directory."""
    return f"{request['base']}/servers"


def _cluster(request: dict[str, Any]) -> RayCluster:
    """A handle on the test's cluster, enough to kill its nodes (nothing is started here)."""
    cluster = RayCluster(Path(request["base"]), workers=len(request["node_ids"]) - 1)
    cluster.cluster_id = request["cluster_id"]
    return cluster


def _ray_alive_state() -> dict[str, int]:
    """Placement groups not removed, and actors not dead, in the whole cluster."""
    import ray
    from ray._private.state import state

    groups = ray.util.placement_group_table()
    actors = state.actor_table(None)
    return {
        "placement_groups": sum(1 for group in groups.values() if group.get("state") != "REMOVED"),
        "actors": sum(1 for actor in actors.values() if actor.get("State") != "DEAD"),
    }


def refuse(request: dict[str, Any]) -> dict[str, Any]:
    """A local directory as the checkpoint location of a stack spread over several nodes."""
    from gymckpt.errors import SharedStorageRequired
    from gymckpt.stack.ray import RayStack

    spec = {
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN},
        "ray": {
            "placement": "spread",
            "cpus_per_server": 0.5,
            "checkpoint_dir": request["local_dir"],
            "log_dir": _log_dir(request),
            # one server on each worker node: two nodes, whatever Ray's spread does
            "resources": {"a": {"node1": 0.01}, "b": {"node2": 0.01}},
        },
        "servers": [{"name": "a", "kind": "counter"}, {"name": "b", "kind": "counter"}],
    }
    seen: dict[str, Any] = {}
    with RayStack(spec, address=request["address"]) as stack:
        try:
            stack.place()
        except SharedStorageRequired as exc:
            seen["refused"] = str(exc)
        else:
            seen["refused"] = None
        seen["left_after_refusal"] = _ray_alive_state()
        # the same stack with S3 storage is accepted (no probe for an object store)
        stack.options = type(stack.options)(**{**stack.options.__dict__, "checkpoint_dir": "s3://bucket/run"})
        placed = stack.place()
        seen["accepted_nodes"] = sorted(set(placed.values()))
        seen["logs"] = [str(server.log_path) for server in stack.servers.values()]
    seen["left_after_close"] = _ray_alive_state() if _connect(request["address"]) else None
    return seen


def avoid(request: dict[str, Any]) -> dict[str, Any]:
    """A node the launcher counts as lost (here: alive, marked by hand) gets no server of a later placement."""
    from gymckpt.stack.ray import RayStack

    names_of = {node_id: name for name, node_id in request["node_ids"].items()}
    avoided = request["node_ids"][request["avoid"]]
    spec = {
        "ray": {"placement": "spread", "cpus_per_server": 0.5, "log_dir": _log_dir(request)},
        "servers": [{"name": f"s{index}", "kind": "counter"} for index in range(6)],
    }
    seen: dict[str, Any] = {}
    with RayStack(spec, address=request["address"]) as stack:
        seen["first"] = sorted({names_of.get(node, node) for node in stack.place().values()})
        stack.lost_nodes.add(avoided)
        seen["again"] = sorted({names_of.get(node, node) for node in stack.replace().values()})
        seen["lost_servers"] = stack.lost()
    seen["left_after_close"] = _ray_alive_state() if _connect(request["address"]) else None
    return seen


def _connect(address: str) -> bool:
    import logging

    import ray

    if not ray.is_initialized():
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    return True


def _drain(stack: Any, node_id: str) -> dict[str, Any]:
    """Ask Ray to drain ``node_id`` (as a preemption does, 60 s from now); what the launcher then sees."""
    import ray
    from ray.core.generated import autoscaler_pb2

    deadline_ms = int((time.time() + 60) * 1000)
    accepted, why = ray._private.worker.global_worker.gcs_client.drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.DRAIN_NODE_REASON_PREEMPTION, "a test's preemption", deadline_ms
    )
    seen = {"accepted": accepted, "rejection": why, "deadline_ms": deadline_ms, "seen": {}}
    deadline = time.monotonic() + 30
    while node_id not in seen["seen"] and time.monotonic() < deadline:
        seen["seen"] = stack.draining_nodes()
        time.sleep(0.1)
    return seen


async def _run_all(harness: RolloutHarness, keys: dict[str, int]) -> dict[str, Any]:
    replies = await asyncio.gather(*(harness.run(key, task_for(index)) for key, index in keys.items()))
    return {key: result_of(reply) for key, reply in zip(keys, replies, strict=True)}


async def _recover(request: dict[str, Any]) -> dict[str, Any]:
    from gymckpt.stack.ray import RayStack
    from gymckpt.stack.ray_recovery import recover
    from gymckpt.testing.moto import MotoEndpoint

    cluster = _cluster(request)
    names_of = {node_id: name for name, node_id in request["node_ids"].items()}
    rollouts = int(request.get("rollouts", 8))
    seen: dict[str, Any] = {}
    shared = request.get("shared_dir")  # a shared filesystem's path every node sees; else S3 (moto, in the namespace)
    with contextlib.nullcontext() if shared else MotoEndpoint() as endpoint:
        if endpoint is None:
            spec = default_stack_spec(token=TOKEN, token_delay_seconds=0.03, allowed_roots=[shared])
            root = shared
        else:
            endpoint.create_bucket("ckpt")
            options = endpoint.storage_options()
            spec = default_stack_spec(token=TOKEN, storage_options=options, token_delay_seconds=0.03)
            root = "s3://ckpt/run"
        spec["ray"] = {
            "placement": "spread",
            "cpus_per_server": 0.5,
            "checkpoint_dir": root,
            "log_dir": _log_dir(request),
            "resources": {"environment": {"worker": 0.01}},  # the environment starts on a worker node
        }
        directory = f"{root}/ck-1"
        stack = RayStack(spec, address=request["address"])
        harness = RolloutHarness(stack, TOKEN, request_timeout=WAIT)  # type: ignore[arg-type]
        try:
            placed = await asyncio.to_thread(stack.place)
            seen["first"] = {name: names_of.get(node, node) for name, node in placed.items()}
            gym = await harness.wait_ready(timeout=WAIT)
            reference = await _run_all(harness, {f"ref{i}": i for i in range(rollouts)})
            seen["reference_ok"] = all(result is not None for result in reference.values())

            # the interrupted run: every rollout started, the checkpoint once each has made a model call
            keys = {f"r{i}": i for i in range(rollouts)}
            runs = {key: asyncio.create_task(harness.run(key, task_for(index))) for key, index in keys.items()}
            deadline = time.monotonic() + WAIT
            while True:
                called = {str(call["call_id"]).rsplit(":", 1)[0] for call in await harness.model_calls()}
                if all(key in called or runs[key].done() for key in keys):
                    break
                assert time.monotonic() < deadline, f"not every rollout made a model call within {WAIT} s"
            in_flight = [key for key, task in runs.items() if not task.done()]
            cut = await harness.checkpoint(gym, "ck-1", directory, in_flight, deadline_seconds=WAIT)
            environment = next(reply for reply in cut.commits.values() if reply.kind == "environment")
            exported = sorted(set(environment.episode_ids) & set(cut.scope))
            seen["in_flight"], seen["exported"] = len(in_flight), len(exported)
            waiting = runs_to_await(in_flight, committed=exported, restarts=cut.prepared.restarts())
            if waiting:
                await asyncio.wait([runs[key] for key in waiting], timeout=10.0)
            finished = {
                key: result_of(task.result()) for key, task in runs.items() if task.done() and not task.exception()
            }

            # the node holding the environment is drained (a preemption notice), then dies: its raylet and every process on it
            victim = names_of[stack.servers["environment"].node_id]
            seen["draining"] = await asyncio.to_thread(_drain, stack, request["node_ids"][victim])
            seen["killed"] = victim
            seen["killed_servers"] = sorted(name for name, node in placed.items() if names_of.get(node) == victim)
            killed_at = time.monotonic()
            await asyncio.to_thread(cluster.kill_node, victim)
            lost = await asyncio.to_thread(stack.wait_lost, 30.0)
            seen["lost"], seen["detect_seconds"] = lost, time.monotonic() - killed_at
            seen["lost_nodes_at_loss"] = sorted(names_of.get(node, node) for node in stack.lost_nodes)
            for task in runs.values():
                task.cancel()
            await asyncio.gather(*runs.values(), return_exceptions=True)
            await gym.close()

            second: dict[str, Any] = {}

            async def kill_during_restore(attempt: int) -> None:
                """The first placement after the loss loses another worker node holding servers, before its restore."""
                if attempt != 0 or not request.get("second_loss", True):
                    return
                now = {name: names_of.get(node, node) for name, node in stack.nodes().items()}
                second["placed"] = now
                others = sorted({node for node in now.values() if node not in ("head", victim)})
                if others:
                    second["killed"] = others[0]
                    await asyncio.to_thread(cluster.kill_node, others[0])

            recovery = await recover(
                stack,
                harness,
                "ck-1",
                directory,
                exported,
                workers=2,
                before_restore=kill_during_restore,
                keep_resources=False,  # the node holding "worker" may be the next to go
            )
            seen["second"] = second
            seen["lost_nodes"] = sorted(names_of.get(node, node) for node in stack.lost_nodes)
            seen["failures"] = recovery.failures
            seen["placements"] = [{n: names_of.get(node, node) for n, node in p.items()} for p in recovery.placements]
            kinds = recovery.coordinator.kinds
            seen["restored"] = sorted(
                key
                for url, reply in recovery.restored.replies.items()
                if kinds[url].kind == "environment"
                for key in reply.restored
            )

            # continue every exported rollout; start over the ones neither exported nor finished
            gym = recovery.coordinator
            over = sorted(key for key in keys if key not in exported and finished.get(key) is None)
            if over:
                await gym.retire(over, checkpoint_id="ck-1", deadline_ts=time.time() + WAIT)

            async def next_attempt(key: str) -> dict[str, Any]:
                rollout, attempt = split_capture_key(key)
                return await harness.run(capture_key(rollout, attempt + 1), task_for(keys[key]))

            replies = await asyncio.gather(*(next_attempt(key) for key in [*exported, *over]))
            final = dict(finished)
            final.update({key: result_of(reply) for key, reply in zip([*exported, *over], replies, strict=True)})
            expected = {key: reference[f"ref{index}"] for key, index in keys.items()}
            lost_results, differing = compare_results(expected, final)
            seen["started_over"] = len(over)
            seen["lost_results"], seen["differing"] = lost_results, differing
            seen["continued_equal"] = [key for key in exported if key not in differing and final.get(key) is not None]
            await gym.close()
        finally:
            await harness.close()
        seen["left_after_close"] = _ray_alive_state() if _connect(request["address"]) else None
    return seen


def recover_scenario(request: dict[str, Any]) -> dict[str, Any]:
    return asyncio.run(asyncio.wait_for(_recover(request), 600))


def _request_drain(node_id: str, seconds: float) -> dict[str, Any]:
    """Ask Ray to drain ``node_id`` as a preemption does, its deadline ``seconds`` from now."""
    import ray
    from ray.core.generated import autoscaler_pb2

    deadline_ms = int((time.time() + seconds) * 1000)
    accepted, why = ray._private.worker.global_worker.gcs_client.drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.DRAIN_NODE_REASON_PREEMPTION, "a test's preemption", deadline_ms
    )
    return {"accepted": accepted, "rejection": why, "deadline_ms": deadline_ms}


async def _drain_mid_checkpoint(request: dict[str, Any]) -> dict[str, Any]:
    """A node holding servers is drained while the guard's checkpoint is open (after prepare replied):
    the launcher's drain watcher tells the guard, which finishes that checkpoint and starts no other."""
    from gymckpt.control.coordination import Coordinator
    from gymckpt.control.preemption import PreemptionGuard
    from gymckpt.stack.ray import RayStack
    from gymckpt.store import verify
    from gymckpt.testing.moto import MotoEndpoint

    class Hooked(Coordinator):
        """Awaits ``hook`` once prepare replied (the checkpoint is open then)."""

        hook: Any = None

        async def prepare(self, checkpoint_id: str, deadline_ts: float) -> Any:
            prepared = await super().prepare(checkpoint_id, deadline_ts)
            hook, self.hook = self.hook, None
            if hook is not None:
                await hook()
            return prepared

    names_of = {node_id: name for name, node_id in request["node_ids"].items()}
    seen: dict[str, Any] = {}
    with MotoEndpoint() as endpoint:
        endpoint.create_bucket("ckpt")
        options = endpoint.storage_options()
        spec = default_stack_spec(token=TOKEN, storage_options=options, token_delay_seconds=0.03)
        spec["ray"] = {
            "placement": "spread",
            "cpus_per_server": 0.5,
            "checkpoint_dir": "s3://ckpt/drain",
            "log_dir": _log_dir(request),
            "resources": {"environment": {"node1": 0.01}, "agent": {"node1": 0.01}},
        }
        stack = RayStack(spec, address=request["address"])
        harness = RolloutHarness(stack, TOKEN, request_timeout=WAIT)  # type: ignore[arg-type]
        gym: Hooked | None = None
        runs: dict[str, asyncio.Task[Any]] = {}
        try:
            placed = await asyncio.to_thread(stack.place)
            seen["placed"] = {name: names_of.get(node, node) for name, node in placed.items()}
            await (await harness.wait_ready(timeout=WAIT)).close()
            gym = Hooked([harness.urls[name] for name in harness.gym_servers], token=TOKEN, storage_options=options)
            (await gym.discover()).raise_for_problems()
            runs = {f"d{i}": asyncio.create_task(harness.run(f"d{i}", task_for(i))) for i in range(4)}
            deadline = time.monotonic() + WAIT
            while not {str(c["call_id"]).rsplit(":", 1)[0] for c in await harness.model_calls()} >= set(runs):
                assert time.monotonic() < deadline, f"not every rollout made a model call within {WAIT} s"
                await asyncio.sleep(0.05)
            guard = PreemptionGuard(
                gym,
                grace_seconds=WAIT,
                checkpoint_root="s3://ckpt/drain",
                in_flight=lambda: [key for key, run in runs.items() if not run.done()],
                signals=(),
            )
            node = stack.servers["environment"].node_id
            seen["drained"] = names_of.get(node, node)

            async def drain_while_open() -> None:
                seen["open_at_drain"] = guard.open_checkpoint
                seen["drain"] = await asyncio.to_thread(_request_drain, node, float(request.get("drain_seconds", 60)))
                until = time.monotonic() + WAIT
                while not guard.noticed and time.monotonic() < until:
                    await asyncio.sleep(0.05)

            gym.hook = drain_while_open
            async with guard:
                with stack.watch_drains(guard.notice, poll_seconds=0.5) as watcher:
                    outcome = await guard.checkpoint("ck-drain")
                    result = await guard.wait()
                    # the drain stays: polls after the notice tell the guard nothing more
                    after = watcher.polls
                    until = time.monotonic() + WAIT
                    while watcher.polls < after + 3 and time.monotonic() < until:
                        await asyncio.sleep(0.1)
                    seen["polls_after"] = watcher.polls - after
                    seen["noticed"] = dict(watcher.noticed)
                    seen["watch_error"] = watcher.error
            seen["notices"] = guard.notices
            seen["result"] = {
                "reason": result.reason,
                "grace_seconds": result.grace_seconds,
                "seconds": result.seconds,
                "finished_open": result.finished_open,
                "ok": result.ok,
                "line": result.line(),
            }
            seen["checkpoint"] = {
                "id": outcome.checkpoint_id,
                "published": outcome.published,
                "stopped": outcome.stopped,
                "continued": list(outcome.continued),
                "error": outcome.error,
            }
            seen["node_id"] = node
            seen["verified"] = (await asyncio.to_thread(verify, outcome.directory, **options)).ok
        finally:
            for run in runs.values():
                run.cancel()
            await asyncio.gather(*runs.values(), return_exceptions=True)
            if gym is not None:
                await gym.close()
            await harness.close()
    return seen


def drain(request: dict[str, Any]) -> dict[str, Any]:
    return asyncio.run(asyncio.wait_for(_drain_mid_checkpoint(request), 600))


def head(request: dict[str, Any]) -> dict[str, Any]:
    """The head node dies under a placed stack: the launcher says so, once, and closes without the cluster."""
    from gymckpt.errors import RayHeadLost
    from gymckpt.stack.ray import RayStack

    spec = {
        "ray": {"cpus_per_server": 0.5, "log_dir": _log_dir(request)},
        "servers": [{"name": "a", "kind": "counter"}, {"name": "b", "kind": "counter"}],
    }
    seen: dict[str, Any] = {}
    stack = RayStack(spec, address=request["address"])
    try:
        seen["placed"] = stack.place()
        _cluster(request).kill_node("head")
        deadline = time.monotonic() + WAIT
        while "head_error" not in seen and time.monotonic() < deadline:
            try:
                seen["lost"] = stack.wait_lost(2.0)
            except RayHeadLost as exc:
                seen["head_error"] = {"type": type(exc).__name__, "message": str(exc)}
    finally:
        stack.close()
    seen["closed"] = True
    return seen


def state(request: dict[str, Any]) -> dict[str, Any]:
    """What is placed on the cluster now (nothing, after a stack closed)."""
    _connect(request["address"])
    return _ray_alive_state()


SCENARIOS = {
    "avoid": avoid,
    "refuse": refuse,
    "recover": recover_scenario,
    "state": state,
    "head": head,
    "drain": drain,
}


def main(argv: list[str]) -> int:
    name, request_file, result_file = argv
    request = json.loads(Path(request_file).read_text())
    try:
        result = SCENARIOS[name](request)
    except BaseException as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(result_file).write_text(json.dumps(result, indent=2, sort_keys=True, default=str))
    if name == "head":  # Ray's exit handlers would wait for a GCS that is gone
        sys.stdout.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
