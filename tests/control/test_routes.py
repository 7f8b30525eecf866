"""The control routes over HTTP (SPEC C1–C3): bearer auth, the schema, invalid requests, errors.

Driven with FastAPI's TestClient (one event loop per client, so the control plane's lease
task and events stay on one loop), one test over a real uvicorn server, and a fuzz of
more than a thousand requests generated from the app's own OpenAPI schema (schemathesis)
plus raw JSON bodies (Hypothesis): no request ever gets a 5xx.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from gymckpt import errors
from gymckpt.control.plane import ControlPlane
from gymckpt.control.routes import CONTROL_PREFIX, install_control, is_control_path
from gymckpt.store import open_store
from gymckpt.testing.participant import FakeParticipant

from ..support import error_code

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

#: (method, route, a valid request body or None)
ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "status", None),
    ("POST", "prepare", {"checkpoint_id": "c1", "deadline_ts": 4e9}),
    ("POST", "renew", {"checkpoint_id": "c1", "deadline_ts": 4e9}),
    ("POST", "commit", {"checkpoint_id": "c1", "deadline_ts": 4e9, "checkpoint_dir": "/tmp/x", "episode_ids": ["a"]}),
    ("POST", "restore", {"checkpoint_id": "c1", "deadline_ts": 4e9, "checkpoint_dir": "/tmp/x", "episode_ids": ["a"]}),
    ("POST", "resume", {"checkpoint_id": "c1", "deadline_ts": 4e9}),
    ("POST", "retire", {"checkpoint_id": "c1", "deadline_ts": 4e9, "episode_ids": ["a"]}),
    ("POST", "forget", {"checkpoint_id": "c1", "deadline_ts": 4e9, "rollout_ids": ["a"]}),
]
ROUTE_IDS = [route for _, route, _ in ROUTES]

#: route → (request model, reply model) names in the OpenAPI schema
MODELS = {
    "status": (None, "StatusReply"),
    "prepare": ("ControlRequest", "PrepareReply"),
    "renew": ("ControlRequest", "RenewReply"),
    "commit": ("CommitRequest", "CommitReply"),
    "restore": ("RestoreRequest", "RestoreReply"),
    "resume": ("ControlRequest", "ResumeReply"),
    "retire": ("RetireRequest", "RetireReply"),
    "forget": ("ForgetRequest", "ForgetReply"),
}


class OwnBody(BaseModel):
    count: int


def make_app(plane: ControlPlane, *, own_handler: bool = False) -> FastAPI:
    """An app with a route of its own and the control routes."""
    app = FastAPI()

    if own_handler:

        async def custom(request: Request, exc: Exception) -> JSONResponse:
            return JSONResponse({"custom": True}, status_code=400)

        app.add_exception_handler(RequestValidationError, custom)

    @app.post("/own")
    async def own(body: OwnBody) -> dict[str, int]:
        return {"count": body.count}

    @app.get("/own/raises/{name}")
    async def raises(name: str) -> None:
        raise getattr(errors, name)("raised by the app's own route")

    install_control(app, plane, TOKEN)
    return app


@pytest.fixture
def plane(fake: FakeParticipant, tmp_path: Path) -> ControlPlane:
    (tmp_path / "allowed").mkdir()
    return ControlPlane(fake, allowed_roots=[str(tmp_path / "allowed")])


@pytest.fixture
def client(plane: ControlPlane) -> Any:
    with TestClient(make_app(plane), raise_server_exceptions=False) as client:
        yield client


def call(client: TestClient, method: str, route: str, body: Any = None, **kwargs: Any) -> httpx.Response:
    url = f"{CONTROL_PREFIX}/{route}"
    if method == "GET":
        return client.get(url, **kwargs)
    if body is not None and "content" not in kwargs:
        kwargs["json"] = body
    return client.post(url, **kwargs)


# --- authorization (C1)

BAD_AUTH = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Bearer {TOKEN}x"},
    {"Authorization": f"Bearer {TOKEN[:-1]}"},
    {"Authorization": "Bearer "},
    {"Authorization": TOKEN},
    {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": ""},
]


@pytest.mark.parametrize("headers", BAD_AUTH, ids=lambda headers: repr(headers.get("Authorization")))
@pytest.mark.parametrize(("method", "route", "body"), ROUTES, ids=ROUTE_IDS)
def test_every_route_refuses_a_missing_or_wrong_token(client, fake, method, route, body, headers):
    response = call(client, method, route, body, headers=headers)
    assert response.status_code == 401, response.text
    assert error_code(response) == "unauthorized"
    assert response.headers.get("www-authenticate", "").lower().startswith("bearer")
    assert TOKEN not in response.text
    assert fake.calls == []


@pytest.mark.parametrize(
    "body",
    [b"{", b"not json", b"\x80", b"[]", b'{"checkpoint_id": 5}', b'{"unknown": 1}', b""],
    ids=["truncated", "not-json", "not-utf8", "array", "wrong-type", "unknown-field", "empty"],
)
@pytest.mark.parametrize(("method", "route", "_"), [r for r in ROUTES if r[0] == "POST"], ids=ROUTE_IDS[1:])
def test_an_unauthenticated_invalid_body_is_still_401(client, fake, method, route, _, body):
    response = call(client, method, route, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 401, response.text
    assert error_code(response) == "unauthorized"
    assert fake.calls == []


@pytest.mark.parametrize(("method", "route", "body"), ROUTES, ids=ROUTE_IDS)
def test_a_credentials_query_parameter_is_no_way_in(client, method, route, body):
    response = call(client, method, route, body, params={"credentials": TOKEN})
    assert response.status_code == 401, response.text
    assert error_code(response) == "unauthorized"


@pytest.mark.parametrize(
    ("path", "control"),
    [
        (f"{CONTROL_PREFIX}/commit", True),
        (CONTROL_PREFIX, True),
        (f"/ng-rollout/r1{CONTROL_PREFIX}/commit", True),
        (f"/ng-rollout/not a key!{CONTROL_PREFIX}/commit", True),  # refused either way, never read
        (f"{CONTROL_PREFIX}x/commit", False),
        ("/ng-rollout/r1/v1/responses", False),
        (f"/own{CONTROL_PREFIX}/commit", False),
        (f"/ng-rollout/r1/ng-rollout/r2{CONTROL_PREFIX}/commit", False),  # the prefix middleware's 400
    ],
)
def test_control_paths_are_known_behind_a_rollout_prefix(path, control):
    assert is_control_path(path) is control


def test_the_token_opens_every_route(client, fake, tmp_path):
    fake.start("a", {"step": 1})
    checkpoint = str(tmp_path / "allowed" / "ck")
    deadline = time.time() + 60

    status = call(client, "GET", "status", headers=AUTH)
    assert status.status_code == 200, status.text
    assert status.json()["phase"] == "idle"

    prepare = call(client, "POST", "prepare", {"checkpoint_id": "c1", "deadline_ts": deadline}, headers=AUTH)
    assert prepare.status_code == 200, prepare.text
    assert prepare.json()["phase"] == "prepared"
    assert prepare.json()["report"]["ready"] is True

    renew = call(client, "POST", "renew", {"checkpoint_id": "c1", "deadline_ts": deadline + 5}, headers=AUTH)
    assert renew.status_code == 200, renew.text
    assert renew.json()["lease_expires_at"] == pytest.approx(deadline + 5 + 600)

    body = {"checkpoint_id": "c1", "deadline_ts": deadline, "checkpoint_dir": checkpoint, "episode_ids": ["a"]}
    commit = call(client, "POST", "commit", body, headers=AUTH)
    assert commit.status_code == 200, commit.text
    reply = commit.json()
    assert reply["phase"] == "committed"
    assert reply["episode_ids"] == ["a"]
    assert reply["record_count"] == 1
    with open_store(checkpoint) as store:
        assert store.read_manifest("", kind="environment", instance="env-0").sha256 == reply["manifest_sha256"]

    assert call(client, "GET", "status", headers=AUTH).json()["phase"] == "committed"
    resume = call(client, "POST", "resume", {"checkpoint_id": "c1", "deadline_ts": deadline}, headers=AUTH)
    assert resume.status_code == 200, resume.text
    assert resume.json() == {"phase": "idle", "idempotent": False, "checkpoint_id": "c1"}

    retire = call(
        client, "POST", "retire", {"checkpoint_id": "r", "deadline_ts": deadline, "episode_ids": ["a"]}, headers=AUTH
    )
    assert retire.status_code == 200, retire.text
    assert retire.json() == {"retired_count": 1, "retired": ["a"]}
    forget = call(
        client, "POST", "forget", {"checkpoint_id": "f", "deadline_ts": deadline, "rollout_ids": ["a"]}, headers=AUTH
    )
    assert forget.status_code == 200, forget.text
    assert forget.json() == {"forgotten_count": 1, "forgotten": ["a"]}

    # a late call naming the resumed checkpoint
    stale = call(client, "POST", "prepare", {"checkpoint_id": "c1", "deadline_ts": deadline}, headers=AUTH)
    assert stale.status_code == 409
    assert error_code(stale) == "stale_checkpoint"


def test_restore_over_http(fake, tmp_path):
    source = tmp_path / "allowed" / "source"
    with open_store(str(source)) as store:
        store.write_participant(
            "", kind="environment", instance="env-0", checkpoint_id="c0", records=[{"episode_id": "r", "state": {}}]
        )
    plane = ControlPlane(fake, allowed_roots=[str(tmp_path / "allowed")])
    with TestClient(make_app(plane), raise_server_exceptions=False) as client:
        body = {
            "checkpoint_id": "c0",
            "deadline_ts": time.time() + 60,
            "checkpoint_dir": str(source),
            "episode_ids": ["r"],
        }
        response = call(client, "POST", "restore", body, headers=AUTH)
        assert response.status_code == 200, response.text
        assert response.json() == {"phase": "restored", "source_checkpoint_id": "c0", "restored": ["r-a1"]}
        assert call(client, "GET", "status", headers=AUTH).json()["retired_rollouts"] == 1


# --- the schema (C2)


def test_the_routes_and_their_models_are_in_the_openapi_schema(plane):
    schema = make_app(plane).openapi()
    components = schema["components"]["schemas"]
    assert "HTTPBearer" in schema["components"]["securitySchemes"]
    for method, route, _ in ROUTES:
        operation = schema["paths"][f"{CONTROL_PREFIX}/{route}"][method.lower()]
        request_model, reply_model = MODELS[route]
        if request_model is None:
            assert "requestBody" not in operation
        else:
            body = operation["requestBody"]
            assert body["required"] is True
            assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{request_model}"}
        ok = operation["responses"]["200"]["content"]["application/json"]["schema"]
        assert ok == {"$ref": f"#/components/schemas/{reply_model}"}
        for status in ("401", "409", "422"):
            error = operation["responses"][status]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/ErrorBody"}
        assert {"HTTPBearer": []} in operation["security"]
        # the token travels in the Authorization header only, never as a parameter
        assert not operation.get("parameters"), operation.get("parameters")

    for name in ("ControlRequest", "CommitRequest", "RestoreRequest", "RetireRequest", "ForgetRequest"):
        model = components[name]
        assert model["additionalProperties"] is False, name
        assert {"checkpoint_id", "deadline_ts"} <= set(model["required"])
        checkpoint_id = model["properties"]["checkpoint_id"]
        assert checkpoint_id["pattern"] == "^[A-Za-z0-9][A-Za-z0-9._-]*$"
        assert (checkpoint_id["minLength"], checkpoint_id["maxLength"]) == (1, 128)
    assert {"checkpoint_dir"} <= set(components["CommitRequest"]["required"])
    assert not {"episode_ids", "stop"} & set(components["CommitRequest"]["required"])  # optional, as in the reference
    assert {"checkpoint_dir", "episode_ids"} <= set(components["RestoreRequest"]["required"])
    assert components["RetireRequest"]["properties"]["episode_ids"]["minItems"] == 1
    assert components["ForgetRequest"]["properties"]["rollout_ids"]["minItems"] == 1
    for name in ("StatusReply", "PrepareReply", "CommitReply", "RestoreReply", "ErrorBody"):
        assert name in components
    assert set(components["StatusReply"]["required"]) >= {
        "kind",
        "instance",
        "phase",
        "checkpoint_id",
        "lease_expires_at",
        "retired_rollouts",
        "report",
    }


# --- invalid requests (C2): 4xx with the error body, never 5xx

VALID = {"checkpoint_id": "c1", "deadline_ts": 4e9}
VALID_COMMIT = {**VALID, "checkpoint_dir": "/tmp/x", "episode_ids": ["a"]}

INVALID: list[tuple[str, Any]] = [
    ("prepare", {**VALID, "unknown": 1}),
    ("commit", {**VALID_COMMIT, "storage_options": {"key": "x"}}),
    ("prepare", {"deadline_ts": 4e9}),
    ("prepare", {"checkpoint_id": "c1"}),
    ("prepare", {}),
    ("prepare", {**VALID, "checkpoint_id": ""}),
    ("prepare", {**VALID, "checkpoint_id": "-leading-dash"}),
    ("prepare", {**VALID, "checkpoint_id": ".hidden"}),
    ("prepare", {**VALID, "checkpoint_id": "a b"}),
    ("prepare", {**VALID, "checkpoint_id": "a/b"}),
    ("prepare", {**VALID, "checkpoint_id": "../up"}),
    ("prepare", {**VALID, "checkpoint_id": "ünïcode"}),
    ("prepare", {**VALID, "checkpoint_id": "c1\n"}),
    ("prepare", {**VALID, "checkpoint_id": "x" * 129}),
    ("prepare", {**VALID, "checkpoint_id": 5}),
    ("prepare", {**VALID, "checkpoint_id": None}),
    ("prepare", {**VALID, "checkpoint_id": ["c1"]}),
    ("prepare", {**VALID, "deadline_ts": "soon"}),
    ("prepare", {**VALID, "deadline_ts": "4000000000"}),
    ("prepare", {**VALID, "deadline_ts": True}),
    ("prepare", {**VALID, "deadline_ts": None}),
    ("prepare", {**VALID, "deadline_ts": [1]}),
    ("retire", {**VALID, "episode_ids": []}),
    ("retire", {**VALID}),
    ("retire", {**VALID, "episode_ids": "a"}),
    ("retire", {**VALID, "episode_ids": [1]}),
    ("retire", {**VALID, "episode_ids": [""]}),
    ("retire", {**VALID, "episode_ids": ["a/b"]}),
    ("retire", {**VALID, "episode_ids": ["a b"]}),
    ("retire", {**VALID, "rollout_ids": ["a"]}),
    ("retire", {**VALID, "episode_ids": [{"rollout_id": "r", "attempt": -1}]}),
    ("retire", {**VALID, "episode_ids": [{"rollout_id": "r", "attempt": "1"}]}),
    ("retire", {**VALID, "episode_ids": [{"rollout_id": "r", "attempt": True}]}),
    ("retire", {**VALID, "episode_ids": [{"rollout_id": "r", "attempt": 1.5}]}),
    ("retire", {**VALID, "episode_ids": [{"rollout_id": "r", "attempt": 0, "session": "s"}]}),
    ("retire", {**VALID, "episode_ids": [{"attempt": 1}]}),
    ("retire", {**VALID, "episode_ids": [{"rollout_id": "r-a1", "attempt": 0}]}),
    ("retire", {**VALID, "episode_ids": [{"rollout_id": "a b"}]}),
    ("forget", {**VALID, "rollout_ids": []}),
    ("forget", {**VALID, "rollout_ids": [None]}),
    ("forget", {**VALID, "episode_ids": ["a"]}),
    ("commit", {**VALID_COMMIT, "checkpoint_dir": ""}),
    ("commit", {**VALID_COMMIT, "checkpoint_dir": "a\x00b"}),
    ("commit", {**VALID_COMMIT, "checkpoint_dir": 7}),
    ("commit", {**VALID_COMMIT, "stop": "yes"}),
    ("commit", {**VALID_COMMIT, "stop": None}),
    ("commit", {**VALID_COMMIT, "episode_ids": {"a": 1}}),
    ("commit", {k: v for k, v in VALID_COMMIT.items() if k != "checkpoint_dir"}),
    ("restore", {k: v for k, v in VALID_COMMIT.items() if k != "episode_ids"}),
    ("restore", {**VALID_COMMIT, "extra": True}),
    ("resume", {**VALID, "episode_ids": ["a"]}),
    ("renew", []),
    ("renew", "c1"),
    ("renew", 42),
    ("renew", None),
]


@pytest.mark.parametrize(
    ("route", "body"), INVALID, ids=[f"{route}-{index}" for index, (route, _) in enumerate(INVALID)]
)
def test_an_invalid_request_is_a_4xx_with_the_error_body(client, fake, route, body):
    response = call(
        client, "POST", route, content=json.dumps(body).encode(), headers={**AUTH, "Content-Type": "application/json"}
    )
    assert 400 <= response.status_code < 500, response.text
    assert error_code(response) == "invalid_request"
    assert fake.calls == []


@pytest.mark.parametrize(
    "raw",
    [
        b'{"checkpoint_id": "c1", "deadline_ts": NaN}',
        b'{"checkpoint_id": "c1", "deadline_ts": Infinity}',
        b'{"checkpoint_id": "c1", "deadline_ts": -Infinity}',
        b'{"checkpoint_id": "c1", "deadline_ts": 1e400}',
        b'{"checkpoint_id": "c1", "deadline_ts": 4e9',
        b'{"checkpoint_id": "c1", "deadline_ts": 4e9, "checkpoint_id": "c1", ',
        b"\xff\xfe",
        b"\x80",
        b'{"checkpoint_id": "c\xe9", "deadline_ts": 4e9}',
        b"",
    ],
    ids=["nan", "inf", "-inf", "overflow", "truncated", "dangling", "bom", "not-utf8", "latin1-id", "empty"],
)
@pytest.mark.parametrize("route", ["prepare", "resume", "renew"])
def test_a_body_that_is_not_a_valid_request_is_a_4xx(client, fake, route, raw):
    response = call(client, "POST", route, content=raw, headers={**AUTH, "Content-Type": "application/json"})
    assert 400 <= response.status_code < 500, response.text
    assert error_code(response) == "invalid_request"
    assert fake.calls == []


def test_a_body_sent_as_text_is_a_4xx(client, fake):
    response = call(
        client, "POST", "prepare", content=json.dumps(VALID).encode(), headers={**AUTH, "Content-Type": "text/plain"}
    )
    assert 400 <= response.status_code < 500
    assert error_code(response) == "invalid_request"
    assert fake.calls == []


def test_the_longest_valid_checkpoint_id_is_accepted(client):
    response = call(
        client,
        "POST",
        "prepare",
        {"checkpoint_id": "A" + "b._-9" * 25 + "xy", "deadline_ts": time.time() + 60},
        headers=AUTH,
    )
    assert response.status_code == 200, response.text


def test_replies_never_echo_the_token(client):
    for response in (
        call(client, "POST", "prepare", {**VALID, "unknown": 1}, headers=AUTH),
        call(client, "POST", "prepare", {**VALID, "unknown": 1}, headers={"Authorization": f"Bearer {TOKEN}-no"}),
        call(client, "GET", "status", headers=AUTH),
    ):
        assert TOKEN not in response.text
        assert TOKEN not in str(response.headers)


@pytest.mark.parametrize(
    "checkpoint_dir",
    ["zip://x", "tar://x", "dir://x", "ftp://127.0.0.1:1/x", "nosuchprotocol://x", "s3://", "/dev/null", "x" * 4000],
)
def test_restore_from_any_checkpoint_dir_is_never_a_5xx(fake, checkpoint_dir):
    """Without allowed_roots every directory is the request's to choose: a bad one is a 4xx."""
    plane = ControlPlane(fake)
    with TestClient(make_app(plane), raise_server_exceptions=False) as client:
        body = {
            "checkpoint_id": "c0",
            "deadline_ts": time.time() + 30,
            "checkpoint_dir": checkpoint_dir,
            "episode_ids": ["a"],
        }
        response = call(client, "POST", "restore", body, headers=AUTH)
        assert 400 <= response.status_code < 500, response.text
        error_code(response)
        assert fake.admission_open


