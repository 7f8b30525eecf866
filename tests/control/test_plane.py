"""The control plane against a controllable fake participant (SPEC C4–C11).

Every wait is bounded (:func:`~gymckpt.testing.time.bounded`, and each test by the root
conftest's timeout); gates are :class:`asyncio.Event` objects the fake participant
(:class:`~gymckpt.testing.participant.FakeParticipant`) waits on. Deadlines that must pass
are ``time.time()`` plus a few hundredths of a second; leases use an injected clock.
Records are stored for real, in a local store under ``tmp_path``; the commit and restore
tests marked ``each_backend`` run on the memory backend too (and S3 where marked so).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import gymckpt.control.plane as plane_module
from gymckpt.control.allowed_roots import check_allowed
from gymckpt.control.models import (
    CommitRequest,
    ControlRequest,
    ForgetRequest,
    Phase,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    RetireRequest,
)
from gymckpt.control.participant import Participant
from gymckpt.control.plane import ControlPlane
from gymckpt.errors import (
    CheckpointConflict,
    CheckpointDirNotAllowed,
    ControlError,
    DeadlineExceeded,
    ExportFailed,
    GymckptError,
    InvalidCheckpointState,
    InvalidPhase,
    RestartInScope,
    RetireIncomplete,
    StaleAttempt,
    StaleCheckpoint,
    UnusableDirectory,
)
from gymckpt.store import CheckpointStore, WriteStop, open_store
from gymckpt.store._local import LocalBackend
from gymckpt.testing.participant import FakeParticipant
from gymckpt.testing.time import WAIT, FakeClock, bounded, drain

from ..support import each_backend, each_backend_and_s3

#: a deadline that must pass while something is gated
SHORT = 0.05
#: a deadline that never passes during a test
LONG = 60.0


# --- requests


def req(checkpoint_id: str, seconds: float = LONG, *, clock: FakeClock | None = None) -> ControlRequest:
    now = clock() if clock is not None else time.time()
    return ControlRequest(checkpoint_id=checkpoint_id, deadline_ts=now + seconds)


def commit_req(checkpoint_id: str, directory: str | Path, scope: list[str], seconds: float = LONG) -> CommitRequest:
    return CommitRequest(
        checkpoint_id=checkpoint_id,
        deadline_ts=time.time() + seconds,
        checkpoint_dir=str(directory),
        episode_ids=scope,
    )


def restore_req(checkpoint_id: str, directory: str | Path, scope: list[str], seconds: float = LONG) -> RestoreRequest:
    return RestoreRequest(
        checkpoint_id=checkpoint_id,
        deadline_ts=time.time() + seconds,
        checkpoint_dir=str(directory),
        episode_ids=scope,
    )


def retire_req(
    keys: list[str], seconds: float = LONG, *, deadline_ts: float | None = None, checkpoint_id: str = "retire-1"
) -> RetireRequest:
    return RetireRequest(
        checkpoint_id=checkpoint_id,
        deadline_ts=deadline_ts if deadline_ts is not None else time.time() + seconds,
        episode_ids=keys,
    )


def forget_req(rollouts: list[str]) -> ForgetRequest:
    return ForgetRequest(checkpoint_id="forget-1", deadline_ts=time.time() + LONG, rollout_ids=rollouts)


# --- storage


def seed_checkpoint(
    directory: str | Path,
    checkpoint_id: str,
    records: list[dict[str, Any]],
    *,
    fake: FakeParticipant,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """A committed checkpoint for ``fake``'s kind and instance, written straight through the store."""
    with open_store(str(directory), **(storage_options or {})) as store:
        store.write_participant(
            "", kind=fake.kind, instance=fake.instance, checkpoint_id=checkpoint_id, records=records
        )


def read_back(
    directory: str | Path, fake: FakeParticipant, storage_options: dict[str, Any] | None = None
) -> tuple[Any, list[dict[str, Any]]]:
    """The manifest and records a commit stored for ``fake``."""
    with open_store(str(directory), **(storage_options or {})) as store:
        manifest = store.read_manifest("", kind=fake.kind, instance=fake.instance)
        records = list(store.read_participant("", kind=fake.kind, instance=fake.instance))
    return manifest, records


def published(directory: str | Path) -> list[Path]:
    """Every manifest and records file under ``directory``."""
    root = Path(directory)
    if not root.exists():
        return []
    return sorted([*root.rglob("manifest.json"), *root.rglob("records-*.jsonl")])


async def prepared(plane: ControlPlane, checkpoint_id: str = "c1") -> None:
    reply = await bounded(plane.prepare(req(checkpoint_id)))
    assert reply.phase is Phase.PREPARED, reply


async def restored_then_resumed(
    plane: ControlPlane, fake: FakeParticipant, source: str | Path, keys: list[str]
) -> None:
    """Restore ``keys`` (each installed under its next attempt) from checkpoint c0 in ``source``, then resume."""
    seed_checkpoint(source, "c0", [{"episode_id": key, "state": {"of": key}} for key in keys], fake=fake)
    await bounded(plane.restore(restore_req("c0", source, keys)))
    await bounded(plane.resume(req("c0")))
    assert plane.phase is Phase.IDLE


# --- phases (C4)


@each_backend_and_s3
async def test_phases_idle_preparing_prepared_committed_idle(fake, ckpt_dir, storage):
    plane = ControlPlane(fake, **storage.plane_options)
    fake.start("a", {"step": 1}, busy=True)
    fake.start("b", {"step": 2})
    assert plane.status().phase is Phase.IDLE

    preparing = asyncio.create_task(plane.prepare(req("c1")))
    await bounded(fake.started["close"].wait())
    await drain()
    assert not preparing.done()
    assert plane.phase is Phase.PREPARING
    assert plane.status().checkpoint_id == "c1"
    assert not fake.admission_open

    fake.finish_step("a")
    reply = await bounded(preparing)
    assert reply.phase is Phase.PREPARED
    assert reply.report.ready
    assert reply.report.blockers == []
    assert reply.report.blocker_count == 0
    assert plane.phase is Phase.PREPARED

    committed = await bounded(plane.commit(commit_req("c1", ckpt_dir, ["a", "b"])))
    assert committed.phase is Phase.COMMITTED
    assert plane.phase is Phase.COMMITTED
    assert plane.status().checkpoint_id == "c1"

    resumed = await bounded(plane.resume(req("c1")))
    assert resumed == ResumeReply(phase=Phase.IDLE, idempotent=False, checkpoint_id="c1")
    assert plane.phase is Phase.IDLE
    assert fake.admission_open
    status = plane.status()
    assert status.checkpoint_id is None
    assert status.lease_expires_at is None
    await plane.close()


@pytest.mark.parametrize(("busy", "open_phase"), [(True, Phase.PREPARING), (False, Phase.PREPARED)])
async def test_resume_returns_an_open_checkpoint_to_idle(fake, busy, open_phase):
    plane = ControlPlane(fake)
    fake.start("a", busy=busy)
    reply = await bounded(plane.prepare(req("c1", SHORT if busy else LONG)))
    assert reply.phase is open_phase
    assert plane.phase is open_phase
    assert not fake.admission_open

    resumed = await bounded(plane.resume(req("c1")))
    assert resumed.phase is Phase.IDLE
    assert plane.phase is Phase.IDLE
    assert fake.admission_open
    assert fake.count("export") == 0
    await plane.close()


async def test_a_second_checkpoint_id_while_one_is_open_conflicts(fake, ckpt_dir):
    plane = ControlPlane(fake)
    fake.start("a")
    await prepared(plane, "c1")
    with pytest.raises(CheckpointConflict):
        await bounded(plane.prepare(req("c2")))
    with pytest.raises(CheckpointConflict):
        await bounded(plane.commit(commit_req("c2", ckpt_dir, ["a"])))
    with pytest.raises(CheckpointConflict):
        await bounded(plane.renew(req("c2")))
    with pytest.raises(CheckpointConflict):
        await bounded(plane.resume(req("c2")))
    assert plane.phase is Phase.PREPARED
    assert plane.status().checkpoint_id == "c1"
    assert not fake.admission_open
    assert fake.count("close") == 1
    assert fake.count("export") == 0
    assert published(ckpt_dir) == []
    await plane.close()


async def test_the_last_64_resumed_ids_are_stale_and_the_65th_oldest_is_forgotten(fake, ckpt_dir):
    plane = ControlPlane(fake)
    fake.start("a")
    for number in range(65):
        await prepared(plane, f"c{number}")
        await bounded(plane.resume(req(f"c{number}")))

    for number in (1, 2, 33, 64):
        with pytest.raises(StaleCheckpoint):
            await bounded(plane.prepare(req(f"c{number}")))
    with pytest.raises(StaleCheckpoint):
        await bounded(plane.commit(commit_req("c64", ckpt_dir, ["a"])))
    with pytest.raises(StaleCheckpoint):
        await bounded(plane.renew(req("c64")))
    assert plane.phase is Phase.IDLE

    # c0 is the 65th-oldest: forgotten, so the id opens again
    await prepared(plane, "c0")
    # a late call naming a remembered id is stale, not a conflict, while another is open
    with pytest.raises(StaleCheckpoint):
        await bounded(plane.commit(commit_req("c5", ckpt_dir, ["a"])))
    with pytest.raises(StaleCheckpoint):
        await bounded(plane.prepare(req("c5")))
    assert plane.status().checkpoint_id == "c0"
    await bounded(plane.resume(req("c0")))
    # resuming c0 pushed c1 out of the 64, resuming c1 again pushes c2 out
    await prepared(plane, "c1")
    await bounded(plane.resume(req("c1")))
    with pytest.raises(StaleCheckpoint):
        await bounded(plane.prepare(req("c3")))
    await prepared(plane, "c2")
    await plane.close()


