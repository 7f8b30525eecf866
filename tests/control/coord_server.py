"""A real server for the coordination tests: one participant behind gymckpt's control routes.

The participant is :class:`~gymckpt.testing.participant.FakeParticipant` with every control
operation logged (:class:`LoggingParticipant`).

Started by ``tests/control/test_coordination.py`` as ``python -m uvicorn
tests.control.coord_server:app`` and configured through environment variables:

``COORD_KIND``, ``COORD_INSTANCE``
    The participant's kind (any string: an unknown kind is how discover's refusal is tested)
    and instance.
``COORD_TOKEN``
    The control bearer token.
``COORD_LOG``
    A file shared by every server of a test; each control operation appends one line
    ``<kind> <instance> <op>`` to it (opened with ``O_APPEND``, one ``write`` per line), so
    the test sees the order in which the servers ran them.
``COORD_EPISODES``, ``COORD_RESTARTS``
    Comma-separated capture keys this server holds at start, and the ones it cannot capture.
``COORD_BEHAVIOURS``
    Comma-separated: ``fail_restore`` (install raises a typed storage error),
    ``hang_status`` (the status route never replies).
``COORD_EXPORT_DELAY``
    Seconds every export takes (so that concurrent commits overlap visibly).

Data routes (no auth): ``GET /episodes``; ``POST /begin/{key}`` and ``POST /finish/{key}``
(a step in flight: it blocks readiness until finished); ``POST /run/{key}`` (one step;
parks while admission is closed); ``GET /wait_parked/{n}`` (returns once n runs are parked);
``POST /slow`` (blocks until ``POST /release``).

Log ops: ``<route>:begin`` / ``<route>:end`` around every control request (end is written
before the reply is sent), and ``close_admission``, ``open_admission``, ``export <keys>``,
``install <keys>``, ``retire <keys>`` from the participant.

Also here, for a test to serve in its own process (:func:`gymckpt.testing.net.serve`):
:func:`build_reference_app`, a participant that speaks only the reference stack's wire
shapes, and :func:`build_non_participant_app`, a server without control routes.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from gymckpt.control.participant import Participant
from gymckpt.control.plane import ControlPlane
from gymckpt.control.routes import CONTROL_PREFIX, install_control
from gymckpt.errors import StorageError
from gymckpt.identity import capture_key, split_capture_key
from gymckpt.store import open_store
from gymckpt.testing.participant import FakeParticipant

if TYPE_CHECKING:
    from collections.abc import Iterable

#: the reference's checkpoint id pattern
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


def _keys(name: str) -> list[str]:
    return [key for key in os.environ.get(name, "").split(",") if key]


class LoggingParticipant(FakeParticipant):
    """The fake participant, every control operation logged; a retire frees earlier attempts too.

    Admission is also an :class:`asyncio.Event` (:attr:`admission`), which parked runs
    wait on; deleting restored episodes is a retire (the interface's default).
    """

    delete_restored = Participant.delete_restored

    def __init__(self, kind: str, instance: str, log_path: str, *, behaviours: set[str], export_delay: float) -> None:
        super().__init__(kind, instance, frees_earlier_attempts=True)
        self._log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.behaviours = behaviours
        self.export_delay = export_delay
        if "fail_restore" in behaviours:
            self.fail_install = StorageError(f"{kind}/{instance}: injected restore failure")
        self.admission = asyncio.Event()
        self.admission.set()
        self.parked = 0
        self.parked_changed = asyncio.Event()

    def log(self, op: str) -> None:
        os.write(self._log_fd, f"{self.kind} {self.instance} {op}\n".encode())

    async def close_admission(self, checkpoint_id: str) -> None:
        self.log("close_admission")
        self.admission.clear()
        await super().close_admission(checkpoint_id)

    async def open_admission(self) -> None:
        self.log("open_admission")
        await super().open_admission()
        self.admission.set()

    def counts(self) -> dict[str, int]:
        return {**super().counts(), "parked": self.parked}

    async def export(self, scope: list[str] | None) -> list[dict[str, Any]]:
        self.log("export *" if scope is None else f"export {','.join(scope)}")
        if self.export_delay:
            await asyncio.sleep(self.export_delay)
        return await super().export(scope)

    async def install(self, records: list[dict[str, Any]], scope: list[str], manifest: Any = None) -> None:
        self.log(f"install {','.join(scope)}")
        await super().install(records, scope, manifest)

    async def retire(self, episode_ids: list[str]) -> None:
        self.log(f"retire {','.join(episode_ids)}")
        await super().retire(episode_ids)


def build_app() -> FastAPI:
    kind = os.environ["COORD_KIND"]
    instance = os.environ["COORD_INSTANCE"]
    token = os.environ["COORD_TOKEN"]
    behaviours = set(_keys("COORD_BEHAVIOURS"))
    participant = LoggingParticipant(
        kind,
        instance,
        os.environ["COORD_LOG"],
        behaviours=behaviours,
        export_delay=float(os.environ.get("COORD_EXPORT_DELAY", "0")),
    )
    for key in _keys("COORD_EPISODES"):
        participant.state[key] = {"kind": kind, "key": key, "step": 1}
    participant.restart_keys.update(_keys("COORD_RESTARTS"))
    plane = ControlPlane(participant)
    app = FastAPI()
    app.state.participant = participant
    app.state.plane = plane
    release = asyncio.Event()

    @app.middleware("http")
    async def log_control(request: Request, call_next: Any) -> Any:
        path = request.url.path
        if not path.startswith(CONTROL_PREFIX + "/"):
            return await call_next(request)
        op = path.rsplit("/", 1)[-1]
        if op == "status" and "hang_status" in behaviours:
            await asyncio.Event().wait()  # accept, read the request, never reply
        participant.log(f"{op}:begin")
        try:
            return await call_next(request)
        finally:
            participant.log(f"{op}:end")

    @app.get("/episodes")
    async def episodes() -> dict[str, Any]:
        return {
            "state": participant.state,
            "busy": sorted(participant.busy),
            "admission_open": participant.admission.is_set(),
            "parked": participant.parked,
            "refused": {key: plane.marks.is_refused(key) for key in participant.state},
        }

    @app.post("/begin/{key}")
    async def begin(key: str) -> dict[str, Any]:
        participant.make_busy(key)
        return {"busy": sorted(participant.busy)}

    @app.post("/finish/{key}")
    async def finish(key: str) -> dict[str, Any]:
        state = participant.state.get(key, {"kind": kind, "key": key, "step": 0})
        participant.finish_step(key, {**state, "step": state["step"] + 1})
        return {"busy": sorted(participant.busy)}

    @app.post("/run/{key}")
    async def run(key: str) -> dict[str, Any]:
        plane.marks.check(key)
        if not participant.admission.is_set():
            participant.parked += 1
            participant.parked_changed.set()
            try:
                await participant.admission.wait()
            finally:
                participant.parked -= 1
            plane.marks.check(key)
        state = participant.state.setdefault(key, {"kind": kind, "key": key, "step": 0})
        participant.state[key] = {**state, "step": state["step"] + 1}
        return {"key": key, "state": participant.state[key]}

    @app.get("/wait_parked/{count}")
    async def wait_parked(count: int) -> dict[str, int]:
        while participant.parked < count:
            participant.parked_changed.clear()
            await participant.parked_changed.wait()
        return {"parked": participant.parked}

    @app.post("/slow")
    async def slow() -> dict[str, bool]:
        await release.wait()
        return {"released": True}

    @app.post("/release")
    async def do_release() -> dict[str, bool]:
        release.set()
        return {"released": True}

    install_control(app, plane, token)
    return app


def __getattr__(name: str) -> Any:
    """``app``: built on first use (by uvicorn, from the environment), so the module imports without it."""
    if name == "app":
        built = globals()["app"] = build_app()
        return built
    raise AttributeError(name)


# --- a server speaking only the reference stack's wire shapes


class ReferenceEpisodeId(BaseModel):
    """The reference's episode id: an object only. A capture-key string does not validate (FastAPI answers 422)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rollout_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    attempt: int = Field(default=0, ge=0)

    @property
    def key(self) -> str:
        return capture_key(self.rollout_id, self.attempt)


ReferenceCheckpointId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=NAME_PATTERN)]


