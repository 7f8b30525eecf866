"""A restore takes only what was published (SPEC C10; issue 24, item 1).

The attack: a published checkpoint whose participant directory was replaced by the same
participant's files from another checkpoint. ``verify`` calls it damaged
(``index_digest_mismatch``); a restore must refuse it too (422 ``invalid_checkpoint_state``,
nothing installed), whether the body names the published manifest's digest (gymckpt's
Coordinator) or not (the reference's controller: the server reads the index itself).

Servers are ``tests/control/coord_server.py`` processes under uvicorn (one environment
participant each), as in ``test_coordination``; checkpoints are taken from a source
server through the Coordinator and published. The reference-shaped servers and the
several-worker server are those of ``test_coordination`` and ``tests/workers/cluster``.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from gymckpt import errors
from gymckpt.control.coordination import KIND_ORDER, Coordinator
from gymckpt.control.routes import CONTROL_PREFIX
from gymckpt.errors import CoordinationError
from gymckpt.store import open_store, verify
from tests.workers.cluster import INSTANCE as WORKER_INSTANCE
from tests.workers.cluster import KIND as WORKER_KIND
from tests.workers.cluster import cluster
from tests.workers.cluster import request as worker_request

from .test_coordination import INSTANCES, TOKEN, Fleet, LogCursor, deadline, reference_fleet, run

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

AUTH = {"Authorization": f"Bearer {TOKEN}"}
ENV = "environment"
PARTICIPANT = Path("gym") / ENV / INSTANCES[ENV]
#: what the source server holds; r1 takes one more step between the two checkpoints
KEYS = ["r1", "r2"]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    created = Fleet(tmp_path / "control.log")
    try:
        yield created
    finally:
        created.kill_all()


class Published:
    """Two published checkpoints of one environment participant: ``old-1``, then ``new-2`` (r1 one step on)."""

    def __init__(self, root: Path) -> None:
        self.old = root / "old"
        self.new = root / "new"

    def digest(self, directory: Path) -> str:
        """The sha256 of the participant's manifest bytes in ``directory``."""
        return hashlib.sha256((directory / PARTICIPANT / "manifest.json").read_bytes()).hexdigest()

    def copy(self, into: Path) -> tuple[Path, Path]:
        """Copies of both checkpoints under ``into`` (each test damages its own)."""
        return shutil.copytree(self.old, into / "old"), shutil.copytree(self.new, into / "new")


async def _checkpoint(url: str, checkpoint_id: str, directory: Path) -> None:
    async with Coordinator([url], token=TOKEN, probe_timeout=10.0) as gym:
        assert (await gym.discover(require_model=False)).ok
        assert (await gym.prepare(checkpoint_id, deadline())).prepared
        try:
            commits = await gym.commit(checkpoint_id, deadline(), str(directory), KEYS)
            await gym.publish(str(directory), commits)
        finally:
            await gym.resume(checkpoint_id, deadline())


async def _post(url: str, path: str, body: Any = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body, headers=AUTH) as response:
        return response.status, await response.json()


async def _get(url: str, path: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(url + path, headers=AUTH) as response:
        assert response.status == 200, await response.text()
        return await response.json()


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Published]:
    root = tmp_path_factory.mktemp("published")
    source = Fleet(root / "control.log")
    made = Published(root)
    try:
        server = source.start(ENV, INSTANCES[ENV], episodes=KEYS)
        source.wait_ready()
        url = server.url

        async def scenario() -> None:
            await _checkpoint(url, "old-1", made.old)
            assert (await _post(url, "/run/r1"))[0] == 200  # r1: step 2 from here on
            await _checkpoint(url, "new-2", made.new)

        run(scenario())
    finally:
        source.kill_all()
    assert verify(str(made.old)).ok and verify(str(made.new)).ok
    assert made.digest(made.old) != made.digest(made.new)
    yield made


