"""The stack on a real Ray cluster checkpointing to a shared filesystem: MooseFS, mounted before the nodes start.

Each worker node runs in a mount namespace of its own (its own tmpfs at a private directory,
as in test_cluster.py); the MooseFS mount made before the nodes started is in every node's
view, so the launcher's probe (written from one node, read back on the others) accepts it.
A worker node dies after a checkpoint with rollouts in flight; the stack is placed again and
restored from the shared filesystem, and every rollout ends with its uninterrupted result.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.testing.sharedfs import MooseFS, SharedFsUnavailable, missing_requirements
from gymckpt.testing.sharedfs import install_hint as sharedfs_hint
from tests.ray.conftest import started_cluster

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from gymckpt.testing.raycluster import RayCluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moosefs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooseFS]:
    lacking = missing_requirements()
    if lacking:
        if os.environ.get("CI") or os.environ.get("GYMCKPT_REQUIRE_SHAREDFS"):
            pytest.fail(sharedfs_hint(lacking), pytrace=False)
        pytest.skip(sharedfs_hint(lacking))
    mfs = MooseFS(tmp_path_factory.mktemp("ray-moosefs"))
    try:
        mfs.start()
    except SharedFsUnavailable as exc:
        pytest.skip(str(exc))
    try:
        mfs.mount("a")
        yield mfs
    finally:
        left = mfs.close()
    assert not left, f"the shared filesystem's teardown left: {left}"


@pytest.fixture(scope="module")
def cluster(moosefs: MooseFS) -> Iterator[RayCluster]:
    """The cluster of conftest.py, started once MooseFS is mounted (a node's mount namespace copies the mounts)."""
    with started_cluster("gm") as made:
        yield made


def test_recovery_from_a_checkpoint_on_a_shared_filesystem(
    moosefs: MooseFS, cluster: RayCluster, run_scenario: Callable[..., dict[str, Any]]
) -> None:
    shared = moosefs.mounts["a"].path / "ray-checkpoints"
    seen = run_scenario("recover", rollouts=6, shared_dir=str(shared), second_loss=False)
    assert len(set(seen["first"].values())) >= 2, f"every server on one node: {seen['first']}"
    assert seen["exported"] >= 1, f"no rollout was exported at the checkpoint: {seen}"
    assert "environment" in seen["lost"] and seen["failures"] == []
    assert seen["killed"] not in set(seen["placements"][-1].values())
    assert seen["lost_results"] == [] and seen["differing"] == []
    assert len(seen["continued_equal"]) == seen["exported"]
    assert (shared / "ck-1").is_dir()  # the checkpoint is on the shared filesystem
    assert seen["left_after_close"] == {"actors": 0, "placement_groups": 0}