@pytest.mark.parametrize("open_phase", [Phase.PREPARING, Phase.PREPARED, Phase.COMMITTED])
async def test_retire_and_forget_are_refused_while_a_checkpoint_is_open(fake, ckpt_dir, open_phase):
    plane = ControlPlane(fake)
    fake.start("a", busy=open_phase is Phase.PREPARING)
    await bounded(plane.prepare(req("c1", SHORT if open_phase is Phase.PREPARING else LONG)))
    if open_phase is Phase.COMMITTED:
        await bounded(plane.commit(commit_req("c1", ckpt_dir, ["a"])))
    assert plane.phase is open_phase

    with pytest.raises(InvalidPhase):
        await bounded(plane.retire(retire_req(["a"])))
    with pytest.raises(InvalidPhase):
        await bounded(plane.forget(forget_req(["a"])))
    assert fake.count("retire") == 0
    assert plane.phase is open_phase

    await bounded(plane.resume(req("c1")))
    assert (await bounded(plane.retire(retire_req(["a"])))).retired_count == 1
    assert (await bounded(plane.forget(forget_req(["a"])))).forgotten_count == 1
    assert fake.retired == [["a"]]
    await plane.close()


# --- prepare (C5)


async def test_prepare_out_of_time_replies_preparing_with_capped_blockers_and_every_restart(fake, ckpt_dir):
    plane = ControlPlane(fake)
    busy = [f"b{number:03d}" for number in range(150)]
    restarts = [f"x{number:03d}" for number in range(120)]
    for key in busy:
        fake.start(key, busy=True)
    fake.restart_keys.update(restarts)

    reply = await bounded(plane.prepare(req("c1", SHORT)))
    assert reply.phase is Phase.PREPARING
    report = reply.report
    assert report.ready is False
    assert report.blockers == sorted(busy)[:100]
    assert report.blocker_count == 150
    assert report.restarts == sorted(restarts)  # never capped
    assert report.counts == {"live": 150, "busy": 150}
    assert fake.blocker_limits
    assert all(limit <= 100 for limit in fake.blocker_limits)
    assert plane.phase is Phase.PREPARING

    # not prepared yet: a commit is refused and exports nothing
    with pytest.raises(InvalidPhase):
        await bounded(plane.commit(commit_req("c1", ckpt_dir, busy[:3])))
    assert fake.count("export") == 0
    await plane.close()


async def test_prepare_with_only_restarts_is_ready(fake):
    plane = ControlPlane(fake)
    fake.start("a")
    fake.start("x")  # a restart keeps running but never blocks
    fake.restart_keys.add("x")
    reply = await bounded(plane.prepare(req("c1")))
    assert reply.phase is Phase.PREPARED
    assert reply.report.ready
    assert reply.report.restarts == ["x"]
    await plane.close()


async def test_prepare_retried_with_its_id_waits_again_and_closes_admission_once(fake):
    clock = FakeClock()
    plane = ControlPlane(fake, clock=clock)
    fake.start("a", busy=True)
    first = await bounded(plane.prepare(req("c1", SHORT, clock=clock)))
    assert first.phase is Phase.PREPARING
    assert first.report.blockers == ["a"]

    second = asyncio.create_task(plane.prepare(req("c1", LONG, clock=clock)))
    await drain()
    assert not second.done()
    fake.finish_step("a")
    reply = await bounded(second)
    assert reply.phase is Phase.PREPARED
    assert fake.count("close") == 1
    # the retry's deadline extended the lease
    assert plane.lease_expires_at == pytest.approx(clock() + LONG + 600.0)
    await plane.close()


async def test_prepare_sets_the_lease_from_the_deadline(fake):
    clock = FakeClock()
    plane = ControlPlane(fake, clock=clock, lease_grace_seconds=120.0)
    request = req("c1", 30.0, clock=clock)
    await bounded(plane.prepare(request))
    assert plane.lease_expires_at == request.deadline_ts + 120.0
    assert plane.status().lease_expires_at == request.deadline_ts + 120.0
    await plane.close()


async def test_a_close_admission_failure_during_prepare_reopens_admission(fake):
    plane = ControlPlane(fake)
    fake.start("a")
    fake.fail_close = RuntimeError("one worker did not close")
    with pytest.raises(RuntimeError):
        await bounded(plane.prepare(req("c1")))
    assert fake.admission_open
    assert fake.count("open") == 1
    assert plane.phase is Phase.IDLE
    assert plane.status().checkpoint_id is None
    assert plane.lease_expires_at is None

    fake.fail_close = None
    await prepared(plane, "c2")
    await plane.close()


async def test_a_prepare_retried_while_admission_is_closing_does_not_report_prepared_early(fake):
    plane = ControlPlane(fake)
    fake.start("a")
    fake.close_gate = asyncio.Event()
    first = asyncio.create_task(plane.prepare(req("c1")))
    await bounded(fake.started["close"].wait())

    second = asyncio.create_task(plane.prepare(req("c1")))
    await drain()
    # admission is not closed yet: nobody may call the participant prepared
    assert not second.done(), second.result()
    assert plane.phase is Phase.PREPARING
    fake.close_gate.set()
    replies = await bounded(asyncio.gather(first, second))
    assert [reply.phase for reply in replies] == [Phase.PREPARED, Phase.PREPARED]
    assert fake.count("close") == 1
    await plane.close()


# --- commit (C6)


@each_backend_and_s3
async def test_commit_stores_the_records_through_the_store(fake, ckpt_dir, storage):
    plane = ControlPlane(fake, **storage.plane_options)
    fake.start("a", {"step": 3, "nested": {"z": 1, "a": [1, 2.5, None]}})
    fake.start("b", {"step": 1})
    fake.start("c", {"step": 9})  # live but out of scope
    fake.extra_manifest = {"note": "fake"}
    fake.extra_commit_reply = {"staging_keys": ["k1"]}
    await prepared(plane)

    reply = await bounded(plane.commit(commit_req("c1", ckpt_dir, ["b", "a", "missing"])))
    assert fake.calls[fake.names().index("export")] == ("export", ["a", "b", "missing"])

    manifest, records = read_back(ckpt_dir, fake, storage.storage_options)
    assert manifest.checkpoint_id == "c1"
    assert manifest.record_count == 2
    assert list(manifest.episode_ids) == ["a", "b"]
    assert records == [
        {"episode_id": "a", "state": {"step": 3, "nested": {"z": 1, "a": [1, 2.5, None]}}},
        {"episode_id": "b", "state": {"step": 1}},
    ]
    raw = storage.read(ckpt_dir, "gym/environment/env-0/manifest.json")
    assert json.loads(raw)["note"] == "fake"

    assert reply.phase is Phase.COMMITTED
    assert reply.checkpoint_id == "c1"
    assert reply.manifest == json.loads(raw)  # the manifest object, as written
    assert reply.manifest_path == "gym/environment/env-0/manifest.json"
    assert reply.manifest_sha256 == hashlib.sha256(raw).hexdigest()
    assert reply.records_file == manifest.records_file
    assert reply.record_count == 2
    assert reply.records_bytes == manifest.records_bytes
    assert reply.episode_ids == ["a", "b"]
    assert reply.model_dump()["staging_keys"] == ["k1"]
    await plane.close()


async def test_a_commit_retried_after_a_failed_store_stores_the_same_records(fake, tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "gym").write_text("a file where the participant directory must go")
    plane = ControlPlane(fake)
    fake.start("a", {"step": 1})
    fake.start("b", {"step": 1})
    await prepared(plane)

    with pytest.raises(UnusableDirectory):
        await bounded(plane.commit(commit_req("c1", checkpoint, ["a", "b"])))
    assert plane.phase is Phase.PREPARED

    # the participant's state changes meanwhile: the cut stays the first one
    fake.finish_step("a", {"step": 2})
    fake.finish_step("b", {"step": 2})
    fake.start("c", {"step": 2})
    (checkpoint / "gym").unlink()

    reply = await bounded(plane.commit(commit_req("c1", checkpoint, ["b", "a"])))
    _, records = read_back(checkpoint, fake)
    assert records == [{"episode_id": "a", "state": {"step": 1}}, {"episode_id": "b", "state": {"step": 1}}]
    assert reply.episode_ids == ["a", "b"]
    assert fake.count("export") == 1
    assert plane.phase is Phase.COMMITTED
    await plane.close()


@each_backend
async def test_a_commit_retried_while_the_first_runs_awaits_it(fake, ckpt_dir, storage):
    plane = ControlPlane(fake, **storage.plane_options)
    fake.start("a")
    fake.start("b")
    await prepared(plane)
    fake.export_gate = asyncio.Event()

    first = asyncio.create_task(plane.commit(commit_req("c1", ckpt_dir, ["a", "b"])))
    await bounded(fake.started["export"].wait())
    second = asyncio.create_task(plane.commit(commit_req("c1", ckpt_dir, ["b", "a"])))
    await drain()
    assert not first.done()
    assert not second.done()

    fake.export_gate.set()
    first_reply, second_reply = await bounded(asyncio.gather(first, second))
    assert first_reply == second_reply
    # after it finished, a retry returns the finished result
    assert await bounded(plane.commit(commit_req("c1", ckpt_dir, ["a", "b"]))) == first_reply
    assert fake.count("export") == 1
    await plane.close()


