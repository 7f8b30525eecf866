"""``gymckpt inspect``: list what checkpoints hold, or dump one participant's records."""

from __future__ import annotations

import sys
from typing import Any

import click
from rich.table import Table

from gymckpt.cli._errors import JSON_ERRORS, Command, fail, fail_for
from gymckpt.cli._options import check_url, storage_arguments, storage_options
from gymckpt.cli._output import human, plain, stdout, text, write_json
from gymckpt.store.checkpoint_store import CheckpointStore, backend_for_url
from gymckpt.store.codec import encode_record
from gymckpt.store.layout import check_readable_name
from gymckpt.store.listing import list_checkpoints, participant_rows
from gymckpt.store.verify import NoCheckpointFound

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
        for row in rows:
            if "damaged" in row:
                plain(row["checkpoint"] or ".", row["participant"], "damaged", row["damaged"])
            else:
                episodes = row["episode_ids"]
                listed = (
                    "not listed" if episodes is None else ",".join(episodes[:20]) + (",…" if len(episodes) > 20 else "")
                )
                size = "size not claimed" if row["records_bytes"] is None else f"{row['records_bytes']} bytes"
                plain(
                    row["checkpoint"] or ".",
                    row["participant"],
                    row["checkpoint_id"],
                    f"{row['record_count']} records",
                    size,
                    f"episodes {listed}",
                    f"extra {','.join(row['extra'])}",
                    f"{row['format']} format",
                )
        return
    table = Table(title=text(f"Checkpoints under {url}"))
    for column in ("checkpoint", "participant", "checkpoint id", "records", "size", "episodes", "extra fields"):
        table.add_column(column, no_wrap=column in ("participant", "checkpoint id"), overflow="fold")
    for row in rows:
        # checkpoint names, ids, episode ids, extras and details are data: never markup, never raw controls
        if "damaged" in row:
            table.add_row(
                text(row["checkpoint"] or "."),
                text(row["participant"]),
                text("damaged", "red"),
                "",
                "",
                "",
                text(row["damaged"]),
            )
            continue
        episodes = row["episode_ids"]
        shown = (
            "(reference format)" if episodes is None else ", ".join(episodes[:3]) + (" …" if len(episodes) > 3 else "")
        )
        table.add_row(
            text(row["checkpoint"] or "."),
            text(row["participant"]),
            text(row["checkpoint_id"]),
            str(row["record_count"]),
            "?" if row["records_bytes"] is None else human(row["records_bytes"]),
            text(shown),
            text(", ".join(row["extra"])),
        )
    console.print(table)


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
