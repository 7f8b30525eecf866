"""The ``gymckpt`` command: verify, inspect and demo, through click's CliRunner and as a real
process. Exit status: 0 clean, 1 damage found, 2 usage error or unreachable storage."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import pytest
from click.testing import CliRunner, Result

from gymckpt.cli import main
from gymckpt.control.settings import load_settings
from gymckpt.errors import (
    RecordsDigestMismatch,
    StorageError,
    UnsupportedStorage,
    UnusableDirectory,
)
from gymckpt.servers.base import load_server_config
from gymckpt.servers.counter import CounterConfig
from gymckpt.stack import load_stack
from gymckpt.store import open_store, verify
from gymckpt.store._local import LocalBackend
from gymckpt.store.codec import decode_line
from gymckpt.store.manifest import RECORDS_NAME_PATTERN
from gymckpt.store.verify import NoCheckpointFound
from gymckpt.testing.values import assert_identical, sample_records

from .support import each_backend

if TYPE_CHECKING:
    from .support import Storage

GYMCKPT = Path(sys.executable).parent / "gymckpt"
#: the width rich uses whenever output is not a terminal (pipes, files, CI logs)
PIPE_WIDTH = {"COLUMNS": "80"}


# --- helpers


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def plain(text: str) -> str:
    return ANSI.sub("", text)


def one_line(text: str) -> str:
    """Help text with its line breaks and indentation collapsed."""
    return " ".join(plain(text).split())


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    # GYMCKPT_ENDPOINT_URL from the developer's shell would make every local path a usage error
    # and FORCE_COLOR or TTY_COMPATIBLE would make rich take the pipe for a terminal (see TERMINAL)
    environment: dict[str, str | None] = {
        "GYMCKPT_ENDPOINT_URL": None,
        "FORCE_COLOR": None,
        "TTY_COMPATIBLE": None,
        **PIPE_WIDTH,
        **(env or {}),
    }
    return CliRunner().invoke(main, list(args), env=environment, catch_exceptions=True)


def run_process(*args: str) -> subprocess.CompletedProcess[bytes]:
    assert GYMCKPT.exists(), f"{GYMCKPT} is not installed (pip install -e .)"
    environment = {key: value for key, value in os.environ.items() if not key.startswith("GYMCKPT_")}
    return subprocess.run([str(GYMCKPT), *args], capture_output=True, timeout=300, env=environment, check=False)


def deep(levels: int) -> Any:
    value: Any = "bottom"
    for _ in range(levels):
        value = {"down": value}
    return value


def environment_records() -> list[dict[str, Any]]:
    records = sample_records(20, prefix="4-")
    records.append(
        {
            "episode_id": "edge",
            "nan": float("nan"),
            "inf": [float("inf"), float("-inf")],
            "neg_zero": -0.0,
            "big": [2**64, -(2**63) - 1, 10**100, -(10**100)],
            "types": [True, 1, 1.0, None, "1"],
            "lone": "\ud800 surrogate",
            "deep": deep(600),
        }
    )
    return records


def agent_records() -> list[dict[str, Any]]:
    return sample_records(7, prefix="9-")


def commit(root: Path | str, checkpoint: str, checkpoint_id: str | None = None) -> dict[str, Any]:
    store = open_store(str(root))
    checkpoint_id = checkpoint_id or checkpoint
    env = store.write_participant(
        checkpoint,
        kind="environment",
        instance="env-0",
        checkpoint_id=checkpoint_id,
        records=iter(environment_records()),
        extra={"seed": 3},
    )
    agent = store.write_participant(
        checkpoint, kind="agent", instance="agent-0", checkpoint_id=checkpoint_id, records=iter(agent_records())
    )
    store.publish(checkpoint, [env, agent], extra={"trainer_step": 7})
    return {"environment": env, "agent": agent}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A store root holding one published checkpoint, ``ck-7``, of two participants."""
    store_root = tmp_path / "store"
    commit(store_root, "ck-7")
    return store_root


def records_file(checkpoint: Path, participant: str = "environment/env-0") -> Path:
    (found,) = (checkpoint / "gym" / participant).glob("records-*.jsonl")
    return found


def flipped(content: bytes) -> bytes:
    """``content`` with one bit of its middle byte flipped."""
    data = bytearray(content)
    middle = len(data) // 2
    data[middle] ^= 0x01
    return bytes(data)


