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
