"""Restore onto another worker count (gymckpt.workers.placement): grouping, even placement, the tables."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gymckpt.errors import ControlError, InvalidCheckpointState, ManifestFieldInvalid
from gymckpt.workers.placement import Placement, is_routing_id, place_records


def rid(n: int) -> str:
    """A routing id (32 lowercase hex digits) numbered ``n``."""
    return f"{n:032x}"


OLD_A, OLD_B, OLD_C = rid(0xA), rid(0xB), rid(0xC)
NEW_1, NEW_2, NEW_3 = rid(1), rid(2), rid(3)


def session(key: str, *, owner: str | None = None, session_id: str | None = None) -> dict[str, Any]:
    record: dict[str, Any] = {"episode_id": key, "state": {"n": key}}
    if session_id is not None:
        record["session_id"] = session_id
    record["owner"] = owner
    return record


def keys_on(placement: Placement) -> dict[int, list[str]]:
    return {index: [record["episode_id"] for record in records] for index, records in placement.records.items()}


def worker_of(placement: Placement, episode_id: str) -> int:
    (index,) = [i for i, records in placement.records.items() if any(r["episode_id"] == episode_id for r in records)]
    return index


def test_routing_ids_are_32_lowercase_hex_digits() -> None:
    assert is_routing_id(rid(7))
    assert not is_routing_id(rid(7).upper().replace("0", "A"))
    assert not is_routing_id(rid(7)[1:])
    assert not is_routing_id(None)


def test_one_to_n_places_each_owner_less_session_on_its_own_and_stamps_its_new_owner() -> None:
    records = [session(f"s{i}-a1", session_id=f"sess-{i}") for i in range(4)]
    before = copy.deepcopy(records)
    placement = place_records(records, {1: NEW_1, 2: NEW_2})

    assert sorted(len(placed) for placed in placement.records.values()) == [2, 2]
    assert placement.aliases == {}
    assert set(placement.placements) == {f"sess-{i}" for i in range(4)}
    routing = {1: NEW_1, 2: NEW_2}
    for index, placed in placement.records.items():
        for record in placed:
            assert record["owner"] == routing[index]
            assert placement.placements[record["session_id"]] == routing[index]
            assert record["state"] == {"n": record["episode_id"]}
            assert next(iter(record)) == "episode_id"
    assert records == before, "the input records are not modified"


def test_n_to_m_keeps_an_owners_sessions_together_and_spreads_owners_by_record_count() -> None:
    records = [
        session("a0-a1", owner=OLD_A, session_id="a0"),
        *(session(f"b{i}-a1", owner=OLD_B, session_id=f"b{i}") for i in range(2)),
        *(session(f"c{i}-a1", owner=OLD_C, session_id=f"c{i}") for i in range(3)),
    ]
    placement = place_records(records, {1: NEW_1, 2: NEW_2}, session_owners=[OLD_A, OLD_B, OLD_C])

    # largest first: C (3) → worker 1; B (2) → worker 2; A (1) → worker 2, the one with fewer records
    # (in owner order instead, A and C would share worker 1: 4 records against 2)
    assert keys_on(placement) == {1: ["c0-a1", "c1-a1", "c2-a1"], 2: ["a0-a1", "b0-a1", "b1-a1"]}
    assert placement.aliases == {OLD_A: NEW_2, OLD_B: NEW_2, OLD_C: NEW_1}
    assert placement.placements == {}
    assert all(record["owner"] in (OLD_A, OLD_B, OLD_C) for placed in placement.records.values() for record in placed)


def test_n_to_one_puts_everything_on_the_one_worker_and_still_returns_the_tables() -> None:
    records = [
        session("a0-a1", owner=OLD_A, session_id="a0"),
        session("b0-a1", owner=OLD_B),
        session("x-a1", session_id="x"),
    ]
    placement = place_records(records, {5: NEW_1}, session_owners=[OLD_A, OLD_B, OLD_C])

    assert sorted(keys_on(placement)[5]) == ["a0-a1", "b0-a1", "x-a1"]
    assert list(placement.records) == [5]
    assert placement.aliases == {OLD_A: NEW_1, OLD_B: NEW_1, OLD_C: NEW_1}
    assert placement.placements == {"x": NEW_1}


def test_owners_listed_without_records_are_aliased_to_a_live_worker() -> None:
    records = [session(f"a{i}-a1", owner=OLD_A) for i in range(2)]
    placement = place_records(records, {1: NEW_1, 2: NEW_2}, session_owners=[OLD_A, OLD_C])

    assert placement.aliases == {OLD_A: NEW_1, OLD_C: NEW_2}
    assert keys_on(placement) == {1: ["a0-a1", "a1-a1"], 2: []}


def test_owners_alone_are_aliased_with_no_records_at_all() -> None:
    placement = place_records([], {1: NEW_1, 2: NEW_2}, session_owners=[OLD_A, OLD_B])

    assert placement.aliases == {OLD_A: NEW_1, OLD_B: NEW_2}
    assert keys_on(placement) == {1: [], 2: []}


def test_a_record_with_neither_owner_nor_session_id_is_refused_naming_its_episode() -> None:
    records = [session("a0-a1", owner=OLD_A), session("lost-a3")]
    with pytest.raises(InvalidCheckpointState, match="lost-a3") as caught:
        place_records(records, {1: NEW_1, 2: NEW_2})
    assert "neither" in str(caught.value)


@pytest.mark.parametrize("bad", ["ABC", "A" * 32, 17])
def test_a_record_whose_owner_is_not_a_routing_id_is_refused(bad: object) -> None:
    with pytest.raises(InvalidCheckpointState, match="r-a1"):
        place_records([{"episode_id": "r-a1", "owner": bad}], {1: NEW_1})


@pytest.mark.parametrize("routing_id", [None, "", "not-a-routing-id"])
def test_a_live_worker_without_a_routing_id_is_refused(routing_id: str | None) -> None:
    with pytest.raises(ControlError, match=r"\[2\]"):
        place_records([session("s-a1", session_id="s")], {1: NEW_1, 2: routing_id})


def test_no_live_worker_is_refused_when_there_is_something_to_place() -> None:
    with pytest.raises(ControlError, match="live worker"):
        place_records([], {}, session_owners=[OLD_A])


def test_held_records_are_set_aside_and_need_no_routing() -> None:
    records = [{"episode_id": "e0-a1", "kind": "run"}, {"episode_id": "e1-a1", "kind": "run"}]
    placement = place_records(records, {1: None, 2: None}, held=lambda record: record.get("kind") == "run")

    assert [record["episode_id"] for record in placement.held] == ["e0-a1", "e1-a1"]
    assert keys_on(placement) == {1: [], 2: []}
    assert placement.aliases == {} and placement.placements == {}


def test_held_records_are_not_placed_beside_sessions() -> None:
    records = [{"episode_id": "e0-a1", "kind": "run"}, session("s-a1", session_id="s")]
    placement = place_records(records, {1: NEW_1}, held=lambda record: record.get("kind") == "run")

    assert [record["episode_id"] for record in placement.held] == ["e0-a1"]
    assert keys_on(placement) == {1: ["s-a1"]}


@pytest.mark.parametrize("field", ["session_owners", "placed_sessions"])
def test_manifest_extras_that_are_not_lists_of_strings_are_refused(field: str) -> None:
    with pytest.raises(ManifestFieldInvalid, match=field):
        place_records([], {1: NEW_1}, **{field: [OLD_A, 3]})
    with pytest.raises(ManifestFieldInvalid, match=field):
        place_records([], {1: NEW_1}, **{field: OLD_A})


def test_a_listed_owner_that_is_not_a_routing_id_is_refused() -> None:
    with pytest.raises(ManifestFieldInvalid, match="session_owners"):
        place_records([], {1: NEW_1}, session_owners=["worker-1"])


def test_a_placed_session_stays_reachable_by_its_session_id_through_a_second_restore() -> None:
    # round 1: a single-process server's session (no owner) restored onto 2 workers
    first = place_records(
        [session("s-a1", session_id="sess-x"), session("t-a1", session_id="sess-t")], {1: NEW_1, 2: NEW_2}
    )
    holder = first.placements["sess-x"]
    (record,) = [r for placed in first.records.values() for r in placed if r["session_id"] == "sess-x"]
    assert record["owner"] == holder

    # a checkpoint: the record now carries its placed owner, the manifest lists the placement table
    committed = {**record, "episode_id": "s-a2"}
    later = [rid(0x31), rid(0x32), rid(0x33)]
    second = place_records(
        [committed],
        {3: later[0], 4: later[1], 5: later[2]},
        session_owners=sorted(first.aliases.keys() | {holder}),
        placed_sessions=sorted(first.placements),
    )

    assert second.placements == {"sess-x": second.aliases[holder]}, "only the session that has a record is re-pointed"
    assert second.placements["sess-x"] in later
    index = worker_of(second, "s-a2")
    assert {3: later[0], 4: later[1], 5: later[2]}[index] == second.placements["sess-x"]
    assert second.records[index][0]["owner"] == holder, "an owned record keeps its owner; the alias routes it"

    without = place_records([committed], {3: later[0], 4: later[1], 5: later[2]})
    assert without.placements == {}, "without placed_sessions nothing is re-pointed"


def test_the_same_input_gives_the_same_placement_whatever_the_order_of_workers_and_records() -> None:
    records = [
        *(session(f"a{i}-a1", owner=OLD_A) for i in range(2)),
        *(session(f"b{i}-a1", owner=OLD_B) for i in range(2)),
        *(session(f"x{i}-a1", session_id=f"x{i}") for i in range(3)),
    ]
    workers = {3: NEW_3, 1: NEW_1, 2: NEW_2}
    reference = place_records(records, workers, session_owners=[OLD_A, OLD_B, OLD_C])
    rng = random.Random(11)
    for _ in range(20):
        shuffled_records = rng.sample(records, len(records))
        shuffled_workers = dict(rng.sample(list(workers.items()), len(workers)))
        owners = rng.sample([OLD_A, OLD_B, OLD_C], 3)
        again = place_records(shuffled_records, shuffled_workers, session_owners=owners)
        assert list(again.records) == [1, 2, 3]
        assert {i: sorted(keys) for i, keys in keys_on(again).items()} == {
            i: sorted(keys) for i, keys in keys_on(reference).items()
        }
        assert dict(again.aliases) == dict(reference.aliases)
        assert dict(again.placements) == dict(reference.placements)
    assert place_records(records, dict(reversed(workers.items())), session_owners=[OLD_A, OLD_B, OLD_C]) == reference


groups_strategy = st.lists(
    st.tuples(st.booleans(), st.integers(min_value=0, max_value=6)), min_size=0, max_size=12
)  # (owned?, record count)


@settings(max_examples=200, deadline=None)
@given(
    groups=groups_strategy,
    worker_indexes=st.sets(st.integers(min_value=0, max_value=50), min_size=1, max_size=6),
)
def test_every_record_lands_once_owners_map_to_one_live_worker_and_the_load_is_even(
    groups: list[tuple[bool, int]], worker_indexes: set[int]
) -> None:
    records: list[dict[str, Any]] = []
    owners: list[str] = []
    sizes: list[int] = []
    for number, (owned, count) in enumerate(groups):
        if owned:
            owner = rid(0x1000 + number)
            owners.append(owner)
            records.extend(session(f"g{number}r{i}-a1", owner=owner) for i in range(count))
            sizes.append(count)
        else:  # owner-less sessions: one group each
            records.extend(session(f"g{number}r{i}-a1", session_id=f"g{number}r{i}") for i in range(count))
            sizes.extend([1] * count)
    workers = {index: rid(0x9000 + index) for index in worker_indexes}
    placement = place_records(records, workers, session_owners=owners)

    placed = [record["episode_id"] for held in placement.records.values() for record in held]
    assert sorted(placed) == sorted(record["episode_id"] for record in records)
    assert set(placement.records) == worker_indexes
    assert set(placement.aliases) == set(owners)
    assert set(placement.aliases.values()) <= set(workers.values())
    for index, held in placement.records.items():
        for record in held:
            owner = record["owner"]
            assert placement.aliases.get(owner, owner) == workers[index]
    loads = [len(held) for held in placement.records.values()]
    assert max(loads) - min(loads) <= max(sizes, default=0)
