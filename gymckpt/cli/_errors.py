"""The command's one place for failure: a typed error or a usage mistake → one line on stderr → an exit code.

Exit codes: :data:`EXIT_OK` 0 clean, :data:`EXIT_DAMAGED` 1 damage found, :data:`EXIT_USAGE`
2 usage error, bad setting or unreachable storage. Every failure goes through :func:`fail`:
``error: <message>`` as one line (a message's line breaks are joined, control characters
escaped), never a traceback; under ``--json`` the same message is also written on stdout as
``{"error": {"code": ..., "detail": ...}}``. :func:`fail_for` chooses the exit code and the
error code of an exception by its type; :class:`Command` makes click's own usage errors (a
bad option, a value out of range) such a line too, with a hint to ``--help``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, NoReturn

import click
from rich.text import Text

from gymckpt.cli._output import stderr, write_json
from gymckpt.errors import GymckptError, InvalidCheckpointState, UnusableDirectory
from gymckpt.store.printable import printable
from gymckpt.store.verify import NoCheckpointFound

__all__ = [
    "EXIT_DAMAGED",
    "EXIT_OK",
    "EXIT_USAGE",
    "FROM_ENVIRONMENT",
    "JSON_ERRORS",
    "Command",
    "Group",
    "fail",
    "fail_for",
    "fail_setting",
]

logger = logging.getLogger("gymckpt.cli")

EXIT_OK, EXIT_DAMAGED, EXIT_USAGE = 0, 1, 2

#: what a line about a bad variable adds: where the value came from, and the way out
FROM_ENVIRONMENT = " (set in the environment: correct it or unset it for the default)"

#: key in click's context meta: write errors as a JSON object on stdout too (--json)
JSON_ERRORS = "gymckpt.json_errors"


def fail(message: object, code: int = EXIT_USAGE, *, error: str = "usage_error") -> NoReturn:
    """Print ``error: message`` on stderr as one line, never read as markup, and exit with ``code``.

    Under --json, also write ``{"error": {"code": error, "detail": message}}`` on stdout.
    """
    line = printable(" ".join(part.strip() for part in str(message).splitlines() if part.strip()))
    context = click.get_current_context(silent=True)
    if context is not None and context.meta.get(JSON_ERRORS):
        write_json({"error": {"code": error, "detail": line}})
    stderr().print(Text.assemble(("error:", "bold red"), " ", line))
    sys.exit(code)


def fail_for(exc: BaseException, about: str, options: dict[str, Any] | None = None) -> NoReturn:
    """Exit for what reading ``about`` (a URL) raised: 1 for damage, 2 for anything else.

    Not damage, exit 2: no checkpoint there, out of memory, a directory that cannot be read,
    any other gymckpt error (its wire code is the JSON error code) and anything the storage
    library raised (``storage_error``; with ``options`` given, a TypeError hints at their names).
    """
    if isinstance(exc, NoCheckpointFound):
        fail(str(exc), error=exc.code)
    if isinstance(exc, MemoryError):
        fail(
            f"ran out of memory while reading {about}: the check did not finish (this is not damage)",
            error="out_of_memory",
        )
    if isinstance(exc, UnusableDirectory):  # cannot be read (no permission, not a directory): not damage
        fail(f"cannot read {about}: {exc}", error=exc.problem)
    if isinstance(exc, InvalidCheckpointState):
        fail(str(exc), EXIT_DAMAGED, error=exc.problem)
    if isinstance(exc, GymckptError):
        fail(f"cannot read {about}: {exc}", error=exc.code)
    hint = " (check the --storage-option names)" if options and isinstance(exc, TypeError) else ""
    fail(f"cannot read {about}: {type(exc).__name__}: {exc}{hint}", error="storage_error")


def fail_setting(exc: ValueError, *, prefix: str = "", hint: str = FROM_ENVIRONMENT) -> NoReturn:
    """Exit 2 for a setting that is not valid: a ``GYMCKPT_*`` or ``OTEL_*`` variable, by default.

    The readers' messages name the variable already; ``prefix`` names it where one does not,
    ``hint`` says where the value came from and the way out.
    """
    logger.debug("invalid setting", exc_info=exc)  # the traceback, for --log-level debug
    fail(f"{prefix}{exc}{hint}")


#: click's "no arguments: show the help" (click >= 8.2), which stays the help it is
_HELP_ERRORS: tuple[type[BaseException], ...] = tuple(
    error for error in (getattr(click.exceptions, "NoArgsIsHelpError", None),) if error is not None
)


def _usage_failed(ctx: click.Context, exc: click.UsageError) -> NoReturn:
    if isinstance(exc, _HELP_ERRORS):
        raise exc
    fail(f"{exc.format_message()} (see '{ctx.command_path} --help')")


class Command(click.Command):
    """A command whose own usage errors are one line too (and a JSON error object under --json)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[JSON_ERRORS] = "--json" in args
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            _usage_failed(ctx, exc)


class Group(click.Group):
    """A group whose usage errors (an unknown command) are one line, as its commands' are."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            _usage_failed(ctx, exc)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            _usage_failed(ctx, exc)
