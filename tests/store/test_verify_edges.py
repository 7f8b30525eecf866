"""verify's edges: one checkpoint's manifests at a time, names that are not UTF-8, checkpoints that vanish
(or lose a file) while they are checked, the hidden directories a prune leaves, and the empty directories
a failed commit leaves."""

from __future__ import annotations

import gc
import importlib
import json
import os
import shutil
import weakref
from typing import TYPE_CHECKING, Any

import orjson
import pytest

from gymckpt.store import open_store, verify
from gymckpt.store._local import LocalBackend
from gymckpt.store.listing import list_checkpoints
from gymckpt.store.verify import CheckpointStatus, NoCheckpointFound
from gymckpt.testing.values import sample_records

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from gymckpt.store.manifest import Manifest
    from gymckpt.store.verify import VerifyReport

#: the hidden name a prune renames a checkpoint to first (on disk: a format, spelled out here)
PRUNING_PREFIX = ".gymckpt-pruning-"
#: the module (``gymckpt.store.verify`` as an attribute is the function the package re-exports)
verify_module = importlib.import_module("gymckpt.store.verify")


def publish(root: Path, checkpoint: str, *, kinds: tuple[str, ...] = ("environment", "agent")) -> list[Manifest]:
    """Checkpoint ``checkpoint`` under ``root``: one participant of each kind, published."""
    with open_store(str(root)) as store:
        manifests = [
            store.write_participant(
                checkpoint, kind=kind, instance="0", checkpoint_id="ck", records=sample_records(4, prefix=f"{kind}-")
            )
            for kind in kinds
        ]
        store.publish(checkpoint, manifests)
    return manifests


def findings(report: VerifyReport) -> list[tuple[str, str, str, str]]:
    return sorted((f.checkpoint, f.code, str(f.severity), f.path) for f in report.findings)


# --- one checkpoint's manifests at a time


def test_verify_holds_at_most_one_checkpoints_manifests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every manifest verify reads is watched (a weak reference): whenever it reads one, the manifests
    still alive all belong to the checkpoint it is reading, and none is alive once it returns."""
    for number in range(6):
        publish(tmp_path, f"ck-{number}")
    read = verify_module.read_manifest_file
    alive: list[tuple[str, weakref.ref[Manifest]]] = []
    seen: list[set[str]] = []

    def watched(backend: Any, path: str, **names: str) -> Manifest:
        checkpoint = path.partition("/")[0]
        gc.collect()
        seen.append({owner for owner, ref in alive if ref() is not None} - {checkpoint})
        manifest = read(backend, path, **names)
        alive.append((checkpoint, weakref.ref(manifest)))
        return manifest

    monkeypatch.setattr(verify_module, "read_manifest_file", watched)
    report = verify(str(tmp_path))
    assert report.ok and len(report.participants) == 12
    assert len(seen) == 12
    assert [other for other in seen if other] == []  # no other checkpoint's manifest was alive
    gc.collect()
    assert [checkpoint for checkpoint, ref in alive if ref() is not None] == []  # nor any once the report is done
    assert report.formats == {"gymckpt": 12, "reference": 0}  # the report keeps what it says of them


def test_the_progress_total_is_every_records_file_checked(tmp_path: Path) -> None:
    manifests = [manifest for number in range(3) for manifest in publish(tmp_path, f"ck-{number}")]
    calls: list[tuple[int, int]] = []
    report = verify(str(tmp_path), progress=lambda done, total: calls.append((done, total)))
    assert report.ok
    expected = sum(manifest.records_bytes or 0 for manifest in manifests)
    assert {total for _, total in calls} == {expected}
    assert sum(done for done, _ in calls) == expected == report.bytes_checked


# --- names that are not UTF-8


def test_findings_about_a_name_that_is_not_utf8_serialize_escaped(tmp_path: Path) -> None:
    publish(tmp_path, "ck")
    checkpoint = os.fsencode(tmp_path / "ck")
    with open(os.path.join(checkpoint, b"gym", b"environment", b"0", b"notes-\xff\xfe"), "wb") as stream:
        stream.write(b"x")
    os.rename(checkpoint, os.fsencode(tmp_path) + b"/ck-\xe9")  # a Latin-1 directory name
    report = verify(str(tmp_path))
    assert report.ok
    document = report.to_dict()
    encoded = orjson.dumps(document)  # what crashed: a lone surrogate is not JSON text
    assert json.loads(encoded) == document
    assert document["checkpoints"] == ["ck-\\xe9"]
    assert [(f["code"], f["path"]) for f in document["findings"]] == [
        ("unexpected_file", "ck-\\xe9/gym/environment/0/notes-\\xff\\xfe")
    ]


# --- a checkpoint that vanishes while it is checked


def rename_away(root: Path, checkpoint: str) -> None:
    """What a collector's prune does first: the whole directory goes, in one step."""
    os.rename(root / checkpoint, root / f"{PRUNING_PREFIX}{checkpoint}-00000000")


