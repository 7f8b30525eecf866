"""The checkpoint store: streaming records, manifest-last publication, offline verification.

The center of gymckpt; it imports nothing from the layers above it.
"""

from gymckpt.store._local import LocalBackend
from gymckpt.store.backend import BlobSink, StorageBackend
from gymckpt.store.checkpoint_store import CheckpointStore, backend_for_url, open_store
from gymckpt.store.encoded import EncodedRecord, encoded
from gymckpt.store.manifest import Manifest
from gymckpt.store.publication import CheckpointIndex
from gymckpt.store.records import WriteStop
from gymckpt.store.verify import Finding, NoCheckpointFound, Severity, VerifyReport, verify

__all__ = [
    "BlobSink",
    "CheckpointIndex",
    "CheckpointStore",
    "EncodedRecord",
    "Finding",
    "LocalBackend",
    "Manifest",
    "NoCheckpointFound",
    "Severity",
    "StorageBackend",
    "VerifyReport",
    "WriteStop",
    "backend_for_url",
    "encoded",
    "open_store",
    "verify",
]
