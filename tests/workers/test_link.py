"""A worker's link: connecting, coordinated reports, refusals it makes itself, and losing the coordinator."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import TYPE_CHECKING

import pytest

from gymckpt.control.plane import ControlPlane
from gymckpt.errors import ControlError, CoordinatorUnavailable, RetireIncomplete
from gymckpt.testing.participant import FakeParticipant
from gymckpt.testing.time import bounded, drain, until
from gymckpt.workers.coordinator import CoordinatedParticipant
from gymckpt.workers.link import WorkerLink, terminate_this_worker
from gymckpt.workers.messages import Message
from gymckpt.workers.remote_plane import RemotePlane
from gymckpt.workers.runtime import socket_path
from gymckpt.workers.worker_server import WorkerServer

from ..support import error_code
from .cluster import INSTANCE, KIND, call, client_of, cluster, control_app, request

if TYPE_CHECKING:
    from pathlib import Path


async def test_a_worker_without_its_coordinator_answers_every_control_call_with_503(tmp_path: Path) -> None:
    link = WorkerLink(FakeParticipant(KIND, INSTANCE), tmp_path / "none.sock", on_coordinator_lost=lambda: None)
    assert link.on_coordinator_lost is not terminate_this_worker
    async with client_of(control_app(RemotePlane(link))) as client:
        for route, body in (("status", None), ("prepare", request()), ("retire", request(episode_ids=["r1"]))):
            reply = await call(client, route, body)
            assert (reply.status_code, error_code(reply)) == (503, "checkpoint_coordinator_unavailable")


async def test_the_default_reaction_to_a_lost_coordinator_terminates_the_worker(tmp_path: Path) -> None:
    assert WorkerLink(FakeParticipant(), tmp_path / "x.sock").on_coordinator_lost is terminate_this_worker


async def test_connect_gives_up_after_its_timeout_when_the_socket_is_missing_or_refuses(tmp_path: Path) -> None:
    missing = WorkerLink(FakeParticipant(), tmp_path / "missing.sock", connect_timeout=0.2)
    with pytest.raises(CoordinatorUnavailable, match="no environment checkpoint coordinator"):
        await bounded(missing.connect())
    path = tmp_path / "refusing.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bound:  # bound, never listening: connections are refused
        bound.bind(os.fspath(path))
        refused = WorkerLink(FakeParticipant(), path, connect_timeout=0.2)
        with pytest.raises(CoordinatorUnavailable) as unavailable:
            await bounded(refused.connect())
    assert unavailable.value.status == 503
    assert refused.channel is None


async def test_connect_retries_until_the_coordinator_listens(tmp_path: Path) -> None:
    coordinator = CoordinatedParticipant(KIND, INSTANCE, expected_workers=1)
    plane = ControlPlane(coordinator)
    path = socket_path(tmp_path, "env")
    link = WorkerLink(FakeParticipant(), path, on_coordinator_lost=lambda: None)
    connecting = asyncio.ensure_future(link.connect())
    await drain()
    assert not connecting.done()  # nothing listens yet: it keeps trying
    server = WorkerServer(plane, path=path)
    await server.start()
    try:
        await bounded(connecting)
        assert list(coordinator.workers) == [1]
        assert (path.stat().st_mode & 0o777) == 0o600
    finally:
        await bounded(link.disconnect())
        await bounded(server.close())
        await plane.close()
    assert not path.exists()


async def test_a_worker_whose_coordinator_goes_away_calls_on_coordinator_lost_unless_it_left_itself(
    tmp_path: Path,
) -> None:
    async with cluster(tmp_path, 3) as running:
        one, two, three = running.workers
        await running.remove(three)
        await bounded(running.server.close())
        await until(lambda: one.lost == ["lost"] and two.lost == ["lost"], message="on_coordinator_lost never called")
        assert three.lost == []
        assert one.link.channel is None
        reply = await one.call("status")
        assert (reply.status_code, error_code(reply)) == (503, "checkpoint_coordinator_unavailable")
        await drain()
        assert one.lost == ["lost"]  # once


async def test_reports_are_coalesced_and_one_equal_to_the_last_sent_is_not_sent_again(tmp_path: Path) -> None:
    async with cluster(tmp_path, 2) as running:
        one, _two = running.workers
        assert (await one.call("prepare", request("c1"))).json()["phase"] == "prepared"
        entry = running.coordinator.workers[one.index]
        first = entry.seq
        for _ in range(20):
            one.fake.notify()  # nothing changed: nothing is sent
        await drain()
        assert entry.seq == first
        one.fake.busy.add("r1")
        for _ in range(20):
            one.fake.notify()
        await until(lambda: entry.seq > first, message="no report")
        await drain()
        assert entry.seq == first + 1
        assert running.coordinator.blockers(100) == ["r1"]


async def test_a_worker_refuses_check_forget_while_its_own_retire_of_the_rollout_still_runs(tmp_path: Path) -> None:
    async with cluster(tmp_path, 1) as running:
        (one,) = running.workers
        one.fake.start("r1")
        one.fake.retire_gate = asyncio.Event()
        channel = running.coordinator.workers[one.index].channel
        retiring = asyncio.ensure_future(channel.request(Message.RETIRE, {"episode_ids": ["r1"]}, timeout=10))
        await bounded(one.fake.started["retire"].wait())
        with pytest.raises(RetireIncomplete, match="r1"):
            await bounded(channel.request(Message.CHECK_FORGET, {"rollout_ids": ["r1"]}, timeout=10))
        assert await bounded(channel.request(Message.CHECK_FORGET, {"rollout_ids": ["r2"]}, timeout=10)) == {}
        one.fake.retire_gate.set()
        assert await bounded(retiring) == {}
        assert await bounded(channel.request(Message.CHECK_FORGET, {"rollout_ids": ["r1"]}, timeout=10)) == {}
        assert one.fake.retired == [["r1"]]


async def test_a_close_a_worker_fails_fails_the_prepare_and_every_worker_reopens(tmp_path: Path) -> None:
    async with cluster(tmp_path, 2) as running:
        one, two = running.workers
        two.fake.fail_close = ControlError("cannot close")
        refused = await one.call("prepare", request("c1"))
        assert (refused.status_code, error_code(refused)) == (409, "checkpoint_error")
        assert "environment worker 2 did not complete close: cannot close" in refused.json()["error"]["detail"]
        assert [worker.fake.count("open") for worker in running.workers] == [1, 1]
        assert [worker.link.accepting for worker in running.workers] == [True, True]
        assert (await one.call("status")).json()["phase"] == "idle"


async def test_a_failed_open_is_logged_and_the_resume_succeeds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with cluster(tmp_path, 2) as running:
        one, two = running.workers
        assert (await one.call("prepare", request("c1"))).json()["phase"] == "prepared"
        two.fake.fail_open = ControlError("cannot open")
        with caplog.at_level(logging.WARNING, logger="gymckpt.workers.coordinator"):
            reply = await one.call("resume", request("c1"))
        assert reply.status_code == 200
        assert one.fake.admission_open is True
        assert any("did not reopen" in record.getMessage() for record in caplog.records)


async def test_delete_restored_and_park_reach_every_worker(tmp_path: Path) -> None:
    async with cluster(tmp_path, 2) as running:
        one, two = running.workers
        await bounded(running.coordinator.delete_restored(["gone-a1"]))
        assert [worker.fake.deleted for worker in running.workers] == [[["gone-a1"]], [["gone-a1"]]]
        one.fake.start("p1")
        two.fake.start("p2")
        assert (await one.call("prepare", request("c1"))).json()["phase"] == "prepared"
        records = await bounded(running.coordinator.export(None))
        await bounded(running.coordinator.park_exported(records))
        assert [worker.fake.arguments("park") for worker in running.workers] == [[["p1"]], [["p2"]]]
        assert [worker.link._gc_pause for worker in running.workers] == [None, None]  # parked: the pause ended


async def test_a_worker_closed_for_a_lost_coordinator_reopens_when_it_joins_an_open_one(tmp_path: Path) -> None:
    async with cluster(tmp_path, 1) as running:
        (one,) = running.workers
        assert (await one.call("prepare", request("c1"))).json()["phase"] == "prepared"
        await bounded(running.server.close())
        await until(lambda: one.lost == ["lost"], message="on_coordinator_lost never called")
        assert one.fake.admission_open is False
        plane = ControlPlane(CoordinatedParticipant(KIND, INSTANCE, expected_workers=1))
        server = WorkerServer(plane, path=running.path)  # the main process restarted on the same socket
        await server.start()
        try:
            await bounded(one.link.connect())
            assert one.fake.admission_open is True
            assert one.link.accepting is True
            assert (await one.call("prepare", request("c2"))).json()["phase"] == "prepared"
        finally:
            await bounded(one.link.disconnect())
            await bounded(server.close())
            await plane.close()


async def test_a_worker_pauses_the_collector_while_closed_and_ends_the_pause_on_open_or_a_lost_coordinator(
    tmp_path: Path,
) -> None:
    async with cluster(tmp_path, 2) as running:
        one, two = running.workers
        assert (await one.call("prepare", request("c1"))).json()["phase"] == "prepared"
        assert all(worker.link._gc_pause is not None for worker in running.workers)
        assert (await one.call("resume", request("c1"))).status_code == 200
        assert [worker.link._gc_pause for worker in running.workers] == [None, None]
        assert (await one.call("prepare", request("c2"))).json()["phase"] == "prepared"
        pause = two.link._gc_pause
        assert pause is not None
        await bounded(running.server.close())  # the coordinator goes away while the workers are closed
        await until(lambda: two.lost == ["lost"], message="on_coordinator_lost never called")
        assert two.link._gc_pause is None and not pause.expired.is_set()  # released, not ended by its bound
