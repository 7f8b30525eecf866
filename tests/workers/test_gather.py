"""Commit across workers (gymckpt.workers.gather): one records list, one copy per session and episode."""

from __future__ import annotations

import logging

import pytest

from gymckpt.store.encoded import EncodedRecord, check_encoded, encoded
from gymckpt.workers.gather import ExportedRecord, WorkerExport, gather_exports

OWNER_1, OWNER_2 = "1" * 32, "2" * 32


def line(episode_id: str, **fields: object) -> EncodedRecord:
    return encoded({"episode_id": episode_id, **fields})


def exported(episode_id: str, session_id: str | None = None, owner: str | None = None) -> ExportedRecord:
    return ExportedRecord(line(episode_id, session_id=session_id, owner=owner), session_id=session_id, owner=owner)


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and r.name == "gymckpt.workers.gather"]


def test_every_workers_lines_go_into_one_list_as_the_same_bytes() -> None:
    # lines no gymckpt encoder writes (odd spacing, NaN): any re-encoding would change them
    odd = EncodedRecord("w1-a0", b'{"episode_id":"w1-a0",  "x": NaN ,"y":[1,2]}\n')
    w1 = [ExportedRecord(odd), exported("w1b-a0", "s1b", OWNER_1)]
    w2 = [exported("w2-a0", "s2", OWNER_2)]
    held = line("h-a1", kind="run")
    gathered = gather_exports({2: WorkerExport(w2), 1: WorkerExport(w1)}, held=[held])

    expected = [w1[0].record, w1[1].record, w2[0].record, held]
    assert [record.episode_id for record in gathered.records] == ["w1-a0", "w1b-a0", "w2-a0", "h-a1"]
    for got, sent in zip(gathered.records, expected, strict=True):
        assert got is sent
        assert got.line is sent.line
    assert gathered.records[0].line == b'{"episode_id":"w1-a0",  "x": NaN ,"y":[1,2]}\n'
    assert all(check_encoded(record) for record in gathered.records)
    assert gathered.delete_unclaimed == ()


def test_a_session_on_two_workers_keeps_the_live_copy_and_deletes_the_stale_one() -> None:
    stale = exported("s-a1", "sess", OWNER_1)
    live = exported("s-a1", "sess", OWNER_2)
    gathered = gather_exports(
        {
            1: WorkerExport([stale, exported("k-a1", "keep", OWNER_1)], unclaimed={"sess", "keep"}),
            2: WorkerExport([live]),
        }
    )

    assert [record.episode_id for record in gathered.records] == ["k-a1", "s-a1"]
    assert gathered.records[1] is live.record
    assert gathered.delete_unclaimed == ((1, "sess"),)


def test_copies_of_a_session_are_merged_even_under_other_episode_ids() -> None:
    stale = exported("s-a1", "sess")
    live = exported("s-a2", "sess")
    gathered = gather_exports({1: WorkerExport([stale], unclaimed={"sess"}), 2: WorkerExport([live])})

    assert gathered.records == (live.record,)
    assert gathered.delete_unclaimed == ((1, "sess"),)


def test_a_session_unclaimed_everywhere_keeps_the_first_copy() -> None:
    first, second = exported("s-a1", "sess"), exported("s-a1", "sess")
    gathered = gather_exports(
        {1: WorkerExport([first], unclaimed=["sess"]), 2: WorkerExport([second], unclaimed=("sess",))}
    )

    assert gathered.records == (first.record,)
    assert gathered.delete_unclaimed == ((2, "sess"),)


