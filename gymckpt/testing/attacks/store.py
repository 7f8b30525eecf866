"""The attack table of the backend suite: a good checkpoint, one thing done to it, what must follow.

Each row builds on a published checkpoint ``ck`` (participants ``environment/e0`` and
``agent/a0``), does one thing to it through the suite's raw hooks (bypassing the backend),
and states the typed error reading a participant (or the index) must raise and exactly
the findings ``verify`` must give. Rows marked ``special`` need symlinks, FIFOs, sockets or
devices, so only a POSIX filesystem runs them. Many rows are "consistent buggy writers":
the manifest, and the index, are rewritten to match the damaged records, so only the rule
the row is about can catch it. A few rows are benign: values that must round-trip.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from gymckpt import errors
from gymckpt.testing.attacks.files import (
    DOCUMENT_BUDGET,
    INDEX_LIMIT,
    MANIFEST_LIMIT,
    E,
    W,
    gym_symlink,
    index_fifo,
    index_over_limit,
    index_symlink_to_copy,
    index_too_complex,
    kind_dir_symlink,
    line_over_max_record_bytes,
    manifest_claims_huge_records,
    manifest_fifo,
    manifest_grows_after_measured,
    manifest_over_limit,
    manifest_symlink_to_copy,
    manifest_symlink_to_dev_zero,
    manifest_too_complex,
    orphan_records_symlink,
    participant_dir_symlink,
    records_dangling_symlink,
    records_endless_garbage,
    records_grow_after_measured,
    records_special,
    records_symlink_to_copy,
    records_symlink_to_dev_zero,
    records_zero_filled,
    records_zero_filled_consistent,
    stray_fifo_in_gym,
    stray_symlink,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from gymckpt.testing.attacks.context import AttackContext, Expected


__all__ = ["ATTACKS", "DOCUMENT_BUDGET", "INDEX_LIMIT", "MANIFEST_LIMIT", "Attack"]


@dataclass(frozen=True)
class Attack:
    """One row: what to do, and what reading and verify must say."""

    apply: Callable[[AttackContext], list[Expected]]
    #: what reading ``read`` raises; None when it must succeed
    error: type[errors.InvalidCheckpointState] | None
    read: tuple[str, str] | None = ("environment", "e0")
    #: read the index (with its manifests) instead of a participant
    read_index: bool = False
    scope: frozenset[str] | None = None
    #: needs symlinks, FIFOs, sockets or devices
    special: bool = False
    #: the promise the row checks (set by :func:`_promise` for its whole group)
    promise: str = ""


def _promise(promise: str, rows: dict[str, Attack]) -> dict[str, Attack]:
    """Rows that check one promise, each stamped with it."""
    return {name: replace(row, promise=promise) for name, row in rows.items()}


# --- a record is what its line says (consistent buggy writers)


def _ids(lines: list[bytes]) -> list[str]:
    return sorted({json.loads(line)["episode_id"] for line in lines if line.startswith(b"{")})


def _duplicate_line(ctx: AttackContext) -> list[Expected]:
    lines = ctx.lines()
    lines.insert(5, lines[3])
    path = ctx.rewrite_records(b"\n".join(lines) + b"\n", count=len(lines), episode_ids=_ids(lines))
    return [("duplicate_episode", E, path)]


def _duplicate_line_listed_twice(ctx: AttackContext) -> list[Expected]:
    lines = ctx.lines()
    lines.insert(5, lines[3])
    twice = sorted([*_ids(lines), json.loads(lines[3])["episode_id"]])
    ctx.rewrite_records(b"\n".join(lines) + b"\n", count=len(lines), episode_ids=twice)
    return [("duplicate_episode", E, ctx.env.path)]


def _replace_line(index: int, line: bytes) -> Callable[[AttackContext], list[Expected]]:
    def apply(ctx: AttackContext) -> list[Expected]:
        lines = ctx.lines()
        lines[index] = line
        path = ctx.rewrite_records(b"\n".join(lines) + b"\n")
        return [("record_undecodable", E, path)]

    return apply


def _second_episode_id(value: str) -> Callable[[AttackContext], list[Expected]]:
    def apply(ctx: AttackContext) -> list[Expected]:
        lines = ctx.lines()
        lines[1] = lines[1][:-1] + f',"episode_id":"{value}"}}'.encode()
        path = ctx.rewrite_records(b"\n".join(lines) + b"\n")
        return [("record_undecodable", E, path)]

    return apply


def _key_twice_in_record(ctx: AttackContext) -> list[Expected]:
    lines = ctx.lines()
    lines[2] = lines[2][:-1] + b',"zeta":"another value"}'
    path = ctx.rewrite_records(b"\n".join(lines) + b"\n")
    return [("record_undecodable", E, path)]


def _key_twice_in_nested_object(ctx: AttackContext) -> list[Expected]:
    lines = ctx.lines()
    index = next(index for index, line in enumerate(lines) if b'"ok":true' in line)  # a fast line's nested object
    lines[index] = lines[index].replace(b'"ok":true', b'"ok":false,"ok":true', 1)
    path = ctx.rewrite_records(b"\n".join(lines) + b"\n")
    return [("record_undecodable", E, path)]


def _manifest_key_twice(ctx: AttackContext) -> list[Expected]:
    """The first of two checkpoint ids is another checkpoint's: a first-wins reader sees that one."""
    raw = ctx.read(ctx.env.path)
    ctx.write(ctx.env.path, raw.replace(b"{", b'{\n  "checkpoint_id": "another-checkpoint",', 1))
    ctx.resync_index()
    return [("duplicate_key", E, ctx.env.path)]


