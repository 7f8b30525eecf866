"""Retire marks: the attempt fence, rollouts refused up to an attempt until forgotten.

A participant owns its fence (:attr:`gymckpt.control.participant.Participant.fence`); the
control plane marks and forgets through it, the participant checks requests against it,
and :meth:`RetireMarks.snapshot` / :meth:`RetireMarks.update` hand it to other processes.
"""

from __future__ import annotations

from gymckpt.errors import StaleAttempt
from gymckpt.identity import AttemptsUpTo

__all__ = ["RetireMarks"]


class RetireMarks(AttemptsUpTo):
    """For each retired, not yet forgotten rollout: the highest attempt refused."""

    def mark(self, key: str) -> None:
        """Refuse ``key``'s attempt and every earlier attempt of its rollout."""
        self.add(key)

    def mark_before(self, key: str) -> None:
        """Refuse every attempt of ``key``'s rollout before ``key``'s own."""
        self.add_before(key)

    def is_refused(self, key: str) -> bool:
        """True when ``key``'s attempt is retired."""
        return self.covers(key)

    def check(self, key: str) -> None:
        """Raise :class:`StaleAttempt` for a request of a retired attempt."""
        if self.covers(key):
            raise StaleAttempt(f"attempt {key!r} was retired; only a later attempt of its rollout may run")

    def forget(self, rollout_ids: list[str]) -> int:
        """Drop the marks of these rollouts; return how many were there."""
        return self.remove(rollout_ids)
