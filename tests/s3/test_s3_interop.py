"""What gymckpt writes to S3 is plain objects any client reads, and the other way round."""

from __future__ import annotations

import hashlib
import json
import re
from typing import TYPE_CHECKING, Any

from gymckpt.store import open_store, verify
from gymckpt.testing.values import same_records, sample_records

from .s3_support import BUCKET, FAST_OPTIONS, all_keys

if TYPE_CHECKING:
    from pathlib import Path

    from gymckpt.testing.moto import MotoEndpoint

RECORDS_KEY = re.compile(r"^(?P<directory>.+)/records-(?P<digest>[0-9a-f]{64})\.jsonl$")


def _write_checkpoint(url: str, **options: Any) -> list[Any]:
    with open_store(url, **options) as store:
        manifests = [
            store.write_participant(
                "ck-1", kind="environment", instance="env-0", checkpoint_id="ck-1", records=sample_records(30)
            ),
            store.write_participant(
                "ck-1",
                kind="model",
                instance="model-0",
                checkpoint_id="ck-1",
                # about 10 MB: a multipart upload
                records=({"episode_id": f"m{i}", "tokens": list(range(i, i + 40_000))} for i in range(40)),
            ),
        ]
        store.publish("ck-1", manifests, extra={"trainer_step": 3})
    return manifests


def test_boto3_reads_what_gymckpt_wrote(s3: Any, s3_url: str, moto_endpoint: MotoEndpoint) -> None:
    _write_checkpoint(s3_url, endpoint_url=moto_endpoint.url, **FAST_OPTIONS)
    keys = all_keys(s3)
    records_keys = [key for key in keys if RECORDS_KEY.match(key)]
    assert len(records_keys) == 2
    named = set()
    for key in records_keys:
        match = RECORDS_KEY.match(key)
        assert match is not None
        data = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        assert hashlib.sha256(data).hexdigest() == match["digest"]  # sha256sum agrees with the name
        manifest_key = f"{match['directory']}/manifest.json"
        raw_manifest = s3.get_object(Bucket=BUCKET, Key=manifest_key)["Body"].read()
        manifest = json.loads(raw_manifest)
        assert manifest["records_file"] == key.rpartition("/")[2]
        assert manifest["records_sha256"] == match["digest"]
        assert manifest["records_bytes"] == len(data)
        assert manifest["record_count"] == data.count(b"\n")
        named.add((manifest_key, hashlib.sha256(raw_manifest).hexdigest()))
    index = json.loads(s3.get_object(Bucket=BUCKET, Key="root/ck-1/gym/checkpoint.json")["Body"].read())
    listed = {(f"root/ck-1/{entry['manifest']}", entry["manifest_sha256"]) for entry in index["participants"]}
    assert listed == named
    assert sorted(keys) == sorted([*records_keys, *(key for key, _ in named), "root/ck-1/gym/checkpoint.json"])


def test_a_local_checkpoint_copied_with_boto3_verifies_on_s3(
    s3: Any, tmp_path: Path, moto_endpoint: MotoEndpoint
) -> None:
    local_root = tmp_path / "local"
    manifests = _write_checkpoint(str(local_root))
    for path in sorted(local_root.rglob("*")):
        if path.is_file():
            s3.put_object(Bucket=BUCKET, Key=f"copied/{path.relative_to(local_root)}", Body=path.read_bytes())
    report = verify(f"s3://{BUCKET}/copied/ck-1", endpoint_url=moto_endpoint.url)
    assert report.ok and report.findings == []
    assert report.records_checked == sum(manifest.record_count for manifest in manifests)
    with open_store(f"s3://{BUCKET}/copied", endpoint_url=moto_endpoint.url) as store:
        restored = list(store.read_participant("ck-1", kind="environment", instance="env-0"))
    assert same_records(restored, sample_records(30))


def test_an_s3_checkpoint_downloaded_with_boto3_verifies_locally(
    s3: Any, s3_url: str, tmp_path: Path, moto_endpoint: MotoEndpoint
) -> None:
    _write_checkpoint(s3_url, endpoint_url=moto_endpoint.url, **FAST_OPTIONS)
    for key in all_keys(s3, "root/"):
        target = tmp_path / "downloaded" / key.removeprefix("root/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    report = verify(str(tmp_path / "downloaded"))
    assert report.ok and report.findings == []
    assert report.checkpoints == ["ck-1"]
