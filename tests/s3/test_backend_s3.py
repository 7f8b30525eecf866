"""The shipped backend suite, and what is particular to S3, against moto's server over HTTP."""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from typing import TYPE_CHECKING, Any

import aiobotocore.session
import fsspec
import pytest

import gymckpt.store._s3 as s3_module
from gymckpt import errors
from gymckpt.store import CheckpointStore, WriteStop, open_store, verify
from gymckpt.store._fsspec import FsspecBackend
from gymckpt.store._s3 import DEFAULT_BLOCK_SIZE, shared_session
from gymckpt.store.warm import warm_storage
from gymckpt.testing.backend_suite import BackendTests
from gymckpt.testing.values import sample_records

from .s3_support import BUCKET, FAST_OPTIONS, all_keys, open_uploads

if TYPE_CHECKING:
    from collections.abc import Iterator

    from gymckpt.testing.moto import MotoEndpoint

PREFIX = "root"


def _key(path: str) -> str:
    return f"{PREFIX}/{path}"


class TestS3Backend(BackendTests):
    """BackendTests through s3fs; the raw hooks use boto3 directly."""

    expects_directory_fsync = False

    @pytest.fixture
    def backend(self, s3: Any, moto_endpoint: MotoEndpoint) -> Iterator[FsspecBackend]:
        self.client = s3
        backend = FsspecBackend(f"s3://{BUCKET}/{PREFIX}", endpoint_url=moto_endpoint.url, **FAST_OPTIONS)
        try:
            yield backend
            assert open_uploads(s3) == [], "a multipart upload was left behind"
        finally:
            backend.close()

    def raw_read(self, backend: FsspecBackend, path: str) -> bytes:
        return self.client.get_object(Bucket=BUCKET, Key=_key(path))["Body"].read()

    def raw_write(self, backend: FsspecBackend, path: str, data: bytes) -> None:
        self.client.put_object(Bucket=BUCKET, Key=_key(path), Body=data)

    def raw_delete(self, backend: FsspecBackend, path: str) -> None:
        self.client.delete_object(Bucket=BUCKET, Key=_key(path))

    def raw_files(self, backend: FsspecBackend, prefix: str = "") -> list[str]:
        keys = all_keys(self.client, _key(prefix) if prefix else f"{PREFIX}/")
        return sorted(key[len(PREFIX) + 1 :] for key in keys)


# --- multipart streaming


