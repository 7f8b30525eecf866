"""The local backend holds its root open and walks from descriptors: a directory swapped for a symlink
while a commit or a restore runs leads nowhere outside, and a filesystem without link() is refused
before the first records byte.

Real files under ``tmp_path``: ``allowed/`` stands for an ``allowed_roots`` entry, ``outside/`` for
a directory an attacker with write access to ``allowed/`` wants the store to use. A swap renames
the real directory aside (it stays inside ``allowed/``) and puts a symlink to ``outside/`` in its
place, as a ``rename()`` race would. ``outside/`` is watched with inotify, so anything the store
creates, opens or reads there is seen.
"""

from __future__ import annotations

import errno
import os
import shutil
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.errors import NotRegularFile, StorageError, UnsupportedStorage, UnusableDirectory
from gymckpt.store import CheckpointStore
from gymckpt.store._local import TEMP_PREFIX, LocalBackend
from gymckpt.store.capabilities import ALLOW_NO_LINK_ENV, LINK_CAPABILITY
from gymckpt.testing.recording import OutsideWatch
from gymckpt.testing.values import same_records, sample_records

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

PARTICIPANT = {"kind": "environment", "instance": "env-0", "checkpoint_id": "ck-1"}
RECORDS = sample_records(40, payload=300)
#: small chunks: the records file takes many writes, so a swap lands in the middle of them
CHUNK_SIZE = 2048


@pytest.fixture
def area(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "allowed").mkdir()
    (tmp_path / "outside").mkdir()
    return {"allowed": tmp_path / "allowed", "outside": tmp_path / "outside"}


def swap(directory: Path, target: Path) -> None:
    """Move ``directory`` aside (it stays where it was, renamed) and put a symlink to ``target`` in its place."""
    directory.rename(directory.with_name(directory.name + ".moved"))
    directory.symlink_to(target, target_is_directory=True)


def entries(directory: Path) -> list[str]:
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*"))


def swapping(records: list[dict[str, Any]], after: int, action: Callable[[], None]) -> Iterator[dict[str, Any]]:
    """``records``, running ``action`` once ``after`` of them were taken (while the records file is written)."""
    for index, record in enumerate(records):
        if index == after:
            action()
        yield record


def store_on(root: Path, **options: Any) -> CheckpointStore:
    return CheckpointStore(LocalBackend(str(root), **options), chunk_size=CHUNK_SIZE)


# --- writes


@pytest.mark.parametrize("existed", [True, False], ids=["root-existed", "root-created-by-the-commit"])
def test_a_root_swapped_after_the_store_was_opened_is_refused_and_nothing_lands_outside(
    area: dict[str, Path], existed: bool
) -> None:
    """What the control plane does: open the store (after the allowed_roots check), export, then write."""
    root = area["allowed"] / "ck"
    if existed:
        root.mkdir()
    store = store_on(root)
    if existed:
        swap(root, area["outside"])
    else:
        root.symlink_to(area["outside"], target_is_directory=True)
    watch = OutsideWatch(str(area["outside"]))
    try:
        with pytest.raises(NotRegularFile):
            store.write_participant("", **PARTICIPANT, records=iter(RECORDS))
        assert watch.events() == []
    finally:
        watch.close()
        store.close()
    assert entries(area["outside"]) == []


#: (store root, checkpoint_dir, the directory swapped mid-write, what ``outside/`` is made to look like)
MID_WRITE = {
    "store-root": ("ck", "", "ck", ["gym/environment/env-0"]),
    "checkpoint-dir": ("", "ck", "ck", ["gym/environment/env-0"]),
    "kind-dir": ("", "ck", "ck/gym/environment", ["env-0"]),
    "participant-dir": ("", "ck", "ck/gym/environment/env-0", []),
}


@pytest.mark.parametrize("case", sorted(MID_WRITE))
def test_a_directory_swapped_while_the_records_are_written_is_refused_and_nothing_lands_outside(
    area: dict[str, Path], case: str
) -> None:
    """``outside/`` holds the directories the rest of the path needs, so following the symlink would work."""
    root_name, checkpoint_dir, swapped, prepared = MID_WRITE[case]
    root = area["allowed"] / root_name if root_name else area["allowed"]
    for directory in prepared:
        (area["outside"] / directory).mkdir(parents=True)
    before = entries(area["outside"])
    store = store_on(root)
    watches: list[OutsideWatch] = []

    def attack() -> None:
        swap(area["allowed"] / swapped, area["outside"])
        watches.append(OutsideWatch(str(area["outside"])))

    try:
        with pytest.raises(NotRegularFile):
            store.write_participant(checkpoint_dir, **PARTICIPANT, records=swapping(RECORDS, 15, attack))
        assert watches, "the records were not taken"
        assert watches[0].events() == []
    finally:
        for watch in watches:
            watch.close()
        store.close()
    assert entries(area["outside"]) == before
    assert not list(area["allowed"].rglob("manifest.json"))


