"""Participants: episode identity and episode steps (the kinds of participant build on these)."""

from gymckpt.participants.identity import (
    MAX_ATTEMPT,
    MAX_ROLLOUT_ID_LENGTH,
    ROLLOUT_PREFIX,
    EpisodeId,
    InvalidRolloutId,
    RolloutAttemptConflict,
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
