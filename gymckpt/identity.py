"""Episode identity, at the bottom of the layers: rollout ids, attempts, capture keys, the rollout prefix.

An episode is one attempt of one rollout. Its capture key names it everywhere:
``r`` for attempt 0 and ``r-aN`` for attempt ``N >= 1``. The suffix ``-a<N>`` is
therefore reserved: a rollout id never ends with it, and an explicit id that does
names attempt ``N`` of the rest of the id. This module is the one codec of capture keys:
the control plane, its request models and the participants all parse them here.

Decisions this module makes (the reference stack's grammar, with two bounds of our own):

- A rollout id matches ``^[A-Za-z0-9][A-Za-z0-9._-]*$`` and does not end with the
  reserved suffix ``-a<N>`` for ``N >= 1`` written without a leading zero
  (``-a([1-9][0-9]*)$``). So ``x-a0`` and ``x-a01`` are rollout ids of their own (attempt
  0, key ``x-a0``), exactly as in the reference, and every key decodes to one episode.
- Bounds the reference does not set: a rollout id is at most
  :data:`MAX_ROLLOUT_ID_LENGTH` characters and an attempt at most :data:`MAX_ATTEMPT`.
  Capture keys travel in URL paths, log lines and per-rollout marks held for the life of
  the process; an unbounded id lets one request grow all three.
- Attempts are plain ints (not bools, not numeric strings).

On the wire an episode is the reference's object ``{"rollout_id": str, "attempt": int}``
or its capture-key string; :func:`episode_key` reads either, :meth:`EpisodeId.to_wire`
writes the object.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gymckpt.errors import InvalidRolloutId, RolloutAttemptConflict

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

__all__ = [
    "MAX_ATTEMPT",
    "MAX_ROLLOUT_ID_LENGTH",
    "ROLLOUT_PREFIX",
    "AttemptsUpTo",
    "EpisodeId",
    "capture_key",
    "default_rollout_id",
    "episode_key",
    "episode_object",
    "first_keys",
    "new_checkpoint_id",
    "rollout_path",
    "split_capture_key",
    "split_rollout_path",
    "validate_capture_key",
    "validate_rollout_id",
]

#: the longest rollout id accepted (a capture key adds at most ``-a`` and nine digits)
MAX_ROLLOUT_ID_LENGTH = 256
#: the highest attempt index accepted
MAX_ATTEMPT = 999_999_999
#: model and resources calls of a rollout go to ``/ng-rollout/<capture key>/<path>``
ROLLOUT_PREFIX = "/ng-rollout/"

# the reserved attempt suffix at the very end: ``-a`` and a number >= 1 without a leading zero
_SUFFIX = re.compile(r"-a([1-9][0-9]*)\Z")

# the reference's rollout id grammar
_ROLLOUT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


#: how many valid ids each validator remembers: a checkpoint of 16,000 rollouts checks every key
#: several times (the request, the scope, the marks, the records), and each check is a pure function
_VALID_IDS_CACHED = 1 << 16
#: the fields of the reference's episode id object
_EPISODE_FIELDS = frozenset({"rollout_id", "attempt"})


#: valid rollout ids seen; and valid capture key → (rollout id, attempt): each dropped whole when full
_VALID_ROLLOUT_IDS: set[str] = set()
_VALID_KEYS: dict[str, tuple[str, int]] = {}


def _remember_key(key: str, parts: tuple[str, int]) -> None:
    if len(_VALID_KEYS) >= _VALID_IDS_CACHED:
        _VALID_KEYS.clear()
    _VALID_KEYS[key] = parts


def validate_rollout_id(rollout_id: object) -> str:
    """Return ``rollout_id`` if it is a valid rollout id (see the module notes), else raise."""
    if type(rollout_id) is str and rollout_id in _VALID_ROLLOUT_IDS:
        return rollout_id
    if not isinstance(rollout_id, str):
        raise InvalidRolloutId(f"a rollout id must be a string, not {type(rollout_id).__name__}")
    _valid_rollout_id(rollout_id)
    if len(_VALID_ROLLOUT_IDS) >= _VALID_IDS_CACHED:
        _VALID_ROLLOUT_IDS.clear()
    _VALID_ROLLOUT_IDS.add(rollout_id)
    return rollout_id


def _valid_rollout_id(rollout_id: str) -> str:
    """:func:`validate_rollout_id` of a string, checked in full (a refusal raises)."""
    if not rollout_id:
        raise InvalidRolloutId("a rollout id must not be empty")
    if len(rollout_id) > MAX_ROLLOUT_ID_LENGTH:
        raise InvalidRolloutId(f"a rollout id is at most {MAX_ROLLOUT_ID_LENGTH} characters, got {len(rollout_id)}")
    if _ROLLOUT_ID.fullmatch(rollout_id) is None:
        raise InvalidRolloutId(
            f"rollout id {rollout_id!r} must start with a letter or digit and hold only letters, digits, '.', '_' and '-'"
        )
    match = _SUFFIX.search(rollout_id)
    if match is not None:
        raise InvalidRolloutId(
            f"rollout id {rollout_id!r} ends with the reserved attempt suffix {match.group(0)!r} (-a<N> names an attempt)"
        )
    return rollout_id


def _validate_attempt(attempt: object, what: str = "attempt") -> int:
    if isinstance(attempt, bool) or not isinstance(attempt, int):
        raise InvalidRolloutId(f"an {what} must be an int, not {type(attempt).__name__}")
    if not 0 <= attempt <= MAX_ATTEMPT:
        raise InvalidRolloutId(f"an {what} must be between 0 and {MAX_ATTEMPT}, got {attempt}")
    return attempt


def split_capture_key(key: str) -> tuple[str, int]:
    """``"r"`` → ``("r", 0)``; ``"r-aN"`` → ``("r", N)`` for N ≥ 1 (no leading zero); anything invalid is refused.

    ``"r-a0"`` and ``"r-a01"`` carry no attempt suffix: they are attempt 0 of the
    rollouts so named. The rollout id is validated too (:func:`validate_rollout_id`); an
    attempt beyond :data:`MAX_ATTEMPT` is :class:`InvalidRolloutId`.
    """
    if type(key) is str:
        known = _VALID_KEYS.get(key)
        if known is not None:
            return known
    if not isinstance(key, str):
        raise InvalidRolloutId(f"a capture key must be a string, not {type(key).__name__}")
    parts = _split_valid_capture_key(key)
    _remember_key(key, parts)
    return parts


def _split_valid_capture_key(key: str) -> tuple[str, int]:
    """:func:`split_capture_key` of a string, checked in full (a refusal raises)."""
    if not key:
        raise InvalidRolloutId("a capture key must not be empty")
    match = _SUFFIX.search(key)
    if match is None:
        return validate_rollout_id(key), 0
    digits = match.group(1)
    if len(digits) > len(str(MAX_ATTEMPT)) or int(digits) > MAX_ATTEMPT:
        raise InvalidRolloutId(f"capture key {key!r} names an attempt beyond {MAX_ATTEMPT}")
    return validate_rollout_id(key[: match.start()]), int(digits)


def capture_key(rollout_id: str, attempt: int) -> str:
    """The capture key of an attempt: ``r`` for attempt 0, ``r-aN`` after."""
    if type(rollout_id) is str and type(attempt) is int:
        key = rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"
        # a valid pair's key splits back into it, and a key remembered is valid
        if _VALID_KEYS.get(key) != (rollout_id, attempt):
            validate_rollout_id(rollout_id)
            _remember_key(key, (rollout_id, _validate_attempt(attempt)))
        return key
    return EpisodeId(rollout_id, attempt).capture_key


def validate_capture_key(key: object) -> str:
    """Return ``key`` if it is a valid capture key, else raise :class:`InvalidRolloutId`."""
    split_capture_key(key)  # type: ignore[arg-type]
    return key  # type: ignore[return-value]


def episode_key(value: object) -> str:
    """The capture key of a wire episode id: a capture-key string or ``{"rollout_id", "attempt"}``.

    The object may hold only those two fields; ``attempt`` defaults to 0. Anything else is
    :class:`InvalidRolloutId`.
    """
    if isinstance(value, str):
        return validate_capture_key(value)
    if isinstance(value, EpisodeId):
        return value.capture_key
    if isinstance(value, dict):
        if not value.keys() <= _EPISODE_FIELDS:
            unknown = sorted(set(value) - _EPISODE_FIELDS)
            raise InvalidRolloutId(f"an episode id object holds only rollout_id and attempt, not {unknown}")
        if "rollout_id" not in value:
            raise InvalidRolloutId("an episode id object needs a rollout_id")
        return capture_key(value["rollout_id"], value.get("attempt", 0))
    raise InvalidRolloutId(
        f"an episode id is a capture key or a {{rollout_id, attempt}} object, not {type(value).__name__}"
    )


def episode_object(key: str) -> dict[str, Any]:
    """The reference's wire form of a capture key: ``{"rollout_id": ..., "attempt": ...}``."""
    rollout_id, attempt = split_capture_key(key)
    return {"rollout_id": rollout_id, "attempt": attempt}


