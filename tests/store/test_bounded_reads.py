"""Memory follows what the manifest allows, not the bytes on disk (gymckpt.store.bounds).

- Records lines: the writer records its longest line (``max_record_bytes``); readers hold no
  longer line (both read loops, restore, scoped and verify-style reads). A manifest without
  it falls back to ``MAX_LINE_BYTES``. A zero-filled file (a crash kept the size) is a digest
  mismatch, read without holding it.
- Documents: a manifest or checkpoint.json over its size limit is refused from its size,
  unread; one that would cost more than the parse budget decoded is refused undecoded.

Memory is observed with tracemalloc (every thread's allocations), bytes read with the
recording backend.
"""

from __future__ import annotations

import hashlib
import io
import json
import tracemalloc
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt import errors
from gymckpt.store import CheckpointStore, codec, open_store
from gymckpt.store import bounds as bounds_module
from gymckpt.store import participant as participant_module
from gymckpt.store import publication as publication_module
from gymckpt.store._local import LocalBackend
from gymckpt.store.bounds import DOCUMENT_BUDGET, document_cost, keys_repeated
from gymckpt.store.manifest import Manifest
from gymckpt.store.records import RecordsCheck, read_records
from gymckpt.store.verify import verify_backend
from gymckpt.testing.recording import RecordingBackend
from gymckpt.testing.reference_format import write_reference_participant, write_reference_records_bytes
from gymckpt.testing.values import assert_identical, sample_records

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

CHUNK = 64 << 10
#: what a read may hold beyond its lines: the queued chunks, the ones in hand and interpreter noise
READ_MARGIN = 12 * CHUNK + (1 << 20)