def _swap_in_old_files(new: Path, old: Path) -> Path:
    """The attack: new's participant directory replaced by old's; returns a backup of new's own."""
    backup = new.parent / "backup"
    shutil.copytree(new / PARTICIPANT, backup)
    shutil.rmtree(new / PARTICIPANT)
    shutil.copytree(old / PARTICIPANT, new / PARTICIPANT)
    return backup


def _repair(new: Path, backup: Path) -> None:
    shutil.rmtree(new / PARTICIPANT)
    shutil.copytree(backup, new / PARTICIPANT)


def _restore_body(directory: Path, restore_id: str = "restore-0123456789ab", **fields: Any) -> dict[str, Any]:
    """The reference's restore body (object ids), plus any of gymckpt's optional fields."""
    return {
        "checkpoint_id": restore_id,
        "deadline_ts": deadline(),
        "checkpoint_dir": str(directory),
        "episode_ids": [{"rollout_id": key, "attempt": 0} for key in KEYS],
        **fields,
    }


def _refused(reply: tuple[int, Any]) -> str:
    """The detail of a 422 ``invalid_checkpoint_state``."""
    status, body = reply
    assert (status, body["error"]["code"]) == (422, "invalid_checkpoint_state"), reply
    return str(body["error"]["detail"])


def _fresh(fleet: Fleet, instance: str = INSTANCES[ENV]) -> str:
    server = fleet.start(ENV, instance)
    fleet.wait_ready()
    return server.url


async def _untouched(url: str, cursor: LogCursor) -> None:
    """Nothing was installed, admission is open again, the phase is idle."""
    held = await _get(url, "/episodes")
    assert held["state"] == {} and held["admission_open"], held
    assert not any(op.startswith("install") for op in cursor.ops()), cursor.ops()
    assert (await _get(url, f"{CONTROL_PREFIX}/status"))["phase"] == "idle"


# --- one server, the reference's body (no digest): it reads the index itself


def test_a_participant_directory_from_another_checkpoint_is_refused_and_nothing_installed(
    published: Published, fleet: Fleet, tmp_path: Path
) -> None:
    old, new = published.copy(tmp_path)
    backup = _swap_in_old_files(new, old)
    findings = verify(str(new))
    assert [finding.code for finding in findings.errors] == ["index_digest_mismatch"], findings
    url = _fresh(fleet)
    cursor = LogCursor(fleet.log)

    async def scenario() -> tuple[tuple[int, Any], tuple[int, Any], Any]:
        refused = await _post(url, f"{CONTROL_PREFIX}/restore", _restore_body(new))
        await _untouched(url, cursor)
        _repair(new, backup)
        # the same restore, retried once the directory is what was published: the newer state goes in
        retried = await _post(url, f"{CONTROL_PREFIX}/restore", _restore_body(new))
        return refused, retried, await _get(url, "/episodes")

    refused, retried, held = run(scenario())
    detail = _refused(refused)
    assert f"gym/checkpoint.json expects {published.digest(published.new)}" in detail
    assert f"manifest hashes to {published.digest(published.old)}" in detail
    assert retried == (200, {"phase": "restored", "source_checkpoint_id": "new-2", "restored": ["r1-a1", "r2-a1"]})
    assert held["state"]["r1-a1"]["step"] == 2  # the newer checkpoint's state, not the older one's step 1


def test_a_body_without_the_new_fields_restores_a_published_checkpoint_as_before(
    published: Published, fleet: Fleet
) -> None:
    url = _fresh(fleet)
    reply = run(_post(url, f"{CONTROL_PREFIX}/restore", _restore_body(published.new)))
    assert reply == (200, {"phase": "restored", "source_checkpoint_id": "new-2", "restored": ["r1-a1", "r2-a1"]})


def test_without_an_index_a_restore_reads_the_directory_as_before(
    published: Published, fleet: Fleet, tmp_path: Path
) -> None:
    """Unpublished (or published by the reference's controller, whose collection.json lists no digests)."""
    _old, new = published.copy(tmp_path)
    (new / "gym" / "checkpoint.json").unlink()
    url = _fresh(fleet)
    reply = run(_post(url, f"{CONTROL_PREFIX}/restore", _restore_body(new)))
    assert reply[0] == 200 and reply[1]["source_checkpoint_id"] == "new-2", reply


