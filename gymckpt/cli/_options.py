"""Options several commands share: the URL and object-storage options, ``--log-level`` and ``--keep-alive``."""

from __future__ import annotations

import math
import os
from typing import Any

import click

from gymckpt.cli._errors import fail, fail_setting

__all__ = ["check_url", "keep_alive_option", "log_level_option", "storage_arguments", "storage_options"]


def check_url(url: str) -> None:
    """Exit 2 for an empty URL argument: it must never mean the current directory."""
    if not url.strip():
        fail("URL is empty: give a checkpoint directory, a store root, or an s3:// URL")


def storage_options(endpoint_url: str | None, options: tuple[str, ...]) -> dict[str, Any]:
    """``--storage-option KEY=VALUE`` (repeated) and ``--endpoint-url`` as the backend's keyword arguments."""
    parsed: dict[str, Any] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not key:
            fail(f"--storage-option expects KEY=VALUE, got {option!r}")
        parsed[key] = value
    if endpoint_url:
        parsed["endpoint_url"] = endpoint_url
    return parsed


def storage_arguments(command: Any) -> Any:
    """``--endpoint-url`` and ``--storage-option``/``-o`` on ``command``."""
    command = click.option(
        "--storage-option",
        "-o",
        "storage_option",
        multiple=True,
        metavar="KEY=VALUE",
        help="Option for the object-storage filesystem (repeatable), e.g. -o key=AKIA… -o secret=….",
    )(command)
    return click.option(
        "--endpoint-url",
        metavar="URL",
        help="S3-compatible endpoint, e.g. http://127.0.0.1:9000. Credentials also come from AWS_* variables.",
    )(command)


def _set_log_level(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--log-level``: gymckpt's lines (timestamp, level, logger) at this level, here and in the servers started."""
    from gymckpt import telemetry

    if value is not None:
        os.environ[telemetry.LOG_LEVEL_ENV] = value
    try:
        telemetry.setup_logging(value)
    except ValueError as exc:  # --log-level is a choice: only the variable can be wrong
        fail_setting(exc, prefix=f"{telemetry.LOG_LEVEL_ENV}: ")
    return value


def log_level_option(command: Any, default: str | None = None) -> Any:
    """``--log-level`` on ``command``, applied before any other option is read."""
    from gymckpt.telemetry import LOG_LEVELS

    return click.option(
        "--log-level",
        type=click.Choice(LOG_LEVELS, case_sensitive=False),
        default=default,
        expose_value=False,
        is_eager=True,
        callback=_set_log_level,
        help="gymckpt's log level, also for the servers it starts "
        f"[default: {default or 'GYMCKPT_LOG_LEVEL, else info'}].",
    )(command)


def _set_keep_alive(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """``--keep-alive``: the servers' idle-connection timeout, here and in the servers started."""
    from gymckpt.transport import KEEP_ALIVE_ENV

    if value is not None and not math.isfinite(value):  # FloatRange lets nan and inf through
        raise click.BadParameter(f"{value} is not a finite number of seconds", ctx, param)
    if value is not None:
        os.environ[KEEP_ALIVE_ENV] = repr(value)
    return value


def keep_alive_option(command: Any) -> Any:
    """``--keep-alive SECONDS`` on ``command`` (it sets ``GYMCKPT_KEEP_ALIVE`` for the servers started)."""
    from gymckpt.transport import SERVER_KEEP_ALIVE_SECONDS

    return click.option(
        "--keep-alive",
        type=click.FloatRange(min=0, min_open=True),
        expose_value=False,
        callback=_set_keep_alive,
        metavar="SECONDS",
        help="How long a server keeps an idle connection open; gymckpt's clients drop theirs sooner "
        f"(after at most half of it) [default: GYMCKPT_KEEP_ALIVE, else {SERVER_KEEP_ALIVE_SECONDS:.0f}].",
    )(command)
