"""The one way an error goes on the wire: ``{"error": {"code", "detail"}}`` with the class's status."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse

from gymckpt import telemetry
from gymckpt.errors import GymckptError, Unauthorized

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

__all__ = ["error_body", "error_response", "handle_gymckpt_error"]


def error_body(code: str, detail: str) -> dict[str, Any]:
    """The wire form of an error."""
    return {"error": {"code": code, "detail": detail}}


def error_response(exc: GymckptError, *, status: int | None = None) -> JSONResponse:
    """The reply for ``exc``: its wire code and detail, its status (or ``status``), and for
    :class:`~gymckpt.errors.Unauthorized` the ``WWW-Authenticate`` challenge."""
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthorized) else None
    telemetry.refused(exc.code)
    return JSONResponse(error_body(exc.code, str(exc)), status_code=status or exc.status, headers=headers)


async def handle_gymckpt_error(request: Request, exc: Exception) -> Response:
    """The FastAPI exception handler of every gymckpt error."""
    assert isinstance(exc, GymckptError)
    return error_response(exc)