def _big_records(count: int, size: int = 300_000, *, fail_at: int | None = None, stop: WriteStop | None = None):
    for index in range(count):
        if index == fail_at:
            raise RuntimeError("the producer failed")
        if stop is not None and index == count // 2:
            stop.stop()
        yield {"episode_id": f"e{index}", "blob": f"{index:08d}" * (size // 8)}


def test_large_records_stream_as_multipart_and_round_trip(
    s3: Any, s3_url: str, moto_endpoint: MotoEndpoint, fault_proxy
) -> None:
    store = open_store(s3_url, endpoint_url=fault_proxy.url, **FAST_OPTIONS)
    manifest = store.write_participant("ck", kind="model", instance="m", checkpoint_id="c", records=_big_records(60))
    assert manifest.records_bytes > 3 * (5 << 20)
    parts = fault_proxy.requests("PUT", query="partNumber=")
    assert len(parts) == 4  # 5 MiB parts of a ~18 MB file, never the whole file in one request
    assert len(fault_proxy.requests("POST", query="uploadId=")) == 1
    copies = [entry for entry in fault_proxy.requests("PUT") if "/records-" in entry.path]
    assert len(copies) == 1  # the digest name is written once, by a server-side copy
    data = s3.get_object(Bucket=BUCKET, Key=f"root/{manifest.records_path}")["Body"].read()
    assert hashlib.sha256(data).hexdigest() == manifest.records_sha256
    assert all_keys(s3) == sorted([f"root/{manifest.path}", f"root/{manifest.records_path}"])
    restored = list(store.read_participant("ck", kind="model", instance="m", scope={"e0", "e59"}))
    assert [record["episode_id"] for record in restored] == ["e0", "e59"]
    assert open_uploads(s3) == []
    store.close()


def test_no_object_under_the_digest_name_before_publication(s3: Any, s3_backend: FsspecBackend) -> None:
    sink = s3_backend.open_sink("ck/gym/model/m")
    chunk = b"x" * (3 << 20)
    for _ in range(4):
        sink.write(chunk)
    assert len(open_uploads(s3)) == 1  # parts are on their way while writing goes on
    sink.finish()
    keys = all_keys(s3)
    assert len(keys) == 1 and keys[0].rpartition("/")[2].startswith(".gymckpt-tmp-")
    digest = hashlib.sha256(chunk * 4).hexdigest()
    sink.publish(f"records-{digest}.jsonl")
    assert all_keys(s3) == [f"root/ck/gym/model/m/records-{digest}.jsonl"]
    assert open_uploads(s3) == []


def test_a_file_up_to_single_put_bytes_is_one_put_under_its_digest_name(
    s3: Any, s3_url: str, moto_endpoint: MotoEndpoint
) -> None:
    backend = FsspecBackend(s3_url, endpoint_url=moto_endpoint.url, block_size=5 << 20, single_put_bytes=12 << 20)
    sink = backend.open_sink("ck/gym/model/m")
    chunk = b"z" * (3 << 20)
    for _ in range(4):
        sink.write(chunk)
    assert open_uploads(s3) == []  # nothing sent: it may still fit one PUT
    sink.finish()
    assert all_keys(s3) == []  # no temporary object either
    digest = hashlib.sha256(chunk * 4).hexdigest()
    sink.publish(f"records-{digest}.jsonl")
    assert all_keys(s3) == [f"root/ck/gym/model/m/records-{digest}.jsonl"]
    backend.close()


def test_what_write_is_given_is_copied_and_only_an_adopted_chunk_is_kept(s3: Any, s3_backend: FsspecBackend) -> None:
    """A wrapper that forwards only ``write`` may fill its buffer again at once: the one PUT must
    still send what was written then. A chunk handed over with ``adopt`` is kept as it is."""
    sink = s3_backend.open_sink("ck/gym/agent/a")
    assert sink.keeps_chunks
    reused = bytearray(b"first line\n")
    sink.write(memoryview(reused))
    reused[:] = b"overwrite!\n"  # same length: a kept view would now read this
    sink.write(memoryview(reused))
    adopted = bytearray(b"adopted\n")
    sink.adopt(memoryview(adopted))
    sink.finish()
    data = b"first line\noverwrite!\nadopted\n"
    digest = hashlib.sha256(data).hexdigest()
    sink.publish(f"records-{digest}.jsonl")
    assert s3_backend.read_bytes(f"ck/gym/agent/a/records-{digest}.jsonl") == data


@pytest.mark.parametrize("how", ["producer_fails", "write_stopped", "not_json"])
def test_a_failed_multipart_write_aborts_its_upload(
    s3: Any, s3_url: str, moto_endpoint: MotoEndpoint, how: str
) -> None:
    store = open_store(s3_url, endpoint_url=moto_endpoint.url, **FAST_OPTIONS)
    stop = WriteStop() if how == "write_stopped" else None
    records: Any = _big_records(40, fail_at=30 if how == "producer_fails" else None, stop=stop)
    if how == "not_json":
        records = [*_big_records(30), {"episode_id": "bad", "when": {1, 2}}]
    expected = {"producer_fails": RuntimeError, "write_stopped": errors.WriteStopped, "not_json": errors.NotJSONError}
    with pytest.raises(expected[how]):
        store.write_participant("ck", kind="agent", instance="a", checkpoint_id="c", records=records, stop=stop)
    assert all_keys(s3) == []
    assert open_uploads(s3) == []
    store.close()


def test_aborting_after_finish_deletes_the_temporary_object(s3: Any, s3_backend: FsspecBackend) -> None:
    sink = s3_backend.open_sink("d")
    sink.write(b"y" * (6 << 20))
    sink.finish()
    assert len(all_keys(s3)) == 1
    sink.abort()
    sink.abort()
    assert all_keys(s3) == []
    assert open_uploads(s3) == []


# --- listings, capabilities, options, lifetime


def test_listings_never_come_from_a_cache(s3: Any, s3_backend: FsspecBackend) -> None:
    assert s3_backend.list_dir("c") == []
    s3.put_object(Bucket=BUCKET, Key="root/c/a.txt", Body=b"1")
    assert s3_backend.list_dir("c") == ["a.txt"]
    assert s3_backend.exists("c/a.txt") and s3_backend.size("c/a.txt") == 1
    s3.put_object(Bucket=BUCKET, Key="root/c/a.txt", Body=b"123")
    s3.put_object(Bucket=BUCKET, Key="root/c/sub/b.txt", Body=b"1")
    assert s3_backend.size("c/a.txt") == 3
    assert s3_backend.list_dir("c") == ["a.txt", "sub/"]
    assert list(s3_backend.walk_files("c")) == ["c/a.txt", "c/sub/b.txt"]
    s3.delete_object(Bucket=BUCKET, Key="root/c/a.txt")
    assert s3_backend.list_dir("c") == ["sub/"]
    assert not s3_backend.exists("c/a.txt")
    assert list(s3_backend.walk_files("")) == ["c/sub/b.txt"]


def test_root_prefix_is_not_a_string_prefix(s3: Any, moto_endpoint: MotoEndpoint) -> None:
    s3.put_object(Bucket=BUCKET, Key="rootless/x.json", Body=b"1")
    s3.put_object(Bucket=BUCKET, Key="root/y.json", Body=b"1")
    backend = FsspecBackend(f"s3://{BUCKET}/root", endpoint_url=moto_endpoint.url)
    assert list(backend.walk_files()) == ["y.json"]
    assert backend.list_dir("") == ["y.json"]
    backend.close()


def test_capabilities(s3_backend: FsspecBackend) -> None:
    assert s3_backend.supports_conditional_create is True
    assert s3_backend.supports_directory_fsync is False
    assert s3_backend.block_size == 5 << 20


def test_the_backend_owns_its_filesystem(s3: Any, moto_endpoint: MotoEndpoint, s3_url: str) -> None:
    first = FsspecBackend(s3_url, endpoint_url=moto_endpoint.url)
    second = FsspecBackend(s3_url, endpoint_url=moto_endpoint.url)
    shared = fsspec.filesystem("s3", endpoint_url=moto_endpoint.url)
    assert first.fs is not second.fs and first.fs is not shared
    assert first.fs.dircache.use_listings_cache is False
    first.create_if_absent("x.json", b"1")
    first.close()
    first.close()
    assert second.read_bytes("x.json") == b"1"  # closing one never closes another's connections
    assert first.read_bytes("x.json") == b"1"  # and a closed backend reconnects if used again
    first.close()
    second.close()


def test_backends_share_one_session_per_process_unless_their_options_set_one(
    s3: Any, moto_endpoint: MotoEndpoint, s3_url: str
) -> None:
    """Two backends' filesystems and clients are their own; the botocore session (its parsed service model) is shared."""
    first = FsspecBackend(s3_url, endpoint_url=moto_endpoint.url, retries=2)
    second = FsspecBackend(s3_url, endpoint_url=moto_endpoint.url)
    assert first.fs is not second.fs
    assert first.fs.session is second.fs.session is shared_session()
    first.create_if_absent("x.json", b"1")
    first.close()
    assert second.read_bytes("x.json") == b"1"  # closing one backend's client leaves the other's
    second.close()
    own = aiobotocore.session.AioSession()
    third = FsspecBackend(s3_url, endpoint_url=moto_endpoint.url, session=own)  # the caller's session wins
    assert third.fs.session is own
    assert third.read_bytes("x.json") == b"1"
    third.close()


@pytest.mark.parametrize(
    ("roots", "options", "warmed"),
    [
        (["s3://bucket/run"], {}, ["s3"]),
        (["/data/ckpt", "s3a://bucket"], {}, ["s3"]),
        (None, {"endpoint_url": "http://127.0.0.1:9"}, ["s3"]),
        (["/data/ckpt"], {}, []),
        (["/data/ckpt"], {"endpoint_url": "http://127.0.0.1:9"}, []),
        (None, {}, []),
        (["gs://bucket"], {"key": "k"}, []),
    ],
)
def test_a_server_warms_the_s3_backend_when_its_settings_point_at_s3(
    roots: list[str] | None, options: dict[str, Any], warmed: list[str]
) -> None:
    assert warm_storage(roots, options) == warmed
    if warmed:
        assert "s3fs" in sys.modules and "aiobotocore.client" in sys.modules


def test_warming_never_fails_a_server(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> None:
        raise ImportError("no s3fs here")

    monkeypatch.setattr(s3_module, "warm_s3", broken)
    with caplog.at_level(logging.DEBUG, logger="gymckpt.store.warm"):
        assert warm_storage(["s3://bucket"], {}) == []
    assert "no s3fs here" in caplog.text


def test_default_block_size_and_string_options(s3: Any, s3_url: str, moto_endpoint: MotoEndpoint) -> None:
    backend = FsspecBackend(s3_url, endpoint_url=moto_endpoint.url)
    assert backend.block_size == DEFAULT_BLOCK_SIZE == 16 << 20
    backend.close()
    options = {"block_size": str(8 << 20), "upload_concurrency": "3", "retries": "2"}
    backend = FsspecBackend(s3_url, endpoint_url=moto_endpoint.url, **options)
    assert (backend.block_size, backend.upload_concurrency, backend.fs.retries) == (8 << 20, 3, 2)
    backend.close()


@pytest.mark.parametrize(
    "options",
    [{"block_size": 1 << 20}, {"block_size": "big"}, {"upload_concurrency": 0}, {"retries": 0}],
)
def test_invalid_options_are_refused(s3_url: str, options: dict[str, Any]) -> None:
    with pytest.raises(errors.UnsupportedStorage):
        FsspecBackend(s3_url, endpoint_url="http://127.0.0.1:9", **options)


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_endpoint_and_credentials_from_the_environment(
    s3: Any, s3_url: str, moto_endpoint: MotoEndpoint, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    monkeypatch.setenv(variable, moto_endpoint.url)
    if variable == "AWS_ENDPOINT_URL_S3":
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the S3-specific one wins
    with open_store(s3_url) as store:
        manifest = store.write_participant(
            "ck", kind="agent", instance="a", checkpoint_id="c", records=sample_records(3)
        )
        store.publish("ck", [manifest])
    assert verify(f"{s3_url}/ck").ok


def test_explicit_options_win_over_the_environment(
    s3: Any, s3_url: str, moto_endpoint: MotoEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    options = {"endpoint_url": moto_endpoint.url, "key": "k", "secret": "s", "region": "eu-west-1"}
    with open_store(s3_url, **options) as store:
        store.backend.create_if_absent("x.json", b"{}")
        assert store.backend.read_bytes("x.json") == b"{}"


# --- errors


def test_a_missing_bucket_cannot_hold_state(s3: Any, moto_endpoint: MotoEndpoint) -> None:
    store = open_store("s3://no-such-bucket/ck", endpoint_url=moto_endpoint.url, **FAST_OPTIONS)
    with pytest.raises(errors.UnusableDirectory) as raised:
        store.write_participant("c", kind="agent", instance="a", checkpoint_id="c", records=sample_records(2))
    assert "bucket does not exist" in str(raised.value)
    with pytest.raises(errors.StorageError):
        list(store.backend.walk_files())
    with pytest.raises(errors.StorageError):
        verify("s3://no-such-bucket/ck", endpoint_url=moto_endpoint.url)
    store.close()


def test_unreachable_endpoint_is_a_storage_error(s3_url: str) -> None:
    backend = FsspecBackend(s3_url, endpoint_url="http://127.0.0.1:9", retries=1)
    for call in (lambda: backend.read_bytes("x"), lambda: list(backend.walk_files()), lambda: backend.size("x")):
        with pytest.raises(errors.StorageError) as raised:
            call()
        assert raised.value.__cause__ is not None
    with pytest.raises(errors.StorageError):
        backend.create_if_absent("m.json", b"1")
    backend.close()


def test_access_denied_is_typed(s3: Any, s3_url: str, fault_proxy) -> None:
    from .fault_proxy import Fault

    backend = FsspecBackend(s3_url, endpoint_url=fault_proxy.url, **FAST_OPTIONS)
    fault_proxy.add(Fault("PUT", action="status", status=403, times=100))
    fault_proxy.add(Fault("GET", action="status", status=403, times=100))
    with pytest.raises(errors.UnusableDirectory, match="access denied"):
        backend.create_if_absent("m.json", b"1")
    with pytest.raises(errors.StorageError, match="access denied") as raised:
        backend.read_bytes("m.json")
    assert not isinstance(raised.value, errors.UnusableDirectory)
    backend.close()


def test_missing_objects_are_file_not_found(s3_backend: FsspecBackend) -> None:
    for call in (s3_backend.read_bytes, s3_backend.open_read, s3_backend.size):
        with pytest.raises(FileNotFoundError) as raised:
            call("nope/x.json")
        assert not isinstance(raised.value, errors.GymckptError)
    assert not s3_backend.exists("nope/x.json")
    s3_backend.delete("nope/x.json")


# --- filesystems without conditional create


def test_a_filesystem_without_conditional_create_is_refused(tmp_path) -> None:
    with pytest.raises(errors.UnsupportedStorage, match="conditional create"):
        open_store(f"local://{tmp_path}/store")


def test_the_unsafe_mode_works_and_says_so(tmp_path) -> None:
    backend = FsspecBackend(f"local://{tmp_path}/store", unsafe_allow_non_atomic_create="true")
    assert backend.supports_conditional_create is False
    assert "exists-then-write" in (FsspecBackend.create_if_absent.__doc__ or "")
    store = CheckpointStore(backend, chunk_size=1024)
    records = sample_records(20)
    manifest = store.write_participant("ck", kind="agent", instance="a", checkpoint_id="c", records=records)
    again = store.write_participant("ck", kind="agent", instance="a", checkpoint_id="c", records=records)
    assert again.raw == manifest.raw
    with pytest.raises(errors.ManifestConflict):
        store.write_participant("ck", kind="agent", instance="a", checkpoint_id="c", records=sample_records(3))
    store.publish("ck", [manifest])
    assert verify(str(tmp_path / "store")).findings == []
    assert sorted(p.name for p in (tmp_path / "store/ck/gym/agent/a").iterdir()) == [
        "manifest.json",
        manifest.records_file,
    ]
    document = json.loads((tmp_path / "store/ck/gym/checkpoint.json").read_bytes())
    assert document["participants"][0]["instance"] == "a"
    sink = backend.open_sink("ck/x")
    sink.write(b"partial")
    sink.abort()
    assert list((tmp_path / "store/ck/x").iterdir()) == []


def test_s3_only_options_are_refused_elsewhere(tmp_path) -> None:
    with pytest.raises(errors.UnsupportedStorage, match="apply to s3:// URLs only"):
        FsspecBackend(f"local://{tmp_path}", unsafe_allow_non_atomic_create=True, block_size=8 << 20)


def test_keys_that_cannot_be_read_back_are_not_listed(s3: Any, s3_backend: FsspecBackend) -> None:
    for key in ("root/c/ok.json", "root/c/../escape.json", "root/c/./dot.json", "root/c//double.json"):
        s3.put_object(Bucket=BUCKET, Key=key, Body=b"1")
    assert list(s3_backend.walk_files("c")) == ["c/ok.json"]
    assert s3_backend.list_dir("c") == ["ok.json"]
