"""The S3 backend's request body over a buffer: read in pieces and again after a seek, never copied whole."""

from __future__ import annotations

import io

import pytest

from gymckpt.store._s3_bodies import BufferBody


def test_a_buffer_body_reads_in_pieces_and_again_from_its_start_after_a_seek() -> None:
    data = bytes(range(256)) * 40
    body = BufferBody(bytearray(data))
    assert len(body) == len(data) and body.seekable() and body.readable()
    pieces = []
    while piece := body.read(1000):
        pieces.append(piece)
    assert b"".join(pieces) == data and [len(piece) for piece in pieces[:-1]] == [1000] * (len(pieces) - 1)
    assert body.tell() == len(data) and body.read(10) == b""
    assert body.seek(0) == 0 and body.read() == data  # a retry reads the whole body again
    assert body.seek(-6, io.SEEK_END) == len(data) - 6 and body.read(100) == data[-6:]
    assert body.seek(-10, io.SEEK_CUR) == len(data) - 10 and body.read(4) == data[-10:-6]


def test_a_buffer_body_reads_the_buffer_in_place() -> None:
    """The body is a view: what the request sends is the buffer itself, not a copy taken at the start."""
    buffer = bytearray(b"abcdef")
    body = BufferBody(buffer)
    buffer[0:3] = b"xyz"  # same length: the view stays valid
    assert body.read() == b"xyzdef"


def test_a_negative_seek_or_an_unknown_whence_is_refused() -> None:
    body = BufferBody(b"abc")
    with pytest.raises(ValueError, match="negative"):
        body.seek(-1)
    with pytest.raises(ValueError, match="whence"):
        body.seek(0, 7)
    assert body.tell() == 0


def test_a_body_over_several_buffers_reads_them_back_to_back_across_their_edges() -> None:
    """The chunks a records file was written in, sent as one PUT without being gathered first."""
    pieces = [b"abc", bytearray(b""), memoryview(b"defgh"), bytearray(b"i"), b"jklmnopq"]
    data = b"abcdefghijklmnopq"
    body = BufferBody(pieces)
    assert len(body) == len(data)
    for size in (1, 2, 3, 4, 7, 100):
        body.seek(0)
        read = []
        while piece := body.read(size):
            read.append(piece)
        assert b"".join(read) == data, size
        assert [len(piece) for piece in read[:-1]] == [size] * (len(read) - 1)
    for start in range(len(data) + 1):
        assert body.seek(start) == start and body.read(5) == data[start : start + 5]
    assert body.seek(-4, io.SEEK_END) == len(data) - 4 and body.read() == b"nopq"
    pieces[3][0:1] = b"I"  # read in place: a piece changed (same length) is what is sent
    assert body.seek(0) == 0 and body.read() == b"abcdefghIjklmnopq"


def test_a_body_over_no_buffers_or_empty_ones_is_empty() -> None:
    for pieces in ([], [b"", bytearray()]):
        body = BufferBody(pieces)
        assert len(body) == 0 and body.read(10) == b"" and body.read() == b""
