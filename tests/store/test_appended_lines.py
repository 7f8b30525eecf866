"""Lines another process appends to a local records file itself: read back, checked and hashed in order.

The producer here is this process opening the sink's ``/proc`` entry, as a server's worker does;
the file must be the one written from the same records handed over, byte for byte.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gymckpt import errors
from gymckpt.store import _local as local_module
from gymckpt.store import appended as appended_module
from gymckpt.store import open_store
from gymckpt.store.capabilities import APPENDING_FILESYSTEMS, filesystem_type
from gymckpt.store.encoded import AppendedLines, AppendedPiece, AppendedRegion, EncodedRun, encoded
from gymckpt.testing.values import assert_identical, sample_records


class FileAppender(AppendedLines):
    """Appends the lines of ``records`` (bytes ``tail`` after them) to the target, or refuses to (``opens``)."""

    def __init__(self, records: list[dict[str, Any]], *, opens: bool = True, tail: bytes = b"") -> None:
        self.lines = [encoded(record) for record in records]
        super().__init__([line.episode_id for line in self.lines], "the test's appender")
        self.opens, self.tail = opens, tail
        self.targets: list[str] = []
        self.runs_taken = 0

    def append_to(self, target: str) -> int | None:
        self.targets.append(target)
        if not self.opens:
            return None
        data = b"".join(line.line for line in self.lines)
        with open(target, "ab") as file:
            file.write(data + self.tail)
        return len(data)

    def runs(self) -> Iterator[EncodedRun]:
        self.runs_taken += 1
        yield EncodedRun(self.episode_ids[:2], b"".join(line.line for line in self.lines[:2]))
        yield EncodedRun(self.episode_ids[2:], b"".join(line.line for line in self.lines[2:]))


def _write(store: Any, name: str, records: list[Any]) -> Any:
    return store.write_participant(name, kind="k", instance="i", checkpoint_id="c", records=records)


@pytest.mark.parametrize("read_back", [64, 4 << 20])
def test_appended_lines_make_the_same_file_as_the_records_handed_over(
    tmp_path, monkeypatch: pytest.MonkeyPatch, read_back: int
) -> None:
    monkeypatch.setattr(appended_module, "READ_BACK", read_back)  # 64: pieces grow past lines longer than that
    store = open_store(str(tmp_path))
    records = sample_records(40, payload=300)
    before, middle, after = records[:5], records[5:35], records[35:]
    plain = _write(store, "plain", records)
    appender = FileAppender(middle)
    mixed = _write(store, "mixed", [*before, appender, *(encoded(record) for record in after)])
    assert len(appender.targets) == 1 and appender.targets[0].startswith("/proc/") and appender.runs_taken == 0
    assert mixed.records_sha256 == plain.records_sha256 and mixed.records_bytes == plain.records_bytes
    assert mixed.episode_ids == plain.episode_ids and mixed.max_record_bytes == plain.max_record_bytes
    assert_identical(records, list(store.read_participant("mixed", kind="k", instance="i")))


def test_a_producer_that_cannot_open_the_file_hands_its_lines_over_as_runs(tmp_path) -> None:
    store = open_store(str(tmp_path))
    records = sample_records(12)
    appender = FileAppender(records[2:], opens=False)
    manifest = _write(store, "runs", [*records[:2], appender])
    assert len(appender.targets) == 1 and appender.runs_taken == 1
    assert manifest.records_sha256 == _write(store, "plain", records).records_sha256


def test_a_sink_without_appends_takes_the_lines_as_runs(tmp_path) -> None:
    store = open_store(f"memory://{tmp_path.name}")
    records = sample_records(12)
    appender = FileAppender(records)
    manifest = _write(store, "runs", [appender])
    assert appender.targets == [] and appender.runs_taken == 1
    assert manifest.records_sha256 == _write(store, "plain", records).records_sha256


def test_more_bytes_appended_than_named_are_refused_and_nothing_is_published(tmp_path) -> None:
    store = open_store(str(tmp_path))
    appender = FileAppender(sample_records(12), tail=b'{"episode_id":"extra"}\n')
    with pytest.raises(errors.StorageError, match=r"the test's appender appended \d+ bytes, not the \d+ named"):
        _write(store, "bad", [appender])
    assert [path for path in tmp_path.rglob("*") if path.is_file()] == []


def test_fewer_lines_appended_than_named_are_refused_and_nothing_is_published(tmp_path) -> None:
    store = open_store(str(tmp_path))
    appender = FileAppender(sample_records(12))
    appender.episode_ids = [*appender.episode_ids, "never-appended"]
    with pytest.raises(errors.InvalidRecord, match="appended 12 lines for the 13 records named"):
        _write(store, "bad", [appender])
    assert [path for path in tmp_path.rglob("*") if path.is_file()] == []


def test_an_appended_line_led_by_another_id_is_refused(tmp_path) -> None:
    store = open_store(str(tmp_path))
    records = sample_records(6)
    appender = FileAppender(records)
    appender.episode_ids = [*appender.episode_ids[:3], "other", *appender.episode_ids[4:]]
    with pytest.raises(errors.InvalidRecord, match="in the lines the test's appender appended"):
        _write(store, "bad", [appender])
    assert [path for path in tmp_path.rglob("*") if path.is_file()] == []


def test_a_filesystem_that_may_cache_sizes_per_descriptor_takes_the_lines_as_runs(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_module, "takes_appends", lambda path: False)  # as on a FUSE or NFS mount
    store = open_store(str(tmp_path))
    records = sample_records(12)
    appender = FileAppender(records)
    manifest = _write(store, "runs", [appender])
    assert appender.targets == [] and appender.runs_taken == 1
    assert manifest.records_sha256 == _write(store, "plain", records).records_sha256


class PiecesAppender(AppendedLines):
    """Producers ``A`` and ``B`` appending at once: their pieces land in ``interleaving`` (a producer
    name per piece, each producer's pieces in its own order); ``closed`` producers cannot open the
    file and hand their lines over as runs. ``misplace`` shifts the first piece's named offset."""

    def __init__(
        self,
        shares: dict[str, list[list[dict[str, Any]]]],
        interleaving: list[str],
        *,
        closed: frozenset[str] = frozenset(),
        misplace: int = 0,
    ) -> None:
        self.shares = {
            name: [[encoded(record) for record in piece] for piece in pieces] for name, pieces in shares.items()
        }
        names = [line.episode_id for pieces in self.shares.values() for piece in pieces for line in piece]
        super().__init__(names, "producers A and B")
        self.interleaving, self.closed, self.misplace = interleaving, closed, misplace
        self.order: list[str] = []  # the ids in file order, as appended

    def append_to(self, target: str) -> AppendedRegion | None:
        next_piece = {name: iter(pieces) for name, pieces in self.shares.items()}
        pieces = []
        with open(target, "ab") as file:
            for name in self.interleaving:
                if name in self.closed:
                    continue
                lines = next(next_piece[name])
                data = b"".join(line.line for line in lines)
                offset = file.seek(0, 2)
                file.write(data)
                file.flush()
                ids = [line.episode_id for line in lines]
                pieces.append(AppendedPiece(offset + self.misplace, len(data), ids, f"producer {name}"))
                self.order += ids
                self.misplace = 0
        if not pieces:
            return None
        rest = [
            EncodedRun([line.episode_id for line in piece], b"".join(line.line for line in piece))
            for name in sorted(self.closed)
            for piece in self.shares[name]
        ]
        self.order += [episode_id for run in rest for episode_id in run.episode_ids]
        return AppendedRegion(pieces, rest)

    def runs(self) -> Iterator[EncodedRun]:
        for pieces in self.shares.values():
            for piece in pieces:
                yield EncodedRun([line.episode_id for line in piece], b"".join(line.line for line in piece))


def _shares(records: list[dict[str, Any]]) -> dict[str, list[list[dict[str, Any]]]]:
    """Producer A: three pieces of the first 18 records; producer B: two of the rest."""
    return {"A": [records[:4], records[4:5], records[5:18]], "B": [records[18:25], records[25:]]}


@pytest.mark.parametrize("closed", [frozenset(), frozenset({"B"})])
def test_pieces_appended_at_once_are_taken_in_file_order(tmp_path, closed: frozenset[str]) -> None:
    """Pieces of two producers, interleaved as they landed, make the file of the same records written
    in that order; a producer that cannot open the file hands its lines over as runs, written after."""
    store = open_store(str(tmp_path))
    records = sample_records(30, payload=200)
    appender = PiecesAppender(_shares(records), ["A", "B", "A", "B", "A"], closed=closed)
    manifest = _write(store, "pieces", [appender])
    by_id = {record["episode_id"]: record for record in records}
    in_order = [by_id[episode_id] for episode_id in appender.order]
    interleaved = [f"r{number}" for number in [*range(4), *range(18, 25), 4, *range(25, 30), *range(5, 18)]]
    assert appender.order == (interleaved if not closed else [record["episode_id"] for record in records])
    plain = _write(store, "plain", in_order)
    assert manifest.episode_ids == plain.episode_ids and set(manifest.episode_ids) == set(appender.order)
    assert manifest.records_sha256 == plain.records_sha256 and manifest.max_record_bytes == plain.max_record_bytes
    assert_identical(in_order, list(store.read_participant("pieces", kind="k", instance="i")))


@pytest.mark.parametrize(
    ("how", "error"),
    [
        ("misplaced", r"producer A named \d+ bytes at byte \d+ of the records file, where the appended lines go on"),
        ("another_id", r"in the lines producer B appended: .*'intruder'"),
        ("extra_ids", r"producer A appended a line of 'one-more', which is none of the records named"),
        ("short", r"producers A and B appended or handed over 29 lines for the 30 records named"),
    ],
)
def test_pieces_that_are_not_where_or_what_they_say_are_refused_and_nothing_is_published(
    tmp_path, how: str, error: str
) -> None:
    store = open_store(str(tmp_path))
    records = sample_records(30)
    shares = _shares(records)
    if how == "another_id":
        shares["B"][1] = [{**shares["B"][1][0], "episode_id": "intruder"}, *shares["B"][1][1:]]
    appender = PiecesAppender(shares, ["A", "B", "A", "B", "A"], misplace=7 if how == "misplaced" else 0)
    if how == "another_id":  # B names the record's own id, but its line is led by another
        appender.shares["B"][1][0] = appender.shares["B"][1][0]._replace(episode_id=records[25]["episode_id"])
        appender.episode_ids = [record["episode_id"] for record in records]
    if how == "extra_ids":
        appender.shares["A"][0].append(encoded(records[0] | {"episode_id": "one-more"}))
    if how == "short":  # B, which cannot open the file, hands over one line fewer than it has
        appender.closed = frozenset({"B"})
        appender.shares["B"][1].pop()
        appender.episode_ids = [*appender.episode_ids, records[-1]["episode_id"]]
    with pytest.raises(errors.InvalidRecord, match=error):
        _write(store, "bad", [appender])
    assert [path for path in tmp_path.rglob("*") if path.is_file()] == []


MOUNTINFO = "\n".join(
    [
        r"36 35 98:0 /mnt1 /mnt/my\040dir rw,noatime master:1 - ext4 /dev/root rw,errors=continue",
        r"37 36 0:5 / /mnt/my\040dir/moose rw shared:2 - fuse.mfs mfsmaster:9421 rw",
        "38 1 0:6 / / rw - overlay overlay rw",
        "39 38 0:7 / /srv/nfs rw - nfs4 server:/export rw",
    ]
)


@pytest.mark.parametrize(
    ("path", "kind", "appends"),
    [
        ("/mnt/my dir/ckpt", "ext4", True),
        ("/mnt/my dir", "ext4", True),
        ("/mnt/my dir/moose/ckpt", "fuse.mfs", False),
        ("/mnt/my dir/mooseX", "ext4", True),
        ("/srv/nfs/a/b", "nfs4", False),
        ("/etc", "overlay", True),
    ],
)
def test_the_filesystem_of_a_path_is_its_deepest_mount_s(path: str, kind: str, appends: bool) -> None:
    assert filesystem_type(path, MOUNTINFO) == kind
    assert (kind in APPENDING_FILESYSTEMS) is appends
