"""gymckpt's Coordinator beside the reference-shaped controller, on servers that speak only the reference's shapes.

The servers are ``tests/control/coord_server.build_reference_app`` (episode ids as objects
only, so a capture key gets FastAPI's bare 422; the reference's replies, retire and forget
answering like the reference's code, ``{"retired": [...]}`` and ``{"forgotten": [...]}``),
one per kind, under uvicorn on loopback. Each controller runs the same checkpoint
(discover, prepare, commit with ``stop``, resume) on a fleet holding episodes, then the
same restore under a fresh ``restore-<hex>`` id, resume, retire and forget on a fresh
fleet. Each server must have received the same control bodies from both (deadlines and
directories aside), and both controllers must read the same outcome from the replies.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from gymckpt.control.coordination import Coordinator
from gymckpt.testing.net import serve
from gymckpt.testing.time import run_bounded
from tests.control.coord_server import ReferenceState, build_reference_app

from .conftest import TOKEN, deadline
from .reference_controller import EpisodeRef, ReferenceController, new_checkpoint_id, new_restore_id

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

KINDS = ("environment", "model", "agent", "resources")
EPISODES = {
    "environment": ["r1", "r2-a1", "x-a0"],
    "model": ["r1"],
    "agent": ["r1", "r2-a1", "x-a0"],
    "resources": ["r2-a1"],
}
#: the agent cannot capture x-a0: a restart, left out of the scope
RESTARTS = {"agent": ["x-a0"]}
IN_FLIGHT = ["r1", "r2-a1", "x-a0"]
BOUND = 30.0

Outcome = dict[str, Any]


@contextlib.contextmanager
def fleet(*, holding: bool) -> Iterator[tuple[dict[str, str], dict[str, ReferenceState]]]:
    """One reference-shaped server per kind: their URLs and states by kind."""
    with contextlib.ExitStack() as servers:
        urls, states = {}, {}
        for kind in KINDS:
            episodes = EPISODES[kind] if holding else []
            app = build_reference_app(kind, f"{kind}-0", TOKEN, episodes=episodes, restarts=RESTARTS.get(kind, []))
            urls[kind] = servers.enter_context(serve(app, graceful_shutdown=5.0))
            states[kind] = app.state.reference
        yield urls, states


def received(states: dict[str, ReferenceState], checkpoint_dir: Path) -> dict[str, list[tuple[str, Any]]]:
    """Each server's control POSTs in order, deadlines dropped, the checkpoint directory as ``<dir>``."""
    bodies: dict[str, list[tuple[str, Any]]] = {}
    for kind, state in states.items():
        bodies[kind] = []
        for op, body in state.requests:
            if op == "status":
                continue
            assert isinstance(body["deadline_ts"], float), (kind, op, body)
            kept = {key: value for key, value in body.items() if key != "deadline_ts"}
            if "checkpoint_dir" in kept:
                assert kept["checkpoint_dir"] == str(checkpoint_dir)
                kept["checkpoint_dir"] = "<dir>"
            bodies[kind].append((op, kept))
    return bodies


# ----------------------------------------------------------------------------- the two controllers


async def reference_checkpoint(urls: dict[str, str], checkpoint_id: str, checkpoint_dir: Path) -> Outcome:
    async with ReferenceController(urls.values(), TOKEN) as controller:
        await controller.discover()
        prepared = await controller.prepare(checkpoint_id, deadline_ts=deadline())
        scope = prepared.continued([EpisodeRef.from_capture_key(key) for key in IN_FLIGHT])
        commits = await controller.commit(checkpoint_id, str(checkpoint_dir), scope, deadline_ts=deadline(), stop=True)
        resumed = await controller.resume(checkpoint_id, deadline_ts=deadline())
    kind_of = {url: kind for kind, url in urls.items()}
    return {
        "prepared": prepared.prepared,
        "restarts": sorted(episode.capture_key for episode in prepared.restarts()),
        "scope": [episode.capture_key for episode in scope],
        "exported": {kind_of[url]: reply.episode_ids for url, reply in commits.items()},
        "idempotent": {kind_of[url]: reply.idempotent for url, reply in resumed.items()},
    }


async def coordinator_checkpoint(urls: dict[str, str], checkpoint_id: str, checkpoint_dir: Path) -> Outcome:
    async with Coordinator(list(urls.values()), token=TOKEN, probe_timeout=10.0) as gym:
        found = await gym.discover()
        assert found.ok, found.problems
        prepared = await gym.prepare(checkpoint_id, deadline())
        scope = prepared.continued(IN_FLIGHT)
        commits = await gym.commit(checkpoint_id, deadline(), str(checkpoint_dir), scope, stop=True)
        # gymckpt's own publication (no server call): its Coordinator restores only published checkpoints
        await gym.publish(str(checkpoint_dir), commits)
        resumed = await gym.resume(checkpoint_id, deadline())
    kind_of = {url: kind for kind, url in urls.items()}
    return {
        "prepared": prepared.prepared,
        "restarts": sorted(prepared.restarts()),
        "scope": list(scope),
        "exported": {kind_of[url]: list(reply.episode_ids) for url, reply in commits.items()},
        "idempotent": {kind_of[url]: reply["idempotent"] for url, reply in resumed.items()},
    }


