"""The records loops in C and in Python give the same files, records, ids and errors.

- Writing: ``_exact.append_lines`` takes the records ``encode_line`` writes and leaves every
  other one (no leading id, orjson's refusals, a duplicate id, anything not a dict) to the
  Python loop, which decides as it always did.
- Reading: ``_exact.decode_lines`` decodes a chunk's fast lines and leaves the others (exact
  lines, damaged ones, lines with a key twice in one object, lines longer than the manifest
  allows, lines across chunks) to the Python loop.

Each comparison runs the same input both ways, at chunk sizes from one byte up, and compares
the chunks, the summary, the records and the error raised.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import random
import tracemalloc
from typing import Any

import pytest

from gymckpt import errors
from gymckpt.errors import NotJSONError
from gymckpt.store import codec
from gymckpt.store.codec import InvalidRecord, encode_record
from gymckpt.store.encoded import EncodedRecord, EncodedRun, encoded
from gymckpt.store.records import RecordsCheck, RecordsSummary, read_records, write_records
from gymckpt.testing.values import assert_identical, sample_records

from .test_records_chunks import ChunkSink

try:
    from gymckpt.store import _exact  # type: ignore[attr-defined]
except ImportError:  # not built here (no C compiler): only the Python loop is there to test
    _exact = None

needs_accelerator = pytest.mark.skipif(_exact is None, reason="gymckpt.store._exact is not built (no C compiler)")

if _exact is not None:  # configured here too: with GYMCKPT_PURE_PYTHON=1 the codec leaves it alone
    _exact.configure_encoder(codec.orjson.dumps, codec._refuse, codec._LINE_OPTIONS)
    _exact.configure_encoded(EncodedRecord, EncodedRun)
    _exact.configure_decoder(codec.orjson.loads)


def _write(records: list[Any], chunk_size: int, *, c_loop: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    """(summary, chunk sizes, file bytes) of write_records with one loop, or the error it raised."""
    with monkeypatch.context() as patch:
        patch.setattr(codec, "_append_lines", _exact.append_lines if c_loop else None)
        patch.setattr(codec, "_encode_line", _exact.encode_line if c_loop else None)
        sink = _KeepingSink()
        try:
            summary = write_records(sink, iter(records), chunk_size=chunk_size)
        except (InvalidRecord, NotJSONError) as exc:
            return type(exc), str(exc), sink.sizes
        return summary, sink.sizes, b"".join(sink.kept)


class _KeepingSink(ChunkSink):
    """A ChunkSink that also keeps a copy of every chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[bytes] = []

    def write(self, chunk: bytes | memoryview) -> None:
        super().write(chunk)
        self.kept.append(bytes(chunk))


def _mixed(count: int) -> list[Any]:
    """Fast records, exact ones (NaN, big ints, deep nesting), pre-encoded ones and runs of them, interleaved."""
    records: list[Any] = sample_records(count, payload=150)
    for index in range(2, count, 4):
        records[index] = encoded(records[index])
    for start in range(5, count - 8, 16):  # runs of one to five lines, whatever each line's path
        size = 1 + start % 5
        records[start : start + size] = [_run(*records[start : start + size])]
    return records


def _run(*records: Any) -> EncodedRun:
    """The run a worker would send for ``records`` (dicts or pre-encoded ones)."""
    pairs = [record if isinstance(record, EncodedRecord) else encoded(record) for record in records]
    return EncodedRun([pair.episode_id for pair in pairs], b"".join(pair.line for pair in pairs))


def _bytes_of(record: Any) -> bytes:
    if isinstance(record, EncodedRun):
        return record.lines
    return record.line if isinstance(record, EncodedRecord) else encode_record(record)[1]


