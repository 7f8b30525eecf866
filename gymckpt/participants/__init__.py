"""Participants: episode steps and the participant kinds built on them (identity lives in gymckpt.identity)."""

from gymckpt.errors import InvalidRolloutId, RolloutAttemptConflict
from gymckpt.identity import (
    MAX_ATTEMPT,
    MAX_ROLLOUT_ID_LENGTH,
    ROLLOUT_PREFIX,
    EpisodeId,
    default_rollout_id,
    rollout_path,
    split_rollout_path,
    validate_rollout_id,
)
from gymckpt.participants.steps import Episode, EpisodeEnded, EpisodeRegistry, EpisodeState, StepMode

__all__ = [
    "MAX_ATTEMPT",
    "MAX_ROLLOUT_ID_LENGTH",
    "ROLLOUT_PREFIX",
    "Episode",
    "EpisodeEnded",
    "EpisodeId",
    "EpisodeRegistry",
    "EpisodeState",
    "InvalidRolloutId",
    "RolloutAttemptConflict",
    "StepMode",
    "default_rollout_id",
    "rollout_path",
    "split_rollout_path",
    "validate_rollout_id",
]
