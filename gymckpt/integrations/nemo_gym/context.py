"""What the current task runs as: the agent activation whose calls are journaled steps.

Kept in a context variable, set for every request the agent serves
(:class:`~gymckpt.integrations.nemo_gym.agent.AgentActivationMiddleware`): a kept-alive
connection's next request may start in a copy of the previous one's context
(:mod:`gymckpt.participants.rollout`), and must not run as its activation.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gymckpt.integrations.nemo_gym.journal import Journal
    from gymckpt.participants.agent import PlainActivation

__all__ = ["IN_PROCESS_KEY", "ActiveActivation", "active_activation", "activation_context"]

#: set in the ASGI scope of a call an activation makes to its own server (run in its task)
IN_PROCESS_KEY = "gymckpt.nemo_gym.in_process"


@dataclass
class ActiveActivation:
    """The agent activation this task runs: its episode's steps and journal."""

    key: str
    activation: PlainActivation
    journal: Journal
    #: resources server → the verify mode its seed reply reported
    verify_modes: dict[str, str] = field(default_factory=dict)
    #: server → the routing cookie its reply set (the worker holding the rollout's session there)
    routing_cookies: dict[str, str] = field(default_factory=dict)


_ACTIVE: ContextVar[ActiveActivation | None] = ContextVar("gymckpt_nemo_gym_activation", default=None)


def active_activation() -> ActiveActivation | None:
    """The agent activation of the current task, if any."""
    return _ACTIVE.get()


class activation_context:
    """Run a block as part of ``active`` (its ServerClient calls are its steps)."""

    def __init__(self, active: ActiveActivation | None) -> None:
        self.active = active

    def __enter__(self) -> ActiveActivation | None:
        self._token = _ACTIVE.set(self.active)
        return self.active

    def __exit__(self, *exc_info: object) -> None:
        _ACTIVE.reset(self._token)
