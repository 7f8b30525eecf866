"""The reference stack with the counter (exported state) and a session-checkpointed agent, as real processes.

Every Gym server runs two uvicorn workers (``gymckpt serve KIND --workers 2``): each
scenario below is one a single-process server passes too (the conformance suite and the
other e2e modules run one worker per server).

Each scenario checkpoints rollouts in flight through the coordinator, usually SIGKILLs
every Gym server's process group, restores into fresh processes and continues, asserting
the exact model calls made after the restore (see ``conftest``).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.control.routes import CONTROL_PREFIX
from gymckpt.stack.harness import RolloutHarness, default_stack_spec, task_for

from .conftest import TOKEN, TOKEN_DELAY, WAIT, E2EStack, calls_of, e2e_stack, key_of, next_key

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

#: every Gym server of the stack
GYM = ("environment", "model", "agent", "resources")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2EStack]:
    with e2e_stack(tmp_path_factory.mktemp("counter-stack"), references=range(6), workers=2) as running:
        yield running


def test_native_episodes_crash_and_continue(e2e: E2EStack, tmp_path: Path) -> None:
    async def scenario() -> None:
        gym = await e2e.coordinator()
        runs = e2e.start({"nat-0": 0})
        await asyncio.wait_for(runs["nat-0"], WAIT)  # finished before the checkpoint
        runs |= e2e.start({"nat-1": 1, "nat-2": 2})
        await e2e.wait_for_calls({"nat-1": 2, "nat-2": 2}, runs)
        runs |= e2e.start({"nat-3": 3, "nat-4": 4, "nat-5": 5})
        await e2e.wait_for_calls({"nat-3": 1, "nat-4": 1, "nat-5": 1}, runs)

        cut = await e2e.checkpoint(gym, "native-1", tmp_path / "ckpt", runs)
        assert "nat-0" in cut.finished
        mid_episode = [
            key for key in cut.committed if 0 < len(cut.recorded(key, e2e.expected(key))) < len(e2e.expected(key).pairs)
        ]
        assert mid_episode, "no rollout was exported in the middle of its episode"

        await e2e.crash(runs, cut.committed)
        await e2e.restore(cut)
        await e2e.continue_committed(cut)

    e2e.run(scenario())


def test_generations_cut_at_the_checkpoint_continue_and_no_token_is_generated_twice(
    e2e: E2EStack, tmp_path: Path
) -> None:
    """Every model call after the restore either continues a cut (only the tokens after its prefix are
    generated) or is a turn nobody had generated: the backend's log shows no token generated twice."""

    async def scenario() -> None:
        gym = await e2e.coordinator()
        keys = {f"cut-{index}": index for index in range(6)}
        runs = e2e.start(keys)
        await e2e.wait_for_calls(dict.fromkeys(keys, 1), runs)
        cut = await e2e.checkpoint(gym, "cuts-1", tmp_path / "ckpt", runs)
        model = next(reply for reply in cut.outcome.commits.values() if reply.kind == "model")
        extra = model.model_extra or {}
        records = cut.records.get("model", {})
        cuts = {key: record["generation_cuts"][0] for key, record in records.items() if record["generation_cuts"]}
        listed = {key for record_keys in extra["staging_keys_by_episode"].values() for key in record_keys}
        assert set(extra["staging_keys"]) == listed  # every staged key the records refer to, and no other
        for key, record in records.items():
            for row in record["rows"]:
                assert row["staging_key"] in extra["staging_keys_by_episode"][key]
        before = len(await e2e.harness.model_calls())
        await e2e.crash(runs, cut.committed)
        await e2e.restore(cut)
        log = await e2e.continue_committed(cut)
        completed_before = {str(call["call_id"]) for call in log[:before]}
        delivered = {key: {row["model_call_id"] for row in record["rows"]} for key, record in records.items()}
        for call in log[before:]:
            rollout_key, _, turn = str(call["call_id"]).rpartition(":")
            source = next((key for key in records if next_key(key) == rollout_key), None)
            old = f"{source}:{turn}" if source is not None else None
            continued = int(call["continued_from"])
            if continued:  # a cut continued, or a delivered response asked for again and replayed whole
                assert source in cuts or old in delivered.get(source or "", set()), call
                assert call["generated"] == len(call["tokens"]) - continued, call
            else:  # generated from its first token: a turn no generation had reached before the crash
                assert old not in completed_before, call
        assert any(int(call["continued_from"]) for call in log[before:]) or not cuts, cuts

    e2e.run(scenario())


