"""The Ray launcher's parts that need no Ray: its ``ray:`` block, and where checkpoints may live across nodes.

A stack file's ``ray:`` block (:class:`RayOptions`)::

    ray:
      address: 10.0.0.5:6379      # the cluster (gymckpt stack up --ray ADDRESS overrides it; auto: RAY_ADDRESS)
      placement: spread           # spread (each server on another node where possible) or pack
      cpus_per_server: 1          # Ray CPUs each server's bundle holds (its workers share them)
      checkpoint_dir: s3://b/run  # where the controller checkpoints: every node must see it
      resources: {inference: {head: 0.01}}   # custom Ray resources a server's bundle asks for

With servers on more than one node, every place checkpoints may go (``ray.checkpoint_dir``
and each of ``checkpoint.allowed_roots``) must be seen by every node: an ``s3://`` URL (or
another object store's) is; a path is only once a probe file written there from one node
reads back from every other (:func:`write_probe`, :func:`read_probe`, run as Ray tasks).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gymckpt.control.settings import misspelled_keys
from gymckpt.errors import SettingsError

__all__ = [
    "OBJECT_STORE_SCHEMES",
    "RAY_KEYS",
    "RayOptions",
    "checkpoint_locations",
    "local_path",
    "read_probe",
    "remove_probe",
    "write_probe",
]

#: the keys of a stack file's ``ray:`` block
RAY_KEYS = frozenset({"address", "placement", "cpus_per_server", "checkpoint_dir", "resources", "log_dir"})
PLACEMENTS = {"spread": "SPREAD", "pack": "PACK"}
#: URL schemes of storage every node reaches over the network (no probe needed)
OBJECT_STORE_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


@dataclass(frozen=True)
class RayOptions:
    """A stack file's ``ray:`` block, checked."""

    address: str | None = None
    placement: str = "spread"
    cpus_per_server: float = 1.0
    checkpoint_dir: str | None = None
    resources: dict[str, dict[str, float]] = field(default_factory=dict)
    #: where on its node each server keeps its config and log (None: a new directory in the node's temp dir)
    log_dir: str | None = None

    @property
    def strategy(self) -> str:
        """Ray's placement group strategy (``SPREAD`` or ``PACK``)."""
        return PLACEMENTS[self.placement]

    @classmethod
    def from_block(cls, block: Any, servers: list[str], path: str = "") -> RayOptions:
        """The ``ray:`` block (None: every default); each mistake a :class:`SettingsError` naming ``ray.<key>``."""
        if block is None:
            return cls()
        if not isinstance(block, dict):
            raise SettingsError([("ray", "must be a mapping (address, placement, cpus_per_server, ...)")], path=path)
        problems = misspelled_keys(block, RAY_KEYS, prefix="ray.")
        address = block.get("address")
        if address is not None and not isinstance(address, str):
            problems.append(("ray.address", "must be a Ray address such as 10.0.0.5:6379 (or auto)"))
        placement = block.get("placement", "spread")
        if placement not in PLACEMENTS:
            problems.append(("ray.placement", f"{placement!r} is no placement; give spread or pack"))
        cpus = block.get("cpus_per_server", 1.0)
        if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or cpus <= 0:
            problems.append(("ray.cpus_per_server", "must be a positive number of Ray CPUs"))
        directory = block.get("checkpoint_dir")
        if directory is not None and (not isinstance(directory, str) or not directory):
            problems.append(("ray.checkpoint_dir", "must be an s3:// URL or a path every node sees"))
        log_dir = block.get("log_dir")
        if log_dir is not None and (not isinstance(log_dir, str) or not log_dir.startswith("/")):
            problems.append(("ray.log_dir", "must be an absolute path, made on each node where a server runs"))
        resources = block.get("resources") or {}
        if not isinstance(resources, dict):
            problems.append(("ray.resources", "must map a server's name to {resource: amount}"))
            resources = {}
        for name, wanted in resources.items():
            if name not in servers:
                problems.append(
                    (f"ray.resources.{name}", f"names no server of this stack (servers: {', '.join(servers)})")
                )
            elif not isinstance(wanted, dict) or not all(
                isinstance(key, str)
                and isinstance(amount, (int, float))
                and not isinstance(amount, bool)
                and amount > 0
                for key, amount in wanted.items()
            ):
                problems.append((f"ray.resources.{name}", "must map a Ray resource's name to a positive amount"))
        if problems:
            raise SettingsError(problems, path=path)
        return cls(
            address=address,
            placement=str(placement),
            cpus_per_server=float(cpus),
            checkpoint_dir=directory,
            log_dir=log_dir,
            resources={
                name: {key: float(amount) for key, amount in wanted.items()} for name, wanted in resources.items()
            },
        )


def local_path(location: str) -> str | None:
    """The filesystem path of a checkpoint location, None for an object store's URL.

    A ``file://`` URL is its path; another scheme not in :data:`OBJECT_STORE_SCHEMES`
    (``memory://``: one process's memory) has no path every node could share, so it is
    returned as is, to be refused by the probe.
    """
    if "://" not in location:
        return location
    scheme, rest = location.split("://", 1)
    if scheme.lower() in OBJECT_STORE_SCHEMES:
        return None
    return rest if scheme.lower() in {"file", "local"} else location


def checkpoint_locations(options: RayOptions, checkpoint: Any) -> list[tuple[str, str]]:
    """``(setting, location)`` of every place checkpoints may go: ``ray.checkpoint_dir``, ``checkpoint.allowed_roots[i]``."""
    found = []
    if options.checkpoint_dir is not None:
        found.append(("ray.checkpoint_dir", options.checkpoint_dir))
    roots = (checkpoint or {}).get("allowed_roots") if isinstance(checkpoint, dict) else None
    for index, root in enumerate(roots or []):
        found.append((f"checkpoint.allowed_roots[{index}]", str(root)))
    return found


# --- the probe's steps: each runs as a Ray task pinned to one node (any process can run them)


def write_probe(directory: str) -> tuple[str, str]:
    """Write a fresh probe file into ``directory`` (made if missing); ``(file name, content)``."""
    if "://" in directory:
        raise OSError(f"{directory} is no filesystem path")
    Path(directory).mkdir(parents=True, exist_ok=True)
    name = f".gymckpt-probe-{secrets.token_hex(8)}"
    content = secrets.token_hex(16)
    target = Path(directory, name)
    with open(target, "w") as stream:
        stream.write(content)
        stream.flush()
        os.fsync(stream.fileno())
    return name, content


def read_probe(directory: str, name: str) -> str | None:
    """The probe file's content as this node sees it, None when it is not there."""
    try:
        return Path(directory, name).read_text()
    except OSError:
        return None


def remove_probe(directory: str, name: str) -> None:
    Path(directory, name).unlink(missing_ok=True)
