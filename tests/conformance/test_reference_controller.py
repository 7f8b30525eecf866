"""A reference-shaped controller drives a stack of real gymckpt server processes end to end.

The stack is the e2e suite's (``tests/e2e/conftest``: inference, model, counter resources,
agent, environment as ``gymckpt serve`` processes; the references are each task run once,
uninterrupted). The harness starts the processes, SIGKILLs them and starts them again;
everything else goes through :mod:`.reference_controller`, with the reference's bodies:

rollouts sent with object episode ids → caught in flight (the inference ``/calls`` log) →
prepare in stage order → commit with object ids and ``stop`` → publish ``collection.json``
then ``LATEST`` → SIGKILL every Gym server → fresh processes → restore what ``LATEST``
names under ``restore-<hex>`` → resume in reverse → the next attempt of every exported
rollout continues (the uninterrupted result, and exactly the model calls the checkpoint
had not completed) → retire → forget. Every reply field the reference's controller reads
is parsed strictly by the controller and asserted here.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.stack.harness import CheckpointOutcome, task_for
from gymckpt.store import open_store, verify
from tests.e2e.conftest import WAIT, Cut, E2EStack, e2e_stack

from .reference_controller import (
    CHECKPOINT_ID_FORMAT,
    PREPARE_ORDER,
    RESTORE_ID_FORMAT,
    CollectionManifest,
    CollectionRoot,
    CommitReply,
    EpisodeRef,
    Member,
    ParticipantError,
    ReferenceController,
    RunReply,
    new_checkpoint_id,
    new_restore_id,
    run_episode,
)

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from .reference_controller import PrepareOutcome

#: the rollouts started (capture key → task index): the first two are caught after two completed
#: model calls, the two started after them after one, so some are always caught mid-episode
ROLLOUTS = {f"conf-{index}": index for index in range(4)}
EARLY, LATE = ["conf-0", "conf-1"], ["conf-2", "conf-3"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2EStack]:
    with e2e_stack(tmp_path_factory.mktemp("conformance-stack"), references=ROLLOUTS.values()) as running:
        yield running


def controller_of(stack: E2EStack) -> ReferenceController:
    return ReferenceController([stack.urls[name] for name in stack.harness.gym_servers], stack.harness.token)


def start_rollouts(stack: E2EStack, keys: list[str]) -> dict[str, asyncio.Task[RunReply]]:
    """One environment ``/run`` per rollout, its episode id an object."""
    session = stack.client()
    runs = {}
    for key in keys:
        index = ROLLOUTS[key]
        episode = EpisodeRef.from_capture_key(key)
        stack.index[episode.rollout_id] = index
        runs[key] = asyncio.create_task(run_episode(session, stack.urls["environment"], episode, task_for(index)))
    return runs


def assert_prepared(controller: ReferenceController, prepared: PrepareOutcome, checkpoint_id: str) -> None:
    assert prepared.prepared, prepared.blockers()
    assert prepared.stages == list(PREPARE_ORDER)
    calls = [call for call in controller.sent if call.route == "prepare"]
    assert [call.url for call in calls] == [member.url for member in controller.members], "prepare out of order"
    assert all(call.body == {"checkpoint_id": checkpoint_id, "deadline_ts": call.body["deadline_ts"]} for call in calls)
    for url, reply in prepared.replies.items():
        assert reply.phase == "prepared", (url, reply)
        assert reply.report.ready and reply.report.blocker_count == 0 and reply.report.blockers == [], (url, reply)
    assert prepared.restarts() == set(), "the counter stack captures every rollout"


def assert_commit(member: Member, reply: CommitReply, checkpoint_id: str, target: Path) -> None:
    """The reply's manifest is the participant's manifest file; gymckpt's fields are extra keys."""
    manifest = reply.manifest
    assert (manifest.kind, manifest.checkpoint_id) == (member.kind, checkpoint_id), reply
    assert manifest.instance == member.instance, reply
    assert manifest.record_count == len(reply.episode_ids), reply
    path = target / "gym" / member.kind / member.instance / "manifest.json"
    assert manifest.model_dump() == json.loads(path.read_bytes()), "the reply's manifest is not the one written"
    extra = reply.model_extra or {}
    assert extra["kind"] == member.kind and extra["instance"] == member.instance, extra
    assert extra["checkpoint_id"] == checkpoint_id and extra["checkpoint_dir"] == str(target), extra
    assert extra["manifest_path"] == f"gym/{member.kind}/{member.instance}/manifest.json", extra
    assert extra["records_file"] == manifest.records_file and extra["record_count"] == manifest.record_count, extra
    assert isinstance(extra["manifest_sha256"], str) and isinstance(extra["records_bytes"], int), extra
    if member.kind == "model":  # every staged key the model's records refer to, and only those
        by_episode = extra["staging_keys_by_episode"]
        assert sorted(by_episode) == sorted(reply.episode_ids), extra
        assert extra["staging_keys"] == sorted({key for keys in by_episode.values() for key in keys}), extra