def test_legacy_runs_crash_and_continue(e2e: E2EStack, tmp_path: Path) -> None:
    async def scenario() -> None:
        gym = await e2e.coordinator()
        runs = e2e.start_legacy({"leg-0": 0})
        await asyncio.wait_for(runs["leg-0"], WAIT)  # finished before the checkpoint
        runs |= e2e.start_legacy({"leg-1": 1, "leg-2": 2, "leg-3": 3})
        await e2e.wait_for_calls({"leg-1": 1, "leg-2": 2, "leg-3": 1}, runs)

        cut = await e2e.checkpoint(gym, "legacy-1", tmp_path / "ckpt", runs, exported_by="agent")
        assert cut.committed, "no legacy run was exported"
        assert not cut.records["environment"]
        for key in cut.committed:
            assert cut.records["agent"][key]["kind"] == "run"
            assert cut.records["agent"][key]["boundary"]["verify_mode"] == "wait"  # the counter's declaration

        await e2e.crash(runs, cut.committed)
        await e2e.restore(cut)
        await e2e.continue_committed(cut, legacy=True)

    e2e.run(scenario())


def test_counter_state_is_needed_for_the_right_reward(e2e: E2EStack, tmp_path: Path) -> None:
    """One crash; the resources server restores the counters of half the rollouts: the other half is the
    negative control (everything else restored, the resources restore skipped) and gets the wrong reward."""

    async def scenario() -> None:
        gym = await e2e.coordinator()
        keys = {f"ctr-{index}": index for index in range(4)}
        runs = e2e.start(keys)
        # two completed model calls: the first tool call (an increment) completed in between
        await e2e.wait_for_calls(dict.fromkeys(keys, 2), runs)
        cut = await e2e.checkpoint(gym, "counter-1", tmp_path / "ckpt", runs)
        assert len(cut.committed) >= 2, cut.committed
        assert sorted(cut.records["resources"]) == cut.committed
        for key in cut.committed:
            assert cut.records["resources"][key]["state"]["count"] > 0, "the count was not exported"
            assert e2e.expected(key).result["reward"] == 1.0
        positive = cut.committed[::2]  # the others are the negative control

        await e2e.crash(runs, cut.committed)
        e2e.harness.restart()
        others = await e2e.coordinator(["environment", "model", "agent"])
        resources = await e2e.coordinator(["resources"])
        deadline = time.time() + WAIT
        restored = await others.restore("counter-1", deadline, cut.directory, cut.committed)
        for url, reply in restored.items():  # each server lists the attempts it installed records for
            assert reply.restored == [next_key(key) for key in cut.outcome.commits[url].episode_ids], url
        (reply,) = (await resources.restore("counter-1", deadline, cut.directory, positive)).values()
        assert reply.restored == [next_key(key) for key in positive]
        await resources.resume("counter-1", deadline)
        await others.resume("counter-1", deadline)

        continued = {key: next_key(key) for key in cut.committed}
        bodies = await asyncio.wait_for(
            asyncio.gather(*(e2e.harness.run(attempt, e2e.task(attempt)) for attempt in continued.values())), WAIT
        )
        log = await e2e.harness.model_calls()
        for (key, attempt), body in zip(continued.items(), bodies, strict=True):
            if key in positive:
                e2e.assert_result(attempt, body)  # the uninterrupted reward, 1.0
                e2e.assert_continued_exactly(log, cut, key, attempt)
            else:
                assert body["result"]["reward"] == 0.0, (attempt, body)  # the count started over at 0
                recorded = cut.recorded(key, e2e.expected(key))
                assert recorded, key
                assert not set(recorded) & set(calls_of(log, attempt)), f"{attempt} made a completed call again"

    e2e.run(scenario())


def test_a_checkpoint_without_a_crash_parks_and_then_releases(e2e: E2EStack, tmp_path: Path) -> None:
    async def scenario() -> None:
        gym = await e2e.coordinator()
        keys = {f"park-{index}": index for index in range(4)}
        runs = e2e.start(keys)
        await e2e.wait_for_calls(dict.fromkeys(keys, 1), runs)
        cut = await e2e.checkpoint(gym, "park-1", tmp_path / "ckpt", runs)
        assert cut.committed
        for name in GYM:
            status = await e2e.status(name)
            assert status["phase"] == "committed", status
            assert status["report"]["blocker_count"] == 0, status
        for key in cut.committed:
            assert not runs[key].done(), f"{key} replied while Gym was prepared"

        await gym.resume("park-1", time.time() + WAIT)
        for name in GYM:
            assert (await e2e.status(name))["phase"] == "idle"
        bodies = await asyncio.wait_for(asyncio.gather(*(runs[key] for key in cut.committed)), WAIT)
        for key, body in zip(cut.committed, bodies, strict=True):
            e2e.assert_result(key, body)
        log = await e2e.harness.model_calls()
        for key in keys:  # released where they parked: every call made once, none again
            assert calls_of(log, key) == e2e.expected(key).pairs, key

    e2e.run(scenario())


