"""``gymckpt serve`` (one reference server, or ``--app`` one of your own) and ``gymckpt stack up`` (a whole stack).

Everything a server would otherwise fail on at startup with a traceback is checked here
first and refused as one line, exit 2: a port outside 0–65535, a host that does not
resolve, an ``--fd`` that is not a socket, a ``GYMCKPT_*`` or ``OTEL_*`` variable that is
not valid (the line names it), a config or stack file that cannot be used (the line names
the file, and in a stack file the entry, the key and the reference), an ``--app`` that names
no app (a module not importable, an attribute it lacks, neither an app nor a factory), or
a KIND and ``--app`` both or neither.
"""

from __future__ import annotations

import os
import socket
import stat
from typing import TYPE_CHECKING

import click

from gymckpt.cli._errors import Command, Group, fail, fail_setting
from gymckpt.cli._options import keep_alive_option, log_level_option
from gymckpt.cli._output import plain
from gymckpt.stack import KINDS, load_stack
from gymckpt.stack.kinds import load_config
from gymckpt.stack.serving import MAX_WORKERS, serve

if TYPE_CHECKING:
    import threading

__all__ = ["check_environment", "serve_command", "stack_group"]


def check_environment() -> None:
    """Exit 2 with one line naming the variable when a ``GYMCKPT_*`` setting a server reads is not valid.

    Each is read here as the server would read it (its keep-alive, pool bound, reply bound,
    request deadlines and connection budget, the workers' health check), so a bad value
    stops the command before any process starts, not inside uvicorn or a worker.
    """
    from gymckpt import transport
    from gymckpt.stack.request_deadlines import RequestDeadlines
    from gymckpt.stack.serving import worker_healthcheck_seconds

    checks = (
        transport.server_keep_alive,
        transport.pool_limit,
        transport.data_reply_limit,
        RequestDeadlines.from_environment,
        worker_healthcheck_seconds,
    )
    for check in checks:
        try:
            check()
        except ValueError as exc:  # each names its variable
            fail_setting(exc)


def _check_telemetry(kind: str) -> None:
    """Configure telemetry from ``OTEL_*`` as the server would (once per process): a bad variable is one line."""
    from gymckpt import telemetry

    try:
        telemetry.configure_from_environment(f"gymckpt-{kind}")
    except ValueError as exc:  # names the variable: OTEL_TRACES_EXPORTER 'x': gymckpt knows …
        fail_setting(exc)


def _check_where(host: str, port: int, fd: int | None) -> None:
    """Exit 2 for an ``--fd`` that is not an open socket, or a ``--host`` that does not resolve."""
    if fd is not None:
        try:
            mode = os.fstat(fd).st_mode
        except OSError as exc:
            fail(
                f"--fd {fd}: not an open file descriptor ({exc.strerror}): give a listening socket this process inherited"
            )
        if not stat.S_ISSOCK(mode):
            fail(f"--fd {fd}: not a socket: give a listening socket this process inherited")
        return
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        fail(
            f"--host {host!r} does not resolve ({reason}): give an address such as 127.0.0.1 or 0.0.0.0, or a host name"
        )


@click.command("serve", cls=Command)
@click.argument("kind", type=click.Choice(sorted(KINDS)), required=False, metavar="[KIND]")
@click.option(
    "--app",
    "app_spec",
    metavar="MODULE:ATTR",
    help="Serve an app of your own instead of a KIND: a FastAPI app, or a factory that takes no arguments "
    "and returns one (imported with the current directory first on the path, as uvicorn does).",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False),
    help="YAML config file: the KIND's config, or the app's settings file (the app reads it with "
    "app_config_file() from gymckpt.participants.install).",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0: any free port.")
@click.option(
    "--fd", type=click.IntRange(min=0), help="Serve an inherited listening socket instead of binding host:port."
)
@click.option(
    "--workers",
    type=click.IntRange(1, MAX_WORKERS),
    default=1,
    show_default=True,
    help="uvicorn worker processes. Above 1, this process coordinates them: one checkpoint participant "
    "for all of them, and each session's requests routed to the worker that holds it.",
)
@keep_alive_option
@log_level_option
def serve_command(
    kind: str | None, app_spec: str | None, config_file: str | None, host: str, port: int, fd: int | None, workers: int
) -> None:
    """Run one reference server (inference, model, agent, counter, weather, sandbox, environment), or --app your own.

    The config file holds the server's own fields and a checkpoint: block; with
    checkpoint.enabled false (the default) no checkpoint route or behaviour is installed.
    With --workers N the control routes answer the same on every worker, a checkpoint
    covers every worker's work, and a restore may run on another worker count.

    --app MODULE:ATTR runs an app of your own the same way (install_checkpointing makes it a
    participant); with --workers N this process builds the app once to learn its participant,
    and each worker builds its own. --config names the app's settings file.

    Exit status 2, with one line saying why: a bad option, config file, app, or GYMCKPT_* or
    OTEL_* variable.
    """
    if (kind is None) == (app_spec is None):
        both = "not both" if kind is not None else f"one of {', '.join(sorted(KINDS))}"
        fail(f"give a server KIND ({both}) or --app MODULE:ATTR (see 'gymckpt serve --help')")
    check_environment()
    if app_spec is not None:
        _serve_app(app_spec, config_file, host, port, fd, workers)
        return
    assert kind is not None
    try:
        load_config(kind, config_file)
    except (ValueError, ImportError, OSError) as exc:  # invalid YAML, a bad field, an unreadable file
        fail(f"cannot build the {kind} server: {exc}")
    _check_where(host, port, fd)
    _check_telemetry(kind)
    serve(kind, config_file, host=host, port=port, fd=fd, workers=workers)


