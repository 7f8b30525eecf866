"""The bodies of the S3 backend's requests: a GET read as a stream, a PUT sent from a buffer in place.

:class:`ObjectReader` reads one streamed GET in the sizes its caller asks for.
:class:`BufferBody` is the body of a PUT or an uploaded part (one buffer, or the chunks a
records file was written in, back to back): botocore and aiohttp read it in
pieces (its length, the payload's checksums, the send itself) and seek back to its start for
a retry, so the request never holds a second copy of the buffer. Given ``bytes``, aiohttp
would hand the whole body to the socket's transport, which keeps whatever the kernel did not
take at once in a buffer of its own: about one more copy per request in flight.

botocore rewinds a body for its own retries; s3fs retries a call with the same arguments, so
:func:`rewind_bodies` makes every call start its body from the beginning (else the retry
would send, and checksum, what is left after the first attempt: nothing).
"""

from __future__ import annotations

import bisect
import io
import itertools
from typing import TYPE_CHECKING, Any

from fsspec.asyn import sync

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gymckpt.store._s3 import S3Backend

__all__ = ["BufferBody", "ObjectReader", "rewind_bodies"]


class BufferBody(io.RawIOBase):
    """A seekable stream over ``buffer``, or over a sequence of buffers one after another (none
    copied; they must not change while they are read)."""

    def __init__(self, buffer: bytes | bytearray | memoryview | Sequence[bytes | bytearray | memoryview]) -> None:
        super().__init__()
        buffers = [buffer] if isinstance(buffer, (bytes, bytearray, memoryview)) else list(buffer)
        self._pieces = [memoryview(piece).cast("B") for piece in buffers if len(piece)]
        #: where each piece starts in the body
        self._starts = list(itertools.accumulate((len(piece) for piece in self._pieces[:-1]), initial=0))
        self._length = sum(len(piece) for piece in self._pieces)
        self._position = 0

    def __len__(self) -> int:
        return self._length

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            position = offset
        elif whence == io.SEEK_CUR:
            position = self._position + offset
        elif whence == io.SEEK_END:
            position = self._length + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if position < 0:
            raise ValueError(f"negative seek position {position}")
        self._position = position
        return position

    def readinto(self, target: Any) -> int:
        wanted, given = len(target), 0
        while given < wanted and self._position < self._length:
            index = bisect.bisect_right(self._starts, self._position) - 1
            offset = self._position - self._starts[index]
            piece = self._pieces[index][offset : offset + wanted - given]
            target[given : given + len(piece)] = piece
            given += len(piece)
            self._position += len(piece)
        return given


def _rewind(params: dict[str, Any], **_: Any) -> None:
    body = params.get("Body")
    if isinstance(body, BufferBody):
        body.seek(0)


def rewind_bodies(client: Any) -> None:
    """Have every call of ``client`` (an S3 client) read its :class:`BufferBody` from the start (idempotent)."""
    client.meta.events.register("before-parameter-build.s3", _rewind, unique_id="gymckpt-rewind-buffer-bodies")


class ObjectReader(io.RawIOBase):
    """One streamed GET of an S3 object, read in the sizes the caller asks for."""

    def __init__(self, backend: S3Backend, path: str, body: Any) -> None:
        super().__init__()
        self._backend = backend
        self._loop = backend.fs.loop
        self._path = path
        self._body = body

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        if self._body is None:
            raise ValueError("read from a closed stream")
        with self._backend.storage_errors(self._path, "read"):
            return sync(self._loop, self._read, -1 if size is None else size)

    async def _read(self, size: int) -> bytes:
        if size < 0:
            return await self._body.read()
        pieces: list[bytes] = []
        wanted = size
        while wanted > 0:
            piece = await self._body.read(wanted)
            if not piece:
                break
            pieces.append(piece)
            wanted -= len(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        body, self._body = self._body, None
        if body is not None:

            async def close_body() -> None:
                body.close()

            try:
                sync(self._loop, close_body, timeout=5)
            except Exception:
                pass
        super().close()
