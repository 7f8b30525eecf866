"""The resources participant (P2) through real requests and the control routes."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.participants.resources import CheckpointedResources, ResourcesParticipant
from gymckpt.store import open_store

from ..support import error_code
from .resources_support import (
    AUTH,
    CONTROL,
    Control,
    bounded,
    build_gated_app,
    client,
    gated_server,
    rp,
    run,
    until,
)

if TYPE_CHECKING:
    from pathlib import Path


def records(directory: str) -> list[dict[str, Any]]:
    """The gated server's records in a checkpoint directory."""
    return list(open_store(directory).read_participant("", kind="resources", instance="gated-0"))


# --------------------------------------------------------------------------- declarations


@pytest.mark.parametrize(
    ("mode", "verify", "restart"),
    [
        ("restart_only", "wait", "1"),
        ("restart_only", "replay", "1"),
        ("stateless", "wait", None),
        ("stateless", "replay", None),
        ("exported", "wait", None),
        ("exported", "replay", None),
    ],
)
def test_seed_reply_headers_and_status(mode: str, verify: str, restart: str | None) -> None:
    async def main() -> None:
        app = build_gated_app(gated_server(mode, verify))  # type: ignore[arg-type]
        async with client(app) as http:
            reply = await http.post(rp("r", "/seed_session"), json={"task_input": {}})
            assert reply.status_code == 200
            assert reply.json() == {"session": "r"}
            assert reply.headers["x-ng-checkpoint-verify"] == verify
            assert reply.headers.get("x-ng-checkpoint-restart") == restart
            # a failed seed reply carries the headers too
            failed = await http.post(rp("r", "/seed_session"), content=b"{", headers={"content-type": "text/plain"})
            assert failed.headers["x-ng-checkpoint-verify"] == verify
            # other replies do not
            tool = await http.post(rp("r", "/tool"), json={})
            assert "x-ng-checkpoint-verify" not in tool.headers
            status = await Control(http).status()
            assert status["verify"] == verify
            assert status["mode"] == mode
            assert status["kind"] == "resources"
            assert status["instance"] == "gated-0"

    run(main())


def test_declarations_are_checked() -> None:
    class Bad(CheckpointedResources):
        checkpoint_mode = "exported"  # type: ignore[assignment]

    with pytest.raises(TypeError, match="export_session_states"):
        ResourcesParticipant(Bad())

    class Unknown(CheckpointedResources):
        checkpoint_verify = "sometimes"  # type: ignore[assignment]

    with pytest.raises(ValueError, match="checkpoint_verify"):
        ResourcesParticipant(Unknown())
    assert ResourcesParticipant(CheckpointedResources()).mode == "restart_only"


def test_requests_need_a_rollout() -> None:
    async def main() -> None:
        app = build_gated_app(gated_server())
        async with client(app) as http:
            for path in ("/seed_session", "/tool", "/verify", "/close_session"):
                reply = await http.post(path, json={})
                assert reply.status_code == 400
                assert error_code(reply) == "rollout_id_required"
            # the API docs and the control routes are not fenced
            assert (await http.get("/openapi.json")).status_code == 200
            assert (await http.get(f"{CONTROL}/status", headers=AUTH)).status_code == 200
            assert (await http.get(f"{CONTROL}/status")).status_code == 401
            # a malformed capture key is refused by the prefix
            bad = await http.post(rp(".r", "/tool"), json={})
            assert bad.status_code == 400

    run(main())


def test_sessions_are_keyed_by_the_rollout_attempt() -> None:
    async def main() -> None:
        server = gated_server()
        app = build_gated_app(server)
        async with client(app) as http:
            assert (await http.post(rp("r", "/seed_session"))).json() == {"session": "r"}
            assert (await http.post(rp("r-a1", "/seed_session"))).json() == {"session": "r-a1"}
            for _ in range(3):
                await http.post(rp("r", "/tool"), json={})
            assert (await http.post(rp("r-a1", "/tool"), json={})).json() == {"calls": 1}
            # a session header does not override the rollout
            reply = await http.post(rp("r", "/tool"), json={}, headers={"x-session-id": "r-a1"})
            assert reply.json() == {"calls": 4}
            assert server.sessions == {"r": {"calls": 4}, "r-a1": {"calls": 1}}
            assert app.state.participant.counts()["sessions"] == 2

    run(main())


# --------------------------------------------------------------------------- readiness and admission