def flip_byte(path: Path) -> None:
    path.write_bytes(flipped(path.read_bytes()))


@dataclass
class Published:
    """Checkpoint ``ck-7`` of two participants, alone at a location of ``storage`` (the ``checkpoint`` fixture)."""

    storage: Storage
    url: str

    def records_file(self, participant: str = "environment/env-0") -> PurePosixPath:
        """The participant's records file, relative to :attr:`url`."""
        (found,) = [
            PurePosixPath(path)
            for path in self.storage.files(self.url)
            if PurePosixPath(path).parent == PurePosixPath("gym", participant) and path.endswith(".jsonl")
        ]
        return found

    def flip_byte(self, path: PurePosixPath) -> None:
        self.storage.write(self.url, str(path), flipped(self.storage.read(self.url, str(path))))

    def truncate(self, path: PurePosixPath) -> None:
        """Drop the last byte of ``path``."""
        self.storage.write(self.url, str(path), self.storage.read(self.url, str(path))[:-1])


@pytest.fixture
def checkpoint(storage: Storage) -> Published:
    """``ck-7`` as :func:`root` holds it, in ``storage`` (local by default; see ``each_backend``)."""
    url = storage.url("store", "ck-7")
    commit(url, "", "ck-7")
    return Published(storage, url)


def report_of(result: Result) -> dict[str, Any]:
    return json.loads(result.stdout)


# --- verify


@each_backend
def test_verify_a_good_checkpoint_exits_0(checkpoint: Published) -> None:
    result = run("verify", checkpoint.url)
    assert result.exit_code == 0, result.output
    text = plain(result.stdout)
    assert "OK" in text and "DAMAGED" not in text
    assert "0 error(s)" in text

    result = run("verify", checkpoint.url, "--json")
    assert result.exit_code == 0
    report = report_of(result)
    assert report["ok"] is True
    assert report["findings"] == []
    assert report["errors"] == 0
    assert report["participants"] == 2
    assert report["records_checked"] == len(environment_records()) + len(agent_records())


@each_backend
def test_verify_a_flipped_byte_exits_1_and_names_the_finding_and_file(checkpoint: Published) -> None:
    damaged = checkpoint.records_file()
    checkpoint.flip_byte(damaged)
    result = run("verify", checkpoint.url, "--json")
    assert result.exit_code == 1, result.output
    report = report_of(result)
    assert report["ok"] is False
    assert report["errors"] == 1
    (finding,) = report["findings"]
    assert finding["code"] == "records_digest_mismatch"
    assert finding["severity"] == "error"
    assert finding["participant"] == "environment/env-0"
    assert finding["path"] == f"gym/environment/env-0/{damaged.name}"


@each_backend
def test_verify_human_report_names_the_finding_and_the_file(checkpoint: Published) -> None:
    """Piped or logged (not a terminal), the report must still name the finding code and the
    damaged file so that it can be grepped and copied."""
    damaged = checkpoint.records_file()
    checkpoint.flip_byte(damaged)
    result = run("verify", checkpoint.url)
    assert result.exit_code == 1
    text = plain(result.stdout)
    assert "DAMAGED" in text
    assert "records_digest_mismatch" in text, text
    assert f"gym/environment/env-0/{damaged.name}" in text, text


@each_backend
def test_verify_quick_skips_hashing_but_sees_truncation(checkpoint: Published) -> None:
    damaged = checkpoint.records_file()
    checkpoint.flip_byte(damaged)
    result = run("verify", checkpoint.url, "--quick", "--json")
    assert result.exit_code == 0, result.output
    report = report_of(result)
    assert report["ok"] is True and report["quick"] is True
    assert report["records_checked"] == 0

    checkpoint.truncate(damaged)
    result = run("verify", checkpoint.url, "--quick", "--json")
    assert result.exit_code == 1, result.output
    codes = [finding["code"] for finding in report_of(result)["findings"]]
    assert codes == ["records_size_mismatch"]

    result = run("verify", checkpoint.url, "--quick")
    assert result.exit_code == 1
    assert "DAMAGED" in plain(result.stdout)