def _manifest_nested_key_twice(ctx: AttackContext) -> list[Expected]:
    ctx.edit_manifest(lambda doc: doc.update(note={"step": 1}))
    raw = ctx.read(ctx.env.path)
    ctx.write(ctx.env.path, raw.replace(b'"step": 1', b'"step": 0, "step": 1', 1))
    ctx.resync_index()
    return [("duplicate_key", E, ctx.env.path)]


def _index_key_twice(ctx: AttackContext) -> list[Expected]:
    raw = ctx.read(ctx.index)
    ctx.write(ctx.index, raw.replace(b"{", b'{\n  "checkpoint_id": "another-checkpoint",', 1))
    return [("duplicate_key", E, ctx.index)]


def _blank_line(ctx: AttackContext) -> list[Expected]:
    lines = ctx.lines()
    lines.insert(4, b"")
    path = ctx.rewrite_records(b"\n".join(lines) + b"\n", count=len(lines))
    return [("record_undecodable", E, path)]


def _last_line_without_newline(ctx: AttackContext) -> list[Expected]:
    path = ctx.rewrite_records(b"\n".join(ctx.lines()))
    return [("record_undecodable", E, path)]


def _empty_episode_id(ctx: AttackContext) -> list[Expected]:
    lines = ctx.lines()
    lines[2] = b'{"episode_id":"","x":1}'
    ctx.rewrite_records(b"\n".join(lines) + b"\n", episode_ids=_ids(lines))
    return [("manifest_field_invalid", E, ctx.env.path)]


def _too_deep_exact_line(ctx: AttackContext) -> list[Expected]:
    lines = ctx.lines()
    lines[0] = b'{"episode_id": "r0", "deep": ' + b"[" * 10000 + b"]" * 10000 + b"}"
    path = ctx.rewrite_records(b"\n".join(lines) + b"\n")
    return [("record_undecodable", E, path)]


# --- benign: values that must come back exactly


def _benign(records: Callable[[], list[dict[str, Any]]]) -> Callable[[AttackContext], list[Expected]]:
    def apply(ctx: AttackContext) -> list[Expected]:
        ctx.expect_records = records()
        ctx.add_participant("benign", "b0", records())
        return []

    return apply


def _huge_ints() -> list[dict[str, Any]]:
    return [
        {"episode_id": "big", "n": 10**5000 + 7, "m": -(10**6000), "nested": [{"k": 3**9000}]},
        {"episode_id": "small", "n": 1},
    ]


def _deepest() -> list[dict[str, Any]]:
    deep: list[Any] = []
    cursor = deep
    for _ in range(4094):
        cursor.append([])
        cursor = cursor[0]
    return [{"episode_id": "deep", "v": deep}]


