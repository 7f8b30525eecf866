"""gymckpt reads checkpoints in the reference stack's format, and keeps writing its own.

Fixtures are written byte for byte in the reference's documented format by
:mod:`gymckpt.testing.reference_format`; the first test pins those bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gymckpt import errors
from gymckpt.store import CheckpointStore, verify
from gymckpt.store._local import LocalBackend
from gymckpt.store.listing import list_checkpoints, participant_rows
from gymckpt.store.manifest import GYMCKPT_FORMAT, REFERENCE_FORMAT
from gymckpt.testing.reference_format import (
    reference_manifest_bytes,
    reference_participant_directory,
    reference_record_line,
    write_reference_collection,
    write_reference_leftovers,
    write_reference_participant,
    write_reference_records_bytes,
)
from gymckpt.testing.values import assert_identical

CHECKPOINT = "ckpt-20260101T000000-0123abcd"
KIND, INSTANCE = "resources", "notes"
REFERENCE_NOTE = "reference format (no records_bytes, episode_ids, writer)"


def deep_list(levels: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(levels - 1):
        value = [value]
    return value


def reference_records() -> list[dict[str, Any]]:
    """Records as the layers above hand them over and get them back: capture-key episode ids."""
    return [
        {
            "episode_id": "r0",
            "session_id": "s0",
            "state": {
                "text": "café 🙂 日本 \u2028 \x00",
                "nan": math.nan,
                "inf": [math.inf, -math.inf, -0.0],
                "big": 2**200,
                "neg": -(3**150),
            },
        },
        {"episode_id": "r1-a2", "zeta": 1, "alpha": {"y": 2, "x": 1}, "owner": None},
        {"episode_id": "x-a0", "task_digest": "d" * 64, "boundary": {"step": 3}},
        {"episode_id": "deep", "state": deep_list(300)},
    ]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


@pytest.fixture
def store(root: Path) -> CheckpointStore:
    root.mkdir(parents=True, exist_ok=True)
    return CheckpointStore(LocalBackend(str(root)))


def write_reference(root: Path, records: list[dict[str, Any]] | None = None, **options: Any) -> dict[str, Any]:
    return write_reference_participant(
        root / CHECKPOINT,
        kind=options.pop("kind", KIND),
        instance=options.pop("instance", INSTANCE),
        checkpoint_id=CHECKPOINT,
        records=reference_records() if records is None else records,
        **options,
    )


def write_raw(root: Path, data: bytes, **options: Any) -> dict[str, Any]:
    return write_reference_records_bytes(
        root / CHECKPOINT, kind=KIND, instance=INSTANCE, checkpoint_id=CHECKPOINT, data=data, **options
    )


def participant_dir(root: Path, kind: str = KIND, instance: str = INSTANCE) -> Path:
    return reference_participant_directory(root / CHECKPOINT, kind, instance)


def read_all(store: CheckpointStore, scope: Any = None, **names: str) -> list[dict[str, Any]]:
    names = {"kind": KIND, "instance": INSTANCE, **names}
    return list(store.read_participant(CHECKPOINT, scope=scope, **names))


def codes(report: Any) -> list[str]:
    return [finding.code for finding in report.findings]


# --- the writer's bytes


def test_the_writer_writes_the_documented_bytes(root: Path) -> None:
    line = reference_record_line({"episode_id": {"rollout_id": "r", "attempt": 0}, "t": "é🙂", "x": math.nan})
    assert line == b'{"episode_id": {"rollout_id": "r", "attempt": 0}, "t": "\\u00e9\\ud83d\\ude42", "x": NaN}\n'

    records = [{"episode_id": "r-a1", "t": "é", "v": [1, math.inf]}]
    manifest = write_reference(root, records, extras={"session_owners": {"s": 0}})
    data = b'{"episode_id": {"rollout_id": "r", "attempt": 1}, "t": "\\u00e9", "v": [1, Infinity]}\n'
    digest = hashlib.sha256(data).hexdigest()
    assert (participant_dir(root) / f"records-{digest}.jsonl").read_bytes() == data
    expected_manifest = (
        "{\n"
        f' "checkpoint_id": "{CHECKPOINT}",\n'
        f' "instance": "{INSTANCE}",\n'
        f' "kind": "{KIND}",\n'
        ' "record_count": 1,\n'
        f' "records_file": "records-{digest}.jsonl",\n'
        f' "records_sha256": "{digest}",\n'
        ' "schema_version": 1,\n'
        ' "session_owners": {\n'
        '  "s": 0\n'
        " }\n"
        "}"
    ).encode()
    assert (participant_dir(root) / "manifest.json").read_bytes() == expected_manifest
    assert reference_manifest_bytes(manifest) == expected_manifest
    assert sorted(path.name for path in participant_dir(root).iterdir()) == [
        "manifest.json",
        f"records-{digest}.jsonl",
    ]


# --- a clean reference checkpoint


def test_a_clean_reference_checkpoint_verifies_and_names_its_format(root: Path) -> None:
    write_reference(root)
    data_size = records_path(root).stat().st_size
    for url in (root, root / CHECKPOINT):
        report = verify(str(url))
        assert report.ok and report.findings == [], report.findings
        assert report.records_checked == len(reference_records())
        assert report.bytes_checked == data_size
        assert report.formats == {GYMCKPT_FORMAT: 0, REFERENCE_FORMAT: 1}
        assert report.format_summary() == f"1 {REFERENCE_NOTE}"
        document = report.to_dict()
        assert document["participant_formats"] == [
            {
                "checkpoint": CHECKPOINT if url == root else "",
                "participant": f"{KIND}/{INSTANCE}",
                "format": "reference",
            }
        ]
        assert document["formats"] == {"gymckpt": 0, "reference": 1}
    quick = verify(str(root), quick=True)
    assert quick.ok and quick.findings == [] and quick.bytes_checked == data_size


def test_reference_records_restore_with_capture_keys_and_every_value_intact(store: CheckpointStore, root: Path) -> None:
    write_reference(root)
    expected = reference_records()
    assert_identical(expected, read_all(store))
    assert_identical([expected[1], expected[2]], read_all(store, scope={"x-a0", "r1-a2", "absent"}))
    assert read_all(store, scope=()) == []

    manifest = store.read_manifest(CHECKPOINT, kind=KIND, instance=INSTANCE)
    assert manifest.format == REFERENCE_FORMAT and manifest.is_reference
    assert (manifest.records_bytes, manifest.episode_ids, manifest.writer) == (None, None, None)
    assert manifest.record_count == len(expected)
    assert_identical([expected[0]], list(store.read_records(manifest, scope=["r0"])))


def test_to_document_is_the_manifest_object_as_stored(store: CheckpointStore, root: Path) -> None:
    write_reference(root, extras={"placed_sessions": {"s0": "w1"}, "a_first": [1, 2]})
    gymckpt = store.write_participant(
        CHECKPOINT, kind="environment", instance="env-0", checkpoint_id=CHECKPOINT, records=[{"episode_id": "r0"}]
    )
    for kind, instance in ((KIND, INSTANCE), ("environment", "env-0")):
        manifest = store.read_manifest(CHECKPOINT, kind=kind, instance=instance)
        stored = json.loads((participant_dir(root, kind, instance) / "manifest.json").read_bytes())
        assert_identical(stored, manifest.to_document())
    reference = store.read_manifest(CHECKPOINT, kind=KIND, instance=INSTANCE).to_document()
    assert not {"records_bytes", "episode_ids", "writer"} & set(reference)
    assert list(reference) == sorted(reference)
    assert_identical(json.loads(gymckpt.raw), gymckpt.to_document())


def test_the_legacy_records_name_reads(store: CheckpointStore, root: Path) -> None:
    write_reference(root, legacy_name=True)
    assert (participant_dir(root) / "records.jsonl").is_file()
    assert_identical(reference_records(), read_all(store))
    report = verify(str(root))
    assert report.ok and report.findings == [], report.findings


def test_episode_objects_in_any_key_order_and_without_attempt(store: CheckpointStore, root: Path) -> None:
    data = (
        b'{"episode_id": {"rollout_id": "a"}, "v": 1}\n'
        b'{"episode_id": {"attempt": 2, "rollout_id": "b"}, "v": 2}\n'
        b'{"session_id": "s", "episode_id": {"rollout_id": "c", "attempt": 1}}\n'
        b'{"episode_id": {"rollout_id": "d", "attempt": 0}, "big": 12345678901234567890123456789, "deep": '
        + b"[" * 2000
        + b"]" * 2000
        + b"}\n"
    )
    write_raw(root, data)
    records = read_all(store)
    assert [record["episode_id"] for record in records] == ["a", "b-a2", "c-a1", "d"]
    assert list(records[2]) == ["session_id", "episode_id"]  # key order kept, the id where it was
    assert records[3]["big"] == 12345678901234567890123456789
    assert [record["episode_id"] for record in read_all(store, scope={"c-a1", "b-a2"})] == ["b-a2", "c-a1"]
    assert verify(str(root)).findings == []


# --- damage


def records_path(root: Path) -> Path:
    (path,) = participant_dir(root).glob("records-*.jsonl")
    return path


def rewrite_manifest(root: Path, change: Any) -> None:
    path = participant_dir(root) / "manifest.json"
    document = json.loads(path.read_bytes())
    change(document)
    path.write_bytes(reference_manifest_bytes(document))


def flip_a_byte(root: Path) -> None:
    write_reference(root)
    path = records_path(root)
    data = bytearray(path.read_bytes())
    data[data.index(b'"s0"') + 1] = ord("t")  # still JSON: only the digest can tell
    path.write_bytes(bytes(data))


def claim_more_records(root: Path) -> None:
    write_reference(root)
    rewrite_manifest(root, lambda document: document.update(record_count=5))


def truncate_the_file(root: Path) -> None:
    write_reference(root)
    path = records_path(root)
    path.write_bytes(path.read_bytes()[:-7])


def delete_the_records(root: Path) -> None:
    write_reference(root)
    records_path(root).unlink()


OBJECT = b'{"episode_id": {"rollout_id": "r", "attempt": 0}, "v": 1}\n'

DAMAGE: dict[str, tuple[Any, type[errors.InvalidCheckpointState]]] = {
    "digest_mismatch": (flip_a_byte, errors.RecordsDigestMismatch),
    "count_mismatch": (claim_more_records, errors.RecordCountMismatch),
    "truncated_line": (
        lambda root: write_raw(root, OBJECT + b'{"episode_id": {"rollout_id": "q", "attempt": 0}, "v": [1, 2'),
        errors.RecordUndecodable,
    ),
    "truncated_file": (truncate_the_file, errors.RecordsDigestMismatch),
    "object_with_an_extra_field": (
        lambda root: write_raw(root, OBJECT + b'{"episode_id": {"rollout_id": "q", "attempt": 0, "x": 1}}\n'),
        errors.RecordUndecodable,
    ),
    "negative_attempt": (
        lambda root: write_raw(root, b'{"episode_id": {"rollout_id": "q", "attempt": -1}}\n'),
        errors.RecordUndecodable,
    ),
    "string_attempt": (
        lambda root: write_raw(root, b'{"episode_id": {"rollout_id": "q", "attempt": "1"}}\n'),
        errors.RecordUndecodable,
    ),
    "fractional_attempt": (
        lambda root: write_raw(root, b'{"episode_id": {"rollout_id": "q", "attempt": 1.5}}\n'),
        errors.RecordUndecodable,
    ),
    "boolean_attempt": (
        lambda root: write_raw(root, b'{"episode_id": {"rollout_id": "q", "attempt": true}}\n'),
        errors.RecordUndecodable,
    ),
    "reserved_suffix_in_rollout_id": (
        lambda root: write_raw(root, b'{"episode_id": {"rollout_id": "q-a1", "attempt": 2}}\n'),
        errors.RecordUndecodable,
    ),
    "no_rollout_id": (
        lambda root: write_raw(root, b'{"episode_id": {"attempt": 2}}\n'),
        errors.RecordUndecodable,
    ),
    "a_second_episode_id_later": (
        lambda root: write_raw(
            root,
            b'{"episode_id": {"rollout_id": "a", "attempt": 0}, "episode_id": {"rollout_id": "b", "attempt": 0}}\n',
        ),
        errors.RecordUndecodable,
    ),
    "no_episode_id": (lambda root: write_raw(root, b'{"v": 1}\n'), errors.RecordUndecodable),
    "duplicate_episode": (lambda root: write_raw(root, OBJECT + OBJECT), errors.DuplicateEpisode),
    "duplicate_episode_in_two_spellings": (
        lambda root: write_raw(
            root,
            b'{"episode_id": {"rollout_id": "r", "attempt": 1}}\n{"episode_id": {"attempt": 1, "rollout_id": "r"}}\n',
        ),
        errors.DuplicateEpisode,
    ),
    "records_missing": (delete_the_records, errors.RecordsMissing),
}


#: damage inside a line that only decoding the line finds: out of scope it is hashed, not decoded (as gymckpt's)
FOUND_BY_DECODING = {"a_second_episode_id_later"}


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_damage_in_a_reference_checkpoint_is_found(store: CheckpointStore, root: Path, name: str) -> None:
    damage, error = DAMAGE[name]
    damage(root)
    with pytest.raises(error):
        read_all(store)
    if name in FOUND_BY_DECODING:
        assert read_all(store, scope=()) == []
    else:
        with pytest.raises(error):
            read_all(store, scope=())
    for quick in (False, True):
        report = verify(str(root), quick=quick)
        if quick and error is not errors.RecordsMissing:
            assert report.ok, report.findings  # --quick reads no records: only a missing file shows
            continue
        assert not report.ok
        assert codes(report) == [error.problem], report.findings


def test_a_damaged_line_out_of_scope_is_found_by_the_episode_id_alone(store: CheckpointStore, root: Path) -> None:
    # the object is read from the line's head: scope filtering refuses it without decoding the line
    write_raw(root, OBJECT + b'{"episode_id": {"rollout_id": "q", "attempt": -1}, "v": [1, 2, 3]}\n')
    with pytest.raises(errors.RecordUndecodable, match="line 2"):
        read_all(store, scope={"r"})


@pytest.mark.parametrize(
    ("change", "error", "text"),
    [
        (lambda doc: doc.update(writer="gymckpt 0"), errors.ManifestFieldInvalid, "has writer but no records_bytes"),
        (
            lambda doc: doc.update(records_bytes=1, episode_ids=[]),
            errors.ManifestFieldInvalid,
            "has records_bytes, episode_ids but no writer",
        ),
        (lambda doc: doc.update(record_count=-1), errors.ManifestFieldInvalid, "negative"),
        (lambda doc: doc.update(schema_version=2), errors.UnsupportedSchemaVersion, "schema_version"),
        (lambda doc: doc.update(checkpoint_id=7), errors.ManifestFieldInvalid, "checkpoint_id"),
        (lambda doc: doc.update(kind="agent"), errors.ParticipantMismatch, "agent"),
        (lambda doc: doc.update(records_file="records-X.jsonl"), errors.RecordsNameInvalid, "does not match"),
        (lambda doc: doc.update(records_file="records-" + "0" * 64 + ".jsonl"), errors.RecordsNameInvalid, "named"),
        (lambda doc: doc.update(records_file="../records.jsonl"), errors.RecordsPathEscapes, "not a file"),
        (lambda doc: doc.pop("records_sha256"), errors.ManifestFieldInvalid, "no records_sha256"),
    ],
)
def test_a_damaged_reference_manifest_is_refused_typed(
    store: CheckpointStore, root: Path, change: Any, error: type[errors.InvalidCheckpointState], text: str
) -> None:
    write_reference(root)
    rewrite_manifest(root, change)
    with pytest.raises(error, match=text) as raised:
        store.read_manifest(CHECKPOINT, kind=KIND, instance=INSTANCE)
    assert raised.value.participant == f"{KIND}/{INSTANCE}"
    assert raised.value.path.endswith("manifest.json")
    report = verify(str(root))
    # with its only manifest unreadable, nothing tells a reference checkpoint from an unpublished gymckpt one
    assert codes(report) == [error.problem, "checkpoint_unpublished"], report.findings


def test_a_legacy_name_needs_a_hex_digest(store: CheckpointStore, root: Path) -> None:
    write_reference(root, legacy_name=True)
    rewrite_manifest(root, lambda doc: doc.update(records_sha256="not-a-digest"))
    with pytest.raises(errors.ManifestFieldInvalid, match="sha256"):
        store.read_manifest(CHECKPOINT, kind=KIND, instance=INSTANCE)


# --- gymckpt's own format stays as it was


def gymckpt_records() -> list[dict[str, Any]]:
    return [{"episode_id": "r0", "v": 1}, {"episode_id": "r1-a1", "v": 2}]


def test_gymckpt_still_writes_its_own_format(store: CheckpointStore, root: Path) -> None:
    manifest = store.write_participant(
        CHECKPOINT, kind="environment", instance="env-0", checkpoint_id=CHECKPOINT, records=gymckpt_records()
    )
    assert manifest.format == GYMCKPT_FORMAT and not manifest.is_reference
    raw = (participant_dir(root, "environment", "env-0") / "manifest.json").read_bytes()
    assert raw == manifest.raw and raw.endswith(b"}\n")
    document = json.loads(raw)
    assert document["records_bytes"] == manifest.records_bytes > 0
    assert document["episode_ids"] == ["r0", "r1-a1"]
    assert document["writer"].startswith("gymckpt ")
    assert list(document)[-1] == "writer"
    records_path = participant_dir(root, "environment", "env-0") / manifest.records_file
    assert records_path.read_bytes().startswith(b'{"episode_id":"r0"')
    assert store.read_manifest(CHECKPOINT, kind="environment", instance="env-0").format == GYMCKPT_FORMAT


def test_gymckpt_manifests_keep_every_check(store: CheckpointStore, root: Path) -> None:
    """The reference's allowances (legacy name, episode objects) are not extended to gymckpt's manifests."""
    manifest = store.write_participant(
        CHECKPOINT, kind="environment", instance="env-0", checkpoint_id=CHECKPOINT, records=gymckpt_records()
    )
    directory = participant_dir(root, "environment", "env-0")
    manifest_path = directory / "manifest.json"
    document = json.loads(manifest_path.read_bytes())

    data = b'{"episode_id": {"rollout_id": "r0", "attempt": 0}, "v": 1}\n{"episode_id":"r1-a1","v":2}\n'
    digest = hashlib.sha256(data).hexdigest()
    (directory / manifest.records_file).unlink()
    (directory / f"records-{digest}.jsonl").write_bytes(data)
    document.update(
        records_file=f"records-{digest}.jsonl", records_sha256=digest, records_bytes=len(data), max_record_bytes=60
    )
    manifest_path.write_text(json.dumps(document))
    with pytest.raises(errors.RecordUndecodable, match="episode_id string"):
        read_all(store, kind="environment", instance="env-0")

    (directory / f"records-{digest}.jsonl").rename(directory / "records.jsonl")
    document.update(records_file="records.jsonl")
    manifest_path.write_text(json.dumps(document))
    with pytest.raises(errors.RecordsNameInvalid):
        store.read_manifest(CHECKPOINT, kind="environment", instance="env-0")


def test_gymckpt_lines_never_take_the_reference_path(
    store: CheckpointStore, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.write_participant(
        CHECKPOINT, kind="environment", instance="env-0", checkpoint_id=CHECKPOINT, records=gymckpt_records()
    )

    def refuse(*_: object) -> None:
        raise AssertionError("a gymckpt line went through the reference decoder")

    import gymckpt.store.records as records_module

    monkeypatch.setattr(records_module, "reference_episode_id_of_line", refuse)
    monkeypatch.setattr(records_module, "decode_reference_record", refuse)
    assert read_all(store, kind="environment", instance="env-0") == gymckpt_records()
    assert verify(str(root)).records_checked == 2


# --- mixed checkpoints, publication, the reference controller's files


def write_mixed(store: CheckpointStore, root: Path) -> list[Any]:
    gymckpt = store.write_participant(
        CHECKPOINT, kind="environment", instance="env-0", checkpoint_id=CHECKPOINT, records=gymckpt_records()
    )
    write_reference(root)
    return [gymckpt, store.read_manifest(CHECKPOINT, kind=KIND, instance=INSTANCE)]


def test_a_mixed_checkpoint_published_by_gymckpt_verifies(store: CheckpointStore, root: Path) -> None:
    manifests = write_mixed(store, root)
    store.publish(CHECKPOINT, manifests)
    report = verify(str(root))
    assert report.ok and report.findings == [], report.findings
    assert report.formats == {GYMCKPT_FORMAT: 1, REFERENCE_FORMAT: 1}
    assert report.format_summary() == f"1 gymckpt format, 1 {REFERENCE_NOTE}"
    assert report.records_checked == len(gymckpt_records()) + len(reference_records())
    assert {entry.participant for entry in store.read_index(CHECKPOINT).participants} == {
        "environment/env-0",
        f"{KIND}/{INSTANCE}",
    }
    assert_identical(reference_records(), read_all(store))
    assert read_all(store, kind="environment", instance="env-0") == gymckpt_records()


def test_a_mixed_checkpoint_published_by_the_reference_controller_verifies(store: CheckpointStore, root: Path) -> None:
    write_mixed(store, root)
    report = verify(str(root))
    assert codes(report) == ["checkpoint_unpublished"]  # gymckpt participants, and nobody published
    assert report.ok

    write_reference_collection(root, CHECKPOINT, continued=["r0", "r1-a2"])
    (root / "dispatched.jsonl").write_text('{"run_id": "x"}\n["r0", 0]\n')
    (root / "collector.pid").write_text("1234")
    for url in (root, root / CHECKPOINT):
        report = verify(str(url))
        assert report.ok and report.findings == [], report.findings
    (layout,) = list_checkpoints(LocalBackend(str(root))).values()
    assert layout.collection == f"{CHECKPOINT}/collection.json"


def test_leftovers_of_the_reference_are_reported_like_gymckpts(root: Path) -> None:
    write_reference(root)
    leftovers = write_reference_leftovers(root / CHECKPOINT, kind=KIND, instance=INSTANCE)
    write_reference_leftovers(root / CHECKPOINT, kind="agent", instance="unfinished")
    report = verify(str(root))
    assert report.ok
    found = sorted((finding.code, finding.path) for finding in report.findings)
    relative = sorted(f"{CHECKPOINT}/gym/{KIND}/{INSTANCE}/{path.name}" for path in leftovers)
    assert [path for code, path in found if code == "leftover_temporary_file" and INSTANCE in path] == relative
    assert sorted(code for code, _ in found) == ["leftover_temporary_file"] * 4 + ["unfinished_commit"]
    for finding in report.findings:
        if finding.code == "leftover_temporary_file":
            assert finding.fix == f"delete {finding.path}" and "reference" in finding.detail


def test_names_longer_than_gymckpt_writes_are_read(store: CheckpointStore, root: Path) -> None:
    kind, instance = "k" * 200, "i" * 255
    write_reference(root, kind=kind, instance=instance)
    assert_identical(reference_records(), read_all(store, kind=kind, instance=instance))
    report = verify(str(root))
    assert report.ok and report.findings == [], report.findings
    manifest = store.read_manifest(CHECKPOINT, kind=kind, instance=instance)
    store.publish(CHECKPOINT, [manifest])
    assert store.read_index(CHECKPOINT).participants[0].instance == instance
    with pytest.raises(ValueError, match="instance"):
        store.write_participant(CHECKPOINT, kind="k", instance="i" * 129, checkpoint_id="c", records=[])
    with pytest.raises(ValueError, match="instance") as raised:
        store.read_manifest(CHECKPOINT, kind=kind, instance="i" * 256)
    assert not isinstance(raised.value, errors.InvalidCheckpointState)


def test_inspect_rows_name_the_format(store: CheckpointStore, root: Path) -> None:
    write_mixed(store, root)
    backend = LocalBackend(str(root))
    rows = {row["participant"]: row for row in participant_rows(backend, list_checkpoints(backend))}
    reference = rows[f"{KIND}/{INSTANCE}"]
    assert reference["format"] == "reference"
    assert (reference["records_bytes"], reference["episode_ids"]) == (None, None)
    assert reference["record_count"] == len(reference_records())
    assert rows["environment/env-0"]["format"] == "gymckpt"
    assert rows["environment/env-0"]["episode_ids"] == ["r0", "r1-a1"]


def test_the_command_verifies_and_inspects_a_reference_checkpoint(root: Path) -> None:
    write_reference(root)

    def gymckpt(*arguments: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gymckpt", *arguments], capture_output=True, text=True, timeout=120, check=False
        )

    result = gymckpt("verify", str(root / CHECKPOINT))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"1 participant(s) (1 {REFERENCE_NOTE})" in result.stdout and "OK" in result.stdout
    result = gymckpt("verify", "--json", str(root))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["participant_formats"][0]["format"] == "reference"
    result = gymckpt("inspect", str(root))
    assert result.returncode == 0, result.stderr
    assert "reference format" in result.stdout and "size not claimed" in result.stdout
    result = gymckpt("inspect", str(root / CHECKPOINT), "--dump", f"{KIND}/{INSTANCE}", "--episode", "r1-a2")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"episode_id": "r1-a2", "zeta": 1, "alpha": {"y": 2, "x": 1}, "owner": None}


# --------------------------------------------------------------------------- the decoder is exact

_TRICKY_VALUES: list[Any] = [
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    -(2**63),
    -(2**63) - 1,
    10**30,
    -(10**30),
    1234567890123456789,
    0.1,
    -0.0,
    1e-320,
    float("nan"),
    float("inf"),
    float("-inf"),
    "\ud800",
    "12345678901234567890",
    "😀 ünï",
    [[[[[[[[[[1]]]]]]]]]],
    {"z": 1, "a": [1.5, 2, None, True]},
]


@pytest.mark.parametrize("value", _TRICKY_VALUES, ids=lambda value: repr(value)[:40])
def test_a_reference_line_decodes_exactly_as_the_stdlib_decoder_reads_it(value: Any) -> None:
    """orjson reads the common lines; whatever it would read differently (integers beyond 64 bits,
    NaN, infinities, lone surrogates) is read by the stdlib decoder, so values come back exactly."""
    from gymckpt.store.codec import decode_reference_record

    record = {"episode_id": {"rollout_id": "r", "attempt": 1}, "value": value, "after": 7}
    line = reference_record_line(record)
    decoded = decode_reference_record(memoryview(line), "r-a1")
    assert list(decoded) == ["episode_id", "value", "after"]
    assert decoded["episode_id"] == "r-a1"
    assert_identical(decoded["value"], json.loads(line)["value"])
    assert_identical(decoded["value"], value)
