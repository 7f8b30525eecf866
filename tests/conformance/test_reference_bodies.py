"""Every control route with the bodies a reference controller sends (docs/wire.md §1–§5).

One row per wire case: a fresh in-process participant app (:class:`~.conftest.PlaneApp`
over a :class:`~gymckpt.testing.participant.FakeParticipant` holding the episodes ``r``,
``s-a2`` and ``x-a0``) is driven through the row's steps. Every step states the status it
must get and the reply fields it must carry (a subset of the reply, nested dicts compared
the same way) or the error code. Rows marked ``restore`` first commit a checkpoint
(:data:`SOURCE`) in another app, so the row's app is a fresh process that restores it.

Then the environment's data route ``/run`` with the reference's bodies, and the reference's
controller order against four participants (prepare stops at the first stage not prepared;
the later ones, resumed under an id they never saw, remember it).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.control.routes import CONTROL_PREFIX
from gymckpt.testing.net import serve_in_loop
from gymckpt.testing.participant import FakeParticipant

from .conftest import (
    AUTH,
    TOKEN,
    PlaneApp,
    close_plane,
    control,
    deadline,
    environment_app,
    environment_client,
    error_of,
    obj,
    participant_app,
    plane_app,
)
from .reference_controller import (
    CommitReply,
    EpisodeRef,
    ForgetReply,
    ParticipantError,
    PrepareReply,
    ReferenceController,
    RenewReply,
    RestoreReply,
    ResumeReply,
    RetireReply,
    StatusReply,
    run_episode,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    import httpx
    from pydantic import BaseModel

    from tests.servers.env_support import FakeDownstream

#: the checkpoint the restore rows restore, under the reference's id format
SOURCE = "ckpt-20240102T030405-0a1b2c3d"
#: a restore's fresh id, as a reference controller makes it
RESTORE = "restore-0123456789ab"
OPEN = "ckpt-20240102T030405-00000001"
OTHER = "ckpt-20240102T030405-00000002"
#: the episodes every row's participant holds (and the source checkpoint records)
HELD = {"r": {"step": 1}, "s-a2": {"step": 2}, "x-a0": {"step": 3}}
#: a deadline already past: a prepare still closes admission and reports at once
PAST = "past"
#: a deadline far ahead, and the default lease grace: the lease is the latest deadline plus the grace
FAR = 4e9
GRACE = 600.0
DIR = "<dir>"
TASK = {"task_id": {"taskset": "demo", "task_id": "t1"}, "task_input": {"prompt": "count"}}


#: what a reference controller parses each route's 200 reply as
REPLY_MODELS: dict[str, type[BaseModel]] = {
    "status": StatusReply,
    "prepare": PrepareReply,
    "renew": RenewReply,
    "commit": CommitReply,
    "restore": RestoreReply,
    "resume": ResumeReply,
    "retire": RetireReply,
    "forget": ForgetReply,
}


@dataclass(frozen=True)
class Step:
    """One call of a row: the route (``status`` is the GET), its body, what it must answer."""

    route: str
    body: dict[str, Any] | None = None
    status: int | tuple[int, ...] = 200
    #: reply fields it must carry (a nested subset)
    reply: dict[str, Any] | None = None
    #: the error code it must carry
    code: str | tuple[str, ...] | None = None
    auth: bool = True


@dataclass(frozen=True)
class Row:
    name: str
    steps: tuple[Step, ...]
    #: commit :data:`SOURCE` first, in another app: this row's app is the fresh process restoring it
    restore: bool = False
    busy: tuple[str, ...] = ()
    restarts: tuple[str, ...] = ()
    held: dict[str, Any] = field(default_factory=lambda: dict(HELD))
    #: a further check on the last step's reply: (reply body, the row's app, checkpoint dir)
    check: Callable[[dict[str, Any], PlaneApp, str], None] | None = None


def prepare(checkpoint_id: str = OPEN, **expect: Any) -> Step:
    return Step("prepare", {"checkpoint_id": checkpoint_id}, **expect)


def commit(episode_ids: Any, checkpoint_id: str = OPEN, *, omit: bool = False, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"checkpoint_id": checkpoint_id, "checkpoint_dir": DIR, **extra}
    if not omit:
        body["episode_ids"] = episode_ids
    return body


def restore(episode_ids: list[Any], checkpoint_id: str = RESTORE, **expect: Any) -> Step:
    body = {"checkpoint_id": checkpoint_id, "checkpoint_dir": DIR, "episode_ids": episode_ids}
    return Step("restore", body, **expect)


def resume(checkpoint_id: str = OPEN, **expect: Any) -> Step:
    return Step("resume", {"checkpoint_id": checkpoint_id}, **expect)


def retire(episode_ids: list[Any], checkpoint_id: str = "retire", **expect: Any) -> Step:
    return Step("retire", {"checkpoint_id": checkpoint_id, "episode_ids": episode_ids}, **expect)


def forget(rollout_ids: list[str], checkpoint_id: str = "forget", **expect: Any) -> Step:
    return Step("forget", {"checkpoint_id": checkpoint_id, "rollout_ids": rollout_ids}, **expect)


def committed(keys: list[str], **manifest: Any) -> dict[str, Any]:
    return {"phase": "committed", "episode_ids": keys, "manifest": {"record_count": len(keys), **manifest}}


def refused(code: str | tuple[str, ...], status: int | tuple[int, ...] = 409) -> dict[str, Any]:
    return {"status": status, "code": code}


#: an invalid body: gymckpt answers 422 invalid_request, or 400 invalid_rollout_id for an id outside the grammar
INVALID = refused(("invalid_request", "invalid_rollout_id"), (400, 422))


# ----------------------------------------------------------------------------- checks of the last reply


def manifest_as_written(reply: dict[str, Any], app: PlaneApp, checkpoint_dir: str) -> None:
    """The reply's manifest is the manifest file, and gymckpt's own fields sit beside it."""
    path = Path(checkpoint_dir) / "gym" / app.fake.kind / app.fake.instance / "manifest.json"
    raw = path.read_bytes()
    assert reply["manifest"] == json.loads(raw)
    manifest = reply["manifest"]
    assert manifest["schema_version"] == 1
    assert (manifest["kind"], manifest["instance"], manifest["checkpoint_id"]) == ("environment", "env-0", OPEN)
    assert manifest["records_file"] == f"records-{manifest['records_sha256']}.jsonl"
    records = path.parent / manifest["records_file"]
    assert hashlib.sha256(records.read_bytes()).hexdigest() == manifest["records_sha256"]
    # gymckpt's own fields, as extra keys
    assert reply["kind"] == "environment" and reply["instance"] == "env-0"
    assert reply["checkpoint_id"] == OPEN and reply["checkpoint_dir"] == checkpoint_dir
    assert reply["manifest_path"] == "gym/environment/env-0/manifest.json"
    assert reply["manifest_sha256"] == hashlib.sha256(raw).hexdigest()
    assert reply["records_file"] == manifest["records_file"]
    assert reply["record_count"] == manifest["record_count"] == len(reply["episode_ids"])
    assert reply["records_bytes"] == records.stat().st_size


def lease_after_deadline(reply: dict[str, Any], app: PlaneApp, checkpoint_dir: str) -> None:
    """A renew's ``lease_expires_at`` is a time at least the grace beyond now."""
    assert isinstance(reply["lease_expires_at"], float), reply
    assert reply["lease_expires_at"] >= time.time() + GRACE, reply


