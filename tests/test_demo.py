"""``gymckpt demo`` (D2): a small demo end to end, through the Python API and as a real process.

Each full run starts the reference stack twice (the uninterrupted run, then the demo's own
stack) and restarts it once, so each takes several seconds on two cores.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from gymckpt.demo import run_demo
from gymckpt.demo.report import EXIT_DIFFERS, EXIT_OK, EXIT_SETUP, EXIT_TERMINATED, compare_results
from gymckpt.demo.s3 import S3_EXTRA
from gymckpt.store import verify

ROLLOUTS = 8


def console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, width=200, color_system=None), buffer


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # each server ran in a process group of its own


def table_value(text: str, row: str) -> str:
    match = re.search(rf"│ {re.escape(row)}\s*│\s*(\S+)\s*│", text)
    assert match is not None, f"no row {row!r} in\n{text}"
    return match.group(1)


def test_demo_checkpoints_kills_restores_and_continues(tmp_path: Path) -> None:
    out, table = console()
    progress, lines = console()
    outcome = run_demo(
        rollouts=ROLLOUTS,
        store_url=str(tmp_path / "ckpts"),
        console=out,
        progress_console=progress,
        logs_dir=tmp_path,
    )

    assert outcome.exit_code == EXIT_OK, (outcome.error, lines.getvalue(), table.getvalue())
    assert outcome.lost == [] and outcome.differing == []
    # every rollout ended exactly one way: finished before the checkpoint, continued, or restarted
    finished, continued, restarted = set(outcome.finished_before), set(outcome.continued), set(outcome.restarted)
    assert len(finished) + len(continued) + len(restarted) == ROLLOUTS
    assert finished | continued | restarted == {f"{i}-0" for i in range(ROLLOUTS)}
    assert outcome.continued == outcome.exported
    # the checkpoint was taken once half had finished: the others were in flight (a few may end during it)
    assert len(outcome.finished_before) >= ROLLOUTS // 2
    assert 1 <= len(outcome.exported) <= ROLLOUTS - ROLLOUTS // 2
    assert outcome.mean_reward == outcome.reference_mean_reward == 1.0
    assert outcome.prepare_seconds > 0 and outcome.commit_seconds > 0 and outcome.restore_seconds > 0
    assert outcome.bytes_written > 0
    assert outcome.records_by_participant["environment/environment"] == len(outcome.exported)
    # generation cuts: no held call generated again from its first token, almost no token generated twice
    assert outcome.held_from_first_token == 0
    assert outcome.tokens_generated_again <= 0.05 * outcome.tokens_in_flight
    assert outcome.tokens_kept_by_cuts <= outcome.tokens_in_flight
    # two workers per Gym server before the crash, three after: the restore landed on another count
    gym = ("model", "resources", "agent", "environment")
    assert outcome.workers_before == dict.fromkeys(gym, 2)
    assert outcome.workers_after == dict.fromkeys(gym, 3)

    # the table and the progress lines
    text = table.getvalue()
    assert table_value(text, "finished before the checkpoint") == str(len(outcome.finished_before))
    assert table_value(text, "exported") == str(len(outcome.exported))
    assert table_value(text, "continued") == str(len(outcome.continued))
    assert table_value(text, "lost") == "0"
    assert table_value(text, "results differing") == "0"
    assert table_value(text, "bytes written") == f"{outcome.bytes_written:,}"
    assert table_value(text, "verify") == "OK"
    assert re.search(r"│ workers per Gym server\s*│\s*2 → 3\s*│", text), text
    assert table_value(text, "held calls from token 0") == "0"
    assert table_value(text, "tokens kept by cuts") == f"{outcome.tokens_kept_by_cuts:,}"
    assert table_value(text, "tokens generated again") == f"{outcome.tokens_generated_again:,}"
    assert f"check it yourself: gymckpt verify {outcome.checkpoint_dir}" in text
    for phase in ("uninterrupted run", "checkpoint", "SIGKILL", "restored", "continued", "verify"):
        assert phase in lines.getvalue()

    # the checkpoint lies under the store root and verifies offline, published and clean
    assert outcome.checkpoint_dir.startswith(str(tmp_path / "ckpts"))
    report = verify(outcome.checkpoint_dir)
    assert report.ok and report.findings == []
    assert len(report.participants) == 4
    assert (tmp_path / "ckpts" / outcome.checkpoint_id / "gym" / "checkpoint.json").is_file()

    assert outcome.logs_dir == ""  # a clean run removes the servers' configs and logs
    assert [path.name for path in tmp_path.iterdir()] == ["ckpts"]
    # no server outlives the demo: both stacks, and the restarted processes
    assert len(outcome.server_pids) == 5 + 5 + 4
    assert_gone(outcome.server_pids)


def test_sigterm_stops_the_demo_and_every_server_it_started(tmp_path: Path) -> None:
    import psutil

    demo = subprocess.Popen(
        [sys.executable, "-m", "gymckpt", "demo", "--rollouts", "8", "--store", str(tmp_path / "store")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200"},
    )
    try:
        seen = b""
        deadline = time.monotonic() + 120
        # the progress line once the first stack answers: its servers are running
        while b"the reference stack answers" not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([demo.stderr], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(demo.stderr.fileno(), 65536) if ready else b""  # type: ignore[union-attr]
            if ready and not chunk:
                break  # the demo ended
            seen += chunk
        assert b"the reference stack answers" in seen, seen.decode(errors="replace")
        servers = [child.pid for child in psutil.Process(demo.pid).children(recursive=True)]
        assert len(servers) >= 5, servers
        demo.send_signal(signal.SIGTERM)
        out, _ = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.communicate()
    assert demo.returncode == EXIT_TERMINATED
    assert "stopped by SIGTERM" in out.decode()
    assert_gone(servers)


def test_demo_as_a_process(tmp_path: Path) -> None:
    store = tmp_path / "store"
    result = subprocess.run(
        [sys.executable, "-m", "gymckpt", "demo", "--rollouts", str(ROLLOUTS), "--store", str(store)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    )
    assert result.returncode == 0, (result.stdout, result.stderr)
    finished = int(table_value(result.stdout, "finished before the checkpoint"))
    continued = int(table_value(result.stdout, "continued"))
    restarted = int(table_value(result.stdout, "restarted"))
    assert finished + continued + restarted == ROLLOUTS
    assert table_value(result.stdout, "lost") == "0"
    assert table_value(result.stdout, "results differing") == "0"
    assert "SIGKILL" in result.stderr
    (checkpoint,) = [path for path in store.iterdir() if path.name.startswith("demo-")]
    assert f"gymckpt verify {checkpoint}" in result.stdout
    checked = subprocess.run(
        [sys.executable, "-m", "gymckpt", "verify", str(checkpoint)], capture_output=True, timeout=60, check=False
    )
    assert checked.returncode == 0, checked.stdout


def test_a_store_root_that_cannot_hold_checkpoints_is_a_setup_failure(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out, table = console()
    outcome = run_demo(rollouts=2, store_url=str(blocker / "ckpts"), console=out, logs_dir=tmp_path)
    assert outcome.exit_code == EXIT_SETUP
    assert "cannot create the store root" in table.getvalue()
    assert outcome.server_pids == []
    assert outcome.logs_dir == ""  # no stack was started


def test_a_lost_or_different_result_is_found() -> None:
    reference = {"0-0": {"reward": 1.0, "response": "answer 1"}, "1-0": {"reward": 1.0, "response": "answer 2"}}
    assert compare_results(reference, dict(reference)) == ([], [])
    assert compare_results(reference, {"0-0": reference["0-0"]}) == (["1-0"], [])
    assert compare_results(reference, {**reference, "1-0": {"reward": 0.0, "response": "answer 2"}}) == ([], ["1-0"])
    assert compare_results(reference, {**reference, "0-0": {"reward": 1.0, "response": "other"}}) == ([], ["0-0"])
    assert EXIT_DIFFERS == 1


def test_demo_with_an_embedded_s3_endpoint(tmp_path: Path) -> None:
    pytest.importorskip("moto")
    from gymckpt.demo import run_s3_demo

    out, table = console()
    outcome = run_s3_demo(rollouts=ROLLOUTS, console=out, logs_dir=tmp_path, workers=1, restore_workers=1)
    assert outcome.exit_code == EXIT_OK, (outcome.error, table.getvalue())
    assert outcome.checkpoint_dir.startswith("s3://gymckpt-demo/checkpoints/demo-")
    assert outcome.lost == [] and outcome.differing == []
    assert outcome.verified
    assert "embedded S3 endpoint" in table.getvalue()
    assert_gone(outcome.server_pids)


def _demo_with_continuation_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Any) -> tuple[Any, str]:
    """Four rollouts, one worker, with ``change(results, failed)`` applied to what the continuation returned."""
    from gymckpt.demo import full as demo

    original = demo._Demo._continue

    async def changed(self: demo._Demo, *args: object) -> tuple[dict[str, object], list[object]]:
        results, failed = await original(self, *args)
        return change(results, failed)

    monkeypatch.setattr(demo._Demo, "_continue", changed)
    out, table = console()
    outcome = run_demo(
        rollouts=4, store_url=str(tmp_path / "ckpts"), console=out, logs_dir=tmp_path, workers=1, restore_workers=1
    )
    assert_gone(outcome.server_pids)
    return outcome, table.getvalue()


def test_a_continued_result_that_differs_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def differ(results: dict[str, Any], failed: list[Any]) -> tuple[dict[str, Any], list[Any]]:
        first = sorted(results)[0]
        return {**results, first: {**results[first], "reward": 0.0}}, failed

    outcome, text = _demo_with_continuation_changed(tmp_path, monkeypatch, differ)
    assert outcome.exit_code == EXIT_DIFFERS
    assert len(outcome.differing) == 1
    assert table_value(text, "results differing") == "1"
    assert "demo failed: 1 result differs" in text
    assert outcome.verified  # the checkpoint itself is fine
    assert outcome.logs_dir.startswith(str(tmp_path))  # kept for a failed demo
    assert (Path(outcome.logs_dir) / "demo" / "environment.log").is_file()


def test_a_lost_rollout_is_named_with_the_reason_its_attempt_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(results: dict[str, Any], failed: list[Any]) -> tuple[dict[str, Any], list[Any]]:
        why = {"failure": {"failure_reason": "the agent gave no reply", "terminal": False}}
        return {**results, sorted(results)[0]: None}, [*failed, why]

    outcome, text = _demo_with_continuation_changed(tmp_path, monkeypatch, fail)
    assert outcome.exit_code == EXIT_DIFFERS
    assert len(outcome.lost) == 1
    assert outcome.lost_reasons == "after the restore: 1 × the agent gave no reply"
    assert "demo failed: 1 rollout lost (after the restore: 1 × the agent gave no reply)" in " ".join(text.split())


def test_a_rollout_refused_while_the_checkpoint_is_open_starts_over_after_the_restore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``/run`` that reaches the environment after the prepare is 409 ``checkpoint_parked``: never admitted, so
    the demo starts it after the restore like any rollout not exported; it is neither lost nor a failure."""
    from gymckpt.demo import full as demo

    launch, checkpoint = demo.launch_rollouts, demo._Demo._checkpoint
    late: dict[str, Any] = {}

    async def launch_all_but_the_last(stack: Any, tasks: dict[str, Any], **options: Any) -> Any:
        *early, last = tasks
        launched = await launch(stack, {key: tasks[key] for key in early}, **options)
        gate = asyncio.Event()

        async def after_the_prepare() -> dict[str, Any]:
            await gate.wait()
            late["reply"] = await stack.run(last, tasks[last])
            return late["reply"]  # type: ignore[no-any-return]

        late.update(key=last, gate=gate, task=options["spawn"](after_the_prepare()))
        launched.runs[last] = late["task"]
        return launched

    async def checkpoint_then_the_late_run(self: Any, *args: Any) -> list[str]:
        exported = await checkpoint(self, *args)
        late["gate"].set()  # the checkpoint is committed and the stack not yet killed: admission is closed
        await late["task"]
        return exported  # type: ignore[no-any-return]

    monkeypatch.setattr(demo, "launch_rollouts", launch_all_but_the_last)
    monkeypatch.setattr(demo._Demo, "_checkpoint", checkpoint_then_the_late_run)
    out, table = console()
    outcome = run_demo(
        rollouts=4, store_url=str(tmp_path / "ckpts"), console=out, logs_dir=tmp_path, workers=1, restore_workers=1
    )
    assert_gone(outcome.server_pids)
    assert late["reply"]["status"] == 409 and late["reply"]["error"]["code"] == "checkpoint_parked", late["reply"]
    assert outcome.exit_code == EXIT_OK, (outcome.error, table.getvalue())
    assert outcome.refused_at_checkpoint == [late["key"]]
    assert late["key"] in outcome.restarted and not outcome.lost and not outcome.differing
    assert "1 refused while the checkpoint was open" in " ".join(table.getvalue().split())


