"""``gymckpt inspect``: list what checkpoints hold, or dump one participant's records."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click
from rich.padding import Padding
from rich.table import Table

from gymckpt.cli._errors import JSON_ERRORS, Command, fail, fail_for
from gymckpt.cli._options import check_url, storage_arguments, storage_options
from gymckpt.cli._output import fits, human, plain, stdout, text, write_json
from gymckpt.store.checkpoint_store import CheckpointStore, backend_for_url
from gymckpt.store.codec import encode_record
from gymckpt.store.layout import check_readable_name
from gymckpt.store.listing import list_checkpoints, participant_rows
from gymckpt.store.verify import NoCheckpointFound

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["inspect_command"]


@click.command("inspect", cls=Command)
@click.argument("url")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='Print the listing as JSON on stdout; on exit 2, {"error": {"code": ..., "detail": ...}} instead.',
)
@click.option("--dump", metavar="KIND/INSTANCE", help="Write this participant's records to stdout as JSONL.")
@click.option("--episode", "episodes", multiple=True, metavar="ID", help="With --dump: only these episodes.")
@storage_arguments
def inspect_command(
    url: str,
    as_json: bool,
    dump: str | None,
    episodes: tuple[str, ...],
    endpoint_url: str | None,
    storage_option: tuple[str, ...],
) -> None:
    """List participants, record counts, sizes, episodes and extra fields under URL.

    \b
    A participant is marked damaged when its manifest is unreadable or
    missing (an unfinished commit, an empty participant directory too), or
    its records file is missing or of another size than the manifest's
    records_bytes (truncated or grown). inspect reads the manifests and asks
    each records file's size, nothing more: it re-hashes nothing, so it stays
    fast; `gymckpt verify URL` is the full check (digest, count, every line).
    In --json, its row holds "damaged": "<problem>: <why>" (and the manifest's
    fields where it was read). On a terminal too narrow for the table, one
    block per participant.

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
    check_url(url)
    if episodes and dump is None:
        fail("--episode needs --dump KIND/INSTANCE: it chooses which of that participant's records to write")
    options = storage_options(endpoint_url, storage_option)
    try:
        backend = backend_for_url(url, **options)
        checkpoints = list_checkpoints(backend)
    except Exception as exc:  # storage, options, memory: never a traceback
        fail_for(exc, url, options)
    if not checkpoints:
        fail(f"no checkpoint (no gym/ directory) under {url}", error=NoCheckpointFound.code)
    if dump is not None:
        _dump(CheckpointStore(backend), checkpoints, dump, episodes)
        return
    try:
        rows = list(participant_rows(backend, checkpoints))
    except Exception as exc:
        fail_for(exc, url, options)
    if as_json:
        write_json(rows)
        return
    console = stdout()
    if not console.is_terminal:
        _print_lines(rows)
        return
    table = _table(url, rows)
    if fits(table, console):
        console.print(table)
    else:  # a table this narrow would break names a letter at a time: one block per participant
        _print_blocks(console, url, rows)


def _episodes(row: dict[str, Any], shown: int, separator: str, more: str) -> str:
    """The first ``shown`` episode ids, and ``more`` when there are others."""
    episodes = row["episode_ids"]
    if episodes is None:
        return "(reference format)"
    return separator.join(episodes[:shown]) + (more if len(episodes) > shown else "")


def _print_lines(rows: list[dict[str, Any]]) -> None:
    """One line a participant, fields tab-separated, never wrapped: for logs, grep and copy-paste."""
    for row in rows:
        if "damaged" in row:
            plain(row["checkpoint"] or ".", row["participant"] or "-", "damaged", row["damaged"])
            continue
        episodes = "not listed" if row["episode_ids"] is None else _episodes(row, 20, ",", ",…")
        size = "size not claimed" if row["records_bytes"] is None else f"{row['records_bytes']} bytes"
        plain(
            row["checkpoint"] or ".",
            row["participant"],
            row["checkpoint_id"],
            f"{row['record_count']} records",
            size,
            f"episodes {episodes}",
            f"extra {','.join(row['extra'])}",
            f"{row['format']} format",
        )


