"""Scenario (b) of bench_scale on a real Ray cluster: big sandbox sessions, the node holding them lost.

A cluster of its own (the test loses a node; :mod:`tests.ray.test_cluster`'s cluster is shared by
tests that need every node). The controller is ``bench_ray --scenario b``'s
(:mod:`benchmarks.ray_sessions`), a Ray driver in the cluster's namespace; its JSON is asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from tests.ray.conftest import PROJECT, SCENARIO_TIMEOUT, cluster_request, started_cluster

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from gymckpt.testing.raycluster import RayCluster

pytestmark = pytest.mark.slow

#: the bound of each phase of the scenario (seconds)
WAIT = 120.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    with started_cluster("gs") as made:
        yield made


def test_big_sessions_come_back_whole_from_a_lost_node(cluster: RayCluster, tmp_path: Path) -> None:
    """``bench_ray --scenario b``'s controller, small: the sandbox server placed on node1, its sessions
    checkpointed through the control routes, node1 SIGKILLed, the server placed again on a node left,
    and every session restored equal to what an uninterrupted one holds."""
    sessions, session_bytes = 6, 40_000
    request, result = tmp_path / "sessions-request.json", tmp_path / "sessions-result.json"
    request.write_text(
        json.dumps(cluster_request(cluster, sessions=sessions, session_bytes=session_bytes, timeout=WAIT, cpus=4))
    )
    log = tmp_path / "sessions.log"
    with log.open("wb") as output:
        done = subprocess.run(
            cluster.command(sys.executable, "-m", "benchmarks.ray_sessions", str(request), str(result)),
            cwd=PROJECT,
            stdout=output,
            stderr=subprocess.STDOUT,
            timeout=SCENARIO_TIMEOUT,
            check=False,
        )
    assert result.exists(), f"the controller exited {done.returncode} without a result: {log.read_text()[-3000:]}"
    seen = json.loads(result.read_text())
    assert seen["ok"] and done.returncode == 0, f"{seen['error']}\n{log.read_text()[-3000:]}"
    assert (seen["lost"], seen["differing"]) == (0, 0)
    assert seen["nodes"][0] == "node1" and len(seen["nodes"]) == 2 and seen["nodes"][1] != "node1", seen["nodes"]
    assert seen["records"] == sessions
    assert seen["bytes_written"] > sessions * session_bytes
    # the server's memory was read on its node around the commit and the restore (the nodes run here)
    for phase in ("commit", "restore"):
        (window,) = seen["memory"][phase].values()
        assert 0 < window["rss_before"] <= window["peak"], (phase, window)
        assert window["records_bytes"] == seen["bytes_written"]
    assert set(seen["participant_lines"]) == {"commit", "restore"}, seen["participant_lines"]
