"""The request deadlines never cut a legitimate connection (:mod:`gymckpt.stack.request_deadlines`).

A loaded client (a trainer opening thousands of ``/run`` calls at once) may take many seconds
between its connect and its first write; a client's pooled connection idles between its
requests; a call may be served for minutes. None of these is a slow client: with deadlines far
smaller than how long each is held here, each is still served, and what the server does close
on its own it says in its log. Real server processes (``gymckpt serve counter``) on a loopback
socket the test binds; every wait is a bounded socket timeout or a bounded poll, never a sleep
standing in for an event, and nothing asserts how long anything took.
"""

from __future__ import annotations

import logging
import socket
from typing import TYPE_CHECKING

import pytest

from gymckpt.stack.request_deadlines import CONNECTION_BUDGET_ENV, HEADER_TIMEOUT_ENV, _Closings

from ..support import read_reply
from .test_slow_clients import HALF_HEAD, STATUS, WAIT, count_closed, server, server_log, until_closed, wait_for_log

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path


def test_a_client_slow_to_write_its_first_request_is_served(tmp_path: Path) -> None:
    """A connection opened, then silent past the head deadline (its client's loop busy), then a whole request:
    served. (Before the fix, the head's clock ran from the connection opening and the server closed it unanswered.)"""
    with server(tmp_path, {HEADER_TIMEOUT_ENV: "1"}) as address, socket.create_connection(address) as slow:
        slow.settimeout(WAIT)
        with socket.create_connection(address) as other:
            other.sendall(HALF_HEAD)
            # accepted after ``slow`` (the backlog is first in, first out) and cut at the deadline: by now
            # ``slow`` has been open longer than the head deadline without a byte
            assert until_closed(other).startswith(b"HTTP/1.1 408 ")
        slow.sendall(STATUS)
        reply = read_reply(slow)
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:300]
    log = server_log(tmp_path)
    assert "1 request head not complete in time" in log  # ``other``'s cut is told
    assert "sent no byte" not in log


#: a budget the test goes past with silent connections
BUDGET = 4
#: silent connections opened past it
SILENT = 12


def test_shedding_takes_silent_connections_never_an_active_clients_kept_alive_one(tmp_path: Path) -> None:
    """A client's pooled connection, idle between two requests, while silent new connections push the server
    past its budget: the silent ones are shed, oldest first, and the pooled one serves the next request."""
    env = {HEADER_TIMEOUT_ENV: "60", CONNECTION_BUDGET_ENV: str(BUDGET)}
    with server(tmp_path, env) as address, socket.create_connection(address, timeout=WAIT) as kept:
        kept.sendall(STATUS)
        assert read_reply(kept).startswith(b"HTTP/1.1 200 ")
        silent = []
        try:
            for _ in range(SILENT):
                silent.append(socket.create_connection(address, timeout=WAIT))
            # the kept connection and the youngest silent ones stay at the budget
            closed = count_closed(silent, at_least=SILENT + 1 - BUDGET)
            kept.sendall(STATUS)
            reply = read_reply(kept)
        finally:
            for sock in silent:
                sock.close()
    assert closed >= SILENT + 1 - BUDGET
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:300]
    assert "shed at the connection budget (GYMCKPT_CONNECTION_BUDGET)" in server_log(tmp_path)


def test_over_budget_with_nothing_to_shed_the_server_keeps_every_connection_and_says_so(tmp_path: Path) -> None:
    """Every connection but the newcomer is a recently used kept-alive one: none is shed (the server stays over
    its budget), the log says so, and each connection serves its next request."""
    env = {HEADER_TIMEOUT_ENV: "60", CONNECTION_BUDGET_ENV: "2"}
    with server(tmp_path, env) as address:
        kept: list[socket.socket] = []
        try:
            for _ in range(4):  # each opened once the ones before it were used: none is new and silent
                kept.append(socket.create_connection(address, timeout=WAIT))
                kept[-1].sendall(STATUS)
                assert read_reply(kept[-1]).startswith(b"HTTP/1.1 200 ")
            wait_for_log(tmp_path, "NOT closed: over the connection budget")
            replies = []
            for sock in kept:
                sock.sendall(STATUS)
                replies.append(read_reply(sock))
        finally:
            for sock in kept:
                sock.close()
    assert all(reply.startswith(b"HTTP/1.1 200 ") for reply in replies), [reply[:100] for reply in replies]


class _ManualLoop:
    """The two things :class:`_Closings` asks of an event loop: the time, and a timer (run by the test)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.timers: list[tuple[float, Callable[..., None], tuple[object, ...]]] = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[..., None], *args: object) -> object:
        self.timers.append((self.now + delay, callback, args))
        return object()


def test_every_closing_is_told_once_and_none_is_left_untold(caplog: pytest.LogCaptureFixture) -> None:
    """The first closing is logged at once; later ones within the rate limit wait for one timer, which logs
    their counts by reason, so a burst that ends is still told."""
    loop = _ManualLoop()
    closings = _Closings()
    with caplog.at_level(logging.WARNING, logger="gymckpt.stack.request_deadlines"):
        closings.add("head", loop)  # type: ignore[arg-type]
        assert len(caplog.records) == 1 and "1 request head not complete" in caplog.records[0].getMessage()
        loop.now += 1
        closings.add("shed", loop, "70 open, budget 64", count=3)  # type: ignore[arg-type]
        closings.add("body", loop)  # type: ignore[arg-type]
        assert len(caplog.records) == 1 and len(loop.timers) == 1  # one line per 10 s at most, one timer
        when, callback, args = loop.timers.pop()
        loop.now = when
        callback(*args)
    assert len(caplog.records) == 2
    told = caplog.records[1].getMessage()
    assert "3 shed at the connection budget" in told and "[70 open, budget 64]" in told
    assert "1 request body too slow" in told