def _serve_app(spec: str, config_file: str | None, host: str, port: int, fd: int | None, workers: int) -> None:
    """``serve --app``: every check before the app is imported, then the import, refused as one line."""
    from gymckpt import telemetry
    from gymckpt.participants.install import STARTUP_LINE_ENV
    from gymckpt.stack.apps import load_app, parse_app_spec

    try:
        parse_app_spec(spec)
    except ValueError as exc:
        fail(str(exc))
    _check_where(host, port, fd)
    try:
        telemetry.check_environment()  # the app's install_checkpointing configures it, named after its participant
    except ValueError as exc:
        fail_setting(exc)
    os.environ[STARTUP_LINE_ENV] = "1"  # the server's startup line is this process's, once it listens
    try:
        loaded = load_app(spec, config_file=config_file, serving_here=workers == 1)
    except (ValueError, OSError) as exc:  # AppNotLoadable, the app's SettingsError (its file and key), a file
        fail(str(exc))
    serve(None, config_file, host=host, port=port, fd=fd, workers=workers, app=loaded)


@click.group("stack", cls=Group)
def stack_group() -> None:
    """Run a whole stack of reference servers (and apps of your own) from a YAML file."""


@stack_group.command("up", cls=Command)
@click.argument("stack_file", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--keep-workdir",
    is_flag=True,
    help="Keep the servers' configs (with the control token) and logs after the stack stops (default: removed).",
)
@click.option(
    "--ray",
    "ray_address",
    metavar="ADDRESS",
    help="Place the servers on this Ray cluster (e.g. 10.0.0.5:6379, or auto) instead of this machine: one "
    "host actor per server through a placement group (the stack file's ray: block; pip install -e '.[ray]').",
)
@keep_alive_option
@log_level_option
def stack_up(stack_file: str, keep_workdir: bool, ray_address: str | None) -> None:
    """Start every server of STACK_FILE, each in its own process group, until interrupted.

    "{name}" in a config value is the URL of the stack's server of that name. Ctrl-C or
    SIGTERM, whenever it comes (also while the stack starts), stops every server and removes
    the stack's working directory unless --keep-workdir. Exit status 2, with one line naming
    the file, the entry and the key: a stack file that cannot be used (a reference to a server
    it does not have, a port outside 0-65535), or a bad GYMCKPT_* variable (the servers
    inherit the environment).

    With --ray ADDRESS the servers run on that Ray cluster (see gymckpt.stack.ray): each line
    names the node a server runs on; a node lost is reported and every server placed again
    (restoring the last checkpoint is the controller's part); Ctrl-C stops every server and
    removes the placement group and host actors, leaving the cluster as it was.
    """
    import signal as signals
    import threading

    check_environment()
    # handlers, not a blocked mask: the servers started below must not inherit blocked signals
    stopping = threading.Event()
    stop_signals = (signals.SIGINT, signals.SIGTERM)
    previous = {number: signals.signal(number, lambda *_: stopping.set()) for number in stop_signals}
    try:
        if ray_address is not None:
            _stack_up_ray(stack_file, ray_address, stopping)
            return
        try:
            stack = load_stack(stack_file, keep_workdir=keep_workdir)  # the whole file, before any socket opens
        except (ValueError, OSError) as exc:  # a SettingsError or invalid YAML names the file already
            message = str(exc)
            fail(message if message.startswith(f"{stack_file}:") else f"{stack_file}: {message}")
        with stack:
            if not stopping.is_set():
                stack.start()
                for name, url in stack.urls.items():
                    plain(name, stack.servers[name].label, url, f"log {stack.servers[name].log_path}")
                plain("press Ctrl-C to stop the stack")
            stopping.wait()
    finally:
        for number, handler in previous.items():
            signals.signal(number, handler)


def _stack_up_ray(stack_file: str, address: str, stopping: threading.Event) -> None:
    """``stack up --ray``: place the stack on the cluster, print where each server runs, until stopped."""
    try:
        from gymckpt.stack.ray import RayStack  # Ray is imported only here
    except ImportError as exc:
        fail(f"--ray needs Ray: pip install -e '.[ray]' in the gymckpt clone ({exc})")
    try:
        stack = RayStack(stack_file, address=address)  # the whole file, before anything is placed
    except (ValueError, OSError) as exc:
        message = str(exc)
        fail(message if message.startswith(f"{stack_file}:") else f"{stack_file}: {message}")
    with stack:
        try:
            stack.serve(stopping, plain)
        except ValueError as exc:  # SharedStorageRequired: the line names the setting
            fail(f"{stack_file}: {exc}")