def first_keys(keys: list[str], limit: int = 5) -> str:
    """``'a', 'b' (and 3 more)``: the episodes an error names when it cannot name just one."""
    shown = ", ".join(repr(key) for key in keys[:limit])
    more = len(keys) - limit
    return f"{shown} (and {more} more)" if more > 0 else shown or "no episode"


class AttemptsUpTo:
    """Every attempt of a rollout up to an attempt: for each rollout, the highest one covered.

    Retire marks are one (a rollout refused up to an attempt); so is the set of executions a
    retire of some keys stops.
    """

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._highest: dict[str, int] = {}
        for key in keys:
            self.add(key)

    def __len__(self) -> int:
        return len(self._highest)

    def add(self, key: str) -> None:
        """Cover ``key``'s attempt and every earlier attempt of its rollout."""
        rollout, attempt = split_capture_key(key)
        if self._highest.get(rollout, -1) < attempt:
            self._highest[rollout] = attempt

    def add_before(self, key: str) -> None:
        """Cover every attempt of ``key``'s rollout before ``key``'s own."""
        rollout, attempt = split_capture_key(key)
        if attempt > 0 and self._highest.get(rollout, -1) < attempt - 1:
            self._highest[rollout] = attempt - 1

    def covers(self, key: str | EpisodeId) -> bool:
        """True when ``key``'s attempt is covered."""
        rollout, attempt = (key.rollout_id, key.attempt) if isinstance(key, EpisodeId) else split_capture_key(key)
        return attempt <= self._highest.get(rollout, -1)

    def remove(self, rollout_ids: Iterable[str]) -> int:
        """Drop these rollouts; return how many were there."""
        return sum(self._highest.pop(rollout, None) is not None for rollout in set(rollout_ids))

    def snapshot(self) -> dict[str, int]:
        """``{rollout id: highest attempt}``, to hand to another process (a worker)."""
        return dict(self._highest)

    def update(self, highest: Mapping[str, int]) -> None:
        """Cover what a :meth:`snapshot` covers, too."""
        for rollout, attempt in highest.items():
            if self._highest.get(rollout, -1) < attempt:
                self._highest[rollout] = attempt


