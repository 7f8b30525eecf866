"""The sandbox resources server: big sessions (a file tree and a command history) exported and restored."""

from __future__ import annotations

import asyncio
import hashlib
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.servers.sandbox import (
    DEFAULT_SESSION_BYTES,
    SandboxConfig,
    SandboxServer,
    build_sandbox_app,
    run_command,
    seed_state,
    session_digest,
)
from gymckpt.stack.kinds import PARTICIPANT_KINDS, build_server
from gymckpt.store import open_store

from ..support import error_code
from .resources_support import Control, bounded, client, config, rp, run, until

if TYPE_CHECKING:
    from pathlib import Path

    import httpx
    from fastapi import FastAPI

#: small sessions: the routes do not depend on the size
SMALL = {"session_bytes": 2_000, "files": 4}


def sandbox_app(*, enabled: bool = True, **fields: Any) -> FastAPI:
    return build_sandbox_app(config(SandboxConfig, enabled=enabled, **fields))


async def play(http: httpx.AsyncClient, key: str, task_input: dict[str, Any] | None = None) -> str:
    """Seed ``key``, write a file, run two commands; the session's digest afterwards."""
    seeded = await http.post(rp(key, "/seed_session"), json={"task_input": task_input or SMALL})
    assert seeded.status_code == 200, seeded.text
    written = await http.post(rp(key, "/write_file"), json={"path": "notes.txt", "content": f"made by {key}\n"})
    assert written.status_code == 200, written.text
    for command in ("ls", "wc -c notes.txt"):
        assert (await http.post(rp(key, "/run_command"), json={"command": command})).status_code == 200
    digest = await http.post(rp(key, "/digest"))
    assert digest.status_code == 200, digest.text
    return str(digest.json()["sha256"])


# --------------------------------------------------------------------------- the seeded tree


def test_the_seeded_tree_is_a_pure_function_of_its_seed_with_the_size_asked() -> None:
    tree = seed_state("7-0")
    assert len(tree["files"]) == 32
    assert sum(len(text) for text in tree["files"].values()) == DEFAULT_SESSION_BYTES
    assert all(text.isascii() for text in tree["files"].values())
    assert all(len(line) <= 79 for text in tree["files"].values() for line in text.split("\n"))
    assert seed_state("7-0") == tree
    assert session_digest(seed_state("7-0")) == session_digest(tree)
    assert seed_state("8-0")["files"] != tree["files"]
    for size, files in ((0, 1), (1, 1), (79, 1), (80, 1), (81, 2), (1_001, 3), (12_345, 7)):
        sized = seed_state("s", size, files)
        assert [len(text) for text in sized["files"].values()] == [
            size // files + (1 if index < size % files else 0) for index in range(files)
        ]
    with pytest.raises(ValueError, match="files >= 1"):
        seed_state("s", 10, 0)


def test_commands_are_deterministic_and_only_rm_changes_the_tree() -> None:
    state = seed_state("c", 500, 2)
    first, second = list(state["files"])
    assert run_command(state, "ls") == (f"{first}\n{second}", 0)
    assert run_command(state, f"cat {first}", max_output=10) == (state["files"][first][:10], 0)
    assert run_command(state, f"wc -c {first}") == (f"250 {first}", 0)
    digest = hashlib.sha256(state["files"][second].encode()).hexdigest()
    assert run_command(state, f"sha256sum {second}") == (f"{digest}  {second}", 0)
    assert run_command(state, "echo hello   world") == ("hello world", 0)
    assert run_command(state, "cat nowhere") == ("cat: nowhere: No such file or directory", 1)
    assert run_command(state, "cat") == ("cat: expected one file operand", 2)
    assert run_command(state, "python -c 1") == ("sh: python: command not found", 127)
    assert run_command(state, "echo 'unclosed")[1] == 2
    assert run_command(state, "") == ("", 0)
    assert len(state["files"]) == 2
    assert run_command(state, f"rm {first}") == ("", 0)
    assert list(state["files"]) == [second]


def test_the_kind_is_registered_as_a_resources_participant() -> None:
    app, loaded = build_server("sandbox", {"checkpoint": {"enabled": True, "control_auth_token": "t"}})
    assert PARTICIPANT_KINDS["sandbox"] == "resources"
    assert isinstance(loaded, SandboxConfig)
    assert app.state.participant.kind == "resources"
    assert app.state.participant.instance == "sandbox-0"


# --------------------------------------------------------------------------- routes


