"""Request and reply bodies of the control routes: unknown fields are refused."""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints

from gymckpt.identity import MAX_ROLLOUT_ID_LENGTH, episode_key, validate_capture_key, validate_rollout_id
from gymckpt.store.layout import check_name

__all__ = [
    "CommitReply",
    "CommitRequest",
    "ControlRequest",
    "ErrorBody",
    "ErrorDetail",
    "ForgetReply",
    "ForgetRequest",
    "Phase",
    "PrepareReply",
    "PrepareReport",
    "RenewReply",
    "RestoreReply",
    "RestoreRequest",
    "ResumeReply",
    "RetireReply",
    "RetireRequest",
    "StatusReply",
]


class Phase(StrEnum):
    """A participant's checkpoint phase."""

    IDLE = "idle"
    PREPARING = "preparing"
    PREPARED = "prepared"
    COMMITTED = "committed"
    RESTORED = "restored"


def is_name(value: str) -> str:
    """A checkpoint id follows the store's name rule (:func:`gymckpt.store.layout.check_name`)."""
    return check_name("checkpoint_id", value)


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("deadline_ts must be a finite epoch time in seconds")
    return value


def _episode_key(value: object) -> object:
    """The reference's ``{"rollout_id", "attempt"}`` object becomes its capture key; a string stays."""
    return episode_key(value) if isinstance(value, dict) else value


#: the wire's pattern (the schema clients see); the store's one name rule (a checkpoint id names files) enforces it
CheckpointId = Annotated[
    str,
    StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$"),
    AfterValidator(is_name),
]
DeadlineTs = Annotated[float, Field(strict=True), AfterValidator(_finite)]
#: a capture key: ``r`` or ``r-aN``, decoded by the one codec (gymckpt.identity)
CaptureKey = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_ROLLOUT_ID_LENGTH + 11), AfterValidator(validate_capture_key)
]
RolloutId = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_ROLLOUT_ID_LENGTH), AfterValidator(validate_rollout_id)
]
#: an episode id on the wire: the reference's ``{"rollout_id", "attempt"}`` object or a capture key; held as the key
EpisodeRef = Annotated[CaptureKey, BeforeValidator(_episode_key)]
CheckpointDir = Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=r"^[^\x00]+$")]
#: a sha256 digest as gym/checkpoint.json lists it: 64 lowercase hex digits
Sha256Hex = Annotated[str, StringConstraints(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ControlRequest(_Strict):
    """Every control request: the checkpoint it belongs to and when the caller gives up."""

    checkpoint_id: CheckpointId
    deadline_ts: DeadlineTs = Field(description="Absolute deadline, epoch seconds.")


class CommitRequest(ControlRequest):
    checkpoint_dir: CheckpointDir = Field(description="Local path or fsspec URL of the checkpoint directory.")
    episode_ids: list[EpisodeRef] | None = Field(
        default=None,
        description="The scope: the episodes the controller continues. None: export every live one, delete nothing.",
    )
    stop: bool = Field(
        default=False, strict=True, description="The controller stops after this checkpoint instead of resuming it."
    )


class RestoreRequest(ControlRequest):
    """A restore; the two optional fields name what was published (gymckpt's own, SPEC C10).

    Without them (the reference's controller sends neither), the server reads
    ``gym/checkpoint.json`` itself where one exists.
    """

    checkpoint_dir: CheckpointDir
    episode_ids: list[EpisodeRef] = Field(description="The checkpointed attempts; records return under attempt + 1.")
    manifest_sha256: Sha256Hex | None = Field(
        default=None,
        description="The sha256 of this participant's manifest bytes as gym/checkpoint.json lists it; "
        "a manifest that hashes otherwise is refused (invalid_checkpoint_state) and nothing is installed.",
    )
    source_checkpoint_id: CheckpointId | None = Field(
        default=None,
        description="The checkpoint id gym/checkpoint.json names; a manifest of another id is refused.",
    )


class RetireRequest(ControlRequest):
    episode_ids: list[EpisodeRef] = Field(min_length=1)


class ForgetRequest(ControlRequest):
    rollout_ids: list[RolloutId] = Field(min_length=1)


class PrepareReport(BaseModel):
    """Readiness at a prepare's reply: blockers are capped, restarts never are."""

    ready: bool
    blockers: list[str] = Field(default_factory=list, description="The first 100 blocking capture keys.")
    blocker_count: int = 0
    counts: dict[str, int] = Field(default_factory=dict)
    restarts: list[str] = Field(default_factory=list)


class PrepareReply(BaseModel):
    phase: Phase
    report: PrepareReport


class CommitReply(BaseModel):
    """The reference's ``{phase, manifest, episode_ids}``, gymckpt's own fields beside them."""

    model_config = ConfigDict(extra="allow")

    phase: Phase
    manifest: dict[str, Any] = Field(description="The manifest object, exactly as written.")
    episode_ids: list[str] = Field(description="Capture keys of the episodes with a record, sorted.")
    kind: str = Field(description="The participant's kind (its directory under gym/).")
    instance: str = Field(description="The participant's instance (its directory under gym/<kind>/).")
    checkpoint_id: str
    checkpoint_dir: str
    manifest_path: str = Field(description="Path of the manifest, relative to checkpoint_dir.")
    manifest_sha256: str
    records_file: str
    record_count: int
    records_bytes: int


class RestoreReply(BaseModel):
    phase: Phase
    source_checkpoint_id: str
    restored: list[str] = Field(description="Next-attempt capture keys the records were installed under.")


class ResumeReply(BaseModel):
    phase: Phase
    idempotent: bool = Field(description="True when nothing was open under this id (a repeat, or an id never seen).")
    checkpoint_id: str


class RenewReply(BaseModel):
    phase: Phase
    checkpoint_id: str
    lease_expires_at: float


class RetireReply(BaseModel):
    retired_count: int
    retired: list[str] = Field(
        default_factory=list, description="The retired capture keys, sorted (what some reference versions read)."
    )


class ForgetReply(BaseModel):
    forgotten_count: int = Field(description="How many of the rollouts had a retire mark.")
    forgotten: list[str] = Field(default_factory=list, description="The rollout ids of the request, sorted.")


class StatusReply(BaseModel):
    model_config = ConfigDict(extra="allow")

    kind: str
    instance: str
    phase: Phase
    checkpoint_id: str | None
    lease_expires_at: float | None
    retired_rollouts: int
    report: PrepareReport
    restore_checks: list[str] = Field(
        default_factory=list,
        description="The optional restore fields this server checks (gymckpt's: manifest_sha256, "
        "source_checkpoint_id); a controller sends them only to a server that lists them.",
    )
    allowed_roots: list[str] | None = Field(
        default=None,
        description="Where a checkpoint_dir may lie (the setting checkpoint.allowed_roots, each resolved as "
        "requests are compared with it); null allows any local path and file:// or s3:// URL. A controller "
        "checks its directory against it before it starts; a status without the key (a reference server) "
        "says nothing.",
    )


class ErrorDetail(BaseModel):
    code: str
    detail: str


class ErrorBody(BaseModel):
    """Every error reply: ``{"error": {"code", "detail"}}``."""

    error: ErrorDetail
