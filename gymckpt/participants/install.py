"""One call that makes any FastAPI app a checkpoint participant, or leaves it untouched.

:func:`install_checkpointing` also sets up the process's logging and telemetry from its
environment (``GYMCKPT_LOG_LEVEL``, ``OTEL_*``: :func:`gymckpt.telemetry.configure_process`,
once per process, never over a logging setup already made), and remembers what it installed
on each app (:func:`installed_on`): ``gymckpt serve --app module:attr --workers N`` starts
the checkpoint coordinator from that. In each of its workers (whose app factory set
:func:`link_workers_with`), it links the app to the coordinator instead of installing a
control plane of its own.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import weakref
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gymckpt import telemetry
from gymckpt.control.plane import ControlPlane
from gymckpt.control.routes import install_control
from gymckpt.control.settings import CheckpointSettings, GymckptSettings, checkpointing_summary
from gymckpt.participants.rollout import RolloutPrefixMiddleware
from gymckpt.store.warm import warm_storage

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator

    from fastapi import FastAPI

    from gymckpt.control.participant import Participant

__all__ = [
    "APP_CONFIG_ENV",
    "STARTUP_LINE_ENV",
    "Installed",
    "SeveralWorkersError",
    "app_config_file",
    "building_only",
    "checkpoint_block",
    "create_control_plane",
    "install_checkpointing",
    "installed_on",
    "link_workers_with",
    "refuse_several_workers",
    "uvicorn_worker_count",
]

logger = logging.getLogger("gymckpt.participants")

#: set (to anything) by a launcher that logs the server's startup line itself, with the address it
#: listens on (``gymckpt serve``): :func:`install_checkpointing` then logs none of its own
STARTUP_LINE_ENV = "GYMCKPT_STARTUP_LINE_LOGGED"
#: the app's settings file, as ``gymckpt serve --app M:A --config FILE`` (or a stack file's ``app:``
#: entry with its ``config:``) names it (an absolute path): read it with :func:`app_config_file`
APP_CONFIG_ENV = "GYMCKPT_APP_CONFIG"


def app_config_file(default: str | Path | None = None) -> Path | None:
    """The settings file the launcher named for this app (:data:`APP_CONFIG_ENV`), else ``default``.

    ``gymckpt serve --app module:attr --config FILE`` sets it before it imports the app, in
    its own process and in every worker, so an app (or its factory) reads its settings as
    ``load_settings(app_config_file(default=...))``.
    """
    named = os.environ.get(APP_CONFIG_ENV, "").strip()
    if named:
        return Path(named)
    return Path(default) if default is not None else None


@dataclass(frozen=True)
class Installed:
    """What :func:`install_checkpointing` found for one app: its participant and the enabled block (None: off)."""

    kind: str
    instance: str
    block: CheckpointSettings | None
    title: str


#: app → what install_checkpointing found for it (weak: an app nobody serves goes away)
_installed: weakref.WeakKeyDictionary[Any, Installed] = weakref.WeakKeyDictionary()
#: set while an app is built only to learn what it installs (the main process of several workers)
_building_only = {"on": False}


def installed_on(app: Any) -> Installed | None:
    """What :func:`install_checkpointing` found for ``app`` in this process (None: it was not called for it)."""
    return _installed.get(app)


@contextmanager
def building_only() -> Iterator[None]:
    """Apps built in this block are not served here: their control planes skip the startup warnings.

    ``gymckpt serve --app M:A --workers N`` builds the app once in its main process only to
    learn its participant (:func:`installed_on`); the coordinator it starts warns instead.
    """
    before = _building_only["on"]
    _building_only["on"] = True
    try:
        yield
    finally:
        _building_only["on"] = before


#: what wires an app in a worker of a coordinated server (None: this process is no such worker)
_worker_link: dict[str, Callable[[Any, Participant | None, CheckpointSettings | None], Any] | None] = {"link": None}


def link_workers_with(link: Callable[[Any, Participant | None, CheckpointSettings | None], Any] | None) -> None:
    """In a worker of ``gymckpt serve --app M:A --workers N``: how :func:`install_checkpointing` wires an app.

    ``link(app, participant, block)`` (participant and block None with checkpointing off)
    links the app to the main process's coordinator and returns the worker's plane; the
    worker's app factory sets it before the app is built (None undoes it).
    """
    _worker_link["link"] = link


class SeveralWorkersError(RuntimeError):
    """Checkpointing is on in one of several uvicorn workers that no gymckpt coordinator started."""


def uvicorn_worker_count() -> int:
    """How many uvicorn workers serve this server: 1 unless this process is a ``--workers N`` worker.

    uvicorn's multiprocess supervisor starts each worker as a ``spawn`` process whose target
    is ``uvicorn._subprocess.subprocess_started`` with the server's ``Config`` (and its
    ``workers``, from ``--workers`` or ``WEB_CONCURRENCY``) among the keyword arguments; the
    worker's :func:`multiprocessing.current_process` is that process object.
    """
    process = multiprocessing.current_process()
    target = getattr(process, "_target", None)
    kwargs = getattr(process, "_kwargs", None)
    if getattr(target, "__module__", None) != "uvicorn._subprocess" or not isinstance(kwargs, dict):
        return 1
    workers = getattr(kwargs.get("config"), "workers", 1)
    return workers if isinstance(workers, int) and workers > 1 else 1


def refuse_several_workers() -> None:
    """Raise :class:`SeveralWorkersError` when this process is one of several uvicorn workers."""
    workers = uvicorn_worker_count()
    if workers > 1:
        config = (getattr(multiprocessing.current_process(), "_kwargs", None) or {}).get("config")
        target = getattr(config, "app", None)
        app = target if isinstance(target, str) and ":" in target else "MODULE:ATTR"
        raise SeveralWorkersError(
            f"this server runs {workers} uvicorn workers with checkpointing on, but no checkpoint coordinator "
            f"(each control call would reach an arbitrary worker): start it with `gymckpt serve --app {app} "
            f"--workers {workers}` (a reference server: `gymckpt serve KIND --workers {workers}`; a stack entry: "
            f"`workers: {workers}`), whose main process coordinates the workers as one participant, or run it "
            "with --workers 1, or turn checkpoint.enabled off."
        )


def _refuse_several_workers_at_startup(app: FastAPI) -> None:
    """Check at lifespan startup (a failed startup makes uvicorn exit), before the app's own lifespan."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[Any]:
        refuse_several_workers()
        async with inner(app) as state:
            yield state

    app.router.lifespan_context = lifespan


