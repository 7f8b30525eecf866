"""Helpers shared by the S3 tests."""

from __future__ import annotations

from typing import Any

BUCKET = "gymckpt-tests"
#: a small part size keeps multipart tests fast; retries bounded so failures end quickly
FAST_OPTIONS: dict[str, Any] = {
    "block_size": 5 << 20,
    "single_put_bytes": 5 << 20,
    "retries": 3,
    "config_kwargs": {"connect_timeout": 2},
}


def all_keys(client: Any, prefix: str = "") -> list[str]:
    """Every object key in the test bucket under ``prefix`` (boto3, not s3fs)."""
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys.extend(item["Key"] for item in page.get("Contents", []))
    return sorted(keys)


def open_uploads(client: Any) -> list[dict[str, Any]]:
    """Multipart uploads started and neither completed nor aborted."""
    return list(client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []))
