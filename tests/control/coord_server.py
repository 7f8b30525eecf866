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
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from fastapi import FastAPI, Request

from gymckpt.control.participant import Participant
from gymckpt.control.plane import ControlPlane
from gymckpt.control.routes import CONTROL_PREFIX, install_control
from gymckpt.errors import StorageError
from gymckpt.testing.participant import FakeParticipant


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

    async def export(self, scope: list[str]) -> list[dict[str, Any]]:
        self.log(f"export {','.join(scope)}")
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


app = build_app()