def during(monkeypatch: pytest.MonkeyPatch, name: str, checkpoint: str, action: Callable[[], None]) -> list[bool]:
    """Run ``action`` once, when verify first calls its ``name`` for a file of ``checkpoint``."""
    original = getattr(verify_module, name)
    done: list[bool] = []

    def wrapped(backend: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
        path = target if isinstance(target, str) else target.path
        if not done and path.startswith(f"{checkpoint}/"):
            done.append(True)
            action()
        return original(backend, target, *args, **kwargs)

    monkeypatch.setattr(verify_module, name, wrapped)
    return done


@pytest.mark.parametrize(
    ("when", "quick"),
    [
        ("read_index_file", False),
        ("read_index_file", True),
        ("read_manifest_file", False),
        ("read_manifest_file", True),
        ("iter_manifest_records", False),  # --quick reads no records
    ],
)
def test_a_checkpoint_deleted_while_checked_is_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str, quick: bool
) -> None:
    publish(tmp_path, "ck-1")
    publish(tmp_path, "ck-2")
    done = during(monkeypatch, when, "ck-1", lambda: rename_away(tmp_path, "ck-1"))
    report = verify(str(tmp_path), quick=quick)
    assert done
    assert report.ok, report.findings
    assert findings(report) == [("ck-1", "checkpoint_vanished", "warning", "ck-1/gym")]
    assert report.statuses == {"ck-1": CheckpointStatus.VANISHED, "ck-2": CheckpointStatus.PUBLISHED}


def test_an_unpublished_checkpoint_deleted_while_checked_is_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On object storage a prune deletes the index first: verify may list a checkpoint without one."""
    publish(tmp_path, "ck-1")
    (tmp_path / "ck-1" / "gym" / "checkpoint.json").unlink()
    done = during(monkeypatch, "iter_manifest_records", "ck-1", lambda: shutil.rmtree(tmp_path / "ck-1" / "gym"))
    report = verify(str(tmp_path))
    assert done
    assert report.ok, report.findings
    assert findings(report) == [("ck-1", "checkpoint_vanished", "warning", "ck-1/gym")]


def test_a_published_checkpoint_that_loses_a_file_while_checked_is_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its index is still there: the missing file is damage, and no vanishing hides it."""
    environment, _ = publish(tmp_path, "ck-1")
    records = tmp_path / environment.records_path
    done = during(monkeypatch, "iter_manifest_records", "ck-1", records.unlink)
    report = verify(str(tmp_path))
    assert done
    assert findings(report) == [("ck-1", "records_missing", "error", environment.records_path)]


def test_a_published_checkpoint_that_loses_a_manifest_while_checked_is_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, agent = publish(tmp_path, "ck-1")
    done = during(monkeypatch, "read_manifest_file", "ck-1", (tmp_path / agent.path).unlink)
    report = verify(str(tmp_path))
    assert done
    assert ("ck-1", "index_participant_missing", "error", agent.path) in findings(report)
    assert "checkpoint_vanished" not in {f.code for f in report.findings}


# --- what a prune leaves


def test_a_directory_a_prune_is_deleting_is_not_a_checkpoint(tmp_path: Path) -> None:
    publish(tmp_path, "ck-1")
    publish(tmp_path, "ck-2")
    rename_away(tmp_path, "ck-2")
    (tmp_path / f"{PRUNING_PREFIX}ck-2-00000000" / "gym" / "checkpoint.json").write_bytes(b"half deleted")
    report = verify(str(tmp_path))
    assert report.ok and report.findings == []
    assert report.checkpoints == ["ck-1"]
    # named itself, it is checked as any checkpoint is
    named = verify(str(tmp_path / f"{PRUNING_PREFIX}ck-2-00000000"))
    assert [f.code for f in named.errors] == ["checkpoint_index_invalid"]


# --- what a failed commit leaves: directories without files


def failed_commit(root: Path, checkpoint: str, kind: str = "environment", instance: str = "0") -> str:
    """A commit whose records stop with an error: its temporary file is removed, its directory stays, empty."""

    def records() -> Any:
        yield from sample_records(2)
        raise RuntimeError("the export failed")

    with open_store(str(root)) as store, pytest.raises(RuntimeError):
        store.write_participant(checkpoint, kind=kind, instance=instance, checkpoint_id="ck", records=records())
    directory = root / checkpoint / "gym" / kind / instance
    assert directory.is_dir() and not any(directory.iterdir())
    return f"{checkpoint}/gym/{kind}/{instance}".lstrip("/")


