"""Run one reference server as ``gymckpt serve`` does: one process, or several uvicorn workers.

With ``workers`` above 1, this process becomes the server's main process: it writes the
routing secret, starts the checkpoint coordinator (checkpointing on) on a thread of its own
(:class:`~gymckpt.workers.process.CoordinatorThread`), and runs uvicorn's supervisor, which
starts the workers from :func:`~gymckpt.stack.kinds.app_from_env` and starts a worker again
when one dies. Each worker links to the coordinator and routes sessions to their owners
(:func:`~gymckpt.workers.process.install_worker`).

Connections: uvicorn keeps an idle connection ``keep_alive`` seconds (default
``GYMCKPT_KEEP_ALIVE``, else :data:`~gymckpt.transport.SERVER_KEEP_ALIVE_SECONDS`, beyond
every client's idle timeout) and listens with a backlog of
:data:`~gymckpt.transport.LISTEN_BACKLOG`, so a burst of thousands of connects waits in
the kernel instead of being dropped. No ``limit_concurrency``: past it uvicorn answers 503,
which would fail rollouts that can as well wait. At startup the soft descriptor limit is
raised to the hard one and the server's descriptor budget is logged
(:func:`check_descriptor_budget`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from gymckpt import telemetry, transport
from gymckpt.stack.kinds import CONFIG_ENV, KIND_ENV, NOT_GYM, PARTICIPANT_KINDS, build_server, load_config

if TYPE_CHECKING:
    from gymckpt.servers.base import ServerConfig
    from gymckpt.workers.process import CoordinatorThread

__all__ = [
    "MAX_WORKERS",
    "WORKER_HEALTHCHECK_ENV",
    "WORKER_HEALTHCHECK_SECONDS",
    "WorkerDeaths",
    "check_descriptor_budget",
    "downstream_hosts",
    "serve",
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
    kind: str,
    config_file: str | None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    fd: int | None = None,
    workers: int = 1,
    log_level: str | None = None,
    keep_alive: float | None = None,
) -> None:
    """Serve ``kind`` until interrupted; ``fd`` is an inherited listening socket (else ``host:port``).

    ``log_level`` (default ``GYMCKPT_LOG_LEVEL``, else info) is gymckpt's; uvicorn logs
    warnings only (its access log only at debug). ``keep_alive`` (default
    ``GYMCKPT_KEEP_ALIVE``, else 75 s) is how long an idle connection stays open; this
    process's clients and its workers' keep theirs at most half as long. ``OTEL_*``
    variables configure telemetry in this process and in every worker.
    """
    import uvicorn

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
    telemetry.configure_from_environment(f"gymckpt-{kind}")
    config = load_config(kind, config_file)
    check_descriptor_budget(kind, config, workers=workers)
    uvicorn_options: dict[str, object] = {
        "log_level": "debug" if level == "debug" else "warning",
        "access_log": level == "debug",
        "timeout_keep_alive": seconds,
        "backlog": transport.LISTEN_BACKLOG,
    }
    if workers > 1:
        uvicorn_options["timeout_worker_healthcheck"] = worker_healthcheck_seconds()
        if level != "debug":  # the supervisor's dead workers are warnings; its other lines stay out
            uvicorn_options.update(log_level="info", log_config=_uvicorn_log_config())
    where = {"fd": fd} if fd is not None else {"host": host, "port": port}
    if workers == 1:
        app, _ = build_server(kind, config_file)
        uvicorn.run(app, **uvicorn_options, **where)  # type: ignore[arg-type]
        return
    from gymckpt.workers.process import ENV_SOCKET, CoordinatorThread, worker_environment

    # no participant (checkpointing off, not a Gym server, an auxiliary model): the workers only route sessions
    participant = config.checkpoint.enabled and kind not in NOT_GYM and getattr(config, "checkpoint_policy", True)
    block = config.checkpoint if participant else None
    instance = str(getattr(config, "instance", f"{PARTICIPANT_KINDS.get(kind, kind)}-0"))
    env = worker_environment(block, workers, f"{kind}/{instance}")
    env[KIND_ENV] = kind
    env[CONFIG_ENV] = str(Path(config_file).resolve()) if config_file else ""
    coordinator: CoordinatorThread | None = None
    if block is not None:
        coordinator = CoordinatorThread(PARTICIPANT_KINDS[kind], instance, block, workers=workers)
        env[ENV_SOCKET] = str(coordinator.start())
    os.environ.update(env)
    try:
        uvicorn.run("gymckpt.stack.kinds:app_from_env", factory=True, workers=workers, **uvicorn_options, **where)  # type: ignore[arg-type]
    finally:
        if coordinator is not None:
            coordinator.stop()


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
    at its bound (``data_connector_limit_per_host``, default
    :func:`~gymckpt.transport.downstream_pool_limit`, × the servers the config names, or
    ``data_connector_limit`` where that is smaller) with the awaited lane beside it
    (:func:`~gymckpt.transport.awaited_pool_limit` per server)
    and :data:`~gymckpt.transport.DESCRIPTOR_RESERVE`; the rest is left for the calls coming
    in. One INFO line gives the limit and how many calls it can hold; a WARNING names what to
    change when the pool is unbounded or takes more than it leaves. ``limits`` (soft, hard)
    stands for the process's own, which are then left as they are (for tests).
    """
    soft, hard = transport.raise_descriptor_limit() if limits is None else limits
    total = config.data_connector_limit or 0
    per_host = config.data_connector_limit_per_host
    per_host = transport.downstream_pool_limit(soft, workers) if per_host is None else per_host
    hosts = max(len(downstream_hosts(config)), 1)
    bounds = [bound for bound in (total, per_host * hosts if per_host else 0) if bound]
    # the data pool at its bound, and the awaited lane beside it (the calls a checkpoint waits for)
    outbound = min(bounds) + transport.awaited_pool_limit(per_host) * hosts if bounds else None
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
            "%s: the data pool has no bound (data_connector_limit and data_connector_limit_per_host are 0): "
            "under load its connections may take every descriptor; set either in the server config",
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
