"""Bad input is one line and an exit code, never a traceback (issue 25, item 3).

``gymckpt serve`` and ``gymckpt stack up`` run as real processes: a port out of range, a
descriptor that is not a socket, a ``GYMCKPT_*``/``OTEL_*`` variable that is not valid, a stack
file naming a server it does not have. A Coordinator's error over several servers says each
distinct cause once, with the servers it hit, each URL once.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.control.coordination import Coordinator
from gymckpt.errors import CoordinationError, Unauthorized
from gymckpt.testing.net import refused_url, serve

if TYPE_CHECKING:
    from pathlib import Path

#: a stack whose model names "{inferense}": no server of that name
MISSPELLED_STACK = """\
servers:
  - {name: inference, kind: inference}
  - {name: model, kind: model, config: {inference_url: "{inferense}"}}
"""


def gymckpt(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it, without the caller's own GYMCKPT_*/OTEL_* settings."""
    clean = {key: value for key, value in os.environ.items() if not key.startswith(("GYMCKPT_", "OTEL_"))}
    return subprocess.run(
        [sys.executable, "-m", "gymckpt", *args],
        capture_output=True,
        text=True,
        timeout=60,  # a command that started serving instead of refusing fails here
        env={**clean, **(env or {})},
        stdin=subprocess.DEVNULL,
        check=False,
    )


def one_error_line(result: subprocess.CompletedProcess[str], *expected: str) -> str:
    """Exit 2, nothing on stdout, and stderr exactly one ``error: …`` line holding each of ``expected``."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    return lines[0]


# --- gymckpt serve


def test_serve_on_a_port_out_of_range_is_one_line_naming_the_range() -> None:
    for port in ("99999", "-1"):
        result = gymckpt("serve", "counter", "--port", port)
        one_error_line(result, "'--port'", port, "0<=x<=65535", "gymckpt serve --help")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--fd", "999"], ["--fd 999", "not an open file descriptor"]),
        (["--fd", "0"], ["--fd 0", "not a socket"]),  # stdin: /dev/null
        (["--fd", "-3"], ["'--fd'", "x>=0"]),
        (["--host", "a..b"], ["--host 'a..b' does not resolve"]),  # refused by the IDNA codec: no lookup
        (["--workers", "0"], ["'--workers'", "1<=x<="]),
        (["--keep-alive", "nan"], ["'--keep-alive'", "not a finite number"]),
    ],
    ids=["closed-fd", "not-a-socket", "negative-fd", "bad-host", "no-workers", "nan-keep-alive"],
)
def test_serve_with_a_bad_option_is_one_line(args: list[str], expected: list[str]) -> None:
    one_error_line(gymckpt("serve", "counter", *args), *expected)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("GYMCKPT_KEEP_ALIVE", "abc"),
        ("GYMCKPT_HEADER_TIMEOUT", "-1"),
        ("GYMCKPT_CONNECTION_BUDGET", "0"),
        ("GYMCKPT_POOL_LIMIT", "many"),
        ("GYMCKPT_MAX_REPLY_BYTES", "-3"),
        ("GYMCKPT_WORKER_HEALTHCHECK", "0"),
        ("GYMCKPT_LOG_LEVEL", "loud"),
        ("OTEL_TRACES_EXPORTER", "bogus"),
    ],
)
def test_serve_with_a_bad_variable_is_one_line_naming_it(variable: str, value: str) -> None:
    result = gymckpt("serve", "counter", "--port", "0", env={variable: value})
    one_error_line(result, variable, repr(value))


def test_stack_up_with_a_bad_variable_is_one_line_naming_it(tmp_path: Path) -> None:
    stack = tmp_path / "stack.yaml"
    stack.write_text("servers: []\n")  # no server: a command that failed to refuse starts none (none is left over)
    result = gymckpt("stack", "up", str(stack), env={"GYMCKPT_HEADER_TIMEOUT": "soon"})
    one_error_line(result, "GYMCKPT_HEADER_TIMEOUT", "'soon'")


# --- gymckpt stack up: the stack file


def test_a_stack_naming_a_server_it_does_not_have_is_one_line(tmp_path: Path) -> None:
    stack = tmp_path / "stack.yaml"
    stack.write_text(MISSPELLED_STACK)
    line = one_error_line(gymckpt("stack", "up", str(stack)), str(stack), "inference_url", "{inferense}")
    assert "names no server" in line, line
    assert "did you mean" in line and "{inference}" in line, line  # the close name
    assert "inference, model" in line, line  # the names there are


@pytest.mark.parametrize(
    ("servers", "expected"),
    [
        ("  - {name: counter, kind: counter, port: 99999}\n", ["servers[0].port", "65535"]),
        ("  - counter\n", ["servers[0]", "mapping"]),
        ("  - {name: m, kind: model, config: 5}\n", ["servers[0].config", "mapping"]),
    ],
    ids=["port-out-of-range", "entry-not-a-mapping", "config-not-a-mapping"],
)
def test_a_stack_file_that_cannot_be_used_is_one_line(tmp_path: Path, servers: str, expected: list[str]) -> None:
    stack = tmp_path / "stack.yaml"
    stack.write_text("servers:\n" + servers)
    one_error_line(gymckpt("stack", "up", str(stack)), str(stack), *expected)


# --- CoordinationError: each distinct cause once, each URL once


async def _refuse(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A server that answers every call as a Gym server does a wrong control token."""
    if scope["type"] != "http":
        return
    body = b'{"error": {"code": "unauthorized", "detail": "a valid bearer token is required"}}'
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _discover_error(urls: list[str]) -> CoordinationError:
    async def scenario() -> CoordinationError:
        async with Coordinator(urls, token="wrong", probe_retries=1) as gym:
            found = await gym.discover()
        with pytest.raises(CoordinationError) as raised:
            found.raise_for_problems()
        return raised.value

    return asyncio.run(scenario())


