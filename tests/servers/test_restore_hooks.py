"""A restore whose records a participant's hook cannot use is a 422 naming the episode, never a 500.

Records are crafted, digest-valid (written through the store API, as a commit writes them),
and restored through the HTTP control route of the real reference server apps.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymckpt.participants.resources import CheckpointedResources, CheckpointMode, ResourcesParticipant
from gymckpt.servers.agent import AgentConfig, build_agent_app
from gymckpt.servers.base import ServerConfig, build_app
from gymckpt.servers.counter import CounterConfig, build_counter_app
from gymckpt.servers.environment import EnvironmentConfig, build_environment_app
from gymckpt.servers.weather import WeatherConfig, build_weather_app
from gymckpt.store import open_store

from .resources_support import AUTH, CONTROL, Control, bounded, client, config, run

if TYPE_CHECKING:
    from pathlib import Path

    from fastapi import FastAPI

NOWHERE = "http://127.0.0.1:9"


def write(directory: Path | str, kind: str, instance: str, records: list[dict[str, Any]]) -> str:
    """A committed participant checkpoint holding ``records`` (checkpoint id c0)."""
    with open_store(str(directory)) as store:
        store.write_participant("", kind=kind, instance=instance, checkpoint_id="c0", records=records)
    return str(directory)


async def restore(http: Any, directory: str, scope: list[str], checkpoint_id: str = "restore-1") -> Any:
    return await Control(http).call("restore", checkpoint_id, 30, checkpoint_dir=directory, episode_ids=scope)


async def control(http: Any, name: str, checkpoint_id: str) -> Any:
    return await Control(http).call(name, checkpoint_id, 30)


def counter_app() -> FastAPI:
    return build_counter_app(config(CounterConfig))


@pytest.mark.parametrize(
    "state",
    [{"calls": 2}, {"count": "x", "calls": 1}, {"count": 3}, {"count": None, "calls": 1}, ["count", 3], "3"],
    ids=["no-count", "string-count", "no-calls", "null-count", "a-list", "a-string"],
)
def test_counter_records_it_cannot_use_are_422_naming_the_episode_and_a_second_restore_works(
    tmp_path: Path, state: Any
) -> None:
    bad = write(tmp_path / "bad", "resources", "counter-0", [{"episode_id": "ep-7", "state": state}])
    good = write(
        tmp_path / "good", "resources", "counter-0", [{"episode_id": "ep-7", "state": {"count": 5, "calls": 2}}]
    )

    async def main() -> None:
        app = counter_app()
        async with client(app) as http:
            refused = await restore(http, bad, ["ep-7"])
            assert refused.status_code == 422, refused.text
            error = refused.json()["error"]
            assert error["code"] == "invalid_checkpoint_state"
            assert "ep-7" in error["detail"]
            assert app.state.server.sessions == {}  # nothing half installed
            status = (await bounded(http.get(f"{CONTROL}/status", headers=AUTH))).json()
            assert status["phase"] == "idle"
            assert not app.state.participant.closed  # admission reopened, as for any failed restore

            restored = await restore(http, good, ["ep-7"])
            assert restored.status_code == 200, restored.text
            assert restored.json()["restored"] == ["ep-7-a1"]
            assert app.state.server.sessions == {"ep-7-a1": {"count": 5, "calls": 2}}
            assert (await control(http, "resume", "restore-1")).status_code == 200
            counted = await bounded(http.post("/ng-rollout/ep-7-a1/increment", json={"n": 1}))
            assert counted.json() == {"count": 6}

    run(main())


def test_a_failed_counter_restore_can_be_resumed_and_the_server_serves(tmp_path: Path) -> None:
    bad = write(tmp_path / "bad", "resources", "counter-0", [{"episode_id": "ep-1", "state": {"calls": 1}}])

    async def main() -> None:
        app = counter_app()
        async with client(app) as http:
            refused = await restore(http, bad, ["ep-1"])
            assert refused.status_code == 422, refused.text
            assert "ep-1" in refused.json()["error"]["detail"]
            assert (await control(http, "resume", "restore-1")).status_code == 200
            seeded = await bounded(http.post("/ng-rollout/ep-2/seed_session", json={"task_input": {}}))
            assert seeded.status_code == 200, seeded.text

    run(main())


class RaisingResources(CheckpointedResources):
    """An exported resources server whose restore hook raises a plain exception on any state."""

    checkpoint_mode: ClassVar[CheckpointMode] = "exported"

    async def export_session_states(self, session_ids: list[str]) -> dict[str, Any]:
        return {}

    async def restore_session_states(self, states: dict[str, Any]) -> None:
        raise KeyError("count")


def test_a_resources_hook_that_raises_is_422_naming_the_scopes_episodes(tmp_path: Path) -> None:
    keys = [f"ep-{index}" for index in range(8)]
    directory = write(tmp_path / "ckpt", "resources", "raising-0", [{"episode_id": key, "state": {}} for key in keys])

    async def main() -> None:
        participant = ResourcesParticipant(RaisingResources(), "raising-0")
        app, _, _ = build_app("raising", config(ServerConfig), participant)
        async with client(app) as http:
            refused = await restore(http, directory, keys)
            assert refused.status_code == 422, refused.text
            error = refused.json()["error"]
            assert error["code"] == "invalid_checkpoint_state"
            assert "restore_session_states refused" in error["detail"]
            assert "'ep-0-a1'" in error["detail"]
            assert "and 3 more" in error["detail"]
            assert not participant.closed

    run(main())


def test_agent_records_it_cannot_use_are_422_naming_the_episode(tmp_path: Path) -> None:
    bad_kind = write(tmp_path / "kind", "agent", "agent-0", [{"episode_id": "ep-3", "kind": "nonsense"}])
    bad_boundary = write(
        tmp_path / "boundary",
        "agent",
        "agent-0",
        [{"episode_id": "ep-3", "kind": "session", "state": {}, "boundary": ["not", "a", "conversation"]}],
    )

    async def main() -> None:
        for directory in (bad_kind, bad_boundary):
            app = build_agent_app(config(AgentConfig, model_url=NOWHERE))
            async with client(app) as http:
                refused = await restore(http, directory, ["ep-3"])
                assert refused.status_code == 422, refused.text
                error = refused.json()["error"]
                assert error["code"] == "invalid_checkpoint_state"
                assert "ep-3" in error["detail"]
                assert app.state.participant.registry.live_keys() == []
                assert app.state.agent.sessions == {}

    run(main())


def test_environment_records_it_cannot_use_are_422_naming_the_episode(tmp_path: Path) -> None:
    directory = write(
        tmp_path / "ckpt",
        "environment",
        "environment-0",
        [
            {"episode_id": "ep-1", "task_digest": "d", "boundary": {"stage": "seed"}},
            {"episode_id": "ep-2", "task_digest": 7, "boundary": {"stage": "seed"}},
        ],
    )

    async def main() -> None:
        app = build_environment_app(config(EnvironmentConfig, agent_url=NOWHERE, resources_url=NOWHERE))
        async with client(app) as http:
            refused = await restore(http, directory, ["ep-1", "ep-2"])
            assert refused.status_code == 422, refused.text
            assert refused.json()["error"]["code"] == "invalid_checkpoint_state"
            assert "ep-2" in refused.json()["error"]["detail"]
            status = (await bounded(http.get(f"{CONTROL}/status", headers=AUTH))).json()
            assert status["phase"] == "idle"
            assert status["report"]["counts"]["live"] == 0  # checked before any was installed

    run(main())


# --- fuzz: crafted, digest-valid records never make the restore route answer 5xx

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
COUNTER_STATE = JSON | st.fixed_dictionaries({}, optional={"count": JSON, "calls": JSON})
AGENT_BOUNDARY = JSON | st.fixed_dictionaries(
    {},
    optional={
        "messages": JSON,
        "expected": JSON,
        "activation": JSON | st.fixed_dictionaries({}, optional={"input_sha256": JSON, "turns": JSON}),
        "pending_call": JSON,
        "last": JSON,
    },
)


def _records(kind: str) -> st.SearchStrategy[list[dict[str, Any]]]:
    if kind in ("counter", "weather"):
        fields = st.fixed_dictionaries({}, optional={"state": COUNTER_STATE})
    elif kind == "environment":
        fields = st.fixed_dictionaries({}, optional={"task_digest": JSON | st.text(max_size=8), "boundary": JSON})
    else:
        fields = st.fixed_dictionaries(
            {}, optional={"kind": JSON | st.sampled_from(["session", "run"]), "state": JSON, "boundary": AGENT_BOUNDARY}
        )
    return st.lists(fields, min_size=1, max_size=3).map(
        lambda rows: [{"episode_id": f"ep-{index}", **row} for index, row in enumerate(rows)]
    )


#: kind → (participant kind, instance, app builder)
APPS = {
    "counter": ("resources", "counter-0", lambda: build_counter_app(config(CounterConfig))),
    "weather": ("resources", "weather-0", lambda: build_weather_app(config(WeatherConfig))),
    "environment": (
        "environment",
        "environment-0",
        lambda: build_environment_app(config(EnvironmentConfig, agent_url=NOWHERE, resources_url=NOWHERE)),
    ),
    "agent": ("agent", "agent-0", lambda: build_agent_app(config(AgentConfig, model_url=NOWHERE))),
}


@st.composite
def restores(draw: st.DrawFn) -> tuple[str, list[dict[str, Any]]]:
    kind = draw(st.sampled_from(sorted(APPS)))
    return kind, draw(_records(kind))


def test_fuzz_crafted_records_never_make_the_restore_route_answer_5xx(tmp_path: Path) -> None:
    serial = itertools.count()

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=restores())
    def check(case: tuple[str, list[dict[str, Any]]]) -> None:
        kind, records = case
        participant_kind, instance, build = APPS[kind]
        directory = write(tmp_path / f"case-{next(serial)}", participant_kind, instance, records)
        scope = [record["episode_id"] for record in records]

        async def main() -> None:
            async with client(build()) as http:
                response = await restore(http, directory, scope)
                assert response.status_code < 500, (kind, records, response.text)
                if response.status_code != 200:
                    assert response.json()["error"]["code"] == "invalid_checkpoint_state", response.text
                    assert any(key in response.json()["error"]["detail"] for key in scope), response.text
                assert (await control(http, "resume", "restore-1")).status_code == 200

        run(main())

    check()