@pytest.mark.parametrize("name", ["[bold]x", "d[/]x", "[red]r[/red]"])
def test_markup_in_the_store_path_is_printed_as_written(tmp_path: Path, name: str) -> None:
    from gymckpt.demo import run_store_demo

    out, text = console()
    root = tmp_path / name
    assert run_store_demo(str(root), episodes=4, seed=0, console=out) == EXIT_OK
    assert f"check it yourself: gymckpt verify {root}/demo-" in text.getvalue()
    blocked = tmp_path / "file"
    blocked.write_text("x")
    out, text = console()
    outcome = run_demo(rollouts=2, store_url=str(blocked / name), console=out, logs_dir=tmp_path)
    assert outcome.exit_code == EXIT_SETUP
    assert f"{blocked / name}" in text.getvalue()


@pytest.mark.parametrize("store_only", [False, True], ids=["full", "store-only"])
def test_store_s3_without_moto_names_the_extra(monkeypatch: pytest.MonkeyPatch, store_only: bool) -> None:
    from click.testing import CliRunner

    from gymckpt.cli import main

    monkeypatch.setitem(sys.modules, "moto", None)  # as if moto were not installed: importing it fails
    args = ["demo", "--store", "s3", "--rollouts", "2", *(["--store-only"] if store_only else [])]
    result = CliRunner().invoke(main, args, env={"COLUMNS": "200"}, catch_exceptions=False)
    assert result.exit_code == EXIT_SETUP, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: gymckpt demo --store s3 needs moto")
    assert "moto is not installed" in line
    assert line.endswith(S3_EXTRA)
    assert "Traceback" not in result.output
    assert result.stdout == ""  # nothing started: no table