def test_a_checkpoint_dir_outside_the_allowed_roots_is_403_naming_the_setting(client, fake):
    for checkpoint_dir in ("/etc", "s3://bucket/x", "/tmp/../etc"):
        body = {
            **VALID_COMMIT,
            "checkpoint_id": "c0",
            "deadline_ts": time.time() + 30,
            "checkpoint_dir": checkpoint_dir,
        }
        response = call(client, "POST", "restore", body, headers=AUTH)
        assert response.status_code == 403, response.text
        assert error_code(response) == "checkpoint_dir_not_allowed"
        assert "allowed_roots" in response.json()["error"]["detail"]


# --- the error handler (C3)

WIRE = {
    errors.StaleCheckpoint: ("stale_checkpoint", 409),
    errors.CheckpointConflict: ("checkpoint_conflict", 409),
    errors.ManifestConflict: ("checkpoint_conflict", 409),
    errors.InvalidPhase: ("invalid_phase", 409),
    errors.DeadlineExceeded: ("deadline_exceeded", 409),
    errors.StaleAttempt: ("stale_attempt", 409),
    errors.RestartInScope: ("restart_in_scope", 409),
    errors.ExportFailed: ("export_failed", 409),
    errors.CheckpointParked: ("checkpoint_parked", 409),
    errors.RetireIncomplete: ("retire_incomplete", 409),
    errors.GenerationCutMismatch: ("generation_cut_mismatch", 409),
    errors.CoordinatorUnavailable: ("checkpoint_coordinator_unavailable", 503),
    errors.RolloutIdRequired: ("rollout_id_required", 400),
    errors.InvalidRolloutId: ("invalid_rollout_id", 400),
    errors.RolloutAttemptConflict: ("invalid_rollout_id", 400),
    errors.CheckpointDirNotAllowed: ("checkpoint_dir_not_allowed", 403),
    errors.SessionBusy: ("session_busy", 409),
    errors.SessionRolloutMismatch: ("session_rollout_mismatch", 409),
    errors.SessionsNotExported: ("export_failed", 409),
    errors.Unauthorized: ("unauthorized", 401),
}
OTHER = {
    errors.StorageError: ("storage_error", 503),
    errors.UnsupportedStorage: ("unsupported_storage", 400),
    errors.WriteStopped: ("write_stopped", 409),
    errors.InvalidPayload: ("invalid_payload", 422),
    errors.NotJSONError: ("invalid_payload", 422),
    errors.InvalidRecord: ("invalid_payload", 422),
}


