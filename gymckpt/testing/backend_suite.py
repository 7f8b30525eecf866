"""The backend test suite every storage backend runs (needs pytest).

Subclass :class:`BackendTests` in a backend's test file, provide the ``backend``
fixture and the raw hooks, which touch the storage directly so the backend is never
tested against itself::

    class TestLocalBackend(BackendTests):
        @pytest.fixture
        def backend(self, tmp_path):
            return LocalBackend(str(tmp_path))

        def raw_read(self, backend, path): ...
"""

from __future__ import annotations

import hashlib
import json
import threading
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt import errors
from gymckpt.store import bounds as bounds_module
from gymckpt.store import participant as participant_module
from gymckpt.store import publication as publication_module
from gymckpt.store.checkpoint_store import CheckpointStore
from gymckpt.store.layout import MANIFEST_NAME
from gymckpt.store.records import WriteStop
from gymckpt.store.verify import Severity, verify_backend
from gymckpt.testing.attacks import ATTACKS, INDEX_LIMIT, MANIFEST_LIMIT, AttackContext
from gymckpt.testing.corruptions import CORRUPTIONS
from gymckpt.testing.recording import OutsideWatch, RecordingBackend
from gymckpt.testing.values import assert_identical, same_records, sample_records

if TYPE_CHECKING:
    from gymckpt.store.backend import StorageBackend

__all__ = ["BackendTests"]