def checkpoint_block(settings: CheckpointSettings | GymckptSettings | None) -> CheckpointSettings | None:
    """The enabled ``checkpoint:`` block of ``settings``, or None when checkpointing is off."""
    block = settings.checkpoint if isinstance(settings, GymckptSettings) else settings
    return block if block is not None and block.enabled else None


def create_control_plane(participant: Participant, block: CheckpointSettings) -> ControlPlane:
    """What runs once per server: the control plane (and the stores it opens), bound to ``participant``."""
    if block.allowed_roots is None and not _building_only["on"]:
        logger.warning(
            "checkpointing is on without checkpoint.allowed_roots: whoever holds the control token can make "
            "this server write (commit) or read (restore) any path the process can write; set "
            "checkpoint.allowed_roots to the directories (or URL prefixes) checkpoints may use"
        )
    if not _building_only["on"]:
        warm_storage(block.allowed_roots, block.storage_options)
    plane = ControlPlane(
        participant,
        lease_grace_seconds=block.lease_grace_seconds,
        storage_options=block.storage_options,
        allowed_roots=block.allowed_roots,
    )
    participant.bind(plane)
    return plane


def install_checkpointing(
    app: FastAPI,
    participant: Participant,
    settings: CheckpointSettings | GymckptSettings | None,
    *,
    plane: ControlPlane | None = None,
) -> ControlPlane | None:
    """Install the control routes, the rollout prefix and the participant's own middleware.

    With checkpointing off (or no settings) nothing is installed and None is returned, so
    the server behaves exactly as it does without gymckpt. ``plane`` is one made by
    :func:`create_control_plane` (what runs once per server); without it, one is made here.

    First, once per process, logging and telemetry are set up from ``GYMCKPT_LOG_LEVEL`` and
    ``OTEL_*`` (:func:`gymckpt.telemetry.configure_process`: gymckpt's log handler only where
    no logging was set up, the service name ``gymckpt-<participant kind>``); a bad value
    raises a ValueError naming the variable. Either way one INFO line says whether
    checkpointing is on, and with which allowed roots (never the token), unless the launcher
    logs that itself (:data:`STARTUP_LINE_ENV`).

    In a worker of ``gymckpt serve --app M:A --workers N`` the app is linked to the main
    process's coordinator (:func:`~gymckpt.workers.process.install_worker`): its control
    routes answer for the whole server, sessions are routed to the worker that holds them,
    and the plane returned is the worker's remote one.
    """
    telemetry.configure_process(f"gymckpt-{participant.kind}")
    block = checkpoint_block(settings)
    _installed[app] = Installed(participant.kind, participant.instance, block, str(getattr(app, "title", "")))
    if not os.environ.get(STARTUP_LINE_ENV):
        logger.info("%s: %s", app.title, checkpointing_summary(block))
    link = _worker_link["link"]
    if link is not None:  # a worker of several: the main process's coordinator holds the plane
        return link(app, participant if block else None, block)  # type: ignore[no-any-return]
    if block is None:
        return None
    if plane is None:
        plane = create_control_plane(participant, block)
    participant.exempt_paths = participant.exempt_paths | frozenset(block.exempt_paths)
    if participant.middleware is not None:
        app.add_middleware(participant.middleware, participant=participant)
    app.add_middleware(RolloutPrefixMiddleware)
    install_control(app, plane, block.token)
    _refuse_several_workers_at_startup(app)
    return plane
