"""Pre-encoded record lines (a worker's): written as they are, after a cheap look; refused when malformed."""

from __future__ import annotations

import pytest

from gymckpt import errors
from gymckpt.store import EncodedRecord, encoded, open_store
from gymckpt.store import records as records_module
from gymckpt.testing.values import assert_identical, sample_records


def test_encoded_records_give_the_same_file_and_are_not_encoded_again(tmp_path, monkeypatch) -> None:
    store = open_store(str(tmp_path))
    records = sample_records(30)
    plain = store.write_participant("a", kind="k", instance="i", checkpoint_id="c", records=records)
    lines = [encoded(record) for record in records]

    def never(record):  # the store must not encode what arrives encoded
        raise AssertionError("an encoded record was encoded again")

    monkeypatch.setattr(records_module, "encode_record", never)
    again = store.write_participant("b", kind="k", instance="i", checkpoint_id="c", records=lines)
    assert again.records_sha256 == plain.records_sha256
    assert again.episode_ids == plain.episode_ids
    assert_identical(records, list(store.read_participant("b", kind="k", instance="i")))


@pytest.mark.parametrize(
    ("record", "says"),
    [
        (EncodedRecord("x", b'{"episode_id":"y"}\n'), "starts with episode_id 'y'"),
        (EncodedRecord("x", b'{"episode_id":"x"}'), "one line ending with a newline"),
        (EncodedRecord("x", b'{"episode_id":"x"}\n{"episode_id":"z"}\n'), "one line ending with a newline"),
        (EncodedRecord("x", b'["x"]\n'), "does not start with its episode_id"),
        (EncodedRecord("x", '{"episode_id":"x"}\n'), "one line ending with a newline"),  # type: ignore[arg-type]
    ],
)
def test_a_malformed_encoded_record_is_refused_and_nothing_is_published(tmp_path, record, says) -> None:
    store = open_store(str(tmp_path))
    with pytest.raises(errors.InvalidRecord, match=says):
        store.write_participant(
            "c", kind="k", instance="i", checkpoint_id="c", records=[encoded({"episode_id": "w"}), record]
        )
    assert [path for path in tmp_path.rglob("*") if path.is_file()] == []


def test_a_duplicate_among_encoded_records_is_refused(tmp_path) -> None:
    store = open_store(str(tmp_path))
    line = encoded({"episode_id": "same", "v": 1})
    with pytest.raises(errors.InvalidRecord, match="appears twice"):
        store.write_participant("c", kind="k", instance="i", checkpoint_id="c", records=[line, line])