def _subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


STATE_ERRORS = [errors.InvalidCheckpointState, *_subclasses(errors.InvalidCheckpointState)]


def test_every_control_error_has_a_wire_mapping_here():
    assert set(_subclasses(errors.ControlError)) == set(WIRE)


def _raise(cls: type) -> Any:
    if cls is errors.StorageError or cls is errors.UnsupportedStorage:
        return cls("the storage said no", path="p")
    if cls is errors.ManifestConflict:
        return cls("the detail of this error", path="p")
    return cls("the detail of this error")


@pytest.mark.parametrize(
    ("cls", "expected"),
    [*WIRE.items(), *((cls, ("invalid_checkpoint_state", 422)) for cls in STATE_ERRORS), *OTHER.items()],
    ids=lambda value: value.__name__ if isinstance(value, type) else "",
)
@pytest.mark.parametrize("route", ["status", "prepare", "commit"])
def test_every_gymckpt_error_maps_to_its_wire_code_and_status(client, plane, monkeypatch, cls, expected, route):
    async def failing(*args: Any) -> Any:
        raise _raise(cls)

    def failing_status() -> Any:
        raise _raise(cls)

    monkeypatch.setattr(plane, route, failing_status if route == "status" else failing)
    method, _, body = next(entry for entry in ROUTES if entry[1] == route)
    response = call(client, method, route, body, headers=AUTH)
    code, status = expected
    assert response.status_code == status, response.text
    assert error_code(response) == code
    assert "the " in response.json()["error"]["detail"]