@pytest.fixture(params=["c_loop", "python_loop"])
def loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each read runs with the C line loop (where built) and with the Python one."""
    if request.param == "c_loop" and codec._decode_fast_lines is None:
        pytest.skip("gymckpt.store._exact is not built (or GYMCKPT_PURE_PYTHON=1)")
    if request.param == "python_loop":
        monkeypatch.setattr(codec, "_decode_fast_lines", None)
        monkeypatch.setattr(codec, "_decode_fast_line", None)
    return request.param


def traced_peak(action: Callable[[], object]) -> int:
    """Peak traced bytes above what was traced when ``action`` started."""
    start = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    action()
    return tracemalloc.get_traced_memory()[1] - start


def committed(tmp_path: Path, count: int = 20, payload: int = 200) -> tuple[CheckpointStore, Manifest]:
    store = CheckpointStore(LocalBackend(str(tmp_path)), chunk_size=CHUNK)
    manifest = store.write_participant(
        "ck", kind="agent", instance="a0", checkpoint_id="c", records=sample_records(count, payload=payload)
    )
    return store, manifest


def findings(tmp_path: Path) -> set[tuple[str, str]]:
    """What verify finds under ``tmp_path``, as (code, store-relative path)."""
    return {(finding.code, finding.path) for finding in verify_backend(LocalBackend(str(tmp_path))).findings}


def rewrite(tmp_path: Path, manifest: Manifest, data: bytes, **claims: Any) -> str:
    """A consistent writer: ``data`` becomes the records file, named and hashed in the manifest with ``claims``."""
    digest = hashlib.sha256(data).hexdigest()
    (tmp_path / manifest.records_path).unlink()
    path = f"{manifest.directory}/records-{digest}.jsonl"
    (tmp_path / path).write_bytes(data)
    document = json.loads((tmp_path / manifest.path).read_bytes())
    document.update(records_file=f"records-{digest}.jsonl", records_sha256=digest, records_bytes=len(data), **claims)
    (tmp_path / manifest.path).write_text(json.dumps(document, indent=2))
    return path


READS: dict[str, Callable[[CheckpointStore], list[dict[str, Any]]]] = {
    "restore": lambda store: list(store.read_participant("ck", kind="agent", instance="a0")),
    "scoped": lambda store: list(store.read_participant("ck", kind="agent", instance="a0", scope={"r3"})),
    # what verify does: every line decoded, none kept
    "verify_style": lambda store: [
        *participant_module.iter_manifest_records(
            store.backend,
            store.read_manifest("ck", kind="agent", instance="a0"),
            scope=(),
            decode_all=True,
            chunk_size=store.chunk_size,
        )
    ],
}


def raises_within(error: type[BaseException], read: Callable[[], object]) -> tuple[BaseException, int]:
    """The error ``read`` raised, and the peak traced bytes while it ran."""
    raised: list[BaseException] = []

    def action() -> None:
        with pytest.raises(error) as caught:
            read()
        raised.append(caught.value)

    peak = traced_peak(action)
    return raised[0], peak


# --- records lines


@pytest.mark.parametrize("writer", ["c_loop", "python_loop"])
def test_the_writer_records_its_longest_line(tmp_path: Path, writer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if writer == "python_loop":
        monkeypatch.setattr(codec, "_append_lines", None)
        monkeypatch.setattr(codec, "_encode_line", None)
    records = [*sample_records(30, payload=100), {"episode_id": "long", "text": "é" * 5000}]
    store = CheckpointStore(LocalBackend(str(tmp_path)), chunk_size=4096)
    manifest = store.write_participant("ck2", kind="agent", instance="a0", checkpoint_id="c", records=records)
    lines = (tmp_path / manifest.records_path).read_bytes().splitlines(keepends=True)
    assert manifest.max_record_bytes == max(map(len, lines)) == len(codec.encode_record(records[-1])[1])
    assert json.loads(manifest.raw)["max_record_bytes"] == manifest.max_record_bytes
    assert Manifest.parse(manifest.raw, path=manifest.path).max_record_bytes == manifest.max_record_bytes
    assert_identical(records, list(store.read_participant("ck2", kind="agent", instance="a0")))


@pytest.mark.parametrize("read", sorted(READS))
def test_a_zero_filled_records_file_is_a_digest_mismatch_read_without_holding_it(
    tmp_path: Path, loop: str, read: str, tracing: None
) -> None:
    """What a filesystem crash can leave: the size kept, the blocks zeros, no newline anywhere."""
    store, manifest = committed(tmp_path, 2000, payload=2000)
    assert manifest.records_bytes > 60 * CHUNK
    (tmp_path / manifest.records_path).write_bytes(bytes(manifest.records_bytes))
    raised, peak = raises_within(errors.RecordsDigestMismatch, lambda: READS[read](store))
    assert raised.path == manifest.records_path
    bound = 2 * manifest.max_record_bytes + READ_MARGIN
    assert peak < bound < manifest.records_bytes // 2, (peak, bound, manifest.records_bytes)


@pytest.mark.parametrize("read", sorted(READS))
def test_a_line_longer_than_max_record_bytes_is_damage_and_is_not_held(
    tmp_path: Path, loop: str, read: str, tracing: None
) -> None:
    """A consistent writer (the digest matches) whose newline-free tail passes the manifest's bound."""
    store, manifest = committed(tmp_path)
    good = (tmp_path / manifest.records_path).read_bytes()
    path = rewrite(tmp_path, manifest, good + b'{"episode_id":"tail","v":"' + b"x" * (8 << 20))
    raised, peak = raises_within(errors.RecordTooLong, lambda: READS[read](store))
    assert isinstance(raised, errors.RecordUndecodable)
    assert raised.path == path and raised.problem == "record_too_long"
    assert f"line {manifest.record_count + 1} is longer than {manifest.max_record_bytes} bytes" in str(raised)
    assert peak < 2 * manifest.max_record_bytes + READ_MARGIN < 4 << 20, peak


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 4096])
def test_a_line_of_exactly_the_limit_reads_and_one_byte_more_does_not(loop: str, chunk_size: int) -> None:
    lines = [codec.encode_record(record)[1] for record in sample_records(5, payload=60)]
    longest = max(map(len, lines))
    data = b"".join(lines)

    def read(limit: int) -> list[dict[str, Any]]:
        check = RecordsCheck(
            path="d/records.jsonl",
            participant="agent/a0",
            manifest_path="d/manifest.json",
            sha256=hashlib.sha256(data).hexdigest(),
            size=len(data),
            count=len(lines),
            episode_ids=None,
            line_limit=limit,
        )
        return list(read_records(io.BytesIO(data), check, chunk_size=chunk_size))

    assert_identical(sample_records(5, payload=60), read(longest))
    with pytest.raises(errors.RecordTooLong, match=f"longer than {longest - 1} bytes"):
        read(longest - 1)


