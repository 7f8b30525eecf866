"""S3 fixtures: the session's moto server (``moto_endpoint``, tests/conftest.py), reset before every test."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.store._fsspec import FsspecBackend
from gymckpt.testing.moto import DUMMY_KEY, DUMMY_SECRET

from .fault_proxy import FaultProxy
from .s3_support import BUCKET, FAST_OPTIONS

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from gymckpt.testing.moto import MotoEndpoint


@pytest.fixture(autouse=True)
def aws_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Dummy credentials, and nothing of the developer's AWS configuration."""
    for name in (
        "AWS_PROFILE",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_REGION",
        "GYMCKPT_ENDPOINT_URL",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", DUMMY_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", DUMMY_SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def s3(moto_endpoint: MotoEndpoint, aws_environment: None) -> Any:
    """A boto3 client on an empty endpoint holding one empty bucket, :data:`BUCKET`."""
    moto_endpoint.reset()
    client = moto_endpoint.client()
    client.create_bucket(Bucket=BUCKET)
    return client


@pytest.fixture
def s3_url(s3: Any) -> str:
    """The store root used by most tests."""
    return f"s3://{BUCKET}/root"


@pytest.fixture
def s3_backend(s3: Any, s3_url: str, moto_endpoint: MotoEndpoint) -> Iterator[FsspecBackend]:
    backend = FsspecBackend(s3_url, endpoint_url=moto_endpoint.url, **FAST_OPTIONS)
    try:
        yield backend
    finally:
        backend.close()


@pytest.fixture
def fault_proxy(moto_endpoint: MotoEndpoint, s3: Any) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of the moto server (forwards everything until told)."""
    with FaultProxy(moto_endpoint.url) as proxy:
        yield proxy