def test_the_handler_covers_the_apps_own_routes_too(client):
    response = client.get("/own/raises/ExportFailed")
    assert response.status_code == 409
    assert error_code(response) == "export_failed"


def test_the_apps_own_routes_keep_fastapis_validation_format(client):
    response = client.post("/own", json={"count": "many"})
    assert response.status_code == 422
    body = response.json()
    assert set(body) == {"detail"}
    assert isinstance(body["detail"], list)
    assert body["detail"][0]["loc"] == ["body", "count"]
    ok = client.post("/own", json={"count": 3})
    assert ok.status_code == 200
    assert ok.json() == {"count": 3}


def test_the_apps_own_validation_handler_is_kept_for_its_routes(plane):
    with TestClient(make_app(plane, own_handler=True), raise_server_exceptions=False) as client:
        own = client.post("/own", json={"count": "many"})
        assert own.status_code == 400
        assert own.json() == {"custom": True}
        control = call(client, "POST", "prepare", {"checkpoint_id": ""}, headers=AUTH)
        assert control.status_code == 422
        assert error_code(control) == "invalid_request"


# --- a real server


def test_the_routes_over_a_real_uvicorn_server(fake, plane, tmp_path):
    import uvicorn

    fake.start("a")
    config = uvicorn.Config(make_app(plane), host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(500):
            if server.started:
                break
            thread.join(0.01)
        assert server.started
        port = server.servers[0].sockets[0].getsockname()[1]
        with httpx.Client(base_url=f"http://127.0.0.1:{port}{CONTROL_PREFIX}", timeout=10) as http:
            assert http.get("/status").status_code == 401
            assert http.get("/status", headers=AUTH).json()["phase"] == "idle"
            deadline = time.time() + 30
            assert (
                http.post("/prepare", json={"checkpoint_id": "c1", "deadline_ts": deadline}, headers=AUTH).json()[
                    "phase"
                ]
                == "prepared"
            )
            body = {
                "checkpoint_id": "c1",
                "deadline_ts": deadline,
                "checkpoint_dir": str(tmp_path / "allowed" / "ck"),
                "episode_ids": ["a"],
            }
            commit = http.post("/commit", json=body, headers=AUTH)
            assert commit.status_code == 200, commit.text
            assert commit.json()["episode_ids"] == ["a"]
            assert (
                http.post("/resume", json={"checkpoint_id": "c1", "deadline_ts": deadline}, headers=AUTH).json()[
                    "phase"
                ]
                == "idle"
            )
            bad = http.post(
                "/prepare",
                content=b'{"checkpoint_id": "c1", "deadline_ts": NaN}',
                headers={**AUTH, "Content-Type": "application/json"},
            )
            assert bad.status_code == 422
            assert error_code(bad) == "invalid_request"
    finally:
        server.should_exit = True
        thread.join(10)
    assert not thread.is_alive()


# --- fuzz: no request is ever a 5xx

AUTH_VARIANTS = {
    "token": AUTH,
    "none": {},
    "wrong": {"Authorization": "Bearer not-the-token"},
}


def test_fuzz_requests_from_the_openapi_schema_never_get_a_5xx(fake, plane):
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis import GenerationMode

    for number in range(5):
        fake.start(f"e{number}")
    app = make_app(plane)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app).include(path_regex=f"^{CONTROL_PREFIX}/")
    cases = st.one_of(
        schema.as_strategy(generation_mode=GenerationMode.POSITIVE),
        schema.as_strategy(generation_mode=GenerationMode.NEGATIVE),
    )
    seen: dict[str, int] = {}

    @settings(
        max_examples=1200,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases, auth=st.sampled_from(["token", "none", "wrong"]))
    def fuzz(case: Any, auth: str) -> None:
        if case.headers:
            for name in [name for name in case.headers if name.lower() == "authorization"]:
                del case.headers[name]
        response = case.call(headers=AUTH_VARIANTS[auth])
        # negative cases may drop or mangle the header after it was set: judge by what was sent
        authorized = response.request.headers.get("Authorization") == AUTH["Authorization"]
        key = f"{'token' if authorized else 'other'}:{response.status_code}"
        seen[key] = seen.get(key, 0) + 1
        where = (case.method, case.path, case.headers, case.body, response.text)
        assert response.status_code < 500, where
        if response.status_code >= 400:
            assert set(response.json()) == {"error"}, where
        unparsable = "JSON decode error" in response.text or "error parsing the body" in response.text
        if not authorized and not unparsable:
            # (a body that is not JSON at all is test_an_unauthenticated_invalid_body_is_still_401's)
            assert response.status_code == 401, where

    fuzz()
    assert sum(seen.values()) >= 1000
    # the fuzz reached past the token check and the body checks: some authorized calls succeeded (how many
    # depends on the lease timing between examples, so only a floor)
    assert sum(count for key, count in seen.items() if key.startswith("token:2")) >= 20, seen


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
FIELDS = ["checkpoint_id", "deadline_ts", "checkpoint_dir", "episode_ids", "rollout_ids", "extra"]
FIELD_VALUES = st.one_of(
    JSON_VALUES,
    st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,130}\Z"),
    st.floats(min_value=-1e10, max_value=1e12),
    st.lists(st.from_regex(r"\A[a-z]{1,3}(-a[0-9]{1,2})?\Z"), max_size=4),
    st.sampled_from(["/tmp", "s3://b/x", "zip://x", "", "..", "memory://m"]),
)


