"""The control routes under ``/ng-control/v1/checkpoint/`` and the one error handler."""

from __future__ import annotations

import inspect
import secrets
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from opentelemetry.trace import SpanKind
from starlette.exceptions import HTTPException as StarletteHTTPException

from gymckpt import telemetry
from gymckpt.control.models import (
    CommitReply,
    CommitRequest,
    ControlRequest,
    ErrorBody,
    ForgetReply,
    ForgetRequest,
    PrepareReply,
    RenewReply,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    RetireReply,
    RetireRequest,
    StatusReply,
)
from gymckpt.control.responses import error_response, handle_gymckpt_error
from gymckpt.errors import GymckptError, InvalidRequest, Unauthorized

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine
    from contextlib import AbstractContextManager

    from starlette.responses import Response

    from gymckpt.control.plane import ControlPlane

__all__ = ["CONTROL_PREFIX", "ControlAuthMiddleware", "control_router", "install_control", "install_error_handlers"]

CONTROL_PREFIX = "/ng-control/v1/checkpoint"

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": description}
    for status, description in (
        (400, "unsupported_storage, invalid_rollout_id"),
        (401, "unauthorized"),
        (403, "checkpoint_dir_not_allowed"),
        (409, "stale_checkpoint, checkpoint_conflict, invalid_phase, deadline_exceeded, export_failed, …"),
        (422, "invalid_checkpoint_state, or an invalid request"),
        (503, "storage_error"),
    )
}
_BEARER = Depends(HTTPBearer(auto_error=False, description="The checkpoint block's control_auth_token."))