def test_the_directory_a_failed_commit_left_is_an_unfinished_checkpoint(tmp_path: Path) -> None:
    path = failed_commit(tmp_path, "")
    report = verify(str(tmp_path))
    assert report.ok
    assert findings(report) == [
        ("", "checkpoint_unpublished", "warning", "gym/checkpoint.json"),
        ("", "unfinished_commit", "warning", path),
    ]
    assert "did not finish" in report.findings[-1].detail  # the index's finding: never "committed"
    assert "empty participant directory" in report.findings[0].detail
    assert report.statuses == {"": CheckpointStatus.UNFINISHED}
    assert [summary.participant for summary in report.participants] == ["environment/0"]
    assert report.to_dict()["checkpoint_status"] == {"": "unfinished"}


def test_an_empty_participant_directory_of_a_published_checkpoint_is_a_warning(tmp_path: Path) -> None:
    publish(tmp_path, "ck-1")
    path = failed_commit(tmp_path, "ck-1", "model", "m-0")  # a late participant whose commit failed
    report = verify(str(tmp_path), quick=True)
    assert findings(report) == [("ck-1", "unfinished_commit", "warning", path)]
    assert report.statuses == {"ck-1": CheckpointStatus.PUBLISHED}


def test_an_unpublished_checkpoint_with_a_failed_participant_is_unfinished_not_unpublished(tmp_path: Path) -> None:
    publish(tmp_path, "ck-1")
    (tmp_path / "ck-1" / "gym" / "checkpoint.json").unlink()
    path = failed_commit(tmp_path, "ck-1", "model", "m-0")
    report = verify(str(tmp_path))
    assert findings(report) == [
        ("ck-1", "checkpoint_unpublished", "warning", "ck-1/gym/checkpoint.json"),
        ("ck-1", "unfinished_commit", "warning", path),
    ]
    assert "did not finish" in report.findings[-1].detail and "committed" not in report.findings[-1].detail
    assert report.statuses == {"ck-1": CheckpointStatus.UNFINISHED}
    os.rmdir(tmp_path / path)  # the failed participant's directory removed: committed, not published
    report = verify(str(tmp_path))
    assert findings(report) == [("ck-1", "checkpoint_unpublished", "warning", "ck-1/gym/checkpoint.json")]
    assert report.statuses == {"ck-1": CheckpointStatus.UNPUBLISHED}


def test_a_gym_directory_without_participants_is_unfinished(tmp_path: Path) -> None:
    (tmp_path / "ck-1" / "gym" / "environment").mkdir(parents=True)  # a kind, no instance yet
    report = verify(str(tmp_path))
    assert findings(report) == [("ck-1", "unfinished_commit", "warning", "ck-1/gym")]
    assert report.statuses == {"ck-1": CheckpointStatus.UNFINISHED}


def test_the_listing_adds_only_directories_no_file_is_in(tmp_path: Path) -> None:
    publish(tmp_path, "ck-1")
    nested = tmp_path / "ck-1" / "gym" / "model" / "m-0" / "notes"
    nested.mkdir(parents=True)
    (nested / "todo.txt").write_text("a file below a participant: the scan's unexpected file, not an empty dir")
    (tmp_path / "ck-1" / "gym" / "bad name" / "x").mkdir(parents=True)  # no participant name: not one
    (tmp_path / "ck-1" / "gym" / "agent" / "1").mkdir()
    (tmp_path / "ck-1" / "unrelated" / "empty").mkdir(parents=True)  # no gym/: nothing
    (layout,) = list_checkpoints(LocalBackend(str(tmp_path))).values()
    assert sorted(layout.participants) == [("agent", "0"), ("agent", "1"), ("environment", "0"), ("model", "m-0")]
    assert layout.participants[("model", "m-0")].unexpected == ["ck-1/gym/model/m-0/notes/todo.txt"]
    assert layout.participants[("agent", "1")].records == []


def test_empty_directories_a_prune_is_deleting_are_not_checkpoints(tmp_path: Path) -> None:
    failed_commit(tmp_path, "ck-2")
    rename_away(tmp_path, "ck-2")
    with pytest.raises(NoCheckpointFound):
        verify(str(tmp_path))
    publish(tmp_path, "ck-1")
    report = verify(str(tmp_path))
    assert report.checkpoints == ["ck-1"] and report.findings == []
