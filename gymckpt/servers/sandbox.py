"""The sandbox resources server: big sessions, each a file tree and a shell-like command history.

A session stands for what a code or shell sandbox holds for one rollout: ``files`` (path →
text) and ``history`` (the commands run so far and their outputs). Seeding fills the tree
with ``session_bytes`` of text (default 350,000 bytes in ``files_per_session`` files),
derived only from the session's seed (the rollout id unless the task names one), so the
same rollout always starts from the same tree and a restored session can be compared with
an uninterrupted one.

Routes (sessions are named as on the counter server: the capture key of the request's
rollout with checkpointing on, the ``x-session-id`` header with it off):

- ``POST /seed_session`` ``{"task_input": {"seed"?: str, "session_bytes"?: int, "files"?: int}}``
  → ``{"session", "files", "bytes"}``: a fresh tree (seeding an existing session starts it over).
- ``POST /write_file`` ``{"path": str, "content": str, "append"?: bool}`` → ``{"path", "bytes"}``.
- ``POST /read_file`` ``{"path": str}`` → ``{"path", "content"}``; 404 when there is no such file.
- ``POST /run_command`` ``{"command": str}`` → ``{"output", "exit_code", "index"}``; the command and
  its output are appended to the history. Commands: ``ls``, ``cat PATH`` (output cut at
  ``max_output_bytes``), ``wc -c PATH``, ``sha256sum PATH``, ``echo WORDS``, ``rm PATH``;
  anything else exits 127.
- ``POST /digest`` → ``{"sha256", "files", "bytes", "history"}``: the sha256 of the session's
  state as JSON (:func:`session_digest`), to compare sessions without moving their bytes.
- ``POST /verify`` ``{"response": str, "expected_sha256"?: str}`` → ``{"reward"}``: 1.0 when the
  session's digest is the expected one; the session ends.
- ``POST /close_session`` → ``{"closed": true}``.

Sizes count characters (the seeded text is ASCII: a byte each). A tool call on a session
the server does not hold starts an empty tree (a continued rollout
whose state was not restored then gets the wrong digest, not an error).

Checkpoint declarations: ``checkpoint_mode = "exported"`` (state :data:`SessionState`),
``checkpoint_verify = "wait"``. Export and install move no session bytes: the export hands
the live state objects to the store (every route that changes a session waits while a
checkpoint holds admission closed, and a seed replaces a session's object instead of
changing it, so what was exported stays put until resume), and a restore installs the
decoded records' objects as they are, after a type check that copies nothing.
"""

from __future__ import annotations

import hashlib
import random
import shlex
from typing import TYPE_CHECKING, Any, ClassVar

import orjson
from fastapi import HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from gymckpt.errors import GymckptError, InvalidCheckpointState
from gymckpt.identity import split_capture_key
from gymckpt.participants.resources import (
    CheckpointedResources,
    CheckpointMode,
    CheckpointVerify,
    ResourcesParticipant,
    seed_session_key,
    session_key,
)
from gymckpt.servers.base import ServerConfig, build_app

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = [
    "DEFAULT_SESSION_BYTES",
    "SandboxConfig",
    "SandboxServer",
    "SessionState",
    "build_sandbox_app",
    "run_command",
    "seed_state",
    "session_digest",
]

#: a session's tree when neither the config nor the task says otherwise (the reference's 350 KB case)
DEFAULT_SESSION_BYTES = 350_000
#: text lines of the seeded files: 79 characters and a newline
_LINE = 80

#: ``{"seed": str, "files": {path: text}, "history": [{"command": str, "exit_code": int, "output": str}]}``
SessionState = dict[str, Any]


class SandboxConfig(ServerConfig):
    """The sandbox server's config: session sizes, the participant instance name and the ``checkpoint:`` block."""

    instance: str = "sandbox-0"
    #: bytes of text a seeded session's files hold together
    session_bytes: int = Field(default=DEFAULT_SESSION_BYTES, ge=0)
    #: how many files a seeded session's tree has
    files_per_session: int = Field(default=32, ge=1, le=100_000)
    #: the largest session a task may ask for (``task_input.session_bytes``)
    max_session_bytes: int = Field(default=64 * 1024 * 1024, ge=0)
    #: a command's output is cut after this many characters
    max_output_bytes: int = Field(default=4096, ge=0)


class SeedBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    task_input: dict[str, Any] = Field(default_factory=dict)


class WriteBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    path: str = Field(min_length=1, max_length=4096)
    content: str
    append: bool = False


class PathBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    path: str = Field(min_length=1, max_length=4096)


class CommandBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    command: str = Field(max_length=65_536)


class VerifyBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    response: str = ""
    expected_sha256: str | None = None