def read_records(target: Path, commits: dict[str, CommitReply]) -> dict[str, dict[str, dict[str, Any]]]:
    """Every participant's records, by kind and capture key (read back through the store)."""
    store = open_store(str(target))
    try:
        return {
            reply.manifest.kind: {
                record["episode_id"]: record
                for record in store.read_participant("", kind=reply.manifest.kind, instance=reply.manifest.instance)
            }
            for reply in commits.values()
        }
    finally:
        store.close()


async def statuses(controller: ReferenceController) -> dict[str, Any]:
    return {member.kind: await controller.status(member.url) for member in controller.members}


def test_reference_controller_checkpoints_crashes_restores_and_continues(stack: E2EStack, tmp_path: Path) -> None:
    root = CollectionRoot(tmp_path / "collection")

    async def scenario() -> None:
        runs = start_rollouts(stack, EARLY)
        try:
            await stack.wait_for_calls(dict.fromkeys(EARLY, 2), runs)  # type: ignore[arg-type]
            runs |= start_rollouts(stack, LATE)
            await stack.wait_for_calls(dict.fromkeys(LATE, 1), runs)  # type: ignore[arg-type]
            cut, commits = await checkpoint_and_publish(runs)
            await stack.crash(runs, cut.committed)  # type: ignore[arg-type]
            stack.harness.restart()
            await restore_and_continue(cut, commits)
        finally:
            for run in runs.values():
                run.cancel()
            await asyncio.gather(*runs.values(), return_exceptions=True)

    async def checkpoint_and_publish(runs: dict[str, asyncio.Task[RunReply]]) -> tuple[Cut, dict[str, CommitReply]]:
        async with controller_of(stack) as controller:
            members = await controller.discover()
            assert [member.kind for member in members] == list(PREPARE_ORDER)
            checkpoint_id = new_checkpoint_id()
            assert CHECKPOINT_ID_FORMAT.fullmatch(checkpoint_id)
            deadline_ts = time.time() + WAIT
            in_flight = [EpisodeRef.from_capture_key(key) for key, run in runs.items() if not run.done()]
            prepared = await controller.prepare(checkpoint_id, deadline_ts=deadline_ts)
            assert_prepared(controller, prepared, checkpoint_id)

            scope = prepared.continued(in_flight)
            target = root.checkpoint_dir(checkpoint_id)
            commits = await controller.commit(checkpoint_id, str(target), scope, deadline_ts=deadline_ts, stop=True)
            for call in (call for call in controller.sent if call.route == "commit"):
                assert call.body["episode_ids"] == [episode.wire() for episode in scope] and call.body["stop"] is True
            by_url = {member.url: member for member in members}
            for url, reply in commits.items():
                assert_commit(by_url[url], reply, checkpoint_id, target)
            committed = next(reply for url, reply in commits.items() if by_url[url].kind == "environment").episode_ids
            assert committed, "no rollout was exported"
            for reply in commits.values():
                assert set(reply.episode_ids) <= set(committed), reply
            # a rollout the environment did not export finished before the checkpoint: its reply may still be on its way
            for key, run in runs.items():
                if key not in committed:
                    body = await asyncio.wait_for(asyncio.shield(run), WAIT)
                    assert body.result == stack.expected(key).result, (key, body)
            for kind, status in (await statuses(controller)).items():
                assert (status.phase, status.checkpoint_id) == ("committed", checkpoint_id), (kind, status)

            # stop: no resume; the controller publishes and stops
            manifest = CollectionManifest(
                checkpoint_id=checkpoint_id,
                run_id=uuid.uuid4().hex,
                created_at=time.time(),
                continued=[EpisodeRef.from_capture_key(key) for key in committed],
                restarted=[episode for episode in in_flight if episode not in set(scope)],
            )
            assert root.publish(manifest) == target
        assert (root.root / "LATEST").read_text() == checkpoint_id
        assert CollectionManifest.model_validate_json((target / "collection.json").read_bytes()) == manifest
        report = verify(str(target))
        assert report.ok, report.errors
        outcome = CheckpointOutcome(checkpoint_id, str(target), None, list(committed), {}, 0.0, 0.0)  # type: ignore[arg-type]
        finished = {key: run.result().model_dump() for key, run in runs.items() if key not in committed}
        cut = Cut(outcome, dict(runs), finished, list(committed), set(), read_records(target, commits))  # type: ignore[arg-type]
        done = {key: len(cut.recorded(key, stack.expected(key))) for key in committed}
        assert any(0 < count < len(stack.expected(key).pairs) for key, count in done.items()), done
        return cut, commits

    async def restore_and_continue(cut: Cut, commits: dict[str, CommitReply]) -> None:
        async with controller_of(stack) as controller:
            members = await controller.discover()
            latest = root.latest()
            assert latest is not None
            target, manifest = latest
            assert (target.name, manifest.checkpoint_id) == (cut.checkpoint_id, cut.checkpoint_id)
            continued = manifest.continued
            assert [episode.capture_key for episode in continued] == cut.committed
            restore_id = new_restore_id()
            assert RESTORE_ID_FORMAT.fullmatch(restore_id)
            deadline_ts = time.time() + WAIT

            restores = await controller.restore(restore_id, str(target), continued, deadline_ts=deadline_ts)
            for call in (call for call in controller.sent if call.route == "restore"):
                assert call.body["episode_ids"] == [episode.wire() for episode in continued]
                assert call.body["checkpoint_id"] == restore_id
            for url, reply in restores.items():
                assert reply.source_checkpoint_id == cut.checkpoint_id, (url, reply)
                expected = sorted(
                    EpisodeRef.from_capture_key(key).next_attempt().capture_key for key in commits[url].episode_ids
                )
                assert reply.restored == expected, (url, reply)
            nexts = [episode.next_attempt() for episode in continued]
            now = await statuses(controller)
            for kind, status in now.items():
                assert (status.phase, status.checkpoint_id) == ("restored", restore_id), (kind, status)
            assert (now["environment"].model_extra or {})["restored_pending"] == sorted(e.capture_key for e in nexts)

            resumed = await controller.resume(restore_id, deadline_ts=deadline_ts)
            calls = [call.url for call in controller.sent if call.route == "resume"]
            assert calls == [member.url for member in reversed(members)], "resume out of order"
            assert {reply.idempotent for reply in resumed.values()} == {False}, resumed
            again = await controller.resume(restore_id, deadline_ts=deadline_ts)
            assert {reply.idempotent for reply in again.values()} == {True}, again

            await continue_every_rollout(cut, nexts)
            assert (await controller.status(stack.urls["environment"])).model_extra["restored_pending"] == []
            await retire_and_forget(controller, nexts)

    async def continue_every_rollout(cut: Cut, nexts: list[EpisodeRef]) -> None:
        session = stack.client()
        replies = await asyncio.wait_for(
            asyncio.gather(
                *(
                    run_episode(session, stack.urls["environment"], episode, stack.task(episode.capture_key))
                    for episode in nexts
                )
            ),
            WAIT,
        )
        for episode, reply in zip(nexts, replies, strict=True):
            assert reply.episode_id == episode, reply
            assert reply.failure is None and reply.result == stack.expected(episode.capture_key).result, reply
        log = await stack.harness.model_calls()
        for key, episode in zip(cut.committed, nexts, strict=True):
            stack.assert_continued_exactly(log, cut, key, episode.capture_key)

    async def retire_and_forget(controller: ReferenceController, nexts: list[EpisodeRef]) -> None:
        deadline_ts = time.time() + WAIT
        retired = await controller.retire("retire", nexts, deadline_ts=deadline_ts)
        order = [call.url for call in controller.sent if call.route == "retire"]
        kinds = [next(member.kind for member in controller.members if member.url == url) for url in order]
        assert kinds[:2] == ["environment", "agent"] and sorted(kinds[2:]) == ["model", "resources"], kinds
        assert {url: reply.retired_count for url, reply in retired.items()} == dict.fromkeys(order, len(nexts))
        for kind, status in (await statuses(controller)).items():
            assert status.retired_rollouts == len(nexts), (kind, status)
        with pytest.raises(ParticipantError) as refused:
            await run_episode(stack.client(), stack.urls["environment"], nexts[0], stack.task(nexts[0].capture_key))
        assert (refused.value.status, refused.value.code) == (409, "stale_attempt")

        forgotten = await controller.forget(
            "forget", [episode.rollout_id for episode in nexts], deadline_ts=deadline_ts
        )
        assert {reply.forgotten_count for reply in forgotten.values()} == {len(nexts)}, forgotten
        assert len(forgotten) == len(controller.members)
        for kind, status in (await statuses(controller)).items():
            assert status.retired_rollouts == 0, (kind, status)

    stack.run(scenario())