def test_a_participant_the_index_does_not_list_is_refused(published: Published, fleet: Fleet) -> None:
    url = _fresh(fleet, "env-1")  # a participant of another instance: its directory is not in the checkpoint
    cursor = LogCursor(fleet.log)

    async def scenario() -> tuple[int, Any]:
        refused = await _post(url, f"{CONTROL_PREFIX}/restore", _restore_body(published.new))
        await _untouched(url, cursor)
        return refused

    assert "gym/checkpoint.json does not list environment/env-1" in _refused(run(scenario()))


# --- the optional fields


def test_a_digest_the_body_names_must_be_the_manifests(published: Published, fleet: Fleet, tmp_path: Path) -> None:
    old, new = published.copy(tmp_path)
    (new / "gym" / "checkpoint.json").unlink()  # no index: the body's digest alone decides
    url = _fresh(fleet)
    cursor = LogCursor(fleet.log)
    wrong, right = published.digest(old), published.digest(new)

    async def scenario() -> tuple[tuple[int, Any], tuple[int, Any]]:
        refused = await _post(url, f"{CONTROL_PREFIX}/restore", _restore_body(new, manifest_sha256=wrong))
        await _untouched(url, cursor)
        body = _restore_body(new, manifest_sha256=right, source_checkpoint_id="new-2")
        return refused, await _post(url, f"{CONTROL_PREFIX}/restore", body)

    refused, accepted = run(scenario())
    assert f"the restore request expects {wrong}" in _refused(refused)
    assert accepted[0] == 200 and accepted[1]["restored"] == ["r1-a1", "r2-a1"], accepted


def test_a_source_checkpoint_id_the_body_names_must_be_the_manifests_and_the_indexs(
    published: Published, fleet: Fleet
) -> None:
    digest = published.digest(published.new)
    first, second = _fresh(fleet), _fresh(fleet, "env-0")
    cursor = LogCursor(fleet.log)

    async def scenario() -> tuple[tuple[int, Any], tuple[int, Any]]:
        body = _restore_body(published.new, manifest_sha256=digest, source_checkpoint_id="old-1")
        against_manifest = await _post(first, f"{CONTROL_PREFIX}/restore", body)
        against_index = await _post(
            second, f"{CONTROL_PREFIX}/restore", _restore_body(published.new, source_checkpoint_id="old-1")
        )
        await _untouched(first, cursor)
        await _untouched(second, cursor)
        return against_manifest, against_index

    against_manifest, against_index = run(scenario())
    assert "manifest names checkpoint_id 'new-2', the restore request expects 'old-1'" in _refused(against_manifest)
    assert "the restore request names checkpoint_id 'old-1', gym/checkpoint.json 'new-2'" in _refused(against_index)


def test_a_malformed_digest_is_an_invalid_request(published: Published, fleet: Fleet) -> None:
    url = _fresh(fleet)
    status, body = run(_post(url, f"{CONTROL_PREFIX}/restore", _restore_body(published.new, manifest_sha256="AB" * 32)))
    assert (status, body["error"]["code"]) == (422, "invalid_request"), body


def test_the_status_names_the_restore_checks(fleet: Fleet) -> None:
    status = run(_get(_fresh(fleet), f"{CONTROL_PREFIX}/status"))
    assert status["restore_checks"] == ["manifest_sha256", "source_checkpoint_id"]


# --- the Coordinator


class _SwapAfterReading(Coordinator):
    """Damages the directory right after the Coordinator read its index: the server's read comes later."""

    def __init__(self, *args: Any, damage: Callable[[], None], **options: Any) -> None:
        super().__init__(*args, **options)
        self.damage = damage

    def _read_published(self, checkpoint_dir: str) -> Any:
        index = super()._read_published(checkpoint_dir)
        self.damage()
        return index