def _text(rng: random.Random, size: int) -> str:
    """``size`` characters of hex text in lines of :data:`_LINE` (the last one shorter)."""
    full, tail = divmod(size, _LINE)
    width = _LINE - 1
    digits = rng.randbytes((full * width + tail) // 2 + 1).hex()
    if not full:
        return digits[:tail]
    body = "\n".join([digits[line * width : (line + 1) * width] for line in range(full)])
    return f"{body}\n{digits[full * width : full * width + tail]}"


def seed_state(seed: str, session_bytes: int = DEFAULT_SESSION_BYTES, files: int = 32) -> SessionState:
    """The tree a session seeded with ``seed`` starts from: ``files`` files of ``session_bytes`` together.

    A pure function of its arguments (each file's text comes from ``seed`` and its path).
    """
    if session_bytes < 0 or files < 1:
        raise ValueError("a seeded session needs session_bytes >= 0 and files >= 1")
    each, extra = divmod(session_bytes, files)
    tree: dict[str, str] = {}
    for index in range(files):
        path = f"src/pkg_{index // 8}/module_{index}.py"
        tree[path] = _text(random.Random(f"{seed}\0{path}"), each + (1 if index < extra else 0))
    return {"seed": seed, "files": tree, "history": []}


def session_digest(state: SessionState) -> str:
    """The sha256 of a session's state as JSON (key order included): equal digests, equal sessions."""
    return hashlib.sha256(orjson.dumps(state)).hexdigest()


def run_command(state: SessionState, command: str, max_output: int = 4096) -> tuple[str, int]:
    """Run one command on ``state`` (``rm`` changes its files); its output and exit code.

    Pure apart from ``rm``: the same command on the same tree gives the same output.
    """
    try:
        words = shlex.split(command)
    except ValueError as exc:
        return f"sh: {exc}", 2
    if not words:
        return "", 0
    files: dict[str, str] = state["files"]
    name, arguments = words[0], words[1:]
    if name == "ls":
        return "\n".join(sorted(files)), 0
    if name == "echo":
        return " ".join(arguments), 0
    if name not in ("cat", "wc", "sha256sum", "rm"):
        return f"sh: {name}: command not found", 127
    operands = [word for word in arguments if not word.startswith("-")]
    if len(operands) != 1:
        return f"{name}: expected one file operand", 2
    path = operands[0]
    text = files.get(path)
    if text is None:
        return f"{name}: {path}: No such file or directory", 1
    if name == "cat":
        return text[:max_output], 0
    if name == "wc":
        return f"{len(text.encode())} {path}", 0
    if name == "sha256sum":
        return f"{hashlib.sha256(text.encode()).hexdigest()}  {path}", 0
    del files[path]
    return "", 0


class SandboxServer(CheckpointedResources):
    """Big per-session state: a file tree and a command history (:data:`SessionState`)."""

    checkpoint_mode: ClassVar[CheckpointMode] = "exported"
    checkpoint_verify: ClassVar[CheckpointVerify] = "wait"

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config if config is not None else SandboxConfig()
        self.sessions: dict[str, SessionState] = {}

    def _held(self, key: str) -> SessionState:
        """The session's state; an empty tree for a session not held (a tool call starts it)."""
        state = self.sessions.get(key)
        if state is None:
            state = self.sessions[key] = {"seed": "", "files": {}, "history": []}
            self.checkpoint_session_started(key)
        return state

    async def seed(self, key: str, task_input: dict[str, Any]) -> SessionState:
        """Start ``key`` over from the tree its seed gives (a new object: an exported one is never changed)."""
        config = self.config
        seed = task_input.get("seed", _default_seed(key))
        size = task_input.get("session_bytes", config.session_bytes)
        files = task_input.get("files", config.files_per_session)
        if not isinstance(seed, str):
            raise HTTPException(422, "task_input.seed must be a string")
        if type(size) is not int or not 0 <= size <= config.max_session_bytes:
            raise HTTPException(422, f"task_input.session_bytes must be an integer in [0, {config.max_session_bytes}]")
        if type(files) is not int or not 1 <= files <= 100_000:
            raise HTTPException(422, "task_input.files must be an integer in [1, 100000]")
        state = self.sessions[key] = seed_state(seed, size, files)
        return state

    async def write_file(self, key: str, path: str, content: str, *, append: bool) -> int:
        """Write (or append to) one file; the file's length afterwards."""
        files = self._held(key)["files"]
        text = files.get(path, "") + content if append else content
        files[path] = text
        return len(text)

    async def read_file(self, key: str, path: str) -> str | None:
        """One file's text, None when there is none."""
        state = self.sessions.get(key)
        return None if state is None else state["files"].get(path)

    async def command(self, key: str, command: str) -> tuple[str, int, int]:
        """Run ``command``, append it to the history; its output, exit code and history index."""
        state = self._held(key)
        output, code = run_command(state, command, self.config.max_output_bytes)
        history: list[dict[str, Any]] = state["history"]
        history.append({"command": command, "exit_code": code, "output": output})
        return output, code, len(history) - 1

    async def digest(self, key: str) -> dict[str, Any]:
        """The session's digest and sizes (an empty tree's for a session not held)."""
        state = self.sessions.get(key) or {"seed": "", "files": {}, "history": []}
        files: dict[str, str] = state["files"]
        return {
            "sha256": session_digest(state),
            "files": len(files),
            "bytes": sum(len(text) for text in files.values()),
            "history": len(state["history"]),
        }

    async def verify(self, key: str, expected: str | None) -> float:
        """1.0 when the session's digest is ``expected``; the session ends."""
        state = self.sessions.pop(key, None)
        if state is None or expected is None:
            return 0.0
        return 1.0 if session_digest(state) == expected else 0.0

    async def close(self, key: str) -> None:
        """Free the session."""
        self.sessions.pop(key, None)

    # --- checkpoint hooks

    async def export_session_states(self, session_ids: list[str]) -> dict[str, Any]:
        """The held sessions' live states, not copies (see the module notes: they stay put until resume)."""
        sessions = self.sessions
        return {key: sessions[key] for key in session_ids if key in sessions}

    async def restore_session_states(self, states: dict[str, Any]) -> None:
        """Install restored sessions under their (next-attempt) keys, all or none, without copying them.

        A state that is not a :data:`SessionState` is ``invalid_checkpoint_state`` naming its
        session and the bad value's place; nothing is installed then.
        """
        for key, state in states.items():
            _check_state(key, state)
        self.sessions.update(states)

    async def retire_session_state(self, session_id: str) -> None:
        """Free the session, if held."""
        self.sessions.pop(session_id, None)


def _default_seed(key: str) -> str:
    """A session's seed: its rollout id (every attempt of a rollout starts from one tree), else the key."""
    try:
        return split_capture_key(key)[0]
    except GymckptError:  # a session named by a header that is no capture key (checkpointing off)
        return key


def _check_state(key: str, state: Any) -> None:
    """Refuse a restored state that is not a :data:`SessionState` (types only: nothing is copied)."""

    def refuse(where: str, why: str) -> InvalidCheckpointState:
        return InvalidCheckpointState(f"the sandbox state of session {key!r}: {where} {why}")

    if not isinstance(state, dict):
        raise refuse("$", f"is not an object: {type(state).__name__}")
    if not isinstance(state.get("seed"), str):
        raise refuse("$.seed", "is not a string")
    files = state.get("files")
    if not isinstance(files, dict):
        raise refuse("$.files", "is not an object")
    for path, text in files.items():
        if not isinstance(text, str):
            raise refuse(f"$.files[{path!r:.80}]", "is not a string")
    history = state.get("history")
    if not isinstance(history, list):
        raise refuse("$.history", "is not a list")
    for index, entry in enumerate(history):
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("command"), str)
            and type(entry.get("exit_code")) is int
            and isinstance(entry.get("output"), str)
        ):
            raise refuse(f"$.history[{index}]", "is not {command: str, exit_code: int, output: str}")


