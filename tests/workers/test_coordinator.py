"""One participant across several workers: a real ControlPlane over a CoordinatedParticipant, linked workers.

Every control call goes to a worker's own control routes (a RemotePlane) and is forwarded
over a real Unix socket to the coordinator's plane.
"""

from __future__ import annotations

import asyncio
import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.control.plane import ControlPlane
from gymckpt.errors import CheckpointParked, RetireIncomplete, StaleAttempt
from gymckpt.store import open_store
from gymckpt.store.codec import episode_id_of_line
from gymckpt.store.encoded import each_line, encoded
from gymckpt.testing.participant import FakeParticipant
from gymckpt.testing.time import bounded, until
from gymckpt.workers import messages

from ..support import error_code
from .cluster import INSTANCE, KIND, call, client_of, cluster, control_app, request

if TYPE_CHECKING:
    import httpx

    from .cluster import Cluster


def _normalized(response: httpx.Response) -> tuple[int, Any]:
    """A reply without what differs by design between one process and several workers."""
    body = response.json()
    if isinstance(body, dict):
        body.pop("lease_expires_at", None)
        body.pop("workers", None)
        body.pop("expected_workers", None)
        for extra in ("worker_pids", "restored_pending", "session_aliases", "session_placements"):
            body.pop(extra, None)
        report = body.get("report")
        if isinstance(report, dict):
            report.get("counts", {}).pop("workers", None)
        if "error" in body:
            body = {"error": body["error"]["code"]}
    return response.status_code, body


async def _script(calls: list[Any]) -> list[tuple[int, Any]]:
    """The same control calls, each on the next client of ``calls`` (one client, or one per worker)."""
    steps = [
        ("prepare", request("c1")),
        ("status", None),
        ("prepare", request("c2")),  # another id while c1 is open
        ("renew", request("c1", seconds=30)),
        ("retire", request("c1", episode_ids=["r9"])),  # refused while a checkpoint is open
        ("resume", request("c1")),
        ("resume", request("c1")),  # a repeat
        ("prepare", request("c1")),  # resumed already
        ("retire", request("c3", episode_ids=["r9"])),
        ("forget", request("c3", rollout_ids=["r9"])),
    ]
    replies = []
    for number, (route, body) in enumerate(steps):
        replies.append(_normalized(await call(calls[number % len(calls)], route, body)))
    return replies


async def test_control_calls_on_any_worker_give_the_replies_of_a_single_process_server(tmp_path: Path) -> None:
    single = FakeParticipant(KIND, INSTANCE)
    single.start("r1")
    single.start("r2")
    plane = ControlPlane(single)
    async with client_of(control_app(plane)) as alone:
        expected = await _script([alone])
    await plane.close()
    async with cluster(tmp_path, 2) as running:
        one, two = running.workers
        one.fake.start("r1")
        two.fake.start("r2")
        replies = await _script([one.client, two.client])
        status = (await one.call("status")).json()
    assert replies == expected
    assert [code for code, _ in replies] == [200, 200, 409, 200, 409, 200, 200, 409, 200, 200]
    assert replies[1][1]["report"] == {
        "ready": True,
        "blockers": [],
        "blocker_count": 0,
        "counts": {"live": 2, "busy": 0},
        "restarts": [],
    }
    # while open, a status asks every worker: the counts are theirs summed (one live episode each)
    assert (status["workers"], status["expected_workers"]) == (2, 2)
    assert status["report"]["counts"] == {"live": 2, "busy": 0, "workers": 2}
    # while admission is open no worker reports: only a worker that is not connected is missing
    assert status["report"]["blockers"] == []
    assert status["report"]["ready"] is True


async def test_a_control_call_is_answered_by_the_coordinator_whichever_worker_takes_it(tmp_path: Path) -> None:
    async with cluster(tmp_path, 3) as running:
        one, two, three = running.workers
        assert [worker.index for worker in running.workers] == [1, 2, 3]
        assert (await one.call("prepare", request("c1"))).json()["phase"] == "prepared"
        statuses = [(await worker.call("status")).json() for worker in running.workers]
        assert [status["phase"] for status in statuses] == ["prepared"] * 3
        assert {status["checkpoint_id"] for status in statuses} == {"c1"}
        assert [(status["workers"], status["expected_workers"]) for status in statuses] == [(3, 3)] * 3
        conflict = await three.call("prepare", request("c2"))
        assert (conflict.status_code, error_code(conflict)) == (409, "checkpoint_conflict")
        resumed = await two.call("resume", request("c1"))
        assert resumed.json() == {"phase": "idle", "idempotent": False, "checkpoint_id": "c1"}
        unauthorized = await one.client.get("/ng-control/v1/checkpoint/status")
        assert (unauthorized.status_code, error_code(unauthorized)) == (401, "unauthorized")


