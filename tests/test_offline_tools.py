"""The offline tools say what they see: ``inspect`` fits the terminal (no word broken across lines) and
marks a missing or resized records file damaged; ``verify`` tells a failed commit's directory, an
unpublished checkpoint and a published one apart, in its last lines and in ``--json``."""

from __future__ import annotations

import json
import re
import shutil
from typing import TYPE_CHECKING, Any

import pytest
from click.testing import CliRunner, Result
from rich.cells import cell_len

from gymckpt.cli import main
from gymckpt.store import open_store
from gymckpt.testing.values import sample_records

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from gymckpt.store.manifest import Manifest

#: the environment in which the command's rich consoles are a terminal (rich reads it when the command runs)
TERMINAL = {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1", "TERM": "xterm-256color"}
PIPE = {"FORCE_COLOR": None, "TTY_COMPATIBLE": None, "COLUMNS": "200"}
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

#: names as long as real runs give them
CHECKPOINT = "ckpt-20240611T101500-7f3a9c21"
CHECKPOINT_ID = "step-700-run-2024-06-11"
PARTICIPANTS = [("environment", "env-0"), ("agent", "simple-agent-0"), ("resources", "notes-server-0")]
EXTRA = {"dataset_name": "math-reasoning-v2", "sampling_temperature": 0.7, "policy_version": "policy-step-700"}


def run(*args: str, columns: int | None = None) -> Result:
    """The command through click's runner: on a terminal ``columns`` wide, or into a pipe."""
    shown = PIPE if columns is None else {**TERMINAL, "COLUMNS": str(columns)}
    return CliRunner().invoke(main, list(args), env={"GYMCKPT_ENDPOINT_URL": None, **shown})


def plain(output: str) -> str:
    return ANSI.sub("", output)


def commit(root: Path, checkpoint: str = CHECKPOINT, *, publish: bool = True) -> list[Manifest]:
    """The participants of :data:`PARTICIPANTS` with 12 records each, published unless told otherwise."""
    with open_store(str(root)) as store:
        manifests = [
            store.write_participant(
                checkpoint,
                kind=kind,
                instance=instance,
                checkpoint_id=CHECKPOINT_ID,
                records=sample_records(12, prefix="rollout-"),
                extra=EXTRA,
            )
            for kind, instance in PARTICIPANTS
        ]
        if publish:
            store.publish(checkpoint, manifests)
    return manifests


def failed_commit(root: Path, checkpoint: str, kind: str = "environment", instance: str = "env-0") -> Path:
    """A commit whose records stop with an error: the store removes its temporary file and leaves the
    participant directory, empty (what the issue met on disk). Returns that directory."""

    def records() -> Iterator[dict[str, Any]]:
        yield from sample_records(2)
        raise RuntimeError("the policy crashed mid-export")

    with open_store(str(root)) as store, pytest.raises(RuntimeError, match="mid-export"):
        store.write_participant(checkpoint, kind=kind, instance=instance, checkpoint_id="x", records=records())
    directory = root / checkpoint / "gym" / kind / instance
    assert directory.is_dir() and list(directory.iterdir()) == []
    return directory


# --- inspect fits the terminal


@pytest.mark.parametrize("columns", [60, 80, 100])
def test_inspect_on_a_terminal_breaks_no_word_across_lines(tmp_path: Path, columns: int) -> None:
    root = tmp_path / "store"
    commit(root)
    result = run("inspect", str(root), columns=columns)
    assert result.exit_code == 0, result.output
    lines = plain(result.stdout).splitlines()
    assert all(cell_len(line) <= columns for line in lines), "\n".join(lines)
    words = [CHECKPOINT, CHECKPOINT_ID, *EXTRA, *(f"{kind}/{instance}" for kind, instance in PARTICIPANTS)]
    words += ["rollout-0", "rollout-1", "rollout-10"]  # the first episodes, in order
    for word in words:
        assert any(re.search(rf"(?<![\w/-]){re.escape(word)}(?![\w/-])", line) for line in lines), (
            word,
            "\n".join(lines),
        )
    assert sum(f"{kind}/{instance}" in line for line in lines for kind, instance in PARTICIPANTS) == 3


def test_inspect_on_a_wide_terminal_is_one_table_row_per_participant(tmp_path: Path) -> None:
    root = tmp_path / "store"
    commit(root)
    lines = plain(run("inspect", str(root), columns=300).stdout).splitlines()
    for kind, instance in PARTICIPANTS:
        (row,) = [line for line in lines if f"{kind}/{instance}" in line]
        assert all(word in row for word in (CHECKPOINT, CHECKPOINT_ID, "12", *EXTRA)), row


def test_inspect_on_a_narrow_terminal_marks_damage_in_the_block(tmp_path: Path) -> None:
    root = tmp_path / "store"
    environment, *_ = commit(root)
    (root / environment.records_path).unlink()
    text = plain(run("inspect", str(root), columns=60).stdout)
    block = text[text.index("environment/env-0") :].split("\n\n")[0]
    assert "damaged" in block and "records_missing" in block, text


# --- inspect marks a missing or resized records file damaged


def test_inspect_marks_a_missing_truncated_or_grown_records_file_damaged(tmp_path: Path) -> None:
    root = tmp_path / "store"
    environment, agent, resources = commit(root)
    (root / environment.records_path).unlink()
    truncated = root / agent.records_path
    truncated.write_bytes(truncated.read_bytes()[:100])
    with (root / resources.records_path).open("ab") as grown:
        grown.write(b'{"episode_id":"late"}\n')

    result = run("inspect", str(root))
    assert result.exit_code == 0, result.output  # a listing: damage is marked, not an exit status
    damaged = {line.split("\t")[1]: line.split("\t")[2:] for line in result.stdout.splitlines()}
    assert damaged == {
        "environment/env-0": ["damaged", "records_missing: records file is missing"],
        "agent/simple-agent-0": [
            "damaged",
            f"records_size_mismatch: records file has 100 bytes, manifest says {agent.records_bytes}",
        ],
        "resources/notes-server-0": [
            "damaged",
            f"records_size_mismatch: records file has {resources.records_bytes + 22} bytes, "
            f"manifest says {resources.records_bytes}",
        ],
    }
    rows = {row["participant"]: row for row in json.loads(run("inspect", str(root), "--json").stdout)}
    assert rows["environment/env-0"]["damaged"].startswith("records_missing: ")
    assert rows["agent/simple-agent-0"]["damaged"].startswith("records_size_mismatch: ")
    assert rows["agent/simple-agent-0"]["record_count"] == 12  # the manifest was read: its fields are kept

    on_terminal = plain(run("inspect", str(root), columns=300).stdout)
    assert on_terminal.count("damaged") == 3 and "records_missing" in on_terminal, on_terminal


def test_inspect_hashes_nothing_and_says_verify_is_the_full_check(tmp_path: Path) -> None:
    root = tmp_path / "store"
    environment, *_ = commit(root)
    flipped = root / environment.records_path
    data = bytearray(flipped.read_bytes())
    data[10] ^= 1  # the same size: only a re-hash finds it
    flipped.write_bytes(bytes(data))
    assert "damaged" not in run("inspect", str(root)).stdout
    assert run("verify", str(root)).exit_code == 1

    text = " ".join(plain(run("inspect", "--help").stdout).split())
    assert "records file is missing or of another size than the manifest's records_bytes" in text, text
    assert "re-hashes nothing" in text and "`gymckpt verify URL` is the full check" in text, text


# --- verify: unfinished, unpublished, published


def last_lines(result: Result) -> list[str]:
    """The verdict: the lines after the summary line (``N checkpoint(s) …``)."""
    lines = plain(result.stdout).splitlines()
    summary = next(index for index, line in enumerate(lines) if re.match(r"\d+ checkpoint\(s\)", line))
    return lines[summary + 1 :]


def test_verify_of_the_directory_a_failed_commit_left_says_unfinished(tmp_path: Path) -> None:
    root = tmp_path / "store"
    directory = failed_commit(root, "step-9")
    for url, name in ((root / "step-9", ""), (root, "step-9")):
        result = run("verify", str(url))
        assert result.exit_code == 0, result.output  # a warning, not damage
        assert "no gym/ directory" not in result.output
        path = str(directory.relative_to(url))
        index = str((root / "step-9" / "gym" / "checkpoint.json").relative_to(url))
        found = sorted(line.split("\t")[:4] for line in plain(result.stdout).splitlines() if "\t" in line)
        assert found == [
            ["warning", "checkpoint_unpublished", "-", index],
            ["warning", "unfinished_commit", "environment/env-0", path],
        ], found
        assert "1 checkpoint(s) (1 unfinished)" in result.stdout
        (verdict,) = last_lines(result)
        assert verdict.startswith("UNFINISHED") and verdict.endswith(name or str(url)), verdict

        report = json.loads(run("verify", str(url), "--json").stdout)
        assert report["ok"] is True
        assert report["checkpoint_status"] == {name: "unfinished"}
        assert sorted((f["code"], f["severity"], f["path"]) for f in report["findings"]) == [
            ("checkpoint_unpublished", "warning", index),
            ("unfinished_commit", "warning", path),
        ]
        details = {f["code"]: f["detail"] for f in report["findings"]}
        assert "did not finish" in details["checkpoint_unpublished"], details
        assert "empty participant directory" in details["unfinished_commit"], details

    rows = json.loads(run("inspect", str(root), "--json").stdout)
    assert rows == [
        {"checkpoint": "step-9", "participant": "environment/env-0", "damaged": "no manifest (unfinished commit)"}
    ]


def test_verify_of_an_empty_gym_directory_says_unfinished(tmp_path: Path) -> None:
    (tmp_path / "step-9" / "gym").mkdir(parents=True)
    report = json.loads(run("verify", str(tmp_path), "--json").stdout)
    assert report["checkpoint_status"] == {"step-9": "unfinished"}
    assert [(f["code"], f["path"]) for f in report["findings"]] == [("unfinished_commit", "step-9/gym")]
    # a directory with no gym/ in it at all is still no checkpoint
    (tmp_path / "elsewhere" / "deep").mkdir(parents=True)
    result = run("verify", str(tmp_path / "elsewhere"))
    assert result.exit_code == 2
    assert "no checkpoint (no gym/ directory)" in result.stderr


def test_verify_tells_unpublished_from_published(tmp_path: Path) -> None:
    root = tmp_path / "store"
    commit(root, "step-1")
    commit(root, "step-2", publish=False)

    published = run("verify", str(root / "step-1"))
    assert published.exit_code == 0, published.output
    assert last_lines(published) == ["OK"]
    assert "1 checkpoint(s) (1 published)" in published.stdout

    unpublished = run("verify", str(root / "step-2"))
    assert unpublished.exit_code == 0, unpublished.output  # a warning: the help says so
    (verdict,) = last_lines(unpublished)
    assert verdict.startswith("OK, but UNPUBLISHED") and verdict.endswith(str(root / "step-2")), verdict
    assert "1 checkpoint(s) (1 unpublished)" in unpublished.stdout

    report = json.loads(run("verify", str(root), "--json").stdout)
    assert report["ok"] is True
    assert report["checkpoint_status"] == {"step-1": "published", "step-2": "unpublished"}
    assert [(f["checkpoint"], f["code"]) for f in report["findings"]] == [("step-2", "checkpoint_unpublished")]


def test_verify_of_a_root_gives_each_checkpoint_its_status(tmp_path: Path) -> None:
    root = tmp_path / "store"
    commit(root, "step-1")
    commit(root, "step-2", publish=False)
    commit(root, "step-3", publish=False)
    # three participants committed, a fourth failed: not a whole checkpoint
    failed_commit(root, "step-3", "model", "policy-0")
    failed_commit(root, "step-4")
    environment, *_ = commit(root, "step-5")
    (root / environment.records_path).unlink()

    result = run("verify", str(root))
    assert result.exit_code == 1, result.output
    assert "5 checkpoint(s) (1 published, 1 unpublished, 2 unfinished, 1 damaged)" in result.stdout
    assert last_lines(result) == ["DAMAGED: do not restore from the checkpoints listed above: step-5"]
    report = json.loads(run("verify", str(root), "--json").stdout)
    assert report["checkpoint_status"] == {
        "step-1": "published",
        "step-2": "unpublished",
        "step-3": "unfinished",
        "step-4": "unfinished",
        "step-5": "damaged",
    }
    warnings = {(f["checkpoint"], f["code"]): f["detail"] for f in report["findings"] if f["severity"] == "warning"}
    assert sorted(warnings) == [
        ("step-2", "checkpoint_unpublished"),
        ("step-3", "checkpoint_unpublished"),
        ("step-3", "unfinished_commit"),
        ("step-4", "checkpoint_unpublished"),
        ("step-4", "unfinished_commit"),
    ]
    # an unfinished checkpoint is not called committed
    assert "committed but never published" in warnings[("step-2", "checkpoint_unpublished")]
    assert "a commit that did not finish" in warnings[("step-3", "checkpoint_unpublished")]

    shutil.rmtree(root / "step-5")
    result = run("verify", str(root))
    assert result.exit_code == 0, result.output
    assert last_lines(result) == [
        "UNFINISHED (a commit that did not finish: a participant without a manifest, or none; not damage): "
        "step-3, step-4",
        "OK, but UNPUBLISHED (every participant committed, no gym/checkpoint.json; publishing it is the "
        "trainer's job): step-2",
    ]


def test_verify_help_names_each_status_and_its_exit_status() -> None:
    text = " ".join(plain(run("verify", "--help").stdout).split())
    assert 'Each checkpoint\'s status ("checkpoint_status" in --json)' in text, text
    assert "unpublished every participant committed, no gym/checkpoint.json: not damaged, a warning" in text, text
    assert "0 no damage: every checkpoint published, unpublished, unfinished or vanished" in text, text
