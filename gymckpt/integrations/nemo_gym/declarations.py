"""What a NeMo Gym resources server declares about its sessions, and the hooks gymckpt makes of it.

A server says where its per-session state lives and gymckpt exports, restores and retires
it; no hand-written hooks. In code, on the server class (pydantic needs ``ClassVar``)::

    class MyServer(SimpleResourcesServer):
        checkpoint_mode: ClassVar[str] = "exported"           # or "stateless", "restart_only"
        checkpoint_session_state: ClassVar[str] = "session_id_to_counter"
        checkpoint_verify: ClassVar[str] = "wait"              # or "replay"
        session_id_to_counter: Dict[str, int] = Field(default_factory=dict)

or, for a class you do not own (NeMo Gym's own servers), in the config file's ``nemo_gym:``
block (``sessions``, ``session_state``, ``verify``); a file that says otherwise than the
class is refused at startup. The attribute holds ``{session id: state}``; a state is
exported as JSON through the attribute's type (a ``Dict[str, SomeModel]`` round-trips its
models) and restored the same way. The hooks stay available for state outside the process:
a class that defines ``export_session_states`` / ``restore_session_states`` /
``retire_session_state`` (async, as :class:`~gymckpt.participants.resources.CheckpointedResources`
names them) is exported through them.

Session ids are capture keys (:mod:`gymckpt.integrations.nemo_gym.sessions` binds every
request's session to its rollout), so the participant's sessions and the attribute's keys
are the same: an export that finds a tracked session missing from the attribute is
:class:`~gymckpt.errors.SessionsNotExported`, never an empty success.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter

from gymckpt.errors import SessionsNotExported, SettingsError
from gymckpt.identity import first_keys
from gymckpt.participants.resources import CheckpointedResources

if TYPE_CHECKING:
    from gymckpt.integrations.nemo_gym.config import NeMoGymBlock

__all__ = ["HOOK_NAMES", "DeclaredSessions", "SessionDeclaration", "declaration_of"]

#: the session hooks a server class may define itself (state outside the process)
HOOK_NAMES = ("export_session_states", "restore_session_states", "retire_session_state")
_MODES = ("exported", "stateless", "restart_only")
_VERIFY = ("wait", "replay")


@dataclass(frozen=True)
class SessionDeclaration:
    """How a resources server's sessions are checkpointed."""

    mode: str
    verify: str
    #: the attribute holding ``{session id: state}`` (None: the class's own hooks, or no state)
    state_attribute: str | None
    #: the class defines the session hooks itself
    own_hooks: bool


def _declared(cls: type, name: str) -> str | None:
    value = getattr(cls, name, None)
    return value if isinstance(value, str) else None


def declaration_of(cls: type, block: NeMoGymBlock, *, path: str = "") -> SessionDeclaration:
    """The declaration of ``cls`` and the config's ``nemo_gym:`` block; a conflict or a gap is a SettingsError."""
    problems: list[tuple[str, str]] = []

    def one(setting: str, given: str | None, attribute: str) -> str | None:
        declared = _declared(cls, attribute)
        if given is not None and declared is not None and given != declared:
            problems.append((f"nemo_gym.{setting}", f"{given!r}, but {cls.__name__}.{attribute} declares {declared!r}"))
        return given if given is not None else declared

    own_hooks = all(inspect.iscoroutinefunction(getattr(cls, hook, None)) for hook in HOOK_NAMES[:2])
    attribute = one("session_state", block.session_state, "checkpoint_session_state")
    mode = one("sessions", block.sessions, "checkpoint_mode") or (
        "exported" if attribute or own_hooks else "restart_only"
    )
    verify = one("verify", block.verify, "checkpoint_verify") or "wait"
    if mode not in _MODES:
        problems.append(("nemo_gym.sessions", f"{mode!r} is not one of {', '.join(_MODES)}"))
    if verify not in _VERIFY:
        problems.append(("nemo_gym.verify", f"{verify!r} is not one of {', '.join(_VERIFY)}"))
    if mode == "exported" and attribute is None and not own_hooks:
        problems.append(
            (
                "nemo_gym.session_state",
                f"required with sessions: exported: the attribute of {cls.__name__} holding {{session id: state}} "
                f"(or define {', '.join(HOOK_NAMES)} on the class)",
            )
        )
    if attribute is not None and attribute not in getattr(cls, "model_fields", {}):
        problems.append(("nemo_gym.session_state", f"{cls.__name__} has no field {attribute!r}"))
    if problems:
        raise SettingsError(problems, path=path)
    return SessionDeclaration(mode, verify, attribute, own_hooks and attribute is None)


