"""Episode identity (I1): capture keys, the reserved -a<N> suffix, run bodies, rollout paths."""

from __future__ import annotations

import string

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from gymckpt.errors import GymckptError
from gymckpt.identity import (
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

# ---------------------------------------------------------------- strategies

# the reference grammar's characters
_ID_ALPHABET = st.sampled_from(string.ascii_letters + string.digits + "._-")


def _valid(text: str) -> bool:
    try:
        validate_rollout_id(text)
    except InvalidRolloutId:
        return False
    return True


# ids built from pieces that often contain "-a" and digits in the middle ("x-a3-b")
_pieces = st.one_of(
    st.text(_ID_ALPHABET, min_size=1, max_size=6), st.sampled_from(["-a", "-a3", "a", "-", "0", "-a0", "-a01"])
)
rollout_ids = (
    st.lists(_pieces, min_size=1, max_size=8).map("".join).map(lambda s: s[:MAX_ROLLOUT_ID_LENGTH]).filter(_valid)
)
attempts = st.integers(min_value=0, max_value=10**6)


# ---------------------------------------------------------------- capture keys


def test_capture_key_of_first_and_later_attempts() -> None:
    assert EpisodeId("r").capture_key == "r"
    assert EpisodeId("r", 0).capture_key == "r"
    assert EpisodeId("r", 3).capture_key == "r-a3"
    assert str(EpisodeId("job-7", 12)) == "job-7-a12"


def test_next_attempt() -> None:
    assert EpisodeId("r").next_attempt() == EpisodeId("r", 1)
    assert EpisodeId("r", 4).next_attempt().capture_key == "r-a5"


def test_ordering_and_hashing() -> None:
    ids = {EpisodeId("b", 1), EpisodeId("a", 2), EpisodeId("a", 0), EpisodeId("a", 0)}
    assert sorted(ids) == [EpisodeId("a", 0), EpisodeId("a", 2), EpisodeId("b", 1)]


def test_is_a_typed_400_error() -> None:
    with pytest.raises(InvalidRolloutId) as info:
        EpisodeId("")
    assert isinstance(info.value, GymckptError)
    assert isinstance(info.value, ValueError)
    assert info.value.code == "invalid_rollout_id"
    assert info.value.status == 400
    assert issubclass(RolloutAttemptConflict, InvalidRolloutId)


@given(rollout_ids, attempts)
@example("x-a3-b", 0)
@example("x-a3-b", 7)
@example("a-a", 1)
@example("x-a0", 2)
@example("x-a01-y", 10**6)
def test_every_key_built_from_parts_decodes_back(rollout_id: str, attempt: int) -> None:
    episode = EpisodeId(rollout_id, attempt)
    key = episode.capture_key
    assert EpisodeId.from_capture_key(key) == episode
    # the run-body way of naming it agrees too
    assert EpisodeId.from_parts(rollout_id, attempt) == episode
    assert EpisodeId.from_parts(key) == episode
    assert EpisodeId.from_parts(rollout_id) == EpisodeId(rollout_id, 0)


@given(
    st.text(max_size=40) | st.builds(lambda a, b: f"{a}-a{b}", st.text(max_size=8), st.text("0123456789", max_size=4))
)
@example("r-a0")
@example("r-a01")
@example("-a3")
def test_every_accepted_key_is_canonical(key: str) -> None:
    """A key either is refused or decodes to an episode whose capture key is that same key."""
    try:
        episode = EpisodeId.from_capture_key(key)
    except InvalidRolloutId:
        return
    assert episode.capture_key == key


@pytest.mark.parametrize("key", ["r-a0", "r-a01", "r-a00", "job-a007"])
def test_a_zero_led_suffix_is_part_of_the_rollout_id(key: str) -> None:
    """As in the reference grammar, only ``-a`` and a number >= 1 without a leading zero is an attempt."""
    assert EpisodeId.from_capture_key(key) == EpisodeId(key, 0)
    assert EpisodeId.from_parts(key) == EpisodeId(key, 0)
    assert EpisodeId(key, 2).capture_key == f"{key}-a2"
    assert EpisodeId.from_capture_key(f"{key}-a2") == EpisodeId(key, 2)


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("r", EpisodeId("r", 0)),
        ("r-a1", EpisodeId("r", 1)),
        ("r-a10", EpisodeId("r", 10)),
        ("x-a3-b", EpisodeId("x-a3-b", 0)),
        ("x-a3-b-a2", EpisodeId("x-a3-b", 2)),
        ("r-a", EpisodeId("r-a", 0)),
        ("r-ab1", EpisodeId("r-ab1", 0)),
        ("r-A1", EpisodeId("r-A1", 0)),
        ("3-4", EpisodeId("3-4", 0)),
    ],
)
def test_from_capture_key(key: str, expected: EpisodeId) -> None:
    assert EpisodeId.from_capture_key(key) == expected


