"""The simple agent's state: a session's conversation and a legacy run, changed only in step boundary callbacks.

Messages are append-only, so a boundary is a cheap :class:`ConversationSnapshot` (a message
count into the list) materialised only at export; :meth:`Conversation.from_boundary` and
:meth:`RunState.from_boundary` rebuild the state a restored boundary describes.
:mod:`gymckpt.servers.agent` runs the turn loop over it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from gymckpt.errors import AgentError
from gymckpt.participants.agent import materialize
from gymckpt.servers.json_body import canonical_json

__all__ = [
    "Conversation",
    "ConversationSnapshot",
    "ModelTurn",
    "RunSnapshot",
    "RunState",
    "Seeded",
    "Session",
    "ToolResult",
    "input_digest",
    "same_snapshot",
]


def input_digest(items: list[dict[str, Any]]) -> str:
    """The sha256 of an activation's input (canonical JSON), to recognise a replayed activation."""
    return hashlib.sha256(canonical_json(items)).hexdigest()


@dataclass(frozen=True, slots=True)
class ModelTurn:
    """A parsed model reply: a function call, or a final text, and the reasoning items before it."""

    call: dict[str, Any] | None
    text: str
    reasoning: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class ToolResult:
    arguments: dict[str, Any]
    reply: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ConversationSnapshot:
    """A lazy boundary: a prefix of the append-only message list, materialised at export."""

    messages: list[dict[str, Any]]
    length: int
    expected: int
    activation: tuple[str, int] | None
    pending_call: dict[str, Any] | None
    last: dict[str, Any] | None

    def __call__(self) -> dict[str, Any]:
        return {
            "messages": self.messages[: self.length],
            "expected": self.expected,
            "activation": None
            if self.activation is None
            else {"input_sha256": self.activation[0], "turns": self.activation[1]},
            "pending_call": self.pending_call,
            "last": self.last,
        }


class Conversation:
    """A session's turn-loop state; it changes only in step boundary callbacks."""

    __slots__ = ("activation", "expected", "last", "messages", "pending_call", "restored")

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.expected = 0
        #: (input digest, model calls so far) of the activation in progress
        self.activation: tuple[str, int] | None = None
        #: a function call the model asked for whose tool call has not completed
        self.pending_call: dict[str, Any] | None = None
        #: ``{"input_sha256", "reply"}`` of the last completed activation
        self.last: dict[str, Any] | None = None
        #: restored and no activation ran since
        self.restored = False

    @classmethod
    def from_boundary(cls, boundary: object) -> Conversation:
        """The conversation a materialised boundary describes (None: a new one)."""
        conversation = cls()
        boundary = _boundary_object(boundary, "conversation")
        if boundary is None:
            return conversation
        conversation.messages = list(boundary.get("messages") or [])
        conversation.expected = int(boundary.get("expected") or 0)
        activation = boundary.get("activation")
        if activation is not None:
            conversation.activation = (str(activation["input_sha256"]), int(activation["turns"]))
        conversation.pending_call = boundary.get("pending_call")
        conversation.last = boundary.get("last")
        return conversation

    def snapshot(self) -> ConversationSnapshot:
        return ConversationSnapshot(
            self.messages, len(self.messages), self.expected, self.activation, self.pending_call, self.last
        )

    def begin(self, items: list[dict[str, Any]], digest: str) -> ConversationSnapshot:
        """A new activation: its input joins the conversation."""
        self.messages.extend(items)
        self.activation = (digest, 0)
        self.pending_call = None
        return self.snapshot()

    def apply_model(self, turn: ModelTurn) -> ConversationSnapshot:
        assert self.activation is not None
        digest, turns = self.activation
        self.activation = (digest, turns + 1)
        self.messages.extend(turn.reasoning)  # the model's reasoning stays in the conversation, as sent
        if turn.call is not None:
            self.messages.append(turn.call)
            self.pending_call = turn.call
            return self.snapshot()
        self.messages.append({"role": "assistant", "content": turn.text})
        return self._finish(turn.text)

    def apply_tool(self, call: dict[str, Any], result: ToolResult) -> ConversationSnapshot:
        n = result.arguments.get("n")
        if isinstance(n, int) and not isinstance(n, bool):
            self.expected += n
        self.messages.append(
            {
                "role": "tool",
                "call_id": call.get("call_id"),
                "name": call["name"],
                "content": json.dumps(result.reply, separators=(",", ":")),
            }
        )
        self.pending_call = None
        return self.snapshot()

    def give_up(self) -> ConversationSnapshot:
        """max_turns reached without a final message."""
        return self._finish("")

    def _finish(self, text: str) -> ConversationSnapshot:
        assert self.activation is not None
        digest, turns = self.activation
        self.last = {"input_sha256": digest, "reply": {"output_text": text, "turns": turns, "expected": self.expected}}
        self.activation = None
        self.pending_call = None
        return self.snapshot()


class Session:
    """One agent session (a rollout attempt): its settings and its conversation."""

    __slots__ = ("conversation", "settings")

    def __init__(self, settings: dict[str, Any], conversation: Conversation) -> None:
        self.settings = settings
        self.conversation = conversation


@dataclass(frozen=True, slots=True)
class RunSnapshot:
    """A legacy run's lazy boundary."""

    seeded: bool
    verify_mode: str
    verify: dict[str, Any] | None
    conversation: object

    def __call__(self) -> dict[str, Any]:
        return {
            "seeded": self.seeded,
            "verify_mode": self.verify_mode,
            "verify": self.verify,
            "conversation": materialize(self.conversation),
        }


@dataclass(frozen=True, slots=True)
class Seeded:
    reply: dict[str, Any]
    verify_mode: str
    restart: bool


class RunState:
    """A legacy run: seeded?, the verify mode the seed reply reported, the loop, the verify reply."""

    __slots__ = ("conversation", "seeded", "verify", "verify_mode")

    def __init__(self) -> None:
        self.seeded = False
        self.verify_mode = "wait"
        self.verify: dict[str, Any] | None = None
        self.conversation = Conversation()

    @classmethod
    def from_boundary(cls, boundary: object) -> RunState:
        state = cls()
        boundary = _boundary_object(boundary, "run")
        if boundary is None:
            return state
        state.seeded = bool(boundary.get("seeded"))
        state.verify_mode = str(boundary.get("verify_mode") or "wait")
        state.verify = boundary.get("verify")
        state.conversation = Conversation.from_boundary(boundary.get("conversation"))
        return state

    def wrap(self, conversation: ConversationSnapshot) -> RunSnapshot:
        return RunSnapshot(self.seeded, self.verify_mode, self.verify, conversation)

    def apply_seed(self, seeded: Seeded, items: list[dict[str, Any]]) -> RunSnapshot:
        self.seeded = True
        self.verify_mode = seeded.verify_mode
        return self.wrap(self.conversation.begin(items, input_digest(items)))

    def apply_verify(self, reply: dict[str, Any]) -> RunSnapshot:
        self.verify = reply
        return self.wrap(self.conversation.snapshot())


def _boundary_object(boundary: object, what: str) -> dict[str, Any] | None:
    """A materialised boundary: None (nothing yet) or an object (:class:`AgentError` otherwise)."""
    if boundary is not None and not isinstance(boundary, dict):
        raise AgentError(f"a {what} boundary must be an object, not {type(boundary).__name__}")
    return boundary


def same_snapshot(snapshot: ConversationSnapshot) -> object:
    return snapshot