def test_a_second_crash_after_a_checkpoint_taken_before_the_replacement_started(e2e: E2EStack, tmp_path: Path) -> None:
    async def scenario() -> None:
        gym = await e2e.coordinator()
        keys = {f"twice-{index}": index for index in range(4)}
        runs = e2e.start(keys)
        await e2e.wait_for_calls(dict.fromkeys(keys, 2), runs)
        first = await e2e.checkpoint(gym, "twice-1", tmp_path / "ckpt-1", runs)
        assert first.committed
        await e2e.crash(runs, first.committed)
        gym = await e2e.restore(first)

        # the replacement attempts have not started: checkpoint them at once
        replacements = {next_key(key): None for key in first.committed}
        second = await e2e.checkpoint(gym, "twice-2", tmp_path / "ckpt-2", replacements)
        assert sorted(second.committed) == sorted(replacements), "a restored episode was not exported again"
        for key in first.committed:
            attempt = next_key(key)
            assert second.recorded(attempt, e2e.expected(key)) == first.recorded(key, e2e.expected(key))
            assert second.records["resources"][attempt]["state"] == first.records["resources"][key]["state"]
        assert not [call for call in await e2e.harness.model_calls() if key_of(call) in replacements]

        await e2e.crash({}, [])
        await e2e.restore(second)
        stale = await e2e.harness.run(next(iter(replacements)), e2e.task(next(iter(replacements))))
        assert stale["status"] == 409 and stale["error"]["code"] == "stale_attempt", stale

        continued = {key: next_key(next_key(key)) for key in first.committed}
        bodies = await asyncio.wait_for(
            asyncio.gather(*(e2e.harness.run(attempt, e2e.task(attempt)) for attempt in continued.values())), WAIT
        )
        for attempt, body in zip(continued.values(), bodies, strict=True):
            e2e.assert_result(attempt, body)
        log = await e2e.harness.model_calls()
        for key, attempt in continued.items():
            assert not calls_of(log, next_key(key))  # the first replacement never ran
            e2e.assert_continued_exactly(log, second, next_key(key), attempt, first=key)

    e2e.run(scenario())


def test_a_retired_episode_leaves_nothing_behind(e2e: E2EStack, tmp_path: Path) -> None:
    async def scenario() -> None:
        gym = await e2e.coordinator()
        keys = {f"retire-{index}": index for index in range(4)}
        runs = e2e.start(keys)
        await e2e.wait_for_calls(dict.fromkeys(keys, 1), runs)
        retired = await gym.retire(list(keys), checkpoint_id="retire-1", deadline_ts=time.time() + WAIT)
        assert retired == len(keys) * len(GYM)
        for body in await asyncio.wait_for(asyncio.gather(*runs.values()), WAIT):
            assert body["failure"] == {"failure_reason": "retired", "terminal": True}, body

        await assert_nothing_live(e2e, retired_rollouts=len(keys))
        await assert_refused(e2e, "retire-0")
        # a checkpoint naming them exports nothing anywhere
        prepared = await gym.prepare("retire-2", time.time() + WAIT)
        assert prepared.ready and not prepared.restarts()
        commits = await gym.commit("retire-2", time.time() + WAIT, str(tmp_path / "ckpt"), list(keys))
        assert all(reply.record_count == 0 for reply in commits.values()), commits
        await gym.resume("retire-2", time.time() + WAIT)

        forgotten = await gym.forget(list(keys), checkpoint_id="retire-3", deadline_ts=time.time() + WAIT)
        assert forgotten == len(keys) * len(GYM)
        await assert_nothing_live(e2e, retired_rollouts=0)
        # the same attempts again: no state of the retired ones shows in their calls or results
        mark = len(await e2e.harness.model_calls())
        again = e2e.start(keys)
        for key, body in zip(keys, await asyncio.wait_for(asyncio.gather(*again.values()), WAIT), strict=True):
            e2e.assert_result(key, body)
        log = (await e2e.harness.model_calls())[mark:]
        for key in keys:
            reference = e2e.expected(key).pairs
            made = calls_of(log, key)
            assert set(made) == set(reference), (key, made)
            # at most one more: a generation abandoned by the retire that the backend still finished
            assert sum((Counter(made) - Counter(reference)).values()) <= 1, (key, made)

    e2e.run(scenario())


