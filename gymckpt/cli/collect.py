"""``gymckpt collect``: run a dataset through the environment, checkpointing the rows in flight."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
from rich.table import Table
from rich.text import Text

from gymckpt.cli._errors import Command, fail
from gymckpt.cli._options import log_level_option, storage_arguments, storage_options
from gymckpt.cli._output import stderr, stdout, text, write_json
from gymckpt.collect.health import DEFAULT_MIN_CHECKPOINT_SUCCESS
from gymckpt.collect.runner import EXIT_CHECKPOINTS_FAILED
from gymckpt.errors import CheckpointDirNotAllowed, GymckptError
from gymckpt.store.printable import printable

__all__ = ["collect_command"]


@click.command("collect", cls=Command)
@click.argument("dataset", type=click.Path(exists=True, dir_okay=False))
@click.option("--environment", required=True, metavar="URL", help="The environment server whose /run runs each row.")
@click.option(
    "--servers",
    multiple=True,
    metavar="URL",
    help="Every other Gym server the checkpoints coordinate: model, agent, resources (repeatable, or comma-separated).",
)
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False), help="The results file (JSONL).")
@click.option(
    "--checkpoint-dir",
    metavar="DIR|s3://…",
    help="Checkpoint root: one directory per checkpoint and LATEST. It must lie below every server's "
    "checkpoint.allowed_roots: checked with each server before the first row (exit 2 if one refuses). "
    "Without it, nothing is checkpointed.",
)
@click.option(
    "--every",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Checkpoint every SECONDS (0: never); needs --checkpoint-dir.",
)
@click.option("--keep", type=click.IntRange(min=1), default=2, show_default=True, help="Published checkpoints kept.")
@click.option(
    "--min-checkpoint-success",
    type=click.FloatRange(min=0, max=1),
    default=DEFAULT_MIN_CHECKPOINT_SUCCESS,
    show_default=True,
    metavar="FRACTION",
    help="Of the checkpoints attempted (--every, SIGUSR1, the stop's), the fraction that must be published, "
    "else exit 3; at least one must be, whatever this is.",
)
@click.option(
    "--concurrency", type=click.IntRange(min=1), default=32, show_default=True, help="Rows in flight at most."
)
@click.option("--resume", is_flag=True, help="Continue the collection of --out from the newest published checkpoint.")
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False),
    help="YAML with the servers' checkpoint: block (a stack file works): the control token, storage_options. "
    "GYMCKPT_CHECKPOINT__CONTROL_AUTH_TOKEN overrides it.",
)
@click.option(
    "--checkpoint-timeout",
    type=click.FloatRange(min=1),
    default=120.0,
    show_default=True,
    help="Seconds per checkpoint.",
)
@click.option(
    "--run-timeout", type=click.FloatRange(min=1), default=3600.0, show_default=True, help="Seconds per /run."
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@storage_arguments
@log_level_option
def collect_command(
    dataset: str,
    environment: str,
    servers: tuple[str, ...],
    out: str,
    checkpoint_dir: str | None,
    every: float,
    keep: int,
    min_checkpoint_success: float,
    concurrency: int,
    resume: bool,
    config_file: str | None,
    checkpoint_timeout: float,
    run_timeout: float,
    as_json: bool,
    endpoint_url: str | None,
    storage_option: tuple[str, ...],
) -> None:
    """Run every row of DATASET (JSONL) through the environment, checkpointing rows in flight.

    \b
    Each row's reply goes to --out as it arrives (its _ng_rollout_id, indexes, attempt, and
    "result" or "failure"). A row's rollout id is its _ng_rollout_id, else
    "<task index>-<rollout index>"; its task is the row without its _ng_* fields.
    Checkpoints are taken every --every seconds, on SIGUSR1, and on SIGTERM or Ctrl-C (then
    the servers stay stopped and collect exits with status 75 once the checkpoint is
    published). --resume skips the rows --out has ended, restores and continues the rows
    the newest checkpoint holds, and starts over (as their next attempt, after fencing the
    old one everywhere) every other row the previous run had sent.

    \b
    Before the first row, --checkpoint-dir is checked with every server against its
    checkpoint.allowed_roots (servers whose status does not list them, reference servers,
    are not checked). A checkpoint that fails is one line while it runs, and counted in
    the summary ("checkpoints failed").

    \b
    Beside --out, <stem>.dispatch.jsonl (results.jsonl: results.dispatch.jsonl) logs every
    attempt this run may have sent: a {"run_id"} line, then [rollout_id, attempt] fsynced
    before each /run. It is replaced when a run starts, and kept when it ends, never
    removed. --resume reads it to fence what the previous run may still have running and
    to know its checkpoints; without it, resume still works from --out and the checkpoint,
    but cannot fence a row the dead run had sent and not yet answered. Delete it with --out.

    \b
    Exit status: 0 every row has a result and enough checkpoints were published,
    1 some row failed, 2 usage or config error (the checkpoint directory refused
    included: nothing was sent), 3 too few checkpoints: checkpoints were attempted and
    none was published, or fewer than --min-checkpoint-success of them (or the stop's
    failed), 75 stopped after a checkpoint.
    """
    import asyncio

    from gymckpt import telemetry
    from gymckpt.collect import CollectOptions, collect
    from gymckpt.control.settings import load_settings

    telemetry.configure_from_environment("gymckpt-collect")
    if every > 0 and checkpoint_dir is None:  # else the timer never runs: a run that looks protected and is not
        fail(
            f"--every {every:g} asks for checkpoints, but no --checkpoint-dir says where: give one, or leave out --every"
        )
    try:
        settings = load_settings(config_file).checkpoint
    except (ValueError, OSError) as exc:
        fail(f"cannot read the settings: {exc}")
    if not settings.control_auth_token:
        fail("no control token: give --config with a checkpoint: block, or set GYMCKPT_CHECKPOINT__CONTROL_AUTH_TOKEN")
    storage = {**settings.storage_options, **storage_options(endpoint_url, storage_option)}
    root = checkpoint_dir
    if root is not None and "://" not in root:
        root = str(Path(root).resolve())  # the servers resolve relative paths against their own directory
    options = CollectOptions(
        dataset=Path(dataset),
        environment=environment,
        servers=[url for value in servers for url in value.split(",") if url.strip()],
        out=Path(out),
        token=settings.control_auth_token.get_secret_value(),
        checkpoint_dir=root,
        storage_options=storage,
        every=every,
        keep=keep,
        min_checkpoint_success=min_checkpoint_success,
        concurrency=concurrency,
        resume=resume,
        checkpoint_timeout=checkpoint_timeout,
        run_timeout=run_timeout,
    )
    try:
        summary = asyncio.run(collect(options, stderr()))
    except GymckptError as exc:  # a bad dataset line, a results file in the way, servers not answering, a refused root
        fail(str(exc), error=exc.code if isinstance(exc, CheckpointDirNotAllowed) else "usage_error")
    except FileNotFoundError as exc:
        fail(str(exc))
    _print_collect_summary(summary, as_json)
    if summary.exit_code == EXIT_CHECKPOINTS_FAILED:  # after the summary: the last line says why the status is 3
        stderr().print(Text.assemble(("error:", "bold red"), " ", printable(_shortfall_line(summary))))
    sys.exit(summary.exit_code)


def _shortfall_line(summary: Any) -> str:
    first = f" (the first: {summary.checkpoint_failure})" if summary.checkpoint_failure else ""
    return f"checkpoints fell short: {summary.checkpoint_shortfall}{first}"


def _print_collect_summary(summary: Any, as_json: bool) -> None:
    import dataclasses

    if as_json:
        write_json(dataclasses.asdict(summary))
        return
    table = Table(title="gymckpt collect", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("rows", summary.rows),
        ("ended before this run", summary.skipped),
        ("finished", summary.finished),
        ("failed", summary.failed),
        ("continued from a checkpoint", summary.continued),
        ("restarted", summary.restarted),
        ("checkpoints taken", len(summary.checkpoints)),
        ("checkpoints failed", summary.checkpoints_failed),
        ("prepare seconds (max)", f"{max(summary.prepare_seconds, default=0):.2f}"),
        ("commit seconds (max)", f"{max(summary.commit_seconds, default=0):.2f}"),
    ]
    if summary.stopped:
        rows.append(("stopped at", summary.stopped_at or "no checkpoint"))
    for name, value in rows:
        table.add_row(name, text(value))
    stdout().print(table)
