"""``checkpoint.exempt_paths``: paths any resources server serves without a rollout (no NeMo Gym needed)."""

from __future__ import annotations

from typing import Any

import pytest

from gymckpt.control.settings import load_settings
from gymckpt.errors import SettingsError
from gymckpt.stack import build_server
from tests.servers.resources_support import TOKEN, client, rp, run


def counter(**block: Any) -> Any:
    app, _ = build_server("counter", {"checkpoint": {"enabled": True, "control_auth_token": TOKEN, **block}})
    return app


def test_an_exempt_path_needs_no_rollout_and_others_still_do() -> None:
    async def main() -> None:
        async with client(counter(exempt_paths=["/increment"])) as http:
            exempt = await http.post("/increment", json={"n": 1}, headers={"x-session-id": "s"})
            assert exempt.status_code != 400, exempt.text  # not refused for lacking a rollout
        async with client(counter()) as http:
            fenced = await http.post("/increment", json={"n": 1})
            assert (fenced.status_code, fenced.json()["error"]["code"]) == (400, "rollout_id_required")
            prefixed = await http.post(rp("r1", "/increment"), json={"n": 1})
            assert prefixed.status_code == 200, prefixed.text

    run(main())


@pytest.mark.parametrize("path", ["increment", "/ng-control/v1/checkpoint/status", "/ng-rollout/r1/x"])
def test_an_exempt_path_must_be_a_plain_path(path: str) -> None:
    with pytest.raises(SettingsError, match="exempt_paths"):
        load_settings({"checkpoint": {"enabled": True, "control_auth_token": "t", "exempt_paths": [path]}})