@dataclass(frozen=True, order=True, slots=True)
class EpisodeId:
    """One attempt of one rollout; ``capture_key`` is its name everywhere."""

    rollout_id: str
    attempt: int = 0

    def __post_init__(self) -> None:
        validate_rollout_id(self.rollout_id)
        _validate_attempt(self.attempt)

    @property
    def capture_key(self) -> str:
        """``r`` for attempt 0, ``r-aN`` for attempt N > 0."""
        return self.rollout_id if self.attempt == 0 else f"{self.rollout_id}-a{self.attempt}"

    def __str__(self) -> str:
        return self.capture_key

    def to_wire(self) -> dict[str, Any]:
        """The reference's wire form: ``{"rollout_id": ..., "attempt": ...}``."""
        return {"rollout_id": self.rollout_id, "attempt": self.attempt}

    def next_attempt(self) -> EpisodeId:
        """The attempt that replaces this one (the one a restore installs records under)."""
        return EpisodeId(self.rollout_id, self.attempt + 1)

    @classmethod
    def from_capture_key(cls, key: object) -> EpisodeId:
        """Decode a capture key (``r-a0`` and ``r-a01`` are attempt 0 of rollouts so named)."""
        rollout_id, attempt = split_capture_key(key)  # type: ignore[arg-type]
        return cls(rollout_id, attempt)

    @classmethod
    def from_parts(cls, rollout_id: object, attempt_index: object | None = None) -> EpisodeId:
        """Combine a run body's rollout id and attempt index.

        An explicit ``"<id>-aN"`` is attempt N of ``<id>``, and may not come with an attempt
        index (:class:`RolloutAttemptConflict`, whatever the index). A plain id takes the
        attempt index, 0 when there is none.
        """
        if isinstance(rollout_id, str) and _SUFFIX.search(rollout_id) is not None:
            if attempt_index is not None:
                raise RolloutAttemptConflict(
                    f"rollout id {rollout_id!r} already names an attempt and cannot also take attempt index {attempt_index!r}"
                )
            return cls.from_capture_key(rollout_id)
        attempt = 0 if attempt_index is None else _validate_attempt(attempt_index, "attempt index")
        return cls(validate_rollout_id(rollout_id), attempt)

    @classmethod
    def from_run_body(cls, body: Mapping[str, Any]) -> EpisodeId | None:
        """The episode of a legacy flat run body, or None when it names no rollout.

        Reads ``_ng_rollout_id`` and ``_ng_attempt_index``; without an explicit id the id is
        ``"<_ng_task_index>-<_ng_rollout_index>"`` when both are present.
        """
        rollout_id = body.get("_ng_rollout_id")
        if rollout_id is None:
            task_index = body.get("_ng_task_index")
            rollout_index = body.get("_ng_rollout_index")
            if task_index is None or rollout_index is None:
                return None
            rollout_id = default_rollout_id(task_index, rollout_index)
        return cls.from_parts(rollout_id, body.get("_ng_attempt_index"))