def test_the_coordinator_sends_each_server_its_published_digest(
    published: Published, fleet: Fleet, tmp_path: Path
) -> None:
    """Damaged after the Coordinator read the index, and the index removed: only the body's digest can refuse it."""
    old, new = published.copy(tmp_path)

    def damage() -> None:
        _swap_in_old_files(new, old)
        (new / "gym" / "checkpoint.json").unlink()

    url = _fresh(fleet)
    cursor = LogCursor(fleet.log)

    async def scenario() -> CoordinationError:
        async with _SwapAfterReading([url], token=TOKEN, damage=damage) as gym:
            assert (await gym.discover(require_model=False)).ok
            assert gym.kinds[url].restore_checks == {"manifest_sha256", "source_checkpoint_id"}
            with pytest.raises(CoordinationError) as raised:
                await gym.restore("restore-1", deadline(), str(new), KEYS)
        await _untouched(url, cursor)
        return raised.value

    raised = run(scenario())
    cause = raised.causes[url]
    assert isinstance(cause, errors.InvalidCheckpointState) and cause.http_status == 422  # type: ignore[attr-defined]
    assert f"the restore request expects {published.digest(published.new)}" in str(cause)


def test_the_coordinator_refuses_a_damaged_checkpoint_before_calling_any_server(
    published: Published, fleet: Fleet, tmp_path: Path
) -> None:
    old, new = published.copy(tmp_path)
    _swap_in_old_files(new, old)
    url = _fresh(fleet)
    cursor = LogCursor(fleet.log)

    async def scenario() -> BaseException:
        async with Coordinator([url], token=TOKEN) as gym:
            assert (await gym.discover(require_model=False)).ok
            with pytest.raises(errors.IndexDigestMismatch) as raised:
                await gym.restore("restore-1", deadline(), str(new), KEYS)
        return raised.value

    raised = run(scenario())
    assert raised.participant == "environment/env-0"  # type: ignore[attr-defined]
    assert not [op for op in cursor.ops() if op.startswith("restore")], cursor.ops()


def test_the_coordinator_restores_only_published_checkpoints(
    published: Published, fleet: Fleet, tmp_path: Path
) -> None:
    _old, new = published.copy(tmp_path)
    (new / "gym" / "checkpoint.json").unlink()
    url = _fresh(fleet)
    cursor = LogCursor(fleet.log)

    async def scenario() -> None:
        async with Coordinator([url], token=TOKEN) as gym:
            assert (await gym.discover(require_model=False)).ok
            with pytest.raises(errors.CheckpointUnpublished):
                await gym.restore("restore-1", deadline(), str(new), KEYS)

    run(scenario())
    assert not [op for op in cursor.ops() if op.startswith("restore")], cursor.ops()


def test_the_coordinator_refuses_a_participant_the_index_does_not_list(published: Published, fleet: Fleet) -> None:
    url = _fresh(fleet, "env-1")
    cursor = LogCursor(fleet.log)

    async def scenario() -> CoordinationError:
        async with Coordinator([url], token=TOKEN) as gym:
            assert (await gym.discover(require_model=False)).ok
            with pytest.raises(CoordinationError) as raised:
                await gym.restore("restore-1", deadline(), str(published.new), KEYS)
        return raised.value

    raised = run(scenario())
    assert isinstance(raised.causes[url], errors.IndexParticipantUnlisted)
    assert not [op for op in cursor.ops() if op.startswith("restore")], cursor.ops()