def _odd_values() -> list[dict[str, Any]]:
    return [
        {"episode_id": "odd", "nan": float("nan"), "inf": [float("inf"), float("-inf"), -0.0], "s": "\ud800 lone"},
        {"episode_id": "with-episode_id-inside", "payload": {"episode_id": "someone-else", "text": '"episode_id"'}},
    ]


# --- names and layout: every valid name is a participant; anything else is a warning


def _damaged_participant(kind: str, instance: str) -> Callable[[AttackContext], list[Expected]]:
    def apply(ctx: AttackContext) -> list[Expected]:
        manifest = ctx.add_participant(kind, instance)
        data = ctx.read(manifest.records_path)
        middle = len(data) // 2
        ctx.write(manifest.records_path, data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1 :])
        return [("records_digest_mismatch", E, manifest.records_path)]

    return apply


def _stray(path: str, code: str = "unexpected_file") -> Callable[[AttackContext], list[Expected]]:
    def apply(ctx: AttackContext) -> list[Expected]:
        ctx.write(path, b"not state\n")
        return [(code, W, path)]

    return apply


def _copied_under_invalid_name(ctx: AttackContext) -> list[Expected]:
    path = "ck/gym/environment/e 0/manifest.json"
    ctx.write(path, ctx.read(ctx.env.path))
    return [("unexpected_file", W, path)]


def _manifest_field(change: Callable[[dict[str, Any]], None], code: str) -> Callable[[AttackContext], list[Expected]]:
    def apply(ctx: AttackContext) -> list[Expected]:
        return [(code, E, ctx.edit_manifest(change))]

    return apply


def _manifest_too_deep(ctx: AttackContext) -> list[Expected]:
    raw = ctx.read(ctx.env.path)
    ctx.write(ctx.env.path, raw.rstrip(b"}\n") + b', "deep": ' + b"[" * 10000 + b"]" * 10000 + b"}\n")
    ctx.resync_index()
    return [("manifest_not_json", E, ctx.env.path)]


def _manifest_names_other_records(ctx: AttackContext) -> list[Expected]:
    agent = ctx.agent
    ctx.edit_manifest(
        lambda doc: doc.update(
            records_file=agent.records_file,
            records_sha256=agent.records_sha256,
            records_bytes=agent.records_bytes,
            record_count=agent.record_count,
            episode_ids=list(agent.episode_ids),
        )
    )
    return [
        ("records_missing", E, f"{ctx.env.directory}/{agent.records_file}"),
        ("orphaned_records", W, ctx.env.records_path),
    ]


# --- ids agree; the index is exact


def _index_edit(
    change: Callable[[AttackContext, dict[str, Any]], Expected],
) -> Callable[[AttackContext], list[Expected]]:
    def apply(ctx: AttackContext) -> list[Expected]:
        document = ctx.document(ctx.index)
        expected = change(ctx, document)
        ctx.write(ctx.index, json.dumps(document, indent=2).encode() + b"\n")
        return [expected]

    return apply


def _index_id(ctx: AttackContext, document: dict[str, Any]) -> Expected:
    document["checkpoint_id"] = "another-checkpoint"
    return ("checkpoint_id_mismatch", E, ctx.index)


def _index_twice(ctx: AttackContext, document: dict[str, Any]) -> Expected:
    document["participants"].append(dict(document["participants"][0]))
    return ("checkpoint_index_invalid", E, ctx.index)


def _index_escapes(ctx: AttackContext, document: dict[str, Any]) -> Expected:
    document["participants"][0]["manifest"] = "../../elsewhere/manifest.json"
    return ("checkpoint_index_invalid", E, ctx.index)


def _index_kind_newline(ctx: AttackContext, document: dict[str, Any]) -> Expected:
    document["participants"][0]["kind"] += "\n"
    return ("checkpoint_index_invalid", E, ctx.index)


def _manifest_of_another_checkpoint(ctx: AttackContext) -> list[Expected]:
    ctx.edit_manifest(lambda doc: doc.update(checkpoint_id="another-checkpoint"))
    return [("checkpoint_id_mismatch", E, ctx.env.path)]


