"""The ``gymckpt`` command: verify and inspect checkpoints offline, run the demo.

Exit codes: 0 clean, 1 damage found (errors), 2 usage error or unreachable storage.
Errors are one line on stderr, never a traceback; text from data (paths, URLs, details)
is never read as rich markup. Under ``--json`` an exit-2 error is also written on stdout
as ``{"error": {"code": ..., "detail": ...}}``.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click
import orjson
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table
from rich.text import Text

from gymckpt._version import __version__
from gymckpt.errors import GymckptError, InvalidCheckpointState, UnusableDirectory
from gymckpt.stack import KINDS, load_stack
from gymckpt.stack.kinds import load_config
from gymckpt.stack.serving import MAX_WORKERS, serve
from gymckpt.store.checkpoint_store import CheckpointStore, backend_for_url
from gymckpt.store.codec import encode_record
from gymckpt.store.layout import check_readable_name
from gymckpt.store.listing import list_checkpoints, participant_rows
from gymckpt.store.verify import NoCheckpointFound, Severity, verify

if TYPE_CHECKING:
    from gymckpt.store.verify import VerifyReport

EXIT_OK, EXIT_DAMAGED, EXIT_USAGE = 0, 1, 2

_stdout = Console(soft_wrap=True)
_stderr = Console(stderr=True, soft_wrap=True)
#: key in click's context meta: write errors as a JSON object on stdout too (--json)
_JSON_ERRORS = "gymckpt.json_errors"


def _storage_options(endpoint_url: str | None, options: tuple[str, ...]) -> dict[str, Any]:
    parsed: dict[str, Any] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not key:
            _fail(f"--storage-option expects KEY=VALUE, got {option!r}")
        parsed[key] = value
    if endpoint_url:
        parsed["endpoint_url"] = endpoint_url
    return parsed


def _storage_arguments(command: Any) -> Any:
    command = click.option(
        "--storage-option",
        "-o",
        "storage_option",
        multiple=True,
        metavar="KEY=VALUE",
        help="Option for the object-storage filesystem (repeatable), e.g. -o key=AKIA… -o secret=….",
    )(command)
    return click.option(
        "--endpoint-url",
        metavar="URL",
        help="S3-compatible endpoint, e.g. http://127.0.0.1:9000. Credentials also come from AWS_* variables.",
    )(command)


def _set_log_level(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--log-level``: gymckpt's lines (timestamp, level, logger) at this level, here and in the servers started."""
    from gymckpt import telemetry

    if value is not None:
        os.environ[telemetry.LOG_LEVEL_ENV] = value
    telemetry.setup_logging(value)
    return value


def _log_level_option(command: Any, default: str | None = None) -> Any:
    from gymckpt.telemetry import LOG_LEVELS

    return click.option(
        "--log-level",
        type=click.Choice(LOG_LEVELS, case_sensitive=False),
        default=default,
        expose_value=False,
        is_eager=True,
        callback=_set_log_level,
        help="gymckpt's log level, also for the servers it starts "
        f"[default: {default or 'GYMCKPT_LOG_LEVEL, else info'}].",
    )(command)