async def test_a_commit_past_its_deadline_keeps_running_and_a_retry_gets_its_result(fake, ckpt_dir):
    plane = ControlPlane(fake)
    fake.start("a")
    await prepared(plane)
    fake.export_gate = asyncio.Event()

    with pytest.raises(DeadlineExceeded):
        await bounded(plane.commit(commit_req("c1", ckpt_dir, ["a"], SHORT)))
    assert plane.phase is Phase.PREPARED
    fake.export_gate.set()
    reply = await bounded(plane.commit(commit_req("c1", ckpt_dir, ["a"])))
    assert reply.episode_ids == ["a"]
    assert fake.count("export") == 1
    assert read_back(ckpt_dir, fake)[0].record_count == 1
    await plane.close()


async def test_a_failed_export_is_export_failed_for_good(fake, tmp_path):
    plane = ControlPlane(fake)
    fake.start("a")
    await prepared(plane)
    fake.fail_export = RuntimeError("export broke")

    with pytest.raises(ExportFailed):
        await bounded(plane.commit(commit_req("c1", tmp_path / "one", ["a"])))
    fake.fail_export = None
    for _ in range(2):
        with pytest.raises(ExportFailed):
            await bounded(plane.commit(commit_req("c1", tmp_path / "one", ["a"])))
    with pytest.raises(ExportFailed):
        await bounded(plane.commit(commit_req("c1", tmp_path / "two", ["a"])))
    with pytest.raises(ExportFailed):
        await bounded(plane.prepare(req("c1")))
    assert fake.count("export") == 1
    assert published(tmp_path) == []

    await bounded(plane.resume(req("c1")))
    assert fake.admission_open
    with pytest.raises(StaleCheckpoint):
        await bounded(plane.commit(commit_req("c1", tmp_path / "one", ["a"])))

    # a new id after resume exports and stores again
    await prepared(plane, "c2")
    reply = await bounded(plane.commit(commit_req("c2", tmp_path / "three", ["a"])))
    assert reply.episode_ids == ["a"]
    assert fake.count("export") == 2
    await plane.close()


async def test_an_export_that_outlived_its_commit_and_failed_is_export_failed_for_good(fake, ckpt_dir):
    plane = ControlPlane(fake)
    fake.start("a")
    await prepared(plane)
    fake.export_gate = asyncio.Event()
    with pytest.raises(DeadlineExceeded):
        await bounded(plane.commit(commit_req("c1", ckpt_dir, ["a"], SHORT)))
    fake.fail_export = RuntimeError("export broke late")
    fake.export_gate.set()
    with pytest.raises(ExportFailed):
        await bounded(plane.commit(commit_req("c1", ckpt_dir, ["a"])))
    fake.fail_export = None
    with pytest.raises(ExportFailed):
        await bounded(plane.commit(commit_req("c1", ckpt_dir, ["a"])))
    assert fake.count("export") == 1
    assert published(ckpt_dir) == []
    await plane.close()


async def test_a_commit_that_failed_deleting_restored_state_can_be_retried(fake, tmp_path):
    plane = ControlPlane(fake)
    await restored_then_resumed(plane, fake, tmp_path / "source", ["a", "b"])
    await prepared(plane)
    fake.fail_delete = RuntimeError("delete failed")
    with pytest.raises(RuntimeError):
        await bounded(plane.commit(commit_req("c1", tmp_path / "one", ["a-a1"])))
    manifest = (tmp_path / "one" / "gym" / "environment" / "env-0" / "manifest.json").read_bytes()

    fake.fail_delete = None
    reply = await bounded(plane.commit(commit_req("c1", tmp_path / "one", ["a-a1"])))
    assert reply.manifest_sha256 == hashlib.sha256(manifest).hexdigest()
    assert fake.count("delete_restored") == 2
    assert fake.deleted == [["b-a1"]]
    assert fake.count("export") == 1
    assert plane.phase is Phase.COMMITTED
    await plane.close()


async def test_readiness_regressed_after_prepare_is_export_failed_for_good(fake, ckpt_dir):
    plane = ControlPlane(fake)
    fake.start("a")
    await prepared(plane)
    fake.make_busy("a")

    with pytest.raises(ExportFailed):
        await bounded(plane.commit(commit_req("c1", ckpt_dir, ["a"])))
    fake.finish_step("a")
    with pytest.raises(ExportFailed):
        await bounded(plane.commit(commit_req("c1", ckpt_dir, ["a"])))
    with pytest.raises(ExportFailed):
        await bounded(plane.prepare(req("c1")))
    assert fake.count("export") == 0
    assert published(ckpt_dir) == []

    await bounded(plane.resume(req("c1")))
    await prepared(plane, "c2")
    reply = await bounded(plane.commit(commit_req("c2", ckpt_dir, ["a"])))
    assert reply.checkpoint_id == "c2"
    await plane.close()


async def test_a_commit_retried_with_another_scope_or_directory_conflicts(fake, tmp_path):
    plane = ControlPlane(fake)
    for key in ("a", "b", "c"):
        fake.start(key)
    await prepared(plane)
    fake.export_gate = asyncio.Event()
    running = asyncio.create_task(plane.commit(commit_req("c1", tmp_path / "one", ["a", "b"])))
    await bounded(fake.started["export"].wait())
    # while it runs
    with pytest.raises(CheckpointConflict):
        await bounded(plane.commit(commit_req("c1", tmp_path / "one", ["a"])))
    fake.export_gate.set()
    reply = await bounded(running)

    # once completed: the same scope in another order (and repeated) is the same commit
    assert await bounded(plane.commit(commit_req("c1", tmp_path / "one", ["b", "a"]))) == reply
    assert await bounded(plane.commit(commit_req("c1", tmp_path / "one", ["b", "a", "b"]))) == reply
    for directory, scope in (
        (tmp_path / "one", ["a"]),
        (tmp_path / "one", ["a", "b", "c"]),
        (tmp_path / "two", ["a", "b"]),
    ):
        with pytest.raises(CheckpointConflict):
            await bounded(plane.commit(commit_req("c1", directory, scope)))
    assert fake.count("export") == 1
    assert published(tmp_path / "two") == []
    await plane.close()


async def test_a_scope_naming_a_restart_is_restart_in_scope(fake, ckpt_dir):
    plane = ControlPlane(fake)
    fake.start("a")
    fake.start("x")
    fake.restart_keys.add("x")
    await prepared(plane)

    with pytest.raises(RestartInScope):
        await bounded(plane.commit(commit_req("c1", ckpt_dir, ["a", "x"])))
    assert fake.count("export") == 0
    assert published(ckpt_dir) == []
    reply = await bounded(plane.commit(commit_req("c1", ckpt_dir, ["a"])))
    assert reply.episode_ids == ["a"]
    await plane.close()


async def test_commit_without_an_open_checkpoint_is_invalid_phase(fake, ckpt_dir):
    plane = ControlPlane(fake)
    fake.start("a")
    with pytest.raises(InvalidPhase):
        await bounded(plane.commit(commit_req("c1", ckpt_dir, ["a"])))
    assert fake.count("export") == 0
    await plane.close()


@each_backend
async def test_commit_deletes_the_restored_episodes_its_scope_leaves_out(fake, storage):
    plane = ControlPlane(fake, **storage.plane_options)
    await restored_then_resumed(plane, fake, storage.url("source"), ["a", "b", "c"])
    fake.start("n")
    await prepared(plane)

    reply = await bounded(plane.commit(commit_req("c1", storage.url("one"), ["a-a1", "n"])))
    assert reply.episode_ids == ["a-a1", "n"]
    assert fake.deleted == [["b-a1", "c-a1"]]
    assert fake.count("retire") == 0
    for key in ("a-a1", "b-a1", "c-a1"):
        assert not plane.marks.is_refused(key)  # deleted, not retired
    _, records = read_back(storage.url("one"), fake)
    assert [record["episode_id"] for record in records] == ["a-a1", "n"]
    assert records[0]["state"] == {"of": "a"}

    # the next checkpoint deletes only what it leaves out of what is still restored
    await bounded(plane.resume(req("c1")))
    await prepared(plane, "c2")
    await bounded(plane.commit(commit_req("c2", storage.url("two"), ["n"])))
    assert fake.deleted == [["b-a1", "c-a1"], ["a-a1"]]
    await plane.close()


async def test_delete_restored_defaults_to_retire(tmp_path):
    class RetireOnly(FakeParticipant):
        delete_restored = Participant.delete_restored

    fake = RetireOnly()
    plane = ControlPlane(fake)
    await restored_then_resumed(plane, fake, tmp_path / "source", ["a", "b"])
    await prepared(plane)
    await bounded(plane.commit(commit_req("c1", tmp_path / "one", ["a-a1"])))
    assert fake.retired == [["b-a1"]]
    assert not plane.marks.is_refused("b-a1")
    await plane.close()


# --- resume (C7)