def test_a_manifest_without_max_record_bytes_falls_back_to_the_cap(
    tmp_path: Path, loop: str, monkeypatch: pytest.MonkeyPatch, tracing: None
) -> None:
    """An earlier gymckpt's manifest: the documented cap bounds a line (patched small here)."""
    store, manifest = committed(tmp_path)
    document = json.loads((tmp_path / manifest.path).read_bytes())
    del document["max_record_bytes"]
    (tmp_path / manifest.path).write_text(json.dumps(document, indent=2))
    monkeypatch.setattr(bounds_module, "MAX_LINE_BYTES", 64 << 10)
    assert len(READS["restore"](store)) == manifest.record_count  # within the cap: read as before
    good = (tmp_path / manifest.records_path).read_bytes()
    rewrite(tmp_path, manifest, good + b'{"episode_id":"tail","v":"' + b"x" * (4 << 20) + b'"}\n', record_count=21)
    assert "max_record_bytes" not in json.loads((tmp_path / manifest.path).read_bytes())
    raised, peak = raises_within(errors.RecordTooLong, lambda: READS["restore"](store))
    assert f"longer than {64 << 10} bytes" in str(raised)
    assert peak < 2 * (64 << 10) + READ_MARGIN, peak


def test_a_reference_records_file_without_a_newline_is_bounded_by_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tracing: None
) -> None:
    """The reference format claims no size and no longest line: the cap bounds it, and it is read to its end."""
    monkeypatch.setattr(bounds_module, "MAX_LINE_BYTES", 64 << 10)
    write_reference_records_bytes(
        tmp_path / "ck", kind="agent", instance="a0", checkpoint_id="ck", data=bytes(4 << 20), record_count=1
    )
    store = CheckpointStore(LocalBackend(str(tmp_path)), chunk_size=CHUNK)
    raised, peak = raises_within(errors.RecordTooLong, lambda: READS["restore"](store))
    assert "line 1 is longer than 65536 bytes" in str(raised)
    assert peak < 2 * (64 << 10) + READ_MARGIN, peak


def test_verify_reports_a_line_too_long_and_a_zero_filled_file(tmp_path: Path) -> None:
    store, manifest = committed(tmp_path)
    other = store.write_participant("ck", kind="env", instance="e0", checkpoint_id="c", records=sample_records(9))
    store.publish("ck", [manifest, other])
    good = (tmp_path / manifest.records_path).read_bytes()
    path = rewrite(tmp_path, manifest, good + b"x" * (1 << 20) + b"\n", record_count=21)
    (tmp_path / other.records_path).write_bytes(bytes(other.records_bytes))
    found = findings(tmp_path)
    assert ("record_too_long", path) in found, found
    assert ("records_digest_mismatch", other.records_path) in found, found


def test_max_record_bytes_must_lie_within_the_records_file(tmp_path: Path) -> None:
    _, manifest = committed(tmp_path)
    document = json.loads(manifest.raw)
    for claim in (manifest.records_bytes + 1, -1, "64", True, 1.5):
        document["max_record_bytes"] = claim
        with pytest.raises(errors.ManifestFieldInvalid, match="max_record_bytes"):
            Manifest.parse(json.dumps(document).encode(), path=manifest.path)
    reference = {key: document[key] for key in ("schema_version", "kind", "instance", "checkpoint_id")}
    reference.update(records_file="records.jsonl", records_sha256="0" * 64, record_count=0, max_record_bytes=5)
    with pytest.raises(errors.ManifestFieldInvalid, match="neither"):
        Manifest.parse(json.dumps(reference).encode(), path=manifest.path)


# --- documents: refused from their size unread, and under a parse budget


def padded(raw: bytes, extra: bytes) -> bytes:
    """A document with ``"x": extra`` added as its last key."""
    return raw.rstrip(b"}\n") + b', "x": ' + extra + b"}\n"


def test_a_manifest_over_the_limit_is_refused_from_its_size_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, manifest = committed(tmp_path)
    monkeypatch.setattr(participant_module, "MAX_MANIFEST_BYTES", 8 << 10)
    (tmp_path / manifest.path).write_bytes(padded(manifest.raw, b'"' + b"y" * (1 << 20) + b'"'))
    recorder = RecordingBackend(LocalBackend(str(tmp_path)))
    with pytest.raises(errors.FileTooLarge, match="refused unread") as raised:
        CheckpointStore(recorder).read_manifest("ck", kind="agent", instance="a0")
    assert raised.value.path == manifest.path
    assert recorder.bytes_read[manifest.path] == 0