def _set_keep_alive(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """``--keep-alive``: the servers' idle-connection timeout, here and in the servers started."""
    from gymckpt.transport import KEEP_ALIVE_ENV

    if value is not None:
        os.environ[KEEP_ALIVE_ENV] = repr(value)
    return value


def _keep_alive_option(command: Any) -> Any:
    from gymckpt.transport import SERVER_KEEP_ALIVE_SECONDS

    return click.option(
        "--keep-alive",
        type=click.FloatRange(min=0, min_open=True),
        expose_value=False,
        callback=_set_keep_alive,
        metavar="SECONDS",
        help="How long a server keeps an idle connection open; gymckpt's clients drop theirs sooner "
        f"(after at most half of it) [default: GYMCKPT_KEEP_ALIVE, else {SERVER_KEEP_ALIVE_SECONDS:.0f}].",
    )(command)


def _fail(message: str, code: int = EXIT_USAGE, *, error: str = "usage_error") -> NoReturn:
    """Print ``error: message`` on stderr as one line, never read as markup, and exit with ``code``.

    Under --json, also write ``{"error": {"code": error, "detail": message}}`` on stdout.
    """
    line = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    context = click.get_current_context(silent=True)
    if context is not None and context.meta.get(_JSON_ERRORS):
        _write_json({"error": {"code": error, "detail": line}})
    _stderr.print(Text.assemble(("error:", "bold red"), " ", line))
    sys.exit(code)


def _fail_reading(url: str, exc: Exception, options: dict[str, Any] | None = None) -> NoReturn:
    """Exit for what opening, listing or reading ``url`` raised: 1 for damage, 2 for anything else."""
    if isinstance(exc, NoCheckpointFound):
        _fail(str(exc), error=exc.code)
    if isinstance(exc, MemoryError):
        _fail(
            f"ran out of memory while reading {url}: the check did not finish (this is not damage)",
            error="out_of_memory",
        )
    if isinstance(exc, UnusableDirectory):  # cannot be read (no permission, not a directory): not damage
        _fail(f"cannot read {url}: {exc}", error=exc.problem)
    if isinstance(exc, InvalidCheckpointState):
        _fail(str(exc), EXIT_DAMAGED, error=exc.problem)
    if isinstance(exc, GymckptError):
        _fail(f"cannot read {url}: {exc}", error=exc.code)
    hint = " (check the --storage-option names)" if options and isinstance(exc, TypeError) else ""
    _fail(f"cannot read {url}: {type(exc).__name__}: {exc}{hint}", error="storage_error")


def _write_json(value: Any) -> None:
    sys.stdout.write(orjson.dumps(value, option=orjson.OPT_INDENT_2).decode() + "\n")


def _check_url(url: str) -> None:
    if not url.strip():
        _fail("URL is empty: give a checkpoint directory, a store root, or an s3:// URL")


class _Command(click.Command):
    """A command whose own usage errors are one line too (and a JSON error object under --json)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[_JSON_ERRORS] = "--json" in args
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            _fail(f"{exc.format_message()} (see '{ctx.command_path} --help')")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gymckpt")
def main() -> None:
    """Partial-rollout checkpointing for RL environment servers.

    \b
    gymckpt verify ./checkpoints/ckpt-7        check a checkpoint offline
    gymckpt inspect ./checkpoints/ckpt-7       list its participants
    gymckpt demo                               checkpoint in-flight rollouts, crash, restore, continue
    gymckpt serve KIND --port N [--workers N]  run one reference server
    gymckpt stack up STACK.yaml                run a whole stack of them
    gymckpt collect DATA.jsonl --environment URL --out R.jsonl --checkpoint-dir DIR
                                               run a dataset, surviving preemption
    """


@main.command("verify", cls=_Command)
@click.argument("url")
@click.option("--quick", is_flag=True, help="Skip re-hashing records files: check manifests, presence and sizes only.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='Print the report as JSON on stdout; on exit 2, {"error": {"code": ..., "detail": ...}} instead.',
)
@_storage_arguments
def verify_command(
    url: str, quick: bool, as_json: bool, endpoint_url: str | None, storage_option: tuple[str, ...]
) -> None:
    """Check one checkpoint directory, or every checkpoint under URL, without any server.

    \b
    URL is a local path, file://, or s3://bucket/prefix.
    Checkpoints the reference stack's store wrote are checked too, as far as
    their manifests allow; the report names each participant's format.
    Exit status:
      0  clean (warnings allowed)
      1  errors found: the checkpoint is damaged
      2  usage error or unreachable storage: no checkpoint there, bad storage
         options, storage that cannot be read, out of memory
    Errors are one line on stderr. With --json, stdout holds the report, or on
    exit 2 {"error": {"code": ..., "detail": ...}}, code e.g. usage_error,
    checkpoint_not_found, unsupported_storage, storage_error.
    """
    _check_url(url)
    options = _storage_options(endpoint_url, storage_option)
    show_progress = not as_json and _stderr.is_terminal
    try:
        with _progress(show_progress) as advance:
            report = verify(url, quick=quick, progress=advance, **options)
    except Exception as exc:  # storage, options, memory: never a traceback, and damage only if it is damage
        _fail_reading(url, exc, options)
    if as_json:
        _write_json(report.to_dict())
    else:
        _print_report(report)
    sys.exit(EXIT_OK if report.ok else EXIT_DAMAGED)


class _progress:
    """A progress bar on a terminal; a no-op callback elsewhere."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Progress | None = None
        self.task: Any = None

    def __enter__(self) -> Any:
        if not self.enabled:
            return None
        self.bar = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=_stderr,
            transient=True,
        )
        self.bar.start()
        self.task = self.bar.add_task("verifying", total=None)
        return self.advance

    def advance(self, done: int, total: int) -> None:
        assert self.bar is not None
        self.bar.update(self.task, advance=done, total=total)

    def __exit__(self, *exc_info: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def _print_report(report: VerifyReport) -> None:
    if report.findings and _stdout.is_terminal:
        table = Table(title=Text(f"Findings for {report.url}"), show_lines=False)
        table.add_column("severity", no_wrap=True)
        table.add_column("finding", no_wrap=True)
        table.add_column("participant", no_wrap=True)
        table.add_column("path", overflow="fold")
        table.add_column("detail", overflow="fold")
        for finding in report.findings:
            style = "bold red" if finding.severity is Severity.ERROR else "yellow"
            table.add_row(  # Text: paths and details are data, never markup
                Text(str(finding.severity), style=style),
                Text(finding.code),
                Text(finding.participant),
                Text(finding.path),
                Text(finding.detail + (f"\nfix: {finding.fix}" if finding.fix else "")),
            )
        _stdout.print(table)
    else:
        # one finding per line, never wrapped: for logs, grep and copy-paste
        for finding in report.findings:
            fix = f" (fix: {finding.fix})" if finding.fix else ""
            _plain(
                f"{finding.severity}\t{finding.code}\t{finding.participant or '-'}\t{finding.path}\t{finding.detail}{fix}"
            )
    mode = "sizes only (--quick)" if report.quick else f"{report.records_checked} records re-read and hashed"
    formats = report.format_summary()
    _plain(
        f"{len(report.checkpoints)} checkpoint(s), {len(report.participants)} participant(s)"
        f"{f' ({formats})' if formats else ''}, {_human(report.bytes_checked)} checked, {mode}: "
        f"{len(report.errors)} error(s), {len(report.warnings)} warning(s)"
    )
    if report.ok:
        _plain("OK" + (" (warnings are leftovers, safe to clean up)" if report.warnings else ""))
    else:
        _plain("DAMAGED: do not restore from the checkpoints listed above")


def _plain(line: str) -> None:
    """A line on stdout, never wrapped or styled (rich would fold it at 80 columns in a pipe)."""
    if _stdout.is_terminal:
        _stdout.print(line, highlight=False, markup=False, emoji=False)
    else:
        sys.stdout.write(line + "\n")


def _human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"  # pragma: no cover


@main.command("inspect", cls=_Command)
@click.argument("url")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='Print the listing as JSON on stdout; on exit 2, {"error": {"code": ..., "detail": ...}} instead.',
)
@click.option("--dump", metavar="KIND/INSTANCE", help="Write this participant's records to stdout as JSONL.")
@click.option("--episode", "episodes", multiple=True, metavar="ID", help="With --dump: only these episodes.")
@_storage_arguments
def inspect_command(
    url: str,
    as_json: bool,
    dump: str | None,
    episodes: tuple[str, ...],
    endpoint_url: str | None,
    storage_option: tuple[str, ...],
) -> None:
    """List participants, record counts, sizes, episodes and extra fields under URL.

    With --dump, write one participant's records as JSONL instead, after verifying the
    whole records file (exit 1, and nothing written, if it is damaged).

    \b
    Exit status:
      0  listed (damaged participants are marked in the listing), or dumped
      1  --dump of a damaged participant (nothing written)
      2  usage error or unreachable storage: no checkpoint there, bad storage
         options, storage that cannot be read, out of memory
    Errors are one line on stderr. With --json, stdout holds the listing, or on
    exit 2 {"error": {"code": ..., "detail": ...}}, code e.g. usage_error,
    checkpoint_not_found, unsupported_storage, storage_error.
    """
    _check_url(url)
    if episodes and dump is None:
        _fail("--episode needs --dump KIND/INSTANCE: it chooses which of that participant's records to write")
    options = _storage_options(endpoint_url, storage_option)
    try:
        backend = backend_for_url(url, **options)
        checkpoints = list_checkpoints(backend)
    except Exception as exc:  # storage, options, memory: never a traceback
        _fail_reading(url, exc, options)
    if not checkpoints:
        _fail(f"no checkpoint (no gym/ directory) under {url}", error=NoCheckpointFound.code)
    if dump is not None:
        _dump(CheckpointStore(backend), checkpoints, dump, episodes)
        return
    try:
        rows = list(participant_rows(backend, checkpoints))
    except Exception as exc:
        _fail_reading(url, exc, options)
    if as_json:
        _write_json(rows)
        return
    if not _stdout.is_terminal:
        for row in rows:
            if "damaged" in row:
                _plain(f"{row['checkpoint'] or '.'}\t{row['participant']}\tdamaged\t{row['damaged']}")
            else:
                episodes = row["episode_ids"]
                listed = (
                    "not listed" if episodes is None else ",".join(episodes[:20]) + (",…" if len(episodes) > 20 else "")
                )
                size = "size not claimed" if row["records_bytes"] is None else f"{row['records_bytes']} bytes"
                _plain(
                    f"{row['checkpoint'] or '.'}\t{row['participant']}\t{row['checkpoint_id']}\t"
                    f"{row['record_count']} records\t{size}\tepisodes {listed}\t"
                    f"extra {','.join(row['extra'])}\t{row['format']} format"
                )
        return
    table = Table(title=Text(f"Checkpoints under {url}"))
    for column in ("checkpoint", "participant", "checkpoint id", "records", "size", "episodes", "extra fields"):
        table.add_column(column, no_wrap=column in ("participant", "checkpoint id"), overflow="fold")
    for row in rows:
        # Text: checkpoint names, ids, episode ids and details are data, never markup
        if "damaged" in row:
            table.add_row(
                Text(row["checkpoint"] or "."),
                Text(row["participant"]),
                Text("damaged", style="red"),
                "",
                "",
                "",
                Text(row["damaged"]),
            )
            continue
        episodes = row["episode_ids"]
        shown = (
            "(reference format)" if episodes is None else ", ".join(episodes[:3]) + (" …" if len(episodes) > 3 else "")
        )
        table.add_row(
            Text(row["checkpoint"] or "."),
            Text(row["participant"]),
            Text(row["checkpoint_id"]),
            str(row["record_count"]),
            "?" if row["records_bytes"] is None else _human(row["records_bytes"]),
            Text(shown),
            Text(", ".join(row["extra"])),
        )
    _stdout.print(table)


