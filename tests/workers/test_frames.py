"""Frames: a 4-byte big-endian length and an exact JSON body, whole or not at all, never over the limit."""

from __future__ import annotations

import asyncio
import datetime
import enum
import socket
import struct

import orjson
import pytest

from gymckpt.testing.time import bounded, drain
from gymckpt.workers import frames
from gymckpt.workers.frames import (
    BLOB_KEY,
    BLOB_MARK,
    MAX_DEPTH,
    MAX_FRAME_BYTES,
    ChannelClosed,
    FrameError,
    FrameTooLarge,
    decode_body,
    encode_body,
    encode_frame,
    read_frame,
    write_frame,
)


def _nested(depth: int) -> list[object]:
    value: list[object] = ["bottom"]
    for _ in range(depth - 1):
        value = [value]
    return value


def _record_lines(count: int) -> list[str]:
    return [
        orjson.dumps({"episode_id": f"r{index}-a0", "text": 'héllo 🙂 "quoted"', "tokens": [1, 2, 3]}).decode()
        for index in range(count)
    ]


TRICKY = {
    "nan": float("nan"),
    "infinities": [float("inf"), float("-inf")],
    "negative zero": -0.0,
    "2**70": 2**70,
    "-2**70": -(2**70),
    "64-bit edges": [2**64 - 1, -(2**63), 2**63],
    "a 4000-digit integer": 10**3999,
    "lone high surrogate": "\ud800",
    "lone low surrogate": {"key \udfff": "x\udfffy"},
    "non-ASCII": {"é": "中文 🙂 ümlaut", "emoji": "🙂"},
    "deep nesting (beyond orjson)": _nested(400),
    "deepest allowed": _nested(MAX_DEPTH),
    "mixed": {"a": [float("nan"), 2**70, "x", None, True, False, 1.5], "b": {"c": {}, "d": []}},
    "empty string": "",
    "records as lines": {"records": _record_lines(50), "unclaimed": []},
}


def _reader_with(data: bytes, *, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


@pytest.mark.parametrize("value", TRICKY.values(), ids=TRICKY.keys())
def test_a_body_gives_back_exactly_what_went_in(value: object) -> None:
    decoded = decode_body(encode_body(value))
    assert repr(decoded) == repr(value)  # repr tells NaN, -0.0 and every digit apart


@pytest.mark.parametrize("value", TRICKY.values(), ids=TRICKY.keys())
async def test_a_frame_read_from_a_stream_gives_back_exactly_what_went_in(value: object) -> None:
    reader = _reader_with(encode_frame(value))
    assert repr(await bounded(read_frame(reader))) == repr(value)


def test_record_lines_take_orjson_and_only_values_it_would_change_take_the_marked_exact_path() -> None:
    lines = {"records": _record_lines(20)}
    assert encode_body(lines) == orjson.dumps(lines)
    for value in (float("nan"), [1, float("inf")], 2**70, "\ud800", _nested(300)):
        body = encode_body(value)
        assert body[:1] == b" ", value
        assert body.isascii()
    assert encode_body((1, [2, (3,)])) == b"[1,[2,[3]]]"  # tuples are arrays


def test_the_frame_is_a_big_endian_length_then_the_body() -> None:
    frame = encode_frame({"id": 1})
    assert frame == struct.pack(">I", len(b'{"id":1}')) + b'{"id":1}'


async def test_many_frames_in_one_write_are_read_one_by_one_then_a_clean_end() -> None:
    values = [{"id": index, "body": "x" * index} for index in range(20)]
    reader = _reader_with(b"".join(encode_frame(value) for value in values))
    assert [await bounded(read_frame(reader)) for _ in values] == values
    with pytest.raises(ChannelClosed) as ended:
        await bounded(read_frame(reader))
    assert ended.value.partial is False


async def test_a_frame_that_arrives_byte_by_byte_is_read_only_once_whole() -> None:
    value = {"kind": "claim", "body": {"key": "r1-a0", "n": 2**70}}
    frame = encode_frame(value)
    reader = asyncio.StreamReader()
    reading = asyncio.create_task(read_frame(reader))
    for byte in frame[:-1]:
        reader.feed_data(bytes([byte]))
        await drain(5)
        assert not reading.done()
    reader.feed_data(frame[-1:])
    assert await bounded(reading) == value


@pytest.mark.parametrize(
    "data",
    [b"\x00\x00", struct.pack(">I", 10) + b'{"id"', struct.pack(">I", 10)],
    ids=["inside the length prefix", "inside the body", "right after the length prefix"],
)
async def test_the_stream_ending_inside_a_frame_is_a_partial_channel_closed(data: bytes) -> None:
    with pytest.raises(ChannelClosed) as ended:
        await bounded(read_frame(_reader_with(data)))
    assert ended.value.partial is True
    assert isinstance(ended.value, ConnectionError)


@pytest.mark.parametrize("length", [MAX_FRAME_BYTES + 1, 0xFFFFFFFF])
async def test_a_length_prefix_over_the_limit_is_refused_before_any_body_is_read(length: int) -> None:
    reader = _reader_with(struct.pack(">I", length) + b"after", eof=False)  # no body will ever come
    with pytest.raises(FrameTooLarge):
        await bounded(read_frame(reader))
    assert await bounded(reader.readexactly(5)) == b"after"  # nothing past the prefix was consumed


async def test_the_limit_is_the_largest_body_either_side_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frames, "MAX_FRAME_BYTES", 64)
    largest = "x" * 62  # 64 bytes with its quotes
    frame = encode_frame(largest)
    assert len(frame) == 4 + 64
    assert await bounded(read_frame(_reader_with(frame))) == largest
    with pytest.raises(FrameTooLarge):
        encode_frame(largest + "x")
    with pytest.raises(FrameTooLarge):
        await bounded(read_frame(_reader_with(struct.pack(">I", 65) + b" " * 65)))