def test_a_manifest_that_grew_after_it_was_measured_is_read_no_further_than_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, manifest = committed(tmp_path)
    limit = 8 << 10
    monkeypatch.setattr(participant_module, "MAX_MANIFEST_BYTES", limit)
    (tmp_path / manifest.path).write_bytes(padded(manifest.raw, b'"' + b"y" * (1 << 20) + b'"'))
    recorder = RecordingBackend(LocalBackend(str(tmp_path)), size_override={manifest.path: len(manifest.raw)})
    with pytest.raises(errors.FileTooLarge, match="grew"):
        CheckpointStore(recorder).read_manifest("ck", kind="agent", instance="a0")
    assert recorder.bytes_read[manifest.path] == limit + 1


def test_an_index_over_the_limit_is_refused_from_its_size_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, manifest = committed(tmp_path)
    store.publish("ck", [manifest])
    index = "ck/gym/checkpoint.json"
    monkeypatch.setattr(publication_module, "MAX_INDEX_BYTES", 4 << 10)
    (tmp_path / index).write_bytes(padded((tmp_path / index).read_bytes(), b'"' + b"y" * (1 << 20) + b'"'))
    recorder = RecordingBackend(LocalBackend(str(tmp_path)))
    with pytest.raises(errors.FileTooLarge, match="refused unread"):
        CheckpointStore(recorder).read_index("ck")
    assert recorder.bytes_read[index] == 0


EMPTY_LISTS = b"[" + b"[]," * 200_000 + b"[]]"  # 600 KB; decoded, 200,001 lists (about 13 MB)


def test_a_manifest_too_complex_to_decode_is_refused_undecoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tracing: None
) -> None:
    """The 60 MiB ``[],[],…`` manifest, scaled down with the budget."""
    store, manifest = committed(tmp_path)
    monkeypatch.setattr(bounds_module, "DOCUMENT_BUDGET", 4 << 20)
    raw = padded(manifest.raw, EMPTY_LISTS)
    (tmp_path / manifest.path).write_bytes(raw)
    raised, peak = raises_within(
        errors.DocumentTooComplex, lambda: store.read_manifest("ck", kind="agent", instance="a0")
    )
    assert raised.path == manifest.path and raised.participant == "agent/a0"
    assert "over the parse budget of 4 MiB" in str(raised)
    assert peak < 3 * len(raw), peak  # the bytes and a copy at most: nothing decoded
    assert ("document_too_complex", manifest.path) in findings(tmp_path)


def test_an_index_too_complex_to_decode_is_refused_undecoded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store, manifest = committed(tmp_path)
    store.publish("ck", [manifest])
    index = "ck/gym/checkpoint.json"
    monkeypatch.setattr(bounds_module, "DOCUMENT_BUDGET", 4 << 20)
    (tmp_path / index).write_bytes(padded((tmp_path / index).read_bytes(), EMPTY_LISTS))
    with pytest.raises(errors.DocumentTooComplex) as raised:
        store.read_index("ck")
    assert raised.value.path == index


@pytest.mark.slow
def test_a_manifest_of_a_million_episode_ids_is_within_the_budget() -> None:
    ids = [f"rollout-{index:07d}-a1" for index in range(1_000_000)]
    manifest = Manifest.build(
        directory="ck/gym/agent/a0",
        kind="agent",
        instance="a0",
        checkpoint_id="c",
        records_sha256="0" * 64,
        record_count=len(ids),
        records_bytes=len(ids) * 100,
        episode_ids=ids,
        extra={"note": "x"},
        max_record_bytes=100,
    )
    assert document_cost(manifest.raw) < DOCUMENT_BUDGET, document_cost(manifest.raw)
    parsed = Manifest.parse(manifest.raw, path=manifest.path)
    assert parsed.episode_ids == tuple(ids) and parsed.raw == manifest.raw