async def test_prepare_closes_every_worker_and_is_ready_only_once_every_worker_reported_ready(tmp_path: Path) -> None:
    async with cluster(tmp_path, 2) as running:
        one, two = running.workers
        one.fake.start("r1")
        two.fake.start("r2", busy=True)
        preparing = asyncio.ensure_future(one.call("prepare", request("c1")))
        await until(lambda: running.reported(), message="the workers never reported")
        assert [worker.fake.admission_open for worker in running.workers] == [False, False]
        assert [worker.link.generation for worker in running.workers] == [1, 1]
        assert running.coordinator.generation == 1
        assert not running.coordinator.ready()
        assert running.coordinator.blockers(100) == ["r2"]
        assert not preparing.done()
        two.fake.finish_step("r2")  # notifies: worker 2 pushes a ready report
        reply = (await bounded(preparing)).json()
        assert reply["phase"] == "prepared"
        assert reply["report"] == {
            "ready": True,
            "blockers": [],
            "blocker_count": 0,
            "counts": {"live": 2, "busy": 0, "workers": 2},
            "restarts": [],
        }


async def test_blockers_are_a_sorted_union_counts_are_summed_and_restarts_are_merged(tmp_path: Path) -> None:
    async with cluster(tmp_path, 2) as running:
        one, two = running.workers
        one.fake.start("b", busy=True)
        two.fake.start("a", busy=True)
        two.fake.start("c", busy=True)
        one.fake.restart_keys.add("z")
        two.fake.restart_keys.update({"y", "z"})
        reply = (await one.call("prepare", request("c1", seconds=0.05))).json()
        assert reply == {
            "phase": "preparing",
            "report": {
                "ready": False,
                "blockers": ["a", "b", "c"],
                "blocker_count": 3,
                "counts": {"live": 3, "busy": 3, "workers": 2},
                "restarts": ["y", "z"],
            },
        }
        one.fake.finish_step("b")
        two.fake.finish_step("a")
        two.fake.finish_step("c")
        assert (await two.call("prepare", request("c1"))).json()["phase"] == "prepared"
        refused = await one.call("commit", request("c1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=["y"]))
        assert (refused.status_code, error_code(refused)) == (409, "restart_in_scope")


async def test_fewer_workers_than_expected_block_prepare_and_commit_until_the_missing_one_joins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(messages, "REPORT_POLL_SECONDS", 3600.0)
    async with cluster(tmp_path, 2, expected=3) as running:
        one, _two = running.workers
        reply = (await one.call("prepare", request("c1", seconds=0.05))).json()
        assert reply["phase"] == "preparing"
        assert reply["report"]["ready"] is False
        assert reply["report"]["blockers"] == ["environment-workers-unreported:1"]
        refused = await one.call("commit", request("c1", checkpoint_dir=str(tmp_path / "ck")))
        assert (refused.status_code, error_code(refused)) == (409, "invalid_phase")
        assert not (tmp_path / "ck").exists()
        third = await running.add_worker()
        await until(running.coordinator.ready, message="the third worker never reported")
        assert third.fake.admission_open is False
        assert (await third.call("prepare", request("c1"))).json()["phase"] == "prepared"


async def test_a_worker_that_joins_while_a_checkpoint_is_open_closes_at_once_and_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(messages, "REPORT_POLL_SECONDS", 3600.0)  # the report comes at once, not from the poll
    async with cluster(tmp_path, 1, expected=2) as running:
        (one,) = running.workers
        await one.call("prepare", request("c1", seconds=0.05))
        late = FakeParticipant(KIND, INSTANCE)
        late.start("late", busy=True)
        joined = await running.add_worker(late)
        assert late.names()[:2] == ["close", "close_done"]
        assert late.admission_open is False
        assert joined.link.generation == running.coordinator.generation == 1
        await until(lambda: running.coordinator.workers[joined.index].report is not None, message="no report")
        assert running.coordinator.blockers(100) == ["late"]
        late.finish_step("late")
        assert (await one.call("prepare", request("c1"))).json()["phase"] == "prepared"


async def test_a_worker_lost_while_closed_blocks_prepare_and_commit_until_resume(tmp_path: Path) -> None:
    async with cluster(tmp_path, 2) as running:
        one, two = running.workers
        assert (await one.call("prepare", request("c1"))).json()["phase"] == "prepared"
        await running.remove(two)
        assert running.coordinator.lost_worker
        status = (await one.call("status")).json()
        assert status["report"]["ready"] is False
        assert status["report"]["blockers"] == ["environment-workers-unreported:1", "environment-worker-lost"]
        refused = await one.call("commit", request("c1", checkpoint_dir=str(tmp_path / "ck")))
        assert (refused.status_code, error_code(refused)) == (409, "export_failed")
        replacement = await running.add_worker()
        assert replacement.index == 3
        await until(lambda: running.coordinator.workers[3].report is not None, message="no report")
        assert running.coordinator.blockers(100) == ["environment-worker-lost"]  # still lost until resume
        assert (await one.call("resume", request("c1"))).status_code == 200
        assert not running.coordinator.lost_worker
        assert (await replacement.call("prepare", request("c2"))).json()["phase"] == "prepared"


async def test_a_worker_lost_while_open_only_drops_out_of_the_count(tmp_path: Path) -> None:
    async with cluster(tmp_path, 2) as running:
        one, two = running.workers
        await running.remove(two)
        assert not running.coordinator.lost_worker
        reply = (await one.call("prepare", request("c1", seconds=0.05))).json()
        assert reply["report"]["blockers"] == ["environment-workers-unreported:1"]
        await running.add_worker()
        await until(running.coordinator.ready, message="the rejoined worker never reported")


async def test_reports_of_an_old_generation_a_lower_seq_or_while_open_are_ignored(tmp_path: Path) -> None:
    async with cluster(tmp_path, 2) as running:
        one, _two = running.workers
        assert (await one.call("prepare", request("c1"))).json()["phase"] == "prepared"
        entry = running.coordinator.workers[one.index]
        channel = one.link.channel
        assert channel is not None
        blocked = {"ready": False, "blockers": ["stale"], "blocker_count": 1, "counts": {}, "restarts": []}
        generation = running.coordinator.generation

        async def report(generation: int, seq: int) -> bool:
            body = {"generation": generation, "seq": seq, "report": blocked}
            reply = await bounded(channel.request(messages.Message.REPORT, body, timeout=10))
            return bool(reply["kept"])

        assert not await report(generation - 1, entry.seq + 10)
        assert not await report(generation, entry.seq)
        assert running.coordinator.ready()
        assert await report(generation, entry.seq + 1)  # the newest of this generation is taken
        assert running.coordinator.blockers(100) == ["stale"]
        assert not await report(generation, entry.seq - 1)
        assert running.coordinator.blockers(100) == ["stale"]
        assert (await one.call("resume", request("c1"))).status_code == 200
        assert not await report(generation, entry.seq + 5)
        assert running.coordinator.workers[one.index].report is None  # cleared by open


async def test_readiness_that_changes_without_a_notification_reaches_the_coordinator_by_the_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(messages, "REPORT_POLL_SECONDS", 0.01)
    async with cluster(tmp_path, 2) as running:
        one, two = running.workers
        two.fake.start("session", busy=True)
        preparing = asyncio.ensure_future(one.call("prepare", request("c1")))
        await until(lambda: running.coordinator.blockers(100) == ["session"], message="no report of the session")
        two.fake.busy.discard("session")  # the session ended, and nobody was told
        assert (await bounded(preparing)).json()["phase"] == "prepared"


def _record_state(index: int) -> dict[str, Any]:
    """States the exact encoder must carry (NaN, infinities, integers beyond 64 bits) and one the fast one does."""
    if index == 1:
        return {"step": 3, "values": [math.nan, -math.inf, math.inf], "big": 2**70}
    return {"step": 4, "text": "café ✓"}


async def _prepared_with_records(running: Cluster) -> dict[str, bytes]:
    expected = {}
    for worker in running.workers:
        key = f"w{worker.index}"
        worker.fake.start(key, _record_state(worker.index))
        expected[key] = encoded({"episode_id": key, "state": worker.fake.state[key]}).line
    assert (await running.workers[0].call("prepare", request("c1"))).json()["phase"] == "prepared"
    return expected


def _lines_of(checkpoint: Path) -> tuple[Any, dict[str, bytes]]:
    """The manifest and the records file's lines by episode id (after the store verified the file)."""
    store = open_store(str(checkpoint))
    manifest = store.read_manifest("", kind=KIND, instance=INSTANCE)
    assert len(list(store.read_participant("", kind=KIND, instance=INSTANCE))) == manifest.record_count
    data = (checkpoint / manifest.records_path).read_bytes()
    return manifest, {episode_id_of_line(line): line for line in data.splitlines(keepends=True)}


async def test_export_gathers_every_workers_lines_encoded_once_into_one_records_file(tmp_path: Path) -> None:
    """The coordinator's export as the plane's commit stores it: one file, each worker's line byte for byte."""
    async with cluster(tmp_path, 2) as running:
        expected = await _prepared_with_records(running)
        records = await bounded(running.coordinator.export(None))
        with pytest.raises(RuntimeError, match="thread of their own"):
            list(records)  # on the event loop the workers could never send them
        read = await bounded(asyncio.to_thread(lambda: dict(each_line(records))))
        assert read == expected
        store = open_store(str(tmp_path / "ck"))
        write = functools.partial(
            store.write_participant,
            "",
            kind=KIND,
            instance=INSTANCE,
            checkpoint_id="c1",
            records=records,
            extra=running.coordinator.manifest_extra(),
        )
        await bounded(asyncio.to_thread(write))  # a second read of the same lines, as a retried write does
    manifest, lines = _lines_of(tmp_path / "ck")
    assert lines == expected
    assert manifest.record_count == 2
    assert manifest.extra == {"session_owners": [], "placed_sessions": [], "owner_aliases": {}}
    back = list(open_store(str(tmp_path / "ck")).read_participant("", kind=KIND, instance=INSTANCE))
    assert sorted(record["episode_id"] for record in back) == ["w1", "w2"]
    assert next(record for record in back if record["episode_id"] == "w1")["state"]["big"] == 2**70
    assert [path.name for path in (tmp_path / "ck" / manifest.directory).iterdir() if path.suffix == ".jsonl"] == [
        manifest.records_file
    ]


async def test_a_commit_on_a_worker_writes_every_workers_records_into_one_records_file_and_manifest(
    tmp_path: Path,
) -> None:
    async with cluster(tmp_path, 2) as running:
        expected = await _prepared_with_records(running)
        reply = await running.workers[1].call("commit", request("c1", checkpoint_dir=str(tmp_path / "ck")))
        assert reply.status_code == 200, reply.json()
        assert reply.json()["episode_ids"] == ["w1", "w2"]
    manifest, lines = _lines_of(tmp_path / "ck")
    assert lines == expected
    assert manifest.record_count == 2


async def test_a_worker_no_longer_ready_refuses_its_export_and_the_commit_fails_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(messages, "REPORT_POLL_SECONDS", 3600.0)  # the coordinator cannot learn it before the export
    async with cluster(tmp_path, 2) as running:
        one, two = running.workers
        two.fake.start("r2")
        assert (await one.call("prepare", request("c1"))).json()["phase"] == "prepared"
        two.fake.busy.add("r2")  # a step started again, and nobody was told
        refused = await one.call("commit", request("c1", checkpoint_dir=str(tmp_path / "ck")))
        assert (refused.status_code, error_code(refused)) == (409, "export_failed")
        detail = refused.json()["error"]["detail"]
        assert "environment worker 2 did not complete export" in detail
        assert "no longer ready to commit" in detail
        assert two.fake.count("export") == 0
        again = await two.call("commit", request("c1", checkpoint_dir=str(tmp_path / "ck")))
        assert error_code(again) == "export_failed"
        assert not (tmp_path / "ck").exists()


async def test_retire_marks_every_worker_first_and_a_worker_that_joins_later_refuses_the_attempt_too(
    tmp_path: Path,
) -> None:
    async with cluster(tmp_path, 2) as running:
        one, two = running.workers
        one.fake.start("r1")
        reply = await two.call("retire", request("c1", episode_ids=["r1"]))
        assert reply.json() == {"retired_count": 1, "retired": ["r1"]}
        assert [worker.fake.retired for worker in running.workers] == [[["r1"]], [["r1"]]]
        assert "r1" not in one.fake.state
        late = await running.add_worker()
        for worker in running.workers:
            with pytest.raises(StaleAttempt):
                worker.fake.check_attempt("r1")
            worker.fake.check_attempt("r1-a1")  # the next attempt may run
        assert late.fake.retired == []
        assert (await late.call("status")).json()["retired_rollouts"] == 1


class ForgetRefusing(FakeParticipant):
    """A worker's participant that cannot forget yet (its retired sessions are not freed)."""

    refusing = True

    def check_forget(self, rollout_ids: list[str]) -> None:
        if self.refusing:
            raise RetireIncomplete(f"sessions of {rollout_ids} are still being freed")


async def test_a_forget_one_worker_refuses_leaves_every_mark_in_place(tmp_path: Path) -> None:
    refusing = ForgetRefusing(KIND, INSTANCE)
    async with cluster(tmp_path, 2, fakes=[FakeParticipant(KIND, INSTANCE), refusing]) as running:
        one, _two = running.workers
        assert (await one.call("retire", request("c1", episode_ids=["r1-a2"]))).status_code == 200
        refused = await one.call("forget", request("c1", rollout_ids=["r1"]))
        assert (refused.status_code, error_code(refused)) == (409, "retire_incomplete")
        assert (await one.call("status")).json()["retired_rollouts"] == 1
        assert running.coordinator.fence.snapshot() == {"r1": 2}
        assert [worker.fake.fence.snapshot() for worker in running.workers] == [{"r1": 2}, {"r1": 2}]
        assert [worker.fake.forgotten for worker in running.workers] == [[], []]
        refusing.refusing = False
        forgot = await one.call("forget", request("c1", rollout_ids=["r1"]))
        assert forgot.json() == {"forgotten_count": 1, "forgotten": ["r1"]}
        assert running.coordinator.fence.snapshot() == {}
        assert [worker.fake.fence.snapshot() for worker in running.workers] == [{}, {}]
        assert [worker.fake.forgotten for worker in running.workers] == [[["r1"]], [["r1"]]]


async def test_resume_reopens_every_worker(tmp_path: Path) -> None:
    async with cluster(tmp_path, 3) as running:
        assert (await running.workers[0].call("prepare", request("c1"))).json()["phase"] == "prepared"
        assert [worker.fake.admission_open for worker in running.workers] == [False] * 3
        assert (await running.workers[2].call("resume", request("c1"))).json()["idempotent"] is False
        assert [worker.fake.admission_open for worker in running.workers] == [True] * 3
        assert [worker.link.accepting for worker in running.workers] == [True] * 3
        assert [worker.fake.count("open") for worker in running.workers] == [1, 1, 1]


def _write_checkpoint(
    directory: Path, records: list[dict[str, Any]], *, kind: str = KIND, extra: dict[str, Any] | None = None
) -> None:
    open_store(str(directory)).write_participant(
        "", kind=kind, instance=INSTANCE, checkpoint_id="c0", records=records, extra=extra or {}
    )


ROUTING = ["1" * 32, "2" * 32, "3" * 32]


async def test_restore_places_sessions_one_old_owner_per_worker_and_sends_every_worker_the_tables(
    tmp_path: Path,
) -> None:
    old_owner = "b" * 32
    records = [
        {"episode_id": "r1", "state": {"step": 1}},  # a one-worker server's session: no owner
        {"episode_id": "r2", "state": {"step": 2}, "owner": old_owner},
        {"episode_id": "r3", "state": {"step": 3}, "owner": old_owner},
    ]
    _write_checkpoint(tmp_path / "ck", records, kind="resources", extra={"session_owners": [old_owner, "c" * 32]})
    async with cluster(tmp_path, 3, routing_ids=ROUTING, kind="resources") as running:
        first, second, third = running.workers
        body = request("restore-1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=["r1", "r2", "r3"])
        reply = await third.call("restore", body)
        assert reply.json()["restored"] == ["r1-a1", "r2-a1", "r3-a1"]
        # the old owner's two sessions together on the first worker, the owner-less one on the next, and the
        # owner without records on the last
        assert [record["episode_id"] for record in first.fake.installed] == ["r2-a1", "r3-a1"]
        assert first.fake.installed[0]["owner"] == old_owner
        assert second.fake.installed == [{"episode_id": "r1-a1", "state": {"step": 1}, "owner": ROUTING[1]}]
        assert third.fake.installed == []
        aliases = {old_owner: ROUTING[0], "c" * 32: ROUTING[2]}
        placements = {"r1-a1": ROUTING[1], "r2-a1": ROUTING[0], "r3-a1": ROUTING[0]}
        for worker in running.workers:
            assert worker.routes[-1] == (aliases, placements)
            assert worker.fake.installed_scope == ["r1-a1", "r2-a1", "r3-a1"]
            assert worker.fake.installed_manifest.checkpoint_id == "c0"
            assert worker.fake.fence.snapshot() == {"r1": 0, "r2": 0, "r3": 0}
        late = await running.add_worker(routing_id="4" * 32)
        assert late.routes == [(aliases, placements)]  # a worker that joins later gets both tables
        status = (await first.call("status")).json()
        assert status["session_aliases"] == aliases
        assert status["session_placements"] == 3
        assert (await first.call("resume", request("restore-1"))).status_code == 200
        assert [worker.fake.admission_open for worker in running.workers] == [True] * 4


async def test_a_restore_follows_the_owner_aliases_of_the_manifest(tmp_path: Path) -> None:
    """A cookie stamped two crashes ago names an owner whose sessions moved: it follows them again."""
    ancient, current = "a" * 32, "b" * 32
    records = [{"episode_id": "r1", "state": {}, "owner": current}]
    extra = {"session_owners": [ancient, current], "owner_aliases": {ancient: current, "bad": current}}
    _write_checkpoint(tmp_path / "ck", records, kind="resources", extra=extra)
    async with cluster(tmp_path, 2, routing_ids=ROUTING[:2], kind="resources") as running:
        body = request("restore-1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=["r1"])
        assert (await running.workers[0].call("restore", body)).status_code == 200
        aliases = running.coordinator.aliases
        assert aliases[ancient] == aliases[current]
        holder = next(worker for worker in running.workers if worker.fake.installed)
        assert aliases[current] == holder.link.routing_id
        assert "bad" not in aliases
        # the next commit's manifest: both old owners now follow the worker that holds their sessions
        assert running.coordinator.owner_aliases == {ancient: holder.link.routing_id, current: holder.link.routing_id}


async def _restored_environment(running: Cluster, tmp_path: Path, keys: list[str]) -> None:
    _write_checkpoint(tmp_path / "ck", [{"episode_id": key, "state": {"n": index}} for index, key in enumerate(keys)])
    body = request("restore-1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=keys)
    assert (await running.workers[0].call("restore", body)).status_code == 200


async def test_whole_episode_records_wait_in_the_coordinator_and_exactly_one_claim_wins(tmp_path: Path) -> None:
    async with cluster(tmp_path, 3) as running:
        await _restored_environment(running, tmp_path, ["r1", "r2"])
        assert [worker.fake.installed for worker in running.workers] == [[], [], []]
        assert sorted(running.coordinator.held) == ["r1-a1", "r2-a1"]
        assert all(worker.link.holding for worker in running.workers)
        assert (await running.workers[0].call("status")).json()["restored_pending"] == ["r1-a1", "r2-a1"]
        assert (await running.workers[1].call("resume", request("restore-1"))).status_code == 200
        claims = [worker.link.claim("r1-a1") for worker in running.workers for _ in range(4)]
        results = await bounded(asyncio.gather(*claims))
        won = [result for result in results if result is not None]
        assert won == [{"episode_id": "r1-a1", "state": {"n": 0}}]
        assert sorted(running.coordinator.held) == ["r2-a1"]
        assert await bounded(running.workers[2].fake.take_restored("r2-a1")) is True
        assert running.workers[2].fake.installed == [{"episode_id": "r2-a1", "state": {"n": 1}}]
        assert await bounded(running.workers[0].fake.take_restored("r2-a1")) is False
        assert (await running.workers[0].call("status")).json()["restored_pending"] == []


async def test_a_claim_while_a_checkpoint_is_open_is_checkpoint_parked(tmp_path: Path) -> None:
    async with cluster(tmp_path, 2) as running:
        await _restored_environment(running, tmp_path, ["r1"])
        assert (await running.workers[0].call("resume", request("restore-1"))).status_code == 200
        assert (await running.workers[0].call("prepare", request("c2"))).json()["phase"] == "prepared"
        with pytest.raises(CheckpointParked):
            await bounded(running.workers[1].link.claim("r1-a1"))
        assert sorted(running.coordinator.held) == ["r1-a1"]  # nothing was taken
        assert (await running.workers[0].call("resume", request("c2"))).status_code == 200
        assert await bounded(running.workers[1].link.claim("r1-a1")) == {"episode_id": "r1-a1", "state": {"n": 0}}


async def test_unclaimed_records_are_exported_again_while_in_scope_and_released_when_not(tmp_path: Path) -> None:
    async with cluster(tmp_path, 2) as running:
        await _restored_environment(running, tmp_path, ["r1", "r2"])
        assert (await running.workers[0].call("resume", request("restore-1"))).status_code == 200
        assert (await running.workers[0].call("prepare", request("c2"))).json()["phase"] == "prepared"
        body = request("c2", checkpoint_dir=str(tmp_path / "c2"), episode_ids=["r1-a1", "r2-a1"])
        committed = (await running.workers[1].call("commit", body)).json()
        assert committed["episode_ids"] == ["r1-a1", "r2-a1"]
        back = list(open_store(str(tmp_path / "c2")).read_participant("", kind=KIND, instance=INSTANCE))
        assert back == [{"episode_id": "r1-a1", "state": {"n": 0}}, {"episode_id": "r2-a1", "state": {"n": 1}}]
        assert (await running.workers[0].call("resume", request("c2"))).status_code == 200
        assert (await running.workers[0].call("prepare", request("c3"))).json()["phase"] == "prepared"
        body = request("c3", checkpoint_dir=str(tmp_path / "c3"), episode_ids=["r2-a1"])
        assert (await running.workers[0].call("commit", body)).json()["episode_ids"] == ["r2-a1"]
        assert sorted(running.coordinator.held) == ["r2-a1"]  # r1-a1 left the scope: released
        assert all(("delete_restored", ["r1-a1"]) in worker.fake.calls for worker in running.workers)


async def test_a_retire_drops_the_held_records_of_its_attempts(tmp_path: Path) -> None:
    async with cluster(tmp_path, 2) as running:
        await _restored_environment(running, tmp_path, ["r1", "r2"])
        assert (await running.workers[0].call("resume", request("restore-1"))).status_code == 200
        reply = await running.workers[1].call("retire", request("restore-1", episode_ids=["r1-a1"]))
        assert reply.status_code == 200, reply.text
        assert sorted(running.coordinator.held) == ["r2-a1"]
        assert await bounded(running.workers[0].link.claim("r1-a1")) is None


async def test_restore_refuses_when_any_worker_already_serves_work(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path / "ck", [{"episode_id": "r1", "state": {}}])
    async with cluster(tmp_path, 2) as running:
        one, two = running.workers
        two.fake.start("busy-1")
        reply = await one.call("restore", request("restore-1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=["r1"]))
        assert (reply.status_code, error_code(reply)) == (409, "checkpoint_error")
        assert "busy-1" in reply.json()["error"]["detail"]
        assert [worker.fake.count("install") for worker in running.workers] == [0, 0]


def test_the_workers_commit_reply_extras_are_merged_lists_joined() -> None:
    from gymckpt.workers.coordinator_fields import merged_reply_extra as _merged_reply_extra

    replies = {
        2: {"records": [], "reply_extra": {"staging_keys": ["k3", "k1"], "note": "second"}},
        1: {"records": [], "reply_extra": {"staging_keys": ["k2", "k1"], "note": "first"}},
        3: {"records": []},
    }
    assert _merged_reply_extra(replies) == {"staging_keys": ["k1", "k2", "k3"], "note": "first"}
    assert _merged_reply_extra({1: {"reply_extra": {"staging_keys": []}}}) == {"staging_keys": []}
    by_episode = {
        1: {"reply_extra": {"staging_keys_by_episode": {"a": ["k2"], "b": ["k1"]}}},
        2: {"reply_extra": {"staging_keys_by_episode": {"a": ["k1"], "c": ["k3"]}}},
    }
    assert _merged_reply_extra(by_episode) == {"staging_keys_by_episode": {"a": ["k1", "k2"], "b": ["k1"], "c": ["k3"]}}
