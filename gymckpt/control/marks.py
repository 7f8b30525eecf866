"""Capture keys on the wire, and retire marks: rollouts refused up to an attempt until forgotten (C9)."""

from __future__ import annotations

import re

from gymckpt.errors import InvalidRolloutId, StaleAttempt

__all__ = ["RetireMarks", "capture_key", "first_keys", "split_capture_key"]

MAX_ATTEMPT_DIGITS = 9
_ATTEMPT_SUFFIX = re.compile(r"^(?P<rollout>.+)-a(?P<attempt>[0-9]+)$")


def first_keys(keys: list[str], limit: int = 5) -> str:
    """``'a', 'b' (and 3 more)``: the episodes an error names when it cannot name just one."""
    shown = ", ".join(repr(key) for key in keys[:limit])
    more = len(keys) - limit
    return f"{shown} (and {more} more)" if more > 0 else shown or "no episode"


def split_capture_key(key: str) -> tuple[str, int]:
    """``"r"`` → ``("r", 0)``; ``"r-aN"`` → ``("r", N)`` for N ≥ 1 (``-a0`` is not canonical)."""
    if not key:
        raise InvalidRolloutId("a capture key must not be empty")
    match = _ATTEMPT_SUFFIX.match(key)
    if match is None:
        return key, 0
    digits = match["attempt"]
    if digits.startswith("0"):
        raise InvalidRolloutId(
            f"capture key {key!r} has a non-canonical attempt suffix: attempt 0 has no suffix, attempts no leading zeros"
        )
    if len(digits) > MAX_ATTEMPT_DIGITS:
        raise InvalidRolloutId(f"capture key {key!r} names an attempt beyond {10**MAX_ATTEMPT_DIGITS - 1}")
    return match["rollout"], int(digits)


def capture_key(rollout_id: str, attempt: int) -> str:
    """The capture key of an attempt: ``r`` for attempt 0, ``r-aN`` after."""
    if attempt < 0:
        raise InvalidRolloutId(f"attempt must be >= 0, got {attempt}")
    return rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"


class RetireMarks:
    """For each retired, not yet forgotten rollout: the highest attempt refused."""

    def __init__(self) -> None:
        self._marks: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._marks)

    def mark(self, key: str) -> None:
        """Refuse ``key``'s attempt and every earlier attempt of its rollout."""
        rollout, attempt = split_capture_key(key)
        if self._marks.get(rollout, -1) < attempt:
            self._marks[rollout] = attempt

    def mark_before(self, key: str) -> None:
        """Refuse every attempt of ``key``'s rollout before ``key``'s own."""
        rollout, attempt = split_capture_key(key)
        if attempt > 0 and self._marks.get(rollout, -1) < attempt - 1:
            self._marks[rollout] = attempt - 1

    def is_refused(self, key: str) -> bool:
        """True when ``key``'s attempt is retired."""
        rollout, attempt = split_capture_key(key)
        return attempt <= self._marks.get(rollout, -1)

    def check(self, key: str) -> None:
        """Raise :class:`StaleAttempt` for a request of a retired attempt."""
        if self.is_refused(key):
            raise StaleAttempt(f"attempt {key!r} was retired; only a later attempt of its rollout may run")

    def forget(self, rollout_ids: list[str]) -> int:
        """Drop the marks of these rollouts; return how many were there."""
        return sum(self._marks.pop(rollout, None) is not None for rollout in set(rollout_ids))