def test_four_servers_with_the_same_cause_name_each_url_once_and_the_cause_once() -> None:
    with ExitStack() as servers:
        urls = [servers.enter_context(serve(_refuse)) for _ in range(4)]
        error = _discover_error(urls)
    assert [type(cause) for cause in error.causes.values()] == [Unauthorized] * 4
    message = str(error)
    assert "\n" not in message, message  # one cause: one line
    assert message.startswith("checkpoint discover failed on 4 participant(s): 4 servers ("), message
    for url in urls:
        assert message.count(url) == 1, (url, message)
    assert message.count("a valid bearer token is required") == 1, message
    assert error.failures == {url: str(error.causes[url]) for url in urls}  # each server's own text is kept


def test_refused_connections_group_although_each_names_its_own_address() -> None:
    with ExitStack() as servers:
        urls = [servers.enter_context(refused_url()) for _ in range(4)]
        error = _discover_error(urls)
    message = str(error)
    assert "\n" not in message, message
    for url in urls:
        assert message.count(url.removeprefix("http://")) == 1, (url, message)  # not even its host:port again
    assert message.count("Cannot connect") == 1, message


def test_different_causes_are_one_line_each() -> None:
    with ExitStack() as servers:
        refusing = [servers.enter_context(serve(_refuse)) for _ in range(2)]
        down = [servers.enter_context(refused_url()) for _ in range(2)]
        error = _discover_error([*refusing, *down])
    head, *lines = str(error).splitlines()
    assert head == "checkpoint discover failed on 4 participant(s): 2 different causes", head
    assert len(lines) == 2, lines
    for url in [*refusing, *down]:
        assert sum(line.count(url) for line in lines) == 1, (url, lines)
    (token_line,) = [line for line in lines if "bearer token" in line]
    assert token_line.strip().startswith(f"2 servers ({', '.join(sorted(refusing))}): "), token_line