def test_generation_tokens_counts_what_cuts_kept_and_what_was_generated_again() -> None:
    from gymckpt.demo.measure import generation_tokens

    before = [
        {"call_id": "a-0:0", "tokens": [1] * 8},  # delivered before the checkpoint
        {"call_id": "a-0:1", "tokens": [1] * 8},  # completed, held: never delivered
    ]
    after = [
        *before,
        {"call_id": "a-0-a1:1", "tokens": [1] * 8, "generated": 0, "continued_from": 8},  # kept whole
        {"call_id": "b-0-a1:0", "tokens": [1] * 8, "generated": 5, "continued_from": 3},  # cut mid-way
        {"call_id": "c-0-a1:0", "tokens": [1] * 8, "generated": 8, "continued_from": 0},  # a new turn
        {"call_id": "z-0-a1:0", "tokens": [1] * 8, "generated": 8, "continued_from": 0},  # not exported
    ]
    tokens = generation_tokens(before, after, ["a-0", "b-0", "c-0"])
    assert (tokens.in_flight, tokens.kept, tokens.generated_again, tokens.from_first_token) == (16, 11, 0, 0)
    redone = [*before, {"call_id": "a-0-a1:1", "tokens": [1] * 8, "generated": 8, "continued_from": 0}]
    again = generation_tokens(before, redone, ["a-0"])
    assert (again.in_flight, again.kept, again.generated_again, again.from_first_token) == (8, 0, 8, 1)
    # the checkpoint held only the first call (the second reached the backend after the export)
    late = generation_tokens(before, redone, ["a-0"], held_calls=["a-0:0", "b-0:1"])
    assert (late.in_flight, late.kept, late.generated_again, late.from_first_token) == (8, 0, 0, 0)
    # a cut that kept tokens, yet the replacement started from the first token: caught though it never completed
    cut = [*before, {"call_id": "b-0-a1:0", "tokens": [1] * 8, "generated": 8, "continued_from": 0}]
    lost = generation_tokens(before, cut, ["a-0", "b-0"], held_calls=["a-0:0", "a-0:1", "b-0:0"])
    assert (lost.in_flight, lost.kept, lost.generated_again, lost.from_first_token) == (8, 0, 0, 1)


