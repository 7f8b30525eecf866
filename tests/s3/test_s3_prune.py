"""The collector's prune on S3 (no rename there): the index goes first, then the manifests, then the rest;
``verify`` of the root while it runs warns that the checkpoint vanished, never reports damage."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.collect.checkpoints import CheckpointRoot, new_checkpoint_id
from gymckpt.store import open_store, verify
from gymckpt.store._s3 import S3Backend

from ..support import prune_while_verifying
from .s3_support import BUCKET, all_keys

if TYPE_CHECKING:
    from gymckpt.testing.moto import MotoEndpoint

verify_module = importlib.import_module("gymckpt.store.verify")


@pytest.fixture
def three(s3: Any, s3_url: str, moto_endpoint: MotoEndpoint) -> list[str]:
    """Three published checkpoints under ``s3_url``, oldest first."""
    ids = sorted(new_checkpoint_id() for _ in range(3))
    with open_store(s3_url, endpoint_url=moto_endpoint.url) as store:
        for number, checkpoint_id in enumerate(ids):
            manifests = [
                store.write_participant(
                    checkpoint_id,
                    kind=kind,
                    instance="0",
                    checkpoint_id=checkpoint_id,
                    records=[{"episode_id": f"{n}-0"} for n in range(5)],
                )
                for kind in ("environment", "agent")
            ]
            store.publish(checkpoint_id, manifests, extra={"run_id": "r", "created_at": 1000.0 + number})
    return ids


def test_prune_deletes_the_index_first_then_the_manifests(
    s3: Any, s3_url: str, moto_endpoint: MotoEndpoint, three: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    deleted: list[str] = []
    delete = S3Backend.delete

    def watched(self: S3Backend, path: str) -> None:
        deleted.append(path)
        delete(self, path)

    monkeypatch.setattr(S3Backend, "delete", watched)
    odd = [
        f"root/{three[0]}/gym//environment/0/manifest.json",
        f"root/{three[0]}/gym/../../{three[1]}/gym/checkpoint.json",
    ]
    for key in odd:  # keys no path names: a path delete would miss them (or, normalized, hit another object)
        s3.put_object(Bucket=BUCKET, Key=key, Body=b"{}")
    kept = all_keys(s3, f"root/{three[1]}/")
    root = CheckpointRoot(s3_url, {"endpoint_url": moto_endpoint.url})
    assert root.prune(2, current=three[-1]) == [three[0]]
    root.close()
    kinds = [path.rpartition("/")[2].split("-")[0] for path in deleted if path.startswith(f"{three[0]}/")]
    assert kinds[0] == "checkpoint.json"  # unpublished in one request
    assert kinds[1:3] == ["manifest.json", "manifest.json"]  # then every participant an unfinished commit
    assert all_keys(s3, f"root/{three[0]}/") == []  # the odd keys too
    assert all_keys(s3, f"root/{three[1]}/") == kept  # and nothing the odd keys' paths would name


@pytest.mark.parametrize("when", ["read_index_file", "read_manifest_file", "iter_manifest_records"])
def test_verify_of_the_root_while_collect_prunes_warns(
    s3: Any, s3_url: str, moto_endpoint: MotoEndpoint, three: list[str], monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    root = CheckpointRoot(s3_url, {"endpoint_url": moto_endpoint.url})
    pruned = prune_while_verifying(monkeypatch, verify_module, when, root, three[0], three[-1])
    report = verify(s3_url, endpoint_url=moto_endpoint.url)
    root.close()
    assert pruned == [three[0]]
    assert report.ok, report.findings
    assert [(f.checkpoint, f.code, str(f.severity)) for f in report.findings] == [
        (three[0], "checkpoint_vanished", "warning")
    ]


def test_verify_between_the_index_and_the_rest_sees_an_unpublished_checkpoint(
    s3: Any, s3_url: str, moto_endpoint: MotoEndpoint, three: list[str]
) -> None:
    """A prune stopped after its first request (a crash): warnings only, and no resume picks it."""
    s3.delete_object(Bucket=BUCKET, Key=f"root/{three[0]}/gym/checkpoint.json")
    report = verify(s3_url, endpoint_url=moto_endpoint.url)
    assert report.ok
    assert {(f.checkpoint, f.code) for f in report.findings} == {(three[0], "checkpoint_unpublished")}
    root = CheckpointRoot(s3_url, {"endpoint_url": moto_endpoint.url})
    assert [item.checkpoint_id for item in root.published()] == three[1:]
    assert root.prune(2, current=three[-1]) == [three[0]]
    root.close()
