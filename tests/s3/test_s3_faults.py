"""Commits through a fault-injecting proxy: every outcome is a verified checkpoint or a typed error.

Targets: the records file's CreateMultipartUpload, one UploadPart, its
CompleteMultipartUpload, its server-side copy to the digest name, and the manifest's
conditional PUT (a records file smaller than a part is PUT directly: tested apart). Faults: a 500 or 503 reply without forwarding, a dropped
connection without forwarding, and a forwarded request whose response is dropped (the
server applied it, the client never learns it).
"""

from __future__ import annotations

import hashlib
import json
import threading
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt import errors
from gymckpt.store import open_store, verify

from .fault_proxy import Fault
from .s3_support import BUCKET, all_keys, open_uploads

if TYPE_CHECKING:
    from gymckpt.testing.moto import MotoEndpoint

    from .fault_proxy import FaultProxy

#: 5 MiB parts (S3's minimum) and bounded retries keep every case short
OPTIONS: dict[str, Any] = {
    "block_size": 5 << 20,
    "single_put_bytes": 5 << 20,
    "retries": 3,
    "config_kwargs": {"connect_timeout": 2, "read_timeout": 10},
}

TARGETS: dict[str, dict[str, Any]] = {
    "create_upload": {"method": "POST", "path": r"/\.gymckpt-tmp-", "query": ("uploads",)},
    # the second (last) part, so the upload is under way when it fails
    "upload_part": {"method": "PUT", "path": r"/\.gymckpt-tmp-", "query": ("partNumber", "uploadId"), "skip": 1},
    "complete_upload": {"method": "POST", "path": r"/\.gymckpt-tmp-", "query": ("uploadId",)},
    "copy_records": {"method": "PUT", "path": r"/records-[0-9a-f]{64}\.jsonl$", "header": "x-amz-copy-source"},
    "manifest_create": {"method": "PUT", "path": r"/manifest\.json$", "header": "If-None-Match"},
}
FAULTS: dict[str, dict[str, Any]] = {
    "reply_500": {"action": "status", "status": 500},
    "reply_503": {"action": "status", "status": 503},
    "drop_request": {"action": "drop"},
    "drop_response": {"action": "drop_response"},
}