async def test_the_sender_refuses_an_oversized_body_and_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frames, "MAX_FRAME_BYTES", 64)
    left, right = socket.socketpair()
    with left, right:
        _, writer = await asyncio.open_unix_connection(sock=left)
        reader, other = await asyncio.open_unix_connection(sock=right)
        with pytest.raises(FrameTooLarge):
            await bounded(write_frame(writer, {"records": ["x" * 100]}))
        await bounded(write_frame(writer, {"small": True}))
        assert await bounded(read_frame(reader)) == {"small": True}  # the refused frame left no bytes behind
        writer.close()
        other.close()


@pytest.mark.parametrize(
    "body",
    [b"", b"{", b"nope", b"\xff\xfe{}", b' {"a": NaN', b" \xff", b"[1,2]]", b" "],
    ids=[
        "empty",
        "truncated",
        "not JSON",
        "not UTF-8",
        "exact truncated",
        "exact not UTF-8",
        "trailing",
        "marker only",
    ],
)
async def test_a_garbage_body_is_a_frame_error(body: bytes) -> None:
    with pytest.raises(FrameError):
        decode_body(body)
    with pytest.raises(FrameError):
        await bounded(read_frame(_reader_with(struct.pack(">I", len(body)) + body)))


class _Color(enum.Enum):
    RED = "red"


def _cycle() -> list[object]:
    value: list[object] = []
    value.append(value)
    return value


@pytest.mark.parametrize(
    "value",
    [
        object(),
        {1, 2},
        b"bytes",
        datetime.datetime(2026, 1, 1),
        _Color.RED,
        {1: "int key"},
        {"nested": {None: 1}},
        "\ud83d\ude42",  # a surrogate pair as two code points reads back as one character
        {"pair \ud83d\ude42": 1},
        _cycle(),
        _nested(MAX_DEPTH + 1),
        10**5000,
    ],
    ids=[
        "object",
        "set",
        "bytes",
        "datetime",
        "enum",
        "int key",
        "None key",
        "surrogate pair",
        "surrogate pair key",
        "cycle",
        "too deep",
        "beyond the digit limit",
    ],
)
def test_a_value_json_would_not_give_back_as_it_is_is_refused_by_the_sender(value: object) -> None:
    with pytest.raises(FrameError):
        encode_frame(value)


async def test_bytes_beside_a_message_arrive_as_they_went_in_its_body() -> None:
    lines = b"".join(line.encode() + b"\n" for line in _record_lines(50))
    message = {"id": 7, "kind": "export_chunk", "body": {"stream": 3, "records": [["r0-a0", None]], "n": 2**70}}
    frame = encode_frame(message, lines)
    assert frame[4:5] == BLOB_MARK
    assert lines in frame  # as they are: no escaping
    got = await bounded(read_frame(_reader_with(frame + encode_frame({"id": 8}))))
    assert got == {**message, "body": {**message["body"], BLOB_KEY: lines}}
    assert type(got["body"][BLOB_KEY]) is bytes
    assert message["body"].keys() == {"stream", "records", "n"}  # the sender's body is left as it was


@pytest.mark.parametrize(
    "message",
    [{"id": 1, "body": [1]}, {"id": 1}, {"id": 1, "body": {"blob": "x"}}, ["not", "a", "message"]],
    ids=["body not an object", "no body", "body holds blob already", "not an object"],
)
def test_bytes_go_only_beside_a_body_object_without_a_blob_member(message: object) -> None:
    with pytest.raises(FrameError, match="body is an object"):
        encode_frame(message, b"x\n")


@pytest.mark.parametrize(
    "body",
    [
        BLOB_MARK + b"\x00\x00",
        BLOB_MARK + struct.pack(">I", 100) + b'{"body":{}}',
        BLOB_MARK + struct.pack(">I", 8) + b'{"id":1}' + b"x",
        BLOB_MARK + struct.pack(">I", 22) + b'{"body":{"blob":true}}',
    ],
    ids=["short length", "length past the frame", "no body object", "body holds blob already"],
)
async def test_a_damaged_blob_frame_is_a_frame_error(body: bytes) -> None:
    with pytest.raises(FrameError):
        await bounded(read_frame(_reader_with(struct.pack(">I", len(body)) + body)))


async def test_a_blob_frame_over_the_limit_is_refused_by_the_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frames, "MAX_FRAME_BYTES", 64)
    message = {"id": 1, "body": {}}
    inner = len(encode_body(message))
    fits = b"x" * (64 - 1 - 4 - inner)
    frame = encode_frame(message, fits)
    assert len(frame) == 4 + 64
    assert (await bounded(read_frame(_reader_with(frame))))["body"][BLOB_KEY] == fits
    with pytest.raises(FrameTooLarge):
        encode_frame(message, fits + b"x")
