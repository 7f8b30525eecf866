"""Object keys no path names (``gym//x``, ``gym/./x``, ``gym/../x``), written with raw boto3 calls: verify
reports every one, an error where a tool that maps keys to paths would read it as checkpoint state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.store import open_store, verify
from gymckpt.store.listing import list_checkpoints
from gymckpt.testing.values import sample_records

from .s3_support import BUCKET

if TYPE_CHECKING:
    from gymckpt.store._fsspec import FsspecBackend
    from gymckpt.store.manifest import Manifest
    from gymckpt.testing.moto import MotoEndpoint


@pytest.fixture
def published(s3: Any, s3_url: str, moto_endpoint: MotoEndpoint) -> list[Manifest]:
    with open_store(s3_url, endpoint_url=moto_endpoint.url) as store:
        manifests = [
            store.write_participant("ck", kind=kind, instance="0", checkpoint_id="ck", records=sample_records(4))
            for kind in ("environment", "agent")
        ]
        store.publish("ck", manifests)
    return manifests


def odd_keys(published: list[Manifest]) -> dict[str, tuple[str, str]]:
    """Key below the root → (severity, what a tool that normalizes keys reads it as)."""
    environment = published[0]
    return {
        "ck/gym//environment/0/manifest.json": ("error", environment.path),
        f"ck/gym/environment/0/./{environment.records_file}": ("error", environment.records_path),
        "ck/gym/../gym/checkpoint.json": ("error", "ck/gym/checkpoint.json"),
        "/ck/gym/notes": ("error", "/ck/gym/notes"),  # "root//ck/…": a leading slash leaves the root
        "ck/gym/./notes": ("warning", "ck/gym/notes"),
        "ck/gym/environment/0/..": ("warning", "ck/gym/environment"),
        "ck/gym/spare//": ("warning", "ck/gym/spare"),
    }


def put_odd_keys(s3: Any, keys: dict[str, tuple[str, str]]) -> None:
    for key in keys:
        s3.put_object(Bucket=BUCKET, Key=f"root/{key}", Body=b'{"not": "state"}')


def test_verify_reports_every_key_no_path_names(
    s3: Any, s3_url: str, moto_endpoint: MotoEndpoint, published: list[Manifest]
) -> None:
    keys = odd_keys(published)
    put_odd_keys(s3, keys)
    report = verify(s3_url, endpoint_url=moto_endpoint.url)
    found = {finding.path: finding for finding in report.findings}
    assert sorted(found) == sorted(keys)
    for key, (severity, normalized) in keys.items():
        finding = found[key]
        assert (finding.code, str(finding.severity), finding.checkpoint) == ("unaddressable_key", severity, "ck")
        assert normalized in finding.detail and repr(key) in finding.fix
    assert not report.ok
    assert report.records_checked == 8  # the checkpoint itself was checked as ever


def test_a_key_that_lands_on_nothing_of_a_checkpoint_is_a_warning(
    s3: Any, s3_url: str, moto_endpoint: MotoEndpoint, published: list[Manifest]
) -> None:
    put_odd_keys(s3, {"ck/gym/./notes": ("warning", "")})
    report = verify(s3_url, endpoint_url=moto_endpoint.url)
    assert report.ok
    assert [(f.code, str(f.severity), f.path) for f in report.findings] == [
        ("unaddressable_key", "warning", "ck/gym/./notes")
    ]


def test_the_listing_names_odd_keys_and_readers_skip_them(
    s3: Any, s3_backend: FsspecBackend, published: list[Manifest]
) -> None:
    keys = odd_keys(published)
    put_odd_keys(s3, keys)
    listed = dict(s3_backend.walk_keys(""))
    assert {key for key, addressable in listed.items() if not addressable} == set(keys)
    assert sorted(s3_backend.walk_files("")) == sorted(key for key, addressable in listed.items() if addressable)
    (layout,) = list_checkpoints(s3_backend).values()  # inspect's view: the checkpoint, its two participants
    assert sorted(layout.participants) == [("agent", "0"), ("environment", "0")]


def test_the_command_exits_1_and_names_each_key(
    s3: Any, s3_url: str, moto_endpoint: MotoEndpoint, published: list[Manifest]
) -> None:
    keys = odd_keys(published)
    put_odd_keys(s3, keys)
    command = [sys.executable, "-m", "gymckpt", "verify", s3_url, "--endpoint-url", moto_endpoint.url]
    environment = {**os.environ, "COLUMNS": "200"}
    as_json = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=120, env=environment)
    assert as_json.returncode == 1, as_json.stderr
    report = json.loads(as_json.stdout)
    assert sorted(f["path"] for f in report["findings"] if f["code"] == "unaddressable_key") == sorted(keys)
    human = subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment)
    assert human.returncode == 1, human.stderr
    lines = [line for line in human.stdout.splitlines() if "unaddressable_key" in line]
    assert sorted(line.split("\t")[3] for line in lines) == sorted(keys)
    assert "skipping" not in human.stderr  # reported, not logged away