def _dump(store: CheckpointStore, checkpoints: dict[str, Any], dump: str, episodes: tuple[str, ...]) -> None:
    kind, sep, instance = dump.partition("/")
    try:
        check_readable_name("kind", kind)
        check_readable_name("instance", instance)
    except ValueError:
        _fail(f"--dump expects KIND/INSTANCE, e.g. environment/env-0; got {dump!r}")
    if not sep:
        _fail(f"--dump expects KIND/INSTANCE, e.g. environment/env-0; got {dump!r}")
    if len(checkpoints) != 1:
        _fail(f"URL holds {len(checkpoints)} checkpoints ({', '.join(checkpoints)}): name one of them in the URL")
    ((checkpoint, files),) = checkpoints.items()
    if (kind, instance) not in files.participants:
        present = ", ".join(f"{k}/{i}" for k, i in sorted(files.participants)) or "none"
        _fail(f"no participant {kind}/{instance} in this checkpoint (present: {present})")
    out = sys.stdout.buffer
    try:
        # verify the whole file first, so nothing unverified reaches stdout
        for _ in store.read_participant(checkpoint, kind=kind, instance=instance, scope=()):
            pass
        for record in store.read_participant(checkpoint, kind=kind, instance=instance, scope=episodes or None):
            out.write(encode_record(record)[1])
        out.flush()
    except BrokenPipeError:  # the reader stopped early (`| head`): neither damage nor the storage
        click.get_current_context().meta[_JSON_ERRORS] = False  # stdout is gone
        _fail("stdout was closed before every record was written")
    except Exception as exc:  # damage exits 1; storage, memory and the rest 2
        _fail_reading(store.url, exc)