def build_sandbox_app(config: SandboxConfig, server: SandboxServer | None = None) -> FastAPI:
    """The sandbox server's app; checkpointing installed only when the config enables it.

    ``app.state.server`` is the :class:`SandboxServer`, ``app.state.participant`` and
    ``app.state.plane`` the participant and control plane (None with checkpointing off).
    """
    server = server if server is not None else SandboxServer(config)
    participant = ResourcesParticipant(server, config.instance) if config.checkpoint.enabled else None
    app, plane, _ = build_app("gymckpt sandbox", config, participant)
    app.state.server = server
    app.state.participant = participant
    app.state.plane = plane

    @app.post("/seed_session")
    async def seed_session(request: Request, body: SeedBody | None = None) -> dict[str, Any]:
        key = seed_session_key(request)
        state = await server.seed(key, body.task_input if body is not None else {})
        files: dict[str, str] = state["files"]
        return {"session": key, "files": len(files), "bytes": sum(len(text) for text in files.values())}

    @app.post("/write_file")
    async def write_file(request: Request, body: WriteBody) -> dict[str, Any]:
        size = await server.write_file(session_key(request), body.path, body.content, append=body.append)
        return {"path": body.path, "bytes": size}

    @app.post("/read_file")
    async def read_file(request: Request, body: PathBody) -> dict[str, Any]:
        content = await server.read_file(session_key(request), body.path)
        if content is None:
            raise HTTPException(404, f"no file {body.path!r} in this session")
        return {"path": body.path, "content": content}

    @app.post("/run_command")
    async def command(request: Request, body: CommandBody) -> dict[str, Any]:
        output, code, index = await server.command(session_key(request), body.command)
        return {"output": output, "exit_code": code, "index": index}

    @app.post("/digest")
    async def digest(request: Request) -> dict[str, Any]:
        return await server.digest(session_key(request))

    @app.post("/verify")
    async def verify(request: Request, body: VerifyBody) -> dict[str, Any]:
        return {"reward": await server.verify(session_key(request), body.expected_sha256)}

    @app.post("/close_session")
    async def close_session(request: Request) -> dict[str, Any]:
        await server.close(session_key(request))
        return {"closed": True}

    return app