def test_the_allowed_roots_check_and_the_store_share_one_resolution(area: dict[str, Path]) -> None:
    """open_allowed_store opens what check_allowed compared; a swap after it is refused, never followed."""
    from gymckpt.control.allowed_roots import check_allowed, open_allowed_store

    (area["allowed"] / "runs").mkdir()
    (area["allowed"] / "alias").symlink_to(area["allowed"] / "runs", target_is_directory=True)
    store = open_allowed_store(str(area["allowed"] / "alias" / "ck"), [str(area["allowed"])])
    try:
        assert isinstance(store.backend, LocalBackend)
        assert store.backend.root == str((area["allowed"] / "runs" / "ck").resolve())
        swap(area["allowed"] / "runs", area["outside"])
        with pytest.raises(NotRegularFile):
            store.write_participant("", **PARTICIPANT, records=iter(RECORDS))
    finally:
        store.close()
    assert entries(area["outside"]) == []

    # a swap between the check and the open: the checked path is not resolved a second time
    (area["allowed"] / "later").mkdir()
    location = check_allowed(str(area["allowed"] / "later" / "ck"), [str(area["allowed"])])
    swap(area["allowed"] / "later", area["outside"])
    backend = LocalBackend(location, resolved=True)
    try:
        with pytest.raises(NotRegularFile):
            CheckpointStore(backend).write_participant("", **PARTICIPANT, records=iter(RECORDS))
    finally:
        backend.close()
    assert entries(area["outside"]) == []


# --- reads


def _committed(allowed: Path) -> None:
    with store_on(allowed) as store:
        store.write_participant("ck", **PARTICIPANT, records=iter(RECORDS))


#: (store root, checkpoint_dir, the directory swapped between the manifest and the records)
BETWEEN_READS = {
    "store-root": ("ck", "", "ck"),
    "checkpoint-dir": ("", "ck", "ck"),
    "kind-dir": ("", "ck", "ck/gym/environment"),
    "participant-dir": ("", "ck", "ck/gym/environment/env-0"),
}


@pytest.mark.parametrize("case", sorted(BETWEEN_READS))
def test_a_directory_swapped_between_manifest_and_records_is_refused_and_nothing_outside_is_read(
    area: dict[str, Path], case: str
) -> None:
    """``outside/`` is a copy of the swapped directory: following the symlink would read valid records."""
    _committed(area["allowed"])
    root_name, checkpoint_dir, swapped = BETWEEN_READS[case]
    root = area["allowed"] / root_name if root_name else area["allowed"]
    copy = area["outside"] / "copy"
    shutil.copytree(area["allowed"] / swapped, copy)
    store = store_on(root)
    watch: OutsideWatch | None = None
    try:
        manifest = store.read_manifest(checkpoint_dir, kind="environment", instance="env-0")
        swap(area["allowed"] / swapped, copy)
        watch = OutsideWatch(str(area["outside"]))
        with pytest.raises(NotRegularFile):
            list(store.read_records(manifest))
        assert watch.events() == []
    finally:
        if watch is not None:
            watch.close()
        store.close()


def test_a_root_swapped_before_a_restore_is_refused(area: dict[str, Path]) -> None:
    _committed(area["allowed"])
    root = area["allowed"] / "ck"
    copy = area["outside"] / "copy"
    shutil.copytree(root, copy)
    store = store_on(root)
    try:
        swap(root, copy)
        watch = OutsideWatch(str(area["outside"]))
        try:
            with pytest.raises(NotRegularFile):
                list(store.read_participant("", kind="environment", instance="env-0"))
            with pytest.raises(NotRegularFile):
                store.backend.list_dir("gym")
            assert watch.events() == []
        finally:
            watch.close()
    finally:
        store.close()
    # the store opened again resolves the path again: the symlink is the root now, and it is followed once
    with store_on(root) as again:
        assert same_records(list(again.read_participant("", kind="environment", instance="env-0")), RECORDS)