@pytest.mark.parametrize("mode", ["exported", "stateless"])
def test_tool_call_in_flight_blocks_readiness_until_done(mode: str) -> None:
    async def main() -> None:
        server = gated_server(mode)  # type: ignore[arg-type]
        server.gates.close("t")
        app = build_gated_app(server)
        participant = app.state.participant
        async with client(app) as http:
            control = Control(http)
            await http.post(rp("r", "/seed_session"))
            call = asyncio.create_task(http.post(rp("r", "/tool"), json={"gate": "t"}))
            await bounded(server.gates.entered_event("t").wait())
            # the deadline ends the wait: the reply tells the call is still in flight
            first = await control.prepare("c1", seconds=0.2)
            assert first["phase"] == "preparing"
            assert first["report"]["ready"] is False
            assert first["report"]["blockers"] == ["r"]
            assert first["report"]["blocker_count"] == 1
            assert first["report"]["counts"]["blocking"] == 1
            assert not call.done()
            # a retried prepare waits; the call finishing makes it ready
            second = asyncio.create_task(control.prepare("c1"))
            server.gates.open("t")
            assert (await bounded(call)).json() == {"calls": 1}
            prepared = await bounded(second)
            assert prepared["phase"] == "prepared"
            assert prepared["report"]["ready"] is True
            assert participant.counts()["running"] == 0
            await control.resume("c1")

    run(main())


def test_requests_while_closed_replay_safe_admitted_others_wait() -> None:
    async def main() -> None:
        server = gated_server("exported", "replay")
        app = build_gated_app(server)
        participant = app.state.participant
        async with client(app) as http:
            control = Control(http)
            await http.post(rp("a", "/seed_session"))
            await http.post(rp("a", "/tool"), json={})
            assert (await control.prepare("c1"))["report"]["ready"]
            # replay-safe: admitted while closed
            seeded = await bounded(http.post(rp("b", "/seed_session")))
            assert seeded.status_code == 200
            verified = await bounded(http.post(rp("a", "/verify"), json={}))
            assert verified.json() == {"reward": 1.0}
            # a tool call waits for resume: not refused, not in flight
            tool = asyncio.create_task(http.post(rp("a", "/tool"), json={}))
            await until(lambda: participant.counts()["waiting"] == 1)
            status = await control.status()
            assert status["report"]["ready"] is True
            assert status["report"]["counts"]["running"] == 0
            assert not tool.done()
            await control.resume("c1")
            assert (await bounded(tool)).json() == {"calls": 2}
            assert participant.counts()["waiting"] == 0

    run(main())


def test_replay_safe_request_in_flight_does_not_block() -> None:
    async def main() -> None:
        server = gated_server("exported", "replay")
        server.gates.close("v")
        app = build_gated_app(server)
        async with client(app) as http:
            control = Control(http)
            await http.post(rp("r", "/seed_session"))
            verify = asyncio.create_task(http.post(rp("r", "/verify"), json={"gate": "v"}))
            await bounded(server.gates.entered_event("v").wait())
            assert (await control.prepare("c1"))["report"]["ready"] is True
            # a replay verify ending while closed: its session stays in this checkpoint (it may replay)
            server.gates.open("v")
            assert (await bounded(verify)).status_code == 200
            assert app.state.participant.counts()["sessions"] == 1
            await control.resume("c1")
            assert app.state.participant.counts()["sessions"] == 0

    run(main())


def test_replay_verify_ending_while_closed_is_exported_then_ends(tmp_path: Path) -> None:
    async def main() -> None:
        server = gated_server("exported", "replay")
        app = build_gated_app(server)
        participant = app.state.participant
        directory = str(tmp_path / "ckpt")
        async with client(app) as http:
            control = Control(http)
            await http.post(rp("r", "/seed_session"))
            await http.post(rp("r", "/tool"), json={})
            await control.prepare("c1")
            assert (await http.post(rp("r", "/verify"), json={})).json() == {"reward": 1.0}
            committed = await control.commit("c1", directory, ["r"])
            assert committed.json()["episode_ids"] == ["r"]
            await control.resume("c1")
            assert participant.counts()["sessions"] == 0
        assert records(directory) == [{"episode_id": "r", "state": {"calls": 1}}]

    run(main())


