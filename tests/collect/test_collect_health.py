"""The pieces behind ``gymckpt collect``'s loud failures, in process (the process tests: ``test_collect_loud``).

Each server's status lists the roots it accepts; the collector's check uses the servers' own
rule (:func:`~gymckpt.control.allowed_roots.check_allowed`) and refuses with one line, the
servers grouped by their roots; a server without the field (a reference server) is skipped;
a failed checkpoint is one short line; the exit rule for too few published checkpoints.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

import pytest

from gymckpt.collect.health import check_checkpoint_dir, checkpoint_shortfall, failure_line, not_prepared_line
from gymckpt.control.allowed_roots import normalize_location
from gymckpt.control.coordination import Coordinator, ParticipantInfo, PrepareResult
from gymckpt.control.models import Phase, PrepareReply, PrepareReport
from gymckpt.control.plane import ControlPlane
from gymckpt.errors import CheckpointDirNotAllowed, CoordinationError, error_for_code
from gymckpt.testing.net import serve
from gymckpt.testing.participant import FakeParticipant

from ..control.coord_server import build_reference_app

if TYPE_CHECKING:
    from pathlib import Path

TOKEN = "collect-health-token"
#: the bound of the one discover against a reference-shaped server
PHASE = 60.0
#: a failed checkpoint's line while running is one short line, not a dump of every server's reply
SHORT_LINE = 300


def _info(url: str, roots: tuple[str, ...] | None, *, reported: bool = True) -> ParticipantInfo:
    return ParticipantInfo(url, "environment", "env-0", allowed_roots=roots, roots_reported=reported)


def test_the_status_lists_the_allowed_roots_resolved(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    relative = os.path.relpath(tmp_path / "link")
    plane = ControlPlane(FakeParticipant("environment", "env-0"), allowed_roots=[relative, "s3://bucket/run-3/"])
    status = plane.status().model_dump(mode="json")
    assert status["allowed_roots"] == [str((tmp_path / "real").resolve()), "s3://bucket/run-3"]
    anything = ControlPlane(FakeParticipant("environment", "env-0")).status().model_dump(mode="json")
    assert "allowed_roots" in anything and anything["allowed_roots"] is None


def test_the_check_uses_the_servers_rule(tmp_path: Path) -> None:
    allowed = str(tmp_path / "allowed")
    (tmp_path / "allowed").mkdir()
    (tmp_path / "escape").symlink_to(tmp_path / "elsewhere")
    below = [_info("http://127.0.0.1:1", (normalize_location(allowed),))]

    assert check_checkpoint_dir(below, f"{allowed}/run-1") == []
    assert check_checkpoint_dir([_info("http://127.0.0.1:1", None)], str(tmp_path / "anywhere")) == []
    assert check_checkpoint_dir([_info("http://127.0.0.1:1", ("s3://bucket/run-3",))], "s3://bucket/run-3/c") == []
    for refused in (str(tmp_path / "elsewhere"), f"{allowed}/../elsewhere", "s3://bucket/run-3/c"):
        with pytest.raises(CheckpointDirNotAllowed) as raised:
            check_checkpoint_dir(below, refused)
        assert "checkpoint.allowed_roots" in str(raised.value) and "--checkpoint-dir" in str(raised.value)
    with pytest.raises(CheckpointDirNotAllowed):  # with any root allowed, only local, file:// and s3:// are
        check_checkpoint_dir([_info("http://127.0.0.1:1", None)], "ftp://host/ckpts")


def test_the_refusal_is_one_line_with_the_servers_grouped_by_their_roots(tmp_path: Path) -> None:
    servers = [
        _info("http://127.0.0.1:1", ("/srv/a",)),
        _info("http://127.0.0.1:2", ("/srv/a",)),
        _info("http://127.0.0.1:3", ("/srv/b",)),
        _info("http://127.0.0.1:4", (str(tmp_path),)),
    ]
    with pytest.raises(CheckpointDirNotAllowed) as raised:
        check_checkpoint_dir(servers, str(tmp_path / "ckpts"))
    message = str(raised.value)
    assert "\n" not in message
    assert message.count("/srv/a") == 1 and message.count("/srv/b") == 1, message
    assert "2 servers (http://127.0.0.1:1, http://127.0.0.1:2)" in message, message
    assert "http://127.0.0.1:4" not in message, message  # it accepts the directory


def test_a_server_that_does_not_report_its_roots_is_skipped(tmp_path: Path) -> None:
    silent = [_info("http://127.0.0.1:1", None, reported=False)]
    assert check_checkpoint_dir(silent, "ftp://host/anything") == ["http://127.0.0.1:1"]

    async def discover(url: str) -> list[ParticipantInfo]:
        async with Coordinator([url], token=TOKEN, probe_timeout=10.0) as gym:
            return (await gym.discover(require_model=False)).raise_for_problems().participants

    with serve(build_reference_app("environment", "env-0", TOKEN), graceful_shutdown=5.0) as url:
        (info,) = asyncio.run(asyncio.wait_for(discover(url), PHASE))
    assert not info.roots_reported and info.allowed_roots is None
    assert check_checkpoint_dir([info], str(tmp_path / "anywhere")) == [url]


def test_a_failed_checkpoint_is_one_short_line_with_the_code_and_the_first_cause() -> None:
    urls = [f"http://127.0.0.1:{port}" for port in (8101, 8102, 8103, 8104)]
    kinds = dict(zip(urls, ("model", "resources", "agent", "environment"), strict=True))
    detail = "checkpoint_dir '/x/ckpt-1' lies outside the setting checkpoint.allowed_roots (['/srv/a']) " * 4
    causes = {}
    for url in urls:
        cause = error_for_code("checkpoint_dir_not_allowed")(f"{url}: commit answered 403: {detail}")  # type: ignore[misc]
        cause.server, cause.wire_code, cause.http_status = url, "checkpoint_dir_not_allowed", 403
        causes[url] = cause
    line = failure_line("ckpt-1", CoordinationError("commit", causes), kinds)
    assert "\n" not in line and len(line) < SHORT_LINE, line
    assert "checkpoint_dir_not_allowed" in line and "403" in line, line
    assert "4 servers" in line and "http://" not in line, line
    assert line.startswith("checkpoint ckpt-1 failed"), line


@pytest.mark.parametrize(
    ("taken", "failed", "fraction", "short"),
    [
        (0, 0, 0.5, False),  # none asked for: no verdict
        (0, 1, 0.5, True),  # none published
        (0, 3, 0.0, True),  # none published, even with no fraction asked for
        (1, 1, 0.5, False),  # half failed: enough
        (1, 2, 0.5, True),  # more than half failed
        (1, 9, 0.1, False),
        (9, 1, 1.0, True),  # every one must publish
    ],
)
def test_the_checkpoint_shortfall_rule(taken: int, failed: int, fraction: float, short: bool) -> None:
    assert (checkpoint_shortfall(taken, failed, fraction) is not None) is short


def test_the_help_states_the_exit_codes_the_rule_and_the_dispatch_log() -> None:
    from click.testing import CliRunner

    from gymckpt.cli import main

    result = CliRunner().invoke(main, ["collect", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for needed in ("3 too few checkpoints", "--min-checkpoint-success", ".dispatch.jsonl", "allowed_roots"):
        assert needed in text, needed


def test_every_without_a_checkpoint_dir_is_a_usage_error(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from gymckpt.cli import main

    dataset = tmp_path / "data.jsonl"
    dataset.write_text('{"task": 1}\n')
    arguments = ["collect", str(dataset), "--environment", "http://127.0.0.1:9", "--out", str(tmp_path / "r.jsonl")]
    result = CliRunner().invoke(main, [*arguments, "--every", "30"])
    assert result.exit_code == 2, result.output
    assert "--checkpoint-dir" in result.output and "--every 30" in result.output, result.output
    assert not (tmp_path / "r.jsonl").exists()


def test_a_checkpoint_not_prepared_in_time_is_one_short_line() -> None:
    blockers = [f"row-{index}" for index in range(100)]
    busy = PrepareReport(ready=False, blockers=blockers, blocker_count=250)
    replies = {
        "http://127.0.0.1:1": PrepareReply(phase=Phase.PREPARED, report=PrepareReport(ready=True)),
        "http://127.0.0.1:2": PrepareReply(phase=Phase.PREPARING, report=busy),
    }
    line = not_prepared_line("ckpt-1", PrepareResult(False, replies, stopped_at="model"))
    assert line.startswith("checkpoint ckpt-1 failed: prepare"), line
    assert "model" in line and "250 blocking rows on 1 server)" in line, line
    assert "row-" not in line and len(line) < SHORT_LINE, line