async def reference_restore(urls: dict[str, str], restore_id: str, checkpoint_dir: Path, scope: list[str]) -> Outcome:
    episodes = [EpisodeRef.from_capture_key(key) for key in scope]
    nexts = [episode.next_attempt() for episode in episodes]
    async with ReferenceController(urls.values(), TOKEN) as controller:
        await controller.discover()
        restores = await controller.restore(restore_id, str(checkpoint_dir), episodes, deadline_ts=deadline())
        await controller.resume(restore_id, deadline_ts=deadline())
        retired = await controller.retire("retire", nexts, deadline_ts=deadline())
        forgotten = await controller.forget("forget", [episode.rollout_id for episode in nexts], deadline_ts=deadline())
    kind_of = {url: kind for kind, url in urls.items()}
    return {
        "restored": {kind_of[url]: (reply.source_checkpoint_id, reply.restored) for url, reply in restores.items()},
        "retired": sum(reply.count for reply in retired.values()),
        "forgotten": sum(reply.count for reply in forgotten.values()),
    }


async def coordinator_restore(urls: dict[str, str], restore_id: str, checkpoint_dir: Path, scope: list[str]) -> Outcome:
    nexts = [EpisodeRef.from_capture_key(key).next_attempt() for key in scope]
    async with Coordinator(list(urls.values()), token=TOKEN, probe_timeout=10.0) as gym:
        assert (await gym.discover()).ok
        restores = await gym.restore(restore_id, deadline(), str(checkpoint_dir), scope)
        await gym.resume(restore_id, deadline())
        retired = await gym.retire(
            [episode.wire() for episode in nexts], checkpoint_id="retire", deadline_ts=deadline()
        )
        forgotten = await gym.forget(
            [episode.rollout_id for episode in nexts], checkpoint_id="forget", deadline_ts=deadline()
        )
    kind_of = {url: kind for kind, url in urls.items()}
    return {
        "restored": {
            kind_of[url]: (reply.source_checkpoint_id, list(reply.restored)) for url, reply in restores.items()
        },
        "retired": retired,
        "forgotten": forgotten,
    }


# ----------------------------------------------------------------------------- the comparison


def test_the_coordinator_sends_and_reads_what_the_reference_controller_does(tmp_path: Path) -> None:
    checkpoint_id, restore_id = new_checkpoint_id(), new_restore_id()
    outcomes: dict[str, tuple[Outcome, Outcome]] = {}
    bodies: dict[str, dict[str, list[tuple[str, Any]]]] = {}
    for name, checkpoint, restore in (
        ("reference", reference_checkpoint, reference_restore),
        ("coordinator", coordinator_checkpoint, coordinator_restore),
    ):
        checkpoint_dir = tmp_path / name
        with fleet(holding=True) as (urls, states):
            taken = run_bounded(checkpoint(urls, checkpoint_id, checkpoint_dir), BOUND)
            sent = received(states, checkpoint_dir)
        with fleet(holding=False) as (urls, states):
            restored = run_bounded(restore(urls, restore_id, checkpoint_dir, taken["scope"]), BOUND)
            for kind, requests in received(states, checkpoint_dir).items():
                sent[kind] += requests
        outcomes[name] = (taken, restored)
        bodies[name] = sent

    taken, restored = outcomes["reference"]
    assert taken == {
        "prepared": True,
        "restarts": ["x-a0"],
        "scope": ["r1", "r2-a1"],
        "exported": {"environment": ["r1", "r2-a1"], "model": ["r1"], "agent": ["r1", "r2-a1"], "resources": ["r2-a1"]},
        "idempotent": dict.fromkeys(KINDS, False),
    }
    assert restored == {
        "restored": {
            "environment": (checkpoint_id, ["r1-a1", "r2-a2"]),
            "model": (checkpoint_id, ["r1-a1"]),
            "agent": (checkpoint_id, ["r1-a1", "r2-a2"]),
            "resources": (checkpoint_id, ["r2-a2"]),
        },
        "retired": 2 * len(KINDS),
        "forgotten": 2 * len(KINDS),
    }
    assert outcomes["coordinator"] == outcomes["reference"]
    for kind in KINDS:
        assert bodies["coordinator"][kind] == bodies["reference"][kind], kind
    commit = next(body for op, body in bodies["reference"]["environment"] if op == "commit")
    assert commit["episode_ids"] == [{"rollout_id": "r1", "attempt": 0}, {"rollout_id": "r2", "attempt": 1}]
    assert commit["stop"] is True