class SlowWrite:
    """The store's records stream blocks after its first record until ``WriteStop.stop()`` ran."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.blocked = threading.Event()
        self.stopped = threading.Event()
        write = CheckpointStore.write_participant
        stop = WriteStop.stop

        def slow_write(store: CheckpointStore, checkpoint_dir: str, *, records: Any, **kwargs: Any) -> Any:
            def stream() -> Any:
                iterator = iter(records)
                yield next(iterator)
                self.blocked.set()
                self.stopped.wait(WAIT)
                yield from iterator

            return write(store, checkpoint_dir, records=stream(), **kwargs)

        def slow_stop(write_stop: WriteStop) -> None:
            stop(write_stop)
            self.stopped.set()

        monkeypatch.setattr(CheckpointStore, "write_participant", slow_write)
        monkeypatch.setattr(WriteStop, "stop", slow_stop)

    def release(self) -> None:
        self.stopped.set()


async def test_resume_stops_a_write_that_outlived_its_commit(fake, ckpt_dir, monkeypatch):
    slow = SlowWrite(monkeypatch)
    try:
        plane = ControlPlane(fake)
        fake.start("a")
        fake.start("b")
        await prepared(plane)
        with pytest.raises(DeadlineExceeded):
            await bounded(plane.commit(commit_req("c1", ckpt_dir, ["a", "b"], SHORT)))
        await bounded(asyncio.to_thread(slow.blocked.wait, WAIT))

        resumed = await bounded(plane.resume(req("c1")))
        assert resumed.phase is Phase.IDLE
        assert published(ckpt_dir) == []
        assert fake.admission_open
        with pytest.raises(StaleCheckpoint):
            await bounded(plane.commit(commit_req("c1", ckpt_dir, ["a", "b"])))
        assert published(ckpt_dir) == []
        await plane.close()
    finally:
        slow.release()


async def test_resume_gives_the_awaiting_commit_caller_an_error(fake, ckpt_dir, monkeypatch):
    slow = SlowWrite(monkeypatch)
    try:
        plane = ControlPlane(fake)
        fake.start("a")
        fake.start("b")
        await prepared(plane)
        commit = asyncio.create_task(plane.commit(commit_req("c1", ckpt_dir, ["a", "b"])))
        await bounded(asyncio.to_thread(slow.blocked.wait, WAIT))

        await bounded(plane.resume(req("c1")))
        with pytest.raises(GymckptError):
            await bounded(commit)
        assert published(ckpt_dir) == []
        await plane.close()
    finally:
        slow.release()


async def test_resume_cancelling_a_running_export_gives_the_commit_caller_export_failed(fake, ckpt_dir):
    plane = ControlPlane(fake)
    fake.start("a")
    await prepared(plane)
    fake.export_gate = asyncio.Event()
    commit = asyncio.create_task(plane.commit(commit_req("c1", ckpt_dir, ["a"])))
    await bounded(fake.started["export"].wait())

    await bounded(plane.resume(req("c1")))
    assert plane.phase is Phase.IDLE
    with pytest.raises(ExportFailed):
        await bounded(commit)
    assert "export_done" not in fake.names()
    assert published(ckpt_dir) == []
    await plane.close()


async def test_resume_waits_for_a_publication_under_way(fake, ckpt_dir, monkeypatch):
    publishing = threading.Event()
    release = threading.Event()
    create = LocalBackend.create_if_absent

    def slow_create(backend: LocalBackend, path: str, data: bytes) -> Any:
        if path.endswith("manifest.json"):
            publishing.set()
            release.wait(WAIT)
        return create(backend, path, data)

    monkeypatch.setattr(LocalBackend, "create_if_absent", slow_create)
    try:
        plane = ControlPlane(fake)
        fake.start("a")
        await prepared(plane)
        commit = asyncio.create_task(plane.commit(commit_req("c1", ckpt_dir, ["a"])))
        await bounded(asyncio.to_thread(publishing.wait, WAIT))

        resume = asyncio.create_task(plane.resume(req("c1")))
        done, _ = await asyncio.wait({resume}, timeout=0.2)
        assert not done, "resume returned while a manifest was being published"
        release.set()
        await bounded(resume)
        files_at_resume = published(ckpt_dir)
        # the publication under way completed before resume returned, and nothing appears after
        assert [path.name for path in files_at_resume if path.name == "manifest.json"] == ["manifest.json"]
        assert (await bounded(commit)).episode_ids == ["a"]
        assert published(ckpt_dir) == files_at_resume
        await plane.close()
    finally:
        release.set()


async def test_resume_out_of_time_keeps_the_phase_and_a_retry_works(fake, tmp_path):
    plane = ControlPlane(fake)
    await restored_then_resumed(plane, fake, tmp_path / "source", ["a", "b"])
    await prepared(plane)
    fake.delete_gate = asyncio.Event()
    commit = asyncio.create_task(plane.commit(commit_req("c1", tmp_path / "one", ["a-a1"])))
    await bounded(fake.started["delete_restored"].wait())
    phase = plane.phase
    opens = fake.count("open")

    with pytest.raises(DeadlineExceeded):
        await bounded(plane.resume(req("c1", SHORT)))
    assert plane.phase is phase
    assert plane.status().checkpoint_id == "c1"
    assert not fake.admission_open
    assert fake.count("open") == opens

    fake.delete_gate.set()
    resumed = await bounded(plane.resume(req("c1")))
    assert resumed.phase is Phase.IDLE
    assert fake.admission_open
    names = fake.names()
    assert names.index("delete_restored_done") < len(names) - 1 - names[::-1].index("open")
    await bounded(commit)
    assert fake.deleted == [["b-a1"]]
    await plane.close()


async def test_resume_out_of_time_reopening_admission_keeps_the_phase(fake):
    plane = ControlPlane(fake)
    fake.start("a")
    await prepared(plane)
    fake.open_gate = asyncio.Event()
    with pytest.raises(DeadlineExceeded):
        await bounded(plane.resume(req("c1", SHORT)))
    assert plane.phase is Phase.PREPARED
    fake.open_gate.set()
    resumed = await bounded(plane.resume(req("c1")))
    assert resumed.phase is Phase.IDLE
    assert fake.admission_open
    await plane.close()


async def test_a_repeated_resume_is_a_no_op(fake):
    plane = ControlPlane(fake)
    fake.start("a")
    await prepared(plane, "c1")
    first = await bounded(plane.resume(req("c1")))
    second = await bounded(plane.resume(req("c1")))
    assert first == ResumeReply(phase=Phase.IDLE, idempotent=False, checkpoint_id="c1")
    assert second == ResumeReply(phase=Phase.IDLE, idempotent=True, checkpoint_id="c1")
    assert fake.count("open") == 1

    # a late resume of c1 while c2 is open changes nothing
    await prepared(plane, "c2")
    late = await bounded(plane.resume(req("c1")))
    assert late.checkpoint_id == "c1"
    assert late.idempotent
    assert plane.phase is Phase.PREPARED
    assert plane.status().checkpoint_id == "c2"
    assert not fake.admission_open
    assert fake.count("open") == 1
    await bounded(plane.resume(req("c2")))
    assert fake.admission_open
    await plane.close()


# --- restore over live work; forget while a retire frees


async def test_restore_refuses_a_process_that_already_serves_work(fake, tmp_path):
    seed_checkpoint(tmp_path / "source", "c0", [{"episode_id": "a", "state": {}}], fake=fake)
    plane = ControlPlane(fake)
    fake.start("z")  # never prepared, but it serves an episode: not a fresh process
    with pytest.raises(ControlError) as refused:
        await bounded(plane.restore(restore_req("c0", tmp_path / "source", ["a"])))
    assert (refused.value.code, refused.value.status) == ("checkpoint_error", 409)
    assert "'z'" in str(refused.value)
    assert plane.phase is Phase.IDLE and fake.count("install") == 0
    assert not plane.marks.is_refused("a")  # refused before it marked anything
    await plane.close()


async def test_forget_while_a_retire_still_frees_its_rollout_is_retire_incomplete(fake):
    plane = ControlPlane(fake)
    fake.start("a")
    fake.start("b")
    fake.retire_gate = asyncio.Event()
    retire = asyncio.create_task(plane.retire(retire_req(["a-a1"])))
    await asyncio.wait_for(fake.started["retire"].wait(), 5)
    with pytest.raises(RetireIncomplete):
        await bounded(plane.forget(forget_req(["a"])))
    assert plane.marks.is_refused("a-a1")  # the refusal stays
    assert (await bounded(plane.forget(forget_req(["b"])))).forgotten_count == 0  # another rollout: fine
    fake.retire_gate.set()
    assert (await bounded(retire)).retired_count == 1
    assert (await bounded(plane.forget(forget_req(["a"])))).forgotten_count == 1
    await plane.close()


# --- the reference's commit: stop, no scope; resume of an unseen id


async def test_a_commit_with_stop_parks_the_exported_episodes_once_and_a_failure_keeps_the_commit(fake, ckpt_dir):
    plane = ControlPlane(fake)
    fake.start("a")
    fake.start("b")
    await prepared(plane, "c1")
    fake.fail_park = RuntimeError("the sandbox service is down")
    stopping = commit_req("c1", ckpt_dir, ["a"]).model_copy(update={"stop": True})
    reply = await bounded(plane.commit(stopping))
    assert reply.phase is Phase.COMMITTED and reply.episode_ids == ["a"]
    assert fake.arguments("park") == [["a"]]  # the exported records, after the durable write
    assert fake.names().index("park") > fake.names().index("export_done")
    assert await bounded(plane.commit(stopping)) == reply  # a retry parks no second time
    assert fake.count("park") == 1
    assert plane.phase is Phase.COMMITTED
    await bounded(plane.resume(req("c1")))
    await plane.close()


async def test_a_commit_without_stop_parks_nothing(fake, ckpt_dir):
    plane = ControlPlane(fake)
    fake.start("a")
    await prepared(plane, "c1")
    await bounded(plane.commit(commit_req("c1", ckpt_dir, ["a"])))
    assert fake.count("park") == 0
    await plane.close()


async def test_a_commit_without_a_scope_exports_every_live_episode_and_deletes_no_restored_state(fake, tmp_path):
    seed_checkpoint(tmp_path / "source", "c0", [{"episode_id": "r", "state": {"of": "r"}}], fake=fake)
    plane = ControlPlane(fake)
    await bounded(plane.restore(restore_req("c0", tmp_path / "source", ["r"])))
    await bounded(plane.resume(req("c0")))
    fake.start("a")
    await prepared(plane, "c1")
    unscoped = commit_req("c1", tmp_path / "c1", []).model_copy(update={"episode_ids": None})
    reply = await bounded(plane.commit(unscoped))
    assert reply.episode_ids == ["a", "r-a1"]  # everything live, the restored episode too
    assert fake.arguments("export") == [None]
    assert fake.count("delete_restored") == 0
    # a retry with a scope is another commit: refused
    with pytest.raises(CheckpointConflict):
        await bounded(plane.commit(commit_req("c1", tmp_path / "c1", ["a"])))
    await plane.close()


async def test_a_resume_of_an_id_never_seen_is_idempotent_and_remembered(fake):
    plane = ControlPlane(fake)
    reply = await bounded(plane.resume(req("c9")))
    assert reply == ResumeReply(phase=Phase.IDLE, idempotent=True, checkpoint_id="c9")
    assert fake.count("open") == 0
    # the prepare that stopped at an earlier stage arrives late: stale, admission stays open
    with pytest.raises(StaleCheckpoint):
        await bounded(plane.prepare(req("c9")))
    assert fake.admission_open and fake.count("close") == 0
    await prepared(plane, "c10")
    await bounded(plane.resume(req("c10")))
    await plane.close()


# --- lease (C8)


@pytest.mark.parametrize("open_phase", [Phase.PREPARING, Phase.PREPARED, Phase.COMMITTED])
async def test_an_expired_lease_resumes_by_itself(fake, ckpt_dir, open_phase):
    clock = FakeClock()
    plane = ControlPlane(fake, clock=clock, lease_grace_seconds=600.0)
    fake.start("a", busy=open_phase is Phase.PREPARING)
    request = req("c1", SHORT if open_phase is Phase.PREPARING else 10.0, clock=clock)
    await bounded(plane.prepare(request))
    if open_phase is Phase.COMMITTED:
        commit = commit_req("c1", ckpt_dir, ["a"]).model_copy(update={"deadline_ts": request.deadline_ts})
        await bounded(plane.commit(commit))
    assert plane.phase is open_phase
    assert plane.lease_expires_at == request.deadline_ts + 600.0

    assert await bounded(plane.expire_lease()) is False
    clock.set(request.deadline_ts + 599.0)
    assert await bounded(plane.expire_lease()) is False
    assert plane.phase is open_phase
    assert not fake.admission_open

    clock.set(request.deadline_ts + 601.0)
    assert await bounded(plane.expire_lease()) is True
    assert plane.phase is Phase.IDLE
    assert fake.admission_open
    assert plane.lease_expires_at is None
    assert plane.status().checkpoint_id is None
    with pytest.raises(StaleCheckpoint):
        await bounded(plane.prepare(req("c1", clock=clock)))
    await plane.close()


async def test_an_expired_lease_of_a_restore_resumes_it(fake, tmp_path):
    clock = FakeClock()
    plane = ControlPlane(fake, clock=clock, lease_grace_seconds=600.0)
    seed_checkpoint(tmp_path / "source", "c0", [{"episode_id": "a", "state": {}}], fake=fake)
    request = restore_req("c0", tmp_path / "source", ["a"])
    request = request.model_copy(update={"deadline_ts": clock() + 10.0})
    await bounded(plane.restore(request))
    assert plane.phase is Phase.RESTORED
    clock.advance(611.0)
    assert await bounded(plane.expire_lease()) is True
    assert plane.phase is Phase.IDLE
    assert fake.admission_open
    await plane.close()


async def test_a_failing_resume_on_lease_expiry_is_retried(fake):
    clock = FakeClock()
    plane = ControlPlane(fake, clock=clock)
    fake.start("a")
    await bounded(plane.prepare(req("c1", 10.0, clock=clock)))
    clock.advance(611.0)
    fake.fail_open = RuntimeError("reopen failed")
    with pytest.raises(RuntimeError):
        await bounded(plane.expire_lease())
    assert plane.phase is Phase.PREPARED
    assert plane.status().checkpoint_id == "c1"

    fake.fail_open = None
    assert await bounded(plane.expire_lease()) is True
    assert plane.phase is Phase.IDLE
    assert fake.admission_open
    await plane.close()


async def test_a_lease_expiry_out_of_time_keeps_the_phase_and_succeeds_on_retry(fake, monkeypatch):
    monkeypatch.setattr(plane_module, "LEASE_RETRY_SECONDS", SHORT)
    clock = FakeClock()
    plane = ControlPlane(fake, clock=clock)
    fake.start("a")
    await bounded(plane.prepare(req("c1", 10.0, clock=clock)))
    clock.advance(611.0)
    fake.open_gate = asyncio.Event()
    with pytest.raises(DeadlineExceeded):
        await bounded(plane.expire_lease())
    assert plane.phase is Phase.PREPARED
    assert not fake.admission_open
    fake.open_gate.set()
    assert await bounded(plane.expire_lease()) is True
    assert plane.phase is Phase.IDLE
    assert fake.admission_open
    await plane.close()


async def test_the_lease_watcher_resumes_and_retries_after_an_error(fake, monkeypatch):
    monkeypatch.setattr(plane_module, "LEASE_RETRY_SECONDS", 0.02)
    plane = ControlPlane(fake, lease_grace_seconds=0.02)
    fake.start("a")
    fake.fail_open = RuntimeError("reopen failed once")
    fake.fail_open_once = True
    await bounded(plane.prepare(req("c1", 0.02)))

    await bounded(fake.opened.wait())
    await drain()
    assert fake.count("open") == 2
    assert plane.phase is Phase.IDLE
    assert plane.lease_expires_at is None
    await plane.close()


async def test_renew_extends_the_lease(fake):
    clock = FakeClock()
    plane = ControlPlane(fake, clock=clock, lease_grace_seconds=600.0)
    fake.start("a")
    first = req("c1", 10.0, clock=clock)
    await bounded(plane.prepare(first))
    assert plane.lease_expires_at == first.deadline_ts + 600.0

    later = ControlRequest(checkpoint_id="c1", deadline_ts=first.deadline_ts + 90.0)
    reply = await bounded(plane.renew(later))
    assert reply.checkpoint_id == "c1"
    assert reply.phase is Phase.PREPARED
    assert reply.lease_expires_at == later.deadline_ts + 600.0
    assert plane.status().lease_expires_at == later.deadline_ts + 600.0

    clock.set(first.deadline_ts + 601.0)  # the first lease would have expired
    assert await bounded(plane.expire_lease()) is False
    assert plane.phase is Phase.PREPARED
    clock.set(later.deadline_ts + 601.0)
    assert await bounded(plane.expire_lease()) is True
    assert plane.phase is Phase.IDLE
    await plane.close()


async def test_renew_outside_an_open_checkpoint_is_refused(fake):
    plane = ControlPlane(fake)
    fake.start("a")
    with pytest.raises(InvalidPhase):
        await bounded(plane.renew(req("c1")))
    await prepared(plane, "c1")
    with pytest.raises(CheckpointConflict):
        await bounded(plane.renew(req("c2")))
    await bounded(plane.resume(req("c1")))
    with pytest.raises(StaleCheckpoint):
        await bounded(plane.renew(req("c1")))
    await plane.close()


# --- retire and forget (C9)


async def test_retire_marks_before_its_deadline_limited_work(fake):
    plane = ControlPlane(fake)
    fake.start("r-a1")
    fake.retire_gate = asyncio.Event()

    with pytest.raises(DeadlineExceeded):
        await bounded(plane.retire(retire_req(["r-a1"], SHORT)))
    for key in ("r", "r-a1"):
        with pytest.raises(StaleAttempt):
            plane.marks.check(key)
    plane.marks.check("r-a2")  # a later attempt still runs
    assert plane.status().retired_rollouts == 1

    # a retry waits for the same stop instead of starting another
    retry = asyncio.create_task(plane.retire(retire_req(["r-a1"])))
    await drain()
    assert not retry.done()
    fake.retire_gate.set()
    reply = await bounded(retry)
    assert reply.retired_count == 1
    assert fake.count("retire") == 1
    assert fake.retired == [["r-a1"]]
    assert "r-a1" not in fake.state
    await plane.close()


async def test_a_retire_past_its_deadline_on_arrival_still_marks(fake):
    plane = ControlPlane(fake)
    fake.retire_gate = asyncio.Event()
    with pytest.raises(DeadlineExceeded):
        await bounded(plane.retire(retire_req(["late-a3"], deadline_ts=1.0)))
    with pytest.raises(StaleAttempt):
        plane.marks.check("late-a2")
    fake.retire_gate.set()
    await plane.close()


async def test_retire_marks_every_earlier_attempt_and_counts_rollouts(fake):
    plane = ControlPlane(fake)
    reply = await bounded(plane.retire(retire_req(["a", "a", "b-a2"])))
    assert reply.retired_count == 2
    for key in ("a", "b", "b-a1", "b-a2"):
        assert plane.marks.is_refused(key)
    for key in ("a-a1", "b-a3", "c"):
        assert not plane.marks.is_refused(key)
    await plane.close()


async def test_marks_survive_a_failed_retire(fake):
    plane = ControlPlane(fake)
    fake.fail_retire = RuntimeError("could not stop")
    with pytest.raises(RuntimeError):
        await bounded(plane.retire(retire_req(["r-a2"])))
    for key in ("r", "r-a1", "r-a2"):
        with pytest.raises(StaleAttempt):
            plane.marks.check(key)
    assert plane.status().retired_rollouts == 1

    fake.fail_retire = None
    assert (await bounded(plane.retire(retire_req(["r-a2"])))).retired_count == 1
    assert fake.count("retire") == 2
    await plane.close()


async def test_forget_removes_marks_and_counts_them(fake):
    plane = ControlPlane(fake)
    await bounded(plane.retire(retire_req(["a", "b-a2"])))
    await bounded(plane.retire(retire_req(["c"])))
    await bounded(plane.retire(retire_req(["c-a1"])))
    assert plane.status().retired_rollouts == 3  # one entry per rollout

    reply = await bounded(plane.forget(forget_req(["a", "b", "never-retired", "a"])))
    assert reply.forgotten_count == 2
    plane.marks.check("a")
    plane.marks.check("b-a2")
    with pytest.raises(StaleAttempt):
        plane.marks.check("c-a1")
    assert plane.status().retired_rollouts == 1
    assert (await bounded(plane.forget(forget_req(["a"])))).forgotten_count == 0
    assert (await bounded(plane.forget(forget_req(["c"])))).forgotten_count == 1
    assert plane.status().retired_rollouts == 0
    await plane.close()


# --- restore (C10)


@each_backend_and_s3
async def test_restore_installs_the_scope_under_the_next_attempt_and_marks_the_replaced(fake, storage):
    source = storage.url("source")
    seed_checkpoint(
        source,
        "c0",
        [
            {"episode_id": "r", "state": {"of": "r"}},
            {"episode_id": "s-a1", "state": {"of": "s-a1"}},
            {"episode_id": "u", "state": {"of": "u"}},  # out of scope
        ],
        fake=fake,
        storage_options=storage.storage_options,
    )
    plane = ControlPlane(fake, **storage.plane_options)  # a fresh process
    reply = await bounded(plane.restore(restore_req("c0", source, ["s-a1", "t", "r"])))

    # restored: the attempts whose records were installed (t has none); the install sees the whole scope
    assert reply == RestoreReply(phase=Phase.RESTORED, source_checkpoint_id="c0", restored=["r-a1", "s-a2"])
    assert fake.installed_scope == ["r-a1", "s-a2", "t-a1"]
    assert sorted(fake.installed, key=lambda record: record["episode_id"]) == [
        {"episode_id": "r-a1", "state": {"of": "r"}},
        {"episode_id": "s-a2", "state": {"of": "s-a1"}},
    ]
    assert all(next(iter(record)) == "episode_id" for record in fake.installed)
    assert plane.phase is Phase.RESTORED
    assert plane.status().checkpoint_id == "c0"
    assert not fake.admission_open

    for key in ("r", "s", "s-a1", "t"):
        with pytest.raises(StaleAttempt):
            plane.marks.check(key)
    for key in ("r-a1", "s-a2", "t-a1", "u"):
        plane.marks.check(key)
    assert plane.status().retired_rollouts == 3

    resumed = await bounded(plane.resume(req("c0")))
    assert resumed.phase is Phase.IDLE
    assert fake.admission_open
    assert plane.marks.is_refused("s-a1")  # marks outlive the restore until forget
    assert (await bounded(plane.forget(forget_req(["r", "s", "t"])))).forgotten_count == 3
    assert not plane.marks.is_refused("s-a1")
    await plane.close()


async def test_retire_and_forget_after_a_restore_carry_its_id_and_extend_its_lease(fake, tmp_path):
    clock = FakeClock()
    seed_checkpoint(tmp_path / "source", "c0", [{"episode_id": "a", "state": {}}], fake=fake)
    plane = ControlPlane(fake, clock=clock, lease_grace_seconds=600.0)
    restore = restore_req("c0", tmp_path / "source", ["a"]).model_copy(update={"deadline_ts": clock() + 10.0})
    await bounded(plane.restore(restore))
    assert plane.phase is Phase.RESTORED
    assert plane.lease_expires_at == restore.deadline_ts + 600.0

    # another id than the open restore's is a conflict, and marks nothing
    with pytest.raises(CheckpointConflict):
        await bounded(plane.retire(retire_req(["a-a1"], checkpoint_id="other")))
    assert not plane.marks.is_refused("a-a1")
    with pytest.raises(CheckpointConflict):
        await bounded(plane.forget(forget_req(["a"])))

    later = clock() + 100.0
    reply = await bounded(plane.retire(retire_req(["a-a1"], deadline_ts=later, checkpoint_id="c0")))
    assert reply.retired_count == 1
    assert plane.lease_expires_at == later + 600.0
    forget = forget_req(["a"]).model_copy(update={"checkpoint_id": "c0", "deadline_ts": later + 50.0})
    assert (await bounded(plane.forget(forget))).forgotten_count == 1
    assert plane.lease_expires_at == later + 650.0
    assert plane.phase is Phase.RESTORED
    await plane.close()


async def test_restore_is_refused_once_the_process_took_part_in_a_checkpoint(fake, tmp_path):
    seed_checkpoint(tmp_path / "source", "c0", [{"episode_id": "a", "state": {}}], fake=fake)
    plane = ControlPlane(fake)
    fake.start("z")
    await prepared(plane, "c1")
    with pytest.raises(InvalidPhase):
        await bounded(plane.restore(restore_req("c0", tmp_path / "source", ["a"])))
    await bounded(plane.resume(req("c1")))
    with pytest.raises(InvalidPhase):
        await bounded(plane.restore(restore_req("c0", tmp_path / "source", ["a"])))
    assert fake.count("install") == 0
    assert len(plane.marks) == 0
    assert fake.admission_open
    assert plane.phase is Phase.IDLE
    await plane.close()


@each_backend
async def test_a_restore_retried_with_its_arguments_replies_the_same_and_with_others_conflicts(fake, storage):
    for name in ("source", "other"):
        seed_checkpoint(
            storage.url(name),
            "c0",
            [{"episode_id": "a", "state": {}}, {"episode_id": "b", "state": {}}],
            fake=fake,
        )
    plane = ControlPlane(fake, **storage.plane_options)
    first = await bounded(plane.restore(restore_req("c0", storage.url("source"), ["a", "b"])))
    again = await bounded(plane.restore(restore_req("c0", storage.url("source"), ["b", "a"])))
    assert again == first
    for checkpoint_id, directory, scope in (
        ("c0", storage.url("source"), ["a"]),
        ("c0", storage.url("other"), ["a", "b"]),
        ("c9", storage.url("source"), ["a", "b"]),
    ):
        with pytest.raises(CheckpointConflict):
            await bounded(plane.restore(restore_req(checkpoint_id, directory, scope)))
    assert fake.count("install") == 1
    assert plane.phase is Phase.RESTORED
    await plane.close()


async def test_a_restore_retried_while_admission_is_closing_awaits_the_first(fake, tmp_path):
    seed_checkpoint(tmp_path / "source", "c0", [{"episode_id": "a", "state": {}}], fake=fake)
    plane = ControlPlane(fake)
    fake.close_gate = asyncio.Event()
    first = asyncio.create_task(plane.restore(restore_req("c0", tmp_path / "source", ["a"])))
    await bounded(fake.started["close"].wait())

    second = asyncio.create_task(plane.restore(restore_req("c0", tmp_path / "source", ["a"])))
    await drain()
    fake.close_gate.set()
    first_reply = await bounded(first)
    second_reply = await bounded(second)  # the same restore: the same reply, not invalid_phase
    assert second_reply == first_reply
    assert fake.count("install") == 1
    await plane.close()


async def test_prepare_while_a_restore_is_open_conflicts_with_another_id_and_is_invalid_phase_with_its_own(
    fake, tmp_path
):
    seed_checkpoint(tmp_path / "source", "c0", [{"episode_id": "a", "state": {}}], fake=fake)
    plane = ControlPlane(fake)
    await bounded(plane.restore(restore_req("c0", tmp_path / "source", ["a"])))
    with pytest.raises(CheckpointConflict):
        await bounded(plane.prepare(req("c1")))
    with pytest.raises(InvalidPhase):
        await bounded(plane.prepare(req("c0")))
    assert plane.phase is Phase.RESTORED
    await bounded(plane.resume(req("c0")))
    fake.start("b")
    await prepared(plane, "c1")
    await plane.close()


async def test_an_install_past_its_deadline_is_kept_and_retire_waits_for_it(fake, tmp_path):
    seed_checkpoint(
        tmp_path / "source", "c0", [{"episode_id": "a", "state": {}}, {"episode_id": "b", "state": {}}], fake=fake
    )
    plane = ControlPlane(fake)
    fake.install_gate = asyncio.Event()
    with pytest.raises(DeadlineExceeded):
        await bounded(plane.restore(restore_req("c0", tmp_path / "source", ["a", "b"], SHORT)))
    assert plane.phase is Phase.RESTORED
    assert fake.count("install") == 1
    assert plane.marks.is_refused("a")  # the replaced attempts are refused, also past the deadline
    assert plane.marks.is_refused("b")
    assert not fake.admission_open

    retry = asyncio.create_task(plane.restore(restore_req("c0", tmp_path / "source", ["b", "a"])))
    retire = asyncio.create_task(plane.retire(retire_req(["a-a1"], checkpoint_id="c0")))
    await drain()
    assert plane.marks.is_refused("a-a1")  # marked before waiting
    assert fake.count("retire") == 0
    assert not retire.done()
    assert not retry.done()

    fake.install_gate.set()
    assert (await bounded(retire)).retired_count == 1
    assert (await bounded(retry)).restored == ["a-a1", "b-a1"]
    names = fake.names()
    assert names.index("install_done") < names.index("retire")
    assert fake.count("install") == 1
    await plane.close()


async def test_resume_reopens_admission_only_after_an_install_that_outlived_its_restore(fake, tmp_path):
    seed_checkpoint(tmp_path / "source", "c0", [{"episode_id": "a", "state": {}}], fake=fake)
    plane = ControlPlane(fake)
    fake.install_gate = asyncio.Event()
    with pytest.raises(DeadlineExceeded):
        await bounded(plane.restore(restore_req("c0", tmp_path / "source", ["a"], SHORT)))

    with pytest.raises(DeadlineExceeded):
        await bounded(plane.resume(req("c0", SHORT)))
    assert plane.phase is Phase.RESTORED
    assert fake.count("open") == 0

    resume = asyncio.create_task(plane.resume(req("c0")))
    await drain()
    assert not resume.done()
    assert fake.count("open") == 0
    fake.install_gate.set()
    assert (await bounded(resume)).phase is Phase.IDLE
    names = fake.names()
    assert names.index("install_done") < names.index("open")
    assert fake.admission_open
    await plane.close()


async def test_a_failed_install_reopens_admission_and_returns_to_idle(fake, tmp_path):
    seed_checkpoint(tmp_path / "source", "c0", [{"episode_id": "a", "state": {}}], fake=fake)
    plane = ControlPlane(fake)
    fake.fail_install = RuntimeError("install broke")
    with pytest.raises(InvalidCheckpointState, match=r"'a-a1'.*install broke") as raised:
        await bounded(plane.restore(restore_req("c0", tmp_path / "source", ["a"])))
    assert isinstance(raised.value.__cause__, RuntimeError)  # a hook that raises is a 422 naming the episode
    assert plane.phase is Phase.IDLE
    assert fake.admission_open
    assert plane.lease_expires_at is None
    assert plane.marks.is_refused("a")  # the replaced attempt stays refused

    # still a fresh process: the restore can run again
    fake.fail_install = None
    reply = await bounded(plane.restore(restore_req("c0", tmp_path / "source", ["a"])))
    assert reply.restored == ["a-a1"]
    assert fake.count("install") == 2
    await plane.close()


async def test_a_damaged_checkpoint_fails_the_restore_with_a_typed_error_and_reopens_admission(fake, tmp_path):
    plane = ControlPlane(fake)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidCheckpointState):
        await bounded(plane.restore(restore_req("c0", tmp_path / "empty", ["a"])))
    assert plane.phase is Phase.IDLE
    assert fake.admission_open
    assert fake.count("install") == 0
    await plane.close()


async def test_a_close_admission_failure_during_restore_reopens_admission(fake, tmp_path):
    seed_checkpoint(tmp_path / "source", "c0", [{"episode_id": "a", "state": {}}], fake=fake)
    plane = ControlPlane(fake)
    fake.fail_close = RuntimeError("one worker did not close")
    with pytest.raises(RuntimeError):
        await bounded(plane.restore(restore_req("c0", tmp_path / "source", ["a"])))
    assert fake.admission_open
    assert plane.phase is Phase.IDLE
    assert fake.count("install") == 0
    await plane.close()


async def test_a_reopen_that_failed_in_a_restore_rollback_is_retried_by_resume(fake, tmp_path):
    seed_checkpoint(tmp_path / "source", "c0", [{"episode_id": "a", "state": {}}], fake=fake)
    plane = ControlPlane(fake)
    fake.fail_close = RuntimeError("one worker did not close")
    fake.fail_open = RuntimeError("reopen failed too")
    with pytest.raises(RuntimeError):
        await bounded(plane.restore(restore_req("c0", tmp_path / "source", ["a"])))
    assert not fake.admission_open

    fake.fail_open = None
    await bounded(plane.resume(req("c0")))
    assert fake.admission_open
    await plane.close()


# --- status (C11)


async def test_status_shape(fake):
    clock = FakeClock()
    plane = ControlPlane(fake, clock=clock)
    fake.extra_status = {"checkpoint_verify": "wait"}
    fake.start("a", busy=True)
    fake.restart_keys.add("x")

    data = plane.status().model_dump(mode="json")
    assert data == {
        "kind": "environment",
        "instance": "env-0",
        "phase": "idle",
        "checkpoint_id": None,
        "lease_expires_at": None,
        "retired_rollouts": 0,
        "report": {
            "ready": False,
            "blockers": ["a"],
            "blocker_count": 1,
            "counts": {"live": 1, "busy": 1},
            "restarts": ["x"],
        },
        "restore_checks": ["manifest_sha256", "source_checkpoint_id"],
        "allowed_roots": None,
        "checkpoint_verify": "wait",
    }

    await bounded(plane.retire(retire_req(["gone-a1"])))
    assert plane.status().retired_rollouts == 1

    request = req("c1", SHORT, clock=clock)
    await bounded(plane.prepare(request))
    data = plane.status().model_dump(mode="json")
    assert data["phase"] == "preparing"
    assert data["checkpoint_id"] == "c1"
    assert data["lease_expires_at"] == request.deadline_ts + 600.0
    await plane.close()


# --- allowed roots (C2)


@pytest.fixture
def roots(tmp_path: Path) -> list[str]:
    (tmp_path / "allowed").mkdir()
    return [str(tmp_path / "allowed"), "s3://bucket/run"]


def refused_dirs(tmp_path: Path) -> list[str]:
    allowed = tmp_path / "allowed"
    return [
        str(tmp_path / "outside"),
        f"{allowed}/../outside",
        f"{allowed}/ck/../../outside",
        str(tmp_path / "allowed-evil"),
        f"file://{tmp_path / 'outside'}",
        f"file://{allowed}/../outside",
        "relative/dir",
        "memory://anything",
        "s3://bucket/running",
        "s3://bucket/run/../other",
        "s3://bucket/run/ck/../../other",
        "s3://bucket",
        "s3://other/run",
        "gs://bucket/run/ck",
    ]


async def test_commit_outside_the_allowed_roots_is_refused_naming_the_setting(fake, tmp_path, roots):
    plane = ControlPlane(fake, allowed_roots=roots)
    fake.start("a")
    await prepared(plane)
    for directory in refused_dirs(tmp_path):
        with pytest.raises(CheckpointDirNotAllowed, match="allowed_roots") as caught:
            await bounded(plane.commit(commit_req("c1", directory, ["a"])))
        assert caught.value.status == 403
    assert fake.count("export") == 0
    assert published(tmp_path) == []

    reply = await bounded(plane.commit(commit_req("c1", tmp_path / "allowed" / "ck", ["a"])))
    assert reply.episode_ids == ["a"]
    assert read_back(tmp_path / "allowed" / "ck", fake)[0].record_count == 1
    await plane.close()


async def test_restore_outside_the_allowed_roots_is_refused_before_anything_changes(fake, tmp_path, roots):
    seed_checkpoint(tmp_path / "outside", "c0", [{"episode_id": "a", "state": {}}], fake=fake)
    plane = ControlPlane(fake, allowed_roots=roots)
    for directory in refused_dirs(tmp_path):
        with pytest.raises(CheckpointDirNotAllowed, match="allowed_roots"):
            await bounded(plane.restore(restore_req("c0", directory, ["a"])))
    assert plane.phase is Phase.IDLE
    assert len(plane.marks) == 0
    assert fake.count("close") == 0
    assert fake.count("install") == 0
    await plane.close()


@pytest.mark.parametrize(
    "directory",
    ["s3://bucket/run", "s3://bucket/run/ck-7", "s3://bucket/run/a/b", "s3://bucket/run/"],
)
def test_checkpoint_dirs_under_an_allowed_url_prefix_pass(directory, tmp_path):
    check_allowed(directory, [str(tmp_path), "s3://bucket/run"])


@pytest.mark.parametrize("directory", ["ck", "./ck", "a/../ck", "file://{root}/ck", "{root}/./ck/"])
def test_local_checkpoint_dirs_under_an_allowed_root_pass(directory, tmp_path):
    root = tmp_path / "allowed"
    if not directory.startswith(("file://", "{root}")):
        directory = str(root / directory)
    check_allowed(directory.format(root=root), [str(root)])


@pytest.fixture
def linked(tmp_path: Path) -> dict[str, Path]:
    """``allowed/`` (the root), ``outside/``, ``allowed/escape`` → ``outside``, ``alias`` → ``allowed``."""
    (tmp_path / "allowed").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "allowed" / "escape").symlink_to(tmp_path / "outside", target_is_directory=True)
    (tmp_path / "alias").symlink_to(tmp_path / "allowed", target_is_directory=True)
    return {"allowed": tmp_path / "allowed", "outside": tmp_path / "outside", "alias": tmp_path / "alias"}


async def test_a_symlink_inside_an_allowed_root_pointing_outside_is_refused(fake, tmp_path, linked):
    plane = ControlPlane(fake, allowed_roots=[str(linked["allowed"])])
    fake.start("a")
    await prepared(plane)
    for directory in (
        linked["allowed"] / "escape" / "ck",
        linked["allowed"] / "escape",
        f"file://{linked['allowed'] / 'escape' / 'ck'}",
    ):
        with pytest.raises(CheckpointDirNotAllowed, match="allowed_roots") as caught:
            await bounded(plane.commit(commit_req("c1", directory, ["a"])))
        assert caught.value.status == 403
    assert fake.count("export") == 0
    assert published(linked["outside"]) == []

    reply = await bounded(plane.commit(commit_req("c1", linked["allowed"] / "sub" / "ck", ["a"])))
    assert reply.episode_ids == ["a"]
    assert read_back(linked["allowed"] / "sub" / "ck", fake)[0].record_count == 1
    assert published(linked["outside"]) == []
    await plane.close()


async def test_a_root_given_through_a_symlink_allows_its_real_directory_and_the_store_opens_the_real_path(
    fake, tmp_path, linked
):
    plane = ControlPlane(fake, allowed_roots=[str(linked["alias"])])
    fake.start("a")
    await prepared(plane)
    reply = await bounded(plane.commit(commit_req("c1", linked["alias"] / "ck", ["a"])))
    # the directory the check resolved is the one written, and the reply names it
    assert reply.checkpoint_dir == str(linked["allowed"].resolve() / "ck")
    assert read_back(linked["allowed"] / "ck", fake)[0].record_count == 1
    await plane.close()

    check_allowed(str(linked["allowed"] / "ck"), [str(linked["alias"])])  # the real path is under the root too
    with pytest.raises(CheckpointDirNotAllowed):
        check_allowed(str(linked["alias"] / "escape" / "ck"), [str(linked["alias"])])


async def test_a_restore_through_an_escaping_symlink_is_refused_before_anything_changes(fake, tmp_path, linked):
    seed_checkpoint(linked["outside"], "c0", [{"episode_id": "a", "state": {}}], fake=fake)
    plane = ControlPlane(fake, allowed_roots=[str(linked["allowed"])])
    with pytest.raises(CheckpointDirNotAllowed, match="allowed_roots"):
        await bounded(plane.restore(restore_req("c0", linked["allowed"] / "escape", ["a"])))
    assert plane.phase is Phase.IDLE
    assert len(plane.marks) == 0
    assert fake.count("install") == 0
    await plane.close()


# --- every store a commit or restore opens is closed


class CountingStores:
    """Wraps ``gymckpt.control.plane.open_allowed_store``: every store the plane opens, and each close() call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened: list[CheckpointStore] = []
        self.closes: list[CheckpointStore] = []
        real = plane_module.open_allowed_store

        def counting_open(url: str, allowed_roots: list[str] | None, **options: Any) -> CheckpointStore:
            store = real(url, allowed_roots, **options)
            close = store.close

            def counted_close() -> None:
                self.closes.append(store)
                close()

            store.close = counted_close  # type: ignore[method-assign]
            self.opened.append(store)
            return store

        monkeypatch.setattr(plane_module, "open_allowed_store", counting_open)

    def each_closed_once(self) -> bool:
        return len(self.closes) == len(self.opened) and all(
            sum(closed is store for closed in self.closes) == 1 for store in self.opened
        )


