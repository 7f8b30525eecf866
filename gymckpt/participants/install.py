"""One call that makes any FastAPI app a checkpoint participant, or leaves it untouched."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gymckpt.control.plane import ControlPlane
from gymckpt.control.routes import install_control
from gymckpt.control.settings import CheckpointSettings, GymckptSettings
from gymckpt.participants.rollout import RolloutPrefixMiddleware

if TYPE_CHECKING:
    from fastapi import FastAPI

    from gymckpt.control.participant import Participant

__all__ = ["install_checkpointing"]


def install_checkpointing(
    app: FastAPI, participant: Participant, settings: CheckpointSettings | GymckptSettings | None
) -> ControlPlane | None:
    """Install the control routes, the rollout prefix and the participant's own middleware.

    With checkpointing off (or no settings) nothing is installed and None is returned, so
    the server behaves exactly as it does without gymckpt.
    """
    block = settings.checkpoint if isinstance(settings, GymckptSettings) else settings
    if block is None or not block.enabled:
        return None
    plane = ControlPlane(
        participant,
        lease_grace_seconds=block.lease_grace_seconds,
        storage_options=block.storage_options,
        allowed_roots=block.allowed_roots,
    )
    bind = getattr(participant, "bind", None)
    if callable(bind):
        bind(plane)
    middleware = getattr(participant, "middleware", None)
    if middleware is not None:
        app.add_middleware(middleware, participant=participant)
    app.add_middleware(RolloutPrefixMiddleware)
    install_control(app, plane, block.token)
    return plane
