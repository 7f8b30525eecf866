"""The collector's files and plan, without servers: the dataset, the results file, the dispatch log,
the checkpoint root, and which rows a resume continues, fences or skips."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from gymckpt.collect.checkpoints import CheckpointRoot, PublishedCheckpoint, new_checkpoint_id
from gymckpt.collect.dataset import load_rows
from gymckpt.collect.journal import DispatchLog, PriorRun, ResultsFile, dispatch_log_path, ended
from gymckpt.collect.runner import plan_resume
from gymckpt.errors import InvalidDataset
from gymckpt.store import open_store

if TYPE_CHECKING:
    from pathlib import Path


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


# --- the dataset


def test_rows_get_their_ids_indexes_and_tasks(tmp_path: Path) -> None:
    data = write_lines(
        tmp_path / "d.jsonl",
        [
            json.dumps({"prompt": "a"}),
            "",
            json.dumps({"prompt": "b", "_ng_rollout_index": 3}),
            json.dumps({"prompt": "c", "_ng_rollout_id": "named.row_7", "_ng_task_index": 9}),
        ],
    )
    rows = load_rows(data)
    assert [(row.rollout_id, row.task_index, row.rollout_index, row.line) for row in rows] == [
        ("0-0", 0, 0, 1),
        ("1-3", 1, 3, 3),
        ("named.row_7", 9, 0, 4),
    ]
    assert [row.task for row in rows] == [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}]  # no _ng_ field sent
    assert rows[2].tagged(2) == {
        "_ng_rollout_id": "named.row_7",
        "_ng_task_index": 9,
        "_ng_rollout_index": 0,
        "_ng_attempt_index": 2,
    }


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ('{"_ng_rollout_id": "task-a2"}', ["task-a2", "reserved"]),
        ('{"_ng_rollout_id": "-bad"}', ["-bad"]),
        ('{"task": ', ["not valid JSON"]),
        ("[1, 2]", ["JSON object", "list"]),
        ('{"_ng_task_index": -1}', ["_ng_task_index", "-1"]),
        ('{"_ng_rollout_index": true}', ["_ng_rollout_index"]),
    ],
)
def test_a_bad_row_is_an_error_naming_the_file_and_line(tmp_path: Path, line: str, words: list[str]) -> None:
    data = write_lines(tmp_path / "d.jsonl", ['{"ok": 1}', '{"ok": 2}', line])
    with pytest.raises(InvalidDataset) as raised:
        load_rows(data)
    message = str(raised.value)
    assert message.startswith(f"{data}:3: ")
    assert raised.value.line == 3
    for word in words:
        assert word in message


def test_two_rows_with_one_id_are_an_error_naming_both_lines(tmp_path: Path) -> None:
    data = write_lines(tmp_path / "d.jsonl", ['{"_ng_rollout_id": "1-0"}', '{"x": 1}', "{}"])  # line 2 is 1-0 too
    with pytest.raises(InvalidDataset, match=r"d\.jsonl:2: rollout id '1-0' is already the id of line 1"):
        load_rows(data)


# --- the results file


def test_results_file_keeps_the_last_line_of_each_row_and_cuts_a_partial_tail(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    results = ResultsFile(out)
    assert results.load() == {}
    results.open()
    results.append({"_ng_rollout_id": "a", "_ng_attempt_index": 0, "failure": {"terminal": False}})
    results.append({"_ng_rollout_id": "a", "_ng_attempt_index": 1, "result": {"reward": 1.0}})
    results.append({"_ng_rollout_id": "b", "_ng_attempt_index": 0, "failure": {"terminal": True}})
    results.close()
    with open(out, "ab") as stream:
        stream.write(b'{"_ng_rollout_id": "c", "res')  # the collector died mid-write
    lines = ResultsFile(out).load()
    assert {key: line["_ng_attempt_index"] for key, line in lines.items()} == {"a": 1, "b": 0}
    assert out.read_bytes().endswith(b"}\n")  # the partial line is gone from the file too
    assert ended(lines["a"]) and ended(lines["b"]) and not ended(None)
    assert not ended({"_ng_rollout_id": "c", "failure": {"terminal": False}})


def test_a_damaged_results_line_in_the_middle_is_an_error_not_dropped(tmp_path: Path) -> None:
    out = write_lines(tmp_path / "r.jsonl", ['{"_ng_rollout_id": "a", "result": 1}', "garbage", "{}"])
    with pytest.raises(InvalidDataset, match=r"r\.jsonl:2: a damaged results line"):
        ResultsFile(out).load()
    assert out.read_text().count("\n") == 3  # nothing was cut


# --- the dispatch log


def test_dispatch_log_records_before_sending_and_carries_attempts_over(tmp_path: Path) -> None:
    path = dispatch_log_path(tmp_path / "results.jsonl")
    assert path.name == "results.dispatch.jsonl"
    log = DispatchLog(path)
    assert log.read() is None
    log.start("run-1", {"x": 4})

    async def send() -> None:
        await asyncio.gather(*(log.record(f"r{i}", i % 2) for i in range(20)), log.record("x", 5))

    asyncio.run(send())
    log.close()
    with open(path, "ab") as stream:
        stream.write(b'["r99", ')  # a partial last line
    prior = DispatchLog(path).read()
    assert prior is not None and prior.run_id == "run-1"
    assert prior.attempts == {**{f"r{i}": i % 2 for i in range(20)}, "x": 5}
    again = DispatchLog(path)
    again.start("run-2", {"r1": 1})
    again.close()
    assert DispatchLog(path).read() == PriorRun("run-2", {"r1": 1})


# --- the checkpoint root


def publish(root: Path, checkpoint_id: str, **extra: object) -> None:
    store = open_store(str(root / checkpoint_id))
    manifest = store.write_participant(
        "", kind="environment", instance="env", checkpoint_id=checkpoint_id, records=[{"episode_id": "0-0"}]
    )
    store.publish("", [manifest], extra=dict(extra))


def test_latest_is_the_newest_published_and_prune_keeps_k(tmp_path: Path) -> None:
    ids = sorted(new_checkpoint_id() for _ in range(3))
    for number, checkpoint_id in enumerate(ids):
        publish(tmp_path, checkpoint_id, run_id="run", created_at=1000.0 + number)
    unpublished = "ckpt-29991231T235959-00000000"  # newer-looking, never published (a crash mid-commit)
    open_store(str(tmp_path / unpublished)).write_participant(
        "", kind="environment", instance="env", checkpoint_id=unpublished, records=[]
    )
    (tmp_path / "notes.txt").write_text("the user's")
    root = CheckpointRoot(str(tmp_path))
    assert [item.checkpoint_id for item in root.published()] == ids
    latest = root.latest()
    assert latest is not None and latest.checkpoint_id == ids[-1]  # no LATEST yet: the newest published
    root.advance(ids[1])
    assert (tmp_path / "LATEST").read_text() == ids[1]
    assert root.latest().checkpoint_id == ids[1]  # type: ignore[union-attr]
    assert root.prune(2, current=ids[-1]) == sorted([ids[0], unpublished])
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([*ids[1:], "LATEST", "notes.txt"])
    # an index deleted mid-prune: no longer published, never a resume's source
    (tmp_path / ids[-1] / "gym" / "checkpoint.json").unlink()
    assert root.latest().checkpoint_id == ids[1]  # type: ignore[union-attr]
    assert root.reset() == sorted(ids[1:])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes.txt"]
    root.close()


# --- the resume plan


def row_file(tmp_path: Path, count: int) -> Path:
    return write_lines(tmp_path / "d.jsonl", [json.dumps({"n": n}) for n in range(count)])


def checkpoint(run_id: str, continued: dict[str, int], dispatched: dict[str, int]) -> PublishedCheckpoint:
    return PublishedCheckpoint(
        "ckpt-x",
        "/root/ckpt-x",
        {
            "run_id": run_id,
            "continued": [{"rollout_id": key, "attempt": attempt} for key, attempt in continued.items()],
            "dispatched": dispatched,
        },
    )


def test_resume_continues_the_checkpoints_rows_and_fences_the_others_the_run_sent(tmp_path: Path) -> None:
    rows = load_rows(row_file(tmp_path, 6))
    earlier = {
        "0-0": {"_ng_rollout_id": "0-0", "_ng_attempt_index": 0, "result": {}},  # ended: skipped
        "1-0": {"_ng_rollout_id": "1-0", "_ng_attempt_index": 0, "result": {}},  # ended though continued
        "4-0": {"_ng_rollout_id": "4-0", "_ng_attempt_index": 2, "failure": {"terminal": False}},
    }
    prior = PriorRun("run", {"0-0": 0, "1-0": 0, "2-0": 0, "3-0": 1, "4-0": 2})
    plan = plan_resume(rows, earlier, prior, checkpoint("run", {"1-0": 0, "2-0": 0}, {"2-0": 0, "3-0": 0}))
    assert plan.continued == {"2-0": 0}
    assert plan.fenced == {"3-0": 1, "4-0": 2}
    assert plan.attempts == {"2-0": 1, "3-0": 2, "4-0": 3}  # 5-0 was never sent: attempt 0


def test_a_checkpoint_of_another_run_is_not_restored_and_its_rows_are_fenced(tmp_path: Path) -> None:
    rows = load_rows(row_file(tmp_path, 3))
    plan = plan_resume(rows, {}, PriorRun("newer", {"0-0": 1}), checkpoint("older", {"0-0": 0}, {"1-0": 0}))
    assert plan.checkpoint is None and plan.continued == {}
    assert plan.fenced == {"0-0": 1}
    # without a dispatch log the checkpoint's own record of dispatched rows is used
    alone = plan_resume(rows, {}, None, checkpoint("older", {"0-0": 0}, {"0-0": 0, "1-0": 0}))
    assert alone.continued == {"0-0": 0} and alone.fenced == {"1-0": 0}
    assert alone.attempts == {"0-0": 1, "1-0": 1}


def run_cli(tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "settings.yaml"
    config.write_text("checkpoint:\n  enabled: true\n  control_auth_token: t0ken\n")
    command = [sys.executable, "-m", "gymckpt", "collect", *arguments, "--config", str(config), "--json"]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_a_finished_collection_resumes_to_nothing_without_servers_and_a_fresh_one_is_not_overwritten(
    tmp_path: Path,
) -> None:
    data = row_file(tmp_path, 2)
    out = write_lines(
        tmp_path / "r.jsonl",
        [json.dumps({"_ng_rollout_id": f"{n}-0", "_ng_attempt_index": 0, "result": {"n": n}}) for n in range(2)],
    )
    nowhere = "http://127.0.0.1:9"  # nothing listens: a finished collection needs no server
    done = run_cli(tmp_path, str(data), "--environment", nowhere, "--out", str(out), "--resume")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert (summary["rows"], summary["skipped"], summary["finished"]) == (2, 2, 0)
    refused = run_cli(tmp_path, str(data), "--environment", nowhere, "--out", str(out))
    assert refused.returncode == 2
    assert "exists: pass --resume" in refused.stderr
    assert out.read_text().count("\n") == 2  # untouched