def test_sandbox_routes() -> None:
    async def main() -> None:
        app = sandbox_app()
        server: SandboxServer = app.state.server
        async with client(app) as http:
            seeded = await http.post(rp("r", "/seed_session"), json={"task_input": SMALL})
            assert seeded.json() == {"session": "r", "files": 4, "bytes": 2_000}
            assert seeded.headers["x-ng-checkpoint-verify"] == "wait"
            assert "x-ng-checkpoint-restart" not in seeded.headers
            assert server.sessions["r"] == seed_state("r", 2_000, 4)  # the rollout id is the default seed

            written = await http.post(rp("r", "/write_file"), json={"path": "a.txt", "content": "one\n"})
            assert written.json() == {"path": "a.txt", "bytes": 4}
            appended = await http.post(rp("r", "/write_file"), json={"path": "a.txt", "content": "two", "append": True})
            assert appended.json() == {"path": "a.txt", "bytes": 7}
            read = await http.post(rp("r", "/read_file"), json={"path": "a.txt"})
            assert read.json() == {"path": "a.txt", "content": "one\ntwo"}
            assert (await http.post(rp("r", "/read_file"), json={"path": "missing"})).status_code == 404

            ran = await http.post(rp("r", "/run_command"), json={"command": "wc -c a.txt"})
            assert ran.json() == {"output": "7 a.txt", "exit_code": 0, "index": 0}
            ran = await http.post(rp("r", "/run_command"), json={"command": "frobnicate"})
            assert ran.json() == {"output": "sh: frobnicate: command not found", "exit_code": 127, "index": 1}
            assert [entry["command"] for entry in server.sessions["r"]["history"]] == ["wc -c a.txt", "frobnicate"]

            digest = (await http.post(rp("r", "/digest"))).json()
            assert digest == {
                "sha256": session_digest(server.sessions["r"]),
                "files": 5,
                "bytes": 2_007,
                "history": 2,
            }
            wrong = await http.post(rp("r", "/verify"), json={"response": "", "expected_sha256": "0" * 64})
            assert wrong.json() == {"reward": 0.0}
            assert "r" not in server.sessions  # verify ends the session

            expected = await play(http, "q")
            right = await http.post(rp("q", "/verify"), json={"response": "done", "expected_sha256": expected})
            assert right.json() == {"reward": 1.0}
            await play(http, "s")
            assert (await http.post(rp("s", "/close_session"))).json() == {"closed": True}
            assert server.sessions == {}

            # a tool call on a session the server does not hold starts an empty tree
            ran = await http.post(rp("t", "/run_command"), json={"command": "ls"})
            assert ran.json() == {"output": "", "exit_code": 0, "index": 0}
            assert server.sessions["t"]["files"] == {}
            assert app.state.participant.counts()["sessions"] == 1

            too_big = await http.post(rp("u", "/seed_session"), json={"task_input": {"session_bytes": 1 << 40}})
            assert too_big.status_code == 422
            assert (await http.post(rp("u", "/seed_session"), json={"task_input": {"files": 0}})).status_code == 422
            assert (await http.post(rp("u", "/seed_session"), json={"task_input": {"seed": 5}})).status_code == 422
            unprefixed = await http.post("/digest")
            assert unprefixed.status_code == 400
            assert error_code(unprefixed) == "rollout_id_required"
            status = await Control(http).status()
            assert (status["mode"], status["verify"], status["instance"]) == ("exported", "wait", "sandbox-0")

    run(main())


def test_with_checkpointing_off_a_session_is_named_by_the_header() -> None:
    async def main() -> None:
        app = sandbox_app(enabled=False, session_bytes=300, files_per_session=3)
        async with client(app) as http:
            seeded = await http.post("/seed_session", json={"task_input": {}}, headers={"x-session-id": "mine"})
            assert seeded.json() == {"session": "mine", "files": 3, "bytes": 300}
            assert app.state.server.sessions["mine"] == seed_state("mine", 300, 3)
            listed = await http.post("/run_command", json={"command": "ls"}, headers={"x-session-id": "mine"})
            assert listed.json()["output"].count("\n") == 2
            assert (await http.post("/digest")).status_code == 400  # no session named

    run(main())


# --------------------------------------------------------------------------- checkpoints