@pytest.mark.parametrize("as_json", [False, True])
def test_verify_a_missing_path_exits_2(tmp_path: Path, as_json: bool) -> None:
    missing = tmp_path / "does-not-exist"
    result = run("verify", str(missing), *(["--json"] if as_json else []))
    assert result.exit_code == 2, result.output
    assert "no checkpoint" in plain(result.stderr)
    assert str(missing) in plain(result.stderr).replace("\n", "")
    if as_json:  # the error as an object on stdout too
        assert report_of(result) == {
            "error": {"code": "checkpoint_not_found", "detail": f"no checkpoint (no gym/ directory) under {missing}"}
        }
    else:
        assert result.stdout == ""


def test_verify_a_directory_without_a_checkpoint_exits_2(tmp_path: Path) -> None:
    (tmp_path / "plain" / "sub").mkdir(parents=True)
    (tmp_path / "plain" / "sub" / "notes.txt").write_text("not a checkpoint")
    result = run("verify", str(tmp_path / "plain"))
    assert result.exit_code == 2, result.output
    assert "no checkpoint" in plain(result.stderr)


def test_verify_refuses_storage_options_for_a_local_path(root: Path) -> None:
    result = run("verify", str(root / "ck-7"), "--endpoint-url", "http://127.0.0.1:9000")
    assert result.exit_code == 2, result.output
    message = " ".join(plain(result.stderr).split())
    assert "endpoint_url" in message
    assert "object storage" in message
    assert result.stdout == ""

    result = run("verify", str(root / "ck-7"), "-o", "key=AKIA")
    assert result.exit_code == 2
    assert "key" in plain(result.stderr)

    result = run("verify", str(root / "ck-7"), "-o", "no-equals-sign")
    assert result.exit_code == 2
    assert "KEY=VALUE" in plain(result.output)


def test_verify_a_root_checks_every_checkpoint(root: Path) -> None:
    commit(root, "ck-8")
    result = run("verify", str(root), "--json")
    assert result.exit_code == 0, result.output
    report = report_of(result)
    assert report["checkpoints"] == ["ck-7", "ck-8"]
    assert report["participants"] == 4
    assert report["records_checked"] == 2 * (len(environment_records()) + len(agent_records()))

    flip_byte(records_file(root / "ck-8", "agent/agent-0"))
    result = run("verify", str(root), "--json")
    assert result.exit_code == 1
    report = report_of(result)
    assert report["checkpoints"] == ["ck-7", "ck-8"]
    (finding,) = report["findings"]
    assert finding["code"] == "records_digest_mismatch"
    assert finding["checkpoint"] == "ck-8"
    assert finding["path"].startswith("ck-8/gym/agent/agent-0/records-")


# --- inspect


@each_backend
def test_inspect_lists_participants_and_counts(checkpoint: Published) -> None:
    result = run("inspect", checkpoint.url)
    assert result.exit_code == 0, result.output
    text = plain(result.stdout)
    assert "environment/env-0" in text, text
    assert "agent/agent-0" in text, text
    assert str(len(environment_records())) in text
    assert str(len(agent_records())) in text


