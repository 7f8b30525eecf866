"""NeMo Gym sessions bound by gymckpt: a request's session id is its rollout's capture key.

NeMo Gym keys a resources server's per-session state by ``request.session["session_id"]``,
which its ``SessionMiddleware`` reads from a signed cookie (or a new random id). With
checkpointing on, :class:`SessionBindingMiddleware` runs inside that middleware and before
NeMo Gym's ``add_session_id``, and sets the session id to the capture key of the request's
rollout (from its ``/ng-rollout/<key>`` prefix). So:

- state is keyed by rollout attempt: a restore installs it under the next attempt's key,
  and attempt N+1 finds it with or without the cookie it was given before the crash;
- a cookie (or an MCP session token, ``X-NeMo-Gym-Session-Token``) bound to another
  rollout, to a later attempt, or to an earlier attempt the request's attempt does not
  continue by a restore, is refused: 409 ``session_rollout_mismatch``;
- the cookie's name and signing key (NeMo Gym derives both from the server's config name)
  no longer carry the state: a restart under another name finds every session;
- the signing key of session cookies and MCP tokens is no longer NeMo Gym's public
  ``<class>___<config name>`` but :func:`session_signing_key`, derived from the control
  token and the server class: a secret, the same in every worker and after a restart under
  another config name, so a cookie or token handed out before it is still read (and still
  refused when it is another rollout's), never silently dropped.

The middleware is placed by construction (:func:`bind_sessions`); a server without NeMo
Gym's session middleware is refused at startup.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import TYPE_CHECKING, Any

from gymckpt.control.responses import error_response
from gymckpt.errors import InvalidRolloutId, SessionRolloutMismatch, SettingsError
from gymckpt.identity import EpisodeId
from gymckpt.participants.rollout import current_episode

if TYPE_CHECKING:
    from fastapi import FastAPI

    from gymckpt.integrations.nemo_gym.declarations import DeclaredSessions
    from gymckpt.participants.resources import ResourcesParticipant

__all__ = [
    "SESSION_ID_KEY",
    "TOKEN_HEADER",
    "SessionBindingMiddleware",
    "bind_sessions",
    "check_bound",
    "session_signing_key",
    "signed_with",
]

#: NeMo Gym's session key (``nemo_gym.server_utils.SESSION_ID_KEY``)
SESSION_ID_KEY = "session_id"
#: NeMo Gym's MCP session token header (``nemo_gym.base_resources_server.NEMO_GYM_MCP_SESSION_TOKEN_HEADER``)
TOKEN_HEADER = "x-nemo-gym-session-token"
#: paths whose success ends a session (the participant stops tracking it there)
_ENDING_PATHS = frozenset({"/verify", "/close_session"})
_KEY_LABEL = b"gymckpt nemo-gym session signing key\0"


def session_signing_key(control_token: str, server_class: type) -> str:
    """The key a checkpointed NeMo Gym server signs its session cookies and MCP tokens with.

    Derived from the control token (a secret every worker and every restart of the server
    reads) and the server class, never from the config name: renaming the instance keeps it.
    """
    label = _KEY_LABEL + server_class.__name__.encode()
    return hmac.new(control_token.encode(), label, hashlib.sha256).hexdigest()


def signed_with(server_class: type, key: str) -> type:
    """``server_class`` with its MCP session tokens signed with ``key`` (its own salt kept).

    The cookie key is set on the session middleware (:func:`bind_sessions`);
    ``get_session_middleware_key`` stays NeMo Gym's (it also names the cookie, the
    profiler's directory and error messages: public, so never the key).
    """
    own = getattr(server_class, "_mcp_token_serializer", None)
    if own is None:
        return server_class

    def _mcp_token_serializer(self: Any) -> Any:
        from itsdangerous import URLSafeSerializer

        return URLSafeSerializer(key, salt=own(self).salt)

    namespace = {
        "_mcp_token_serializer": _mcp_token_serializer,
        "__module__": server_class.__module__,
        "__qualname__": server_class.__qualname__,
        "__doc__": server_class.__doc__,
    }
    return type(server_class.__name__, (server_class,), namespace)


def check_bound(given: str | None, episode: EpisodeId, *, what: str, continues_restored: bool) -> None:
    """Refuse a session id ``given`` (a cookie's, a token's) that is not ``episode``'s.

    Accepted: none, the episode's own capture key, or an earlier attempt of the same rollout
    when this attempt continues restored state (``continues_restored``).
    """
    if given is None or given == episode.capture_key:
        return
    try:
        bound = EpisodeId.from_capture_key(given)
    except InvalidRolloutId:
        raise SessionRolloutMismatch(
            f"the {what} names session {given!r}, which no rollout owns; send the request without it"
        ) from None
    if bound.rollout_id != episode.rollout_id:
        raise SessionRolloutMismatch(
            f"the {what} is bound to rollout {bound.rollout_id!r}, not {episode.rollout_id!r}: send each rollout's own"
        )
    if bound.attempt > episode.attempt or not continues_restored:
        raise SessionRolloutMismatch(
            f"the {what} is bound to attempt {bound.capture_key!r}, which {episode.capture_key!r} does not continue: "
            "send the request without it"
        )


class SessionBindingMiddleware:
    """Inside NeMo Gym's SessionMiddleware: bind the request's session (and MCP token) to its capture key."""

    def __init__(self, app: Any, sessions: DeclaredSessions, participant: ResourcesParticipant | None = None) -> None:
        self.app = app
        self.sessions = sessions
        self.participant = participant
        serializer = getattr(sessions.server, "_mcp_token_serializer", None)
        self._tokens = serializer() if callable(serializer) else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        episode = current_episode()
        session = scope.get("session") if scope["type"] == "http" else None
        if episode is None or session is None:
            await self.app(scope, receive, send)
            return
        key = episode.capture_key
        continues = key in self.sessions.restored
        try:
            check_bound(session.get(SESSION_ID_KEY), episode, what="session cookie", continues_restored=continues)
            if self._tokens is not None:
                scope = self._rebind_token(scope, episode, continues)
        except SessionRolloutMismatch as exc:
            await error_response(exc)(scope, receive, send)
            return
        session[SESSION_ID_KEY] = key
        status = {"code": 0}

        async def watch(message: Any) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        await self.app(scope, receive, watch)
        participant = self.participant
        if (
            participant is not None
            and status["code"] < 400
            and scope.get("path") not in _ENDING_PATHS
            and self.sessions.holds(key)
        ):
            participant.session_started(key)  # state made outside /seed_session (a tool call) is a session too

    def _rebind_token(self, scope: Any, episode: EpisodeId, continues: bool) -> Any:
        """Check the MCP token's session and sign it again for this attempt (it carries the capture key)."""
        from itsdangerous import BadSignature

        assert self._tokens is not None
        headers = list(scope.get("headers") or [])
        raw = next((value for name, value in headers if name == TOKEN_HEADER.encode()), None)
        if raw is None:
            return scope
        try:
            given = self._tokens.loads(raw.decode("latin-1"))
        except BadSignature:
            given = None  # signed with another key (another control token): the prefix names the rollout, remade
        check_bound(
            given if isinstance(given, str) else None, episode, what="MCP session token", continues_restored=continues
        )
        token = self._tokens.dumps(episode.capture_key).encode("latin-1")
        scope = dict(scope)
        scope["headers"] = [(name, token if name == TOKEN_HEADER.encode() else value) for name, value in headers]
        return scope


def bind_sessions(
    app: FastAPI, sessions: DeclaredSessions, participant: ResourcesParticipant | None, *, signing_key: str
) -> None:
    """Place :class:`SessionBindingMiddleware` right inside NeMo Gym's SessionMiddleware, which signs with ``signing_key``."""
    from starlette.middleware.sessions import SessionMiddleware

    stack = app.user_middleware  # outermost first
    positions = [index for index, entry in enumerate(stack) if entry.cls is SessionMiddleware]
    if not positions:
        raise SettingsError(
            f"{type(sessions.server).__name__}.setup_webserver installs no SessionMiddleware "
            "(NeMo Gym's setup_session_middleware): its sessions cannot be bound to rollouts"
        )
    from starlette.middleware import Middleware

    for index in positions:
        entry = stack[index]
        stack[index] = Middleware(SessionMiddleware, *entry.args, **{**entry.kwargs, "secret_key": signing_key})
    stack.insert(positions[-1] + 1, Middleware(SessionBindingMiddleware, sessions=sessions, participant=participant))