def test_reference_servers_get_the_reference_body_and_the_coordinator_checks_their_manifests(tmp_path: Path) -> None:
    """A reference server refuses unknown fields: it gets none, and its manifest is checked before any call."""
    directory, other = tmp_path / "ckpt", tmp_path / "other"
    with reference_fleet() as (url_of, _held, _other):

        async def checkpoint(checkpoint_id: str, into: Path) -> None:
            async with Coordinator(list(url_of.values()), token=TOKEN, probe_timeout=10.0) as gym:
                assert (await gym.discover()).ok
                assert (await gym.prepare(checkpoint_id, deadline())).prepared
                commits = await gym.commit(checkpoint_id, deadline(), str(into), ["r1"])
                await gym.publish(str(into), commits)
                await gym.resume(checkpoint_id, deadline())

        run(checkpoint("ref-old", other))
        run(checkpoint("ref-new", directory))
    model = Path("gym") / "model" / INSTANCES["model"]
    with reference_fleet(holding=False) as (url_of, held, _other):

        async def restore() -> tuple[BaseException, dict[str, Any]]:
            async with Coordinator(list(url_of.values()), token=TOKEN, probe_timeout=10.0) as gym:
                assert (await gym.discover()).ok
                assert {info.restore_checks for info in gym.kinds.values()} == {frozenset()}
                shutil.copytree(directory / model, tmp_path / "kept")
                shutil.rmtree(directory / model)
                shutil.copytree(other / model, directory / model)
                with pytest.raises(errors.IndexDigestMismatch) as refused:
                    await gym.restore("ref-new", deadline(), str(directory), ["r1"])
                assert not any(op == "restore" for state in held.values() for op, _ in state.requests)
                shutil.rmtree(directory / model)
                shutil.copytree(tmp_path / "kept", directory / model)
                return refused.value, await gym.restore("ref-new", deadline(), str(directory), ["r1"])

        refused, restored = run(restore())
        bodies = {kind: [body for op, body in held[kind].requests if op == "restore"] for kind in KIND_ORDER}
    assert refused.participant == "model/model-0"  # type: ignore[attr-defined]
    assert {reply.source_checkpoint_id for reply in restored.values()} == {"ref-new"}
    for kind, sent in bodies.items():
        (body,) = sent
        assert set(body) == {"checkpoint_id", "deadline_ts", "checkpoint_dir", "episode_ids"}, (kind, body)


# --- several workers: the worker forwards the fields to its coordinator's plane


def _publish_for_workers(directory: Path, checkpoint_id: str, step: int) -> str:
    """A published checkpoint of the workers' participant; returns its manifest's digest."""
    with open_store(str(directory)) as store:
        manifest = store.write_participant(
            "",
            kind=WORKER_KIND,
            instance=WORKER_INSTANCE,
            checkpoint_id=checkpoint_id,
            records=[{"episode_id": "r1", "state": {"step": step}}],
        )
        store.publish("", [manifest])
    return manifest.sha256


async def test_a_server_of_several_workers_refuses_on_its_coordinator(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    _publish_for_workers(old, "old-1", 1)
    right = _publish_for_workers(new, "new-2", 2)
    participant = Path("gym") / WORKER_KIND / WORKER_INSTANCE
    shutil.copytree(new / participant, tmp_path / "kept")
    shutil.rmtree(new / participant)
    shutil.copytree(old / participant, new / participant)
    async with cluster(tmp_path, 2) as running:
        first, second = running.workers
        status = (await first.call("status")).json()
        assert status["restore_checks"] == ["manifest_sha256", "source_checkpoint_id"]
        by_index = await second.call(
            "restore", worker_request("restore-1", checkpoint_dir=str(new), episode_ids=["r1"])
        )
        assert by_index.status_code == 422, by_index.text
        assert "gym/checkpoint.json expects" in by_index.json()["error"]["detail"]
        (new / "gym" / "checkpoint.json").unlink()
        body = worker_request("restore-1", checkpoint_dir=str(new), episode_ids=["r1"], manifest_sha256=right)
        by_body = await first.call("restore", body)
        assert by_body.status_code == 422, by_body.text
        assert f"the restore request expects {right}" in by_body.json()["error"]["detail"]
        # an environment's whole-episode records wait in the coordinator until a worker claims them: none
        assert sorted(running.coordinator.held) == []
        shutil.rmtree(new / participant)
        shutil.copytree(tmp_path / "kept", new / participant)
        accepted = await second.call("restore", body)
        assert accepted.status_code == 200, accepted.text
        assert accepted.json()["source_checkpoint_id"] == "new-2"
        assert sorted(running.coordinator.held) == ["r1-a1"]