def installed(*keys: str) -> Callable[[dict[str, Any], PlaneApp, str], None]:
    """The participant holds the restored records under these next-attempt keys."""

    def check(reply: dict[str, Any], app: PlaneApp, checkpoint_dir: str) -> None:
        assert sorted(record["episode_id"] for record in app.fake.installed) == sorted(keys)
        for record in app.fake.installed:
            first = EpisodeRef.from_capture_key(record["episode_id"])
            source = EpisodeRef(rollout_id=first.rollout_id, attempt=first.attempt - 1).capture_key
            assert record["state"] == HELD[source]

    return check


# ----------------------------------------------------------------------------- the table

STATUS_IDLE = {
    "kind": "environment",
    "instance": "env-0",
    "phase": "idle",
    "checkpoint_id": None,
    "lease_expires_at": None,
    "retired_rollouts": 0,
    "report": {"ready": True, "blockers": [], "blocker_count": 0, "restarts": []},
}
READY = {"ready": True, "blockers": [], "blocker_count": 0, "restarts": []}

ROWS = [
    # --- shared
    Row("status: the reference's keys", (Step("status", reply=STATUS_IDLE),)),
    Row(
        "no bearer token: 401 unauthorized",
        (Step("prepare", {"checkpoint_id": OPEN}, auth=False, **refused("unauthorized", 401)),),
    ),
    # --- prepare
    Row("prepare: phase and report", (prepare(reply={"phase": "prepared", "report": READY}),)),
    Row(
        "prepare: blockers are capture keys",
        (
            Step(
                "prepare",
                {"checkpoint_id": OPEN, "deadline_ts": PAST},
                reply={"phase": "preparing", "report": {"ready": False, "blockers": ["s-a2"], "blocker_count": 1}},
            ),
        ),
        busy=("s-a2",),
    ),
    Row(
        "prepare: restarts are capture keys, x-a0 among them",
        (prepare(reply={"phase": "prepared", "report": {"ready": True, "restarts": ["t-a3", "x-a0"]}}),),
        restarts=("t-a3", "x-a0"),
    ),
    Row("prepare: another id while one is open", (prepare(), prepare(OTHER, **refused("checkpoint_conflict")))),
    Row(
        "prepare: during a restore, another id",
        (restore([obj("r")]), prepare(OTHER, **refused("checkpoint_conflict"))),
        restore=True,
    ),
    Row(
        "prepare: during a restore, the same id",
        (restore([obj("r")]), prepare(RESTORE, **refused("invalid_phase"))),
        restore=True,
    ),
    Row(
        "prepare: after a resume of an id never seen",
        (resume(OTHER, reply={"phase": "idle", "idempotent": True}), prepare(OTHER, **refused("stale_checkpoint"))),
    ),
    # --- renew
    Row("renew: the lease", (prepare(), Step("renew", {"checkpoint_id": OPEN}, reply={})), check=lease_after_deadline),
    Row(
        "renew: never shortens the lease",
        (
            Step("prepare", {"checkpoint_id": OPEN, "deadline_ts": FAR}),
            Step("renew", {"checkpoint_id": OPEN}, reply={"lease_expires_at": FAR + GRACE}),
        ),
    ),
    Row("renew: while idle", (Step("renew", {"checkpoint_id": OPEN}, **refused("invalid_phase")),)),
    # --- commit
    Row(
        "commit: object ids",
        (prepare(), Step("commit", commit([obj("r"), obj("s", 2)]), reply=committed(["r", "s-a2"]))),
        check=manifest_as_written,
    ),
    Row("commit: mixed forms", (prepare(), Step("commit", commit([obj("r"), "s-a2"]), reply=committed(["r", "s-a2"])))),
    Row(
        "commit: attempt defaults to 0",
        (prepare(), Step("commit", commit([{"rollout_id": "r"}]), reply=committed(["r"]))),
    ),
    Row(
        "commit: stop, then the phase is still committed",
        (
            prepare(),
            Step("commit", commit([obj("r")], stop=True), reply=committed(["r"])),
            Step("status", reply={"phase": "committed", "checkpoint_id": OPEN}),
            resume(reply={"phase": "idle", "idempotent": False}),
        ),
    ),
    Row("commit: stop false", (prepare(), Step("commit", commit([obj("r")], stop=False), reply=committed(["r"])))),
    Row(
        "commit: no episode_ids exports everything",
        (prepare(), Step("commit", commit(None, omit=True), reply=committed(["r", "s-a2", "x-a0"]))),
    ),
    Row(
        "commit: episode_ids null exports everything",
        (prepare(), Step("commit", commit(None), reply=committed(["r", "s-a2", "x-a0"]))),
    ),
    Row(
        "commit: x-a0 is attempt 0 of the rollout x-a0",
        (prepare(), Step("commit", commit([obj("x-a0")]), reply=committed(["x-a0"]))),
    ),
    Row(
        "commit: attempt 1 of x-a0",
        (prepare(), Step("commit", commit([obj("x-a0", 1)]), reply=committed(["x-a0-a1"]))),
        held={"x-a0-a1": {"step": 1}},
    ),
    Row(
        "commit: an object's rollout id with the reserved suffix",
        (prepare(), Step("commit", commit([obj("r-a1")]), **INVALID)),
    ),
    Row(
        "commit: an object with an unknown field",
        (prepare(), Step("commit", commit([{**obj("r"), "extra": 1}]), **refused("invalid_request", 422))),
    ),
    Row(
        "commit: a restart in scope",
        (prepare(), Step("commit", commit([obj("r")]), **refused("restart_in_scope"))),
        restarts=("r",),
    ),
    Row(
        "commit: a retry with another scope",
        (
            prepare(),
            Step("commit", commit([obj("r")]), reply=committed(["r"])),
            Step("commit", commit([obj("r"), obj("s", 2)]), **refused("checkpoint_conflict")),
        ),
    ),
    # --- restore
    Row(
        "restore: object ids under a fresh id",
        (
            restore(
                [obj("r"), obj("s", 2)],
                reply={"phase": "restored", "source_checkpoint_id": SOURCE, "restored": ["r-a1", "s-a3"]},
            ),
            Step("status", reply={"phase": "restored", "checkpoint_id": RESTORE}),
        ),
        restore=True,
        check=installed("r-a1", "s-a3"),
    ),
    Row(
        "restore: an episode the checkpoint lacks is no error and not restored",
        (
            restore(
                [obj("r"), obj("gone", 4)],
                reply={"phase": "restored", "source_checkpoint_id": SOURCE, "restored": ["r-a1"]},
            ),
        ),
        restore=True,
        check=installed("r-a1"),
    ),
    Row(
        "restore: mixed forms",
        (restore([obj("r"), "s-a2"], reply={"restored": ["r-a1", "s-a3"], "source_checkpoint_id": SOURCE}),),
        restore=True,
    ),
    Row(
        "restore: an empty scope",
        (restore([], reply={"phase": "restored", "restored": [], "source_checkpoint_id": SOURCE}),),
        restore=True,
    ),
    Row(
        "restore: x-a0 continues as x-a0-a1",
        (restore([obj("x-a0")], reply={"restored": ["x-a0-a1"], "source_checkpoint_id": SOURCE}),),
        restore=True,
        check=installed("x-a0-a1"),
    ),
    Row(
        "restore: resumed with its own id",
        (
            restore([obj("r")]),
            resume(RESTORE, reply={"phase": "idle", "idempotent": False}),
            resume(RESTORE, reply={"phase": "idle", "idempotent": True}),
            Step("status", reply={"phase": "idle"}),
        ),
        restore=True,
    ),
    Row(
        "restore: resume with another id",
        (restore([obj("r")]), resume(SOURCE, **refused("checkpoint_conflict"))),
        restore=True,
    ),
    # --- resume
    Row("resume: an id never seen", (resume(OTHER, reply={"phase": "idle", "idempotent": True}),)),
    Row(
        "resume: a real reopen, then a repeat",
        (
            prepare(),
            resume(reply={"phase": "idle", "idempotent": False}),
            resume(reply={"phase": "idle", "idempotent": True}),
            prepare(**refused("stale_checkpoint")),
        ),
    ),
    Row("resume: another id while one is open", (prepare(), resume(OTHER, **refused("checkpoint_conflict")))),
    # --- retire
    Row(
        "retire: object ids",
        (retire([obj("r"), obj("s", 2)], reply={"retired_count": 2}), Step("status", reply={"retired_rollouts": 2})),
    ),
    Row("retire: mixed forms", (retire([obj("r"), "s-a2"], reply={"retired_count": 2}),)),
    Row("retire: x-a0", (retire([obj("x-a0")], reply={"retired_count": 1}),)),
    Row("retire: no episode", (retire([], **INVALID),)),
    Row("retire: while prepared", (prepare(), retire([obj("r")], **refused("invalid_phase")))),
    Row(
        "retire: restored phase, the restore's id",
        (restore([obj("r")]), retire([obj("r", 1)], RESTORE, reply={"retired_count": 1})),
        restore=True,
    ),
    Row(
        "retire: restored phase, renews the lease",
        (
            restore([obj("r")]),
            Step("retire", {"checkpoint_id": RESTORE, "episode_ids": [obj("r", 1)], "deadline_ts": FAR}),
            Step("status", reply={"phase": "restored", "lease_expires_at": FAR + GRACE}),
        ),
        restore=True,
    ),
    Row(
        "retire: restored phase, another id",
        (restore([obj("r")]), retire([obj("r", 1)], "retire", **refused("checkpoint_conflict"))),
        restore=True,
    ),
    # --- forget
    Row(
        "forget: retired rollouts",
        (
            retire([obj("r"), obj("x-a0")], reply={"retired_count": 2}),
            forget(["r", "x-a0"], reply={"forgotten_count": 2}),
            Step("status", reply={"retired_rollouts": 0}),
        ),
    ),
    Row("forget: no rollout", (forget([], **INVALID),)),
    Row(
        "forget: restored phase, the restore's id",
        (restore([obj("r")]), forget(["r"], RESTORE, reply={"forgotten_count": 1})),
        restore=True,
    ),
    Row(
        "forget: restored phase, another id",
        (restore([obj("r")]), forget(["r"], "forget", **refused("checkpoint_conflict"))),
        restore=True,
    ),
]


