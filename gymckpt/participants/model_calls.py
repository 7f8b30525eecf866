"""A policy model server's calls as its participant tracks them: their states and what each carries.

:class:`ModelCall` is one ``/v1/responses`` call of one episode attempt, from its admission to
its end (:class:`CallState`); :func:`next_ticket_id` names it for the generation-cut inventory.
:mod:`gymckpt.participants.model` moves calls between states.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gymckpt.identity import EpisodeId

__all__ = ["ANONYMOUS", "CallState", "ModelCall", "next_ticket_id"]

#: the blocker name of a streaming call that carries no rollout (only without a bound plane)
ANONYMOUS = "(no rollout)"


class CallState(StrEnum):
    """Where a model call is (the names of :meth:`ModelParticipant.counts`)."""

    WAITING = "waiting"
    IN_FLIGHT = "in_flight"
    HELD = "held"
    STREAMING = "streaming"
    ENDED = "ended"


#: a ticket id is this process's random salt and a serial: unique, and no system call per model call
_TICKET_SALT = secrets.token_hex(8)
_TICKET_SERIALS = itertools.count()


def next_ticket_id() -> str:
    """A new ticket id (32 hex digits, as the generation-cut inventory requires), unique across processes."""
    return f"{_TICKET_SALT}{next(_TICKET_SERIALS):016x}"


@dataclass(eq=False)
class ModelCall:
    """One ``/v1/responses`` call of one episode attempt (``episode`` None: no rollout prefix)."""

    episode: EpisodeId | None
    stream: bool
    state: CallState = CallState.WAITING
    #: the child task running the call's wait, generation and hold (cancelled by retire)
    task: asyncio.Task[Any] | None = None
    #: set by retire: the call must stop and answer stale_attempt
    retired: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    #: the inference backend's call id (the ledger's ``model_call_id``)
    call_id: str = ""
    #: sha256 of the request's prompt: a restored cut continues only the same request
    request_digest: str = ""
    #: why this call is never cut (constrained decoding), or None
    constrained: str | None = None
    ticket_id: str = field(default_factory=next_ticket_id)
    admitted_at: float = field(default_factory=time.time)
    #: the continuation this checkpoint's cut gave (None: not cut)
    cut: dict[str, Any] | None = None
    cut_failed: bool = False
    #: the whole generation as a terminal cut, once it completed while undelivered (None: not yet)
    terminal: dict[str, Any] | None = None
    #: the generation, once complete, as its cut's record keeps it (``{"token_ids", "logprobs", "encoding"}``)
    prefix: dict[str, Any] | None = None
    #: the tokens of the cut prefix this checkpoint's cut gave (None: not cut, or not given)
    cut_prefix: dict[str, Any] | None = None
    #: the restored cut this call continues (None: none)
    continues: dict[str, Any] | None = None
    #: the restored ledger row this call replays (None: none)
    replays: dict[str, Any] | None = None
    delivered: bool = False
    #: whether the call's request may have reached the inference backend. A server that queues
    #: calls before sending them (a full connection pool) admits them with ``sent=False`` and
    #: sets it when the request goes out; a cut asks the backend only about sent calls
    sent: bool = True

    @property
    def key(self) -> str:
        """The capture key of the call's attempt (a placeholder without one)."""
        return self.episode.capture_key if self.episode is not None else ANONYMOUS
