"""Run one reference server as ``gymckpt serve`` does: one process, or several uvicorn workers.

With ``workers`` above 1, this process becomes the server's main process: it writes the
routing secret, starts the checkpoint coordinator (checkpointing on) on a thread of its own
(:class:`~gymckpt.workers.process.CoordinatorThread`), and runs uvicorn's supervisor, which
starts the workers from :func:`~gymckpt.stack.kinds.app_from_env` and starts a worker again
when one dies. Each worker links to the coordinator and routes sessions to their owners
(:func:`~gymckpt.workers.process.install_worker`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from gymckpt import telemetry
from gymckpt.stack.kinds import CONFIG_ENV, KIND_ENV, NOT_GYM, PARTICIPANT_KINDS, build_server, load_config

if TYPE_CHECKING:
    from gymckpt.workers.process import CoordinatorThread

__all__ = ["MAX_WORKERS", "serve"]

#: the most workers one server may run
MAX_WORKERS = 64


def serve(
    kind: str,
    config_file: str | None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    fd: int | None = None,
    workers: int = 1,
    log_level: str | None = None,
) -> None:
    """Serve ``kind`` until interrupted; ``fd`` is an inherited listening socket (else ``host:port``).

    ``log_level`` (default ``GYMCKPT_LOG_LEVEL``, else info) is gymckpt's; uvicorn logs
    warnings only (its access log only at debug). ``OTEL_*`` variables configure telemetry
    in this process and in every worker.
    """
    import uvicorn

    if not 1 <= workers <= MAX_WORKERS:
        raise ValueError(f"workers must be between 1 and {MAX_WORKERS}, not {workers}")
    level = (log_level or os.environ.get(telemetry.LOG_LEVEL_ENV) or "info").lower()
    telemetry.setup_logging(level)
    os.environ[telemetry.LOG_LEVEL_ENV] = level  # the workers' own setup reads it
    telemetry.configure_from_environment(f"gymckpt-{kind}")
    uvicorn_options = {"log_level": "debug" if level == "debug" else "warning", "access_log": level == "debug"}
    where = {"fd": fd} if fd is not None else {"host": host, "port": port}
    if workers == 1:
        app, _ = build_server(kind, config_file)
        uvicorn.run(app, **uvicorn_options, **where)  # type: ignore[arg-type]
        return
    from gymckpt.workers.process import ENV_SOCKET, CoordinatorThread, worker_environment

    config = load_config(kind, config_file)
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