async def test_every_commit_closes_the_store_it_opened_also_after_a_failed_store(fake, tmp_path, monkeypatch):
    stores = CountingStores(monkeypatch)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "gym").write_text("a file where the participant directory must go")
    plane = ControlPlane(fake)
    fake.start("a", {"step": 1})
    await prepared(plane)

    with pytest.raises(UnusableDirectory):
        await bounded(plane.commit(commit_req("c1", checkpoint, ["a"])))
    assert len(stores.opened) == 1
    assert stores.each_closed_once()

    (checkpoint / "gym").unlink()
    reply = await bounded(plane.commit(commit_req("c1", checkpoint, ["a"])))  # the retry opens a store of its own
    assert reply.episode_ids == ["a"]
    assert len(stores.opened) == 2
    assert stores.opened[0] is not stores.opened[1]
    assert stores.each_closed_once()

    await bounded(plane.commit(commit_req("c1", checkpoint, ["a"])))  # a finished commit's result: no store
    assert len(stores.opened) == 2
    await bounded(plane.resume(req("c1")))

    await prepared(plane, "c2")
    await bounded(plane.commit(commit_req("c2", tmp_path / "ckpt2", ["a"])))
    assert len(stores.opened) == 3
    assert stores.each_closed_once()
    await plane.close()