class BackendTests:
    """Tests every :class:`StorageBackend` must pass; subclass and fill in the hooks."""

    #: set False for backends whose sync_directories is a no-op by nature
    expects_directory_fsync: bool = True
    #: True for POSIX filesystems, where symlinks, FIFOs and devices exist: the attack rows for them run
    supports_special_files: bool = False

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Only the attack rows that apply to this backend (symlinks and FIFOs need a POSIX filesystem)."""
        if "attack" in metafunc.fixturenames:
            names = sorted(name for name, row in ATTACKS.items() if self.supports_special_files or not row.special)
            metafunc.parametrize("attack", names)

    def outside_directory(self, backend: Any) -> str | None:
        """An empty directory outside the store's root (POSIX filesystems only), for symlink targets."""
        return None

    @pytest.fixture
    def backend(self) -> StorageBackend:  # pragma: no cover - provided by subclasses
        raise NotImplementedError

    # raw hooks: touch the storage directly, bypassing the backend under test
    def raw_read(self, backend: Any, path: str) -> bytes:
        raise NotImplementedError

    def raw_write(self, backend: Any, path: str, data: bytes) -> None:
        raise NotImplementedError

    def raw_delete(self, backend: Any, path: str) -> None:
        raise NotImplementedError

    def raw_files(self, backend: Any, prefix: str = "") -> list[str]:
        """Every file under ``prefix`` (store-relative paths), sorted."""
        raise NotImplementedError

    # --- the backend interface

    def test_capabilities_are_stated(self, backend: StorageBackend) -> None:
        assert isinstance(backend.supports_directory_fsync, bool)
        assert isinstance(backend.supports_conditional_create, bool)
        assert backend.supports_directory_fsync is self.expects_directory_fsync

    def test_sink_content_is_invisible_until_published(self, backend: StorageBackend) -> None:
        sink = backend.open_sink("d/e")
        sink.write(b"hello ")
        sink.write(memoryview(b"world"))
        sink.finish()
        assert not backend.exists("d/e/final.bin")
        assert "d/e/final.bin" not in self.raw_files(backend)
        sink.publish("final.bin")
        assert self.raw_read(backend, "d/e/final.bin") == b"hello world"
        assert self.raw_files(backend) == ["d/e/final.bin"]

    def test_aborted_sink_leaves_nothing(self, backend: StorageBackend) -> None:
        sink = backend.open_sink("d")
        sink.write(b"x" * 1000)
        sink.abort()
        sink.abort()
        assert self.raw_files(backend) == []

    def test_create_if_absent_creates_once(self, backend: StorageBackend) -> None:
        assert backend.create_if_absent("a/b/m.json", b"one") is True
        assert backend.create_if_absent("a/b/m.json", b"one") is False
        with pytest.raises(errors.ManifestConflict) as raised:
            backend.create_if_absent("a/b/m.json", b"two")
        assert isinstance(raised.value, FileExistsError)
        assert self.raw_read(backend, "a/b/m.json") == b"one"
        assert self.raw_files(backend) == ["a/b/m.json"]

    def test_create_if_absent_races_have_one_winner(self, backend: StorageBackend) -> None:
        outcomes: list[object] = []
        barrier = threading.Barrier(4)

        def create(data: bytes) -> None:
            barrier.wait(timeout=30)
            try:
                outcomes.append(backend.create_if_absent("race/m.json", data))
            except errors.ManifestConflict as exc:
                outcomes.append(exc)

        threads = [threading.Thread(target=create, args=(f"writer-{i}".encode(),)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert outcomes.count(True) == 1
        assert sum(isinstance(outcome, errors.ManifestConflict) for outcome in outcomes) == 3
        assert self.raw_read(backend, "race/m.json").startswith(b"writer-")

    def test_read_bytes_and_size(self, backend: StorageBackend) -> None:
        self.raw_write(backend, "x/y.bin", b"abc" * 10)
        assert backend.read_bytes("x/y.bin") == b"abc" * 10
        assert backend.size("x/y.bin") == 30
        with backend.open_read("x/y.bin") as stream:
            assert stream.read(4) == b"abca"
        with pytest.raises(FileNotFoundError):
            backend.read_bytes("x/missing.bin")
        with pytest.raises(FileNotFoundError):
            backend.open_read("x/missing.bin")
        with pytest.raises(FileNotFoundError):
            backend.size("x/missing.bin")

    def test_listing_and_delete(self, backend: StorageBackend) -> None:
        for path in ("c/gym/k/i/a.txt", "c/gym/k/i/b.txt", "c/gym/checkpoint.json", "c/other.txt"):
            self.raw_write(backend, path, b"1")
        assert backend.list_dir("c") == ["gym/", "other.txt"]
        assert backend.list_dir("c/gym") == ["checkpoint.json", "k/"]
        assert backend.list_dir("nothing-here") == []
        assert sorted(backend.walk_files("c")) == [
            "c/gym/checkpoint.json",
            "c/gym/k/i/a.txt",
            "c/gym/k/i/b.txt",
            "c/other.txt",
        ]
        assert backend.exists("c/other.txt") and not backend.exists("c/none.txt")
        backend.delete("c/other.txt")
        backend.delete("c/other.txt")
        assert not backend.exists("c/other.txt")
        assert "c/other.txt" not in self.raw_files(backend)

    def test_replace_writes_whether_or_not_the_file_exists(self, backend: StorageBackend) -> None:
        backend.replace("root/LATEST", b"ckpt-1")
        assert backend.read_bytes("root/LATEST") == b"ckpt-1"
        backend.replace("root/LATEST", b"ckpt-22")
        assert backend.read_bytes("root/LATEST") == b"ckpt-22"
        assert self.raw_files(backend, "root") == ["root/LATEST"]  # no temporary file left beside it

    def test_delete_tree_removes_one_directory_and_nothing_beside_it(self, backend: StorageBackend) -> None:
        for path in ("r/old/gym/k/i/a.txt", "r/old/gym/checkpoint.json", "r/older/x", "r/LATEST"):
            self.raw_write(backend, path, b"1")
        assert backend.delete_tree("r/old") == 2
        assert self.raw_files(backend, "r/") == ["r/LATEST", "r/older/x"]
        assert backend.list_dir("r") == ["LATEST", "older/"]
        assert backend.delete_tree("r/missing") == 0
        with pytest.raises(ValueError, match="root"):
            backend.delete_tree("")

    @pytest.mark.parametrize("path", ["../escape", "/etc/passwd", "a/../../b", "a\\b"])
    def test_paths_never_escape_the_root(self, backend: StorageBackend, path: str) -> None:
        with pytest.raises(errors.RecordsPathEscapes):
            backend.read_bytes(path)
        with pytest.raises(errors.RecordsPathEscapes):
            backend.create_if_absent(path, b"x")
        with pytest.raises(errors.RecordsPathEscapes):
            backend.replace(path, b"x")
        with pytest.raises(errors.RecordsPathEscapes):
            backend.delete_tree(path)

    def test_sync_directories_accepts_nested_paths(self, backend: StorageBackend) -> None:
        self.raw_write(backend, "s/t/u/file", b"1")
        backend.sync_directories("s/t/u")
        backend.sync_directories("s/t/u", up_to="s")

    # --- the store on this backend

    def test_commit_and_restore_round_trip(self, backend: StorageBackend) -> None:
        store = CheckpointStore(backend, chunk_size=4096)
        records = sample_records(40)
        manifest = store.write_participant(
            "ck", kind="agent", instance="a-0", checkpoint_id="ck-1", records=iter(records), extra={"note": [1, 2.5]}
        )
        data = self.raw_read(backend, manifest.records_path)
        assert manifest.records_file == f"records-{hashlib.sha256(data).hexdigest()}.jsonl"
        assert manifest.records_bytes == len(data)
        assert data.count(b"\n") == 40
        document = json.loads(self.raw_read(backend, manifest.path))
        assert list(document)[:10] == [
            "schema_version",
            "kind",
            "instance",
            "checkpoint_id",
            "records_file",
            "records_sha256",
            "record_count",
            "records_bytes",
            "max_record_bytes",
            "episode_ids",
        ]
        assert document["episode_ids"] == sorted(record["episode_id"] for record in records)
        assert document["max_record_bytes"] == max(map(len, data.splitlines(keepends=True)))
        assert document["note"] == [1, 2.5]
        assert list(document)[-1] == "writer"
        restored = list(store.read_participant("ck", kind="agent", instance="a-0"))
        assert same_records(restored, records)
        scoped = list(store.read_participant("ck", kind="agent", instance="a-0", scope={"r3", "r7", "nope"}))
        assert [record["episode_id"] for record in scoped] == ["r3", "r7"]
        assert same_records(scoped, [records[3], records[7]])

    def test_same_records_give_the_same_manifest_bytes(self, backend: StorageBackend) -> None:
        store = CheckpointStore(backend, chunk_size=1024)
        first = store.write_participant("c1", kind="model", instance="m", checkpoint_id="x", records=sample_records(9))
        second = store.write_participant("c2", kind="model", instance="m", checkpoint_id="x", records=sample_records(9))
        assert first.raw == second.raw
        assert self.raw_read(backend, first.path) == self.raw_read(backend, second.path)

    def test_identical_retry_succeeds_and_leaves_no_temporary_file(self, backend: StorageBackend) -> None:
        store = CheckpointStore(backend)
        first = store.write_participant("c", kind="model", instance="m", checkpoint_id="x", records=sample_records(5))
        again = store.write_participant("c", kind="model", instance="m", checkpoint_id="x", records=sample_records(5))
        assert again.raw == first.raw
        assert self.raw_files(backend, "c") == sorted([first.path, first.records_path])

    def test_different_manifest_is_a_conflict_and_the_loser_leaves_nothing(self, backend: StorageBackend) -> None:
        store = CheckpointStore(backend)
        first = store.write_participant("c", kind="model", instance="m", checkpoint_id="x", records=sample_records(5))
        with pytest.raises(errors.ManifestConflict):
            store.write_participant("c", kind="model", instance="m", checkpoint_id="x", records=sample_records(6))
        assert self.raw_files(backend, "c") == sorted([first.path, first.records_path])
        assert self.raw_read(backend, first.path) == first.raw

    def test_racing_writers_leave_one_manifest_that_verifies(self, backend: StorageBackend) -> None:
        store = CheckpointStore(backend, chunk_size=2048)
        barrier = threading.Barrier(3)
        outcomes: list[object] = []

        def commit(count: int) -> None:
            records = sample_records(count, prefix=f"w{count}-")
            barrier.wait(timeout=30)
            try:
                outcomes.append(
                    store.write_participant("race", kind="agent", instance="a", checkpoint_id="r", records=records)
                )
            except errors.ManifestConflict as exc:
                outcomes.append(exc)

        threads = [threading.Thread(target=commit, args=(count,)) for count in (10, 11, 12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        winners = [outcome for outcome in outcomes if not isinstance(outcome, Exception)]
        assert len(winners) == 1 and len(outcomes) == 3
        files = self.raw_files(backend, "race")
        assert files == sorted([winners[0].path, winners[0].records_path])  # type: ignore[attr-defined]
        report = verify_backend(backend)
        assert report.ok and not report.findings[1:]

    def test_stop_before_publication_leaves_no_manifest(self, backend: StorageBackend) -> None:
        store = CheckpointStore(backend, chunk_size=512)
        stop = WriteStop()

        def records():
            for index, record in enumerate(sample_records(50)):
                if index == 20:
                    stop.stop()
                yield record

        with pytest.raises(errors.WriteStopped):
            store.write_participant("c", kind="agent", instance="a", checkpoint_id="x", records=records(), stop=stop)
        assert self.raw_files(backend, "c") == []

    def test_not_json_value_fails_the_commit_by_name(self, backend: StorageBackend) -> None:
        store = CheckpointStore(backend)
        records = sample_records(3)
        records[2]["alpha"]["when"] = {1, 2}
        with pytest.raises(errors.NotJSONError) as raised:
            store.write_participant("c", kind="agent", instance="a", checkpoint_id="x", records=records)
        assert raised.value.episode_id == "r2"
        assert raised.value.path == "$.alpha.when"
        assert self.raw_files(backend, "c") == []

    def test_publish_lists_every_participant(self, backend: StorageBackend) -> None:
        store = CheckpointStore(backend)
        manifests = [
            store.write_participant("p", kind=kind, instance="0", checkpoint_id="p1", records=sample_records(3))
            for kind in ("resources", "environment")
        ]
        document = store.publish("p", manifests, extra={"step": 7})
        raw = json.loads(self.raw_read(backend, "p/gym/checkpoint.json"))
        assert raw == document
        assert [entry["kind"] for entry in raw["participants"]] == ["environment", "resources"]
        assert raw["participants"][0]["manifest_sha256"] == hashlib.sha256(manifests[1].raw).hexdigest()
        assert store.publish("p", manifests, extra={"step": 7}) == document
        with pytest.raises(errors.ManifestConflict):
            store.publish("p", manifests, extra={"step": 8})
        index = store.read_index("p")
        assert index.checkpoint_id == "p1" and index.extra == {"step": 7}
        assert verify_backend(backend).findings == []

    # --- the corruption table

    def _published(self, backend: StorageBackend) -> dict[str, str]:
        store = CheckpointStore(backend, chunk_size=1024)
        env = store.write_participant(
            "ck", kind="environment", instance="e0", checkpoint_id="c", records=sample_records(12)
        )
        agent = store.write_participant("ck", kind="agent", instance="a0", checkpoint_id="c", records=sample_records(6))
        store.publish("ck", [env, agent])
        return {"manifest": env.path, "records": env.records_path, "index": "ck/gym/checkpoint.json"}

    @pytest.mark.parametrize("case", sorted(CORRUPTIONS))
    def test_corruption_gives_a_typed_error_and_one_finding(self, backend: StorageBackend, case: str) -> None:
        paths = self._published(backend)
        assert verify_backend(backend).findings == []
        damage, error, code = CORRUPTIONS[case]
        named = damage(self, backend, paths)
        store = CheckpointStore(backend, chunk_size=1024)
        with pytest.raises(error) as raised:
            if case.startswith("index_"):
                store.read_index("ck")
            else:
                list(store.read_participant("ck", kind="environment", instance="e0"))
        assert raised.value.code == "invalid_checkpoint_state"
        for quick in (False, True):
            report = verify_backend(backend, quick=quick)
            if quick and code in {
                "records_digest_mismatch",
                "record_undecodable",
                "record_count_mismatch",
                "episode_ids_mismatch",
            }:
                # --quick does not re-read records; a changed manifest still shows in the index check
                assert [finding.code for finding in report.errors] in ([], ["index_digest_mismatch"])
                continue
            assert [finding.code for finding in report.errors] == [code], report.errors
            assert report.errors[0].path == named
            assert not report.ok
        # the other participant still restores
        assert len(list(store.read_participant("ck", kind="agent", instance="a0"))) == 6

    def test_leftovers_are_warnings_not_errors(self, backend: StorageBackend) -> None:
        paths = self._published(backend)
        directory = paths["manifest"].rpartition("/")[0]
        self.raw_write(backend, f"{directory}/records-{'a' * 64}.jsonl", b"{}\n")
        self.raw_write(backend, f"{directory}/.gymckpt-tmp-0123.part", b"partial")
        self.raw_write(backend, "ck/gym/model/m0/records-" + "b" * 64 + ".jsonl", b"")
        report = verify_backend(backend)
        assert report.ok
        assert sorted(finding.code for finding in report.findings) == [
            "leftover_temporary_file",
            "orphaned_records",
            "orphaned_records",
            "unfinished_commit",
        ]
        assert all(finding.severity is Severity.WARNING for finding in report.findings)

    # --- the attack table: one thing done to a good checkpoint; refused, reported, nothing outside touched

    def test_attack_is_refused_reported_and_touches_nothing_outside(
        self, backend: StorageBackend, attack: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        row = ATTACKS[attack]
        monkeypatch.setattr(participant_module, "MAX_MANIFEST_BYTES", MANIFEST_LIMIT)
        monkeypatch.setattr(publication_module, "MAX_INDEX_BYTES", INDEX_LIMIT)
        store = CheckpointStore(backend, chunk_size=1024)
        env = store.write_participant(
            "ck", kind="environment", instance="e0", checkpoint_id="c", records=sample_records(12)
        )
        agent = store.write_participant("ck", kind="agent", instance="a0", checkpoint_id="c", records=sample_records(6))
        store.publish("ck", [env, agent])
        assert verify_backend(backend).findings == []
        ctx = AttackContext(self, backend, env, agent, self.outside_directory(backend))
        expected = row.apply(ctx)
        if ctx.document_budget is not None:
            monkeypatch.setattr(bounds_module, "DOCUMENT_BUDGET", ctx.document_budget)
        watch = OutsideWatch(ctx.outside) if ctx.outside is not None else None
        recorder = RecordingBackend(backend, ctx.size_override)
        reading = CheckpointStore(recorder, chunk_size=1024)

        def read() -> list[dict[str, Any]]:
            if row.read_index:
                reading.read_index("ck")
                return []
            assert row.read is not None
            kind, instance = row.read
            return list(reading.read_participant("ck", kind=kind, instance=instance, scope=row.scope))

        try:
            if row.error is None:
                restored = read()
                if ctx.expect_records is not None:
                    assert_identical(ctx.expect_records, restored)
            else:
                with pytest.raises(row.error) as raised:
                    read()
                assert raised.value.code == "invalid_checkpoint_state"
            report = verify_backend(recorder)
            found = sorted((finding.code, str(finding.severity), finding.path) for finding in report.findings)
            assert found == sorted(expected), report.findings
            assert report.ok is not any(severity == "error" for _, severity, _ in expected)
            # advice that loses nothing: never delete a records file a published checkpoint needs
            needed = {f"delete {env.records_path}", f"delete {agent.records_path}"}
            assert not [finding for finding in report.findings if finding.fix in needed]
            # nothing outside the checkpoint read, nothing written, every read bounded
            assert recorder.writes == []
            assert all(path in ("", "ck") or path.startswith("ck/") for path in recorder.reads), recorder.reads
            for path, bound in ctx.read_bounds.items():
                assert recorder.bytes_read[path] <= bound, (path, recorder.bytes_read[path], bound)
            for path, count in recorder.bytes_read.items():
                if path.endswith(MANIFEST_NAME):
                    assert count <= MANIFEST_LIMIT + 1, (path, count)
            if watch is not None:
                events = watch.events()
                assert events == [], f"outside the store's root was touched: {events}"
        finally:
            if watch is not None:
                watch.close()