class ControlAuthMiddleware:
    """Refuse control calls without the bearer token before anything reads their body.

    The route dependency checks again (and documents the scheme); this middleware makes a
    missing token a 401 even when the body is not JSON.
    """

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(CONTROL_PREFIX + "/"):
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not secrets.compare_digest(given, self.expected):
                await error_response(Unauthorized("missing or wrong bearer token"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _OrjsonRequest(Request):
    """A request whose JSON body orjson decodes (a commit or restore names every episode of its scope)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())  # its JSONDecodeError is json's: a 422 as before
        return self._json


class _OrjsonRoute(APIRoute):
    """A control route reading its JSON body with orjson (the standard library's decoder took ~40 ms a
    call for a scope of 12,000 episodes)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def orjson_handler(request: Request) -> Response:
            return await handler(_OrjsonRequest(request.scope, request.receive))

        return orjson_handler


def control_router(plane: ControlPlane, token: str) -> APIRouter:
    """The control routes of one server, behind ``Authorization: Bearer <token>``."""
    if not token:
        raise ValueError("the control routes need a non-empty control_auth_token")
    expected = token.encode()

    async def authorize(credentials: HTTPAuthorizationCredentials | None = _BEARER) -> None:
        given = credentials.credentials.encode() if credentials is not None else b""
        if credentials is None or not secrets.compare_digest(given, expected):
            raise Unauthorized("missing or wrong bearer token")

    router = APIRouter(
        prefix=CONTROL_PREFIX,
        tags=["checkpoint control"],
        dependencies=[Depends(authorize)],
        route_class=_OrjsonRoute,
    )
    kind, instance = _identity(plane)

    def traced(name: str, checkpoint_id: str) -> AbstractContextManager[telemetry.Operation]:
        """The operation's SERVER span (continuing the caller's trace), duration metric and INFO line."""
        return telemetry.operation(
            name, kind=kind, instance=instance, checkpoint_id=checkpoint_id, span_kind=SpanKind.SERVER
        )

    @router.get("/status", response_model=StatusReply, responses=_ERRORS)
    async def status() -> StatusReply:
        # a worker's plane forwards status to its coordinator, so it may be awaitable
        result = plane.status()
        return await result if inspect.isawaitable(result) else result  # type: ignore[no-any-return]

    @router.post("/prepare", response_model=PrepareReply, responses=_ERRORS)
    async def prepare(request: ControlRequest) -> PrepareReply:
        with traced("prepare", request.checkpoint_id) as op:
            reply = await plane.prepare(request)
            blockers = reply.report.blocker_count or len(reply.report.blockers)
            op.set(phase=str(reply.phase), blockers=blockers, prepared=reply.phase == "prepared")
            telemetry.prepared(kind=kind, blockers=blockers, in_flight=sum(reply.report.counts.values()))
            return reply

    @router.post("/renew", response_model=RenewReply, responses=_ERRORS)
    async def renew(request: ControlRequest) -> RenewReply:
        with traced("renew", request.checkpoint_id) as op:
            reply = await plane.renew(request)
            op.set(phase=str(reply.phase))
            return reply

    @router.post("/commit", response_model=CommitReply, responses=_ERRORS)
    async def commit(request: CommitRequest) -> CommitReply:
        with traced("commit", request.checkpoint_id) as op:
            reply = await plane.commit(request)
            op.set(records=reply.record_count, bytes=reply.records_bytes, episodes=len(reply.episode_ids))
            return reply

    @router.post("/restore", response_model=RestoreReply, responses=_ERRORS)
    async def restore(request: RestoreRequest) -> RestoreReply:
        with traced("restore", request.checkpoint_id) as op:
            reply = await plane.restore(request)
            op.set(records=len(reply.restored), episodes=len(request.episode_ids))
            return reply

    @router.post("/resume", response_model=ResumeReply, responses=_ERRORS)
    async def resume(request: ControlRequest) -> ResumeReply:
        with traced("resume", request.checkpoint_id) as op:
            reply = await plane.resume(request)
            op.set(phase=str(reply.phase))
            return reply

    @router.post("/retire", response_model=RetireReply, responses=_ERRORS)
    async def retire(request: RetireRequest) -> RetireReply:
        with traced("retire", request.checkpoint_id) as op:
            reply = await plane.retire(request)
            op.set(episodes=len(request.episode_ids))
            return reply

    @router.post("/forget", response_model=ForgetReply, responses=_ERRORS)
    async def forget(request: ForgetRequest) -> ForgetReply:
        with traced("forget", request.checkpoint_id) as op:
            reply = await plane.forget(request)
            op.set(rollouts=len(request.rollout_ids))
            return reply

    return router


def _identity(plane: Any) -> tuple[str, str]:
    """The participant's kind and instance (a worker's plane knows them through its link)."""
    participant = getattr(plane, "participant", None) or getattr(getattr(plane, "link", None), "participant", None)
    return str(getattr(participant, "kind", "unknown")), str(getattr(participant, "instance", "unknown"))


def install_error_handlers(app: FastAPI) -> None:
    """Map every gymckpt error to its wire code and status; control-route validation errors too.

    Validation errors of the app's own routes keep the handler the app had.
    """
    app.add_exception_handler(GymckptError, handle_gymckpt_error)
    previous = app.exception_handlers.get(RequestValidationError, request_validation_exception_handler)

    async def validation_error(request: Request, exc: Exception) -> Response:
        if not request.url.path.startswith(CONTROL_PREFIX + "/"):
            return await previous(request, exc)  # type: ignore[no-any-return]
        assert isinstance(exc, RequestValidationError)
        detail = "; ".join(
            f"{'.'.join(str(part) for part in error.get('loc', ()))}: {error.get('msg', '')}" for error in exc.errors()
        )
        return error_response(InvalidRequest(detail[:2000]))

    app.add_exception_handler(RequestValidationError, validation_error)
    previous_http = app.exception_handlers.get(StarletteHTTPException, http_exception_handler)

    async def http_error(request: Request, exc: Exception) -> Response:
        if not request.url.path.startswith(CONTROL_PREFIX + "/"):
            return await previous_http(request, exc)  # type: ignore[no-any-return]
        assert isinstance(exc, StarletteHTTPException)
        refusal = Unauthorized if exc.status_code == 401 else InvalidRequest
        return error_response(refusal(str(exc.detail)), status=exc.status_code)

    app.add_exception_handler(StarletteHTTPException, http_error)


def install_control(app: FastAPI, plane: ControlPlane, token: str) -> None:
    """Add the control routes and the error handlers to ``app``, and stop the lease on shutdown."""
    app.include_router(control_router(plane, token))
    app.add_middleware(ControlAuthMiddleware, token=token)
    app.add_middleware(telemetry.TraceContextMiddleware)  # outermost: the caller's trace for the whole call
    install_error_handlers(app)
    app.router.on_shutdown.append(plane.close)
