"""The channel: requests both ways matched by id, immediate replies first, typed errors, 503 when the peer is gone."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import sys
import textwrap
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.errors import (
    ControlError,
    CoordinatorUnavailable,
    DeadlineExceeded,
    InvalidCheckpointState,
    InvalidRequest,
    StaleAttempt,
    StorageError,
)
from gymckpt.testing.time import bounded, drain
from gymckpt.workers import frames
from gymckpt.workers.channel import Channel
from gymckpt.workers.frames import encode_frame, read_frame, write_frame

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]
TRANSPORTS = pytest.mark.parametrize("transport", ["socketpair", "unix"])


@asynccontextmanager
async def _streams(transport: str, tmp_path: Path) -> AsyncIterator[tuple[Streams, Streams]]:
    """Two connected stream pairs: over ``socket.socketpair`` or a real Unix socket server in ``tmp_path``."""
    server = None
    if transport == "socketpair":
        left, right = socket.socketpair()
        one = await asyncio.open_unix_connection(sock=left)
        other = await asyncio.open_unix_connection(sock=right)
    else:
        accepted: asyncio.Future[Streams] = asyncio.get_running_loop().create_future()
        path = os.fspath(tmp_path / "c.sock")
        server = await asyncio.start_unix_server(lambda reader, writer: accepted.set_result((reader, writer)), path)
        one = await bounded(asyncio.open_unix_connection(path))
        other = await bounded(accepted)
    try:
        yield one, other
    finally:
        for _, writer in (one, other):
            writer.transport.abort()
        if server is not None:
            server.close()
            await server.wait_closed()


@asynccontextmanager
async def _channels(transport: str, tmp_path: Path) -> AsyncIterator[tuple[Channel, Channel]]:
    """Two started channels, ``a`` and ``b``, talking to each other (handlers may be added while they run)."""
    async with _streams(transport, tmp_path) as (one, other):
        a, b = Channel(*one, name="a"), Channel(*other, name="b")
        a.start()
        b.start()
        try:
            yield a, b
        finally:
            await bounded(a.close())
            await bounded(b.close())


async def _ended(reader: asyncio.StreamReader) -> bool:
    """True once the stream ends: an EOF, or a reset (the other side dropped unread data)."""
    try:
        return await reader.read() == b""
    except ConnectionResetError:
        return True


async def _echo(body: Any) -> Any:
    return body


@TRANSPORTS
async def test_requests_go_both_ways_at_once_and_out_of_order_replies_find_their_callers(
    transport: str, tmp_path: Path
) -> None:
    async with _channels(transport, tmp_path) as (a, b):
        gates = {n: asyncio.Event() for n in range(3)}
        started: list[int] = []
        all_started = asyncio.Event()

        async def held(body: dict[str, int]) -> dict[str, Any]:
            started.append(body["n"])
            if len(started) == len(gates):
                all_started.set()
            await gates[body["n"]].wait()
            return {"n": body["n"], "from": "b"}

        b.handle("held", held)
        a.handle("echo", _echo)
        calls = [asyncio.create_task(a.request("held", {"n": n}, timeout=10)) for n in gates]
        from_b = [asyncio.create_task(b.request("echo", {"m": m, "big": 2**70}, timeout=10)) for m in range(5)]
        assert [await bounded(call) for call in from_b] == [{"m": m, "big": 2**70} for m in range(5)]
        await bounded(all_started.wait())
        for n in reversed(gates):  # release the last first: its reply comes back first
            gates[n].set()
            assert await bounded(calls[n]) == {"n": n, "from": "b"}
            assert all(not call.done() for call in calls[:n])


async def test_an_immediate_reply_precedes_everything_this_side_sends_after_it_even_with_its_writes_stuck(
    tmp_path: Path,
) -> None:
    async with _streams("socketpair", tmp_path) as ((a_reader, a_writer), (peer_reader, peer_writer)):
        a = Channel(a_reader, a_writer, name="peer")
        claimed = asyncio.Event()

        def claim(body: dict[str, str]) -> dict[str, str]:
            claimed.set()
            return {"record": f"record of {body['key']}"}

        a.handle_immediately("claim", claim)
        a.start()
        # the peer reads nothing yet: a bulk frame fills the buffers and holds a's write lock in drain
        bulk = asyncio.create_task(a.request("bulk", {"data": "x" * (8 << 20)}, timeout=10))
        await drain()
        assert a_writer.transport.get_write_buffer_size() > 0
        queued = asyncio.create_task(a.request("queued", {}, timeout=10))  # waits for the write lock
        await drain()
        await bounded(write_frame(peer_writer, {"id": 7, "kind": "claim", "body": {"key": "r1-a0"}}))
        await bounded(claimed.wait())
        after = asyncio.create_task(a.request("after", {}, timeout=10))  # sent once the claim was answered
        await drain()
        seen = []
        for _ in range(4):
            message = await bounded(read_frame(peer_reader))
            seen.append(message.get("kind") or ("reply", message["reply_to"], message["body"]))
        assert seen == ["bulk", ("reply", 7, {"record": "record of r1-a0"}), "queued", "after"]
        for request_id in (1, 2, 3):
            await bounded(write_frame(peer_writer, {"reply_to": request_id, "ok": True, "body": request_id}))
        assert [await bounded(call) for call in (bulk, queued, after)] == [1, 2, 3]
        await bounded(a.close())


async def test_an_ordinary_handler_that_waits_replies_after_what_was_sent_meanwhile(tmp_path: Path) -> None:
    """The contrast to the immediate handler: only it is guaranteed to answer first."""
    async with _streams("socketpair", tmp_path) as ((a_reader, a_writer), (peer_reader, peer_writer)):
        a = Channel(a_reader, a_writer, name="peer")
        entered, release = asyncio.Event(), asyncio.Event()

        async def claim(body: Any) -> str:
            entered.set()
            await release.wait()
            return "late"

        a.handle("claim", claim)
        a.start()
        await bounded(write_frame(peer_writer, {"id": 1, "kind": "claim", "body": {}}))
        await bounded(entered.wait())
        after = asyncio.create_task(a.request("after", {}, timeout=10))
        assert (await bounded(read_frame(peer_reader)))["kind"] == "after"
        release.set()
        assert await bounded(read_frame(peer_reader)) == {"reply_to": 1, "ok": True, "body": "late"}
        after.cancel()
        await bounded(a.close())


def _refuse_at_once(body: Any) -> None:
    raise StaleAttempt("retired, at once")


@TRANSPORTS
async def test_errors_arrive_as_their_class_with_their_status_code_and_detail(
    transport: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def raises(body: dict[str, str]) -> None:
        errors = {
            "stale": StaleAttempt("rollout r1 attempt 0 was retired"),
            "deadline": DeadlineExceeded("the commit's deadline passed"),
            "unavailable": CoordinatorUnavailable("no coordinator"),
            "storage": StorageError("disk full", path="/x"),
            "bug": RuntimeError("a bug in the handler"),
        }
        raise errors[body["which"]]

    async with _channels(transport, tmp_path) as (a, b):
        b.handle("raise", raises)
        b.handle_immediately("raise_now", _refuse_at_once)
        with pytest.raises(StaleAttempt) as stale:
            await a.request("raise", {"which": "stale"}, timeout=10)
        assert (type(stale.value), stale.value.status, stale.value.code) == (StaleAttempt, 409, "stale_attempt")
        assert str(stale.value) == "rollout r1 attempt 0 was retired"
        with pytest.raises(StaleAttempt, match="retired, at once"):
            await a.request("raise_now", {}, timeout=10)
        with pytest.raises(DeadlineExceeded) as deadline:  # a TimeoutError, yet not taken for the call's own timeout
            await a.request("raise", {"which": "deadline"}, timeout=10)
        assert deadline.value.status == 409
        with pytest.raises(CoordinatorUnavailable) as unavailable:
            await a.request("raise", {"which": "unavailable"}, timeout=10)
        assert (unavailable.value.status, str(unavailable.value)) == (503, "no coordinator")
        with pytest.raises(StorageError) as storage:
            await a.request("raise", {"which": "storage"}, timeout=10)
        assert (storage.value.status, storage.value.code, str(storage.value)) == (503, "storage_error", "disk full")
        with caplog.at_level(logging.ERROR, logger="gymckpt.workers.channel"), pytest.raises(ControlError) as bug:
            await a.request("raise", {"which": "bug"}, timeout=10)
        assert (type(bug.value), bug.value.status, bug.value.code) == (ControlError, 500, "checkpoint_error")
        assert "RuntimeError: a bug in the handler" in str(bug.value)
        assert any(record.exc_info and isinstance(record.exc_info[1], RuntimeError) for record in caplog.records)


@TRANSPORTS
async def test_a_reply_that_cannot_be_framed_arrives_as_422_invalid_checkpoint_state(
    transport: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def unframeable(body: dict[str, str]) -> Any:
        return {"not json": object()} if body["why"] == "type" else {"records": ["x" * 4096]}

    async with _channels(transport, tmp_path) as (a, b):
        b.handle("export", unframeable)
        b.handle("echo", _echo)
        b.handle_immediately("claim", lambda body: {1: "an int key"})
        for kind, why in (("export", "type"), ("claim", "type")):
            with pytest.raises(InvalidCheckpointState) as refused:
                await a.request(kind, {"why": why}, timeout=10)
            assert (refused.value.status, refused.value.code) == (422, "invalid_checkpoint_state")
            assert "cannot be framed" in str(refused.value)
        monkeypatch.setattr(frames, "MAX_FRAME_BYTES", 1024)
        with pytest.raises(InvalidCheckpointState, match="over the limit"):
            await a.request("export", {"why": "size"}, timeout=10)
        assert await a.request("echo", "still connected", timeout=10) == "still connected"
        assert not a.closed.is_set()
        assert not b.closed.is_set()


@TRANSPORTS
async def test_an_unknown_kind_is_refused_with_a_typed_error_and_the_channel_goes_on(
    transport: str, tmp_path: Path
) -> None:
    async with _channels(transport, tmp_path) as (a, b):
        b.handle("echo", _echo)
        with pytest.raises(InvalidRequest, match="no_such_kind") as refused:
            await a.request("no_such_kind", {}, timeout=10)
        assert refused.value.status == 422
        assert await a.request("echo", {"still": "here"}, timeout=10) == {"still": "here"}


async def test_an_error_reply_of_a_code_gymckpt_does_not_know_keeps_its_code_and_status(tmp_path: Path) -> None:
    async with _streams("socketpair", tmp_path) as (one, (peer_reader, peer_writer)):
        a = Channel(*one, name="peer").start()
        call = asyncio.create_task(a.request("op", {}, timeout=10))
        request = await bounded(read_frame(peer_reader))
        error = {"status": 418, "code": "teapot", "detail": "short and stout"}
        await bounded(write_frame(peer_writer, {"reply_to": request["id"], "ok": False, "error": error}))
        with pytest.raises(ControlError) as unknown:
            await bounded(call)
        assert (type(unknown.value), unknown.value.status, unknown.value.code) == (ControlError, 418, "teapot")
        assert str(unknown.value) == "short and stout"
        second = asyncio.create_task(a.request("op", {}, timeout=10))
        request = await bounded(read_frame(peer_reader))
        await bounded(write_frame(peer_writer, {"reply_to": request["id"], "ok": False, "error": "garbage"}))
        with pytest.raises(ControlError) as malformed:
            await bounded(second)
        assert (malformed.value.status, malformed.value.code) == (500, "checkpoint_error")
        await bounded(a.close())


@TRANSPORTS
async def test_a_request_without_a_reply_in_time_is_coordinator_unavailable_and_a_late_reply_is_dropped(
    transport: str, tmp_path: Path
) -> None:
    async with _channels(transport, tmp_path) as (a, b):
        release = asyncio.Event()
        replied = asyncio.Event()

        async def slow(body: Any) -> str:
            await release.wait()
            replied.set()
            return "late"

        b.handle("slow", slow)
        b.handle("echo", _echo)
        with pytest.raises(CoordinatorUnavailable) as unavailable:
            await a.request("slow", {}, timeout=0.05)
        assert (unavailable.value.status, unavailable.value.code) == (503, "checkpoint_coordinator_unavailable")
        assert "no reply to slow" in str(unavailable.value)
        release.set()
        await bounded(replied.wait())
        assert await a.request("echo", "next", timeout=10) == "next"
        assert not a.closed.is_set()


async def test_the_timeout_covers_a_send_the_peer_never_reads(tmp_path: Path) -> None:
    async with _streams("socketpair", tmp_path) as (one, _peer):
        a = Channel(*one, name="peer").start()
        with pytest.raises(CoordinatorUnavailable, match="no reply to bulk"):
            await bounded(a.request("bulk", {"data": "x" * (16 << 20)}, timeout=0.2))
        await bounded(a.close())


@TRANSPORTS
async def test_the_peer_closing_fails_every_pending_request_on_both_sides_and_sets_closed(
    transport: str, tmp_path: Path
) -> None:
    async with _channels(transport, tmp_path) as (a, b):
        never = asyncio.Event()
        entered = {"a": asyncio.Event(), "b": asyncio.Event()}

        def holding(side: str) -> Any:
            async def hold(body: Any) -> None:
                entered[side].set()
                await never.wait()

            return hold

        a.handle("hold", holding("a"))
        b.handle("hold", holding("b"))
        from_a = [asyncio.create_task(a.request("hold", {"n": n}, timeout=None)) for n in range(3)]
        from_b = asyncio.create_task(b.request("hold", {}, timeout=None))
        await bounded(entered["a"].wait())
        await bounded(entered["b"].wait())
        await bounded(b.close())
        for call in (*from_a, from_b):
            with pytest.raises(CoordinatorUnavailable):
                await bounded(call)
        await bounded(a.closed.wait())
        assert b.closed.is_set()
        with pytest.raises(CoordinatorUnavailable, match="cannot send"):
            await a.request("hold", {}, timeout=10)


async def test_a_peer_killed_in_the_middle_of_a_frame_fails_the_pending_requests(tmp_path: Path) -> None:
    path = os.fspath(tmp_path / "k.sock")
    accepted: asyncio.Future[Streams] = asyncio.get_running_loop().create_future()
    server = await asyncio.start_unix_server(lambda reader, writer: accepted.set_result((reader, writer)), path)
    peer = textwrap.dedent(
        """
        import socket, struct, sys, time

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(sys.argv[1])

        def exactly(size):
            data = b""
            while len(data) < size:
                chunk = sock.recv(size - len(data))
                if not chunk:
                    sys.exit(1)
                data += chunk
            return data

        (length,) = struct.unpack(">I", exactly(4))
        exactly(length)  # the request
        sock.sendall(struct.pack(">I", 100) + b'{"reply_to":1,')  # a reply cut short
        print("partial", flush=True)
        time.sleep(120)
        """
    )
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", peer, path, stdout=asyncio.subprocess.PIPE)
    try:
        channel = Channel(*await bounded(accepted), name="worker").start()
        calls = [asyncio.create_task(channel.request("export", {"n": n}, timeout=None)) for n in range(2)]
        assert process.stdout is not None
        assert await bounded(process.stdout.readline()) == b"partial\n"
        process.kill()
        await bounded(process.wait())
        for call in calls:
            with pytest.raises(CoordinatorUnavailable, match="middle of a frame"):
                await bounded(call)
        assert channel.closed.is_set()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    "data",
    [struct.pack(">I", 0xFFFFFFFF), struct.pack(">I", 4) + b"nope", encode_frame([1, 2]), encode_frame({"x": 1})],
    ids=["length over the limit", "garbage body", "not an envelope", "neither request nor reply"],
)
async def test_a_broken_frame_from_the_peer_ends_the_connection(tmp_path: Path, data: bytes) -> None:
    async with _streams("socketpair", tmp_path) as (one, (peer_reader, peer_writer)):
        a = Channel(*one, name="peer").start()
        call = asyncio.create_task(a.request("op", {}, timeout=None))
        await bounded(read_frame(peer_reader))
        peer_writer.write(data)
        with pytest.raises(CoordinatorUnavailable):
            await bounded(call)
        assert a.closed.is_set()
        assert await bounded(_ended(peer_reader))  # a dropped the connection
        await bounded(a.close())


async def test_an_immediate_handler_must_be_a_plain_function(tmp_path: Path) -> None:
    async with _streams("socketpair", tmp_path) as (one, _peer):
        a = Channel(*one)
        with pytest.raises(TypeError):
            a.handle_immediately("claim", _echo)