def test_two_live_copies_keep_one_and_log_an_error(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    first, second = exported("s-a1", "sess", OWNER_1), exported("s-a1", "sess", OWNER_2)
    gathered = gather_exports({1: WorkerExport([first]), 2: WorkerExport([second])})

    assert gathered.records == (first.record,)
    assert gathered.delete_unclaimed == ()
    (message,) = errors(caplog)
    assert "'sess'" in message and "workers 1 and 2" in message


def test_records_without_a_session_are_never_merged_by_session() -> None:
    gathered = gather_exports({1: WorkerExport([exported("a-a0")]), 2: WorkerExport([exported("b-a0")])})

    assert [record.episode_id for record in gathered.records] == ["a-a0", "b-a0"]


def test_one_episode_id_on_two_workers_is_stored_once_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    first, second = exported("e-a0"), exported("e-a0")
    gathered = gather_exports({1: WorkerExport([first]), 2: WorkerExport([second])})

    assert gathered.records == (first.record,)
    (message,) = errors(caplog)
    assert "'e-a0'" in message


def test_one_episode_id_under_two_sessions_keeps_the_live_one() -> None:
    stale, live = exported("e-a1", "old"), exported("e-a1", "new")
    gathered = gather_exports({1: WorkerExport([stale], unclaimed={"old"}), 2: WorkerExport([live])})

    assert gathered.records == (live.record,)
    assert gathered.delete_unclaimed == ((1, "old"),)


@pytest.mark.parametrize(
    ("scope", "appended"),
    [(None, ["h0-a1", "h1-a1"]), (["h1-a1", "w-a0"], ["h1-a1"]), ([], []), (["h0-a2"], [])],
)
def test_held_whole_episode_records_are_appended_only_in_scope(scope: list[str] | None, appended: list[str]) -> None:
    held = [line("h0-a1", kind="run"), line("h1-a1", kind="run")]
    gathered = gather_exports({1: WorkerExport([exported("w-a0")])}, held=held, scope=scope)

    assert [record.episode_id for record in gathered.records] == ["w-a0", *appended]


def test_a_worker_copy_wins_over_a_held_copy_of_the_same_episode(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    worker_copy = exported("h-a1")
    gathered = gather_exports({1: WorkerExport([worker_copy])}, held=[line("h-a1", kind="run")])

    assert gathered.records == (worker_copy.record,)
    assert gathered.delete_unclaimed == ()
    (message,) = errors(caplog)
    assert "'h-a1'" in message and "coordinator" in message


def test_session_owners_are_only_those_of_the_stored_records() -> None:
    third = "3" * 32
    gathered = gather_exports(
        {
            1: WorkerExport([exported("s-a1", "sess", OWNER_1), exported("n-a1", "none")], unclaimed={"sess"}),
            2: WorkerExport([exported("s-a1", "sess", OWNER_2), exported("t-a1", "t", third)]),
        },
        placements={"gone": OWNER_1},
    )

    assert gathered.session_owners == (OWNER_2, third) == tuple(sorted((OWNER_2, third)))
    assert OWNER_1 not in gathered.session_owners, "the dropped stale copy's owner is not carried on"


def test_placed_sessions_are_the_placement_tables_keys_sorted() -> None:
    placements = {"zeta": OWNER_1, "alpha": OWNER_2, "mid": OWNER_1}
    gathered = gather_exports({1: WorkerExport([exported("z-a0", "zeta", OWNER_1)])}, placements=placements)

    assert gathered.placed_sessions == ("alpha", "mid", "zeta")
    assert gathered.manifest_extra() == {"session_owners": [OWNER_1], "placed_sessions": ["alpha", "mid", "zeta"]}
    assert gather_exports({}).manifest_extra() == {"session_owners": [], "placed_sessions": []}


def test_a_hundred_thousand_records_across_four_workers() -> None:
    per_worker = 25_000
    exports = {}
    for worker in range(4):
        records = [
            ExportedRecord(EncodedRecord(f"w{worker}r{i}-a0", b""), session_id=f"w{worker}s{i}", owner=f"{worker:032x}")
            for i in range(per_worker)
        ]
        # the first 1,000 sessions of worker 0 are also exported, unused, by worker 3
        if worker == 3:
            records += [ExportedRecord(EncodedRecord(f"w0r{i}-a0", b""), session_id=f"w0s{i}") for i in range(1000)]
        exports[worker] = WorkerExport(records, unclaimed={f"w0s{i}" for i in range(1000)} if worker == 3 else set())
    held = [EncodedRecord(f"h{i}-a1", b"") for i in range(10)]
    gathered = gather_exports(exports, held=held, scope=None)

    assert len(gathered.records) == 4 * per_worker + 10
    assert len({record.episode_id for record in gathered.records}) == len(gathered.records)
    assert gathered.delete_unclaimed == tuple((3, f"w0s{i}") for i in range(1000))
    assert gathered.session_owners == tuple(f"{worker:032x}" for worker in range(4))
    assert gathered.records[:per_worker] == tuple(record.record for record in exports[0].records)
