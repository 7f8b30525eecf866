"""The control routes under ``/ng-control/v1/checkpoint/`` and the one error handler.

Every control route refuses a call without the bearer token before anything reads its body,
however the call reached it: the route class itself compares the ``Authorization`` header
(:class:`_ControlRoute`, constant time) before it hands the request to FastAPI's handler,
which reads and decodes the body. A middleware that rewrites the path (the rollout prefix,
``/ng-rollout/<key>/ng-control/v1/checkpoint/…``, which stays reachable, as the reference's
routes are: a prefix names an episode and grants nothing) or reorders the stack cannot
bypass it. :class:`ControlAuthMiddleware` refuses early as well, also for control paths no
route serves, with or without the prefix.
"""

from __future__ import annotations

import inspect
import secrets
from typing import TYPE_CHECKING, Any, ClassVar

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
from gymckpt.identity import ROLLOUT_PREFIX

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine
    from contextlib import AbstractContextManager

    from starlette.responses import Response

    from gymckpt.control.plane import ControlPlane

__all__ = [
    "CONTROL_PREFIX",
    "ControlAuthMiddleware",
    "control_router",
    "install_control",
    "install_error_handlers",
    "is_control_path",
]

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


def is_control_path(path: str) -> bool:
    """True for a path a control route would serve: under ``CONTROL_PREFIX``, behind a rollout prefix or not."""
    if path.startswith(ROLLOUT_PREFIX):
        # the path after the capture key, whether the key is valid or not (an invalid one is a 400 anyway)
        path = "/" + path[len(ROLLOUT_PREFIX) :].partition("/")[2]
    return path == CONTROL_PREFIX or path.startswith(CONTROL_PREFIX + "/")


def _authorization(scope: Any) -> bytes:
    """The request's first ``Authorization`` header value (empty when there is none)."""
    return next((value for name, value in scope["headers"] if name == b"authorization"), b"")


class ControlAuthMiddleware:
    """Refuse control calls without the bearer token before anything reads their body.

    The route class checks again (so no path rewriting or middleware order can bypass the
    check); this middleware also makes a missing token a 401 for a control path no route
    serves, with or without a rollout prefix.
    """

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and is_control_path(scope["path"])
            and not secrets.compare_digest(_authorization(scope), self.expected)
        ):
            await _refusal()(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _refusal() -> Response:
    """The 401 of a control call without the token, sent before its body is read.

    The connection stays open: uvicorn discards the rest of the body as it arrives (no memory
    grows), and the body deadline (:mod:`gymckpt.stack.request_deadlines`) closes it if the
    client sends it too slowly. Closing at once could reset the connection before the client
    read the 401.
    """
    return error_response(Unauthorized("missing or wrong bearer token"))


class _OrjsonRequest(Request):
    """A request whose JSON body orjson decodes (a commit or restore names every episode of its scope)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())  # its JSONDecodeError is json's: a 422 as before
        return self._json


class _ControlRoute(APIRoute):
    """A control route: the bearer token is checked before the body is read, and the JSON body is
    decoded with orjson (the standard library's decoder took ~40 ms a call for a scope of 12,000
    episodes).

    :func:`control_router` makes a subclass per router that sets :attr:`expected_authorization`.
    """

    expected_authorization: ClassVar[bytes] = b""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        expected = self.expected_authorization
        if not expected:
            raise ValueError("a control route needs the expected Authorization value")

        async def authorized_handler(request: Request) -> Response:
            # before the handler, which reads and decodes the body: whatever path reached this route
            if not secrets.compare_digest(_authorization(request.scope), expected):
                return _refusal()
            return await handler(_OrjsonRequest(request.scope, request.receive))

        return authorized_handler


def control_router(plane: ControlPlane, token: str) -> APIRouter:
    """The control routes of one server, behind ``Authorization: Bearer <token>``."""
    if not token:
        raise ValueError("the control routes need a non-empty control_auth_token")
    expected = token.encode()

    async def authorize(credentials: HTTPAuthorizationCredentials | None = _BEARER) -> None:
        given = credentials.credentials.encode() if credentials is not None else b""
        if credentials is None or not secrets.compare_digest(given, expected):
            raise Unauthorized("missing or wrong bearer token")

    route_class = type("_AuthorizedControlRoute", (_ControlRoute,), {"expected_authorization": b"Bearer " + expected})
    router = APIRouter(
        prefix=CONTROL_PREFIX,
        tags=["checkpoint control"],
        dependencies=[Depends(authorize)],  # checked by the route class already; documents the scheme
        route_class=route_class,
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
