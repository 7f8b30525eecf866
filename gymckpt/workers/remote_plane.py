"""What a worker's control routes call: the coordinator's control plane, over the worker's link.

:class:`RemotePlane` has the methods :func:`gymckpt.control.routes.control_router` calls on a
:class:`~gymckpt.control.plane.ControlPlane` (``status`` is awaitable here). Each forwards
its request to the coordinator as ``control {operation, body}`` and returns the reply as
the same reply model the plane returns, so a control call on any worker gets the reply a
single-process server would give; the seconds of the plane's steps (``export``, ``write``,
``read``, ``install``, …) that come with it join this route's log line. Errors come back
typed, with their status and code (the channel raises them as their class); a worker
without its coordinator answers 503 ``checkpoint_coordinator_unavailable``.

A call waits ``max(0, deadline_ts - now)`` plus
:data:`~gymckpt.workers.messages.REPLY_GRACE_SECONDS` for its reply; ``status``, which has
no deadline, :data:`~gymckpt.workers.messages.MESSAGE_TIMEOUT_SECONDS` plus the grace.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel, ValidationError

from gymckpt import telemetry
from gymckpt.control.models import (
    CommitReply,
    ForgetReply,
    PrepareReply,
    RenewReply,
    RestoreReply,
    ResumeReply,
    RetireReply,
    StatusReply,
)
from gymckpt.errors import ControlError, CoordinatorUnavailable
from gymckpt.workers.messages import CONTROL_OPERATIONS, Message, deadline_timeout

if TYPE_CHECKING:
    from collections.abc import Callable

    from gymckpt.control.models import CommitRequest, ControlRequest, ForgetRequest, RestoreRequest, RetireRequest
    from gymckpt.workers.link import WorkerLink

Reply = TypeVar("Reply", bound=BaseModel)

__all__ = ["RemotePlane"]


class RemotePlane:
    """The control plane of a worker: every operation runs on the coordinator's plane.

    ``clock`` gives epoch seconds (deadlines are epoch times).
    """

    def __init__(self, link: WorkerLink, *, clock: Callable[[], float] = time.time) -> None:
        self.link = link
        self.clock = clock

    async def status(self) -> StatusReply:
        """The coordinator's status (phase, lease, marks, merged readiness, ``workers``)."""
        return await self._forward("status", None, StatusReply)

    async def prepare(self, request: ControlRequest) -> PrepareReply:
        """Close every worker and wait until all are ready, or the deadline."""
        return await self._forward("prepare", request, PrepareReply)

    async def renew(self, request: ControlRequest) -> RenewReply:
        return await self._forward("renew", request, RenewReply)

    async def commit(self, request: CommitRequest) -> CommitReply:
        """Gather every worker's records into one records file and manifest."""
        return await self._forward("commit", request, CommitReply)

    async def restore(self, request: RestoreRequest) -> RestoreReply:
        return await self._forward("restore", request, RestoreReply)

    async def resume(self, request: ControlRequest) -> ResumeReply:
        return await self._forward("resume", request, ResumeReply)

    async def retire(self, request: RetireRequest) -> RetireReply:
        return await self._forward("retire", request, RetireReply)

    async def forget(self, request: ForgetRequest) -> ForgetReply:
        return await self._forward("forget", request, ForgetReply)

    async def close(self) -> None:
        """Nothing to stop: the coordinator's plane owns the lease (the link is closed by its owner)."""

    async def _forward(self, operation: str, request: ControlRequest | None, reply_model: type[Reply]) -> Reply:
        assert CONTROL_OPERATIONS[operation].reply is reply_model
        channel = self.link.channel
        if channel is None:
            raise CoordinatorUnavailable(
                f"this {self.link.participant.kind} worker is not connected to its checkpoint coordinator"
            )
        body = None if request is None else request.model_dump(mode="json")
        deadline_ts = None if request is None else request.deadline_ts
        reply = await channel.request(
            Message.CONTROL,
            {"operation": operation, "body": body, "trace": telemetry.inject({})},  # the coordinator continues it
            timeout=deadline_timeout(deadline_ts, clock=self.clock),
        )
        fields = reply if isinstance(reply, dict) else {}
        telemetry.add_steps(fields.get("steps"))  # the plane's steps, on this route's log line
        try:
            return reply_model.model_validate(fields.get("reply"))
        except ValidationError as exc:
            raise ControlError(f"the coordinator's reply to {operation} is malformed: {exc}"[:2000]) from exc