async def test_a_commit_whose_export_fails_closes_its_store(fake, ckpt_dir, monkeypatch):
    stores = CountingStores(monkeypatch)
    plane = ControlPlane(fake)
    fake.start("a")
    fake.fail_export = RuntimeError("export broke")
    await prepared(plane)
    with pytest.raises(ExportFailed):
        await bounded(plane.commit(commit_req("c1", ckpt_dir, ["a"])))
    assert len(stores.opened) == 1
    assert stores.each_closed_once()
    await plane.close()


async def test_every_restore_closes_the_store_it_opened_whether_it_succeeds_or_fails(fake, tmp_path, monkeypatch):
    stores = CountingStores(monkeypatch)
    (tmp_path / "empty").mkdir()
    seed_checkpoint(tmp_path / "source", "c0", [{"episode_id": "a", "state": {}}], fake=fake)
    plane = ControlPlane(fake)

    with pytest.raises(InvalidCheckpointState):  # nothing to read there
        await bounded(plane.restore(restore_req("c0", tmp_path / "empty", ["a"])))
    assert len(stores.opened) == 1
    assert stores.each_closed_once()

    fake.fail_install = RuntimeError("install broke")
    with pytest.raises(InvalidCheckpointState):
        await bounded(plane.restore(restore_req("c0", tmp_path / "source", ["a"])))
    assert len(stores.opened) == 2
    assert stores.each_closed_once()

    fake.fail_install = None
    reply = await bounded(plane.restore(restore_req("c0", tmp_path / "source", ["a"])))
    assert reply.restored == ["a-a1"]
    assert len(stores.opened) == 3
    assert stores.each_closed_once()
    await plane.close()