SHAPES = {
    "episode_ids": lambda: json.dumps({"episode_ids": [f"rollout-{i:06d}" for i in range(50_000)]}, indent=2),
    "short_strings": lambda: json.dumps([str(i % 7) for i in range(100_000)]),
    "empty_lists": lambda: "[" + "[]," * 100_000 + "[]]",
    "empty_objects": lambda: "[" + "{}," * 100_000 + "{}]",
    "small_objects": lambda: json.dumps([{"a": i, "b": [i]} for i in range(30_000)]),
    "numbers": lambda: json.dumps([i * 1_000_003 for i in range(100_000)] + [i / 7 for i in range(100_000)]),
    "nested_lists": lambda: "[" + "[[[1]]]," * 50_000 + "[]]",
    "unicode": lambda: json.dumps(["é🙂" * 20 for _ in range(20_000)], ensure_ascii=False),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_estimate_bounds_what_decoding_costs(shape: str, tracing: None) -> None:
    data = SHAPES[shape]().encode()
    held: list[object] = []
    cost = traced_peak(lambda: held.append(codec.decode_document(data)))
    assert cost <= document_cost(data), (cost, document_cost(data))


# --- no key twice


def write_manifest_text(tmp_path: Path, manifest: Manifest, raw: bytes) -> None:
    (tmp_path / manifest.path).write_bytes(raw)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (lambda raw: raw.replace(b"{", b'{\n  "checkpoint_id": "another",', 1), "checkpoint_id"),
        (lambda raw: raw.replace(b'"kind": "agent"', b'"kind": "model", "kind": "agent"', 1), "kind"),
        (lambda raw: padded(raw, b'{"step": 0, "step": 1}'), "step"),
        (lambda raw: padded(raw, b'[{"a": 1}, {"b": 2, "b": 2}]'), "b"),
    ],
    ids=["first_checkpoint_id_another", "kind_twice", "extra_key_twice", "key_twice_in_a_list"],
)
def test_a_manifest_with_a_key_twice_is_refused_naming_it(
    tmp_path: Path, change: Callable[[bytes], bytes], key: str
) -> None:
    store, manifest = committed(tmp_path)
    write_manifest_text(tmp_path, manifest, change(manifest.raw))
    with pytest.raises(errors.DuplicateKey, match=f"the key '{key}' twice") as raised:
        store.read_manifest("ck", kind="agent", instance="a0")
    assert raised.value.path == manifest.path and raised.value.participant == "agent/a0"
    assert ("duplicate_key", manifest.path) in findings(tmp_path)


def test_an_index_with_a_key_twice_is_refused_naming_it(tmp_path: Path) -> None:
    store, manifest = committed(tmp_path)
    store.publish("ck", [manifest])
    index = tmp_path / "ck/gym/checkpoint.json"
    raw = index.read_bytes()
    index.write_bytes(raw.replace(b'"kind": "agent"', b'"kind": "agent", "kind": "agent"', 1))
    with pytest.raises(errors.DuplicateKey, match=r"checkpoint\.json holds the key 'kind' twice") as raised:
        store.read_index("ck")
    assert raised.value.path == "ck/gym/checkpoint.json"
    assert ("duplicate_key", "ck/gym/checkpoint.json") in findings(tmp_path)


KEY_TWICE_LINES = {
    "top_level": (b'{"episode_id":"t","a":1,"a":2}', "a"),
    "episode_id_same_value": (b'{"episode_id":"t","episode_id":"t"}', "episode_id"),
    "nested": (b'{"episode_id":"t","s":{"x":{"y":1,"y":1}}}', "y"),
    "in_a_list": (b'{"episode_id":"t","l":[{"k":1},{"k":2,"j":3,"k":4}]}', "k"),
    "dropped_value_held_an_object": (b'{"episode_id":"t","o":{"p":{"q":1}},"o":2}', "o"),
    "beside_colons_and_braces_in_strings": (b'{"episode_id":"t","u":"a:{b}:\\"c:","u":"d"}', "u"),
    "exact_line": (b'{"episode_id": "t", "n": NaN, "n": 1}', "n"),
    "escaped_colon_in_a_string": (b'{"episode_id":"t","w":"\\u003a","w":1}', "w"),
}


@pytest.mark.parametrize("case", sorted(KEY_TWICE_LINES))
@pytest.mark.parametrize("read", sorted(READS))
def test_a_records_line_with_a_key_twice_is_undecodable_naming_it(
    tmp_path: Path, loop: str, read: str, case: str
) -> None:
    store, manifest = committed(tmp_path)
    line, key = KEY_TWICE_LINES[case]
    good = (tmp_path / manifest.records_path).read_bytes().splitlines(keepends=True)
    data = b"".join([*good[:3], line + b"\n", *good[3:]])
    rewrite(tmp_path, manifest, data, record_count=21, episode_ids=sorted([*manifest.episode_ids, "t"]))
    if read == "scoped":  # a scoped read decodes its scope only: the line in it
        reading = lambda: list(store.read_participant("ck", kind="agent", instance="a0", scope={"t"}))  # noqa: E731
    else:
        reading = lambda: READS[read](store)  # noqa: E731
    with pytest.raises(errors.RecordUndecodable, match=f"line 4: line holds the key '{key}' twice"):
        reading()