@needs_accelerator
@pytest.mark.parametrize("chunk_size", [1, 97, 700, 4096, 1 << 20])
def test_both_loops_write_the_same_chunks_and_summary(chunk_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    records = _mixed(90)
    with_c = _write(records, chunk_size, c_loop=True, monkeypatch=monkeypatch)
    with_python = _write(records, chunk_size, c_loop=False, monkeypatch=monkeypatch)
    assert isinstance(with_c[0], RecordsSummary), with_c
    assert with_c == with_python
    summary, sizes, data = with_c
    assert any(isinstance(record, EncodedRun) for record in records)
    assert data == b"".join(map(_bytes_of, records))
    assert summary.episode_ids == [f"r{index}" for index in range(90)]
    assert summary.count == 90 and summary.size == len(data) == sum(sizes)
    assert summary.max_record_bytes == max(map(len, data.splitlines(keepends=True)))


BAD_SEQUENCES = {
    "duplicate": lambda rs: [rs[0], rs[1], rs[0]],
    "duplicate_encoded": lambda rs: [rs[0], rs[1], encoded(rs[1])],
    "encoded_then_duplicate": lambda rs: [encoded(rs[0]), rs[2], rs[0]],
    "none_record": lambda rs: [rs[0], None, rs[1]],
    "list_record": lambda rs: [rs[0], ["episode_id", "x"], rs[1]],
    "id_not_first": lambda rs: [rs[0], {"v": 1, "episode_id": "late"}],
    "empty_id": lambda rs: [rs[0], {"episode_id": ""}],
    "tuple_value": lambda rs: [rs[0], rs[1], {"episode_id": "t", "v": (1, 2)}],
    "set_value": lambda rs: [rs[0], {"episode_id": "s", "v": {1}}],
    "encoded_other_id": lambda rs: [encoded(rs[0]), EncodedRecord("r9", encoded(rs[1]).line)],
    "encoded_id_prefix": lambda rs: [EncodedRecord("r", encoded(rs[1]).line)],
    "encoded_two_lines": lambda rs: [rs[0], EncodedRecord("r1", encoded(rs[1]).line + b"{}\n")],
    "encoded_no_newline": lambda rs: [rs[0], EncodedRecord("r1", encoded(rs[1]).line[:-1])],
    "encoded_bytearray": lambda rs: [rs[0], EncodedRecord("r1", bytearray(encoded(rs[1]).line))],
    "encoded_id_not_str": lambda rs: [rs[0], EncodedRecord(1, encoded(rs[1]).line)],  # type: ignore[arg-type]
    "encoded_empty_line": lambda rs: [rs[0], EncodedRecord("r1", b"")],
    "encoded_no_id": lambda rs: [rs[0], EncodedRecord("r1", b'{"v":1}\n')],
    "run_other_id": lambda rs: [rs[0], EncodedRun(["r1", "r9"], _run(rs[1], rs[2]).lines)],
    "run_fewer_lines": lambda rs: [rs[0], EncodedRun(["r1", "r2"], _run(rs[1]).lines)],
    "run_more_lines": lambda rs: [rs[0], EncodedRun(["r1"], _run(rs[1], rs[2]).lines)],
    "run_no_newline": lambda rs: [rs[0], EncodedRun(["r1"], _run(rs[1]).lines[:-1])],
    "run_twice_inside": lambda rs: [rs[0], _run(rs[1], rs[2], rs[1])],
    "run_seen_before": lambda rs: [rs[0], rs[2], _run(rs[1], rs[2])],
    "run_then_duplicate": lambda rs: [_run(rs[0], rs[1]), rs[1]],
    "run_ids_tuple": lambda rs: [rs[0], EncodedRun(("r1",), _run(rs[1]).lines)],  # type: ignore[arg-type]
    "run_bytearray": lambda rs: [rs[0], EncodedRun(["r1"], bytearray(_run(rs[1]).lines))],  # type: ignore[arg-type]
    "run_id_not_str": lambda rs: [rs[0], EncodedRun([1], _run(rs[1]).lines)],  # type: ignore[list-item]
    "run_no_id": lambda rs: [rs[0], EncodedRun(["r1"], b'{"v":1}\n')],
}


@needs_accelerator
@pytest.mark.parametrize("name", sorted(BAD_SEQUENCES))
@pytest.mark.parametrize("chunk_size", [1, 4096])
def test_both_loops_refuse_the_same_record_with_the_same_error(
    name: str, chunk_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = BAD_SEQUENCES[name](sample_records(4, payload=40))
    with_c = _write(records, chunk_size, c_loop=True, monkeypatch=monkeypatch)
    with_python = _write(records, chunk_size, c_loop=False, monkeypatch=monkeypatch)
    assert with_c[0] in (InvalidRecord, NotJSONError), with_c
    assert with_c == with_python


def _fast(count: int, start: int = 0) -> list[dict[str, Any]]:
    return [{"episode_id": f"e{index}", "tokens": [index, index + 1], "text": "é"} for index in range(start, count)]


@needs_accelerator
def test_append_lines_stops_at_its_target_and_says_when_the_records_ended() -> None:
    records = _fast(5)
    lines = [encode_record(record)[1] for record in records]
    pending = iter(records)
    batch, seen, ids = bytearray(), set(), []
    filled, ended, left = _exact.append_lines(pending, batch, 0, len(lines[0]) + 1, seen, ids)
    assert (filled, ended, left) == (len(lines[0]) + len(lines[1]), False, None)  # the line that passed the target
    assert bytes(batch[:filled]) == lines[0] + lines[1]
    filled, ended, left = _exact.append_lines(pending, batch, filled, 1 << 20, seen, ids)
    assert (filled, ended, left) == (sum(map(len, lines)), True, None)
    assert bytes(batch[:filled]) == b"".join(lines)
    assert ids == ["e0", "e1", "e2", "e3", "e4"] and seen == set(ids)
    assert _exact.append_lines(pending, batch, filled, 1 << 20, seen, ids) == (filled, True, None)


@needs_accelerator
@pytest.mark.parametrize(
    "left",
    [None, 7, {"episode_id": "big", "v": 2**70}, {"v": 1, "episode_id": "late"}, {"episode_id": "e1"}],
    ids=["none", "int", "big_int", "id_not_first", "duplicate"],
)
def test_append_lines_leaves_a_record_to_python_with_nothing_of_it_written(left: Any) -> None:
    before = _fast(2)
    pending = iter([*before, left, *_fast(4, start=2)])
    batch, seen, ids = bytearray(), set(), []
    filled, ended, returned = _exact.append_lines(pending, batch, 0, 1 << 20, seen, ids)
    assert not ended and returned is left
    assert filled == sum(len(encode_record(record)[1]) for record in before)
    assert ids == ["e0", "e1"] and seen == {"e0", "e1"}
    # the next call goes on after it
    filled, ended, returned = _exact.append_lines(pending, batch, filled, 1 << 20, seen, ids)
    assert ended and returned is None and ids == ["e0", "e1", "e2", "e3"]


#: pre-encoded records whose lines the Python loop accepts: orjson's, an exact one, ids with escapes
ENCODED_ACCEPTED = {
    "plain": {"episode_id": "e-1", "v": [1, 2]},
    "non_ascii_id": {"episode_id": "é-ü", "v": 1},
    "quote_in_id": {"episode_id": 'a"b', "v": 1},
    "backslash_in_id": {"episode_id": "a\\b", "v": 1},
    "control_in_id": {"episode_id": "a\u0001b", "v": 1},
    "exact_line": {"episode_id": "nan", "v": float("nan")},
}


@needs_accelerator
@pytest.mark.parametrize("name", sorted(ENCODED_ACCEPTED))
def test_both_loops_write_a_pre_encoded_line_as_it_is(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    record = encoded(ENCODED_ACCEPTED[name])
    records = [{"episode_id": "first"}, record, encoded({"episode_id": "last"})]
    with_c = _write(records, 4096, c_loop=True, monkeypatch=monkeypatch)
    assert with_c == _write(records, 4096, c_loop=False, monkeypatch=monkeypatch)
    summary, _, data = with_c
    assert data.splitlines(keepends=True)[1] == record.line
    assert summary.episode_ids == ["first", record.episode_id, "last"]


@needs_accelerator
@pytest.mark.parametrize("name", sorted(ENCODED_ACCEPTED))
def test_both_loops_write_a_run_of_pre_encoded_lines_as_it_is(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run({"episode_id": "before"}, ENCODED_ACCEPTED[name], {"episode_id": "after"})
    records = [{"episode_id": "first"}, run, EncodedRun([], b""), encoded({"episode_id": "last"})]
    with_c = _write(records, 4096, c_loop=True, monkeypatch=monkeypatch)
    assert with_c == _write(records, 4096, c_loop=False, monkeypatch=monkeypatch)
    summary, _, data = with_c
    assert data.splitlines(keepends=True)[1:4] == run.lines.splitlines(keepends=True)
    assert summary.episode_ids == ["first", "before", ENCODED_ACCEPTED[name]["episode_id"], "after", "last"]


@needs_accelerator
def test_append_lines_copies_a_run_at_once_and_leaves_a_bad_one_with_nothing_of_it_taken() -> None:
    good = _run(*_fast(3))
    bad = _run(*_fast(5, start=3), {"episode_id": "e3"})  # e3 twice in one run
    pending = iter([good, bad, encoded({"episode_id": "after"})])
    batch, seen, ids = bytearray(), set(), []
    filled, ended, left, longest = _exact.append_lines(pending, batch, 0, 1 << 20, seen, ids, 0)
    assert not ended and left is bad
    assert bytes(batch[:filled]) == good.lines and ids == ["e0", "e1", "e2"] and seen == set(ids)
    assert longest == max(map(len, good.lines.splitlines(keepends=True)))
    filled, ended, left = _exact.append_lines(pending, batch, filled, 1 << 20, seen, ids)
    assert ended and left is None and ids == ["e0", "e1", "e2", "after"]


@needs_accelerator
def test_append_lines_takes_pre_encoded_lines_itself_and_leaves_escaped_ids_to_python() -> None:
    plain = [encoded(record) for record in _fast(3)]
    escaped = encoded({"episode_id": 'q"uote', "v": 1})
    pending = iter([*plain, escaped, encoded({"episode_id": "after"})])
    batch, seen, ids = bytearray(), set(), []
    filled, ended, left = _exact.append_lines(pending, batch, 0, 1 << 20, seen, ids)
    assert not ended and left is escaped  # an id orjson escapes: the Python code reads its token
    assert bytes(batch[:filled]) == b"".join(record.line for record in plain)
    assert ids == ["e0", "e1", "e2"] and seen == {"e0", "e1", "e2"}


@needs_accelerator
def test_append_lines_writes_nan_and_infinities_itself_and_reuses_a_larger_buffer() -> None:
    record = {"episode_id": "n", "v": [float("nan"), float("inf"), -0.0]}
    batch = bytearray(b"#" * 500)
    filled, ended, left = _exact.append_lines(iter([record]), batch, 3, 1 << 20, set(), [])
    line = encode_record(record)[1]
    assert (filled, ended, left) == (3 + len(line), True, None)
    assert len(batch) == 500, "a buffer the line fits in keeps its size"
    assert bytes(batch[3:filled]) == line and batch[:3] == b"###"


@needs_accelerator
def test_append_lines_refuses_arguments_of_the_wrong_types() -> None:
    good = (iter([]), bytearray(), 0, 10, set(), [])
    for index, wrong in itertools.product(range(6), ([], b"x", "1", 1.0)):
        arguments = list(good)
        arguments[index] = wrong
        if type(wrong) is type(good[index]):
            continue
        with pytest.raises(TypeError, match="append_lines"):
            _exact.append_lines(*arguments)
    with pytest.raises(ValueError, match="outside the batch"):
        _exact.append_lines(iter([]), bytearray(4), 5, 10, set(), [])


@needs_accelerator
def test_an_error_raised_by_the_records_iterator_comes_through() -> None:
    def records() -> Any:
        yield from _fast(2)
        raise RuntimeError("the source failed")

    ids: list[str] = []
    with pytest.raises(RuntimeError, match="the source failed"):
        _exact.append_lines(records(), bytearray(), 0, 1 << 20, set(), ids)
    assert ids == ["e0", "e1"]


# --- reading


def _check(data: bytes, count: int, ids: list[str] | None, line_limit: int = 1 << 30) -> RecordsCheck:
    return RecordsCheck(
        path="d/records.jsonl",
        participant="agent/a0",
        manifest_path="d/manifest.json",
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        count=count,
        episode_ids=None if ids is None else tuple(sorted(ids)),
        line_limit=line_limit,
    )


def _read(data: bytes, check: RecordsCheck, chunk_size: int, *, c_loop: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    """(records, progress total) of read_records with one loop, or (error type, message, records before it)."""
    records: list[Any] = []
    progressed: list[int] = []
    with monkeypatch.context() as patch:
        patch.setattr(codec, "_decode_fast_lines", _exact.decode_lines if c_loop else None)
        try:
            for record in read_records(io.BytesIO(data), check, chunk_size=chunk_size, progress=progressed.append):
                records.append(record)
        except errors.InvalidCheckpointState as exc:
            return type(exc), str(exc), records
    return records, sum(progressed)


def _lines_of(records: list[Any]) -> bytes:
    return b"".join(encode_record(record)[1] for record in records)


ESCAPED_IDS = [{"episode_id": 'quote"d', "v": 1}, {"episode_id": "tab\tbed", "v": [2]}, {"episode_id": "é", "v": {}}]


@needs_accelerator
@pytest.mark.parametrize("chunk_size", [1, 5, 97, 700, 4096, 1 << 20])
def test_both_read_loops_give_the_same_records_and_progress(chunk_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    records = [*sample_records(60, payload=120), *ESCAPED_IDS, *sample_records(5, prefix="z")]
    data = _lines_of(records)
    check = _check(data, len(records), [record["episode_id"] for record in records])
    with_c = _read(data, check, chunk_size, c_loop=True, monkeypatch=monkeypatch)
    with_python = _read(data, check, chunk_size, c_loop=False, monkeypatch=monkeypatch)
    assert isinstance(with_c[0], list), with_c
    assert_identical(with_c[0], records)
    assert_identical(with_python[0], records)
    assert with_c[1] == with_python[1] == len(data)


def _damaged(name: str) -> tuple[bytes, int]:
    """(file bytes, lines claimed) of a damaged file; its digest and size are consistent."""
    good = _lines_of(sample_records(6, payload=30))
    lines = good.splitlines(keepends=True)
    if name == "not_json":
        return b"".join([*lines[:3], b'{"episode_id":"bad", not json}\n', *lines[3:]]), 7
    if name == "fast_prefix_but_truncated":
        return b"".join([*lines[:2], lines[2][:40] + b"\n", *lines[3:]]), 6
    if name == "id_not_leading":
        return b"".join([*lines[:4], b'{"v":1,"episode_id":"late"}\n', *lines[4:]]), 7
    if name == "no_final_newline":
        return good[:-1], 6
    if name == "empty_line":
        return b"".join([*lines[:1], b"\n", *lines[1:]]), 7
    if name == "two_damaged":
        return b"".join([lines[0], b"{]\n", lines[1], b"nope\n", *lines[2:]]), 8
    if name == "key_twice":
        return b"".join([*lines[:2], b'{"episode_id":"twice","k":1,"k":2}\n', *lines[2:]]), 7
    if name == "key_twice_nested":
        return b"".join([*lines[:5], b'{"episode_id":"twice","l":[{"k":1},{"k":1,"k":1}]}\n', *lines[5:]]), 7
    if name == "line_too_long":  # longer than LINE_LIMIT, within one chunk or across many
        return b"".join([*lines[:3], b'{"episode_id":"long","v":"' + b"x" * 5000 + b'"}\n', *lines[3:]]), 7
    if name == "tail_too_long_without_newline":
        return good + b'{"episode_id":"long","v":"' + b"x" * 5000, 7
    raise AssertionError(name)


DAMAGE = [
    "not_json",
    "fast_prefix_but_truncated",
    "id_not_leading",
    "no_final_newline",
    "empty_line",
    "two_damaged",
    "key_twice",
    "key_twice_nested",
    "line_too_long",
    "tail_too_long_without_newline",
]
#: the line limit the damaged files are read with: each good line fits, the long one does not
LINE_LIMIT = 2000


@needs_accelerator
@pytest.mark.parametrize("name", DAMAGE)
@pytest.mark.parametrize("chunk_size", [1, 64, 1 << 20])
def test_both_read_loops_name_the_same_damaged_line(
    name: str, chunk_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, count = _damaged(name)
    check = _check(data, count, None, LINE_LIMIT)
    with_c = _read(data, check, chunk_size, c_loop=True, monkeypatch=monkeypatch)
    with_python = _read(data, check, chunk_size, c_loop=False, monkeypatch=monkeypatch)
    expected = errors.RecordTooLong if "too_long" in name else errors.RecordUndecodable
    assert with_c[0] is expected, with_c
    assert with_c[:2] == with_python[:2]
    assert_identical(with_c[2], with_python[2])


@needs_accelerator
def test_decode_lines_stops_at_its_limit_and_at_the_last_newline() -> None:
    records = _fast(4)
    data = _lines_of(records)
    first = len(encode_record(records[0])[1])
    ids: list[str] = []
    decoded, position = _exact.decode_lines(data + b'{"episode_id":"par', 0, 1, ids)
    assert (decoded, position, ids) == (records[:1], first, ["e0"])  # the line that passed the limit
    decoded, position = _exact.decode_lines(data + b'{"episode_id":"par', position, 1 << 20, ids)
    assert decoded == records[1:] and position == len(data)  # the unfinished line is left for the next chunk
    assert ids == ["e0", "e1", "e2", "e3"]
    assert _exact.decode_lines(data, len(data), 1 << 20, ids) == ([], len(data))


@needs_accelerator
@pytest.mark.parametrize(
    "left",
    [
        b'{"episode_id": "x","v": NaN}\n',
        b'{"episode_id":"q\\"x","v":1}\n',
        b'{"episode_id":"x", broken\n',
        b"\n",
        b'{"v":1,"episode_id":"x"}\n',
    ],
    ids=["exact", "escaped_id", "damaged", "empty", "id_not_leading"],
)
def test_decode_lines_leaves_a_line_it_does_not_read_fast_where_it_starts(left: bytes) -> None:
    before = _lines_of(_fast(2))
    ids: list[str] = []
    decoded, position = _exact.decode_lines(before + left + _lines_of(_fast(3, start=2)), 0, 1 << 20, ids)
    assert decoded == _fast(2) and position == len(before) and ids == ["e0", "e1"]


@needs_accelerator
def test_decode_lines_leaves_a_line_longer_than_its_line_limit_where_it_starts() -> None:
    lines = [encode_record(record)[1] for record in _fast(4)]
    data = b"".join(lines)
    ids: list[str] = []
    decoded, position = _exact.decode_lines(data, 0, 1 << 20, ids, len(lines[0]))  # newline included: it fits
    assert decoded == _fast(4) and position == len(data)
    ids = []
    decoded, position = _exact.decode_lines(data, 0, 1 << 20, ids, len(lines[0]) - 1)
    assert (decoded, position, ids) == ([], 0, [])
    with pytest.raises(ValueError, match="line_limit is negative"):
        _exact.decode_lines(data, 0, 1 << 20, ids, -1)


@needs_accelerator
@pytest.mark.parametrize(
    "line",
    [
        b'{"episode_id":"x","a":1,"a":1}',
        b'{"episode_id":"x","episode_id":"x"}',
        b'{"episode_id":"x","o":{"a":{"b":1,"b":1}}}',
        b'{"episode_id":"x","l":[{"a":1},{"a":1,"a":2}]}',
        b'{"episode_id":"x","s":"\\\\\\":{","a":1,"a":2}',
    ],
)
def test_decode_line_leaves_a_line_with_a_key_twice_to_python(line: bytes) -> None:
    assert _exact.decode_line(line) is None
    assert _exact.decode_lines(line + b"\n", 0, 1 << 20, []) == ([], 0)
    with pytest.raises(errors.RecordUndecodable, match="twice"):
        codec.decode_line_and_id(line)


@needs_accelerator
@pytest.mark.parametrize(
    "line",
    [
        b'{"episode_id":"x","s":"a:b,{c}\\":\\\\","t":{":":"{"}}',
        b'{"episode_id":"x","l":[{"a":1},{"a":1}],"o":{"a":{"a":{}}}}',
        b'{"episode_id":"x","e":{},"f":[[],{}]}',
    ],
)
def test_decode_line_reads_lines_whose_keys_only_look_repeated(line: bytes) -> None:
    assert _exact.decode_line(line) == ("x", json.loads(line))


def _random_line(rng: random.Random, serial: int) -> bytes:
    """A records line whose objects may hold a key twice at any depth, with strings full of what the
    scan must see through: quotes, runs of backslashes, colons and braces, multibyte characters."""
    alphabet = ['"', "\\", "\\\\", ":", "{", "}", "[", "]", ",", "a", "é", "🙂", " ", "\n"]

    def text() -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.choice([0, 1, 2, 7, 30, 70, 130])))

    def value(depth: int) -> str:
        roll = rng.random()
        if depth > 4 or roll < 0.35:
            return rng.choice([json.dumps(text(), ensure_ascii=False), "1", "2.5", "null", "true", "-7"])
        if roll < 0.6:
            return "[" + ",".join(value(depth + 1) for _ in range(rng.randrange(5))) + "]"
        keys = [text() if rng.random() < 0.7 else "k" for _ in range(rng.randrange(6))]
        return "{" + ",".join(json.dumps(key, ensure_ascii=False) + ":" + value(depth + 1) for key in keys) + "}"

    members = [f'"episode_id":"e{serial}"'] + [
        json.dumps(text(), ensure_ascii=False) + ":" + value(0) for _ in range(rng.randrange(5))
    ]
    return ("{" + ",".join(members) + "}").encode()


def _holds_a_key_twice(line: bytes) -> bool:
    found = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        if len({key for key, _ in items}) != len(items):
            found.append(True)
        return dict(items)

    json.loads(line, object_pairs_hook=pairs)
    return bool(found)


@needs_accelerator
def test_the_c_key_check_never_accepts_a_key_twice_and_the_codec_decides_every_line_exactly() -> None:
    """Seeded random lines: the C loop may leave a line to Python (a list with dicts between scalars), never
    accept one with a key twice; decode_line_and_id (C, then Python) refuses exactly those."""
    rng = random.Random(20260412)
    twice = 0
    for serial in range(4000):
        line = _random_line(rng, serial)
        repeated = _holds_a_key_twice(line)
        twice += repeated
        if repeated:
            assert _exact.decode_line(line) is None, line
            with pytest.raises(errors.RecordUndecodable, match="twice"):
                codec.decode_line_and_id(line)
        else:
            assert codec.decode_line_and_id(line) == (f"e{serial}", json.loads(line))
    assert 1000 < twice < 3000, twice  # both kinds were tried


@needs_accelerator
def test_append_lines_reports_the_longest_line_when_asked() -> None:
    records = [*_fast(3), {"episode_id": "long", "v": "y" * 300}, *_fast(6, start=3)]
    lengths = [len(encode_record(record)[1]) for record in records]
    batch, seen, ids = bytearray(), set(), []
    assert _exact.append_lines(iter(records), batch, 0, 1 << 20, seen, ids, 7) == (
        sum(lengths),
        True,
        None,
        max(lengths),
    )
    assert _exact.append_lines(iter(_fast(2)), bytearray(), 0, 1 << 20, set(), [], 10_000)[3] == 10_000


@needs_accelerator
def test_decode_lines_refuses_arguments_of_the_wrong_types() -> None:
    for arguments in ((bytearray(b"x\n"), 0, 1, []), (b"x", "0", 1, []), (b"x", 0, 1, ()), (b"x", 0, 1.0, [])):
        with pytest.raises(TypeError, match="decode_lines"):
            _exact.decode_lines(*arguments)
    for start, limit in ((3, 1), (-1, 1), (0, -1)):
        with pytest.raises(ValueError, match="outside the chunk"):
            _exact.decode_lines(b"ab", start, limit, [])
    with pytest.raises(TypeError, match="decode_lines"):
        _exact.decode_lines(b"x", 0, 1, [], 1.0)


def test_an_encoded_line_takes_its_own_length_in_memory_however_long_it_is_kept() -> None:
    record = {"episode_id": "e1", "text": "x" * 3000}
    tracemalloc.start()
    try:
        kept = [encoded(record) for _ in range(50)]
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    length = len(kept[0].line)
    assert kept[0].line == encode_record(record)[1]
    # orjson's own output of this record keeps a buffer of about twelve times its length
    assert held < 50 * (length + 256), (held, length)


@needs_accelerator
def test_note_run_takes_a_written_run_s_ids_and_leaves_a_bad_one_with_nothing_changed() -> None:
    good = _run(*_fast(3))
    seen, ids = {"before"}, ["before"]
    longest = _exact.note_run(good, seen, ids, 5)
    assert longest == max(map(len, good.lines.splitlines(keepends=True)))
    assert ids == ["before", "e0", "e1", "e2"] and seen == set(ids)
    for bad in (_run(*_fast(5, start=3), {"episode_id": "e3"}), _run({"episode_id": "e0"}), EncodedRun(["x"], b"")):
        assert _exact.note_run(bad, seen, ids, 0) is None
        assert ids == ["before", "e0", "e1", "e2"] and seen == set(ids)