@pytest.mark.parametrize("key", ["-a3", "x-a3-a2", "r-a1234567890", "", "a/b-a1", 7])
def test_from_capture_key_refuses(key: object) -> None:
    with pytest.raises(InvalidRolloutId):
        EpisodeId.from_capture_key(key)


# ---------------------------------------------------------------- rollout id validation


@pytest.mark.parametrize(
    "rollout_id",
    [
        "",
        "a/b",
        "a b",
        "a\tb",
        "a\nb",
        "a\x00b",
        "a?b",
        "a#b",
        "a%2Fb",
        "a\\b",
        ".",
        "..",
        "x" * (MAX_ROLLOUT_ID_LENGTH + 1),
        "r-a1",
        "-a5",
        ".x",
        "_x",
        "a:b",
        "a@b",
        "é",
        None,
        5,
    ],
)
def test_invalid_rollout_ids(rollout_id: object) -> None:
    with pytest.raises(InvalidRolloutId):
        EpisodeId(rollout_id, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "rollout_id", ["r", "3-4", "x-a3-b", "x-a0", "x-a01", "a.b_c-d", "0", "x" * MAX_ROLLOUT_ID_LENGTH]
)
def test_valid_rollout_ids(rollout_id: str) -> None:
    assert validate_rollout_id(rollout_id) == rollout_id


@pytest.mark.parametrize("attempt", [-1, MAX_ATTEMPT + 1, True, 1.0, "1", None])
def test_invalid_attempts(attempt: object) -> None:
    with pytest.raises(InvalidRolloutId):
        EpisodeId("r", attempt)  # type: ignore[arg-type]


def test_largest_attempt_round_trips() -> None:
    episode = EpisodeId("r", MAX_ATTEMPT)
    assert EpisodeId.from_capture_key(episode.capture_key) == episode
    with pytest.raises(InvalidRolloutId):
        episode.next_attempt()


# ---------------------------------------------------------------- from_parts and run bodies


def test_explicit_suffix_is_that_attempt() -> None:
    assert EpisodeId.from_parts("restored-a1") == EpisodeId("restored", 1)
    assert EpisodeId.from_parts("job-a2", None) == EpisodeId("job", 2)


@pytest.mark.parametrize("attempt_index", [0, 1, 2, 5])
def test_suffix_and_attempt_index_are_refused(attempt_index: int) -> None:
    with pytest.raises(RolloutAttemptConflict, match="job-a2"):
        EpisodeId.from_parts("job-a2", attempt_index)


def test_plain_id_takes_the_attempt_index() -> None:
    assert EpisodeId.from_parts("job", 1) == EpisodeId("job", 1)
    assert EpisodeId.from_parts("job", 1).capture_key == "job-a1"
    assert EpisodeId.from_parts("job") == EpisodeId("job", 0)
    with pytest.raises(InvalidRolloutId):
        EpisodeId.from_parts("job", -1)
    with pytest.raises(InvalidRolloutId):
        EpisodeId.from_parts("job", "1")


def test_default_rollout_id() -> None:
    assert default_rollout_id(3, 4) == "3-4"
    assert EpisodeId.from_parts(default_rollout_id(0, 12), 2).capture_key == "0-12-a2"
    for bad in [(-1, 0), (0, -1), (True, 0), ("1", 2), (1.0, 2)]:
        with pytest.raises(InvalidRolloutId):
            default_rollout_id(*bad)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"_ng_rollout_id": "restored-a1"}, EpisodeId("restored", 1)),
        ({"_ng_rollout_id": "job", "_ng_attempt_index": 1}, EpisodeId("job", 1)),
        ({"_ng_rollout_id": "job"}, EpisodeId("job", 0)),
        ({"_ng_task_index": 3, "_ng_rollout_index": 4}, EpisodeId("3-4", 0)),
        ({"_ng_task_index": 3, "_ng_rollout_index": 4, "_ng_attempt_index": 2}, EpisodeId("3-4", 2)),
        ({"_ng_rollout_id": "x", "_ng_task_index": 3, "_ng_rollout_index": 4}, EpisodeId("x", 0)),
        ({"responses_create_params": {}}, None),
        ({"_ng_task_index": 3}, None),
    ],
)
def test_from_run_body(body: dict[str, object], expected: EpisodeId | None) -> None:
    assert EpisodeId.from_run_body(body) == expected


def test_from_run_body_refuses_suffix_with_attempt_index() -> None:
    with pytest.raises(RolloutAttemptConflict):
        EpisodeId.from_run_body({"_ng_rollout_id": "job-a2", "_ng_attempt_index": 3})


# ---------------------------------------------------------------- rollout path prefix


