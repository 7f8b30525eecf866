"""Rules of the store beyond the attack table: names, integers of any size, cycles, one view of a root."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from typing import Any

import pytest

from gymckpt import errors
from gymckpt.store import CheckpointStore, open_store, verify
from gymckpt.store._local import LocalBackend
from gymckpt.store._memory import MemoryBackend, clear_memory_stores
from gymckpt.store.codec import encode_record
from gymckpt.store.layout import check_name, is_readable_name, is_valid_name, scan_checkpoints
from gymckpt.testing.values import assert_identical, sample_records

BAD_NAMES = ["env-0\n", "\nenv-0", "env 0", "", "-env", ".env", "a/b", "a\\b", "é", "x" * 129, "env\x00", "env\r"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_one_name_rule_at_every_store_entry_point(tmp_path, name: str) -> None:
    store = CheckpointStore(LocalBackend(str(tmp_path)))
    for what in ("kind", "instance", "checkpoint_id"):
        arguments: dict[str, Any] = {"kind": "environment", "instance": "e0", "checkpoint_id": "c"}
        arguments[what] = name
        with pytest.raises(ValueError, match=what):
            store.write_participant("ck", records=sample_records(1), **arguments)
    # reading takes names up to 255 characters (the reference's checkpoints set no limit): a longer
    # valid name is looked up, and simply not found; every other bad name is refused as a name
    with pytest.raises(ValueError) as reading:
        list(store.read_participant("ck", kind=name, instance="e0"))
    with pytest.raises(ValueError) as manifest:
        store.read_manifest("ck", kind="environment", instance=name)
    for raised in (reading, manifest):
        assert isinstance(raised.value, errors.ParticipantNotFound) is is_readable_name(name)
    assert not is_valid_name(name)
    assert is_readable_name(name) is (name == "x" * 129)
    assert list(tmp_path.rglob("*")) == []  # nothing was created under a bad name


@pytest.mark.parametrize(
    "name", ["gym", "manifest.json", "checkpoint.json", "records-1.jsonl", "A", "x" * 128, "a.b_c-d"]
)
def test_layout_words_and_odd_valid_names_are_names(name: str) -> None:
    assert check_name("instance", name) == name


def test_a_checkpoint_directory_named_gym_is_found_beside_others(tmp_path) -> None:
    store = CheckpointStore(LocalBackend(str(tmp_path)))
    for checkpoint in ("runs/gym", "runs/ckpt-2", "gym"):
        manifest = store.write_participant(
            checkpoint, kind="gym", instance="gym", checkpoint_id="c", records=sample_records(3)
        )
        store.publish(checkpoint, [manifest])
    found = scan_checkpoints(LocalBackend(str(tmp_path)).walk_entries(""))
    assert sorted(found) == ["gym", "runs/ckpt-2", "runs/gym"]
    assert all(list(layout.participants) == [("gym", "gym")] for layout in found.values())
    report = verify(str(tmp_path))
    assert report.ok and report.findings == [], report.findings
    assert len(report.participants) == 3


def test_integers_of_any_size_round_trip_through_a_fresh_default_process(tmp_path) -> None:
    records = [{"episode_id": "big", "n": 10**5000 + 1, "neg": -(7**9000), "list": [2**70, -(2**64)]}]
    store = CheckpointStore(LocalBackend(str(tmp_path)))
    store.write_participant("ck", kind="model", instance="m", checkpoint_id="c", records=records)
    assert sys.get_int_max_str_digits() > 0  # the writer did not leave the limit lifted
    program = (
        "import json, sys\n"
        "from gymckpt.store import open_store\n"
        "assert sys.get_int_max_str_digits() == 4300\n"
        "[record] = open_store(sys.argv[1]).read_participant('ck', kind='model', instance='m')\n"
        "print(json.dumps({'bits': record['n'].bit_length(), 'n_mod': record['n'] % 1000003,"
        " 'neg_mod': record['neg'] % 1000003, 'list': [str(v) for v in record['list']]}))\n"
    )
    output = subprocess.run(
        [sys.executable, "-I", "-c", program, str(tmp_path)], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    seen = json.loads(output)
    assert seen == {
        "bits": (10**5000 + 1).bit_length(),
        "n_mod": (10**5000 + 1) % 1000003,
        "neg_mod": (-(7**9000)) % 1000003,
        "list": [str(2**70), str(-(2**64))],
    }


def test_a_value_that_contains_itself_is_refused_by_name() -> None:
    loop: list[Any] = []
    loop.append(loop)
    cyclic: dict[str, Any] = {"a": 1}
    cyclic["self"] = {"again": cyclic}
    for record, path in (
        ({"episode_id": "e", "x": loop}, "$.x[0]"),
        ({"episode_id": "e", "y": [1, {"z": cyclic}]}, "$.y[1].z.self.again"),
    ):
        with pytest.raises(errors.NotJSONError) as raised:
            encode_record(record)
        assert raised.value.episode_id == "e"
        assert raised.value.path == path
        assert "contains itself" in str(raised.value)


def test_two_memory_backends_on_one_name_have_one_create_winner() -> None:
    clear_memory_stores()
    backends = [MemoryBackend("memory://shared") for _ in range(4)]
    barrier = threading.Barrier(4)
    outcomes: list[object] = []

    def create(backend: MemoryBackend, data: bytes) -> None:
        barrier.wait(timeout=30)
        try:
            outcomes.append(backend.create_if_absent("m.json", data))
        except errors.ManifestConflict as exc:
            outcomes.append(exc)

    for _ in range(50):  # bounded repetitions of the race
        outcomes.clear()
        for backend in backends:
            backend.delete("m.json")
        threads = [
            threading.Thread(target=create, args=(backend, f"w{i}".encode())) for i, backend in enumerate(backends)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert outcomes.count(True) == 1, outcomes
        assert sum(isinstance(outcome, errors.ManifestConflict) for outcome in outcomes) == 3


def test_a_records_line_naming_another_episode_never_returns_that_episode(tmp_path) -> None:
    """The case seen: scope {"a"} returned the record of "victim"; now the read fails, typed."""
    store = open_store(str(tmp_path))
    forged = [{"episode_id": "a", "x": 1}, {"episode_id": "victim", "secret": 2}]
    manifest = store.write_participant("ck", kind="agent", instance="a0", checkpoint_id="c", records=forged)
    path = tmp_path / manifest.records_path
    lines = path.read_bytes().split(b"\n")
    lines[0] = lines[0][:-1] + b',"episode_id":"victim"}'
    data = b"\n".join(lines)
    digest = hashlib.sha256(data).hexdigest()
    path.unlink()
    (path.parent / f"records-{digest}.jsonl").write_bytes(data)
    document = json.loads((tmp_path / manifest.path).read_bytes())
    longest = max(len(line) + 1 for line in data.split(b"\n")[:-1])  # a consistent writer: its longest line too
    document.update(
        records_file=f"records-{digest}.jsonl", records_sha256=digest, records_bytes=len(data), max_record_bytes=longest
    )
    (tmp_path / manifest.path).write_text(json.dumps(document))
    returned: list[dict[str, Any]] = []
    with pytest.raises(errors.RecordUndecodable, match="twice"):
        returned.extend(store.read_participant("ck", kind="agent", instance="a0", scope={"a"}))
    assert all(record.get("secret") is None for record in returned)


def test_a_nested_episode_id_key_is_not_damage(tmp_path) -> None:
    store = open_store(str(tmp_path))
    records = [{"episode_id": "r", "calls": [{"episode_id": "other", "text": '"episode_id": "x"'}]}]
    store.write_participant("ck", kind="agent", instance="a0", checkpoint_id="c", records=records)
    assert_identical(records, list(store.read_participant("ck", kind="agent", instance="a0")))
