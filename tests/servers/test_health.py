"""``GET /health`` on every reference server, and requests that are not rollout work are never fenced."""

from __future__ import annotations

from typing import Any

import pytest

from gymckpt.participants.rollout import UNFENCED_PATHS, is_unfenced
from gymckpt.stack import KINDS, build_server

from .resources_support import AUTH, CONTROL, TOKEN, client, rp, run

#: the fields each kind needs besides the checkpoint block (URLs nobody calls here)
FIELDS: dict[str, dict[str, Any]] = {
    "inference": {},
    "model": {"inference_url": "http://127.0.0.1:9"},
    "agent": {"model_url": "http://127.0.0.1:9", "session_hooks": True},
    "counter": {},
    "weather": {},
    "sandbox": {},
    "environment": {"agent_url": "http://127.0.0.1:9", "resources_url": "http://127.0.0.1:9"},
}
#: work routes of each kind that refuse a request without a rollout while checkpointing is on
#: work that needs a rollout with checkpointing on (the policy model admits calls without one: P4)
WORK = {
    "agent": ("/v1/responses", {"input": "hi"}),
    "counter": ("/increment", {"n": 1}),
    "weather": ("/get_weather", {"city": "Oslo"}),
    "sandbox": ("/run_command", {"command": "ls"}),
}


def build(kind: str, *, enabled: bool) -> Any:
    block = {"enabled": True, "control_auth_token": TOKEN} if enabled else {}
    app, _ = build_server(kind, {**FIELDS[kind], **({"checkpoint": block} if kind != "inference" else {})})
    return app


def test_every_reference_server_kind_is_covered() -> None:
    assert set(FIELDS) == set(KINDS)


@pytest.mark.parametrize("enabled", [True, False], ids=["checkpointing-on", "checkpointing-off"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_health_answers_ok_without_a_rollout_prefix(kind: str, enabled: bool) -> None:
    async def main() -> None:
        app = build(kind, enabled=enabled)
        async with client(app) as http:
            response = await http.get("/health")
            assert response.status_code == 200, response.text
            assert response.json() == {"status": "ok"}
            if enabled and kind != "inference":
                # the same probe through a rollout prefix is fine too, and the server is a participant
                prefixed = await http.get(rp("r1", "/health"))
                assert (prefixed.status_code, prefixed.json()) == (200, {"status": "ok"})
                status = await http.get(f"{CONTROL}/status", headers=AUTH)
                assert status.status_code == 200, status.text

    run(main())


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_probes_and_api_docs_are_not_fenced_while_work_without_a_rollout_is(kind: str) -> None:
    async def main() -> None:
        app = build(kind, enabled=True)
        async with client(app) as http:
            for path in ("/health", "/openapi.json", "/docs", "/redoc"):
                response = await http.get(path)
                assert response.status_code == 200, (path, response.status_code, response.text[:200])
            if kind in WORK:
                path, body = WORK[kind]
                refused = await http.post(path, json=body)
                assert refused.status_code == 400, refused.text
                assert refused.json()["error"]["code"] == "rollout_id_required"

    run(main())


def test_a_resources_probe_is_not_counted_and_not_held_while_admission_is_closed() -> None:
    """A probe during a checkpoint answers at once: it is neither in flight nor waiting for resume."""

    async def main() -> None:
        app = build("counter", enabled=True)
        async with client(app) as http:
            prepared = await http.post(
                f"{CONTROL}/prepare", json={"checkpoint_id": "c1", "deadline_ts": 4e9}, headers=AUTH
            )
            assert prepared.status_code == 200, prepared.text
            assert app.state.participant.closed
            response = await http.get("/health")
            assert (response.status_code, response.json()) == (200, {"status": "ok"})
            counts = (await http.get(f"{CONTROL}/status", headers=AUTH)).json()["report"]["counts"]
            assert (counts["running"], counts["waiting"], counts["blocking"]) == (0, 0, 0)
            resumed = await http.post(
                f"{CONTROL}/resume", json={"checkpoint_id": "c1", "deadline_ts": 4e9}, headers=AUTH
            )
            assert resumed.status_code == 200, resumed.text

    run(main())


def test_one_unfenced_list_names_the_probes_and_the_docs() -> None:
    assert {"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"} <= UNFENCED_PATHS
    assert is_unfenced(CONTROL + "/status")
    assert is_unfenced("/health")
    assert not is_unfenced("/increment")
    assert not is_unfenced("/healthy")
