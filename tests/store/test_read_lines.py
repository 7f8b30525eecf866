"""read_lines: a records file's lines handed on undecoded, the whole file still verified (S4, S8).

A server's coordinator sends each worker its share of a restore as the lines were read
(gymckpt.workers.scatter); the store verifies the file as read_records does.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

import pytest

from gymckpt import errors
from gymckpt.store import open_store
from gymckpt.store.codec import decode_line, encode_record, rekeyed_line
from gymckpt.store.records import RecordsCheck, read_lines

RECORDS: list[dict[str, Any]] = [
    {"episode_id": "a", "state": {"text": "x" * 5000, "quote": 'he said "owner"\n'}},
    {"episode_id": "b", "state": {"nan": float("nan"), "big": 2**70}},  # an exact line
    {"episode_id": "c\u00e9", "state": [1, 2.5, None, True]},
]


def _file(records: list[dict[str, Any]] = RECORDS) -> tuple[bytes, RecordsCheck]:
    data = b"".join(encode_record(record)[1] for record in records)
    ids = tuple(sorted(record["episode_id"] for record in records))
    check = RecordsCheck(
        path="d/records.jsonl",
        participant="resources/s0",
        manifest_path="d/manifest.json",
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        count=len(records),
        episode_ids=ids,
    )
    return data, check


@pytest.mark.parametrize("chunk_size", [7, 1 << 20])
def test_lines_come_undecoded_in_file_order_and_decode_to_the_records(chunk_size: int) -> None:
    data, check = _file()
    got = list(read_lines(io.BytesIO(data), check, chunk_size=chunk_size))
    assert [episode_id for episode_id, _ in got] == [record["episode_id"] for record in RECORDS]
    assert [line + b"\n" for _, line in got] == data.splitlines(keepends=True)
    assert all(type(line) is bytes for _, line in got)
    for (_, line), record in zip(got, RECORDS, strict=True):
        assert repr(decode_line(line)) == repr(record)


def test_only_lines_in_scope_are_yielded_but_every_line_is_checked() -> None:
    data, check = _file()
    assert [episode_id for episode_id, _ in read_lines(io.BytesIO(data), check, scope={"b"})] == ["b"]
    damaged = data[:-3] + b"X" + data[-2:]  # a byte of the last line, out of scope
    with pytest.raises(errors.RecordsDigestMismatch):
        list(read_lines(io.BytesIO(damaged), check, scope={"a"}))


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda data: data[:-1], errors.RecordsSizeMismatch),
        (lambda data: data + b"{}\n", errors.RecordsSizeMismatch),
    ],
)
def test_a_file_of_another_size_is_typed_damage(change: Any, error: type[Exception]) -> None:
    data, check = _file()
    with pytest.raises(error):
        list(read_lines(io.BytesIO(change(data)), check))


def test_a_line_without_a_leading_episode_id_is_undecodable_even_with_a_matching_digest() -> None:
    data = b'{"state":1,"episode_id":"a"}\n'
    check = RecordsCheck(
        path="d/r.jsonl",
        participant="resources/s0",
        manifest_path="d/m.json",
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        count=1,
        episode_ids=("a",),
    )
    with pytest.raises(errors.RecordUndecodable) as raised:
        list(read_lines(io.BytesIO(data), check))
    assert raised.value.participant == "resources/s0"


def test_a_line_longer_than_its_limit_is_not_held() -> None:
    data, check = _file()
    check.line_limit = 100
    with pytest.raises(errors.RecordTooLong):
        list(read_lines(io.BytesIO(data), check))


def test_a_repeated_episode_and_a_wrong_count_are_typed() -> None:
    records = [RECORDS[0], RECORDS[0]]
    data, check = _file(records)
    with pytest.raises(errors.DuplicateEpisode):
        list(read_lines(io.BytesIO(data), check))
    data, check = _file()
    check.count = 2
    with pytest.raises(errors.RecordCountMismatch):
        list(read_lines(io.BytesIO(data), check))


def test_a_reference_file_is_refused_for_lines() -> None:
    data, check = _file()
    check.reference = True
    with pytest.raises(ValueError, match="read_records"):
        list(read_lines(io.BytesIO(data), check))


def test_the_store_reads_a_participants_lines_as_its_records(tmp_path: Any) -> None:
    store = open_store(str(tmp_path))
    manifest = store.write_participant(
        "ck", kind="resources", instance="s0", checkpoint_id="c0", records=RECORDS, extra={}
    )
    manifest = store.read_manifest("ck", kind="resources", instance="s0")
    lines = dict(store.read_lines(manifest, scope={"a", "c\u00e9"}))
    assert sorted(lines) == ["a", "c\u00e9"]
    assert repr(decode_line(lines["a"])) == repr(RECORDS[0])


@pytest.mark.parametrize("record", [*RECORDS, {"episode_id": 'q"\\', "x": 1}, {"episode_id": "s", "x": 10**40}])
@pytest.mark.parametrize("key", ["r-a1", "\u00e9-a2", 'odd"key'])
def test_a_rekeyed_line_decodes_to_the_record_under_the_new_key_in_its_place(record: dict[str, Any], key: str) -> None:
    line = encode_record(record)[1][:-1]
    decoded = decode_line(rekeyed_line(line, key))
    assert decoded["episode_id"] == key
    assert list(decoded) == list(record)
    assert repr({**decoded, "episode_id": record["episode_id"]}) == repr(record)


def test_rekeying_a_line_without_a_leading_id_is_undecodable() -> None:
    with pytest.raises(errors.RecordUndecodable):
        rekeyed_line(b'{"x":1,"episode_id":"a"}', "b")
