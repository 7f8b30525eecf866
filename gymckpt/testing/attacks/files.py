"""The attack table's rows on files and sizes: special files where state belongs, bounded reads, memory.

Each maker does one thing to the published checkpoint ``ck`` and returns the findings
``verify`` must give; :mod:`gymckpt.testing.attacks.store` puts them in rows.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from gymckpt.testing.attacks.context import AttackContext, Expected

__all__ = [
    "DOCUMENT_BUDGET",
    "E",
    "INDEX_LIMIT",
    "MANIFEST_LIMIT",
    "W",
    "gym_symlink",
    "index_fifo",
    "index_over_limit",
    "index_symlink_to_copy",
    "index_too_complex",
    "kind_dir_symlink",
    "line_over_max_record_bytes",
    "manifest_claims_huge_records",
    "manifest_fifo",
    "manifest_grows_after_measured",
    "manifest_over_limit",
    "manifest_symlink_to_copy",
    "manifest_symlink_to_dev_zero",
    "manifest_too_complex",
    "orphan_records_symlink",
    "participant_dir_symlink",
    "records_dangling_symlink",
    "records_endless_garbage",
    "records_grow_after_measured",
    "records_special",
    "records_symlink_to_copy",
    "records_symlink_to_dev_zero",
    "records_zero_filled",
    "records_zero_filled_consistent",
    "stray_fifo_in_gym",
    "stray_symlink",
]

#: the limits the attack test patches in (small, so an oversized file is cheap to build)
MANIFEST_LIMIT = 32 << 10
INDEX_LIMIT = 16 << 10
#: the parse budget a row may ask for (a good checkpoint's documents cost a few KB)
DOCUMENT_BUDGET = 256 << 10


E, W = "error", "warning"


# --- special files where state belongs (POSIX only)


def records_symlink_to_copy(ctx: AttackContext) -> list[Expected]:
    ctx.replace_with_symlink(ctx.env.records_path, ctx.copy_outside(ctx.env.records_path))
    return [("not_regular_file", E, ctx.env.records_path)]


def records_symlink_to_dev_zero(ctx: AttackContext) -> list[Expected]:
    ctx.replace_with_symlink(ctx.env.records_path, "/dev/zero")
    return [("not_regular_file", E, ctx.env.records_path)]


def records_dangling_symlink(ctx: AttackContext) -> list[Expected]:
    ctx.replace_with_symlink(ctx.env.records_path, "nothing-here")
    return [("not_regular_file", E, ctx.env.records_path)]


def records_special(make: str) -> Callable[[AttackContext], list[Expected]]:
    def apply(ctx: AttackContext) -> list[Expected]:
        getattr(ctx, f"replace_with_{make}")(ctx.env.records_path)
        return [("not_regular_file", E, ctx.env.records_path)]

    return apply


def manifest_symlink_to_copy(ctx: AttackContext) -> list[Expected]:
    ctx.replace_with_symlink(ctx.env.path, ctx.copy_outside(ctx.env.path))
    return [("not_regular_file", E, ctx.env.path)]


def manifest_fifo(ctx: AttackContext) -> list[Expected]:
    ctx.replace_with_fifo(ctx.env.path)
    return [("not_regular_file", E, ctx.env.path)]


def manifest_symlink_to_dev_zero(ctx: AttackContext) -> list[Expected]:
    ctx.replace_with_symlink(ctx.env.path, "/dev/zero")
    return [("not_regular_file", E, ctx.env.path)]


def participant_dir_symlink(ctx: AttackContext) -> list[Expected]:
    ctx.replace_with_symlink(ctx.env.directory, ctx.copy_outside(ctx.env.directory))
    return [("not_regular_file", E, ctx.env.directory)]


def kind_dir_symlink(ctx: AttackContext) -> list[Expected]:
    ctx.replace_with_symlink("ck/gym/environment", ctx.copy_outside("ck/gym/environment"))
    return [("not_regular_file", E, "ck/gym/environment")]


def gym_symlink(ctx: AttackContext) -> list[Expected]:
    ctx.replace_with_symlink("ck/gym", ctx.copy_outside("ck/gym"))
    return [("not_regular_file", E, "ck/gym")]


def index_symlink_to_copy(ctx: AttackContext) -> list[Expected]:
    ctx.replace_with_symlink(ctx.index, ctx.copy_outside(ctx.index))
    return [("not_regular_file", E, ctx.index)]


def index_fifo(ctx: AttackContext) -> list[Expected]:
    ctx.replace_with_fifo(ctx.index)
    return [("not_regular_file", E, ctx.index)]


def stray_symlink(ctx: AttackContext) -> list[Expected]:
    path = f"{ctx.env.directory}/notes.txt"
    os.symlink(ctx.copy_outside(ctx.env.records_path), ctx.real(path))
    return [("unexpected_file", W, path)]


def stray_fifo_in_gym(ctx: AttackContext) -> list[Expected]:
    os.mkfifo(ctx.real("ck/gym/not a kind"))
    return [("unexpected_file", W, "ck/gym/not a kind")]


def orphan_records_symlink(ctx: AttackContext) -> list[Expected]:
    path = f"{ctx.env.directory}/records-{'c' * 64}.jsonl"
    os.symlink(ctx.copy_outside(ctx.env.records_path), ctx.real(path))
    return [("not_regular_file", E, path)]


# --- bounded reads


def records_grow_after_measured(ctx: AttackContext) -> list[Expected]:
    path = ctx.env.records_path
    ctx.write(path, ctx.read(path) + b"x" * (1 << 20))
    ctx.size_override[path] = ctx.env.records_bytes
    ctx.read_bounds[path] = ctx.env.records_bytes + 1
    return [("records_size_mismatch", E, path)]


def records_endless_garbage(ctx: AttackContext) -> list[Expected]:
    path = ctx.env.records_path
    ctx.write(path, ctx.read(path) + b"y" * (4 << 20))
    ctx.read_bounds[path] = ctx.env.records_bytes + 1
    return [("records_size_mismatch", E, path)]


def manifest_claims_huge_records(ctx: AttackContext) -> list[Expected]:
    ctx.edit_manifest(lambda doc: doc.update(records_bytes=10**15))
    ctx.read_bounds[ctx.env.records_path] = 0
    return [("records_size_mismatch", E, ctx.env.records_path)]


def manifest_over_limit(ctx: AttackContext) -> list[Expected]:
    raw = ctx.read(ctx.env.path)
    ctx.write(ctx.env.path, raw.rstrip(b"\n") + b" " * (MANIFEST_LIMIT + 100) + b"\n")
    ctx.resync_index()
    ctx.read_bounds[ctx.env.path] = 0  # refused from its size, unread
    return [("file_too_large", E, ctx.env.path)]


def manifest_grows_after_measured(ctx: AttackContext) -> list[Expected]:
    raw = ctx.read(ctx.env.path)
    ctx.write(ctx.env.path, raw.rstrip(b"\n") + b" " * (4 * MANIFEST_LIMIT) + b"\n")
    ctx.resync_index()
    ctx.size_override[ctx.env.path] = len(raw)  # measured before it grew
    ctx.read_bounds[ctx.env.path] = MANIFEST_LIMIT + 1
    return [("file_too_large", E, ctx.env.path)]


def index_over_limit(ctx: AttackContext) -> list[Expected]:
    raw = ctx.read(ctx.index)
    ctx.write(ctx.index, raw.rstrip(b"\n") + b" " * (INDEX_LIMIT + 100) + b"\n")
    ctx.read_bounds[ctx.index] = 0  # refused from its size, unread
    return [("file_too_large", E, ctx.index)]


# --- memory follows what the manifest allows: lines bounded, documents decoded under a budget


def records_zero_filled(ctx: AttackContext) -> list[Expected]:
    """What a filesystem crash can leave: the size kept, the blocks zeros (one line, no newline)."""
    ctx.write(ctx.env.records_path, bytes(ctx.env.records_bytes))
    return [("records_digest_mismatch", E, ctx.env.records_path)]


def records_zero_filled_consistent(ctx: AttackContext) -> list[Expected]:
    """A writer that hashed its zeros but claims the longest line of the records it meant."""
    path = ctx.rewrite_records(bytes(256 << 10))
    ctx.edit_manifest(lambda doc: doc.update(max_record_bytes=ctx.env.max_record_bytes))
    return [("record_too_long", E, path)]


def line_over_max_record_bytes(ctx: AttackContext) -> list[Expected]:
    lines = ctx.lines()
    lines[3] = lines[3][:-1] + b',"pad":"' + b"p" * 5000 + b'"}'
    path = ctx.rewrite_records(b"\n".join(lines) + b"\n")
    ctx.edit_manifest(lambda doc: doc.update(max_record_bytes=ctx.env.max_record_bytes))
    return [("record_too_long", E, path)]


def extra_of_empty_lists(limit: int) -> bytes:
    """``[],`` repeated to just under ``limit`` bytes: cheap to store, dear to decode."""
    return b"[" + b"[]," * (limit // 3 - 100) + b"[]]"


def manifest_too_complex(ctx: AttackContext) -> list[Expected]:
    ctx.document_budget = DOCUMENT_BUDGET
    raw = ctx.read(ctx.env.path)
    ctx.write(ctx.env.path, raw.rstrip(b"}\n") + b', "x": ' + extra_of_empty_lists(MANIFEST_LIMIT - len(raw)) + b"}\n")
    ctx.resync_index()
    return [("document_too_complex", E, ctx.env.path)]


def index_too_complex(ctx: AttackContext) -> list[Expected]:
    ctx.document_budget = DOCUMENT_BUDGET
    raw = ctx.read(ctx.index)
    ctx.write(ctx.index, raw.rstrip(b"}\n") + b', "x": ' + extra_of_empty_lists(INDEX_LIMIT - len(raw)) + b"}\n")
    return [("document_too_complex", E, ctx.index)]