def test_a_reference_records_line_with_a_key_twice_is_undecodable(tmp_path: Path) -> None:
    write_reference_records_bytes(
        tmp_path / "ck",
        kind="agent",
        instance="a0",
        checkpoint_id="ck",
        data=b'{"episode_id": {"rollout_id": "r", "attempt": 0}, "v": 1, "v": 2}\n',
    )
    with pytest.raises(errors.RecordUndecodable, match="the key 'v' twice"):
        READS["restore"](open_store(str(tmp_path)))


NO_KEY_TWICE = [
    {"episode_id": "a", "text": 'colons: "quoted: {braces}" and \\ backslashes \\\\: end', "n": {"k:": "v:"}},
    {"episode_id": "b", "same": {"x": 1}, "other": {"x": 1}, "list": [{"x": 1}, {"x": 1}], "nested": [[{"y": {}}]]},
    {"episode_id": "c", "episode_id_inside": {"episode_id": "d"}, "escaped": '\u003a\x7f\n\t"', "empty": {"": ""}},
    {"episode_id": "d", "tokens": list(range(3000)), "objects": [{"i": i} for i in range(300)], "nan": float("nan")},
]


def test_keys_that_only_look_repeated_are_not_damage(tmp_path: Path, loop: str) -> None:
    store = open_store(str(tmp_path))
    store.write_participant("ck", kind="agent", instance="a0", checkpoint_id="c", records=NO_KEY_TWICE)
    for read in READS.values():
        read(store)
    assert_identical(NO_KEY_TWICE, READS["restore"](store))
    write_reference_participant(
        tmp_path / "ref", kind="agent", instance="a0", checkpoint_id="ref", records=NO_KEY_TWICE[:3]
    )
    assert len(list(open_store(str(tmp_path)).read_participant("ref", kind="agent", instance="a0"))) == 3


@pytest.mark.parametrize(
    ("line", "repeated"),
    [
        (b'{"a":1,"b":{"c":2}}', False),
        (b'{"a":"x:y","b":"{:}"}', False),
        (b'{"a":"\\\\","b":"\\":"}', False),
        (b'{"a":"\\u003a","b":1}', False),  # as many colons as keys: decided without looking at strings
        (b'{"a":"\\u003a:","b":1}', None),  # a colon in a string beside an escaped one: the counts cannot decide
        (b'{"a":1,"a":1}', True),
        (b'{"a":"x:","a":":"}', True),
        (b'{"a":[{"b":1},{"b":1,"b":1}]}', True),
    ],
)
def test_keys_repeated_decides_by_counting_or_says_it_cannot(line: bytes, repeated: bool | None) -> None:
    assert keys_repeated(line, json.loads(line)) is repeated
    if repeated:
        with pytest.raises(errors.RecordUndecodable, match="twice"):
            codec.decode_line(b'{"episode_id":"e",' + line[1:])
    else:
        assert codec.decode_line(b'{"episode_id":"e",' + line[1:])["a"] == json.loads(line)["a"]


# --- the writer refuses what every reader would refuse


@pytest.mark.parametrize("limit", ["size", "budget"])
def test_a_manifest_no_reader_would_accept_is_never_published(
    tmp_path: Path, limit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many episodes (each id is a string in the manifest): refused at commit, not at the restore that needs it."""
    store = CheckpointStore(LocalBackend(str(tmp_path)))
    small = store.write_participant("ok", kind="agent", instance="a0", checkpoint_id="c", records=sample_records(3))
    if limit == "size":
        monkeypatch.setattr(participant_module, "MAX_MANIFEST_BYTES", len(small.raw) + 200)
        refused: type[errors.InvalidCheckpointState] = errors.FileTooLarge
    else:
        monkeypatch.setattr(bounds_module, "DOCUMENT_BUDGET", document_cost(small.raw) + 2000)
        refused = errors.DocumentTooComplex
    with pytest.raises(refused) as raised:
        store.write_participant("ck", kind="agent", instance="a0", checkpoint_id="c", records=sample_records(400))
    assert "not published" in str(raised.value)
    directory = tmp_path / "ck" / "gym" / "agent" / "a0"
    assert not directory.exists() or list(directory.iterdir()) == []  # no manifest, no records file left
