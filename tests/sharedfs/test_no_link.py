"""Mounts that cannot hold a checkpoint safely: an S3 bucket mounted with Debian's s3fs (FUSE), against
the test's moto server on 127.0.0.1, has no link(). The first commit there is refused with
UnsupportedStorage naming the directory and the missing capability before a byte of records is
written; opted in, manifests are created with
O_EXCL instead, and a checkpoint committed that way verifies and restores."""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING

import pytest

from gymckpt.errors import ManifestConflict, UnsupportedStorage
from gymckpt.store import CheckpointStore, verify
from gymckpt.store._local import LocalBackend
from gymckpt.store.capabilities import ALLOW_NO_LINK_ENV, LINK_CAPABILITY, allow_no_link_from_environment, probe_link
from gymckpt.testing.moto import DUMMY_KEY, DUMMY_SECRET
from gymckpt.testing.sharedfs import SharedFsUnavailable, s3fs_mount
from gymckpt.testing.values import same_records, sample_records

from .conftest import PARTICIPANT

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from gymckpt.testing.moto import MotoEndpoint

    from .conftest import Hosts

pytestmark = pytest.mark.slow

MANIFEST = "ck/gym/environment/env-0/manifest.json"


@pytest.fixture
def bucket(moto_endpoint: MotoEndpoint, tmp_path: Path) -> Iterator[Path]:
    """A fresh bucket of the session's moto server, mounted with s3fs."""
    name = f"nolink-{tmp_path.name.lower().replace('_', '-')[-40:]}"
    moto_endpoint.create_bucket(name)
    try:
        with s3fs_mount(
            name, tmp_path / "bucket", endpoint_url=moto_endpoint.url, key=DUMMY_KEY, secret=DUMMY_SECRET
        ) as path:
            yield path
    except SharedFsUnavailable as exc:
        pytest.skip(str(exc))


def _commit(store: CheckpointStore, records: list[dict]) -> None:
    store.write_participant("ck", **PARTICIPANT, records=iter(records))


def test_probe_link_tells_the_mounts_apart(bucket: Path, hosts: Hosts, tmp_path: Path) -> None:
    assert probe_link(str(bucket)) is False
    assert probe_link(str(hosts.a)) is True
    assert probe_link(str(tmp_path)) is True
    assert probe_link(str(tmp_path / "missing")) is None
    assert [path.name for path in bucket.iterdir()] == []  # the probe's files are gone


def test_the_first_commit_on_a_mount_without_link_is_refused(bucket: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_NO_LINK_ENV, raising=False)
    backend = LocalBackend(str(bucket))
    assert backend.supports_conditional_create
    taken: list[dict] = []
    with pytest.raises(UnsupportedStorage) as refused:
        store = CheckpointStore(backend)
        store.write_participant("ck", **PARTICIPANT, records=(taken.append(r) or r for r in sample_records(5)))
    message = str(refused.value)
    directory = "ck/gym/environment/env-0"
    assert refused.value.path == directory, refused.value.path  # refused at the records file, not the manifest
    assert str(bucket / directory) in message
    assert LINK_CAPABILITY in message and ALLOW_NO_LINK_ENV in message
    assert refused.value.errno == errno.EOPNOTSUPP
    assert taken == []  # before the first record was taken: no byte of records was written
    assert [path.name for path in (bucket / directory).iterdir()] == []
    assert not backend.supports_conditional_create
    # every later create on that filesystem is refused the same way, without another try
    with pytest.raises(UnsupportedStorage):
        backend.create_if_absent("other/manifest.json", b"{}")


def test_opted_in_manifests_are_created_with_o_excl(bucket: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GYMCKPT_ALLOW_NO_LINK=1: the commit succeeds, verify and restore see it, a retry of the same
    manifest is success and a different one a ManifestConflict, on the same mount."""
    monkeypatch.setenv(ALLOW_NO_LINK_ENV, "1")
    records = sample_records(12, payload=300)
    store = CheckpointStore(LocalBackend(str(bucket)))
    _commit(store, records)
    assert not store.backend.supports_conditional_create
    report = verify(str(bucket / "ck"))
    assert report.ok and report.records_checked == 12, [finding.to_dict() for finding in report.findings]
    assert same_records(list(store.read_participant("ck", kind="environment", instance="env-0")), records)
    manifest = (bucket / MANIFEST).read_bytes()
    assert store.backend.create_if_absent(MANIFEST, manifest) is False
    with pytest.raises(ManifestConflict):
        _commit(CheckpointStore(LocalBackend(str(bucket))), sample_records(3, prefix="x"))
    assert (bucket / MANIFEST).read_bytes() == manifest


def test_the_opt_in_is_explicit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for value, expected in (("", False), ("0", False), ("1", True), ("yes", True), ("off", False)):
        monkeypatch.setenv(ALLOW_NO_LINK_ENV, value)
        assert allow_no_link_from_environment() is expected
        assert LocalBackend(str(tmp_path)).allow_no_link is expected
    monkeypatch.setenv(ALLOW_NO_LINK_ENV, "maybe")
    with pytest.raises(ValueError, match=ALLOW_NO_LINK_ENV):
        LocalBackend(str(tmp_path))
    assert LocalBackend(str(tmp_path), allow_no_link=False).allow_no_link is False
