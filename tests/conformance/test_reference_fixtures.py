"""Checkpoints written byte for byte in the reference's on-disk format verify and restore through gymckpt.

The fixtures come from :mod:`gymckpt.testing.reference_format` (docs/wire.md §9): records
lines of ``json.dumps(record)`` with object episode ids, a sorted-keys ``indent=1``
manifest without gymckpt's fields, optionally the legacy ``records.jsonl`` name, no
``gym/checkpoint.json`` but the reference controller's ``collection.json`` and ``LATEST``.

- ``gymckpt verify`` (the command and the store's :func:`~gymckpt.store.verify`) finds
  nothing wrong, and the reference's temporary files only as leftovers;
- the store reads the records back under capture keys, scope filtering included;
- a restore through gymckpt's control routes (under a fresh ``restore-<hex>`` id, with
  object ids) answers ``source_checkpoint_id`` from the manifest and ``restored`` with the
  next attempts it installed: into a fake participant, into the counter resources server
  (whose restored count gives the right reward), and into the environment server, whose
  episode continues from its boundary with the task digest the reference computes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from click.testing import CliRunner

from gymckpt.cli import main
from gymckpt.control.routes import CONTROL_PREFIX
from gymckpt.servers.counter import CounterConfig, build_counter_app
from gymckpt.store import open_store, verify
from gymckpt.testing.participant import FakeParticipant
from gymckpt.testing.reference_format import (
    write_reference_collection,
    write_reference_leftovers,
    write_reference_participant,
)

from .conftest import TOKEN, control, environment_client, error_of, obj, participant_app

if TYPE_CHECKING:
    from tests.servers.env_support import FakeDownstream

CHECKPOINT = "ckpt-20240102T030405-0a1b2c3d"
RESTORE = "restore-0123456789ab"
#: a task whose canonical JSON differs between ``json.dumps`` and orjson (non-ASCII text, a small float)
TASK = {
    "task_id": {"taskset": "démo", "task_id": "t1"},
    "task_input": {"prompt": "zähle bis drei ✓", "temperature": 1e-07},
}
#: an environment boundary of gymckpt's single-turn environment: the agent replied and was closed
VERIFY_BOUNDARY = {
    "stage": "verify",
    "session": {"session": "s"},
    "verify_mode": "wait",
    "agent": {"output_text": "answer 7", "turns": 2, "expected": 7},
}
FAKE_RECORDS = [
    {"episode_id": "r", "state": {"step": 1}},
    {"episode_id": "s-a2", "state": {"step": 2, "text": "é"}},
    {"episode_id": "x-a0", "state": {"step": 3}},
]


def reference_task_digest(task: Any) -> str:
    """The reference's task digest: sha256 over ``json.dumps(task, sort_keys=True, separators=(",", ":"))``."""
    return hashlib.sha256(json.dumps(task, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def environment_records() -> list[dict[str, Any]]:
    return [
        {"episode_id": obj("r"), "task_digest": reference_task_digest(TASK), "boundary": VERIFY_BOUNDARY},
        {"episode_id": obj("s", 2), "task_digest": reference_task_digest(TASK), "boundary": None},
    ]


def counter_records() -> list[dict[str, Any]]:
    return [
        {"episode_id": obj("r"), "session_id": "cookie-r", "state": {"count": 3, "calls": 3}, "owner": 0},
        {"episode_id": obj("s", 2), "session_id": "cookie-s", "state": {"count": 1, "calls": 1}},
    ]


def write_stack_checkpoint(root: Path, *, legacy_name: bool = False) -> tuple[Path, dict[str, dict[str, Any]]]:
    """A reference checkpoint of a whole stack under ``root`` (published with ``LATEST``); its manifests by kind."""
    target = write_reference_collection(root, CHECKPOINT, continued=["r", "s-a2"])
    manifests = {
        "environment": write_reference_participant(
            target,
            kind="environment",
            instance="environment-0",
            checkpoint_id=CHECKPOINT,
            records=environment_records(),
            legacy_name=legacy_name,
        ),
        "resources": write_reference_participant(
            target,
            kind="resources",
            instance="counter-0",
            checkpoint_id=CHECKPOINT,
            records=counter_records(),
            legacy_name=legacy_name,
        ),
        "model": write_reference_participant(
            target, kind="model", instance="model-0", checkpoint_id=CHECKPOINT, records=[], legacy_name=legacy_name
        ),
    }
    return target, manifests


legacy = pytest.mark.parametrize("legacy_name", [False, True], ids=["digest-name", "records.jsonl"])


# ----------------------------------------------------------------------------- verify and read


@legacy
def test_a_reference_checkpoint_verifies_clean(tmp_path: Path, legacy_name: bool) -> None:
    target, manifests = write_stack_checkpoint(tmp_path / "root", legacy_name=legacy_name)
    records = sum(manifest["record_count"] for manifest in manifests.values())
    for url in (target, tmp_path / "root"):  # the checkpoint, and the controller's root holding it and LATEST
        report = verify(str(url))
        assert report.ok, report.errors
        assert not report.warnings, report.warnings
        assert len(report.participants) == len(manifests)
        assert {summary.format for summary in report.participants} == {"reference"}, "not said to be the reference's"
        assert report.records_checked == records

        result = CliRunner().invoke(main, ["verify", "--json", str(url)])
        assert result.exit_code == 0, result.output
        printed = json.loads(result.stdout)
        assert printed["ok"] and printed["errors"] == 0, printed
        assert printed["records_checked"] == records
        assert printed["formats"] == {"gymckpt": 0, "reference": len(manifests)}, printed


def test_the_reference_temporary_files_are_leftovers(tmp_path: Path) -> None:
    target, _ = write_stack_checkpoint(tmp_path / "root")
    leftovers = write_reference_leftovers(target, kind="environment", instance="environment-0")
    report = verify(str(target))
    assert report.ok, report.errors
    flagged = {Path(finding.path).name for finding in report.warnings}
    assert {path.name for path in leftovers} <= flagged, report.warnings


@legacy
def test_the_store_reads_reference_records_under_capture_keys(tmp_path: Path, legacy_name: bool) -> None:
    target, manifests = write_stack_checkpoint(tmp_path / "root", legacy_name=legacy_name)
    store = open_store(str(target))
    try:
        manifest = store.read_manifest("", kind="resources", instance="counter-0")
        assert manifest.checkpoint_id == CHECKPOINT
        assert manifest.records_file == manifests["resources"]["records_file"]
        records = list(store.read_participant("", kind="resources", instance="counter-0"))
        assert [record["episode_id"] for record in records] == ["r", "s-a2"]
        assert records[0]["session_id"] == "cookie-r" and records[0]["state"] == {"count": 3, "calls": 3}
        scoped = list(store.read_participant("", kind="environment", instance="environment-0", scope={"s-a2"}))
        assert [(record["episode_id"], record["boundary"]) for record in scoped] == [("s-a2", None)]
        assert list(store.read_participant("", kind="model", instance="model-0")) == []
    finally:
        store.close()


# ----------------------------------------------------------------------------- restore through gymckpt


def restore_body(checkpoint_dir: Path, episode_ids: list[Any]) -> dict[str, Any]:
    return {"checkpoint_id": RESTORE, "checkpoint_dir": str(checkpoint_dir), "episode_ids": episode_ids}


@legacy
async def test_a_participant_restores_reference_records(tmp_path: Path, legacy_name: bool) -> None:
    manifest = write_reference_participant(
        tmp_path / "ckpt",
        kind="environment",
        instance="env-0",
        checkpoint_id=CHECKPOINT,
        records=FAKE_RECORDS,
        extras={"session_owners": {"r": 0}},
        legacy_name=legacy_name,
    )
    async with participant_app(FakeParticipant()) as app:
        scope = [obj("r"), "s-a2", obj("x-a0"), obj("missing", 3)]
        body = {**restore_body(tmp_path / "ckpt", scope), "deadline_ts": 4e9}
        response = await app.post("restore", body)
        assert response.status_code == 200, response.text
        assert response.json() == {
            "phase": "restored",
            "source_checkpoint_id": manifest["checkpoint_id"],
            "restored": ["r-a1", "s-a3", "x-a0-a1"],
        }
        assert {record["episode_id"]: record["state"] for record in app.fake.installed} == {
            "r-a1": {"step": 1},
            "s-a3": {"step": 2, "text": "é"},
            "x-a0-a1": {"step": 3},
        }
        assert app.fake.installed_manifest.checkpoint_id == CHECKPOINT
        assert (await app.status())["checkpoint_id"] == RESTORE


async def test_the_counter_restores_reference_sessions_and_rewards_them(tmp_path: Path) -> None:
    target, manifests = write_stack_checkpoint(tmp_path / "root")
    config = CounterConfig(checkpoint={"enabled": True, "control_auth_token": TOKEN})
    transport = httpx.ASGITransport(app=build_counter_app(config))
    async with httpx.AsyncClient(transport=transport, base_url="http://counter", timeout=60) as client:
        restored = await control(client, "restore", **restore_body(target, [obj("r"), obj("s", 2)]))
        assert restored.status_code == 200, restored.text
        assert restored.json() == {
            "phase": "restored",
            "source_checkpoint_id": manifests["resources"]["checkpoint_id"],
            "restored": ["r-a1", "s-a3"],
        }
        resumed = await control(client, "resume", checkpoint_id=RESTORE)
        assert resumed.status_code == 200 and resumed.json()["idempotent"] is False, resumed.text
        rewards = {}
        for key, expected in (("r-a1", 3), ("s-a3", 1), ("fresh", 3)):  # "fresh" was not restored: it counts from 0
            reply = await client.post(f"/ng-rollout/{key}/verify", json={"response": "", "expected": expected})
            assert reply.status_code == 200, reply.text
            rewards[key] = reply.json()["reward"]
        assert rewards == {"r-a1": 1.0, "s-a3": 1.0, "fresh": 0.0}


async def test_the_environment_continues_a_reference_episode(tmp_path: Path, downstream: FakeDownstream) -> None:
    target, manifests = write_stack_checkpoint(tmp_path / "root")
    async with environment_client(downstream) as client:
        restored = await control(client, "restore", **restore_body(target, [obj("r"), obj("s", 2), obj("gone")]))
        assert restored.status_code == 200, restored.text
        assert restored.json() == {
            "phase": "restored",
            "source_checkpoint_id": manifests["environment"]["checkpoint_id"],
            "restored": ["r-a1", "s-a3"],
        }
        status = (await client.get(f"{CONTROL_PREFIX}/status", headers={"Authorization": f"Bearer {TOKEN}"})).json()
        assert status["phase"] == "restored" and status["restored_pending"] == ["r-a1", "s-a3"], status
        resumed = await control(client, "resume", checkpoint_id=RESTORE)
        assert resumed.status_code == 200 and resumed.json()["idempotent"] is False, resumed.text

        # r was checkpointed at its verification: only /verify is left, and the task digest is the reference's
        reply = await client.post("/run", json={"episode_id": obj("r", 1), "task": TASK})
        assert reply.status_code == 200, reply.text
        assert reply.json() == {
            "episode_id": obj("r", 1),
            "task_id": TASK["task_id"],
            "result": {"reward": 1.0, "response": "answer 7"},
        }
        assert downstream.calls == [("verify", "/ng-rollout/r-a1/verify")]

        # the replaced attempt is refused
        stale = await client.post("/run", json={"episode_id": obj("r"), "task": TASK})
        assert stale.status_code == 409 and error_of(stale) == "stale_attempt", stale.text
