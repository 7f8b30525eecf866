"""What the command writes: its two consoles, plain lines, table cells of data, and JSON.

Text from data (paths, URLs, details) is never read as rich markup and reaches the terminal
only through :func:`~gymckpt.store.printable.printable` (:func:`text`, :func:`plain`, and
:func:`~gymckpt.cli._errors.fail`), so a control character in a file name is shown escaped,
never sent raw. ``--json`` output is written by the store's own document encoder
(:func:`write_json`).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.text import Text

from gymckpt.store.codec import encode_document
from gymckpt.store.printable import printable

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["fits", "human", "plain", "stderr", "stdout", "text", "write_json"]

#: key in click's context meta: this invocation's (stdout, stderr) consoles
_CONSOLES = "gymckpt.consoles"


def _consoles() -> tuple[Console, Console]:
    """This invocation's consoles, made when first used.

    Made per invocation, not at import: whether a stream is a terminal, and its width, are
    what the environment says when the command runs (``FORCE_COLOR``, ``COLUMNS``), so a
    test drives the terminal branches through the public command alone.
    """
    context = click.get_current_context(silent=True)
    made: tuple[Console, Console] | None = None if context is None else context.meta.get(_CONSOLES)
    if made is None:
        made = (Console(soft_wrap=True), Console(stderr=True, soft_wrap=True))
        if context is not None:
            context.meta[_CONSOLES] = made
    return made


def stdout() -> Console:
    """The console on stdout (reports, tables)."""
    return _consoles()[0]


def stderr() -> Console:
    """The console on stderr (errors, progress)."""
    return _consoles()[1]


def plain(*fields: object) -> None:
    """One line on stdout: ``fields`` made printable (:func:`printable`: a tab or newline in one is escaped
    too) and joined by tabs; never wrapped or styled (rich would fold it at 80 columns in a pipe)."""
    line = "\t".join(printable(field) for field in fields)
    console = stdout()
    if console.is_terminal:
        console.print(line, highlight=False, markup=False, emoji=False)
    else:
        sys.stdout.write(line + "\n")


def text(value: object, style: str | None = None) -> Text:
    """A table cell or title of data: never markup, every control character escaped (:func:`printable`)."""
    return Text(printable(value), style=style or "")


def write_json(value: Any) -> None:
    """``value`` as indented JSON on stdout, by the store's own document encoder: integers of any size, NaN,
    +/-Infinity and lone surrogates are written as a manifest holds them, so every value the store
    accepts is written (never a crash). ASCII only: anything else is a ``\\u`` escape."""
    sys.stdout.write(encode_document(value).decode("ascii"))


def human(size: float) -> str:
    """A byte count for people: 512 B, 1.5 KB, 2.0 MB, 3.1 GB."""
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"  # pragma: no cover


def fits(table: Table, console: Console) -> bool:
    """True when ``table`` fits ``console``'s width with no word broken: every column at least as wide as
    its longest word (a ``no_wrap`` column: its longest cell), plus padding and borders. Where it does not,
    rich would break words a letter at a time to fit: show the data another way."""
    # measured against an unbounded width: rich clamps a measurement to the width it is given
    narrowest = table.__rich_measure__(console, console.options.update_width(1 << 16)).minimum
    return narrowest <= console.width