def test_inspect_json_lists_every_participant(root: Path) -> None:
    result = run("inspect", str(root / "ck-7"), "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    by_participant = {row["participant"]: row for row in rows}
    assert sorted(by_participant) == ["agent/agent-0", "environment/env-0"]
    env = by_participant["environment/env-0"]
    assert env["checkpoint"] == ""
    assert env["checkpoint_id"] == "ck-7"
    assert env["record_count"] == len(environment_records())
    assert env["episode_ids"] == sorted(record["episode_id"] for record in environment_records())
    assert env["extra"] == {"seed": 3}
    assert env["records_file"] == records_file(root / "ck-7").name
    assert env["records_bytes"] == records_file(root / "ck-7").stat().st_size
    assert by_participant["agent/agent-0"]["record_count"] == len(agent_records())

    rows = json.loads(run("inspect", str(root), "--json").stdout)
    assert {row["checkpoint"] for row in rows} == {"ck-7"}


def test_inspect_json_marks_a_participant_without_manifest(root: Path) -> None:
    (root / "ck-7" / "gym" / "model" / "m-0").mkdir(parents=True)
    (root / "ck-7" / "gym" / "model" / "m-0" / f"records-{'0' * 64}.jsonl").write_bytes(b"")
    rows = json.loads(run("inspect", str(root / "ck-7"), "--json").stdout)
    (row,) = [row for row in rows if row["participant"] == "model/m-0"]
    assert "damaged" in row


@pytest.mark.parametrize("url", ["checkpoint", "root"])
def test_inspect_dump_writes_exactly_the_committed_records(root: Path, url: str) -> None:
    target = root / "ck-7" if url == "checkpoint" else root
    result = run("inspect", str(target), "--dump", "environment/env-0")
    assert result.exit_code == 0, result.output
    assert result.stdout_bytes == records_file(root / "ck-7").read_bytes()
    lines = result.stdout_bytes.splitlines()
    committed = environment_records()
    assert len(lines) == len(committed)
    for expected, line in zip(committed, lines, strict=True):
        assert_identical(expected, decode_line(line))


@each_backend
def test_inspect_dump_of_some_episodes(checkpoint: Published) -> None:
    result = run("inspect", checkpoint.url, "--dump", "environment/env-0", "--episode", "edge")
    assert result.exit_code == 0, result.output
    lines = result.stdout_bytes.splitlines()
    assert len(lines) == 1
    (edge,) = [record for record in environment_records() if record["episode_id"] == "edge"]
    assert_identical(edge, decode_line(lines[0]))

    result = run(
        "inspect",
        checkpoint.url,
        "--dump",
        "agent/agent-0",
        "--episode",
        "9-5",
        "--episode",
        "9-1",
        "--episode",
        "x",
    )
    assert result.exit_code == 0
    assert [decode_line(line)["episode_id"] for line in result.stdout_bytes.splitlines()] == ["9-1", "9-5"]


@each_backend
def test_inspect_dump_of_a_damaged_participant_exits_1(checkpoint: Published) -> None:
    checkpoint.flip_byte(checkpoint.records_file())
    result = run("inspect", checkpoint.url, "--dump", "environment/env-0")
    assert result.exit_code == 1
    assert "records file hashes to" in " ".join(plain(result.stderr).split())


def test_inspect_dump_needs_kind_slash_instance_and_one_checkpoint(root: Path) -> None:
    result = run("inspect", str(root / "ck-7"), "--dump", "environment")
    assert result.exit_code == 2
    assert "KIND/INSTANCE" in plain(result.output)

    commit(root, "ck-8")
    result = run("inspect", str(root), "--dump", "environment/env-0")
    assert result.exit_code == 2
    assert "2 checkpoints" in plain(result.stderr)


def test_inspect_dump_of_a_participant_the_checkpoint_does_not_have_exits_2(root: Path) -> None:
    """Naming a participant that is not there is a usage error (2), not damage (1)."""
    result = run("inspect", str(root / "ck-7"), "--dump", "model/m-0")
    assert result.exit_code == 2, result.output
    assert "model/m-0" in plain(result.stderr)


def test_inspect_dump_of_an_invalid_participant_name_exits_2_without_a_traceback(root: Path) -> None:
    result = run("inspect", str(root / "ck-7"), "--dump", "not a/name")
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, result.output
    assert "not a" in plain(result.output)


def test_inspect_a_missing_path_exits_2(tmp_path: Path) -> None:
    result = run("inspect", str(tmp_path / "nothing"))
    assert result.exit_code == 2
    assert "no checkpoint" in plain(result.stderr)


# --- help


@pytest.mark.parametrize("command", [[], ["verify"], ["inspect"], ["demo"]])
def test_help_exits_0(command: list[str]) -> None:
    for flag in ("--help", "-h"):
        result = run(*command, flag)
        assert result.exit_code == 0, result.output
        assert "Usage:" in result.stdout


def test_verify_help_states_the_exit_codes() -> None:
    text = one_line(run("verify", "--help").stdout)
    assert "0 no damage: every checkpoint published, unpublished, unfinished or vanished" in text, text
    assert "1 errors found" in text
    assert "2 usage error" in text
    for status in ("published", "unpublished", "unfinished", "damaged", "vanished"):
        assert f" {status} " in text, status


# --- a real process


def test_real_process_verify_and_inspect(root: Path) -> None:
    checkpoint = root / "ck-7"
    good = run_process("verify", str(checkpoint), "--json")
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["ok"] is True

    dumped = run_process("inspect", str(checkpoint), "--dump", "environment/env-0", "--episode", "edge")
    assert dumped.returncode == 0, dumped.stderr
    assert decode_line(dumped.stdout)["big"] == [2**64, -(2**63) - 1, 10**100, -(10**100)]

    damaged = records_file(checkpoint)
    flip_byte(damaged)
    bad = run_process("verify", str(checkpoint), "--json")
    assert bad.returncode == 1, bad.stderr
    (finding,) = json.loads(bad.stdout)["findings"]
    assert finding["code"] == "records_digest_mismatch"
    assert finding["path"].endswith(damaged.name)

    missing = run_process("verify", str(root / "missing"))
    assert missing.returncode == 2
    assert b"no checkpoint" in missing.stderr
    assert b"Traceback" not in missing.stderr


def test_real_process_demo_writes_a_checkpoint_that_verifies(tmp_path: Path) -> None:
    store_root = tmp_path / "demo-store"
    demo = run_process("demo", "--store-only", "--store", str(store_root), "--episodes", "24", "--seed", "5")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert b"identical to what was committed" in b" ".join(demo.stdout.split())

    report = verify(str(store_root))
    assert report.ok, report.findings
    assert report.findings == []
    assert len(report.checkpoints) == 1
    assert len(report.participants) == 4
    assert report.records_checked == 4 * 24

    again = run("verify", str(store_root), "--json")
    assert again.exit_code == 0
    assert report_of(again)["ok"] is True


def test_sha256sum_agrees_with_every_records_file_name(root: Path, tmp_path: Path) -> None:
    commit(root, "ck-8")
    demo = run_process("demo", "--store-only", "--store", str(root), "--episodes", "8")
    assert demo.returncode == 0, demo.stderr
    files = sorted(root.rglob("records-*.jsonl"))
    assert len(files) == 2 + 2 + 4
    checked = subprocess.run(
        ["sha256sum", *map(str, files)], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    assert len(checked) == len(files)
    for line, path in zip(checked, files, strict=True):
        digest, _, name = line.partition("  ")
        assert name == str(path)
        match = RECORDS_NAME_PATTERN.match(path.name)
        assert match is not None, path.name
        assert digest == match.group(1) == hashlib.sha256(path.read_bytes()).hexdigest()


# --- data is never markup; errors are one line, never a traceback

#: checkpoint names that rich would read as markup (or as an emoji code)
MARKUP_NAMES = ["[bold]x", "a[/]b", "[red]x[/red]", "x:smile:y"]


#: the environment in which the command's rich consoles are a terminal 400 columns wide (rich reads
#: it when the command runs: FORCE_COLOR, and TTY_COMPATIBLE from rich 14 on)
TERMINAL = {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1", "TERM": "xterm-256color", "COLUMNS": "400"}


class Consoles:
    """Runs the CLI with its rich consoles as a pipe (the default) or as a terminal (:data:`TERMINAL`),
    so that the table and progress branches run."""

    def __init__(self, terminal: bool) -> None:
        self.terminal = terminal

    def run(self, *args: str) -> tuple[Result, str, str]:
        """The result, and all of stdout and stderr as plain text."""
        result = run(*args, env=TERMINAL if self.terminal else None)
        assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
        return result, plain(result.stdout), plain(result.stderr)


@pytest.fixture(params=[False, True], ids=["pipe", "terminal"])
def consoles(request: pytest.FixtureRequest) -> Consoles:
    return Consoles(request.param)


def assert_one_error_line(result: Result, *expected: str) -> str:
    """stderr is exactly one ``error: …`` line holding each of ``expected``, and no traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = plain(result.stderr).splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert "Traceback" not in result.output
    return lines[0]


def json_error(result: Result) -> dict[str, str]:
    document = report_of(result)
    assert list(document) == ["error"], document
    assert sorted(document["error"]) == ["code", "detail"], document
    return document["error"]


@pytest.mark.parametrize("name", MARKUP_NAMES)
def test_verify_prints_a_checkpoint_name_with_markup_verbatim(tmp_path: Path, consoles: Consoles, name: str) -> None:
    root = tmp_path / "store"
    commit(root, name, checkpoint_id="ck-7")
    for url in (root, root / name):
        result, out, _ = consoles.run("verify", str(url))
        assert result.exit_code == 0, out
        assert "OK" in out

    flip_byte(records_file(root / name))
    result, out, _ = consoles.run("verify", str(root))
    assert result.exit_code == 1, out
    assert "records_digest_mismatch" in out
    assert f"{name}/gym/environment/env-0/records-" in out, out
    assert "DAMAGED" in out
    result, out, _ = consoles.run("verify", str(root / name))
    assert result.exit_code == 1, out
    if consoles.terminal:  # the findings table's title names the URL
        assert f"Findings for {root / name}" in out, out


@pytest.mark.parametrize("name", MARKUP_NAMES)
def test_inspect_prints_a_checkpoint_name_with_markup_verbatim(tmp_path: Path, consoles: Consoles, name: str) -> None:
    root = tmp_path / name / "store"  # markup in the URL too
    commit(root, name, checkpoint_id="ck-7")
    result, out, _ = consoles.run("inspect", str(root))
    assert result.exit_code == 0, out
    lines = [line for line in out.splitlines() if "environment/env-0" in line]
    assert len(lines) == 1, out
    assert name in lines[0], out
    if consoles.terminal:  # the title may wrap before a long path
        assert f"Checkpoints under {root}" in " ".join(out.split()), out

    unfinished = root / name / "gym" / "model" / "m-0"  # a participant without manifest
    unfinished.mkdir(parents=True)
    (unfinished / f"records-{'0' * 64}.jsonl").write_bytes(b"")
    result, out, _ = consoles.run("inspect", str(root))
    assert result.exit_code == 0, out
    assert "damaged" in out and "no manifest" in out

    flip_byte(records_file(root / name))
    result, _, err = consoles.run("inspect", str(root), "--dump", "environment/env-0")
    assert result.exit_code == 1
    assert f"{name}/gym/environment/env-0/records-" in err, err
    assert result.stdout_bytes == b""


@pytest.mark.parametrize("command", ["verify", "inspect"])
@pytest.mark.parametrize("name", MARKUP_NAMES)
def test_an_error_naming_a_path_with_markup_prints_it_verbatim(
    tmp_path: Path, consoles: Consoles, command: str, name: str
) -> None:
    missing = tmp_path / name / "missing"
    expected = f"error: no checkpoint (no gym/ directory) under {missing}"
    result, out, err = consoles.run(command, str(missing))
    assert result.exit_code == 2, err
    assert expected in err, err
    assert out == ""
    if not consoles.terminal:
        assert_one_error_line(result, expected)

    result, out, err = consoles.run(command, str(missing), "--json")
    assert result.exit_code == 2
    assert expected in err
    assert json_error(result) == {"code": "checkpoint_not_found", "detail": expected.removeprefix("error: ")}


def test_a_usage_error_with_markup_in_it_prints_verbatim(root: Path, consoles: Consoles) -> None:
    result, _, err = consoles.run("inspect", str(root / "ck-7"), "--dump", "[red]x[/red]/[/]")
    assert result.exit_code == 2
    assert "got '[red]x[/red]/[/]'" in err, err


# --- --json on exit 2


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_json_error_object_for_each_kind_of_exit_2(root: Path, tmp_path: Path, command: str) -> None:
    cases = [
        ([str(tmp_path / "nothing")], "checkpoint_not_found"),
        ([str(root / "ck-7"), "--endpoint-url", "http://127.0.0.1:9"], "unsupported_storage"),
        ([""], "usage_error"),
        ([str(root / "ck-7"), "-o", "no-equals-sign"], "usage_error"),
        ([], "usage_error"),  # click's own: a missing URL
        ([str(root / "ck-7"), "--no-such-flag"], "usage_error"),
    ]
    for args, code in cases:
        result = run(command, *args, "--json")
        assert result.exit_code == 2, (args, result.output)
        error = json_error(result)
        assert error["code"] == code, (args, error)
        # the same message, as one line, on stderr
        assert assert_one_error_line(result) == f"error: {error['detail']}"


def test_json_error_object_for_inspect_usage_errors(root: Path) -> None:
    result = run("inspect", str(root / "ck-7"), "--episode", "x", "--json")
    assert result.exit_code == 2
    assert json_error(result)["code"] == "usage_error"
    result = run("inspect", str(root / "ck-7"), "--dump", "environment", "--json")
    assert result.exit_code == 2
    assert json_error(result)["code"] == "usage_error"
    assert "KIND/INSTANCE" in json_error(result)["detail"]


# --- usage errors: exit 2, one line


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["verify", ""], "URL is empty"),
        (["inspect", ""], "URL is empty"),
        (["verify", "   "], "URL is empty"),
        (["inspect", "{checkpoint}", "--episode", "edge"], "--episode needs --dump"),
        (["inspect", "{checkpoint}", "--dump", "environment"], "KIND/INSTANCE"),
        (["inspect", "{checkpoint}", "--dump", "not a/name"], "KIND/INSTANCE"),
        (["inspect", "{checkpoint}", "--dump", "environment/"], "KIND/INSTANCE"),
        (["verify", "{checkpoint}", "-o", "no-equals-sign"], "KEY=VALUE"),
        (["verify"], "Missing argument 'URL'"),
        (["inspect", "{checkpoint}", "--no-such-flag"], "No such option"),
    ],
)
def test_usage_errors_exit_2_with_one_line(root: Path, args: list[str], expected: str) -> None:
    result = run(*(arg.replace("{checkpoint}", str(root / "ck-7")) for arg in args))
    assert result.exit_code == 2, result.output
    assert_one_error_line(result, expected)
    assert result.stdout == ""


def test_an_empty_url_is_not_the_current_directory(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(root)  # a store root: '' must not verify it
    result = run("verify", "")
    assert result.exit_code == 2
    assert_one_error_line(result, "URL is empty")


# --- storage errors: exit 2, one line, never 1, never a traceback

BAD_STORAGE = [
    ["s3://b/x::memory://y"],
    ["s3://bucket/x", "-o", "no_such_option=1", "--endpoint-url", "http://127.0.0.1:9"],
]


@pytest.mark.parametrize("command", ["verify", "inspect"])
@pytest.mark.parametrize("args", BAD_STORAGE, ids=["chained_url", "unknown_option"])
def test_bad_storage_urls_and_options_exit_2_with_one_line(command: str, args: list[str]) -> None:
    pytest.importorskip("s3fs")
    result = run(command, *args)
    assert result.exit_code == 2, result.output
    assert_one_error_line(result, f"error: cannot read {args[0]}: ")
    assert result.stdout == ""

    result = run(command, *args, "--json")
    assert result.exit_code == 2
    assert json_error(result)["code"] in {"storage_error", "unsupported_storage"}


@pytest.mark.parametrize("args", BAD_STORAGE, ids=["chained_url", "unknown_option"])
def test_real_process_bad_storage_exits_2_without_a_traceback(args: list[str]) -> None:
    pytest.importorskip("s3fs")
    result = run_process("verify", *args)
    assert result.returncode == 2, result.stderr
    assert b"Traceback" not in result.stdout + result.stderr
    (line,) = result.stderr.decode().splitlines()
    assert line.startswith(f"error: cannot read {args[0]}: ")


def test_real_process_markup_in_a_missing_path_exits_2_without_a_traceback(tmp_path: Path) -> None:
    missing = tmp_path / "a[/]b" / "[bold]x"
    result = run_process("verify", str(missing))
    assert result.returncode == 2, result.stderr
    assert b"Traceback" not in result.stderr
    assert result.stderr.decode().splitlines() == [f"error: no checkpoint (no gym/ directory) under {missing}"]


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (StorageError("cannot list [/]x: connection refused"), "storage_error"),
        (UnsupportedStorage("[bold]no conditional create"), "unsupported_storage"),
        (UnusableDirectory("cannot list x: Permission denied", path="x"), "unusable_directory"),
        (NoCheckpointFound("no checkpoint (no gym/ directory) under [red]x[/red]"), "checkpoint_not_found"),
        (PermissionError(13, "Permission denied"), "storage_error"),
        (OSError("[Errno 5] Input/output error"), "storage_error"),
        (ValueError("Protocol not known: [bold]s4"), "storage_error"),
        (TypeError("__init__() got an unexpected keyword argument 'no_such_option'"), "storage_error"),
        (RuntimeError("Event loop is closed"), "storage_error"),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else value,
)
@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_what_opening_the_storage_raises_exits_2_never_1(
    root: Path, monkeypatch: pytest.MonkeyPatch, command: str, error: Exception, code: str
) -> None:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(LocalBackend, "__init__", fail)  # what opening the storage raises, for both commands
    url = str(root / "ck-7")
    for as_json in (False, True):
        result = run(command, url, *(["--json"] if as_json else []))
        assert result.exit_code == 2, result.output
        line = assert_one_error_line(result, str(error))  # verbatim: markup in it is kept
        if not isinstance(error, NoCheckpointFound):
            assert line.startswith(f"error: cannot read {url}: ")
        if as_json:
            assert json_error(result) == {"code": code, "detail": line.removeprefix("error: ")}


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_running_out_of_memory_exits_2_and_is_not_damage(
    root: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    def out_of_memory(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError

    monkeypatch.setattr(LocalBackend, "__init__", out_of_memory)
    result = run(command, str(root / "ck-7"))
    assert result.exit_code == 2, result.output
    line = assert_one_error_line(result, "ran out of memory", str(root / "ck-7"))
    assert "not damage" in line
    assert "DAMAGED" not in result.output

    result = run(command, str(root / "ck-7"), "--json")
    assert result.exit_code == 2
    assert json_error(result)["code"] == "out_of_memory"


def test_damage_raised_while_verifying_exits_1(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def damaged(*args: Any, **kwargs: Any) -> Any:
        raise RecordsDigestMismatch("records file hashes to 00, manifest says 11", path="gym/x/records-11.jsonl")

    monkeypatch.setattr(LocalBackend, "__init__", damaged)
    result = run("verify", str(root / "ck-7"))
    assert result.exit_code == 1, result.output
    assert_one_error_line(result, "gym/x/records-11.jsonl: records file hashes to 00")


def test_a_storage_error_while_listing_for_inspect_exits_2(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading the manifests for the listing fails: exit 2 with one line, not a traceback."""

    def broken(self: Any, path: str) -> Any:
        raise StorageError(f"cannot read {path}: Input/output error", path=path)

    monkeypatch.setattr(LocalBackend, "open_read", broken)
    result = run("inspect", str(root / "ck-7"))
    assert result.exit_code == 2, result.output
    assert_one_error_line(result, f"cannot read {root / 'ck-7'}: ", "Input/output error")


# --- invalid YAML: a startup error naming the file and the position

BAD_YAML = "checkpoint: [unclosed\n"
BAD_YAML_PROBLEM = "invalid YAML at line 2, column 1: expected ',' or ']', but got '<stream end>'"


def test_serve_with_invalid_yaml_exits_2_before_uvicorn_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("uvicorn started")

    monkeypatch.setattr(uvicorn, "run", never)
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_YAML)
    result = run("serve", "counter", "--config", str(bad))
    assert result.exit_code == 2, result.output
    assert_one_error_line(result, f"{bad}: {BAD_YAML_PROBLEM}")


def test_stack_up_with_invalid_yaml_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("servers:\n  - {name: counter, kind: counter}\n\tport: 3\n")
    result = run("stack", "up", str(bad))
    assert result.exit_code == 2, result.output
    line = assert_one_error_line(result, f"{bad}: invalid YAML at line 3, column 1: found character")
    assert line.count(str(bad)) == 1, line

    bad.write_text(BAD_YAML)
    result = run("stack", "up", str(bad))
    assert result.exit_code == 2
    assert assert_one_error_line(result) == f"error: {bad}: {BAD_YAML_PROBLEM}"


def test_the_loaders_raise_value_error_naming_the_file_and_position(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_YAML)
    expected = f"{bad}: {BAD_YAML_PROBLEM}"
    with pytest.raises(ValueError) as settings:
        load_settings(bad)
    assert str(settings.value) == expected
    with pytest.raises(ValueError) as config:
        load_server_config(CounterConfig, bad)
    assert str(config.value) == expected
    with pytest.raises(ValueError) as stack:
        load_stack(bad, workdir=tmp_path)
    assert str(stack.value) == expected


def test_verify_and_inspect_help_state_exit_codes_and_the_json_error() -> None:
    for command in ("verify", "inspect"):
        text = one_line(run(command, "--help").stdout)
        assert "Exit status: 0" in text, text
        assert "2 usage error or unreachable storage" in text, text
        assert '{"error": {"code": ..., "detail": ...}}' in text, text
    assert "1 errors found" in one_line(run("verify", "--help").stdout)
    assert "1 --dump of a damaged participant (nothing written)" in one_line(run("inspect", "--help").stdout)