def test_fuzz_raw_json_bodies_never_get_a_5xx(fake, plane):
    for number in range(5):
        fake.start(f"e{number}")
    bodies = st.one_of(
        st.dictionaries(st.sampled_from(FIELDS), FIELD_VALUES, max_size=6),
        JSON_VALUES,
    )
    with TestClient(make_app(plane), raise_server_exceptions=False) as client:

        @settings(
            max_examples=400, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
        )
        @given(
            route=st.sampled_from([route for method, route, _ in ROUTES if method == "POST"]),
            body=bodies,
            auth=st.sampled_from(sorted(AUTH_VARIANTS)),
        )
        def fuzz(route: str, body: Any, auth: str) -> None:
            raw = json.dumps(body, allow_nan=True).encode()
            response = call(
                client, "POST", route, content=raw, headers={**AUTH_VARIANTS[auth], "Content-Type": "application/json"}
            )
            assert response.status_code < 500, (route, body, response.text)
            if response.status_code >= 400:
                error_code(response)
            if auth != "token":
                assert response.status_code == 401, (route, body, response.text)

        fuzz()


def test_fuzz_sequences_of_valid_calls_never_get_a_5xx(fake, tmp_path):
    """Random but valid call sequences, with directories inside the allowed root: the plane's own refusals only."""
    allowed = tmp_path / "allowed"
    allowed.mkdir(exist_ok=True)
    ids = st.sampled_from(["c1", "c2", "c3"])
    scopes = st.lists(st.sampled_from(["a", "b", "a-a1", "x"]), max_size=3)
    dirs = st.sampled_from([str(allowed / "one"), str(allowed / "two"), str(tmp_path / "outside")])
    steps = st.lists(
        st.one_of(
            st.tuples(st.sampled_from(["prepare", "renew", "resume"]), st.fixed_dictionaries({"checkpoint_id": ids})),
            st.tuples(
                st.sampled_from(["commit", "restore"]),
                st.fixed_dictionaries({"checkpoint_id": ids, "checkpoint_dir": dirs, "episode_ids": scopes}),
            ),
            st.tuples(
                st.just("retire"), st.fixed_dictionaries({"checkpoint_id": ids, "episode_ids": scopes.filter(bool)})
            ),
            st.tuples(
                st.just("forget"), st.fixed_dictionaries({"checkpoint_id": ids, "rollout_ids": scopes.filter(bool)})
            ),
        ),
        max_size=12,
    )

    @settings(max_examples=60, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(steps=steps)
    def fuzz(steps: list[tuple[str, dict[str, Any]]]) -> None:
        participant = FakeParticipant()
        for key in ("a", "b", "x"):
            participant.start(key)
        participant.restart_keys.add("x")
        plane = ControlPlane(participant, allowed_roots=[str(allowed)])
        with TestClient(make_app(plane), raise_server_exceptions=False) as client:
            for route, body in steps:
                response = call(client, "POST", route, {**body, "deadline_ts": time.time() + 10}, headers=AUTH)
                assert response.status_code < 500, (route, body, response.text)
                if response.status_code >= 400:
                    error_code(response)
            status = call(client, "GET", "status", headers=AUTH)
            assert status.status_code == 200

    fuzz()


def test_deadlines_far_in_the_future_or_past_are_fine(client, fake):
    for deadline in (1.0, 1e-300, 1.7976931348623157e308, 4e9):
        response = call(client, "POST", "resume", {"checkpoint_id": "c9", "deadline_ts": deadline}, headers=AUTH)
        assert response.status_code == 200, response.text
    assert fake.calls == []  # nothing was open: each resume was a no-op


@pytest.mark.parametrize("route", ["commit", "restore"])
@pytest.mark.parametrize(
    ("checkpoint_dir", "storage_options"),
    [
        ("s3://bucket/x::memory://y", {}),  # a chained fsspec URL
        ("s3://bucket/run/ckpt", {"no_such_option": "1", "endpoint_url": "http://127.0.0.1:9"}),
        ("s3://bucket/run/ckpt", {"block_size": "not-a-number", "endpoint_url": "http://127.0.0.1:9"}),
        ("/tmp/somewhere", {"endpoint_url": "http://127.0.0.1:9"}),  # options a local store would ignore
    ],
)
def test_bad_storage_urls_and_options_are_a_4xx_with_the_error_body(fake, route, checkpoint_dir, storage_options):
    """Seen: 500 for an unknown storage option and for a chained URL (they failed at the first request)."""
    plane = ControlPlane(fake, storage_options=storage_options)
    with TestClient(make_app(plane), raise_server_exceptions=False) as client:
        if route == "commit":
            prepared = call(
                client, "POST", "prepare", {"checkpoint_id": "c0", "deadline_ts": time.time() + 30}, headers=AUTH
            )
            assert prepared.status_code == 200, prepared.text
        body = {
            "checkpoint_id": "c0",
            "deadline_ts": time.time() + 30,
            "checkpoint_dir": checkpoint_dir,
            "episode_ids": [],
        }
        response = call(client, "POST", route, body, headers=AUTH)
        assert response.status_code == 400, response.text
        assert error_code(response) == "unsupported_storage"


@pytest.mark.parametrize("special", ["fifo", "symlink-outside", "dev-zero"])
def test_a_restore_from_a_special_records_file_is_a_prompt_422(fake, tmp_path, special):
    """Seen: a FIFO named as the records file hung restore forever; /dev/zero read until MemoryError."""
    import os

    root = tmp_path / "allowed" / "ck"
    store = open_store(str(root))
    manifest = store.write_participant(
        "", kind=fake.kind, instance=fake.instance, checkpoint_id="c-old", records=[{"episode_id": "a", "v": 1}]
    )
    records = root / manifest.records_path
    outside = tmp_path / "outside-copy"
    outside.write_bytes(records.read_bytes())
    records.unlink()
    if special == "fifo":
        os.mkfifo(records)
    else:
        records.symlink_to(outside if special == "symlink-outside" else "/dev/zero")
    plane = ControlPlane(fake, allowed_roots=[str(tmp_path / "allowed")])
    with TestClient(make_app(plane), raise_server_exceptions=False) as client:
        body = {
            "checkpoint_id": "r-1",
            "deadline_ts": time.time() + 30,
            "checkpoint_dir": str(root),
            "episode_ids": ["a"],
        }
        response = call(client, "POST", "restore", body, headers=AUTH)
        assert response.status_code == 422, response.text
        assert error_code(response) == "invalid_checkpoint_state"
        assert "not a regular file" in response.json()["error"]["detail"]
        assert fake.admission_open  # a failed restore reopens admission