def test_wait_verify_while_closed_waits_for_resume() -> None:
    async def main() -> None:
        server = gated_server("exported", "wait")
        app = build_gated_app(server)
        participant = app.state.participant
        async with client(app) as http:
            control = Control(http)
            await http.post(rp("r", "/seed_session"))
            await control.prepare("c1")
            verify = asyncio.create_task(http.post(rp("r", "/verify"), json={}))
            await until(lambda: participant.counts()["waiting"] == 1)
            assert not verify.done()
            await control.resume("c1")
            assert (await bounded(verify)).json() == {"reward": 0.0}
            assert participant.counts()["sessions"] == 0  # a completed verify ends the session

    run(main())


def test_request_woken_by_resume_waits_again_when_a_new_checkpoint_closed() -> None:
    async def main() -> None:
        app = build_gated_app(gated_server())
        participant = app.state.participant
        async with client(app) as http:
            control = Control(http)
            await http.post(rp("r", "/seed_session"))
            await control.prepare("c1")
            tool = asyncio.create_task(http.post(rp("r", "/tool"), json={}))
            await until(lambda: participant.counts()["waiting"] == 1)
            # resume and close again before the woken request runs
            await participant.open_admission()
            await participant.close_admission("c-test")
            await until(lambda: participant.counts()["waiting"] == 1)
            for _ in range(20):
                await asyncio.sleep(0)
            assert not tool.done()
            assert participant.ready()
            await participant.open_admission()
            assert (await bounded(tool)).json() == {"calls": 1}

    run(main())


# --------------------------------------------------------------------------- what a checkpoint holds


def test_session_seeded_while_closed_is_not_part_of_that_checkpoint(tmp_path: Path) -> None:
    async def main() -> None:
        server = gated_server("exported")
        app = build_gated_app(server)
        participant = app.state.participant
        async with client(app) as http:
            control = Control(http)
            await http.post(rp("a", "/seed_session"))
            await http.post(rp("a", "/tool"), json={})
            assert (await control.prepare("c1"))["report"]["ready"]
            await http.post(rp("late", "/seed_session"))
            assert participant.counts()["late_sessions"] == 1
            assert (await control.prepare("c1"))["report"]["ready"] is True
            committed = await control.commit("c1", str(tmp_path / "c1"), ["a", "late"])
            assert committed.status_code == 200, committed.text
            assert committed.json()["episode_ids"] == ["a"]
            assert server.exported == [["a"]]
            await control.resume("c1")
            # an ordinary session from resume on
            counts = participant.counts()
            assert (counts["sessions"], counts["late_sessions"]) == (2, 0)
            await http.post(rp("late", "/tool"), json={})
            second = await control.checkpoint("c2", str(tmp_path / "c2"), ["a", "late"])
            assert second["episode_ids"] == ["a", "late"]
        assert records(str(tmp_path / "c2")) == [
            {"episode_id": "a", "state": {"calls": 1}},
            {"episode_id": "late", "state": {"calls": 1}},
        ]

    run(main())


def test_dropped_session_is_not_exported(tmp_path: Path) -> None:
    async def main() -> None:
        server = gated_server("exported")
        app = build_gated_app(server)
        participant = app.state.participant
        async with client(app) as http:
            control = Control(http)
            for key in ("a", "b"):
                await http.post(rp(key, "/seed_session"))
            server.drop("b")
            committed = await control.checkpoint("c1", str(tmp_path / "c1"), ["a", "b"])
            assert committed["episode_ids"] == ["a"]
            assert server.exported == [["a", "b"]]
            assert participant.counts()["sessions"] == 1  # no longer tracked
        assert records(str(tmp_path / "c1")) == [{"episode_id": "a", "state": {"calls": 0}}]

    run(main())


def test_export_covers_only_the_scope(tmp_path: Path) -> None:
    async def main() -> None:
        server = gated_server("exported")
        app = build_gated_app(server)
        async with client(app) as http:
            for key in ("a", "b", "c"):
                await http.post(rp(key, "/seed_session"))
            committed = await Control(http).checkpoint("c1", str(tmp_path / "c1"), ["c", "a", "unknown"])
            assert committed["episode_ids"] == ["a", "c"]

    run(main())


def test_stateless_exports_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        server = gated_server("stateless")
        app = build_gated_app(server)
        async with client(app) as http:
            await http.post(rp("a", "/seed_session"))
            await http.post(rp("a", "/tool"), json={})
            prepared = await Control(http).prepare("c1")
            assert prepared["report"]["restarts"] == []
            committed = await Control(http).commit("c1", str(tmp_path / "c1"), ["a"])
            assert committed.json()["record_count"] == 0
            assert server.exported == []

    run(main())


