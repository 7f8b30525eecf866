"""Load a storage backend's machinery when a server starts, not in its first commit or restore.

A server that checkpoints to S3 would otherwise import s3fs, aiobotocore and botocore and
parse S3's service model inside its first commit: about 0.3 s of CPU and 25 MiB, paid by
every server process at once, on the checkpoint's critical path. :func:`warm_storage` does it
at startup when the server's checkpoint settings point at S3; nothing is contacted, and a
failure is logged, never raised (the first commit then reports it).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

__all__ = ["S3_HINT_OPTIONS", "warm_storage"]

logger = logging.getLogger(__name__)

#: storage options that only an S3 store takes: without allowed roots (which decide), they point at S3
S3_HINT_OPTIONS = frozenset({"endpoint_url", "key", "secret", "region", "block_size", "upload_concurrency"})
_S3_SCHEMES = frozenset({"s3", "s3a"})


def _points_at_s3(allowed_roots: Iterable[str] | None, storage_options: Mapping[str, Any]) -> bool:
    roots = list(allowed_roots or ())
    if roots:
        return any("://" in root and root.split("://", 1)[0].lower() in _S3_SCHEMES for root in roots)
    return bool(S3_HINT_OPTIONS & set(storage_options))


def warm_storage(allowed_roots: Iterable[str] | None, storage_options: Mapping[str, Any]) -> list[str]:
    """Warm the backends these settings point at; returns the ones warmed (``["s3"]`` or none)."""
    if not _points_at_s3(allowed_roots, storage_options):
        return []
    try:
        from gymckpt.store._s3 import warm_s3

        warm_s3()
    except Exception as exc:  # a missing package or a broken install: the first commit says so
        logger.debug("could not load the S3 backend ahead of the first checkpoint: %s", exc)
        return []
    return ["s3"]