def test_sessions_are_exported_and_restored_under_the_next_attempt(tmp_path: Path) -> None:
    async def main() -> None:
        directory = str(tmp_path / "ckpt")
        first = sandbox_app()
        async with client(first) as http:
            digests = {key: await play(http, key) for key in ("r", "q")}
            live = dict(first.state.server.sessions)
            committed = await Control(http).checkpoint("c1", directory, ["r", "q"])
            assert committed["episode_ids"] == ["q", "r"]
        with open_store(directory) as store:
            stored = {
                record["episode_id"]: record["state"]
                for record in store.read_participant("", kind="resources", instance="sandbox-0")
            }
        assert stored == live

        # every server process died: a fresh app restores and the replacement attempts continue
        restored_app = sandbox_app()
        async with client(restored_app) as http:
            control = Control(http)
            reply = await control.restore("c1", directory, ["r", "q"])
            assert reply["restored"] == ["q-a1", "r-a1"]
            await control.resume("c1")
            for key, digest in digests.items():
                assert (await http.post(rp(f"{key}-a1", "/digest"))).json()["sha256"] == digest
            ran = await http.post(rp("r-a1", "/run_command"), json={"command": "cat notes.txt"})
            assert ran.json() == {"output": "made by r\n", "exit_code": 0, "index": 2}
            stale = await http.post(rp("r", "/digest"))
            assert stale.status_code == 409
            assert error_code(stale) == "stale_attempt"
            verified = await http.post(rp("q-a1", "/verify"), json={"response": "", "expected_sha256": digests["q"]})
            assert verified.json() == {"reward": 1.0}

        # negative control: the same continuation without the restore gets the wrong reward
        bare = sandbox_app()
        async with client(bare) as http:
            verified = await http.post(rp("q-a1", "/verify"), json={"response": "", "expected_sha256": digests["q"]})
            assert verified.json() == {"reward": 0.0}

    run(main())


def test_the_export_hands_over_the_live_state_and_changes_wait_for_resume(tmp_path: Path) -> None:
    """No copy is made: the records are the sessions' own objects, which no request changes while the
    checkpoint is open (a write waits for resume; a seed replaces the session's object)."""

    async def main() -> None:
        app = sandbox_app()
        server: SandboxServer = app.state.server
        async with client(app) as http:
            control = Control(http)
            await play(http, "r")
            await play(http, "q")
            before = {key: session_digest(state) for key, state in server.sessions.items()}
            exported = await server.export_session_states(["r", "q", "gone"])
            assert set(exported) == {"r", "q"}
            assert all(exported[key] is server.sessions[key] for key in exported)

            prepared = await control.prepare("c1")
            assert prepared["report"]["ready"], prepared
            write = asyncio.create_task(
                http.post(rp("r", "/write_file"), json={"path": "late.txt", "content": "after the cut"})
            )
            participant = app.state.participant
            await bounded(until(lambda: participant.counts()["waiting"] == 1))
            committed = await control.commit("c1", str(tmp_path / "ckpt"), ["r", "q"])
            assert committed.status_code == 200, committed.text
            assert not write.done()
            with open_store(str(tmp_path / "ckpt")) as store:
                stored = {
                    record["episode_id"]: session_digest(record["state"])
                    for record in store.read_participant("", kind="resources", instance="sandbox-0")
                }
            assert stored == before
            reseed = await http.post(rp("q", "/seed_session"), json={"task_input": {"session_bytes": 10, "files": 1}})
            assert reseed.status_code == 200  # replay-safe: admitted while closed
            assert server.sessions["q"] is not exported["q"]  # a new object: the exported one is unchanged
            assert session_digest(exported["q"]) == before["q"]
            await control.resume("c1")
            assert (await bounded(write)).status_code == 200
            assert "late.txt" in server.sessions["r"]["files"]

    run(main())


def test_a_malformed_restored_state_is_refused_naming_its_session_and_nothing_is_installed(tmp_path: Path) -> None:
    good = seed_state("ok", 100, 1)
    bad_states: list[Any] = [
        ["not", "an", "object"],
        {"seed": "x", "files": {"a": 1}, "history": []},
        {"seed": "x", "files": {}, "history": [{"command": "ls", "exit_code": "0", "output": ""}]},
        {"seed": "x", "files": [], "history": []},
        {"files": {}, "history": []},
    ]

    async def main() -> None:
        for index, state in enumerate(bad_states):
            directory = tmp_path / f"ckpt-{index}"
            with open_store(str(directory)) as store:
                store.write_participant(
                    "",
                    kind="resources",
                    instance="sandbox-0",
                    checkpoint_id="c0",
                    records=[{"episode_id": "good", "state": good}, {"episode_id": "bad", "state": state}],
                )
            app = sandbox_app()
            async with client(app) as http:
                refused = await Control(http).call(
                    "restore", "c0", checkpoint_dir=str(directory), episode_ids=["good", "bad"]
                )
                assert refused.status_code == 422, refused.text
                assert error_code(refused) == "invalid_checkpoint_state"
                assert "'bad-a1'" in refused.json()["error"]["detail"], refused.text
                assert app.state.server.sessions == {}

    run(main())


def test_retire_frees_the_sessions_of_the_attempt_and_earlier_ones() -> None:
    async def main() -> None:
        app = sandbox_app()
        server: SandboxServer = app.state.server
        async with client(app) as http:
            await play(http, "r")
            await play(http, "q")
            reply = await Control(http).retire(["r"])
            assert reply["retired_count"] >= 1
            assert set(server.sessions) == {"q"}
            stale = await http.post(rp("r", "/digest"))
            assert stale.status_code == 409

    run(main())
