"""Two hosts, one checkpoint: participants commit through mount A and mount B into one checkpoint
directory, A publishes, and B's verify, inspect and restore see exactly what A published; writers of
one participant racing from A and B leave exactly one manifest, which verifies."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.store import verify
from gymckpt.store.layout import INDEX_NAME
from gymckpt.testing.values import same_records, sample_records

from .conftest import PARTICIPANT, PROJECT

if TYPE_CHECKING:
    from .conftest import CommitWorker, Hosts

pytestmark = pytest.mark.slow

GYMCKPT = PROJECT / ".venv" / "bin" / "gymckpt"
CHECKPOINT = "run/ck-1"
RACES = 20
RECORDS_FILE = re.compile(r"records-([0-9a-f]{64})\.jsonl")
ALLOWED_WARNINGS = {"orphaned_records", "leftover_temporary_file", "checkpoint_unpublished"}


def _cli(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(GYMCKPT), *arguments], capture_output=True, text=True, timeout=120, check=False)


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path → bytes)."""
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def _misnamed_records(root: Path) -> list[str]:
    """Records files whose bytes do not hash to their name."""
    wrong = []
    for path in root.rglob("records-*.jsonl"):
        match = RECORDS_FILE.fullmatch(path.name)
        if match is None or hashlib.sha256(path.read_bytes()).hexdigest() != match.group(1):
            wrong.append(str(path))
    return wrong


def test_participants_of_two_hosts_in_one_checkpoint(hosts: Hosts) -> None:
    """A commits the environment, B the model; A publishes; B sees A's bytes, verifies, inspects, restores."""
    environment = sample_records(30, prefix="e", payload=300)
    model = sample_records(25, prefix="m", payload=200)
    store_a, store_b = hosts.store("a"), hosts.store("b")
    env_manifest = store_a.write_participant(
        CHECKPOINT, kind="environment", instance="env-0", checkpoint_id="ck-1", records=iter(environment)
    )
    model_manifest = store_b.write_participant(
        CHECKPOINT, kind="model", instance="model-0", checkpoint_id="ck-1", records=iter(model)
    )
    # A publishes what it reads of both manifests: B's, through A, is B's bytes
    read_by_a = [
        store_a.read_manifest(CHECKPOINT, kind=m.kind, instance=m.instance) for m in (env_manifest, model_manifest)
    ]
    assert [manifest.raw for manifest in read_by_a] == [env_manifest.raw, model_manifest.raw]
    index = store_a.publish(CHECKPOINT, read_by_a)

    # everything under the checkpoint, byte for byte, through either mount
    through_a, through_b = _files(hosts.a / CHECKPOINT), _files(hosts.b / CHECKPOINT)
    assert through_a == through_b
    assert through_b[f"gym/{INDEX_NAME}"] == (hosts.a / CHECKPOINT / "gym" / INDEX_NAME).read_bytes()
    assert store_b.read_index(CHECKPOINT).document == index
    assert through_b[env_manifest.path.removeprefix(f"{CHECKPOINT}/")] == env_manifest.raw
    assert json.loads(through_b[f"gym/{INDEX_NAME}"]) == index

    # verify and inspect, as processes on B's view
    verified = _cli("verify", str(hosts.b / CHECKPOINT), "--json")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    report = json.loads(verified.stdout)
    assert report["errors"] == 0 and report["participants"] == 2 and report["records_checked"] == 55, report
    inspected = _cli("inspect", str(hosts.b / CHECKPOINT), "--json")
    assert inspected.returncode == 0, inspected.stderr
    rows = {row["participant"]: row for row in json.loads(inspected.stdout)}
    assert {name: row["record_count"] for name, row in rows.items()} == {"environment/env-0": 30, "model/model-0": 25}
    dumped = _cli("inspect", str(hosts.b / CHECKPOINT), "--dump", "environment/env-0")
    assert dumped.returncode == 0, dumped.stderr
    records_file = hosts.b / CHECKPOINT / "gym" / "environment" / "env-0" / env_manifest.records_file
    assert dumped.stdout.encode() == records_file.read_bytes()

    # restore through B: the records A wrote, the manifest A published
    assert same_records(list(store_b.read_participant(CHECKPOINT, kind="environment", instance="env-0")), environment)
    assert same_records(list(store_a.read_participant(CHECKPOINT, kind="model", instance="model-0")), model)
    assert store_b.read_manifest(CHECKPOINT, kind="environment", instance="env-0").raw == env_manifest.raw


def test_racing_writers_of_one_participant_from_two_hosts(
    hosts: Hosts, workers: tuple[CommitWorker, CommitWorker], observations: dict[str, Any]
) -> None:
    """Two processes, one per mount, commit different records for one participant at the same moment
    (a barrier), twenty times: exactly one manifest, which verifies; the loser gets ManifestConflict;
    no records file holds bytes that hash to another name."""
    winners: Counter[str] = Counter()
    for race in range(RACES):
        checkpoint = f"race-{race}"
        pids = [
            worker.prepare(root, checkpoint, prefix=side, count=20)
            for worker, root, side in zip(workers, (hosts.a, hosts.b), ("a", "b"), strict=True)
        ]
        assert pids[0] != pids[1]
        for worker in workers:
            worker.go()
        outcomes = {side: worker.outcome()["child"] for side, worker in zip("ab", workers, strict=True)}
        committed = [side for side, child in outcomes.items() if child["outcome"] == "committed"]
        assert len(committed) == 1, outcomes
        (winner,) = committed
        loser = outcomes["b" if winner == "a" else "a"]
        assert loser["outcome"] == "error" and "ManifestConflict" in loser["types"], loser
        winners[winner] += 1
        manifest = hosts.b / checkpoint / "gym" / PARTICIPANT["kind"] / PARTICIPANT["instance"] / "manifest.json"
        assert hashlib.sha256(manifest.read_bytes()).hexdigest() == outcomes[winner]["manifest_sha256"]
        assert _misnamed_records(hosts.a / checkpoint) == [] and _misnamed_records(hosts.b / checkpoint) == []
        report = verify(str(hosts.b / checkpoint))
        assert report.ok, [finding.to_dict() for finding in report.findings]
        assert {finding.code for finding in report.warnings} <= ALLOWED_WARNINGS
        restored = list(
            hosts.store("a").read_participant(checkpoint, **{k: PARTICIPANT[k] for k in ("kind", "instance")})
        )
        assert [record["episode_id"][0] for record in restored] == [winner] * 20
    observations.update(races=RACES, won_by_mount=dict(winners))
