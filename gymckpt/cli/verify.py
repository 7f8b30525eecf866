"""``gymckpt verify``: check checkpoints offline, without any server."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from gymckpt.cli._errors import EXIT_DAMAGED, EXIT_OK, Command, fail_for
from gymckpt.cli._options import check_url, storage_arguments, storage_options
from gymckpt.cli._output import human, plain, stderr, stdout, text, write_json
from gymckpt.store.verify import CheckpointStatus, Severity, verify

if TYPE_CHECKING:
    from gymckpt.store.verify import VerifyReport

__all__ = ["verify_command"]


@click.command("verify", cls=Command)
@click.argument("url")
@click.option("--quick", is_flag=True, help="Skip re-hashing records files: check manifests, presence and sizes only.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='Print the report as JSON on stdout; on exit 2, {"error": {"code": ..., "detail": ...}} instead.',
)
@storage_arguments
def verify_command(
    url: str, quick: bool, as_json: bool, endpoint_url: str | None, storage_option: tuple[str, ...]
) -> None:
    """Check one checkpoint directory, or every checkpoint under URL, without any server.

    \b
    URL is a local path, file://, or s3://bucket/prefix.
    Checkpoints the reference stack's store wrote are checked too, as far as
    their manifests allow; the report names each participant's format.
    Each checkpoint's status ("checkpoint_status" in --json):
      published    checkpoint.json lists its participants (or the reference
                   stack published it)
      unpublished  every participant committed, no gym/checkpoint.json: not
                   damaged, a warning (publishing is the trainer's job)
      unfinished   a participant directory without a manifest (an empty one
                   too), or a gym/ without participants, and nothing published:
                   a commit that did not finish; a warning
      damaged      an error was found
      vanished     deleted while verify read it (a collector's prune); a warning
    The report ends with "OK"; or with a line starting "UNFINISHED" and one
    starting "OK, but UNPUBLISHED", each naming its checkpoints; or "DAMAGED".
    Exit status:
      0  no damage: every checkpoint published, unpublished, unfinished or
         vanished (warnings allowed; the last line says which)
      1  errors found: a checkpoint is damaged
      2  usage error or unreachable storage: no checkpoint there (no gym/
         directory at all), bad storage options, storage that cannot be
         read, out of memory
    Errors are one line on stderr. With --json, stdout holds the report, or on
    exit 2 {"error": {"code": ..., "detail": ...}}, code e.g. usage_error,
    checkpoint_not_found, unsupported_storage, storage_error.
    Names and details are shown with control characters escaped (\\x1b, \\t,
    \\u202e); a byte of a name that is not UTF-8 as \\xNN, in --json too.
    A checkpoint deleted while it is checked (a collector's prune) is a
    warning, checkpoint_vanished, not damage.
    """
    check_url(url)
    options = storage_options(endpoint_url, storage_option)
    show_progress = not as_json and stderr().is_terminal
    try:
        with _Progress(show_progress) as advance:
            report = verify(url, quick=quick, progress=advance, **options)
    except Exception as exc:  # storage, options, memory: never a traceback, and damage only if it is damage
        fail_for(exc, url, options)
    if as_json:
        write_json(report.to_dict())
    else:
        _print_report(report)
    sys.exit(EXIT_OK if report.ok else EXIT_DAMAGED)


class _Progress:
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
            console=stderr(),
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
    console = stdout()
    if report.findings and console.is_terminal:
        table = Table(title=text(f"Findings for {report.url}"), show_lines=False)
        table.add_column("severity", no_wrap=True)
        table.add_column("finding", no_wrap=True)
        table.add_column("participant", no_wrap=True)
        table.add_column("path", overflow="fold")
        table.add_column("detail", overflow="fold")
        for finding in report.findings:
            style = "bold red" if finding.severity is Severity.ERROR else "yellow"
            detail = text(finding.detail)
            if finding.fix:
                detail.append("\n").append_text(text(f"fix: {finding.fix}"))
            table.add_row(  # paths and details are data, never markup, never raw control characters
                text(finding.severity, style),
                text(finding.code),
                text(finding.participant),
                text(finding.path),
                detail,
            )
        console.print(table)
    else:
        # one finding per line, never wrapped: for logs, grep and copy-paste
        for finding in report.findings:
            fix = f" (fix: {finding.fix})" if finding.fix else ""
            plain(finding.severity, finding.code, finding.participant or "-", finding.path, finding.detail + fix)
    mode = "sizes only (--quick)" if report.quick else f"{report.records_checked} records re-read and hashed"
    formats = report.format_summary()
    plain(
        f"{len(report.checkpoints)} checkpoint(s) ({report.status_summary()}), {len(report.participants)} "
        f"participant(s){f' ({formats})' if formats else ''}, {human(report.bytes_checked)} checked, {mode}: "
        f"{len(report.errors)} error(s), {len(report.warnings)} warning(s)"
    )
    for line in _verdict(report):
        plain(line)


#: the most checkpoints a verdict line names; the rest are counted
_NAMED = 5


def _named(report: VerifyReport, names: list[str]) -> str:
    """Checkpoint names for a verdict line (the URL for the checkpoint at the URL), the first few of many."""
    shown = ", ".join(name or report.url for name in names[:_NAMED])
    return shown + (f" and {len(names) - _NAMED} more" if len(names) > _NAMED else "")


def _verdict(report: VerifyReport) -> list[str]:
    """The last lines: DAMAGED; else UNFINISHED and "OK, but UNPUBLISHED" where they apply; else OK."""
    if not report.ok:
        damaged = report.with_status(CheckpointStatus.DAMAGED)
        return [
            "DAMAGED: do not restore from the checkpoints listed above"
            + (f": {_named(report, damaged)}" if damaged else "")
        ]
    lines = []
    if unfinished := report.with_status(CheckpointStatus.UNFINISHED):
        lines.append(
            "UNFINISHED (a commit that did not finish: a participant without a manifest, or none; not damage): "
            + _named(report, unfinished)
        )
    if unpublished := report.with_status(CheckpointStatus.UNPUBLISHED):
        lines.append(
            "OK, but UNPUBLISHED (every participant committed, no gym/checkpoint.json; publishing it is the "
            "trainer's job): " + _named(report, unpublished)
        )
    return lines or ["OK" + (" (warnings are leftovers, safe to clean up)" if report.warnings else "")]
