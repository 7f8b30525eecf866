"""``gymckpt collect`` fails loudly: a refused checkpoint directory, checkpoints that fail, the exit status.

Against the real stack of ``test_collect_process`` (its module fixtures, reused: real
``gymckpt serve`` processes whose ``allowed_roots`` is the module's base directory) with
the collector as a subprocess:

- a ``--checkpoint-dir`` outside the servers' ``allowed_roots`` is refused before any row
  is sent (no results file, no dispatch log, no model call), with one line naming the
  setting and the option;
- a run whose every checkpoint fails (the directory lies below an allowed root, but under a
  regular file: every server's commit fails) exits with status 3 and counts the failures in
  its summary, each failure said in one short line while it runs;
- a healthy run still exits 0 with none failed.
- every server's status lists the roots it accepts (``allowed_roots``), as the check reads them.

The pieces, in process: ``test_collect_health``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gymckpt.collect.journal import dispatch_log_path
from gymckpt.control.coordination import Coordinator, ParticipantInfo

from . import test_collect_process as process
from .test_collect_process import PHASE, TOKEN, CollectStack, write_dataset

if TYPE_CHECKING:
    from pathlib import Path

EXIT_OK, EXIT_USAGE, EXIT_CHECKPOINTS_FAILED = 0, 2, 3
#: rows of a run that must take checkpoints: at 4 in flight, about 7 s of rows (a row takes ~0.7 s)
ROWS = 40
#: a failed checkpoint's line while running is one short line, not a dump of every server's reply
SHORT_LINE = 300


# the stack fixtures of test_collect_process, reused (this module gets a stack of its own)
module_stack, stack, workdir = process.module_stack, process.stack, process.workdir


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


# ----------------------------------------------------------------------------- against the stack


def test_a_checkpoint_dir_outside_the_allowed_roots_is_refused_before_any_row(
    stack: CollectStack, workdir: Path, tmp_path: Path
) -> None:
    dataset = write_dataset(workdir / "data.jsonl", range(12))
    out = workdir / "results.jsonl"
    outside = tmp_path / "ckpts"  # tmp_path is not below the module's base, the servers' only allowed root
    assert not str(outside).startswith(str(stack.base))

    done = stack.start_collect(dataset, out, outside, "--every", "1").finish()

    assert done.code == EXIT_USAGE, done
    lines = error_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    (line,) = lines
    assert line.startswith("error:"), line
    assert "checkpoint.allowed_roots" in line and "--checkpoint-dir" in line, line
    assert str(outside) in line and str(stack.base.resolve()) in line, line
    assert len(line) < 1000, line
    # nothing was sent: no results, no dispatch log, no model call (every /run makes several)
    assert not out.exists() or out.read_bytes() == b"", out.read_text()
    assert not dispatch_log_path(out).exists()
    assert stack.model_calls() == []
    assert not outside.exists()
    # the same run below the allowed root is not blocked by the refused one (no results file was left)
    again = stack.start_collect(dataset, out, workdir / "ckpts").finish()
    assert again.code == EXIT_OK, again
    assert again.summary["finished"] == 12, again


def test_every_checkpoint_failing_exits_3_and_counts_them(stack: CollectStack, workdir: Path) -> None:
    dataset = write_dataset(workdir / "data.jsonl", range(ROWS))
    out = workdir / "results.jsonl"
    blocker = workdir / "blocker"
    blocker.write_text("a regular file where the checkpoint root's parent should be\n")
    root = blocker / "ckpts"  # below the allowed root: passes the check, but no server can commit there

    done = stack.start_collect(dataset, out, root, "--every", "0.5", "--concurrency", "4").finish()

    assert done.code == EXIT_CHECKPOINTS_FAILED, done
    summary = done.summary
    assert summary["finished"] == ROWS and summary["failed"] == 0, done
    assert summary["checkpoints"] == [], done
    assert summary["checkpoints_failed"] >= 1, done
    assert summary["checkpoint_failure"], done
    failures = [line for line in done.stderr.splitlines() if line.startswith("checkpoint ") and "fail" in line]
    assert len(failures) == summary["checkpoints_failed"], done.stderr
    assert all(len(line) < SHORT_LINE for line in failures), failures
    assert all(line.count("http://") <= 1 for line in failures), failures  # the servers grouped, not each URL


def test_a_healthy_run_exits_0_with_no_checkpoint_failed(stack: CollectStack, workdir: Path) -> None:
    dataset = write_dataset(workdir / "data.jsonl", range(ROWS))
    out = workdir / "results.jsonl"

    done = stack.start_collect(dataset, out, workdir / "ckpts", "--every", "0.5", "--concurrency", "4").finish()

    assert done.code == EXIT_OK, done
    assert done.summary["finished"] == ROWS, done
    assert done.summary["checkpoints"], done
    assert done.summary["checkpoints_failed"] == 0 and done.summary["checkpoint_failure"] is None, done


def test_every_server_of_the_stack_reports_its_allowed_roots(stack: CollectStack) -> None:
    async def discover() -> list[ParticipantInfo]:
        urls = [stack.harness.urls[name] for name in stack.harness.gym_servers]
        async with Coordinator(urls, token=TOKEN, probe_timeout=PHASE) as gym:
            return (await gym.discover()).raise_for_problems().participants

    participants = stack.run(discover())
    assert {info.kind for info in participants} == {"environment", "model", "agent", "resources"}
    for info in participants:
        assert info.roots_reported and info.allowed_roots == (str(stack.base.resolve()),), info
