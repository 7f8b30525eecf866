"""Run one server as ``gymckpt serve`` does: one process, or several uvicorn workers.

The server is a reference kind (``serve(kind, …)``) or an app of your own (``serve(None, …,
app="module:attr")``, :mod:`gymckpt.stack.apps`); both run the same way. With ``workers``
above 1, this process becomes the server's main process: it writes the routing secret,
starts the checkpoint coordinator (checkpointing on) on a thread of its own
(:class:`~gymckpt.workers.process.CoordinatorThread`), and runs uvicorn's supervisor, which
starts the workers from :func:`~gymckpt.stack.kinds.app_from_env` (a kind) or
:func:`~gymckpt.stack.apps.app_from_env` (an app) and starts a worker again when one dies.
Each worker links to the coordinator and routes sessions to their owners
(:func:`~gymckpt.workers.process.install_worker`).

Connections: uvicorn keeps an idle connection ``keep_alive`` seconds (default
``GYMCKPT_KEEP_ALIVE``, else :data:`~gymckpt.transport.SERVER_KEEP_ALIVE_SECONDS`, beyond
every client's idle timeout) and listens with a backlog of
:data:`~gymckpt.transport.LISTEN_BACKLOG`, so a burst of thousands of connects waits in
the kernel instead of being dropped. No ``limit_concurrency``: past it uvicorn answers 503,
which would fail rollouts that can as well wait. At startup the soft descriptor limit is
raised to the hard one and the server's descriptor budget is logged
(:func:`check_descriptor_budget`), and then one INFO line (:func:`startup_line`) says where
the server listens and whether checkpointing is on, with which allowed roots (from the main
process only, with several workers).

Slow clients (:mod:`gymckpt.stack.request_deadlines`, the HTTP protocol of every server run
here): a request's head must arrive within ``GYMCKPT_HEADER_TIMEOUT`` seconds (default 10)
of its first byte, else 408 and close (before that byte, a connection is idle: the
keep-alive bounds it); a body must keep
``GYMCKPT_BODY_MIN_RATE`` bytes/s (default 1024) after ``GYMCKPT_BODY_GRACE`` seconds
(default 10), counted only while the server waits for the client's bytes, not while the app
has not read them. Past ``GYMCKPT_CONNECTION_BUDGET`` connections (default: what the
descriptor budget leaves for calls coming in), connections with no whole head yet are closed,
longest waiting first, then kept-alive ones idle for half the keep-alive, so a complete
request (a control call) still gets in; requests in progress are never closed. What a
server closes on its own, it logs (one WARNING line every 10 s at most).
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from gymckpt import telemetry, transport
from gymckpt.control.settings import checkpointing_summary
from gymckpt.gc_pause import tune_collector
from gymckpt.participants.install import STARTUP_LINE_ENV
from gymckpt.stack.kinds import CONFIG_ENV, KIND_ENV, NOT_GYM, PARTICIPANT_KINDS, build_server, load_config
from gymckpt.stack.request_deadlines import CONNECTION_BUDGET_ENV, DeadlineProtocol, RequestDeadlines

if TYPE_CHECKING:
    from gymckpt.servers.base import ServerConfig
    from gymckpt.stack.apps import LoadedApp
    from gymckpt.workers.process import CoordinatorThread

__all__ = [
    "MAX_WORKERS",
    "WORKER_HEALTHCHECK_ENV",
    "WORKER_HEALTHCHECK_SECONDS",
    "WorkerDeaths",
    "check_descriptor_budget",
    "downstream_hosts",
    "listening_url",
    "serve",
    "startup_line",
    "uvicorn_options",
    "worker_healthcheck_seconds",
]

logger = logging.getLogger(__name__)

#: the most workers one server may run
MAX_WORKERS = 64
#: how long uvicorn's supervisor waits for a worker to answer its health check before it takes the
#: worker for hung, kills it and starts another (uvicorn's own default is 5 s). A worker killed loses
#: every call it was serving, so a loaded one (thousands of rollouts on a shared core, a long garbage
#: collection) must not be taken for a hung one.
WORKER_HEALTHCHECK_SECONDS = 60
#: the variable that sets :data:`WORKER_HEALTHCHECK_SECONDS`
WORKER_HEALTHCHECK_ENV = "GYMCKPT_WORKER_HEALTHCHECK"


def worker_healthcheck_seconds() -> int:
    """``GYMCKPT_WORKER_HEALTHCHECK`` (whole seconds ≥ 1), else :data:`WORKER_HEALTHCHECK_SECONDS`."""
    raw = os.environ.get(WORKER_HEALTHCHECK_ENV, "").strip()
    if not raw:
        return WORKER_HEALTHCHECK_SECONDS
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{WORKER_HEALTHCHECK_ENV} must be a whole number of seconds >= 1, not {raw!r}")
    return int(raw)


class WorkerDeaths(logging.Filter):
    """uvicorn's supervisor lines: its INFO lines dropped, except a dead worker's, raised to WARNING.

    uvicorn logs a worker it found gone (or hung, and killed) at INFO; for a checkpointing
    server that is the moment the worker's calls were lost, so it is a warning that says so.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        message = record.getMessage()
        if not (message.startswith("Child process") and message.endswith("died")):
            return False
        record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        record.msg = (
            f"{message}: the worker exited, or gave no answer to the supervisor's health check within "
            f"{worker_healthcheck_seconds()} s and was killed ({WORKER_HEALTHCHECK_ENV}); the calls it was "
            "serving are lost, and a new worker is started"
        )
        record.args = ()
        return True


