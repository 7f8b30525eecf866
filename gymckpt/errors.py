"""Every error gymckpt raises, in one small hierarchy.

Each class that can cross the wire carries its ``code`` (the wire error code) and its
HTTP ``status``; the control plane maps them in one exception handler. Subclasses also
inherit the built-in exception that fits, so ``except FileNotFoundError`` keeps working.
Every code belongs to exactly one class, the one that defines it (subclasses inherit it);
:data:`WIRE_ERRORS` lists them and :func:`error_for_code` maps a wire code back.

Three things are called a code and are kept apart: ``GymckptError.code`` is the wire error
code (``{"error": {"code", "detail"}}``); ``InvalidCheckpointState.problem`` names a kind of
damage (and is what ``verify``'s findings call their ``code``); an S3 error code
(``NoSuchKey``) stays inside the S3 backend (``_s3_error_code``). HTTP statuses are ``status``.

::

    GymckptError
    ├── InvalidPayload                           422 invalid_payload: records that cannot be stored
    │   ├── NotJSONError (TypeError)             a payload value that is not JSON
    │   └── InvalidRecord (ValueError)           a record without a leading episode_id, a duplicate
    ├── NoCheckpointFound (FileNotFoundError)    404 checkpoint_not_found: nothing under a URL is a checkpoint
    ├── InvalidRequest (ValueError)              422 invalid_request: a body or parameter the routes refuse
    ├── ServerCallFailed                         502 server_unreachable: a control call got no typed reply
    ├── CoordinationError                        a fan-out that failed on some servers (controller side, never on the wire)
    ├── DownstreamError                          502 downstream_error: a server this one calls answered an error
    │   ├── InferenceFailed                      502 inference_failed: the policy model's backend failed
    │   └── ReplyTooLarge                        a reply beyond its bound: read no further, the connection dropped
    ├── ClientDisconnected                       499 client_disconnected: nobody reads the reply any more
    ├── RequestTimeout (TimeoutError)            408 request_timeout: a client too slow to send its request
    ├── SessionOwnerGone                         410 session_owner_gone: the worker that held a session exited
    ├── SessionForwardFailed                     502 session_forward_failed: the owning worker did not answer
    ├── StorageError (OSError)                   the storage failed (ENOSPC, EIO, network)
    │   └── UnsupportedStorage                   a backend lacks a capability the store needs
    ├── WriteStopped                             a write was stopped before it published
    ├── ControlError                             409 checkpoint_error: control-plane refusals, each with its wire code
    │   ├── StaleCheckpoint                      409 stale_checkpoint: a resumed checkpoint's late call
    │   ├── CheckpointConflict                   409 checkpoint_conflict: another id open, other args
    │   │   └── ManifestConflict (FileExistsError) another manifest is already published there
    │   ├── InvalidPhase                         409 invalid_phase
    │   ├── DeadlineExceeded (TimeoutError)      409 deadline_exceeded
    │   ├── StaleAttempt                         409 stale_attempt: a retired attempt's request
    │   ├── CoordinatorUnavailable               503 checkpoint_coordinator_unavailable: a worker without its coordinator
    │   ├── RetireIncomplete                     409 retire_incomplete: forget while a retire still frees
    │   ├── GenerationCutMismatch                409 generation_cut_mismatch: a continuation not of its staged prefix
    │   ├── RestartInScope                       409 restart_in_scope
    │   ├── ExportFailed                         409 export_failed: this checkpoint id is over
    │   ├── CheckpointParked                     409 checkpoint_parked: new work while a checkpoint is open
    │   ├── RolloutIdRequired                    400 rollout_id_required
    │   ├── InvalidRolloutId (ValueError)        400 invalid_rollout_id
    │   │   └── RolloutAttemptConflict           "<id>-aN" given with an attempt index
    │   ├── CheckpointDirNotAllowed              403 checkpoint_dir_not_allowed (allowed_roots)
    │   ├── SessionBusy                          409 session_busy: an agent session already runs
    │   ├── SessionRolloutMismatch               409 session_rollout_mismatch: a session cookie or token of another rollout
    │   ├── SessionsNotExported                  409 export_failed: tracked sessions the server's state does not hold
    │   └── Unauthorized                         401 unauthorized
    ├── AgentError                               502 agent_error: a turn loop that cannot go on
    ├── AgentRequestError                        400 invalid_agent_request
    ├── RestoredInputMismatch                    409 restored_input_mismatch
    ├── ReplayDiverged                           409 replay_diverged: a restored agent called otherwise than its journal
    ├── InvalidDataset (ValueError)              400 invalid_dataset: a collection's dataset line (file:line: why)
    ├── CollectionExists (FileExistsError)       409 collection_exists: results or checkpoints of an earlier collection
    ├── SettingsError (ValueError)               a settings file or dict refused at startup (file: key.path: why; never on the wire)
    ├── AppNotLoadable (ValueError)              an --app module:attr that names no app (never on the wire)
    ├── PreemptionGuardInactive (RuntimeError)   a notice or checkpoint through a guard not entered (never on the wire)
    ├── RayStackError                            the Ray launcher: a placement that failed, a cluster gone (never on the wire)
    │   ├── NodeLost                             a node holding servers died (the stack must be placed again)
    │   ├── RayHeadLost                          Ray's head node is gone: fatal without an external GCS store
    │   └── SharedStorageRequired (ValueError)   servers on several nodes, checkpoints where not every node sees them
    └── InvalidCheckpointState (ValueError)      damage: wire code invalid_checkpoint_state, 422
        ├── ParticipantNotFound (FileNotFoundError)
        ├── ManifestNotJSON
        ├── ManifestNotObject
        ├── ManifestFieldInvalid                 a field missing or of the wrong type
        ├── UnsupportedSchemaVersion
        ├── ParticipantMismatch                  kind/instance differ from the directory
        ├── RecordsPathEscapes                   records_file outside the participant directory
        ├── RecordsNameInvalid                   records_file not records-<sha256>.jsonl
        ├── RecordsMissing (FileNotFoundError)
        ├── RecordsSizeMismatch
        ├── RecordsDigestMismatch
        ├── RecordUndecodable                    a line that is not a JSON object with an episode_id, or holds a key twice
        │   └── RecordTooLong                    a line longer than its manifest's max_record_bytes (or the read cap)
        ├── RecordCountMismatch
        ├── EpisodeIdsMismatch
        ├── DuplicateEpisode                     an episode id on two lines, or twice in a manifest
        ├── NotRegularFile (OSError)             a symlink, FIFO or device where state belongs
        ├── UnaddressableKey                     an object key with empty, '.' or '..' segments: no path reads it
        ├── FileTooLarge                         a manifest or checkpoint.json over its size limit
        ├── DocumentTooComplex                   a manifest or checkpoint.json whose decoding would pass the parse budget
        ├── DuplicateKey                         a key twice in one object of a manifest or checkpoint.json
        ├── CheckpointIndexInvalid               gym/checkpoint.json damaged or inconsistent
        │   ├── IndexParticipantMissing          it lists a participant whose manifest is missing
        │   ├── IndexDigestMismatch              a listed manifest hashes otherwise
        │   ├── IndexParticipantUnlisted         a committed participant it does not list
        │   └── CheckpointIdMismatch             a manifest of another checkpoint id
        ├── CheckpointUnpublished (FileNotFoundError) no gym/checkpoint.json: a coordinated restore takes only published ones
        └── UnusableDirectory (OSError)          a directory that cannot hold state (read-only, no permission)
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

__all__ = [
    "AgentError",
    "AgentRequestError",
    "AppNotLoadable",
    "PreemptionGuardInactive",
    "NodeLost",
    "RayHeadLost",
    "RayStackError",
    "SharedStorageRequired",
    "CheckpointConflict",
    "CheckpointDirNotAllowed",
    "CheckpointIdMismatch",
    "CheckpointUnpublished",
    "CheckpointIndexInvalid",
    "CheckpointParked",
    "ClientDisconnected",
    "RequestTimeout",
    "ControlError",
    "CoordinationError",
    "CoordinatorUnavailable",
    "GenerationCutMismatch",
    "SessionForwardFailed",
    "SessionOwnerGone",
    "DeadlineExceeded",
    "DownstreamError",
    "DuplicateEpisode",
    "EpisodeIdsMismatch",
    "ExportFailed",
    "FileTooLarge",
    "DocumentTooComplex",
    "DuplicateKey",
    "RecordTooLong",
    "GymckptError",
    "IndexDigestMismatch",
    "IndexParticipantMissing",
    "IndexParticipantUnlisted",
    "InferenceFailed",
    "ReplyTooLarge",
    "InvalidCheckpointState",
    "InvalidPayload",
    "InvalidDataset",
    "CollectionExists",
    "SettingsError",
    "InvalidPhase",
    "InvalidRecord",
    "InvalidRequest",
    "InvalidRolloutId",
    "ManifestConflict",
    "ManifestFieldInvalid",
    "ManifestNotJSON",
    "ManifestNotObject",
    "NoCheckpointFound",
    "NotJSONError",
    "NotRegularFile",
    "UnaddressableKey",
    "ParticipantMismatch",
    "ParticipantNotFound",
    "RecordCountMismatch",
    "RecordUndecodable",
    "RecordsDigestMismatch",
    "RecordsMissing",
    "RecordsNameInvalid",
    "RecordsPathEscapes",
    "RecordsSizeMismatch",
    "RestartInScope",
    "RestoredInputMismatch",
    "RolloutAttemptConflict",
    "RolloutIdRequired",
    "ServerCallFailed",
    "SessionBusy",
    "SessionRolloutMismatch",
    "SessionsNotExported",
    "ReplayDiverged",
    "RetireIncomplete",
    "StaleAttempt",
    "StaleCheckpoint",
    "StorageError",
    "Unauthorized",
    "UnsupportedSchemaVersion",
    "UnsupportedStorage",
    "UnusableDirectory",
    "WIRE_ERRORS",
    "WriteStopped",
    "error_for_code",
]


class GymckptError(Exception):
    """Base of every gymckpt error."""

    code: str = "internal_error"
    status: int = 500

    def __init__(self, detail: str = "") -> None:
        super().__init__(detail)
        self.detail = detail


class InvalidPayload(GymckptError):
    """422 ``invalid_payload``: records a participant handed over that cannot be stored."""

    code = "invalid_payload"
    status = 422


class NotJSONError(InvalidPayload, TypeError):
    """A payload value that JSON cannot represent exactly; names the episode and the path."""

    def __init__(self, detail: str, *, episode_id: str | None = None, path: str = "$") -> None:
        super().__init__(detail)
        self.episode_id = episode_id
        self.path = path


class InvalidRecord(InvalidPayload, ValueError):
    """A record that cannot be stored: not a dict, no leading episode_id, or a duplicate id."""


class NoCheckpointFound(GymckptError, FileNotFoundError):
    """Nothing under the URL looks like a checkpoint (no ``gym/`` directory)."""

    code = "checkpoint_not_found"
    status = 404


class InvalidRequest(GymckptError, ValueError):
    """A request body, path or parameter the routes refuse (validation, an unknown route's method)."""

    code = "invalid_request"
    status = 422


class ServerCallFailed(GymckptError):
    """A control call failed without a typed error (connection refused, timeout, garbage reply)."""

    code = "server_unreachable"
    status = 502


class CoordinationError(GymckptError):
    """A coordinated operation failed on some servers: ``failures`` names each one and why.

    ``causes`` keeps each server's exception (typed by its wire code where it sent one). The
    message says each distinct cause once, on a line of its own, with the servers it hit
    (``3 servers (URL, URL, URL): <cause>``; one server: ``URL: <cause>``): each URL once.
    """

    def __init__(self, operation: str, causes: dict[str, BaseException]) -> None:
        self.operation = operation
        self.causes = dict(sorted(causes.items()))
        self.failures = {server: str(cause) or type(cause).__name__ for server, cause in self.causes.items()}
        grouped: dict[str, list[str]] = {}
        for server, text in self.failures.items():
            grouped.setdefault(_said_once(server, text), []).append(server)
        lines = [
            f"{servers[0]}: {self.failures[servers[0]].removeprefix(f'{servers[0]}: ')}"
            if len(servers) == 1
            else f"{len(servers)} servers ({', '.join(servers)}): {cause}"
            for cause, servers in grouped.items()
        ]
        head = f"checkpoint {operation} failed on {len(self.failures)} participant(s): "
        if len(lines) == 1:
            super().__init__(head + lines[0])
        else:
            super().__init__(f"{head}{len(lines)} different causes" + "".join(f"\n  {line}" for line in lines))


def _said_once(server: str, text: str) -> str:
    """A cause's text as said once for several servers: without the server's own address.

    A client's error leads with the server's URL and often names its host:port again
    (``Cannot connect to host 127.0.0.1:8101 … ('127.0.0.1', 8101)``); with each put as
    ``<server>``, the same cause on several servers reads the same.
    """
    text = text.removeprefix(f"{server}: ")
    try:
        address = urlsplit(server)
        host, port = address.hostname, address.port
    except ValueError:  # not a URL with a valid port ("deployment")
        return text
    if not host or port is None:
        return text
    for form in (server, f"('{host}', {port})", f"{host}:{port}"):
        text = text.replace(form, "<server>")
    return text


class DownstreamError(GymckptError):
    """A server this one calls (a downstream: agent, model, resources) answered an error status, or no reply came.

    ``downstream_status`` is the status it answered, 0 when no reply came (a refused connect,
    a dropped connection: the client's error is the ``__cause__``).
    """

    code = "downstream_error"
    status = 502

    def __init__(self, detail: str, *, url: str = "", downstream_status: int = 0, body: bytes = b"") -> None:
        super().__init__(detail)
        self.url = url
        self.downstream_status = downstream_status
        self.body = body

    @property
    def wire_code(self) -> str | None:
        """The downstream's ``{"error": {"code"}}``, None when its body carries none."""
        try:
            payload = json.loads(self.body)
        except (ValueError, TypeError):
            return None
        error = payload.get("error") if isinstance(payload, dict) else None
        code = error.get("code") if isinstance(error, dict) else None
        return code if isinstance(code, str) else None

    @classmethod
    def answered(cls, url: str, downstream_status: int, body: bytes) -> DownstreamError:
        """The error for a reply of status ``downstream_status`` from ``url``."""
        return cls(
            f"{url} answered {downstream_status}: {body[:300]!r}",
            url=url,
            downstream_status=downstream_status,
            body=body,
        )


class InferenceFailed(DownstreamError):
    """The policy model's inference backend failed or could not be reached."""

    code = "inference_failed"


class ReplyTooLarge(DownstreamError):
    """A reply longer than the bound its caller reads (:func:`gymckpt.transport.read_bounded`): read no further.

    ``limit`` is the bound, ``received`` the bytes read when it was refused (at most one
    piece past the bound; 0 when ``Content-Length`` alone exceeded it). The connection is
    dropped, never reused. It fails that one call, like any other reply that is no answer.
    """

    def __init__(self, detail: str, *, url: str = "", downstream_status: int = 0, limit: int, received: int) -> None:
        super().__init__(detail, url=url, downstream_status=downstream_status)
        self.limit = limit
        self.received = received


class ClientDisconnected(GymckptError):
    """The caller went away before the reply (nobody reads it); nginx's 499."""

    code = "client_disconnected"
    status = 499


class RequestTimeout(GymckptError, TimeoutError):
    """A client that did not send its request head in time, or its body too slowly; the server closes it."""

    code = "request_timeout"
    status = 408


class StorageError(GymckptError, OSError):
    """The storage failed while writing or reading (no space, I/O error, network)."""

    code = "storage_error"
    status = 503

    def __init__(self, detail: str, *, path: str | None = None, errno: int | None = None) -> None:
        GymckptError.__init__(self, detail)
        self.path = path
        self.errno = errno

    def __str__(self) -> str:
        return self.detail


class UnsupportedStorage(StorageError):
    """A backend lacks a capability safe publication needs, or got options it would ignore."""

    code = "unsupported_storage"
    status = 400


class SessionOwnerGone(GymckptError):
    """A request of a session whose owning worker is no longer running: its state is lost, start a new session."""

    code = "session_owner_gone"
    status = 410


class SessionForwardFailed(GymckptError):
    """A request forwarded to the worker that owns its session got no reply from it."""

    code = "session_forward_failed"
    status = 502


class WriteStopped(GymckptError):
    """The write was stopped (resume, cancellation) before it published a manifest."""

    code = "write_stopped"
    status = 409


class ControlError(GymckptError):
    """A control-plane refusal; ``code`` and ``status`` go on the wire."""

    code = "checkpoint_error"
    status = 409


class StaleCheckpoint(ControlError):
    code = "stale_checkpoint"


class CheckpointConflict(ControlError):
    code = "checkpoint_conflict"


class ManifestConflict(CheckpointConflict, FileExistsError):
    """A different manifest (or checkpoint.json) is already published at this path."""

    def __init__(self, detail: str, *, path: str) -> None:
        GymckptError.__init__(self, detail)
        self.path = path

    def __str__(self) -> str:
        return self.detail


class InvalidPhase(ControlError):
    code = "invalid_phase"


class DeadlineExceeded(ControlError, TimeoutError):
    code = "deadline_exceeded"


class StaleAttempt(ControlError):
    code = "stale_attempt"


class CoordinatorUnavailable(ControlError):
    """A worker of a several-worker server lost (or never reached) its coordinator, which owns the control plane."""

    code = "checkpoint_coordinator_unavailable"
    status = 503


class GenerationCutMismatch(ControlError):
    """A continuation whose staged prefix is missing or not this call's (the inference backend refuses it)."""

    code = "generation_cut_mismatch"


class RetireIncomplete(ControlError):
    """A forget of rollouts whose retire is still stopping and freeing them; retry after it finished."""

    code = "retire_incomplete"


class RestartInScope(ControlError):
    code = "restart_in_scope"


class ExportFailed(ControlError):
    code = "export_failed"


class CheckpointParked(ControlError):
    """New work (an environment episode, an agent session) arriving while a checkpoint is open; retry it."""

    code = "checkpoint_parked"


class RolloutIdRequired(ControlError):
    code = "rollout_id_required"
    status = 400


class InvalidRolloutId(ControlError, ValueError):
    code = "invalid_rollout_id"
    status = 400


class RolloutAttemptConflict(InvalidRolloutId):
    """An explicit ``"<id>-aN"`` rollout id given together with an attempt index."""


class CheckpointDirNotAllowed(ControlError):
    code = "checkpoint_dir_not_allowed"
    status = 403


class SessionBusy(ControlError):
    """409 ``session_busy``: the session already runs an activation (or is of the other kind)."""

    code = "session_busy"


class SessionRolloutMismatch(ControlError):
    """A session cookie or MCP session token bound to another rollout, or to an attempt this one does not continue."""

    code = "session_rollout_mismatch"


class SessionsNotExported(ExportFailed):
    """An export left out sessions the participant tracks: the server's state does not hold them."""


class AgentError(GymckptError):
    """502 ``agent_error``: a turn loop that cannot go on (a malformed model reply or tool call)."""

    code = "agent_error"
    status = 502


class AgentRequestError(GymckptError):
    """400 ``invalid_agent_request``: a request the agent cannot serve (bad input, no resources server)."""

    code = "invalid_agent_request"
    status = 400


class RestoredInputMismatch(GymckptError):
    """409 ``restored_input_mismatch``: a legacy run's replacement attempt brought another input."""

    code = "restored_input_mismatch"
    status = 409


class ReplayDiverged(GymckptError):
    """A restored agent, run again from its input, made a call its journal does not hold at that place."""

    code = "replay_diverged"
    status = 409


class Unauthorized(ControlError):
    code = "unauthorized"
    status = 401


class InvalidCheckpointState(GymckptError, ValueError):
    """Stored checkpoint state is damaged or inconsistent; names the participant and the file."""

    code = "invalid_checkpoint_state"
    status = 422
    #: short machine name of the damage; verify's findings use the same names
    problem: str = "invalid_checkpoint_state"

    def __init__(self, detail: str, *, path: str = "", participant: str = "") -> None:
        where = " ".join(part for part in (participant, path) if part)
        super().__init__(f"{where}: {detail}" if where else detail)
        self.path = path
        self.participant = participant
        self.reason = detail


class ParticipantNotFound(InvalidCheckpointState, FileNotFoundError):
    problem = "participant_not_found"


class ManifestNotJSON(InvalidCheckpointState):
    problem = "manifest_not_json"


class ManifestNotObject(InvalidCheckpointState):
    problem = "manifest_not_object"


class ManifestFieldInvalid(InvalidCheckpointState):
    problem = "manifest_field_invalid"


class UnsupportedSchemaVersion(InvalidCheckpointState):
    problem = "unsupported_schema_version"


class ParticipantMismatch(InvalidCheckpointState):
    problem = "participant_mismatch"


class RecordsPathEscapes(InvalidCheckpointState):
    problem = "records_path_escapes"


class RecordsNameInvalid(InvalidCheckpointState):
    problem = "records_name_invalid"


class RecordsMissing(InvalidCheckpointState, FileNotFoundError):
    problem = "records_missing"


class RecordsSizeMismatch(InvalidCheckpointState):
    problem = "records_size_mismatch"


class RecordsDigestMismatch(InvalidCheckpointState):
    problem = "records_digest_mismatch"


class RecordUndecodable(InvalidCheckpointState):
    problem = "record_undecodable"


class RecordTooLong(RecordUndecodable):
    """A records line longer than its manifest's ``max_record_bytes`` (or the documented cap): held no further."""

    problem = "record_too_long"


class RecordCountMismatch(InvalidCheckpointState):
    problem = "record_count_mismatch"


class EpisodeIdsMismatch(InvalidCheckpointState):
    problem = "episode_ids_mismatch"


class DuplicateEpisode(InvalidCheckpointState):
    """One episode id on two lines of a records file, or listed twice by a manifest."""

    problem = "duplicate_episode"


class NotRegularFile(InvalidCheckpointState, OSError):
    """A symlink, FIFO, socket or device where a records file, a manifest or a directory of state belongs.

    Only regular files (in real directories) are state: such an entry is never followed or read.
    """

    problem = "not_regular_file"


class UnaddressableKey(InvalidCheckpointState):
    """An object key under a checkpoint with an empty, ``.`` or ``..`` segment (``gym//x``, ``gym/./x``).

    No store-relative path names it, so no gymckpt reader reads it; a tool that maps keys to
    paths would read it as another file. ``verify`` reports it, never skips it silently.
    """

    problem = "unaddressable_key"


class FileTooLarge(InvalidCheckpointState):
    """A manifest or ``checkpoint.json`` larger than its documented limit (read no further)."""

    problem = "file_too_large"


class DocumentTooComplex(InvalidCheckpointState):
    """A manifest or ``checkpoint.json`` whose decoded objects would cost more than the parse budget (not decoded)."""

    problem = "document_too_complex"


class DuplicateKey(InvalidCheckpointState):
    """A manifest or ``checkpoint.json`` holding one key twice in an object (readers that keep the first would differ)."""

    problem = "duplicate_key"


class CheckpointIndexInvalid(InvalidCheckpointState):
    problem = "checkpoint_index_invalid"


class IndexParticipantMissing(CheckpointIndexInvalid, FileNotFoundError):
    problem = "index_participant_missing"


class IndexDigestMismatch(CheckpointIndexInvalid):
    problem = "index_digest_mismatch"


class IndexParticipantUnlisted(CheckpointIndexInvalid):
    problem = "index_participant_unlisted"


class CheckpointIdMismatch(CheckpointIndexInvalid):
    """A manifest whose ``checkpoint_id`` differs from the checkpoint's (its index, or the other manifests)."""

    problem = "checkpoint_id_mismatch"


class CheckpointUnpublished(InvalidCheckpointState, FileNotFoundError):
    """No ``gym/checkpoint.json``: the Coordinator restores only what was published (verify's finding of the same name)."""

    problem = "checkpoint_unpublished"


class UnusableDirectory(InvalidCheckpointState, OSError):
    """A directory that cannot hold state: read-only, not permitted, or not a directory."""

    problem = "unusable_directory"


class InvalidDataset(GymckptError, ValueError):
    """A collection's dataset (or its results file) that cannot be used: names the file, the line and why."""

    code = "invalid_dataset"
    status = 400

    def __init__(self, detail: str, *, path: str = "", line: int | None = None) -> None:
        where = f"{path}:{line}: " if path and line is not None else f"{path}: " if path else ""
        super().__init__(where + detail)
        self.path = path
        self.line = line


class CollectionExists(GymckptError, FileExistsError):
    """A collection asked to start fresh where an earlier one's results or checkpoints are: resume it instead."""

    code = "collection_exists"
    status = 409


class SettingsError(GymckptError, ValueError):
    """Settings refused at startup (a server config, a stack file, a ``checkpoint:`` block); never on the wire.

    ``problems`` holds ``(key path, why)`` pairs; the text is one ``file: key.path: why`` line
    each (no ``file: `` for a dict, no key for the file as a whole). It shows no value given
    (a token stays out of it) but a server kind or a ``"{name}"`` reference that names nothing.
    """

    def __init__(self, problems: list[tuple[str, str]] | str, *, path: str = "") -> None:
        self.problems = [("", problems)] if isinstance(problems, str) else list(problems)
        self.path = path
        where = f"{path}: " if path else ""
        super().__init__("\n".join(f"{where}{key}: {why}" if key else f"{where}{why}" for key, why in self.problems))


class AppNotLoadable(GymckptError, ValueError):
    """An app named as ``module:attr`` (``gymckpt serve --app``, a stack file's ``app:``) that gives no app.

    The module cannot be imported (or raised while it was), it has no such attribute, or the
    attribute is neither a FastAPI (Starlette) app nor a factory that takes no arguments and
    returns one. Refused at startup, never on the wire.
    """


class PreemptionGuardInactive(GymckptError, RuntimeError):
    """A notice or checkpoint through a :class:`~gymckpt.control.preemption.PreemptionGuard` outside
    its ``async with`` (not entered yet, or left); never on the wire."""


class RayStackError(GymckptError):
    """The Ray launcher (:mod:`gymckpt.stack.ray`) could not place or keep a stack; never on the wire."""


class NodeLost(RayStackError):
    """A Ray node holding servers of the stack died: its servers are gone, place the stack again and restore."""

    def __init__(self, detail: str = "", nodes: list[str] | None = None) -> None:
        super().__init__(detail)
        #: the ids of the nodes found dead
        self.nodes = list(nodes or [])


class RayHeadLost(RayStackError):
    """Ray's head node (its GCS) is gone: without Ray's external GCS store the cluster cannot recover."""


class SharedStorageRequired(RayStackError, ValueError):
    """Servers on several nodes, and a checkpoint location not every node sees; refused at startup."""


#: wire code → the one class that defines it (its subclasses inherit the code and are not listed)
WIRE_ERRORS: dict[str, type[GymckptError]] = {
    cls.code: cls
    for cls in (
        GymckptError,
        InvalidPayload,
        NoCheckpointFound,
        InvalidRequest,
        ServerCallFailed,
        DownstreamError,
        InferenceFailed,
        ClientDisconnected,
        RequestTimeout,
        SessionOwnerGone,
        SessionForwardFailed,
        StorageError,
        UnsupportedStorage,
        WriteStopped,
        ControlError,
        StaleCheckpoint,
        CheckpointConflict,
        InvalidPhase,
        DeadlineExceeded,
        StaleAttempt,
        RetireIncomplete,
        GenerationCutMismatch,
        CoordinatorUnavailable,
        RestartInScope,
        ExportFailed,
        CheckpointParked,
        RolloutIdRequired,
        InvalidRolloutId,
        CheckpointDirNotAllowed,
        SessionBusy,
        AgentError,
        AgentRequestError,
        RestoredInputMismatch,
        SessionRolloutMismatch,
        ReplayDiverged,
        Unauthorized,
        InvalidCheckpointState,
        InvalidDataset,
        CollectionExists,
    )
}


def error_for_code(code: str) -> type[GymckptError] | None:
    """The class of the wire error ``code`` (``{"error": {"code": …}}``), None for a code gymckpt never sends."""
    return WIRE_ERRORS.get(code)