def test_held_model_calls_are_the_completed_ones_and_what_the_model_records_kept(tmp_path: Path) -> None:
    from gymckpt.demo.measure import held_model_calls
    from gymckpt.store import open_store

    def cut(call_id: str, tokens: int) -> dict[str, object]:
        return {"model_call_id": call_id, "continuation": {"prefix_token_count": tokens, "staging_keys": ["k"]}}

    store = open_store(str(tmp_path))
    manifest = store.write_participant(
        "ck",
        kind="model",
        instance="model-0",
        checkpoint_id="ck",
        records=[
            {"episode_id": "a-0", "rows": [{"model_call_id": "a-0:0"}], "generation_cuts": [cut("a-0:1", 3)]},
            {"episode_id": "b-0", "rows": [], "generation_cuts": [cut("b-0:0", 0)]},  # kept no token
            {"episode_id": "c-0", "rows": [{"model_call_id": "c-0:0"}], "generation_cuts": []},  # not exported
        ],
    )
    store.publish("ck", [manifest])
    completed = [{"call_id": "d-0:2"}]
    held = held_model_calls(str(tmp_path / "ck"), {}, ["a-0", "b-0"], completed)
    assert held == {"a-0:0", "a-0:1", "d-0:2"}


def test_read_stages_counts_where_the_exported_rollouts_stood(tmp_path: Path) -> None:
    from gymckpt.demo.measure import read_stages
    from gymckpt.store import open_store

    tool = {"role": "tool", "content": "1"}
    store = open_store(str(tmp_path))
    environment = store.write_participant(
        "ck",
        kind="environment",
        instance="environment-0",
        checkpoint_id="ck",
        records=[
            {"episode_id": "a-0", "boundary": {"stage": "invoke_agent"}},
            {"episode_id": "b-0", "boundary": {"stage": "invoke_agent"}},
            {"episode_id": "c-0", "boundary": {"stage": "verify"}},
            {"episode_id": "d-0", "boundary": {"stage": "invoke_agent"}},  # not exported
        ],
    )
    agent = store.write_participant(
        "ck",
        kind="agent",
        instance="agent-0",
        checkpoint_id="ck",
        records=[
            {"episode_id": "a-0", "boundary": {"messages": [{"role": "user"}, tool, tool]}},
            {"episode_id": "b-0", "boundary": {"messages": [{"role": "user"}]}},
        ],
    )
    store.publish("ck", [environment, agent])
    said: list[str] = []
    stages = asyncio.run(read_stages(str(tmp_path / "ck"), {}, ["a-0", "b-0", "c-0"], said.append))
    assert stages == {"agent turn 3": 1, "agent turn 1": 1, "verifying": 1}
    assert said == []