def _participant_of_another_commit(ctx: AttackContext) -> list[Expected]:
    """The environment's directory replaced by its files of another commit (same id, other records).

    Each file is consistent with the others, so only the index's manifest digest tells: a
    restore must take exactly what was published.
    """
    from gymckpt.store._memory import MemoryBackend
    from gymckpt.store.checkpoint_store import CheckpointStore
    from gymckpt.testing.values import sample_records

    other = MemoryBackend(f"memory://attack-other-{secrets.token_hex(8)}")
    older = CheckpointStore(other).write_participant(
        "ck", kind="environment", instance="e0", checkpoint_id="c", records=sample_records(7)
    )
    ctx.delete(ctx.env.records_path)
    ctx.write(older.records_path, other.read_bytes(older.records_path))
    ctx.write(ctx.env.path, other.read_bytes(older.path))
    return [("index_digest_mismatch", E, ctx.env.path)]


def _manifest_deleted_while_listed(ctx: AttackContext) -> list[Expected]:
    ctx.delete(ctx.env.path)
    return [("index_participant_missing", E, ctx.env.path), ("orphaned_records", W, ctx.env.records_path)]


def _records_swapped_between_participants(ctx: AttackContext) -> list[Expected]:
    """The agent's records and manifest copied over the environment's: its kind and instance give it away."""
    ctx.delete(ctx.env.records_path)
    ctx.delete(ctx.env.path)
    ctx.write(f"{ctx.env.directory}/{ctx.agent.records_file}", ctx.read(ctx.agent.records_path))
    ctx.write(ctx.env.path, ctx.read(ctx.agent.path))
    ctx.resync_index()
    return [("participant_mismatch", E, ctx.env.path)]


