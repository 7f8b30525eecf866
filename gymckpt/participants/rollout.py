"""The rollout context of a request: which episode attempt a model or resources call belongs to.

With checkpointing on, callers put the capture key in the path, ``/ng-rollout/<key>/…``;
:class:`RolloutPrefixMiddleware` strips it, so the app's routes stay as they are, and
makes the episode available as :func:`current_episode` for the request's duration.

The server's ``receive`` and ``send`` are called outside any episode (:func:`outside_episodes`):
uvicorn starts a kept-alive connection's next request in a copy of the context it last
re-armed the connection's reader in, and it re-arms it from inside ``receive()`` (a large
body) and ``send()`` (a pipelined request). Without that, the next request on the
connection would run as this one's rollout.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from gymckpt.control.responses import error_response
from gymckpt.control.routes import CONTROL_PREFIX
from gymckpt.errors import InvalidRolloutId
from gymckpt.identity import ROLLOUT_PREFIX, EpisodeId, split_rollout_path

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "SESSION_HEADER",
    "UNFENCED_PATHS",
    "RolloutPrefixMiddleware",
    "SessionHeaderMiddleware",
    "current_episode",
    "episode_context",
    "is_unfenced",
    "outside_episodes",
]

#: with checkpointing off there is no rollout prefix: the reference servers name the episode
#: (their session) in this header instead
SESSION_HEADER = "x-session-id"

#: requests that are not rollout work: never refused for lacking a rollout, never counted or
#: held by admission (health probes and the API docs). The one list every participant's
#: fencing consults; the control routes (under ``CONTROL_PREFIX``) are never fenced either.
UNFENCED_PATHS: frozenset[str] = frozenset(
    {"/health", "/healthz", "/livez", "/readyz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
)


def is_unfenced(path: str) -> bool:
    """True for a path no participant fences: a control route, a probe or the API docs."""
    return path in UNFENCED_PATHS or path == CONTROL_PREFIX or path.startswith(CONTROL_PREFIX + "/")


_CURRENT: ContextVar[EpisodeId | None] = ContextVar("gymckpt_rollout_episode", default=None)


def current_episode() -> EpisodeId | None:
    """The episode attempt of the request being handled (None when it carries no rollout prefix)."""
    return _CURRENT.get()


@contextmanager
def episode_context(episode: EpisodeId | None) -> Iterator[EpisodeId | None]:
    """Run code as part of ``episode`` (e.g. an environment's downstream calls)."""
    token = _CURRENT.set(episode)
    try:
        yield episode
    finally:
        _CURRENT.reset(token)


def outside_episodes(receive: Any, send: Any) -> tuple[Any, Any]:
    """The server's ``receive`` and ``send``, each called with no episode current (module notes)."""

    async def receive_outside() -> Any:
        token = _CURRENT.set(None)
        try:
            return await receive()
        finally:
            _CURRENT.reset(token)

    async def send_outside(message: Any) -> None:
        token = _CURRENT.set(None)
        try:
            await send(message)
        finally:
            _CURRENT.reset(token)

    return receive_outside, send_outside


class RolloutPrefixMiddleware:
    """Strip ``/ng-rollout/<capture key>`` from the path and set the request's episode.

    A control route stays reachable behind the prefix (the prefix grants nothing): the
    route itself refuses a call without the token before its body is read
    (:mod:`gymckpt.control.routes`), whatever path rewriting brought the call there.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        receive, send = outside_episodes(receive, send)  # an episode set inside (by any code) stays inside
        if scope["type"] != "http" or not scope["path"].startswith(ROLLOUT_PREFIX.rstrip("/")):
            await self.app(scope, receive, send)
            return
        try:
            episode, rest = split_rollout_path(scope["path"])
        except InvalidRolloutId as exc:
            response = error_response(exc)
            await response(scope, receive, send)
            return
        scope = dict(scope)
        scope["path"] = rest
        scope["raw_path"] = rest.encode()
        token = _CURRENT.set(episode)
        try:
            await self.app(scope, receive, send)
        finally:
            _CURRENT.reset(token)


class SessionHeaderMiddleware:
    """Without checkpointing: take the request's episode from ``x-session-id`` when it names one."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            receive, send = outside_episodes(receive, send)
            value = next((v for name, v in scope["headers"] if name == SESSION_HEADER.encode()), None)
            if value is not None:
                try:
                    episode = EpisodeId.from_capture_key(value.decode("latin-1"))
                except InvalidRolloutId:
                    episode = None
                if episode is not None:
                    token = _CURRENT.set(episode)
                    try:
                        await self.app(scope, receive, send)
                    finally:
                        _CURRENT.reset(token)
                    return
        await self.app(scope, receive, send)
