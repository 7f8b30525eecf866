"""One call that makes any FastAPI app a checkpoint participant, or leaves it untouched."""

from __future__ import annotations

import logging
import multiprocessing
import os
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from gymckpt.control.plane import ControlPlane
from gymckpt.control.routes import install_control
from gymckpt.control.settings import CheckpointSettings, GymckptSettings, checkpointing_summary
from gymckpt.participants.rollout import RolloutPrefixMiddleware

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from fastapi import FastAPI

    from gymckpt.control.participant import Participant

__all__ = [
    "STARTUP_LINE_ENV",
    "SeveralWorkersError",
    "checkpoint_block",
    "create_control_plane",
    "install_checkpointing",
    "refuse_several_workers",
    "uvicorn_worker_count",
]

logger = logging.getLogger("gymckpt.participants")

#: set (to anything) by a launcher that logs the server's startup line itself, with the address it
#: listens on (``gymckpt serve``): :func:`install_checkpointing` then logs none of its own
STARTUP_LINE_ENV = "GYMCKPT_STARTUP_LINE_LOGGED"


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
        raise SeveralWorkersError(
            f"this server runs {workers} uvicorn workers with checkpointing on, but no checkpoint coordinator "
            "(each control call would reach an arbitrary worker): start it with `gymckpt serve KIND --workers "
            f"{workers}` (or a stack entry's `workers: {workers}`), whose main process coordinates the workers "
            "as one participant, or run it with --workers 1, or turn checkpoint.enabled off."
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
    if block.allowed_roots is None:
        logger.warning(
            "checkpointing is on without checkpoint.allowed_roots: whoever holds the control token can make "
            "this server write (commit) or read (restore) any path the process can write; set "
            "checkpoint.allowed_roots to the directories (or URL prefixes) checkpoints may use"
        )
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

    Either way one INFO line says whether checkpointing is on, and with which allowed roots
    (never the token), unless the launcher logs that itself (:data:`STARTUP_LINE_ENV`).
    """
    block = checkpoint_block(settings)
    if not os.environ.get(STARTUP_LINE_ENV):
        logger.info("%s: %s", app.title, checkpointing_summary(block))
    if block is None:
        return None
    if plane is None:
        plane = create_control_plane(participant, block)
    if participant.middleware is not None:
        app.add_middleware(participant.middleware, participant=participant)
    app.add_middleware(RolloutPrefixMiddleware)
    install_control(app, plane, block.token)
    _refuse_several_workers_at_startup(app)
    return plane