ATTACKS: dict[str, Attack] = {
    **_promise(
        "state is a regular file in a real directory: anything else is refused, never followed (POSIX only)",
        {
            "records_symlink_to_an_outside_copy": Attack(records_symlink_to_copy, errors.NotRegularFile, special=True),
            "records_symlink_to_dev_zero": Attack(records_symlink_to_dev_zero, errors.NotRegularFile, special=True),
            "records_dangling_symlink": Attack(records_dangling_symlink, errors.NotRegularFile, special=True),
            "records_fifo": Attack(records_special("fifo"), errors.NotRegularFile, special=True),
            "records_socket": Attack(records_special("socket"), errors.NotRegularFile, special=True),
            "records_device": Attack(records_special("device"), errors.NotRegularFile, special=True),
            "manifest_symlink_to_an_outside_copy": Attack(
                manifest_symlink_to_copy, errors.NotRegularFile, special=True
            ),
            "manifest_symlink_to_dev_zero": Attack(manifest_symlink_to_dev_zero, errors.NotRegularFile, special=True),
            "manifest_fifo": Attack(manifest_fifo, errors.NotRegularFile, special=True),
            "participant_dir_symlink": Attack(participant_dir_symlink, errors.NotRegularFile, special=True),
            "kind_dir_symlink": Attack(kind_dir_symlink, errors.NotRegularFile, special=True),
            "gym_dir_symlink": Attack(gym_symlink, errors.NotRegularFile, special=True),
            "index_symlink_to_an_outside_copy": Attack(
                index_symlink_to_copy, errors.NotRegularFile, read=None, read_index=True, special=True
            ),
            "index_fifo": Attack(index_fifo, errors.NotRegularFile, read=None, read_index=True, special=True),
            "orphan_records_symlink": Attack(orphan_records_symlink, None, special=True),
            "stray_symlink_in_participant_dir": Attack(stray_symlink, None, special=True),
            "stray_fifo_in_gym": Attack(stray_fifo_in_gym, None, special=True),
        },
    ),
    **_promise(
        "every read bounded by what the manifest claims",
        {
            "records_grow_after_measured": Attack(records_grow_after_measured, errors.RecordsSizeMismatch),
            "records_endless_garbage": Attack(records_endless_garbage, errors.RecordsSizeMismatch),
            "manifest_claims_huge_records": Attack(manifest_claims_huge_records, errors.RecordsSizeMismatch),
            "manifest_over_limit": Attack(manifest_over_limit, errors.FileTooLarge),
            "manifest_grows_after_measured": Attack(manifest_grows_after_measured, errors.FileTooLarge),
            "index_over_limit": Attack(index_over_limit, errors.FileTooLarge, read=None, read_index=True),
        },
    ),
    **_promise(
        "memory follows what the manifest allows: no line held past max_record_bytes, documents under a parse budget",
        {
            "records_zero_filled_by_a_crash": Attack(records_zero_filled, errors.RecordsDigestMismatch),
            "records_zero_filled_consistent_writer": Attack(records_zero_filled_consistent, errors.RecordTooLong),
            "line_longer_than_max_record_bytes": Attack(line_over_max_record_bytes, errors.RecordTooLong),
            "max_record_bytes_beyond_the_file": Attack(
                _manifest_field(
                    lambda doc: doc.update(max_record_bytes=doc["records_bytes"] + 1), "manifest_field_invalid"
                ),
                errors.ManifestFieldInvalid,
            ),
            "max_record_bytes_a_string": Attack(
                _manifest_field(lambda doc: doc.update(max_record_bytes="64"), "manifest_field_invalid"),
                errors.ManifestFieldInvalid,
            ),
            "manifest_too_complex_to_decode": Attack(manifest_too_complex, errors.DocumentTooComplex),
            "index_too_complex_to_decode": Attack(
                index_too_complex, errors.DocumentTooComplex, read=None, read_index=True
            ),
        },
    ),
    **_promise(
        "a record is what its line says",
        {
            "duplicate_line": Attack(_duplicate_line, errors.DuplicateEpisode),
            "duplicate_line_listed_twice": Attack(_duplicate_line_listed_twice, errors.DuplicateEpisode),
            "second_episode_id_names_another": Attack(
                _second_episode_id("r2"), errors.RecordUndecodable, scope=frozenset({"r1"})
            ),
            "episode_id_not_first": Attack(_replace_line(1, b'{"x":1,"episode_id":"r1"}'), errors.RecordUndecodable),
            "line_is_an_array": Attack(_replace_line(1, b'["episode_id","r1"]'), errors.RecordUndecodable),
            "line_invalid_utf8": Attack(
                _replace_line(1, b'{"episode_id":"r1","x":"\xff\xfe"}'), errors.RecordUndecodable
            ),
            "line_truncated_json": Attack(_replace_line(1, b'{"episode_id":"r1","x":[1,2'), errors.RecordUndecodable),
            "episode_id_not_a_string": Attack(_replace_line(1, b'{"episode_id":17}'), errors.RecordUndecodable),
            "blank_line": Attack(_blank_line, errors.RecordUndecodable),
            "last_line_without_newline": Attack(_last_line_without_newline, errors.RecordUndecodable),
            "empty_episode_id": Attack(_empty_episode_id, errors.ManifestFieldInvalid),
            "nesting_beyond_the_limit": Attack(_too_deep_exact_line, errors.RecordUndecodable),
            "benign_integers_of_any_size": Attack(_benign(_huge_ints), None, read=("benign", "b0")),
            "benign_deepest_nesting": Attack(_benign(_deepest), None, read=("benign", "b0")),
            "benign_nan_surrogates_nested_ids": Attack(_benign(_odd_values), None, read=("benign", "b0")),
        },
    ),
    **_promise(
        "no key twice in one object (decoders keep the last, other readers the first); a scoped restore hashes the lines out of its scope without decoding them, verify decodes every one",
        {
            "second_episode_id_same_value": Attack(_second_episode_id("r1"), errors.RecordUndecodable),
            "record_key_twice": Attack(_key_twice_in_record, errors.RecordUndecodable),
            "record_key_twice_in_a_nested_object": Attack(_key_twice_in_nested_object, errors.RecordUndecodable),
            "record_key_twice_out_of_scope_is_not_decoded": Attack(_key_twice_in_record, None, scope=frozenset({"r5"})),
            "manifest_key_twice": Attack(_manifest_key_twice, errors.DuplicateKey),
            "manifest_key_twice_in_an_extra": Attack(_manifest_nested_key_twice, errors.DuplicateKey),
            "index_key_twice": Attack(_index_key_twice, errors.DuplicateKey, read=None, read_index=True),
        },
    ),
    **_promise(
        "names: every valid name is a participant; anything else is a warning",
        {
            "instance_named_gym": Attack(
                _damaged_participant("environment", "gym"), errors.RecordsDigestMismatch, read=("environment", "gym")
            ),
            "kind_named_gym": Attack(
                _damaged_participant("gym", "g0"), errors.RecordsDigestMismatch, read=("gym", "g0")
            ),
            "instance_named_manifest_json": Attack(
                _damaged_participant("agent", "manifest.json"),
                errors.RecordsDigestMismatch,
                read=("agent", "manifest.json"),
            ),
            "instance_named_checkpoint_json": Attack(
                _damaged_participant("model", "checkpoint.json"),
                errors.RecordsDigestMismatch,
                read=("model", "checkpoint.json"),
            ),
            "stray_file_in_kind_dir": Attack(_stray("ck/gym/environment/notes.txt"), None),
            "stray_file_in_participant_dir": Attack(_stray("ck/gym/environment/e0/notes.txt"), None),
            "stray_dir_in_participant_dir": Attack(_stray("ck/gym/environment/e0/sub/deeper/x.json"), None),
            "stray_file_in_gym": Attack(_stray("ck/gym/README"), None),
            "leftover_in_gym": Attack(_stray("ck/gym/.gymckpt-tmp-0a1b.part", "leftover_temporary_file"), None),
            "copy_under_an_invalid_name": Attack(_copied_under_invalid_name, None),
            "kind_with_trailing_newline": Attack(
                _manifest_field(lambda doc: doc.update(kind="environment\n"), "participant_mismatch"),
                errors.ParticipantMismatch,
            ),
            "records_file_with_trailing_newline": Attack(
                _manifest_field(
                    lambda doc: doc.update(records_file=doc["records_file"] + "\n"), "records_name_invalid"
                ),
                errors.RecordsNameInvalid,
            ),
            "checkpoint_id_with_trailing_newline": Attack(
                _manifest_field(lambda doc: doc.update(checkpoint_id="c\n"), "manifest_field_invalid"),
                errors.ManifestFieldInvalid,
            ),
            "episode_ids_unsorted": Attack(
                _manifest_field(lambda doc: doc["episode_ids"].reverse(), "manifest_field_invalid"),
                errors.ManifestFieldInvalid,
            ),
            "record_count_a_bool": Attack(
                _manifest_field(lambda doc: doc.update(record_count=True), "manifest_field_invalid"),
                errors.ManifestFieldInvalid,
            ),
            "records_bytes_negative": Attack(
                _manifest_field(lambda doc: doc.update(records_bytes=-1), "manifest_field_invalid"),
                errors.ManifestFieldInvalid,
            ),
            "records_sha256_upper_case": Attack(
                _manifest_field(
                    lambda doc: doc.update(records_sha256=doc["records_sha256"].upper()), "records_name_invalid"
                ),
                errors.RecordsNameInvalid,
            ),
            "manifest_nested_too_deep": Attack(_manifest_too_deep, errors.ManifestNotJSON),
            "manifest_names_another_participants_records": Attack(_manifest_names_other_records, errors.RecordsMissing),
            "records_and_manifest_of_another_participant": Attack(
                _records_swapped_between_participants, errors.ParticipantMismatch
            ),
        },
    ),
    **_promise(
        "ids agree, and the index is exact",
        {
            "index_names_another_checkpoint_id": Attack(
                _index_edit(_index_id), errors.CheckpointIdMismatch, read=None, read_index=True
            ),
            "manifest_of_another_checkpoint_id": Attack(
                _manifest_of_another_checkpoint, errors.CheckpointIdMismatch, read=None, read_index=True
            ),
            "index_lists_a_participant_twice": Attack(
                _index_edit(_index_twice), errors.CheckpointIndexInvalid, read=None, read_index=True
            ),
            "index_manifest_path_escapes": Attack(
                _index_edit(_index_escapes), errors.CheckpointIndexInvalid, read=None, read_index=True
            ),
            "index_kind_with_trailing_newline": Attack(
                _index_edit(_index_kind_newline), errors.CheckpointIndexInvalid, read=None, read_index=True
            ),
            "participant_directory_of_another_commit": Attack(
                _participant_of_another_commit, errors.IndexDigestMismatch, read=None, read_index=True
            ),
            "manifest_deleted_while_listed": Attack(
                _manifest_deleted_while_listed, errors.IndexParticipantMissing, read=None, read_index=True
            ),
        },
    ),
}