@main.command("serve", cls=_Command)
@click.argument("kind", type=click.Choice(sorted(KINDS)))
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False), help="YAML config file.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True)
@click.option("--fd", type=int, help="Serve an inherited listening socket instead of binding host:port.")
@click.option(
    "--workers",
    type=click.IntRange(1, MAX_WORKERS),
    default=1,
    show_default=True,
    help="uvicorn worker processes. Above 1, this process coordinates them: one checkpoint participant "
    "for all of them, and each session's requests routed to the worker that holds it.",
)
@_keep_alive_option
@_log_level_option
def serve_command(kind: str, config_file: str | None, host: str, port: int, fd: int | None, workers: int) -> None:
    """Run one reference server (inference, model, agent, counter, weather, environment).

    The config file holds the server's own fields and a checkpoint: block; with
    checkpoint.enabled false (the default) no checkpoint route or behaviour is installed.
    With --workers N the control routes answer the same on every worker, a checkpoint
    covers every worker's work, and a restore may run on another worker count.
    """
    try:
        load_config(kind, config_file)
    except (ValueError, ImportError, OSError) as exc:  # invalid YAML, a bad field, an unreadable file
        _fail(f"cannot build the {kind} server: {exc}")
    serve(kind, config_file, host=host, port=port, fd=fd, workers=workers)