# --- the lease never shrinks, and the watcher sees every lease change at once


async def test_an_earlier_deadline_never_shortens_the_lease_and_a_lease_change_wakes_the_watcher(fake):
    clock = FakeClock()
    plane = ControlPlane(fake, clock=clock, lease_grace_seconds=600.0)
    fake.start("a")
    first = req("c1", 10.0, clock=clock)
    await bounded(plane.prepare(first))
    assert plane.phase is Phase.PREPARED
    lease = first.deadline_ts + 600.0
    assert plane.lease_expires_at == lease

    # a renew (or a retried prepare) with an earlier deadline keeps the lease
    earlier = ControlRequest(checkpoint_id="c1", deadline_ts=first.deadline_ts - 5.0)
    assert (await bounded(plane.renew(earlier))).lease_expires_at == lease
    await bounded(plane.prepare(earlier))
    assert plane.lease_expires_at == lease
    await drain()  # the watcher is asleep: its lease is 610 s away, so it waits LEASE_RETRY_SECONDS (30 s)
    assert not fake.admission_open

    # the plane's clock passes the lease; a renew wakes the watcher, which resumes by itself
    # long before its 30 s sleep would have ended
    clock.set(lease + 1.0)
    assert (await bounded(plane.renew(earlier))).lease_expires_at == lease
    await asyncio.wait_for(fake.opened.wait(), 5.0)
    await drain()
    assert plane.phase is Phase.IDLE
    assert plane.lease_expires_at is None
    with pytest.raises(StaleCheckpoint):
        await bounded(plane.prepare(req("c1", clock=clock)))
    await plane.close()


async def test_a_longer_lease_keeps_the_watcher_waiting(fake):
    clock = FakeClock()
    plane = ControlPlane(fake, clock=clock, lease_grace_seconds=600.0)
    fake.start("a")
    first = req("c1", 10.0, clock=clock)
    await bounded(plane.prepare(first))
    await drain()
    await bounded(plane.renew(ControlRequest(checkpoint_id="c1", deadline_ts=first.deadline_ts + 60.0)))
    await drain()  # woken, the watcher recomputes and waits again
    assert plane.phase is Phase.PREPARED
    assert not fake.admission_open
    assert plane._lease_task is not None and not plane._lease_task.done()
    await plane.close()


@pytest.mark.parametrize("instance", ["env-0\n", "env 0", "", "a/b", "x" * 129])
def test_a_participant_name_the_store_would_refuse_is_refused_at_startup(instance: str) -> None:
    """Names follow one rule at every entry point: a bad instance fails the server's start, not its first commit."""
    with pytest.raises(ValueError, match="instance"):
        ControlPlane(FakeParticipant(instance=instance))