async def assert_nothing_live(e2e: E2EStack, *, retired_rollouts: int) -> None:
    statuses = {name: await e2e.status(name) for name in GYM}
    for status in statuses.values():
        assert status["phase"] == "idle", status
        assert status["retired_rollouts"] == retired_rollouts, status
        assert status["report"]["blocker_count"] == 0 and not status["report"]["restarts"], status
    counts = {name: status["report"]["counts"] for name, status in statuses.items()}
    assert counts["environment"]["live"] == 0, counts
    assert counts["agent"]["live"] == 0 and counts["agent"]["activations"] == 0, counts
    assert not any(value for name, value in counts["model"].items() if name != "workers"), counts
    for field in ("sessions", "late_sessions", "running", "blocking", "waiting"):
        assert counts["resources"][field] == 0, counts


async def assert_refused(e2e: E2EStack, key: str) -> None:
    """Every Gym server refuses work of a retired attempt with ``stale_attempt``."""
    client = e2e.client()
    refused = await e2e.harness.run(key, e2e.task(key))
    assert refused["status"] == 409 and refused["error"]["code"] == "stale_attempt", refused
    for name, path, body in (
        ("agent", "/v1/responses", {"input": "hello"}),
        ("model", "/v1/responses", {"input": "hello"}),
        ("resources", "/seed_session", {"task_input": {}}),
    ):
        async with client.post(f"{e2e.urls[name]}/ng-rollout/{key}{path}", json=body) as response:
            assert response.status == 409, (name, await response.text())
            assert (await response.json())["error"]["code"] == "stale_attempt"


def test_checkpointing_off_exposes_no_control_route_and_behaves_the_same(e2e: E2EStack, tmp_path: Path) -> None:
    """A stack started with checkpointing off against this module's stack (on, no checkpoint taken)."""

    async def scenario() -> None:
        spec = default_stack_spec(token=TOKEN, token_delay_seconds=TOKEN_DELAY)
        spec["checkpoint"]["enabled"] = False
        (tmp_path / "off").mkdir()
        off = RolloutHarness.start(spec, workdir=tmp_path / "off")
        try:
            await compare(e2e, off)
        finally:
            await off.close()

    e2e.run(scenario())


async def compare(e2e: E2EStack, off: RolloutHarness) -> None:
    client = e2e.client()
    for name in GYM:
        async with client.get(f"{off.urls[name]}{CONTROL_PREFIX}/status") as response:
            assert response.status == 404, name
        async with client.post(
            f"{off.urls[name]}{CONTROL_PREFIX}/prepare",
            json={"checkpoint_id": "x", "deadline_ts": time.time() + WAIT},
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as response:
            assert response.status == 404, name
        async with client.get(f"{e2e.urls[name]}{CONTROL_PREFIX}/status") as response:
            assert response.status == 401, name  # on: the route is there, behind its token
    # no middleware: no rollout id needed, no checkpoint headers
    async with client.post(f"{off.urls['resources']}/seed_session", json={"task_input": {}}) as response:
        assert response.status == 200
        assert not [name for name in response.headers if name.lower().startswith("x-ng-")]
    async with client.post(f"{e2e.urls['resources']}/seed_session", json={"task_input": {}}) as response:
        assert response.status == 400 and (await response.json())["error"]["code"] == "rollout_id_required"

    keys = {f"cmp-{index}": index for index in range(3)}
    on_runs = e2e.start(keys)
    off_bodies = await asyncio.wait_for(
        asyncio.gather(*(off.run(key, task_for(index)) for key, index in keys.items())), WAIT
    )
    on_bodies = await asyncio.wait_for(asyncio.gather(*on_runs.values()), WAIT)
    # a legacy agent /run too
    e2e.index["cmp-legacy"] = 3
    on_legacy = await asyncio.wait_for(e2e.run_legacy("cmp-legacy"), WAIT)
    row = e2e.legacy_row("cmp-legacy", resources_url=off.urls["resources"])
    async with client.post(f"{off.urls['agent']}/run", json=row) as response:
        off_legacy = {**await response.json(), "status": response.status}

    for key, off_body, on_body in zip(keys, off_bodies, on_bodies, strict=True):
        assert off_body == on_body, (key, off_body, on_body)
        e2e.assert_result(key, off_body)
    assert off_legacy == on_legacy, (off_legacy, on_legacy)
    e2e.assert_result("cmp-legacy", off_legacy)

    def generations(log: list[dict[str, Any]]) -> Counter[tuple[str, int, tuple[int, ...]]]:
        return Counter((call["prompt_sha256"], call["seed"], tuple(call["tokens"])) for call in log)

    off_log = await off.model_calls()
    on_log = [call for call in await e2e.harness.model_calls() if key_of(call) in {*keys, "cmp-legacy"}]
    assert generations(off_log) == generations(on_log)
    # no rollout prefix downstream: the session header names the episode instead
    assert {key_of(call) for call in off_log} == {*keys, "cmp-legacy"}