@main.group("stack")
def stack_group() -> None:
    """Run a whole stack of reference servers from a YAML file."""


@stack_group.command("up", cls=_Command)
@click.argument("stack_file", type=click.Path(exists=True, dir_okay=False))
@_keep_alive_option
@_log_level_option
def stack_up(stack_file: str) -> None:
    """Start every server of STACK_FILE, each in its own process group, until interrupted."""
    import signal as signals

    try:
        stack = load_stack(stack_file)
    except (ValueError, OSError) as exc:  # invalid YAML names the file already
        message = str(exc)
        _fail(message if message.startswith(f"{stack_file}:") else f"{stack_file}: {message}")
    with stack:
        stack.start()
        for name, url in stack.urls.items():
            _plain(f"{name}\t{stack.servers[name].kind}\t{url}\tlog {stack.servers[name].log_path}")
        _plain("press Ctrl-C to stop the stack")
        stop_signals = {signals.SIGINT, signals.SIGTERM}
        signals.pthread_sigmask(signals.SIG_BLOCK, stop_signals)
        signals.sigwait(stop_signals)


@main.command("demo", cls=_Command)
@functools.partial(_log_level_option, default="warning")
@click.option("--rollouts", default=64, show_default=True, type=click.IntRange(1, 100_000), help="Concurrent rollouts.")
@click.option(
    "--store",
    "store_url",
    default="./checkpoints",
    show_default=True,
    help="Store root (path or URL), or 's3' for an S3 endpoint the demo serves itself (moto, no account).",
)
@click.option("--keep", is_flag=True, help="Leave the restarted stack running; print its URLs and how to stop it.")
@click.option("--seed", default=0, show_default=True, help="Chooses the tasks (the same seed, the same results).")
@click.option(
    "--store-only", is_flag=True, help="Only the store: write four participants' generated records, no servers."
)
@click.option("--episodes", default=64, show_default=True, help="With --store-only: records per participant.")
@click.option(
    "--workers",
    default=2,
    show_default=True,
    type=click.IntRange(1, MAX_WORKERS),
    help="uvicorn workers of each Gym server before the crash.",
)
@click.option(
    "--restore-workers",
    default=3,
    show_default=True,
    type=click.IntRange(1, MAX_WORKERS),
    help="uvicorn workers of each Gym server after the crash (the restore lands on another worker count).",
)
def demo_command(
    rollouts: int,
    store_url: str,
    keep: bool,
    seed: int,
    store_only: bool,
    episodes: int,
    workers: int,
    restore_workers: int,
) -> None:
    """Checkpoint rollouts in flight, kill every server, restore, continue, verify.

    \b
    Starts the reference stack as real processes on loopback and runs the tasks once
    uninterrupted; then, on a fresh stack, starts the rollouts, checkpoints the ones in
    flight once about half have finished, SIGKILLs every server, restarts them, restores,
    continues each exported rollout, compares every result with the uninterrupted run,
    verifies the checkpoint offline and prints a table. Each Gym server runs --workers
    uvicorn workers before the crash and --restore-workers after it.
    Exit status: 0 success, 1 a rollout lost, a result different or a damaged
    checkpoint, 2 setup failure.
    """
    from gymckpt.demo import run_demo, run_s3_demo, run_s3_store_demo, run_store_demo

    if store_only:
        if store_url == "s3":
            try:
                sys.exit(run_s3_store_demo(episodes=episodes, seed=seed, console=_stdout))
            except GymckptError as exc:
                _fail(str(exc))
        sys.exit(run_store_demo(store_url, episodes=episodes, seed=seed, console=_stdout))
    if store_url == "s3":
        try:  # moto or s3fs missing: one line naming the extra to install
            outcome = run_s3_demo(
                rollouts=rollouts,
                keep=keep,
                seed=seed,
                console=_stdout,
                progress_console=_stderr,
                workers=workers,
                restore_workers=restore_workers,
            )
        except GymckptError as exc:
            _fail(str(exc))
    else:
        outcome = run_demo(
            rollouts=rollouts,
            store_url=store_url,
            keep=keep,
            seed=seed,
            console=_stdout,
            progress_console=_stderr,
            workers=workers,
            restore_workers=restore_workers,
        )
    sys.exit(outcome.exit_code)