class _ReferenceBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checkpoint_id: ReferenceCheckpointId
    deadline_ts: float


class _ReferenceCommit(_ReferenceBody):
    checkpoint_dir: str = Field(min_length=1)
    episode_ids: list[ReferenceEpisodeId] | None = None
    stop: bool = False


class _ReferenceRestore(_ReferenceBody):
    checkpoint_dir: str = Field(min_length=1)
    episode_ids: list[ReferenceEpisodeId]


class _ReferenceRetire(_ReferenceBody):
    episode_ids: list[ReferenceEpisodeId] = Field(min_length=1)


class _ReferenceForget(_ReferenceBody):
    rollout_ids: list[str] = Field(min_length=1)


class _Refused(Exception):
    def __init__(self, code: str, detail: str, status: int = 409) -> None:
        super().__init__(detail)
        self.code, self.detail, self.status = code, detail, status


@dataclass
class ReferenceState:
    """What a reference-shaped server holds, and every control request it received (``requests``)."""

    kind: str
    instance: str
    state: dict[str, Any] = field(default_factory=dict)
    restarts: set[str] = field(default_factory=set)
    #: episodes with a step in flight: a prepare answers ``preparing`` while any is left
    busy: set[str] = field(default_factory=set)
    fail_restore: bool = False
    phase: str = "idle"
    checkpoint_id: str | None = None
    committed: dict[str, Any] | None = None
    retired: set[str] = field(default_factory=set)
    resumed: list[str] = field(default_factory=list)
    #: (operation, body as received) for every control request, in arrival order
    requests: list[tuple[str, Any]] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        blockers = sorted(self.busy)
        return {
            "ready": not blockers,
            "blockers": blockers[:100],
            "blocker_count": len(blockers),
            "counts": {"live": len(self.state)},
            "restarts": sorted(self.restarts),
        }

    def admit(self, checkpoint_id: str, phases: tuple[str, ...]) -> None:
        if checkpoint_id in self.resumed:
            raise _Refused("stale_checkpoint", f"checkpoint {checkpoint_id!r} was resumed")
        if self.checkpoint_id not in (None, checkpoint_id):
            raise _Refused("checkpoint_conflict", f"checkpoint {self.checkpoint_id!r} is open")
        if self.phase not in phases:
            raise _Refused("invalid_phase", f"{self.phase}: not one of {phases}")


