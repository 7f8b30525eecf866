"""The counter (exported) and weather (stateless, replay verify) reference resources servers."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from gymckpt.servers.counter import CounterConfig, CounterServer, build_counter_app
from gymckpt.servers.weather import FORECAST_WORDS, WeatherConfig, build_weather_app, forecast
from gymckpt.store import open_store

from ..support import error_code
from .resources_support import AUTH, CONTROL, Control, Gates, bounded, client, config, rp, run, until

if TYPE_CHECKING:
    from pathlib import Path

    from fastapi import FastAPI


class GatedCounter(CounterServer):
    """A counter whose increments can be held open by the test."""

    def __init__(self) -> None:
        super().__init__()
        self.gates = Gates()

    async def increment(self, key: str, n: int) -> int:
        await self.gates.hold("increment")
        return await super().increment(key, n)


def counter_app(*, enabled: bool = True, server: CounterServer | None = None) -> FastAPI:
    return build_counter_app(config(CounterConfig, enabled=enabled), server)


def weather_app(*, enabled: bool = True) -> FastAPI:
    return build_weather_app(config(WeatherConfig, enabled=enabled))


async def play_counter(http: httpx.AsyncClient, key: str, ns: list[int]) -> None:
    seeded = await http.post(rp(key, "/seed_session"), json={"task_input": {"prompt": "count"}})
    assert seeded.status_code == 200
    for n in ns:
        assert (await http.post(rp(key, "/increment"), json={"n": n})).status_code == 200


# --------------------------------------------------------------------------- counter


def test_counter_protocol() -> None:
    async def main() -> None:
        app = counter_app()
        async with client(app) as http:
            seeded = await http.post(rp("r", "/seed_session"), json={"task_input": {}})
            assert seeded.json() == {"session": "r"}
            assert seeded.headers["x-ng-checkpoint-verify"] == "wait"
            assert "x-ng-checkpoint-restart" not in seeded.headers
            assert (await http.post(rp("r", "/increment"), json={"n": 2})).json() == {"count": 2}
            assert (await http.post(rp("r", "/increment"), json={"n": 3})).json() == {"count": 5}
            assert app.state.server.sessions == {"r": {"count": 5, "calls": 2}}
            assert (await http.post(rp("r", "/increment"), json={"n": "x"})).status_code == 422
            verified = await http.post(rp("r", "/verify"), json={"response": "5", "expected": 5})
            assert verified.json() == {"reward": 1.0}
            assert app.state.server.sessions == {}  # verify ends the session
            await play_counter(http, "s", [1])
            assert (await http.post(rp("s", "/verify"), json={"response": "", "expected": 2})).json() == {"reward": 0.0}
            await play_counter(http, "t", [1])
            assert (await http.post(rp("t", "/close_session"))).json() == {"closed": True}
            assert app.state.server.sessions == {}
            status = await Control(http).status()
            assert (status["mode"], status["verify"]) == ("exported", "wait")
            assert status["instance"] == "counter-0"

    run(main())


def test_counter_state_is_exported_and_restored_under_the_next_attempt(tmp_path: Path) -> None:
    async def main() -> None:
        directory = str(tmp_path / "ckpt")
        first = counter_app()
        async with client(first) as http:
            await play_counter(http, "r", [2, 3, 4])
            await play_counter(http, "q", [1])
            committed = await Control(http).checkpoint("c1", directory, ["r", "q"])
            assert committed["episode_ids"] == ["q", "r"]
        stored = list(open_store(directory).read_participant("", kind="resources", instance="counter-0"))
        assert sorted(stored, key=lambda record: record["episode_id"]) == [
            {"episode_id": "q", "state": {"count": 1, "calls": 1}},
            {"episode_id": "r", "state": {"count": 9, "calls": 3}},
        ]

        # every server process died: a fresh app restores and the replacement attempt continues
        restored_app = counter_app()
        async with client(restored_app) as http:
            control = Control(http)
            reply = await control.restore("c1", directory, ["r", "q"])
            assert reply["restored"] == ["q-a1", "r-a1"]
            await control.resume("c1")
            assert restored_app.state.server.sessions["r-a1"] == {"count": 9, "calls": 3}
            assert (await http.post(rp("r-a1", "/increment"), json={"n": 1})).json() == {"count": 10}
            verified = await http.post(rp("r-a1", "/verify"), json={"response": "done", "expected": 10})
            assert verified.json() == {"reward": 1.0}
            stale = await http.post(rp("r", "/increment"), json={"n": 1})
            assert stale.status_code == 409
            assert error_code(stale) == "stale_attempt"

        # negative control: the same continuation without the restore gets the wrong reward
        bare = counter_app()
        async with client(bare) as http:
            assert (await http.post(rp("r-a1", "/increment"), json={"n": 1})).json() == {"count": 1}
            verified = await http.post(rp("r-a1", "/verify"), json={"response": "done", "expected": 10})
            assert verified.json() == {"reward": 0.0}

    run(main())


def test_counter_increment_in_flight_blocks_readiness() -> None:
    async def main() -> None:
        server = GatedCounter()
        server.gates.close("increment")
        app = counter_app(server=server)
        async with client(app) as http:
            control = Control(http)
            await http.post(rp("r", "/seed_session"))
            call = asyncio.create_task(http.post(rp("r", "/increment"), json={"n": 4}))
            await bounded(server.gates.entered_event("increment").wait())
            report = (await control.prepare("c1", seconds=0.2))["report"]
            assert (report["ready"], report["blockers"]) == (False, ["r"])
            second = asyncio.create_task(control.prepare("c1"))
            server.gates.open("increment")
            assert (await bounded(call)).json() == {"count": 4}
            assert (await bounded(second))["report"]["ready"] is True
            await control.resume("c1")

    run(main())


def test_counter_verify_while_closed_waits_for_resume() -> None:
    async def main() -> None:
        app = counter_app()
        participant = app.state.participant
        async with client(app) as http:
            control = Control(http)
            await play_counter(http, "r", [3])
            assert (await control.prepare("c1"))["report"]["ready"]
            # seeding is replay-safe: admitted while closed
            seeded = await bounded(http.post(rp("s", "/seed_session")))
            assert seeded.status_code == 200
            verify = asyncio.create_task(http.post(rp("r", "/verify"), json={"response": "", "expected": 3}))
            await until(lambda: participant.counts()["waiting"] == 1)
            assert not verify.done()
            assert (await control.status())["report"]["ready"] is True  # a waiting call is not in flight
            await control.resume("c1")
            assert (await bounded(verify)).json() == {"reward": 1.0}

    run(main())


def test_counter_session_seeded_while_closed_is_not_exported(tmp_path: Path) -> None:
    async def main() -> None:
        app = counter_app()
        async with client(app) as http:
            control = Control(http)
            await play_counter(http, "a", [1])
            await control.prepare("c1")
            await http.post(rp("late", "/seed_session"))
            assert (await control.prepare("c1"))["report"]["ready"] is True
            committed = await control.commit("c1", str(tmp_path / "c1"), ["a", "late"])
            assert committed.json()["episode_ids"] == ["a"]
            await control.resume("c1")

    run(main())


# --------------------------------------------------------------------------- weather


def test_weather_protocol() -> None:
    async def main() -> None:
        app = weather_app()
        async with client(app) as http:
            seeded = await http.post(rp("r", "/seed_session"), json={"task_input": {}})
            assert seeded.json() == {"session": "r"}
            assert seeded.headers["x-ng-checkpoint-verify"] == "replay"
            assert "x-ng-checkpoint-restart" not in seeded.headers
            paris = (await http.post(rp("r", "/get_weather"), json={"city": "Paris"})).json()
            assert paris == {"forecast": forecast("Paris")}
            assert (await http.post(rp("r", "/get_weather"), json={"city": " paris "})).json() == paris
            assert paris["forecast"].split(",")[0] in FORECAST_WORDS
            good = await http.post(rp("r", "/verify"), json={"response": f"It will be {paris['forecast']}."})
            assert good.json() == {"reward": 1.0}
            bad = await http.post(rp("r", "/verify"), json={"response": "no idea"})
            assert bad.json() == {"reward": 0.0}
            assert (await http.post(rp("r", "/close_session"))).json() == {"closed": True}
            status = await Control(http).status()
            assert (status["mode"], status["verify"]) == ("stateless", "replay")

    run(main())


def test_forecast_is_deterministic() -> None:
    cities = ["Paris", "Lagos", "Lima", "Oslo", "Tokyo", "Cairo", "Quito", "Perth"]
    assert [forecast(city) for city in cities] == [forecast(city) for city in cities]
    assert len({forecast(city) for city in cities}) > 1


def test_weather_verify_and_seed_admitted_while_closed_and_nothing_exported(tmp_path: Path) -> None:
    async def main() -> None:
        app = weather_app()
        participant = app.state.participant
        async with client(app) as http:
            control = Control(http)
            await http.post(rp("r", "/seed_session"))
            assert (await control.prepare("c1"))["report"]["ready"]
            assert (await bounded(http.post(rp("s", "/seed_session")))).status_code == 200
            verified = await bounded(http.post(rp("r", "/verify"), json={"response": "sunny"}))
            assert verified.json() == {"reward": 1.0}
            # a tool call waits for resume
            tool = asyncio.create_task(http.post(rp("r", "/get_weather"), json={"city": "Oslo"}))
            await until(lambda: participant.counts()["waiting"] == 1)
            committed = await control.commit("c1", str(tmp_path / "c1"), ["r", "s"])
            assert committed.status_code == 200, committed.text
            assert committed.json()["record_count"] == 0
            assert not tool.done()
            await control.resume("c1")
            assert (await bounded(tool)).json() == {"forecast": forecast("Oslo")}

    run(main())


# --------------------------------------------------------------------------- checkpointing off


async def script(http: httpx.AsyncClient, kind: str, path_of: Any, headers: dict[str, str]) -> list[Any]:
    """The same calls against a server; each reply as (status, body, checkpoint headers)."""
    if kind == "counter":
        calls = [
            ("/seed_session", {"task_input": {"prompt": "p"}}),
            ("/increment", {"n": 2}),
            ("/increment", {"n": 5}),
            ("/increment", {"n": "bad"}),
            ("/verify", {"response": "7", "expected": 7}),
            ("/verify", {"response": "7", "expected": 7}),
            ("/close_session", {}),
        ]
    else:
        calls = [
            ("/seed_session", {"task_input": {}}),
            ("/get_weather", {"city": "Lima"}),
            ("/get_weather", {}),
            ("/verify", {"response": forecast("Lima")}),
            ("/verify", {"response": "unknown"}),
            ("/close_session", {}),
        ]
    replies = []
    for path, body in calls:
        reply = await http.post(path_of(path), json=body, headers=headers)
        replies.append((reply.status_code, reply.json()))
    return replies


@pytest.mark.parametrize("kind", ["counter", "weather"])
def test_checkpointing_off_installs_nothing_and_behaves_the_same(kind: str) -> None:
    async def main() -> None:
        build = counter_app if kind == "counter" else weather_app
        off = build(enabled=False)
        assert off.state.participant is None
        assert off.state.plane is None
        async with client(off) as http:
            for name in ("status", "prepare"):
                method = http.get if name == "status" else http.post
                assert (await method(f"{CONTROL}/{name}", headers=AUTH)).status_code == 404
            assert (await http.post(rp("r", "/seed_session"))).status_code == 404  # no rollout prefix
            seeded = await http.post("/seed_session", json={})
            assert not any(name.startswith("x-ng-") for name in seeded.headers)
            assert len(seeded.json()["session"]) == 32  # a new session id
            off_replies = await script(http, kind, lambda path: path, {"x-session-id": "r"})

        on = build(enabled=True)
        async with client(on) as http:
            on_replies = await script(http, kind, lambda path: rp("r", path), {})
        assert off_replies == on_replies
        assert off_replies[0] == (200, {"session": "r"})

    run(main())


def test_counter_off_keys_sessions_by_header() -> None:
    async def main() -> None:
        app = counter_app(enabled=False)
        async with client(app) as http:
            session = (await http.post("/seed_session", json={})).json()["session"]
            other = (await http.post("/seed_session", json={})).json()["session"]
            assert session != other
            await http.post("/increment", json={"n": 3}, headers={"x-session-id": session})
            await http.post("/increment", json={"n": 1}, headers={"x-session-id": other})
            assert app.state.server.sessions == {session: {"count": 3, "calls": 1}, other: {"count": 1, "calls": 1}}
            missing = await http.post("/increment", json={"n": 1})
            assert missing.status_code == 400

    run(main())
