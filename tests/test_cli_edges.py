"""The ``gymckpt`` command on hostile names and values: JSON is always written, and nothing a checkpoint
holds reaches the operator's terminal as a control sequence."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from click.testing import CliRunner, Result

from gymckpt.cli import main
from gymckpt.store import open_store
from gymckpt.testing.values import sample_records

if TYPE_CHECKING:
    from gymckpt.store.manifest import Manifest

#: what an attacker puts in a name: clear the screen, set the window title, a C1 CSI, a bidi override
HOSTILE = "\x1b[2J\x1b]0;owned\x07\x9b31m\u202e"
#: the bytes and characters none of which may reach a terminal raw
RAW = ("\x1b", "\x07", "\x9b", "\u202e")
#: rich's own sequences on a terminal, the only ones allowed: colours, and the progress bar's erase line,
#: cursor up, hide and show cursor (never the clear screen, title or C1 sequences of :data:`HOSTILE`)
STYLING = re.compile(r"\x1b\[(?:[0-9;]*m|2K|1A|\?25[lh])")


#: the environment in which the command's rich consoles are a terminal (rich reads it when the command runs:
#: FORCE_COLOR, and TTY_COMPATIBLE from rich 14 on)
TERMINAL = {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1", "TERM": "xterm-256color", "COLUMNS": "300"}


def run(*args: str, terminal: bool = False) -> Result:
    shown = TERMINAL if terminal else {"FORCE_COLOR": None, "TTY_COMPATIBLE": None, "COLUMNS": "200"}
    return CliRunner().invoke(main, list(args), env={"GYMCKPT_ENDPOINT_URL": None, **shown})


def run_process(*args: str | bytes) -> subprocess.CompletedProcess[bytes]:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("GYMCKPT_")}
    return subprocess.run(
        [sys.executable, "-m", "gymckpt", *args], capture_output=True, timeout=120, env=environment, check=False
    )


def commit(root: Path, checkpoint: str, extra: dict[str, Any] | None = None) -> list[Manifest]:
    with open_store(str(root)) as store:
        manifests = [
            store.write_participant(
                checkpoint, kind=kind, instance="0", checkpoint_id="ck", records=sample_records(3), extra=extra
            )
            for kind in ("environment", "agent")
        ]
        store.publish(checkpoint, manifests)
    return manifests


# --- JSON is always written


def test_verify_json_of_names_that_are_not_utf8(tmp_path: Path) -> None:
    commit(tmp_path, "ck")
    stray = os.path.join(os.fsencode(tmp_path), b"ck", b"gym", b"environment", b"0", b"notes-\xff")
    with open(stray, "wb") as stream:
        stream.write(b"x")
    os.rename(os.fsencode(tmp_path / "ck"), os.fsencode(tmp_path) + b"/ck-\xe9")
    result = run("verify", str(tmp_path), "--json")
    assert result.exit_code == 0, result.output  # a stray file is a warning
    report = json.loads(result.stdout_bytes.decode("utf-8"))
    assert report["checkpoints"] == ["ck-\\xe9"]
    assert [(f["code"], f["path"]) for f in report["findings"]] == [
        ("unexpected_file", "ck-\\xe9/gym/environment/0/notes-\\xff")
    ]
    human = run("verify", str(tmp_path))
    assert human.exit_code == 0, human.output
    assert "ck-\\xe9/gym/environment/0/notes-\\xff" in human.stdout

    # damage in such a checkpoint: exit 1, and the report still written
    (tmp_path / "ck-\udce9" / "gym" / "checkpoint.json").write_bytes(b"{")
    damaged = run("verify", str(tmp_path), "--json")
    assert damaged.exit_code == 1, damaged.output
    assert json.loads(damaged.stdout)["errors"] == 1


def test_the_json_error_of_a_url_that_is_not_utf8(tmp_path: Path) -> None:
    result = run_process("verify", os.fsencode(tmp_path) + b"/missing-\xff", "--json")
    assert result.returncode == 2, result.stderr
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "checkpoint_not_found"
    assert error["detail"].endswith("missing-\\xff")


def test_inspect_json_writes_what_the_store_accepts(tmp_path: Path) -> None:
    big = 2**70
    commit(tmp_path, "ck", extra={"big": big, "small": -(2**64), "nan": float("nan"), "lone": "\ud800"})
    result = run("inspect", str(tmp_path / "ck"), "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [row["participant"] for row in rows] == ["agent/0", "environment/0"]
    extra = rows[0]["extra"]
    assert extra["big"] == big and extra["small"] == -(2**64)  # exact, not a float
    assert extra["nan"] != extra["nan"]
    assert extra["lone"] == "\ud800"  # as the manifest holds it


# --- no control sequence reaches the terminal


def hostile_root(tmp_path: Path) -> Path:
    """A root whose checkpoint name, stray file, manifest extra and a damaged manifest carry :data:`HOSTILE`."""
    root = tmp_path / "root"
    commit(root, f"ck{HOSTILE}", extra={f"key{HOSTILE}": f"value{HOSTILE}"})
    participant = root / f"ck{HOSTILE}" / "gym" / "environment" / "0"
    (participant / f"notes{HOSTILE}\tcolumn").write_bytes(b"x")
    manifest = json.loads((participant / "manifest.json").read_bytes())
    manifest["kind"] = f"model{HOSTILE}"  # a detail quoting a value from the manifest
    (participant / "manifest.json").write_text(json.dumps(manifest))
    return root


def assert_escaped(output: str) -> None:
    unstyled = STYLING.sub("", output)
    for raw in RAW:
        assert raw not in unstyled, (raw, unstyled)
    assert "\\x1b[2J\\x1b]0;owned\\x07\\x9b31m\\u202e" in unstyled, unstyled


@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "terminal"])
def test_control_characters_from_a_checkpoint_are_escaped(tmp_path: Path, terminal: bool) -> None:
    root = hostile_root(tmp_path)

    def output(*args: str) -> tuple[int, str]:
        result = run(*args, terminal=terminal)
        assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
        return result.exit_code, result.output

    code, shown = output("verify", str(root))
    assert code == 1  # the manifest's kind is damage
    assert_escaped(shown)
    assert ("Findings for" in shown) == terminal  # the findings table: only on a terminal
    assert "participant_mismatch" in shown and "unexpected_file" in shown
    code, shown = output("inspect", str(root))
    assert code == 0
    assert_escaped(shown)
    code, shown = output("verify", str(root / f"missing{HOSTILE}"))
    assert code == 2
    assert_escaped(shown)
    if not terminal:  # one finding per line, its fields kept apart by tabs: the tab in the name is escaped
        lines = [line for line in run("verify", str(root)).stdout.splitlines() if "unexpected_file" in line]
        assert [len(line.split("\t")) for line in lines] == [5]
        assert "\\tcolumn" in lines[0]


def test_names_in_the_narrow_layout_and_in_the_verdict_are_escaped(tmp_path: Path) -> None:
    """inspect's blocks (a terminal too narrow for its table) and verify's last lines, which name the
    checkpoints that are unpublished or unfinished, escape a name as the table does."""
    root = tmp_path / "root"
    with open_store(str(root)) as store:
        store.write_participant(f"un{HOSTILE}", kind="environment", instance="0", checkpoint_id="ck", records=[])
    unfinished = root / f"failed{HOSTILE}" / "gym" / "environment" / "0"
    unfinished.mkdir(parents=True)  # what a failed commit leaves
    commit(root, f"ck{HOSTILE}", extra={f"key{HOSTILE}": 1})
    narrow = {**TERMINAL, "COLUMNS": "60"}
    shown = CliRunner().invoke(main, ["inspect", str(root)], env={"GYMCKPT_ENDPOINT_URL": None, **narrow})
    assert shown.exit_code == 0, shown.output
    assert "┏" not in shown.output  # the blocks, not the table
    assert_escaped(shown.output)
    for terminal in (False, True):
        result = run("verify", str(root), terminal=terminal)
        assert result.exit_code == 0, result.output
        assert_escaped(result.output)
        lines = STYLING.sub("", result.output).splitlines()
        assert any(line.startswith("UNFINISHED") and "failed\\x1b[2J" in line for line in lines), lines
        assert any(line.startswith("OK, but UNPUBLISHED") and "un\\x1b[2J" in line for line in lines), lines


def test_no_control_byte_from_a_file_name_reaches_a_real_process_output(tmp_path: Path) -> None:
    root = hostile_root(tmp_path)
    for args in (
        ["verify", str(root)],
        ["verify", str(root), "--json"],
        ["inspect", str(root)],
        ["inspect", str(root), "--json"],
        ["verify", str(root / f"missing{HOSTILE}")],
    ):
        result = run_process(*args)
        assert result.returncode in (0, 1, 2), result.stderr
        for stream in (result.stdout, result.stderr):
            assert b"\x1b" not in stream and b"\x07" not in stream, (args, stream)
            assert "\x9b".encode() not in stream and "\u202e".encode() not in stream, (args, stream)
        assert b"Traceback" not in result.stderr