def build_reference_app(
    kind: str,
    instance: str,
    token: str,
    *,
    episodes: Iterable[str] = (),
    restarts: Iterable[str] = (),
    fail_restore: bool = False,
) -> FastAPI:
    """One participant that answers only in the reference's shapes (``app.state.reference``: its state).

    Bodies are the reference's models (``extra=forbid``, episode ids as objects only: a
    string gets FastAPI's bare 422 ``{"detail": [...]}``). Replies: commit
    ``{phase, manifest, episode_ids}`` (the model adds ``staging_keys``), resume
    ``{phase, idempotent}``, retire ``{"retired": [keys]}``, forget ``{"forgotten": [ids]}``,
    errors ``{"error": {"code", "detail"}}``. The checkpoint's files are written through
    gymckpt's store (their format is not what these tests look at); records hold
    ``{"episode_id": <key>, "state": ...}``.
    """
    held = ReferenceState(kind, instance, restarts=set(restarts), fail_restore=fail_restore)
    for key in episodes:
        held.state[key] = {"kind": kind, "key": key, "step": 1}
    app = FastAPI()
    app.state.reference = held
    expected = f"Bearer {token}"

    @app.middleware("http")
    async def authorize(request: Request, call_next: Any) -> Any:
        if request.url.path.startswith(CONTROL_PREFIX + "/"):
            if request.headers.get("authorization") != expected:
                return JSONResponse({"error": {"code": "unauthorized", "detail": "bad bearer token"}}, status_code=401)
            body = await request.body()
            held.requests.append((request.url.path.rsplit("/", 1)[-1], json.loads(body) if body else None))
        return await call_next(request)

    @app.exception_handler(_Refused)
    async def refused(_request: Request, exc: _Refused) -> JSONResponse:
        return JSONResponse({"error": {"code": exc.code, "detail": exc.detail}}, status_code=exc.status)

    @app.get(f"{CONTROL_PREFIX}/status")
    async def status() -> dict[str, Any]:
        return {
            "kind": held.kind,
            "instance": held.instance,
            "phase": held.phase,
            "checkpoint_id": held.checkpoint_id,
            "lease_expires_at": None,
            "retired_rollouts": len({split_capture_key(key)[0] for key in held.retired}),
            "report": held.report(),
        }

    @app.post(f"{CONTROL_PREFIX}/prepare")
    async def prepare(body: _ReferenceBody) -> dict[str, Any]:
        held.admit(body.checkpoint_id, ("idle", "preparing", "prepared"))
        held.checkpoint_id = body.checkpoint_id
        held.phase = "preparing" if held.busy else "prepared"
        return {"phase": held.phase, "report": held.report()}

    @app.post(f"{CONTROL_PREFIX}/renew")
    async def renew(body: _ReferenceBody) -> dict[str, Any]:
        if held.phase == "idle":
            raise _Refused("invalid_phase", "nothing is open")
        held.admit(body.checkpoint_id, (held.phase,))
        return {"lease_expires_at": body.deadline_ts + 600}

    @app.post(f"{CONTROL_PREFIX}/commit")
    async def commit(body: _ReferenceCommit) -> dict[str, Any]:
        held.admit(body.checkpoint_id, ("prepared", "committed"))
        if held.committed is not None:
            return held.committed
        scope = (
            sorted(held.state) if body.episode_ids is None else sorted({episode.key for episode in body.episode_ids})
        )
        if held.restarts.intersection(scope):
            raise _Refused("restart_in_scope", f"{sorted(held.restarts.intersection(scope))}")
        records = [{"episode_id": key, "state": held.state[key]} for key in scope if key in held.state]

        def write() -> Any:
            with open_store(body.checkpoint_dir) as store:
                return store.write_participant(
                    "", kind=held.kind, instance=held.instance, checkpoint_id=body.checkpoint_id, records=records
                )

        manifest = await asyncio.to_thread(write)
        reply: dict[str, Any] = {
            "phase": "committed",
            "manifest": json.loads(manifest.raw),
            "episode_ids": sorted(record["episode_id"] for record in records),
        }
        if held.kind == "model":
            reply["staging_keys"] = []
        held.committed = reply
        held.phase = "committed"
        return reply

    @app.post(f"{CONTROL_PREFIX}/restore")
    async def restore(body: _ReferenceRestore) -> dict[str, Any]:
        held.admit(body.checkpoint_id, ("idle",))
        if held.fail_restore:
            raise _Refused("checkpoint_error", f"{held.kind}/{held.instance}: injected restore failure")
        scope = {episode.key for episode in body.episode_ids}

        def read() -> tuple[str, list[dict[str, Any]]]:
            with open_store(body.checkpoint_dir) as store:
                manifest = store.read_manifest("", kind=held.kind, instance=held.instance)
                return manifest.checkpoint_id, list(store.read_records(manifest, scope=scope))

        source, records = await asyncio.to_thread(read)
        restored = []
        for record in records:
            rollout, attempt = split_capture_key(record["episode_id"])
            key = capture_key(rollout, attempt + 1)
            held.state[key] = record["state"]
            restored.append(key)
        held.phase, held.checkpoint_id = "restored", body.checkpoint_id
        return {"phase": "restored", "source_checkpoint_id": source, "restored": sorted(restored)}

    @app.post(f"{CONTROL_PREFIX}/resume")
    async def resume(body: _ReferenceBody) -> dict[str, Any]:
        if body.checkpoint_id in held.resumed:
            return {"phase": held.phase, "idempotent": True}
        if held.checkpoint_id is None:
            held.resumed.append(body.checkpoint_id)  # never seen: remembered, so a late prepare is stale
            return {"phase": "idle", "idempotent": True}
        held.admit(body.checkpoint_id, (held.phase,))
        held.resumed.append(body.checkpoint_id)
        held.phase, held.checkpoint_id, held.committed = "idle", None, None
        return {"phase": "idle", "idempotent": False}

    @app.post(f"{CONTROL_PREFIX}/retire")
    async def retire(body: _ReferenceRetire) -> dict[str, Any]:
        if held.phase not in ("idle", "restored"):
            raise _Refused("invalid_phase", "resume first")
        keys = sorted({episode.key for episode in body.episode_ids})
        held.retired.update(keys)
        for key in keys:
            held.state.pop(key, None)
        return {"retired": keys}

    @app.post(f"{CONTROL_PREFIX}/forget")
    async def forget(body: _ReferenceForget) -> dict[str, Any]:
        if held.phase not in ("idle", "restored"):
            raise _Refused("invalid_phase", "resume first")
        ids = sorted(set(body.rollout_ids))
        held.retired = {key for key in held.retired if split_capture_key(key)[0] not in ids}
        return {"forgotten": ids}

    return app


def build_non_participant_app() -> FastAPI:
    """A server without control routes (an auxiliary model, a relay): its status is FastAPI's 404."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    return app