def default_rollout_id(task_index: object, rollout_index: object) -> str:
    """The rollout id of a row without an explicit one: ``"<task index>-<rollout index>"``."""
    for name, value in (("task index", task_index), ("rollout index", rollout_index)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidRolloutId(f"a {name} must be a non-negative int, got {value!r}")
    return f"{task_index}-{rollout_index}"


def rollout_path(capture_key: str | EpisodeId, path: str) -> str:
    """``/ng-rollout/<capture key><path>`` for a path that starts with ``/``."""
    key = (
        capture_key.capture_key
        if isinstance(capture_key, EpisodeId)
        else EpisodeId.from_capture_key(capture_key).capture_key
    )
    if not path.startswith("/"):
        raise InvalidRolloutId(f"path {path!r} must start with /")
    if _is_prefixed(path):
        raise InvalidRolloutId(f"path {path!r} already carries a rollout prefix")
    return f"{ROLLOUT_PREFIX}{key}{path}"


def split_rollout_path(path: str) -> tuple[EpisodeId | None, str]:
    """Split a request path into its episode and the path after the rollout prefix.

    A path without the prefix is ``(None, path)``. A prefixed path must have a valid
    capture key followed by ``/`` and must not be prefixed twice; otherwise
    :class:`InvalidRolloutId`. The path is the decoded path without a query string.
    """
    if not _is_prefixed(path):
        return None, path
    key, slash, tail = path[len(ROLLOUT_PREFIX) :].partition("/")
    if not slash:
        raise InvalidRolloutId(f"rollout path {path!r} has no path after its capture key")
    episode = EpisodeId.from_capture_key(key)
    remaining = "/" + tail
    if _is_prefixed(remaining):
        raise InvalidRolloutId(f"rollout path {path!r} carries the rollout prefix twice")
    return episode, remaining


def _is_prefixed(path: str) -> bool:
    return path.startswith(ROLLOUT_PREFIX) or path == ROLLOUT_PREFIX[:-1]


def new_checkpoint_id() -> str:
    """A fresh checkpoint id: ``ckpt-20261201T183012-1a2b3c4d`` (UTC time, 8 random hex digits)."""
    return f"ckpt-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"