def _body(step: Step, checkpoint_dir: str) -> dict[str, Any] | None:
    if step.body is None:
        return None
    body = {key: (checkpoint_dir if value == DIR else value) for key, value in step.body.items()}
    if body.get("deadline_ts") == PAST:
        body["deadline_ts"] = time.time() - 1.0
    body.setdefault("deadline_ts", deadline())
    return body


def assert_subset(expected: Any, actual: Any, where: str = "reply") -> None:
    """Every key of ``expected`` is in ``actual`` with that value (dicts compared the same way, recursively)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: {actual!r} is not an object"
        for key, value in expected.items():
            assert key in actual, f"{where}: no {key!r} in {actual!r}"
            assert_subset(value, actual[key], f"{where}.{key}")
    else:
        assert actual == expected, f"{where}: {actual!r}, expected {expected!r}"


async def _checkpointed(checkpoint_dir: str) -> None:
    """Commit :data:`SOURCE` of every :data:`HELD` episode into ``checkpoint_dir`` (the restore rows' source)."""
    fake = FakeParticipant()
    for key, state in HELD.items():
        fake.start(key, state)
    async with participant_app(fake) as app:
        assert (await app.post("prepare", {"checkpoint_id": SOURCE, "deadline_ts": deadline()})).status_code == 200
        body = {"checkpoint_id": SOURCE, "deadline_ts": deadline(), "checkpoint_dir": checkpoint_dir}
        reply = await app.post("commit", {**body, "episode_ids": [obj("r"), obj("s", 2), obj("x-a0")]})
        assert reply.status_code == 200, reply.text
        assert (await app.post("resume", {"checkpoint_id": SOURCE, "deadline_ts": deadline()})).status_code == 200


async def _call(app: PlaneApp, step: Step, checkpoint_dir: str) -> httpx.Response:
    if step.route == "status":
        return await app.client.get(f"{CONTROL_PREFIX}/status", headers=AUTH)
    return await app.post(step.route, _body(step, checkpoint_dir), auth=step.auth)


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
async def test_reference_body(row: Row, tmp_path: Path) -> None:
    checkpoint_dir = str(tmp_path / "ckpt")
    if row.restore:
        await _checkpointed(checkpoint_dir)
    fake = FakeParticipant()
    for key, state in ({} if row.restore else row.held).items():  # a restore runs in a fresh process
        fake.start(key, state, busy=key in row.busy)
    fake.restart_keys = set(row.restarts)
    async with participant_app(fake) as app:
        reply: dict[str, Any] = {}
        for index, step in enumerate(row.steps):
            response = await _call(app, step, checkpoint_dir)
            where = f"step {index} ({step.route})"
            statuses = step.status if isinstance(step.status, tuple) else (step.status,)
            assert response.status_code in statuses, f"{where}: {response.status_code} {response.text}"
            if step.code is not None:
                codes = step.code if isinstance(step.code, tuple) else (step.code,)
                assert error_of(response) in codes, f"{where}: {response.text}"
                continue
            reply = response.json()
            REPLY_MODELS[step.route].model_validate(reply)  # the reference controller can read it
            assert_subset(step.reply or {}, reply, where)
        if row.check is not None:
            row.check(reply, app, checkpoint_dir)


# ----------------------------------------------------------------------------- the data route


async def test_run_takes_an_object_and_answers_one(downstream: FakeDownstream) -> None:
    async with environment_client(downstream) as client:
        for episode in (obj("r"), obj("x-a0"), obj("s", 2)):
            response = await client.post("/run", json={"episode_id": episode, "task": TASK})
            assert response.status_code == 200, response.text
            assert response.json() == {
                "episode_id": episode,
                "task_id": TASK["task_id"],
                "result": {"reward": 1.0, "response": "answer 7"},
            }
        # a capture key is accepted too, and answered with the object
        response = await client.post("/run", json={"episode_id": "k-a3", "task": TASK})
        assert response.status_code == 200, response.text
        assert response.json()["episode_id"] == obj("k", 3)
    prefixes = {path.split("/")[2] for _, path in downstream.calls}
    assert prefixes == {"r", "x-a0", "s-a2", "k-a3"}


async def test_a_new_run_while_a_checkpoint_is_open_is_parked(downstream: FakeDownstream) -> None:
    async with environment_client(downstream) as client:
        prepared = await control(client, "prepare", checkpoint_id=OPEN)
        assert prepared.status_code == 200 and prepared.json()["phase"] == "prepared", prepared.text
        parked = await client.post("/run", json={"episode_id": obj("late"), "task": TASK})
        assert parked.status_code == 409, parked.text
        assert error_of(parked) == "checkpoint_parked"
        assert not downstream.calls, "a refused episode called downstream"

        resumed = await control(client, "resume", checkpoint_id=OPEN)
        assert resumed.json() == {**resumed.json(), "phase": "idle", "idempotent": False}
        retried = await client.post("/run", json={"episode_id": obj("late"), "task": TASK})
        assert retried.status_code == 200 and retried.json()["episode_id"] == obj("late"), retried.text


async def test_a_retired_run_answers_a_reference_failure(downstream: FakeDownstream) -> None:
    import threading

    downstream.gates["agent"] = threading.Event()
    downstream.entered["agent"] = threading.Event()
    async with environment_client(downstream) as client:
        run = asyncio.create_task(client.post("/run", json={"episode_id": obj("gone", 1), "task": TASK}))
        assert await asyncio.to_thread(downstream.entered["agent"].wait, 30), "the agent was never called"
        retired = await control(client, "retire", checkpoint_id="retire", episode_ids=[obj("gone", 1)])
        assert retired.status_code == 200 and retired.json()["retired_count"] == 1, retired.text
        response = await asyncio.wait_for(run, 30)
        downstream.gates["agent"].set()
    assert response.status_code == 200, response.text
    assert response.json() == {
        "episode_id": obj("gone", 1),
        "task_id": TASK["task_id"],
        "failure": {"failure_reason": "retired", "terminal": True},
    }


async def test_reference_run_helper_reads_the_reply(downstream: FakeDownstream) -> None:
    """:func:`run_episode` over HTTP: the reply parses as the reference's RunReply."""
    import aiohttp

    async with serve_in_loop(environment_app(downstream)) as url, aiohttp.ClientSession() as session:
        reply = await run_episode(session, url, EpisodeRef(rollout_id="h", attempt=2), TASK)
    assert reply.episode_id == EpisodeRef(rollout_id="h", attempt=2)
    assert reply.task_id.model_dump() == TASK["task_id"]
    assert reply.result == {"reward": 1.0, "response": "answer 7"} and reply.failure is None


# ----------------------------------------------------------------------------- the controller's order


async def test_prepare_stops_at_the_first_stage_not_prepared_and_the_rest_remember_the_id() -> None:
    """The environment cannot get ready: the later stages are never prepared; resumed under that id, they
    answer idempotent and refuse a late prepare with it as stale."""
    fakes = {kind: FakeParticipant(kind, f"{kind}-0") for kind in ("resources", "agent", "model", "environment")}
    fakes["environment"].start("r", busy=True)
    apps = {kind: plane_app(fake) for kind, fake in fakes.items()}
    async with (
        serve_in_loop(apps["environment"][0]) as environment,
        serve_in_loop(apps["model"][0]) as model,
        serve_in_loop(apps["agent"][0]) as agent,
        serve_in_loop(apps["resources"][0]) as resources,
        ReferenceController([resources, agent, model, environment], TOKEN) as controller,
    ):
        members = await controller.discover()
        assert [member.kind for member in members] == ["environment", "model", "agent", "resources"]
        prepared = await controller.prepare(OPEN, deadline_ts=time.time() - 1.0)
        assert not prepared.prepared
        assert prepared.stages == ["environment"]
        assert prepared.blockers() == {environment: ["r"]}
        assert [(call.url, call.route) for call in controller.sent] == [(environment, "prepare")]
        for url in (model, agent, resources):
            status = await controller.status(url)
            assert (status.phase, status.checkpoint_id) == ("idle", None)

        resumed = await controller.resume(OPEN, deadline_ts=deadline())
        assert [call.url for call in controller.sent[1:]] == [resources, agent, model, environment]
        assert {url: reply.idempotent for url, reply in resumed.items()} == {
            environment: False,
            model: True,
            agent: True,
            resources: True,
        }
        for url in (model, agent, resources):
            with pytest.raises(ParticipantError) as late:
                await controller.call(url, "prepare", {"checkpoint_id": OPEN, "deadline_ts": deadline()}, deadline())
            assert (late.value.status, late.value.code) == (409, "stale_checkpoint")
    for _, plane in apps.values():
        await close_plane(plane)