def test_read_stages_says_in_one_line_when_it_cannot_read_them(tmp_path: Path) -> None:
    """Only a figure of the demo's table: a checkpoint it cannot read is said, never silently zero."""
    from gymckpt.demo.measure import read_stages

    said: list[str] = []
    stages = asyncio.run(read_stages(str(tmp_path / "missing"), {}, ["a-0"], said.append))
    assert stages == {}
    assert len(said) == 1
    assert said[0].startswith("where the exported rollouts stood could not be read")
    assert "Error" in said[0]
    assert asyncio.run(read_stages(str(tmp_path / "missing"), {}, [], said.append)) == {}
    assert len(said) == 1  # nothing exported: nothing to read, nothing said


def test_a_failed_uninterrupted_run_prints_one_line_naming_the_failure_not_a_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 15: a reply that is not JSON (a proxy's error page) fails the demo with one line, no table of zeros."""
    import json

    from gymckpt.stack.harness import RolloutHarness

    original = RolloutHarness.run
    calls = 0

    async def garbled(self: RolloutHarness, episode_id: str, task: dict[str, object]) -> dict[str, object]:
        nonlocal calls
        calls += 1
        if episode_id.startswith("1-"):
            raise json.JSONDecodeError("Expecting value", "<html>bad gateway</html>", 0)
        return await original(self, episode_id, task)

    monkeypatch.setattr(RolloutHarness, "run", garbled)
    out, table = console()
    progress, _ = console()
    outcome = run_demo(
        rollouts=3,
        store_url=str(tmp_path / "ckpts"),
        console=out,
        progress_console=progress,
        logs_dir=tmp_path,
        workers=1,
        restore_workers=1,
    )
    assert outcome.exit_code == EXIT_SETUP
    assert calls == 3  # the other rollouts ran to their end: one failure does not cancel them
    printed = table.getvalue().splitlines()
    assert printed[0].startswith("demo failed: the uninterrupted run failed for 1 of 3 rollouts (e.g. 1-0): ")
    assert "1 × JSONDecodeError: Expecting value" in printed[0]
    assert printed[1:] == [f"server logs: {outcome.logs_dir}"]
    assert "│" not in table.getvalue() and "Traceback" not in table.getvalue()
    assert_gone(outcome.server_pids)


def test_an_unexpected_error_is_one_line_and_its_traceback_is_kept_in_the_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gymckpt.demo import full as demo

    async def broken(self: demo._Demo, *args: object) -> object:
        raise KeyError("a bug in a phase")

    monkeypatch.setattr(demo._Demo, "_launch_until_checkpoint", broken)
    out, table = console()
    progress, lines = console()
    outcome = run_demo(
        rollouts=2, store_url=str(tmp_path / "ckpts"), console=out, progress_console=progress, logs_dir=tmp_path
    )
    assert outcome.exit_code == EXIT_DIFFERS
    first, second = table.getvalue().splitlines()
    traceback_file = Path(outcome.logs_dir) / "traceback.txt"
    assert (
        first
        == f"demo failed: KeyError: 'a bug in a phase' (an unexpected error: its traceback is in {traceback_file})"
    )
    assert second == f"server logs: {outcome.logs_dir}"
    assert "_launch_until_checkpoint" in traceback_file.read_text()
    assert "Traceback" not in lines.getvalue() + table.getvalue()
    assert_gone(outcome.server_pids)


def test_failure_summary_counts_error_bodies_by_code_with_one_example() -> None:
    from gymckpt.demo.report import failure_summary, refused_at_checkpoint

    def parked(episode: str) -> dict[str, Any]:
        detail = f"a checkpoint is open: episode '{episode}' cannot start now; retry it after resume"
        return {"error": {"code": "checkpoint_parked", "detail": detail}, "status": 409}

    replies = [parked("1-0"), parked("2-0"), {"error": {"code": "checkpoint_parked"}, "status": 200}]
    assert [refused_at_checkpoint(reply) for reply in replies] == [True, True, False]
    assert failure_summary(replies[:2]) == (
        "2 × HTTP 409 checkpoint_parked (e.g. HTTP 409: {'code': 'checkpoint_parked', 'detail': \"a checkpoint is "
        "open: episode '1-0' cannot start now; retry it after resume\"})"
    )


def test_failure_summary_counts_the_commonest_reasons() -> None:
    from gymckpt.demo.report import failure_summary

    replies = [
        {"result": {"reward": 1.0}, "status": 200},
        {"failure": {"failure_reason": "resources: server disconnected", "terminal": False}, "status": 200},
        {"failure": {"failure_reason": "resources: server disconnected", "terminal": False}, "status": 200},
        ConnectionResetError(104, "Connection reset by peer"),
        {"body": "<html>\n bad gateway</html>", "status": 502},
    ]
    assert failure_summary(replies) == (
        "2 × resources: server disconnected; 1 × ConnectionResetError: [Errno 104] Connection reset by peer; "
        "1 × HTTP 502: <html> bad gateway</html>"
    )
    assert failure_summary(replies[:1]) == ""