@main.command("collect", cls=_Command)
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
    help="Checkpoint root: one directory per checkpoint and LATEST. Below the servers' allowed_roots. "
    "Without it, nothing is checkpointed.",
)
@click.option(
    "--every", type=click.FloatRange(min=0), default=0.0, show_default=True, help="Checkpoint every SECONDS (0: never)."
)
@click.option("--keep", type=click.IntRange(min=1), default=2, show_default=True, help="Published checkpoints kept.")
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
@_storage_arguments
@_log_level_option
def collect_command(
    dataset: str,
    environment: str,
    servers: tuple[str, ...],
    out: str,
    checkpoint_dir: str | None,
    every: float,
    keep: int,
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
    Exit status: 0 every row has a result, 1 some row failed, 2 usage or config error,
    75 stopped after a checkpoint.
    """
    import asyncio

    from gymckpt import telemetry
    from gymckpt.collect import CollectOptions, collect
    from gymckpt.control.settings import load_settings

    telemetry.configure_from_environment("gymckpt-collect")
    try:
        settings = load_settings(config_file).checkpoint
    except (ValueError, OSError) as exc:
        _fail(f"cannot read the settings: {exc}")
    if not settings.control_auth_token:
        _fail("no control token: give --config with a checkpoint: block, or set GYMCKPT_CHECKPOINT__CONTROL_AUTH_TOKEN")
    storage = {**settings.storage_options, **_storage_options(endpoint_url, storage_option)}
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
        concurrency=concurrency,
        resume=resume,
        checkpoint_timeout=checkpoint_timeout,
        run_timeout=run_timeout,
    )
    try:
        summary = asyncio.run(collect(options, _stderr))
    except GymckptError as exc:  # a bad dataset line, a results file in the way, servers not answering
        _fail(str(exc))
    except FileNotFoundError as exc:
        _fail(str(exc))
    _print_collect_summary(summary, as_json)
    sys.exit(summary.exit_code)


def _print_collect_summary(summary: Any, as_json: bool) -> None:
    import dataclasses

    if as_json:
        _write_json(dataclasses.asdict(summary))
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
        ("prepare seconds (max)", f"{max(summary.prepare_seconds, default=0):.2f}"),
        ("commit seconds (max)", f"{max(summary.commit_seconds, default=0):.2f}"),
    ]
    if summary.stopped:
        rows.append(("stopped at", summary.stopped_at or "no checkpoint"))
    for name, value in rows:
        table.add_row(name, Text(str(value)))
    _stdout.print(table)


if __name__ == "__main__":  # pragma: no cover
    main()