def _value_adapter(cls: type, attribute: str) -> TypeAdapter[Any]:
    """A TypeAdapter of the attribute's values (``Dict[str, V]`` → V; anything else → Any)."""
    annotation = cls.model_fields[attribute].annotation  # type: ignore[attr-defined]
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    value_type: Any = args[1] if origin in (dict, typing.Dict, MutableMapping) and len(args) == 2 else Any  # noqa: UP006
    return TypeAdapter(value_type)


class DeclaredSessions(CheckpointedResources):
    """The checkpoint side of one NeMo Gym resources server, made from its declaration.

    Kept apart from the server object (a pydantic model), so the server class needs no
    mixin. ``restored`` is the sessions restored into this process that a request of theirs
    has not ended: the session binding accepts an earlier attempt's cookie for those only.
    """

    def __init__(self, server: Any, declaration: SessionDeclaration) -> None:
        self.server = server
        self.declaration = declaration
        self.checkpoint_mode = declaration.mode  # type: ignore[misc]  # per instance: the declaration decides
        self.checkpoint_verify = declaration.verify  # type: ignore[misc]
        self.restored: set[str] = set()
        attribute = declaration.state_attribute
        self._values = _value_adapter(type(server), attribute) if attribute is not None else None
        if attribute is not None and not isinstance(getattr(server, attribute, None), MutableMapping):
            raise SettingsError(
                [("nemo_gym.session_state", f"{type(server).__name__}.{attribute} is not a mapping of sessions")]
            )

    def _store(self) -> MutableMapping[str, Any]:
        assert self.declaration.state_attribute is not None
        return getattr(self.server, self.declaration.state_attribute)  # type: ignore[no-any-return]

    def holds(self, session_id: str) -> bool:
        """True when the declared attribute holds a state for ``session_id``."""
        return self.declaration.state_attribute is not None and session_id in self._store()

    async def export_session_states(self, session_ids: list[str]) -> dict[str, Any]:
        """Each session's state as JSON (copies); a tracked session the attribute lacks is an error."""
        if self.declaration.own_hooks:
            return await self.server.export_session_states(session_ids)  # type: ignore[no-any-return]
        store = self._store()
        missing = [session_id for session_id in session_ids if session_id not in store]
        if missing:
            attribute = f"{type(self.server).__name__}.{self.declaration.state_attribute}"
            raise SessionsNotExported(
                f"{attribute} holds no state for the tracked sessions {first_keys(missing)}: its /seed_session "
                "creates none (declare sessions: stateless or restart_only) or its state is keyed otherwise"
            )
        assert self._values is not None
        return {session_id: self._values.dump_python(store[session_id], mode="json") for session_id in session_ids}

    async def restore_session_states(self, states: dict[str, Any]) -> None:
        """Install restored states under the next attempts' session ids, all or none."""
        if self.declaration.own_hooks:
            await self.server.restore_session_states(states)
        else:
            assert self._values is not None
            values = {session_id: self._values.validate_python(state) for session_id, state in states.items()}
            self._store().update(values)
        self.restored.update(states)

    async def retire_session_state(self, session_id: str) -> None:
        """Free the session's state (an unknown one is no error)."""
        self.restored.discard(session_id)
        if self.declaration.own_hooks:
            retire = getattr(self.server, "retire_session_state", None)
            if inspect.iscoroutinefunction(retire):
                await retire(session_id)
            return
        if self.declaration.state_attribute is not None:
            self._store().pop(session_id, None)