def test_restart_only_reports_restarts_and_never_blocks(tmp_path: Path) -> None:
    async def main() -> None:
        server = gated_server("restart_only")
        server.gates.close("t")
        app = build_gated_app(server)
        participant = app.state.participant
        async with client(app) as http:
            control = Control(http)
            for key in ("a", "b"):
                await http.post(rp(key, "/seed_session"))
            await http.post(rp("b", "/verify"), json={})  # a verified session is no longer a restart
            call = asyncio.create_task(http.post(rp("a", "/tool"), json={"gate": "t"}))
            await bounded(server.gates.entered_event("t").wait())
            prepared = await control.prepare("c1")
            assert prepared["phase"] == "prepared"
            assert prepared["report"]["ready"] is True
            assert prepared["report"]["restarts"] == ["a"]
            # a restart keeps running through the checkpoint: its requests are admitted while closed
            assert (await bounded(http.post(rp("a", "/tool"), json={}))).status_code == 200
            # a new seed waits for resume, so the set of restarts cannot change
            late = asyncio.create_task(http.post(rp("late", "/seed_session")))
            await until(lambda: participant.counts()["waiting"] == 1)
            assert participant.restarts() == ["a"]
            refused = await control.commit("c1", str(tmp_path / "c1"), ["a"])
            assert refused.status_code == 409
            assert error_code(refused) == "restart_in_scope"
            committed = await control.commit("c1", str(tmp_path / "c1"), ["late"])
            assert committed.status_code == 200, committed.text
            assert committed.json()["record_count"] == 0
            assert not late.done()
            await control.resume("c1")
            assert (await bounded(late)).status_code == 200
            assert sorted(participant.restarts()) == ["a", "late"]
            server.gates.open("t")
            assert (await bounded(call)).status_code == 200

    run(main())


# --------------------------------------------------------------------------- retire


def test_retire_stops_requests_frees_sessions_and_fences_the_attempt() -> None:
    async def main() -> None:
        server = gated_server("exported")
        server.gates.close("t")
        app = build_gated_app(server)
        participant = app.state.participant
        async with client(app) as http:
            control = Control(http)
            await http.post(rp("r", "/seed_session"))
            await http.post(rp("other", "/seed_session"))
            call = asyncio.create_task(http.post(rp("r", "/tool"), json={"gate": "t"}))
            await bounded(server.gates.entered_event("t").wait())
            assert (await control.retire(["r"])) == {"retired_count": 1, "retired": ["r"]}
            stopped = await bounded(call)
            assert stopped.status_code == 409
            assert error_code(stopped) == "stale_attempt"
            assert server.retired == ["r"]
            assert "r" not in server.sessions
            assert participant.counts()["sessions"] == 1
            assert participant.counts()["running"] == 0
            for path in ("/tool", "/seed_session", "/verify"):
                refused = await http.post(rp("r", path), json={})
                assert refused.status_code == 409
                assert error_code(refused) == "stale_attempt"
            # a later attempt runs; other rollouts were untouched
            assert (await http.post(rp("r-a1", "/seed_session"))).status_code == 200
            assert (await http.post(rp("r-a1", "/tool"), json={})).json() == {"calls": 1}
            assert server.sessions["other"] == {"calls": 0}

    run(main())


def test_request_waiting_for_resume_is_refused_if_its_attempt_was_marked_meanwhile() -> None:
    async def main() -> None:
        app = build_gated_app(gated_server())
        participant = app.state.participant
        async with client(app) as http:
            await http.post(rp("r", "/seed_session"))
            await participant.close_admission("c-test")
            waiting = asyncio.create_task(http.post(rp("r", "/tool"), json={}))
            await until(lambda: participant.counts()["waiting"] == 1)
            app.state.plane.marks.mark("r")  # a retire marks first, before it stops anything
            await participant.open_admission()
            refused = await bounded(waiting)
            assert refused.status_code == 409
            assert error_code(refused) == "stale_attempt"
            assert app.state.server.sessions["r"] == {"calls": 0}

    run(main())


def test_retire_covers_earlier_attempts() -> None:
    async def main() -> None:
        server = gated_server("exported")
        app = build_gated_app(server)
        participant = app.state.participant
        async with client(app) as http:
            for key in ("x", "x-a1", "x-a3", "y"):
                await http.post(rp(key, "/seed_session"))
            await Control(http).retire(["x-a2"])
            assert sorted(server.retired) == ["x", "x-a1", "x-a2"]
            assert sorted(server.sessions) == ["x-a3", "y"]
            assert participant.counts()["sessions"] == 2
            assert (await http.post(rp("x-a1", "/tool"), json={})).status_code == 409
            assert (await http.post(rp("x-a3", "/tool"), json={})).status_code == 200
            # forget ends the refusal
            forgot = await Control(http).call("forget", "forget", rollout_ids=["x"])
            assert forgot.json()["forgotten_count"] == 1
            assert (await http.post(rp("x-a1", "/tool"), json={})).status_code == 200

    run(main())


