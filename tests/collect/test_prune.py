"""The collector's prune looks like pruning: a checkpoint is unpublished in one step (a rename to a hidden
name) before its files go, ``verify`` of the root meanwhile warns that it vanished, and what a crash
mid-prune leaves is skipped by readers and removed by the next prune."""

from __future__ import annotations

import importlib
import json
from typing import TYPE_CHECKING

import pytest
from click.testing import CliRunner

from gymckpt.cli import main
from gymckpt.collect.checkpoints import CheckpointRoot, new_checkpoint_id
from gymckpt.store import open_store, verify
from gymckpt.store._local import LocalBackend

from ..support import prune_while_verifying

if TYPE_CHECKING:
    from pathlib import Path

#: the hidden name a prune renames a checkpoint to first (on disk: a format, spelled out here)
PRUNING_PREFIX = ".gymckpt-pruning-"
verify_module = importlib.import_module("gymckpt.store.verify")


def publish(root: Path, checkpoint_id: str, created_at: float) -> None:
    with open_store(str(root)) as store:
        manifests = [
            store.write_participant(
                checkpoint_id,
                kind=kind,
                instance="0",
                checkpoint_id=checkpoint_id,
                records=[{"episode_id": f"{n}-0", "n": n} for n in range(20)],
            )
            for kind in ("environment", "agent")
        ]
        store.publish(checkpoint_id, manifests, extra={"run_id": "run", "created_at": created_at})


@pytest.fixture
def three(tmp_path: Path) -> list[str]:
    """Three published checkpoints under ``tmp_path``, oldest first."""
    ids = sorted(new_checkpoint_id() for _ in range(3))
    for number, checkpoint_id in enumerate(ids):
        publish(tmp_path, checkpoint_id, 1000.0 + number)
    return ids


def test_prune_renames_a_checkpoint_away_before_deleting_its_files(
    tmp_path: Path, three: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    deleting: list[tuple[str, list[str]]] = []
    delete_tree = LocalBackend.delete_tree

    def watched(self: LocalBackend, path: str) -> int:
        deleting.append((path, sorted(entry.name for entry in tmp_path.iterdir())))
        return delete_tree(self, path)

    monkeypatch.setattr(LocalBackend, "delete_tree", watched)
    root = CheckpointRoot(str(tmp_path))
    assert root.prune(2, current=three[-1]) == [three[0]]
    root.close()
    ((path, present),) = deleting
    assert path.startswith(f"{PRUNING_PREFIX}{three[0]}-")  # the files go from the hidden name only
    assert three[0] not in present and path in present  # the checkpoint was gone, whole, before any delete
    assert sorted(entry.name for entry in tmp_path.iterdir()) == three[1:]


def test_a_prune_that_crashed_mid_delete_leaves_nothing_published_and_the_next_prune_cleans_up(
    tmp_path: Path, three: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(self: LocalBackend, path: str) -> int:
        raise KeyboardInterrupt  # the collector killed between the rename and the delete

    root = CheckpointRoot(str(tmp_path))
    with monkeypatch.context() as patched:
        patched.setattr(LocalBackend, "delete_tree", crash)
        with pytest.raises(KeyboardInterrupt):
            root.prune(2, current=three[-1])
    (hidden,) = [entry.name for entry in tmp_path.iterdir() if entry.name.startswith(PRUNING_PREFIX)]
    assert [item.checkpoint_id for item in root.published()] == three[1:]  # never a resume's source
    report = verify(str(tmp_path))
    assert report.ok and report.findings == [] and report.checkpoints == three[1:]
    assert root.prune(2, current=three[-1]) == []  # nothing more to prune, and the leftover goes
    assert sorted(entry.name for entry in tmp_path.iterdir()) == three[1:]
    assert not (tmp_path / hidden).exists()
    root.close()


@pytest.mark.parametrize("when", ["read_index_file", "read_manifest_file", "iter_manifest_records"])
def test_verify_of_the_root_while_collect_prunes_warns_and_exits_0(
    tmp_path: Path, three: list[str], monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """``gymckpt verify ROOT`` lists the three; the collector prunes the oldest while verify reads it."""
    root = CheckpointRoot(str(tmp_path))
    pruned = prune_while_verifying(monkeypatch, verify_module, when, root, three[0], three[-1])
    result = CliRunner().invoke(main, ["verify", str(tmp_path), "--json"], env={"GYMCKPT_ENDPOINT_URL": None})
    root.close()
    assert pruned == [three[0]]
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [(f["checkpoint"], f["code"], f["severity"]) for f in report["findings"]] == [
        (three[0], "checkpoint_vanished", "warning")
    ]
    assert report["checkpoints"] == three