@pytest.fixture(autouse=True)
def short_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore waits up to 1 s, 2 s… before a retry; what is retried matters here, not how long it waits."""
    from botocore.retries.standard import ExponentialBackoff

    monkeypatch.setattr(ExponentialBackoff, "delay_amount", lambda self, context: 0.01)


def _records(count: int = 20, *, prefix: str = "e") -> list[dict[str, Any]]:
    """About 6 MB: a 5 MiB part and a last, smaller one."""
    return [{"episode_id": f"{prefix}{index}", "blob": f"{index:08d}" * 37_500} for index in range(count)]


def assert_consistent(client: Any) -> None:
    """No manifest without its records (whose bytes hash to its name), no temporary objects, no uploads."""
    keys = all_keys(client)
    for key in keys:
        if key.endswith("/manifest.json"):
            manifest = json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
            records_key = f"{key.rpartition('/')[0]}/{manifest['records_file']}"
            assert records_key in keys, f"{key} names a missing records file"
            data = client.get_object(Bucket=BUCKET, Key=records_key)["Body"].read()
            assert hashlib.sha256(data).hexdigest() == manifest["records_sha256"]
    assert not [key for key in keys if ".gymckpt-tmp-" in key], keys
    assert open_uploads(client) == []


def _commit(url: str, endpoint: str, records: list[dict[str, Any]], **options: Any) -> Any:
    with open_store(url, endpoint_url=endpoint, **{**OPTIONS, **options}) as store:
        manifest = store.write_participant("ck", kind="agent", instance="a0", checkpoint_id="ck", records=records)
        store.publish("ck", [manifest])
        return manifest


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_a_single_fault_is_retried_and_the_checkpoint_verifies(
    s3: Any, s3_url: str, moto_endpoint: MotoEndpoint, fault_proxy: FaultProxy, target: str, fault: str
) -> None:
    armed = fault_proxy.add(Fault(**TARGETS[target], **FAULTS[fault], times=1))
    manifest = _commit(s3_url, fault_proxy.url, _records())
    assert armed.fired == 1, "the fault never hit its request"
    report = verify(s3_url, endpoint_url=moto_endpoint.url)
    assert report.ok and report.findings == [], report.findings
    assert report.records_checked == manifest.record_count == 20
    assert_consistent(s3)
    if target == "manifest_create" and fault == "drop_response":
        # applied, answer lost: the retry met 412, read the manifest back, found our bytes
        attempts = [entry for entry in fault_proxy.requests("PUT") if entry.path.endswith("/manifest.json")]
        assert [entry.status for entry in attempts] == [200, 412]


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_a_lasting_fault_fails_typed_or_resolves(
    s3: Any, s3_url: str, moto_endpoint: MotoEndpoint, fault_proxy: FaultProxy, target: str, fault: str
) -> None:
    armed = fault_proxy.add(Fault(**TARGETS[target], **FAULTS[fault], times=1000))
    try:
        _commit(s3_url, fault_proxy.url, _records(), retries=2)
    except errors.GymckptError as exc:
        assert isinstance(exc, errors.StorageError), repr(exc)
        outcome = "failed"
    else:
        outcome = "committed"
    assert armed.fired >= 1
    assert_consistent(s3)
    if fault == "drop_response" and target in {"complete_upload", "copy_records", "manifest_create"}:
        # the server applied the request every time: reading back shows it, so the commit stands
        assert outcome == "committed"
    else:
        assert outcome == "failed"
    manifests = [key for key in all_keys(s3) if key.endswith("/manifest.json")]
    if outcome == "committed":
        assert verify(s3_url, endpoint_url=moto_endpoint.url).findings == []
    elif target == "manifest_create":
        # the records were published, the manifest never: harmless leftovers, reported as such
        assert manifests == []
        report = verify(s3_url, endpoint_url=moto_endpoint.url)
        assert report.ok and sorted(finding.code for finding in report.findings) == [
            "checkpoint_unpublished",
            "orphaned_records",
            "unfinished_commit",
        ]
    else:
        assert all_keys(s3) == []


def test_racing_writers_through_faults_leave_one_manifest_that_verifies(
    s3: Any, s3_url: str, moto_endpoint: MotoEndpoint, fault_proxy: FaultProxy
) -> None:
    # the first manifest PUT to reach the server is applied but its writer never hears back
    armed = fault_proxy.add(Fault(**TARGETS["manifest_create"], action="drop_response", times=1))
    barrier = threading.Barrier(2)
    outcomes: list[object] = []

    def commit(prefix: str) -> None:
        records = _records(12, prefix=prefix)
        with open_store(s3_url, endpoint_url=fault_proxy.url, **OPTIONS) as store:
            barrier.wait(timeout=30)
            try:
                outcomes.append(
                    store.write_participant("ck", kind="agent", instance="a0", checkpoint_id="ck", records=records)
                )
            except errors.GymckptError as exc:
                outcomes.append(exc)

    threads = [threading.Thread(target=commit, args=(prefix,)) for prefix in ("left-", "right-")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert armed.fired == 1
    winners = [outcome for outcome in outcomes if not isinstance(outcome, Exception)]
    losers = [outcome for outcome in outcomes if isinstance(outcome, Exception)]
    assert len(winners) == 1 and len(losers) == 1, outcomes
    assert isinstance(losers[0], errors.ManifestConflict)
    winner: Any = winners[0]
    assert all_keys(s3) == sorted([f"root/{winner.path}", f"root/{winner.records_path}"])
    assert_consistent(s3)
    with open_store(s3_url, endpoint_url=moto_endpoint.url) as store:
        store.publish("ck", [winner])
    assert verify(s3_url, endpoint_url=moto_endpoint.url).findings == []


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_faults_on_the_direct_put_of_a_small_records_file(
    s3: Any, s3_url: str, moto_endpoint: MotoEndpoint, fault_proxy: FaultProxy, fault: str
) -> None:
    small = _records(3)  # less than one part: PUT straight under the digest name, no temporary object
    target = {"method": "PUT", "path": r"/records-[0-9a-f]{64}\.jsonl$"}
    once = fault_proxy.add(Fault(**target, **FAULTS[fault], times=1))
    _commit(s3_url, fault_proxy.url, small)
    assert once.fired == 1
    assert verify(s3_url, endpoint_url=moto_endpoint.url).findings == []
    assert not fault_proxy.requests("POST", query="uploads")
    assert_consistent(s3)

    moto_endpoint.reset()
    s3.create_bucket(Bucket=BUCKET)
    fault_proxy.add(Fault(**target, **FAULTS[fault], times=1000))
    try:
        _commit(s3_url, fault_proxy.url, small, retries=2)
    except errors.StorageError:
        assert fault != "drop_response"
        assert all_keys(s3) == []
    else:
        assert fault == "drop_response"  # applied every time, answer lost: reading back shows it whole
        assert verify(s3_url, endpoint_url=moto_endpoint.url).findings == []
    assert_consistent(s3)
