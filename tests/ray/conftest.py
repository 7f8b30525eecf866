"""Fixtures of the Ray tests: one cluster of three nodes per module, and a way to run a controller in it.

- ``cluster``: :class:`~gymckpt.testing.raycluster.RayCluster` (a head and two worker raylets
  in a network namespace the fixture made, only ``lo`` up; each worker node with a private
  tmpfs at ``<base>/local``), for the module. Where this machine cannot run it (not root,
  ``ip``, ``unshare`` or the ray package missing) the tests are skipped with a message
  saying what is needed, and fail instead when ``GYMCKPT_REQUIRE_RAY`` is set.
  Its teardown fails the module if a process of the cluster or its namespace is left.
  :func:`started_cluster` makes it (test_moosefs.py's own ``cluster`` uses it too).
- ``run_scenario``: runs ``tests/ray/scenario.py``'s scenario in the cluster's namespace
  (the controller is a Ray driver: it must reach 127.0.0.1 of the namespace) and returns
  the JSON it wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.testing.raycluster import RayCluster, RayClusterUnavailable, install_hint, missing

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

PROJECT = Path(__file__).resolve().parents[2]
#: the bound of one scenario's process (seconds)
SCENARIO_TIMEOUT = 600.0


def _unavailable(reason: str) -> None:
    if os.environ.get("GYMCKPT_REQUIRE_RAY"):  # CI sets it once it installs the ray extra
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


@contextlib.contextmanager
def started_cluster(prefix: str) -> Iterator[RayCluster]:
    """A started three-node :class:`RayCluster` under a short new ``/tmp/<prefix>-*`` directory (Ray's
    Unix sockets live under it: AF_UNIX paths are short); skipped (or failed, see the module) where this
    machine cannot run it. On exit every process and the namespace are gone, or the exit fails naming them."""
    lacking = missing()
    if lacking:
        _unavailable(install_hint(lacking))
    short = Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir="/tmp"))
    made = RayCluster(short, workers=2, cpus=4, private_dir=short / "local")
    try:
        made.start()
    except RayClusterUnavailable as exc:
        shutil.rmtree(short, ignore_errors=True)
        _unavailable(str(exc))
    try:
        yield made
    finally:
        left = made.close()
        shutil.rmtree(short, ignore_errors=True)
    assert not left, f"the Ray cluster's teardown left: {left}"


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    with started_cluster("gr") as made:
        yield made


def cluster_request(cluster: RayCluster, **fields: Any) -> dict[str, Any]:
    """What a scenario needs to reach the cluster and kill its nodes."""
    return {
        "address": cluster.address,
        "base": str(cluster.base),
        "cluster_id": cluster.cluster_id,
        "node_ids": cluster.node_ids(),
        **fields,
    }


@pytest.fixture
def run_scenario(cluster: RayCluster, tmp_path: Path) -> Callable[..., dict[str, Any]]:
    def run(name: str, **fields: Any) -> dict[str, Any]:
        request, result = tmp_path / f"{name}-request.json", tmp_path / f"{name}-result.json"
        request.write_text(json.dumps(cluster_request(cluster, **fields)))
        log = tmp_path / f"{name}.log"
        with log.open("wb") as output:
            done = subprocess.run(
                cluster.command(sys.executable, "-m", "tests.ray.scenario", name, str(request), str(result)),
                cwd=PROJECT,
                stdout=output,
                stderr=subprocess.STDOUT,
                timeout=SCENARIO_TIMEOUT,
                check=False,
            )
        assert done.returncode == 0 and result.exists(), (
            f"scenario {name} exited {done.returncode}: {log.read_text()[-3000:]}"
        )
        seen = json.loads(result.read_text())
        assert "error" not in seen, f"scenario {name}: {seen['error']}\n{seen['traceback']}\n{log.read_text()[-3000:]}"
        return seen

    return run
