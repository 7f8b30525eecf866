"""What an attack row works with: a published checkpoint and the backend suite's raw hooks.

The rows themselves are in :mod:`gymckpt.testing.attacks.store`; this is the context they damage a
checkpoint through, bypassing the backend under test.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import stat
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gymckpt.store.checkpoint_store import CheckpointStore

if TYPE_CHECKING:
    from collections.abc import Callable

    from gymckpt.store.backend import StorageBackend
    from gymckpt.store.manifest import Manifest

__all__ = ["AttackContext", "Expected"]

#: (finding code, "error" or "warning", path)
Expected = tuple[str, str, str]


@dataclass
class AttackContext:
    """The published checkpoint a row damages, and the suite's raw hooks."""

    suite: Any
    backend: StorageBackend
    env: Manifest
    agent: Manifest
    #: a directory outside the store's root (POSIX filesystems only)
    outside: str | None
    index: str = "ck/gym/checkpoint.json"
    #: sizes the storage reports instead of the real ones (a file that grows after it was measured)
    size_override: dict[str, int] = field(default_factory=dict)
    #: most bytes a read of a path may take
    read_bounds: dict[str, int] = field(default_factory=dict)
    #: records a benign row expects back
    expect_records: list[dict[str, Any]] | None = None
    #: the parse budget the reads run under (None: the documented one), so a small document can pass it
    document_budget: int | None = None

    # raw access, bypassing the backend under test
    def read(self, path: str) -> bytes:
        return self.suite.raw_read(self.backend, path)

    def write(self, path: str, data: bytes) -> None:
        self.suite.raw_write(self.backend, path, data)

    def delete(self, path: str) -> None:
        self.suite.raw_delete(self.backend, path)

    def real(self, path: str) -> str:
        """The OS path of a store-relative path (POSIX filesystems only)."""
        return os.path.join(self.backend.root, path)  # type: ignore[attr-defined]

    def document(self, path: str) -> dict[str, Any]:
        return json.loads(self.read(path))

    def lines(self, manifest: Manifest | None = None) -> list[bytes]:
        return self.read((manifest or self.env).records_path).split(b"\n")[:-1]

    def write_document(self, path: str, document: dict[str, Any], *, resync: bool = True) -> None:
        self.write(path, json.dumps(document, indent=2).encode() + b"\n")
        if resync:
            self.resync_index()

    def resync_index(self) -> None:
        """Make the index's digests match the manifests as they are now (a consistent writer)."""
        document = self.document(self.index)
        for entry in document["participants"]:
            path = f"ck/{entry['manifest']}"
            try:
                entry["manifest_sha256"] = hashlib.sha256(self.read(path)).hexdigest()
            except (FileNotFoundError, KeyError, OSError):
                continue
        self.write(self.index, json.dumps(document, indent=2).encode() + b"\n")

    def rewrite_records(
        self,
        data: bytes,
        *,
        count: int | None = None,
        episode_ids: list[str] | None = None,
        manifest: Manifest | None = None,
    ) -> str:
        """Replace a participant's records with ``data`` and make its manifest (and the index) agree."""
        manifest = manifest or self.env
        digest = hashlib.sha256(data).hexdigest()
        path = f"{manifest.directory}/records-{digest}.jsonl"
        self.delete(manifest.records_path)
        self.write(path, data)
        document = self.document(manifest.path)
        document.update(records_file=f"records-{digest}.jsonl", records_sha256=digest, records_bytes=len(data))
        if "max_record_bytes" in document:  # a consistent writer measures its longest line too
            lines = data.split(b"\n")
            document["max_record_bytes"] = max(
                (len(line) + 1 for line in lines[: -1 if data.endswith(b"\n") else None]), default=0
            )
        if count is not None:
            document["record_count"] = count
        if episode_ids is not None:
            document["episode_ids"] = episode_ids
        self.write_document(manifest.path, document)
        return path

    def edit_manifest(self, change: Callable[[dict[str, Any]], None], *, resync: bool = True) -> str:
        document = self.document(self.env.path)
        change(document)
        self.write_document(self.env.path, document, resync=resync)
        return self.env.path

    def add_participant(self, kind: str, instance: str, records: list[dict[str, Any]] | None = None) -> Manifest:
        """Commit another participant through the store and list it in the index."""
        from gymckpt.testing.values import sample_records

        manifest = CheckpointStore(self.backend).write_participant(
            "ck", kind=kind, instance=instance, checkpoint_id="c", records=records or sample_records(5)
        )
        document = self.document(self.index)
        document["participants"].append(
            {
                "kind": kind,
                "instance": instance,
                "manifest": f"gym/{kind}/{instance}/manifest.json",
                "manifest_sha256": manifest.sha256,
            }
        )
        document["participants"].sort(key=lambda entry: (entry["kind"], entry["instance"]))
        self.write(self.index, json.dumps(document, indent=2).encode() + b"\n")
        return manifest

    # special files (POSIX filesystems only)
    def copy_outside(self, path: str) -> str:
        assert self.outside is not None
        target = os.path.join(self.outside, path.replace("/", "_"))
        source = self.real(path)
        if os.path.isdir(source):
            shutil.copytree(source, target)
        else:
            shutil.copyfile(source, target)
        return target

    def replace_with_symlink(self, path: str, target: str) -> None:
        real = self.real(path)
        if os.path.isdir(real) and not os.path.islink(real):
            shutil.rmtree(real)
        else:
            os.unlink(real)
        os.symlink(target, real)

    def replace_with_fifo(self, path: str) -> None:
        os.unlink(self.real(path))
        os.mkfifo(self.real(path))

    def replace_with_socket(self, path: str) -> None:
        os.unlink(self.real(path))
        with tempfile.TemporaryDirectory(prefix="gs") as short:  # socket paths are limited to 108 bytes
            bound = os.path.join(short, "s")
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                server.bind(bound)
                os.rename(bound, self.real(path))
            finally:
                server.close()

    def replace_with_device(self, path: str) -> None:
        os.unlink(self.real(path))
        try:
            os.mknod(self.real(path), stat.S_IFCHR | 0o600, os.makedev(1, 5))  # what /dev/zero is
        except PermissionError:
            os.mkfifo(self.real(path))  # no CAP_MKNOD (not root): the nearest special file
