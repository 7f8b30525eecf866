"""``gymckpt verify``, ``inspect`` and ``demo --store s3`` as a user runs them: subprocesses, exit codes 0/1/2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.store import open_store
from gymckpt.testing.values import sample_records

from .s3_support import BUCKET

if TYPE_CHECKING:
    from gymckpt.testing.moto import MotoEndpoint


def gymckpt(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gymckpt", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        check=False,
    )


@pytest.fixture
def checkpoint(s3: Any, s3_url: str, moto_endpoint: MotoEndpoint) -> dict[str, Any]:
    with open_store(s3_url, endpoint_url=moto_endpoint.url) as store:
        manifests = [
            store.write_participant("ck", kind=kind, instance="0", checkpoint_id="ck", records=sample_records(8))
            for kind in ("environment", "agent")
        ]
        store.publish("ck", manifests)
    return {"url": f"{s3_url}/ck", "manifests": manifests}


def test_verify_clean_then_damaged(s3: Any, checkpoint: dict[str, Any], moto_endpoint: MotoEndpoint) -> None:
    clean = gymckpt("verify", checkpoint["url"], "--endpoint-url", moto_endpoint.url)
    assert clean.returncode == 0, clean.stderr
    assert "OK" in clean.stdout and "16 records re-read" in clean.stdout

    records_key = f"root/{checkpoint['manifests'][0].records_path}"
    data = s3.get_object(Bucket=BUCKET, Key=records_key)["Body"].read()
    s3.put_object(Bucket=BUCKET, Key=records_key, Body=data[:10] + bytes([data[10] ^ 1]) + data[11:])
    damaged = gymckpt("verify", checkpoint["url"], "--endpoint-url", moto_endpoint.url, "--json")
    assert damaged.returncode == 1, damaged.stderr
    report = json.loads(damaged.stdout)
    assert not report["ok"]
    assert [(finding["code"], finding["path"]) for finding in report["findings"]] == [
        ("records_digest_mismatch", checkpoint["manifests"][0].records_path.removeprefix("ck/"))
    ]  # paths are relative to the URL verified
    quick = gymckpt("verify", checkpoint["url"], "--endpoint-url", moto_endpoint.url, "--quick")
    assert quick.returncode == 0, quick.stdout  # sizes only: a flipped byte keeps the size


def test_endpoint_and_options_from_environment_and_flags(
    checkpoint: dict[str, Any], moto_endpoint: MotoEndpoint
) -> None:
    from_env = gymckpt("verify", checkpoint["url"], "--json", env={"AWS_ENDPOINT_URL": moto_endpoint.url})
    assert from_env.returncode == 0, from_env.stderr
    assert json.loads(from_env.stdout)["records_checked"] == 16
    with_options = gymckpt(
        "verify",
        checkpoint["url"],
        "--endpoint-url",
        moto_endpoint.url,
        "-o",
        "retries=2",
        "-o",
        f"block_size={8 << 20}",
        "-o",
        f"key={os.environ['AWS_ACCESS_KEY_ID']}",
        "-o",
        f"secret={os.environ['AWS_SECRET_ACCESS_KEY']}",
    )
    assert with_options.returncode == 0, with_options.stderr
    half = gymckpt("verify", checkpoint["url"], "--endpoint-url", moto_endpoint.url, "-o", "key=AKIA-only")
    assert half.returncode == 2
    assert "credentials missing or rejected" in half.stderr


@pytest.mark.parametrize(
    ("url", "endpoint"),
    [
        (f"s3://{BUCKET}/root/ck", "http://127.0.0.1:9"),  # nobody listens
        ("s3://no-such-bucket/ck", None),
        (f"s3://{BUCKET}/nothing-here", None),
    ],
    ids=["unreachable", "missing_bucket", "no_checkpoint"],
)
def test_unusable_storage_exits_2(
    checkpoint: dict[str, Any], moto_endpoint: MotoEndpoint, url: str, endpoint: str | None
) -> None:
    result = gymckpt("verify", url, "--endpoint-url", endpoint or moto_endpoint.url, "-o", "retries=1")
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "error:" in result.stderr


def test_inspect_lists_and_dumps(checkpoint: dict[str, Any], moto_endpoint: MotoEndpoint) -> None:
    listing = gymckpt("inspect", checkpoint["url"], "--endpoint-url", moto_endpoint.url, "--json")
    assert listing.returncode == 0, listing.stderr
    rows = json.loads(listing.stdout)
    assert [(row["participant"], row["record_count"]) for row in rows] == [("agent/0", 8), ("environment/0", 8)]
    dump = gymckpt(
        "inspect", checkpoint["url"], "--endpoint-url", moto_endpoint.url, "--dump", "agent/0", "--episode", "r0"
    )
    assert dump.returncode == 0, dump.stderr
    lines = dump.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith('{"episode_id":"r0"')


def test_demo_with_an_embedded_s3_endpoint() -> None:
    result = gymckpt("demo", "--store-only", "--store", "s3", "--episodes", "16")
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert "embedded S3 endpoint (moto) at http://127.0.0.1:" in result.stdout
    assert "s3://gymckpt-demo/checkpoints" in result.stdout
    assert "verify: OK (0 errors, 0 warnings" in result.stdout
    assert "identical to what was committed" in result.stdout


def test_an_unknown_storage_option_exits_2_with_one_line(
    checkpoint: dict[str, Any], moto_endpoint: MotoEndpoint
) -> None:
    for command in ("verify", "inspect"):
        result = gymckpt(command, checkpoint["url"], "--endpoint-url", moto_endpoint.url, "-o", "no_such_option=1")
        assert result.returncode == 2, (result.stdout, result.stderr)
        assert "Traceback" not in result.stderr
        (line,) = result.stderr.splitlines()
        assert line.startswith(f"error: cannot read {checkpoint['url']}: ")
        assert "no_such_option" in line


@pytest.mark.parametrize("command", ["verify", "inspect"])
@pytest.mark.parametrize(
    ("url", "endpoint", "code"),
    [
        (f"s3://{BUCKET}/root/ck", "http://127.0.0.1:9", "storage_error"),  # nobody listens
        ("s3://no-such-bucket/ck", None, "storage_error"),
        (f"s3://{BUCKET}/nothing-here", None, "checkpoint_not_found"),
    ],
    ids=["unreachable", "missing_bucket", "no_checkpoint"],
)
def test_unusable_storage_with_json_writes_an_error_object(
    checkpoint: dict[str, Any], moto_endpoint: MotoEndpoint, command: str, url: str, endpoint: str | None, code: str
) -> None:
    result = gymckpt(command, url, "--endpoint-url", endpoint or moto_endpoint.url, "-o", "retries=1", "--json")
    assert result.returncode == 2, (result.stdout, result.stderr)
    error = json.loads(result.stdout)["error"]
    assert error["code"] == code, error
    assert result.stderr.splitlines() == [f"error: {error['detail']}"]