def test_rollout_path() -> None:
    assert rollout_path("r", "/v1/responses") == "/ng-rollout/r/v1/responses"
    assert rollout_path("r-a2", "/v1/responses") == "/ng-rollout/r-a2/v1/responses"
    assert rollout_path(EpisodeId("x-a3-b", 4), "/seed_session") == "/ng-rollout/x-a3-b-a4/seed_session"
    assert ROLLOUT_PREFIX == "/ng-rollout/"


@pytest.mark.parametrize(
    ("key", "path"),
    [
        ("r", "v1/responses"),
        ("", "/v1"),
        ("a/b", "/v1"),
        ("r", "/ng-rollout/s/v1"),
        ("r", "/ng-rollout"),
    ],
)
def test_rollout_path_refuses(key: str, path: str) -> None:
    with pytest.raises(InvalidRolloutId):
        rollout_path(key, path)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/v1/responses", (None, "/v1/responses")),
        ("/", (None, "/")),
        ("/ng-rolloutx/r/v1", (None, "/ng-rolloutx/r/v1")),
        ("/ng-rollout/r/v1/responses", (EpisodeId("r"), "/v1/responses")),
        ("/ng-rollout/r-a3/v1/responses", (EpisodeId("r", 3), "/v1/responses")),
        ("/ng-rollout/x-a3-b/", (EpisodeId("x-a3-b"), "/")),
        ("/ng-rollout/r-a0/v1", (EpisodeId("r-a0"), "/v1")),
        ("/ng-rollout/r-a01-a2/v1", (EpisodeId("r-a01", 2), "/v1")),
    ],
)
def test_split_rollout_path(path: str, expected: tuple[EpisodeId | None, str]) -> None:
    assert split_rollout_path(path) == expected


@pytest.mark.parametrize(
    "path",
    [
        "/ng-rollout",
        "/ng-rollout/",
        "/ng-rollout/r",
        "/ng-rollout//v1",
        "/ng-rollout/-a1/v1",
        "/ng-rollout/.r/v1",
        "/ng-rollout/a b/v1",
        "/ng-rollout/r/ng-rollout/s/v1",
        "/ng-rollout/r/ng-rollout",
    ],
)
def test_split_rollout_path_refuses_malformed_prefix(path: str) -> None:
    with pytest.raises(InvalidRolloutId):
        split_rollout_path(path)


@given(rollout_ids, attempts, st.lists(st.text("abcxyz_-.0123456789", min_size=1, max_size=6), max_size=4))
def test_rollout_path_round_trip(rollout_id: str, attempt: int, segments: list[str]) -> None:
    path = "/" + "/".join(segments)
    assume(not path.startswith("/ng-rollout"))
    episode = EpisodeId(rollout_id, attempt)
    assert split_rollout_path(rollout_path(episode.capture_key, path)) == (episode, path)
    assert split_rollout_path(path) == (None, path)


def test_remembered_validations_still_refuse_every_bad_id_every_time_and_typed() -> None:
    from gymckpt.identity import capture_key, episode_key, split_capture_key, validate_rollout_id

    for _ in range(2):  # a refusal is never remembered as valid
        with pytest.raises(InvalidRolloutId):
            split_capture_key("bad id")
        with pytest.raises(InvalidRolloutId):
            validate_rollout_id("x-a3")
        with pytest.raises(InvalidRolloutId):
            capture_key("r", -1)
    for unhashable in (["r"], {"r": 1}):  # refused as ids, never a TypeError from a cache
        with pytest.raises(InvalidRolloutId):
            split_capture_key(unhashable)  # type: ignore[arg-type]
        with pytest.raises(InvalidRolloutId):
            episode_key({"rollout_id": unhashable, "attempt": 0})
    with pytest.raises(InvalidRolloutId):
        episode_key({"rollout_id": "r", "attempt": True})
    assert [split_capture_key("r-a2"), split_capture_key("r-a2")] == [("r", 2), ("r", 2)]
    assert episode_key({"rollout_id": "r", "attempt": 2}) == capture_key("r", 2) == "r-a2"


def test_the_remembered_ids_stay_within_their_bound_and_a_key_built_splits_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gymckpt import identity

    monkeypatch.setattr(identity, "_VALID_IDS_CACHED", 4)
    for index in range(10):
        key = identity.capture_key(f"bound-{index}", index)
        assert identity.split_capture_key(key) == (f"bound-{index}", index)
        assert identity.validate_rollout_id(f"bound-{index}") == f"bound-{index}"
        assert len(identity._VALID_KEYS) <= 4 and len(identity._VALID_ROLLOUT_IDS) <= 4
    # a remembered key never stands for another pair: the reserved suffix stays refused as a rollout id
    assert identity.capture_key("x", 3) == "x-a3"
    with pytest.raises(InvalidRolloutId):
        identity.capture_key("x-a3", 0)
    with pytest.raises(InvalidRolloutId):
        identity.capture_key("x", identity.MAX_ATTEMPT + 1)