# --------------------------------------------------------------------------- restore


def test_restore_installs_under_the_next_attempt(tmp_path: Path) -> None:
    async def main() -> None:
        directory = str(tmp_path / "c1")
        first = gated_server("exported")
        app = build_gated_app(first)
        async with client(app) as http:
            for key in ("a", "b"):
                await http.post(rp(key, "/seed_session"))
            for _ in range(2):
                await http.post(rp("a", "/tool"), json={})
            await Control(http).checkpoint("c1", directory, ["a", "b"])

        fresh = gated_server("exported")
        app = build_gated_app(fresh)
        participant = app.state.participant
        async with client(app) as http:
            control = Control(http)
            restored = await control.restore("c1", directory, ["a", "b"])
            assert restored["restored"] == ["a-a1", "b-a1"]
            assert fresh.restored == [{"a-a1": {"calls": 2}, "b-a1": {"calls": 0}}]
            # admission is closed until resume: a request of the replacement waits, a retire stops it
            waiting = asyncio.create_task(http.post(rp("b-a1", "/tool"), json={}))
            await until(lambda: participant.counts()["waiting"] == 1)
            await control.retire(["b-a1"], checkpoint_id="c1")
            stopped = await bounded(waiting)
            assert error_code(stopped) == "stale_attempt"
            await control.resume("c1")
            assert (await http.post(rp("a-a1", "/tool"), json={})).json() == {"calls": 3}
            # the captured attempt is refused from now on
            old = await http.post(rp("a", "/tool"), json={})
            assert error_code(old) == "stale_attempt"
            assert participant.counts()["sessions"] == 1

    run(main())


def test_commit_deletes_untouched_restored_sessions_it_leaves_out(tmp_path: Path) -> None:
    async def main() -> None:
        first = gated_server("exported")
        app = build_gated_app(first)
        async with client(app) as http:
            for key in ("a", "b", "c"):
                await http.post(rp(key, "/seed_session"))
            await Control(http).checkpoint("c1", str(tmp_path / "c1"), ["a", "b", "c"])

        fresh = gated_server("exported")
        app = build_gated_app(fresh)
        async with client(app) as http:
            control = Control(http)
            await control.restore("c1", str(tmp_path / "c1"), ["a", "b", "c"])
            await control.resume("c1")
            await http.post(rp("c-a1", "/tool"), json={})  # c's replacement runs
            committed = await control.checkpoint("c2", str(tmp_path / "c2"), ["a-a1"])
            assert committed["episode_ids"] == ["a-a1"]
            # b-a1 was never touched: freed; c-a1 belongs to a running attempt: kept, not refused
            assert fresh.retired == ["b-a1"]
            assert sorted(fresh.sessions) == ["a-a1", "c-a1"]
            assert (await http.post(rp("b-a1", "/seed_session"))).status_code == 200

    run(main())


@pytest.mark.parametrize("mode", ["exported", "stateless", "restart_only"])
def test_a_commit_with_stop_parks_the_exported_sessions_still_held(tmp_path: Path, mode: str) -> None:
    """The controller stops after this checkpoint: an exported-mode server frees their outside compute."""

    async def main() -> None:
        server = gated_server(mode)  # type: ignore[arg-type]
        app = build_gated_app(server)
        async with client(app) as http:
            control = Control(http)
            for key in ("a", "b"):
                await http.post(rp(key, "/seed_session"))
            await http.post(rp("b", "/verify"), json={})  # b ended: nothing of it is held
            prepared = await control.prepare("c1")
            assert prepared["phase"] == "prepared"
            scope = [] if mode == "restart_only" else ["a", "b"]
            committed = await control.commit("c1", str(tmp_path / "c1"), scope, stop=True)
            assert committed.status_code == 200, committed.text
            assert server.parked == ([["a"]] if mode == "exported" else [])
            again = await control.commit("c1", str(tmp_path / "c1"), scope, stop=True)
            assert again.json() == committed.json()
            assert len(server.parked) == (1 if mode == "exported" else 0)  # once per checkpoint
            await control.resume("c1")

    run(main())
