"""The stack on a real Ray cluster: a head and two worker raylets in a network namespace the test made.

One cluster for the module (:func:`tests.ray.conftest.cluster`); the tests that kill nodes come
last. The controller of each scenario is a Ray driver in the namespace
(``tests/ray/scenario.py``), and its JSON is what is asserted here.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from tests.ray.conftest import PROJECT

if TYPE_CHECKING:
    from collections.abc import Callable

    from gymckpt.testing.raycluster import RayCluster

pytestmark = pytest.mark.slow

#: the bound of any one wait in these tests (seconds)
WAIT = 120.0


def test_a_local_directory_is_refused_with_servers_on_two_nodes(
    cluster: RayCluster, run_scenario: Callable[..., dict[str, Any]]
) -> None:
    # each worker node sees its own tmpfs at cluster.private_dir: a local disk
    assert cluster.private_dir is not None
    seen = run_scenario("refuse", local_dir=str(cluster.private_dir / "checkpoints"))
    refused = seen["refused"]
    assert refused is not None, "a directory only one node sees was accepted"
    assert refused.startswith(f"ray.checkpoint_dir {cluster.private_dir / 'checkpoints'}: ")
    assert "is not seen from node" in refused and "\n" not in refused
    # nothing of the refused placement stays on the cluster
    assert seen["left_after_refusal"] == {"actors": 0, "placement_groups": 0}
    # an S3 URL needs no probe: the same stack is placed on two nodes
    assert len(seen["accepted_nodes"]) == 2
    assert seen["left_after_close"] == {"actors": 0, "placement_groups": 0}
    # each server kept its config and log under ray.log_dir; a stopped server's directory is removed
    servers = cluster.base / "servers"
    assert [Path(log).parent.parent for log in seen["logs"]] == [servers, servers], seen["logs"]
    assert [Path(log).name for log in seen["logs"]] == ["a.log", "b.log"]
    assert list(servers.iterdir()) == []


def test_a_node_known_lost_gets_no_server_of_a_later_placement(
    cluster: RayCluster, run_scenario: Callable[..., dict[str, Any]]
) -> None:
    # six servers spread over three nodes, then placed again with node2 counted as lost (it is alive)
    seen = run_scenario("avoid", avoid="node2")
    assert seen["first"] == ["head", "node1", "node2"], seen
    assert "node2" not in seen["again"] and seen["again"], seen
    assert seen["lost_servers"] == []
    assert seen["left_after_close"] == {"actors": 0, "placement_groups": 0}


def _server_processes(cluster: RayCluster) -> list[int]:
    """Every ``gymckpt serve`` process (and lifeline) running on any node of the cluster."""
    found = []
    for pid in cluster.pids(f"{cluster.cluster_id}/"):
        with contextlib.suppress(OSError):
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if "gymckpt serve" in command or "gymckpt.stack.lifeline" in command or "multiprocessing" in command:
                found.append(pid)
    return found


def _lines(stream: Any) -> queue.Queue[str | None]:
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for raw in stream:
            lines.put(raw.decode(errors="replace").rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def test_ctrl_c_of_stack_up_ray_leaves_no_server_behind(
    cluster: RayCluster, run_scenario: Callable[..., dict[str, Any]], tmp_path: Path
) -> None:
    stack_file = tmp_path / "stack.yaml"
    stack_file.write_text(
        yaml.safe_dump(
            {
                "ray": {
                    "cpus_per_server": 0.5,
                    "resources": {"one": {"node1": 0.01}, "two": {"node2": 0.01}},
                    "log_dir": str(tmp_path / "logs"),
                },
                "servers": [
                    {"name": "one", "kind": "counter", "workers": 2},
                    {"name": "two", "kind": "counter"},
                ],
            }
        )
    )
    up = subprocess.Popen(
        cluster.command(sys.executable, "-m", "gymckpt", "stack", "up", str(stack_file), "--ray", cluster.address),
        cwd=PROJECT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    try:
        lines = _lines(up.stdout)
        said: list[str] = []
        deadline = time.monotonic() + WAIT
        while not any("press Ctrl-C" in line for line in said):
            assert time.monotonic() < deadline, f"stack up --ray did not come up within {WAIT} s: {said}"
            with contextlib.suppress(queue.Empty):
                line = lines.get(timeout=1.0)
                assert line is not None, f"stack up --ray exited {up.wait()}: {said}"
                said.append(line)
        # name, kind, URL, node, workers, log: one line per server
        placed = {line.split("\t")[0]: line.split("\t") for line in said if line.startswith(("one\t", "two\t"))}
        assert set(placed) == {"one", "two"}, said
        assert placed["one"][3] != placed["two"][3], f"both on one node: {placed}"
        for name, fields in placed.items():
            log = Path(fields[5].removeprefix("log "))
            assert log.name == f"{name}.log" and log.parent.parent == tmp_path / "logs", fields
        # each server's lifeline and supervisor, and the 2 workers of one: 6 processes once all started
        deadline = time.monotonic() + WAIT
        while len(_server_processes(cluster)) < 6:
            assert time.monotonic() < deadline, (
                f"the servers' processes did not all start: {_server_processes(cluster)}"
            )
            time.sleep(0.1)
        up.send_signal(signal.SIGINT)
        assert up.wait(WAIT) == 0
        assert list((tmp_path / "logs").iterdir()) == []  # a stopped server's directory is removed
        deadline = time.monotonic() + WAIT
        while _server_processes(cluster):
            assert time.monotonic() < deadline, f"server processes left: {_server_processes(cluster)}"
            time.sleep(0.1)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(30)
    assert run_scenario("state") == {"actors": 0, "placement_groups": 0}


def test_losing_a_node_then_another_during_the_restore(
    cluster: RayCluster, run_scenario: Callable[..., dict[str, Any]]
) -> None:
    """Checkpoint to S3 (moto in the namespace) with rollouts in flight; SIGKILL the node holding the
    environment (its raylet and every process on it); recover on the nodes left, losing the other
    worker node during that restore; every rollout ends with its uninterrupted result."""
    ids = cluster.node_ids()
    seen = run_scenario("recover", rollouts=8)
    first = seen["first"]
    assert len(set(first.values())) >= 2, f"every server on one node: {first}"
    assert first["environment"] in ("node1", "node2")
    assert seen["reference_ok"]
    assert seen["exported"] >= 1, f"no rollout was exported at the checkpoint: {seen}"
    # the drain of the environment's node (a preemption notice) was seen by the launcher, with its deadline
    drained = seen["draining"]
    assert drained["accepted"], drained
    assert drained["seen"] == {ids[seen["killed"]]: drained["deadline_ms"]}
    # the launcher learned of the loss: the servers of the killed node, and no other
    assert seen["lost"] == seen["killed_servers"] and "environment" in seen["lost"]
    # the killed node was known lost at once (its raylet refused the launcher), and no placement after went there
    assert seen["lost_nodes_at_loss"] == [seen["killed"]]
    assert all(seen["killed"] not in placement.values() for placement in seen["placements"]), seen["placements"]
    # the first placement after the loss lost the other worker node during its restore, which failed;
    # the next placement (on the head alone) restored
    assert seen["second"].get("killed") is not None, f"the second placement held no server on a worker: {seen}"
    assert seen["lost_nodes"] == sorted([seen["killed"], seen["second"]["killed"]])
    assert len(seen["failures"]) == 1 and "lost" in seen["failures"][0]
    assert len(seen["placements"]) == 2
    assert set(seen["placements"][-1].values()) == {"head"}
    assert seen["restored"] and all(key.endswith("-a1") for key in seen["restored"])
    # nothing lost, and every continued rollout's result is its uninterrupted run's
    assert seen["lost_results"] == [] and seen["differing"] == []
    assert len(seen["continued_equal"]) == seen["exported"]
    assert seen["left_after_close"] == {"actors": 0, "placement_groups": 0}
    assert set(ids) == {"head", "node1", "node2"}


def test_the_head_node_lost_is_one_clear_error(
    cluster: RayCluster, run_scenario: Callable[..., dict[str, Any]]
) -> None:
    """Last: the cluster is gone after it (the module's teardown removes what is left)."""
    seen = run_scenario("head")
    assert seen.get("head_error") is not None, f"the head's loss was not reported: {seen}"
    assert seen["head_error"]["type"] == "RayHeadLost"
    message = seen["head_error"]["message"]
    assert message.startswith("Ray's head node is gone") and "external GCS store" in message and "\n" not in message
    assert seen["closed"]