def test_a_root_removed_while_open_reads_as_missing_and_is_not_created_again(area: dict[str, Path]) -> None:
    root = area["allowed"] / "ck"
    root.mkdir()
    store = store_on(root)
    try:
        root.rmdir()
        assert store.backend.list_dir("") == []
        assert not store.backend.exists("gym/checkpoint.json")
        with pytest.raises(UnusableDirectory, match="removed while the store was open"):
            store.write_participant("", **PARTICIPANT, records=iter(RECORDS))
        assert not root.exists()
    finally:
        store.close()


# --- the root's descriptor


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_backend_holds_one_descriptor_until_closed(area: dict[str, Path]) -> None:
    before = _open_descriptors()
    backend = LocalBackend(str(area["allowed"]))
    assert _open_descriptors() == before + 1
    backend.close()
    assert _open_descriptors() == before
    with pytest.raises(StorageError, match="closed"):
        backend.list_dir("")
    dropped = LocalBackend(str(area["allowed"]))
    assert _open_descriptors() == before + 1
    del dropped  # an unclosed backend gives its descriptor back when it is collected
    assert _open_descriptors() == before


# --- a filesystem without link()


class NoLink:
    """os.link below the backend, as a filesystem without hard links answers it (s3fs: EOPNOTSUPP)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, error: int = errno.EOPNOTSUPP) -> None:
        self.calls = 0
        self.error = error
        monkeypatch.setattr(os, "link", self)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.calls += 1
        raise OSError(self.error, os.strerror(self.error))


def _taken(records: list[dict[str, Any]], taken: list[str]) -> Iterator[dict[str, Any]]:
    for record in records:
        taken.append(record["episode_id"])
        yield record


@pytest.mark.parametrize("error", [errno.EOPNOTSUPP, errno.EPERM, errno.ENOSYS], ids=errno.errorcode.get)
def test_a_filesystem_without_link_is_refused_before_the_first_records_byte(
    area: dict[str, Path], monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    monkeypatch.delenv(ALLOW_NO_LINK_ENV, raising=False)
    no_link = NoLink(monkeypatch, error)
    store = store_on(area["allowed"])
    taken: list[str] = []
    with pytest.raises(UnsupportedStorage) as refused:
        store.write_participant("ck", **PARTICIPANT, records=_taken(RECORDS, taken))
    assert taken == []  # not one record was asked for
    participant = area["allowed"] / "ck/gym/environment/env-0"
    assert [name for name in os.listdir(participant) if name.startswith(("records-", TEMP_PREFIX))] == []
    assert entries(participant) == []
    message = str(refused.value)
    assert refused.value.errno == error and refused.value.path == "ck/gym/environment/env-0"
    assert LINK_CAPABILITY in message and ALLOW_NO_LINK_ENV in message and str(participant) in message
    assert not store.backend.supports_conditional_create
    assert no_link.calls == 1

    # decided once for that filesystem: another participant's commit is refused without another link()
    with pytest.raises(UnsupportedStorage):
        store.write_participant("ck", kind="environment", instance="env-1", checkpoint_id="ck-1", records=iter([]))
    assert no_link.calls == 1
    assert entries(area["allowed"] / "ck/gym/environment/env-1") == []


def test_opted_in_a_filesystem_without_link_commits_with_o_excl(
    area: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    NoLink(monkeypatch)
    store = store_on(area["allowed"], allow_no_link=True)
    store.write_participant("ck", **PARTICIPANT, records=iter(RECORDS))
    assert not store.backend.supports_conditional_create
    assert same_records(list(store.read_participant("ck", kind="environment", instance="env-0")), RECORDS)
    names = os.listdir(area["allowed"] / "ck/gym/environment/env-0")
    assert [name for name in names if name.startswith(TEMP_PREFIX)] == []


def test_the_probe_asks_once_per_filesystem_and_leaves_nothing(
    area: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_link = os.link
    calls: list[str] = []

    def counting(source: str, target: str, **kwargs: Any) -> None:
        calls.append(target)
        real_link(source, target, **kwargs)

    monkeypatch.setattr(os, "link", counting)
    store = store_on(area["allowed"])
    for instance in ("env-0", "env-1"):
        store.write_participant(
            "ck", kind="environment", instance=instance, checkpoint_id="ck-1", records=iter(RECORDS)
        )
    probes = [name for name in calls if name.startswith(TEMP_PREFIX)]
    assert len(probes) == 1 and calls.count("manifest.json") == 2, calls
    assert store.backend.supports_conditional_create
    for instance in ("env-0", "env-1"):
        names = sorted(os.listdir(area["allowed"] / "ck/gym/environment" / instance))
        assert len(names) == 2 and names[0] == "manifest.json" and names[1].startswith("records-"), names