def _size(row: dict[str, Any]) -> str:
    return "?" if row["records_bytes"] is None else human(row["records_bytes"])


def _table(url: str, rows: list[dict[str, Any]]) -> Table:
    """One row a participant; names and ids are never wrapped, the other columns wrap between words."""
    table = Table(title=text(f"Checkpoints under {url}"))
    for column in ("checkpoint", "participant", "checkpoint id", "records", "size", "episodes", "extra fields"):
        table.add_column(column, no_wrap=column in ("participant", "checkpoint id"), overflow="fold")
    for row in rows:
        # checkpoint names, ids, episode ids, extras and details are data: never markup, never raw controls
        if "damaged" in row:
            table.add_row(
                text(row["checkpoint"] or "."),
                text(row["participant"] or "-"),
                text("damaged", "red"),
                "",
                "",
                "",
                text(row["damaged"]),
            )
            continue
        table.add_row(
            text(row["checkpoint"] or "."),
            text(row["participant"]),
            text(row["checkpoint_id"]),
            str(row["record_count"]),
            _size(row),
            text(_episodes(row, 3, ", ", " …")),
            text(", ".join(row["extra"])),
        )
    return table


def _print_blocks(console: Console, url: str, rows: list[dict[str, Any]]) -> None:
    """A block a participant: its name and checkpoint, then one field a line, wrapped between words."""
    console.print(text(f"Checkpoints under {url}", "italic"), soft_wrap=False)
    for row in rows:
        head = text(row["participant"] or "(no participant)", "bold")
        head.append("  in ").append_text(text(row["checkpoint"] or "."))
        console.print()
        console.print(head, soft_wrap=False)
        fields = Table.grid(padding=(0, 2))
        fields.add_column(no_wrap=True, style="dim")
        fields.add_column(overflow="fold")  # a word wider than the terminal is the only one ever broken
        if "damaged" in row:
            fields.add_row(text("damaged", "red"), text(row["damaged"]))
        else:
            fields.add_row("checkpoint id", text(row["checkpoint_id"]))
            fields.add_row("records", f"{row['record_count']}, {_size(row)}")
            fields.add_row("episodes", text(_episodes(row, 3, ", ", " …")))
            fields.add_row("extra fields", text(", ".join(row["extra"]) or "-"))
        console.print(Padding(fields, (0, 0, 0, 2), expand=False))


def _dump(store: CheckpointStore, checkpoints: dict[str, Any], dump: str, episodes: tuple[str, ...]) -> None:
    kind, sep, instance = dump.partition("/")
    try:
        check_readable_name("kind", kind)
        check_readable_name("instance", instance)
    except ValueError:
        fail(f"--dump expects KIND/INSTANCE, e.g. environment/env-0; got {dump!r}")
    if not sep:
        fail(f"--dump expects KIND/INSTANCE, e.g. environment/env-0; got {dump!r}")
    if len(checkpoints) != 1:
        fail(f"URL holds {len(checkpoints)} checkpoints ({', '.join(checkpoints)}): name one of them in the URL")
    ((checkpoint, files),) = checkpoints.items()
    if (kind, instance) not in files.participants:
        present = ", ".join(f"{k}/{i}" for k, i in sorted(files.participants)) or "none"
        fail(f"no participant {kind}/{instance} in this checkpoint (present: {present})")
    out = sys.stdout.buffer
    try:
        # verify the whole file first, so nothing unverified reaches stdout
        for _ in store.read_participant(checkpoint, kind=kind, instance=instance, scope=()):
            pass
        for record in store.read_participant(checkpoint, kind=kind, instance=instance, scope=episodes or None):
            out.write(encode_record(record)[1])
        out.flush()
    except BrokenPipeError:  # the reader stopped early (`| head`): neither damage nor the storage
        click.get_current_context().meta[JSON_ERRORS] = False  # stdout is gone
        fail("stdout was closed before every record was written")
    except Exception as exc:  # damage exits 1; storage, memory and the rest 2
        fail_for(exc, store.url)