def _uvicorn_log_config() -> dict[str, object]:
    """uvicorn's loggers through this process's handlers: warnings, and its supervisor's dead workers."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"worker_deaths": {"()": f"{__name__}.WorkerDeaths"}},
        "loggers": {
            "uvicorn": {"level": "WARNING"},
            "uvicorn.error": {"level": "INFO", "filters": ["worker_deaths"]},
            "uvicorn.access": {"level": "WARNING"},
        },
    }


def serve(
    kind: str | None,
    config_file: str | None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    fd: int | None = None,
    workers: int = 1,
    log_level: str | None = None,
    keep_alive: float | None = None,
    app: str | LoadedApp | None = None,
) -> None:
    """Serve ``kind``, or ``app`` (``module:attr``, or one :func:`~gymckpt.stack.apps.load_app` loaded), until interrupted.

    ``fd`` is an inherited listening socket (else ``host:port``); ``config_file`` is the
    kind's config, or the app's settings file. ``log_level`` (default ``GYMCKPT_LOG_LEVEL``,
    else info) is gymckpt's; uvicorn logs warnings only (its access log only at debug).
    ``keep_alive`` (default ``GYMCKPT_KEEP_ALIVE``, else 75 s) is how long an idle connection
    stays open; this process's clients and its workers' keep theirs at most half as long.
    ``OTEL_*`` variables configure telemetry in this process and in every worker. The request
    deadlines and the connection budget (``GYMCKPT_HEADER_TIMEOUT``, ``GYMCKPT_BODY_GRACE``,
    ``GYMCKPT_BODY_MIN_RATE``, ``GYMCKPT_CONNECTION_BUDGET``) are checked before uvicorn starts.
    An app given as ``module:attr`` is loaded here (:class:`~gymckpt.errors.AppNotLoadable`);
    one already loaded must have been loaded with ``serving_here=(workers == 1)``.
    """
    import uvicorn

    if (kind is None) == (app is None):
        raise ValueError("serve one server: a kind or an app, not both or neither")
    if not 1 <= workers <= MAX_WORKERS:
        raise ValueError(f"workers must be between 1 and {MAX_WORKERS}, not {workers}")
    level = (log_level or os.environ.get(telemetry.LOG_LEVEL_ENV) or "info").lower()
    telemetry.setup_logging(level)
    os.environ[telemetry.LOG_LEVEL_ENV] = level  # the workers' own setup reads it
    if keep_alive is not None:
        if not keep_alive > 0:
            raise ValueError(f"keep_alive must be a positive number of seconds, not {keep_alive}")
        os.environ[transport.KEEP_ALIVE_ENV] = repr(float(keep_alive))  # the workers' clients read it
    seconds = transport.server_keep_alive()
    loaded = None if app is None else _load(app, config_file, workers)
    if loaded is None:
        assert kind is not None
        telemetry.configure_from_environment(f"gymckpt-{kind}")
        config = load_config(kind, config_file)
    else:
        telemetry.configure_from_environment(loaded.service_name)  # a no-op once the app's install did it
        config = _app_pools()
    label = kind if loaded is None else loaded.spec
    tune_collector()  # before any app is built; a bad GYMCKPT_GC_THRESHOLDS stops here, and the workers inherit it
    budget = check_descriptor_budget(label, config, workers=workers)
    if not os.environ.get(CONNECTION_BUDGET_ENV, "").strip() and budget.inbound is not None and budget.inbound > 0:
        os.environ[CONNECTION_BUDGET_ENV] = str(budget.inbound)  # this process's and every worker's
    options = uvicorn_options(level, keep_alive=seconds)
    if workers > 1:
        options["timeout_worker_healthcheck"] = worker_healthcheck_seconds()
        if level != "debug":  # the supervisor's dead workers are warnings; its other lines stay out
            options.update(log_level="info", log_config=_uvicorn_log_config())
    if fd is None and port == 0:  # bound here, so the startup line names the port the system picked
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        fd = socket.create_server((host, 0), family=family, backlog=transport.LISTEN_BACKLOG).detach()
    where = {"fd": fd} if fd is not None else {"host": host, "port": port}
    url = listening_url(host, port, fd)
    if loaded is None:
        assert kind is not None
        logger.info("%s", startup_line(kind, config, url, workers=workers))
    else:
        logger.info("%s", loaded.startup_line(url, workers=workers))
    os.environ[STARTUP_LINE_ENV] = "1"  # install_checkpointing, here or in a worker, logs no line of its own
    if workers == 1:
        served = build_server(kind, config_file)[0] if loaded is None else loaded.app  # type: ignore[arg-type]
        uvicorn.run(served, **options, **where)  # type: ignore[arg-type]
        return
    from gymckpt.workers.process import ENV_SOCKET, CoordinatorThread, worker_environment

    if loaded is None:
        assert kind is not None
        # no participant (checkpointing off, not a Gym server, an auxiliary model): the workers only route sessions
        block = config.checkpoint if _is_participant(kind, config) else None
        participant = PARTICIPANT_KINDS.get(kind, kind)
        instance = str(getattr(config, "instance", f"{participant}-0"))
        env = worker_environment(block, workers, f"{kind}/{instance}")
        env[KIND_ENV] = kind
        env[CONFIG_ENV] = str(Path(config_file).resolve()) if config_file else ""
        factory = "gymckpt.stack.kinds:app_from_env"
    else:
        from gymckpt.stack.apps import APP_ENV

        installed = loaded.installed
        block = loaded.block
        participant = installed.kind if installed is not None else "app"
        instance = installed.instance if installed is not None else "app-0"
        env = worker_environment(block, workers, f"{participant}/{instance}")
        env[APP_ENV] = loaded.spec
        factory = "gymckpt.stack.apps:app_from_env"
    coordinator: CoordinatorThread | None = None
    if block is not None:
        coordinator = CoordinatorThread(participant, instance, block, workers=workers)
        env[ENV_SOCKET] = str(coordinator.start())
    os.environ.update(env)
    try:
        uvicorn.run(factory, factory=True, workers=workers, **options, **where)  # type: ignore[arg-type]
    finally:
        if coordinator is not None:
            coordinator.stop()


def _load(app: str | LoadedApp, config_file: str | None, workers: int) -> LoadedApp:
    """The app, built here (its own install logs no startup line: this process logs the server's)."""
    from gymckpt.stack.apps import load_app

    if not isinstance(app, str):
        return app
    os.environ[STARTUP_LINE_ENV] = "1"
    return load_app(app, config_file=config_file, serving_here=workers == 1)


def _app_pools() -> ServerConfig:
    """What the descriptor budget of an app of your own counts: gymckpt's default pool bounds, one host."""
    from gymckpt.servers.base import ServerConfig

    return ServerConfig()


def _is_participant(kind: str, config: ServerConfig) -> bool:
    """Whether ``kind`` with ``config`` takes part in checkpoints (not the inference backend, nor an auxiliary model)."""
    return bool(config.checkpoint.enabled and kind not in NOT_GYM and getattr(config, "checkpoint_policy", True))


def listening_url(host: str, port: int, fd: int | None = None) -> str:
    """The URL a server listens on: ``host:port``, or what the listening socket ``fd`` is bound to."""
    if fd is not None:
        sock = socket.socket(fileno=fd)
        try:
            family, address = sock.family, sock.getsockname()
        except OSError:
            return f"the inherited socket {fd}"
        finally:
            sock.detach()  # the descriptor stays open: it is the server's
        if family == socket.AF_UNIX:
            return f"unix:{address}"
        host, port = address[0], address[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def startup_line(kind: str, config: ServerConfig, url: str, *, workers: int = 1) -> str:
    """The one line a server logs at startup: where it listens, whether checkpointing is on, which roots."""
    if _is_participant(kind, config):
        checkpointing = checkpointing_summary(config.checkpoint)
    elif kind in NOT_GYM:
        checkpointing = "checkpointing off (not a Gym server)"
    elif config.checkpoint.enabled:
        checkpointing = "checkpointing off (checkpoint_policy: false, an auxiliary model)"
    else:
        checkpointing = checkpointing_summary(None)
    several = f" with {workers} workers" if workers > 1 else ""
    return f"{kind} server listening on {url}{several}, {checkpointing}"


def uvicorn_options(level: str = "info", *, keep_alive: float | None = None) -> dict[str, object]:
    """The uvicorn options of every server run here (one process, or each of several workers).

    gymckpt's log ``level`` decides uvicorn's (warnings, its access log at debug only);
    ``keep_alive`` defaults to :func:`~gymckpt.transport.server_keep_alive`. The HTTP protocol
    is :class:`~gymckpt.stack.request_deadlines.DeadlineProtocol` (h11 with the request
    deadlines and shedding), whose settings are read and checked here: a ValueError names a
    variable that is not a positive number.
    """
    RequestDeadlines.from_environment()  # a bad variable fails here, not in each connection
    return {
        "log_level": "debug" if level == "debug" else "warning",
        "access_log": level == "debug",
        "timeout_keep_alive": transport.server_keep_alive() if keep_alive is None else keep_alive,
        "backlog": transport.LISTEN_BACKLOG,
        "http": DeadlineProtocol,
    }


def downstream_hosts(config: ServerConfig) -> list[str]:
    """The distinct servers a config names (its ``*_url`` fields): where its data pool connects."""
    urls = {
        str(value).rstrip("/")
        for name, value in config
        if name.endswith("_url") and isinstance(value, str) and value.strip()
    }
    return sorted(urls)


def check_descriptor_budget(
    kind: str,
    config: ServerConfig,
    *,
    workers: int = 1,
    limits: tuple[int, int] | None = None,
) -> transport.DescriptorBudget:
    """Raise the soft descriptor limit to the hard one and log what this server's connections may take.

    The model, per process (each worker has the limit to itself): outbound, the data pool
    at its bound per server (``data_connector_limit_by_url``'s for a server it names, else
    ``data_connector_limit_per_host``, default :func:`~gymckpt.transport.downstream_pool_limit`;
    ``data_connector_limit`` only where there is no bound per host: it counts the connections
    in use, not the idle ones kept for another server) summed over the servers the config
    names, with the awaited lane beside it (:func:`~gymckpt.transport.awaited_pool_limit` per
    server) and :data:`~gymckpt.transport.DESCRIPTOR_RESERVE`; the rest is left for the calls coming
    in. One INFO line gives the limit and how many calls it can hold; a WARNING names what to
    change when the pool is unbounded or takes more than it leaves. ``limits`` (soft, hard)
    stands for the process's own, which are then left as they are (for tests).
    """
    soft, hard = transport.raise_descriptor_limit() if limits is None else limits
    total = config.data_connector_limit or 0
    per_host = config.data_connector_limit_per_host
    per_host = transport.downstream_pool_limit(soft, workers) if per_host is None else per_host
    own = config.data_connector_limit_by_url
    named = sorted(set(downstream_hosts(config)) | set(own)) or [""]
    bounds = [own.get(host, per_host or total) for host in named]
    # the data pool at its bound, and the awaited lane beside it (the calls a checkpoint waits for)
    awaited = transport.awaited_pool_limit(per_host) * len(named)
    outbound = sum(bounds) + awaited if all(bounds) else None
    hosts = len(named)
    budget = transport.DescriptorBudget(limit=soft, hard_limit=hard, outbound=outbound)
    shown = "unlimited" if soft < 0 else str(soft)
    logger.info(
        "%s: descriptor limit %s (hard %s) per process, %d worker(s): %s outbound (%d server(s) downstream) "
        "+ %d reserved leave %s for calls coming in; listen backlog %d, keep-alive %.0f s",
        kind,
        shown,
        "unlimited" if hard < 0 else hard,
        workers,
        outbound if outbound is not None else "unbounded",
        hosts,
        budget.reserve,
        budget.inbound if budget.inbound is not None else "the rest",
        transport.LISTEN_BACKLOG,
        transport.server_keep_alive(),
    )
    if outbound is None:
        logger.warning(
            "%s: the data pool has no bound towards some server (data_connector_limit and "
            "data_connector_limit_per_host are 0, or its data_connector_limit_by_url is): "
            "under load its connections may take every descriptor; set a bound in the server config",
            kind,
        )
    elif not budget.fits:
        logger.warning(
            "%s: the data pool's %d connections leave only %d of the descriptor limit %s for calls coming in: "
            "lower data_connector_limit / data_connector_limit_per_host in the server config (or %s), "
            "or raise the hard limit (ulimit -Hn)",
            kind,
            outbound,
            budget.inbound,
            shown,
            transport.POOL_LIMIT_ENV,
        )
    return budget
