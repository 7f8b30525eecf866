"""read_spans: the lines a verified read located, read back alone (S4, W2).

A server's coordinator verifies a records file whole (read_lines, which names each line's
span and CRC-32); each worker then reads only its share's lines. A span is checked as a line
and against its CRC-32, never trusted for more.
"""

from __future__ import annotations

import io
import zlib
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt import errors
from gymckpt.store import spans as spans_module
from gymckpt.store.records import RecordsCheck, read_lines
from gymckpt.store.spans import LineSpan, read_spans

from ..support import ALL_BACKENDS
from .test_read_lines import _file as records_file

if TYPE_CHECKING:
    from gymckpt.store.checkpoint_store import CheckpointStore

RECORDS: list[dict[str, Any]] = [
    {"episode_id": f"e{index}", "state": {"text": "x" * (40 * index), "n": index}} for index in range(40)
] + [
    {"episode_id": "b", "state": {"nan": float("nan"), "big": 2**70}},  # an exact line
    {"episode_id": "c\u00e9", "state": ["\n", 'a "quoted" \\ line']},
]


def _file(records: list[dict[str, Any]] = RECORDS) -> tuple[bytes, RecordsCheck]:
    return records_file(records)


def _located(data: bytes, check: RecordsCheck, scope: set[str] | None = None) -> tuple[dict[str, bytes], dict]:
    """The lines read_lines yields (verified whole) and the spans it names."""
    spans: dict[str, LineSpan] = {}
    lines = dict(read_lines(io.BytesIO(data), check, scope=scope, chunk_size=97, spans=spans))
    return lines, spans


class _Forward(io.BytesIO):
    """A stream that cannot seek (an object store's body)."""

    def seekable(self) -> bool:
        return False

    def seek(self, *args: Any) -> int:
        raise AssertionError("a stream that cannot seek was sought")


@pytest.mark.parametrize("stream", [io.BytesIO, _Forward])
@pytest.mark.parametrize(("gap", "most"), [(64 << 10, 1 << 20), (1, 1), (300, 2000)])
def test_the_spans_of_a_verified_read_give_back_its_lines(
    stream: type[io.BytesIO], gap: int, most: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every other line of the scope, read in any order of spans, comes back as read_lines gave it, in file order."""
    monkeypatch.setattr(spans_module, "SPAN_GAP", gap)
    monkeypatch.setattr(spans_module, "SPAN_READ", most)
    data, check = _file()
    scope = {record["episode_id"] for record in RECORDS[::2]} | {"c\u00e9"}
    lines, spans = _located(data, check, scope)
    assert sorted(lines) == sorted(spans) == sorted(scope)
    for episode_id, (offset, length, crc) in spans.items():
        assert data[offset : offset + length] == lines[episode_id] + b"\n"
        assert crc == zlib.crc32(lines[episode_id])
    share = [(episode_id, *spans[episode_id]) for episode_id in sorted(spans, reverse=True)]
    got = list(read_spans(stream(data), check, share))
    assert [episode_id for episode_id, _ in got] == [
        record["episode_id"] for record in RECORDS if record["episode_id"] in scope
    ]
    assert all(type(line) is bytes and line == lines[episode_id] for episode_id, line in got)


def _span(data: bytes, offset: int, length: int, episode_id: str) -> tuple[str, int, int, int]:
    """A span whose CRC-32 is that of the bytes it names (so only the other checks can refuse it)."""
    return episode_id, offset, length, zlib.crc32(data[offset : offset + length - 1])


def _refusals(data: bytes, spans: dict[str, LineSpan]) -> list[Any]:
    a, b = (("e1", *spans["e1"]), ("e2", *spans["e2"]))
    return [
        ("changed since the file was verified", errors.RecordsDigestMismatch, [(*a[:3], a[3] ^ 1)]),
        ("outside the file", errors.RecordUndecodable, [_span(data + b"x" * 99, len(data) - 5, 50, "e1")]),
        ("over the line before", errors.RecordUndecodable, [a, _span(data, a[1] + 3, b[2], "e2")]),
        ("are not one line", errors.RecordUndecodable, [_span(data, a[1], a[2] + b[2], "e1")]),
        ("are not one line", errors.RecordUndecodable, [_span(data, a[1], a[2] - 1, "e1")]),
        ("hold the line of 'e2'", errors.RecordUndecodable, [_span(data, b[1], b[2], "e1")]),
        ("does not start with an episode_id", errors.RecordUndecodable, [_span(data, a[1] + 1, a[2] - 1, "e1")]),
    ]


@pytest.mark.parametrize("case", range(7))
def test_a_span_that_is_not_its_line_as_verified_is_typed_damage_naming_the_file(case: int) -> None:
    data, check = _file()
    _, spans = _located(data, check)
    message, error, share = _refusals(data, spans)[case]
    with pytest.raises(error, match=message) as raised:
        list(read_spans(io.BytesIO(data), check, share))
    assert raised.value.path == "d/records.jsonl" and raised.value.participant == "resources/s0"


def test_a_span_longer_than_the_line_limit_is_refused_before_anything_is_read() -> None:
    data, check = _file()
    _, spans = _located(data, check)
    check.line_limit = spans["e39"][1] - 1

    class _Unread(io.BytesIO):
        def read(self, *args: Any) -> bytes:
            raise AssertionError("read before the spans were checked")

    with pytest.raises(errors.RecordTooLong, match="more than"):
        list(read_spans(_Unread(data), check, [("e39", *spans["e39"])]))


def test_a_file_shorter_than_its_spans_is_typed_damage() -> None:
    data, check = _file()
    _, spans = _located(data, check)
    with pytest.raises(errors.RecordUndecodable, match="the file ends before byte"):
        list(read_spans(_Forward(data[:-10]), check, [("c\u00e9", *spans["c\u00e9"])]))


@pytest.mark.parametrize("storage", ALL_BACKENDS, indirect=True)
def test_a_store_reads_the_spans_its_verified_read_named(store: CheckpointStore) -> None:
    """Through each backend (an S3 body cannot seek): read_lines names the spans of a committed file,
    read_spans reads them back."""
    store.write_participant("ck", kind="resources", instance="r", records=RECORDS, checkpoint_id="ck-1")
    manifest = store.read_manifest("ck", kind="resources", instance="r")
    spans: dict[str, LineSpan] = {}
    lines = dict(store.read_lines(manifest, scope={"e3", "e30", "b"}, spans=spans))
    got = list(store.read_spans(manifest, [(episode_id, *span) for episode_id, span in spans.items()]))
    assert got == [("e3", lines["e3"]), ("e30", lines["e30"]), ("b", lines["b"])]
