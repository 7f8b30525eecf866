"""Deleting a whole checkpoint so that, to every reader, it looks like what it is: pruning, not damage.

A checkpoint is first unpublished in one step, then its files are deleted:

- On a local or shared filesystem its directory is renamed, atomically, to a hidden name
  in the same parent, ``.gymckpt-pruning-<name>-<hex>`` (:data:`PRUNING_PREFIX`), and the
  parent fsynced; only then is the renamed tree deleted. A reader that listed the
  checkpoint before the rename finds it gone, as a whole, and ``verify`` reports it as
  ``checkpoint_vanished`` (a warning); ``verify`` and ``inspect`` skip hidden pruning
  directories when they list a root. A crash between the rename and the end of the delete
  leaves a hidden directory that :func:`remove_pruning_leftovers` deletes (the collector
  calls it on every prune).
- Object storage has no rename (S3's is a copy of every object and a delete): a copy would
  double the I/O and would, for a moment, show the checkpoint twice. There the index
  ``gym/checkpoint.json`` is deleted first (which unpublishes it: no resume or restore picks a
  checkpoint without one), then every manifest (its participants become unfinished commits,
  warnings), then the rest, and the keys below it that no path names (``gym//x``: only a raw
  delete of the key reaches them). Every state a reader can meet on the way is either a published
  checkpoint whose files are all there, or an unpublished one that ``verify`` reports with
  warnings; a reader whose listing predates the delete finds the index gone and reports
  ``checkpoint_vanished``.
"""

from __future__ import annotations

import os
import secrets
from typing import TYPE_CHECKING

from gymckpt.errors import StorageError
from gymckpt.store.backend import join, safe_relative_path
from gymckpt.store.layout import GYM_DIR, MANIFEST_NAME, index_path

if TYPE_CHECKING:
    from gymckpt.store.backend import StorageBackend

__all__ = ["PRUNING_PREFIX", "delete_checkpoint", "is_pruning_name", "remove_pruning_leftovers"]

#: a checkpoint directory renamed for deletion: ``.gymckpt-pruning-<name>-<hex>``
PRUNING_PREFIX = ".gymckpt-pruning-"


def is_pruning_name(name: str) -> bool:
    """True for a directory name :func:`delete_checkpoint` gives a checkpoint it is deleting."""
    return name.startswith(PRUNING_PREFIX)


def _rename_local(backend: StorageBackend, directory: str) -> str | None:
    """Rename ``directory`` to a hidden pruning name beside it, fsync the parent; the new path.

    None where the backend has no rename (object storage, memory); raises FileNotFoundError when
    ``directory`` is already gone.
    """
    open_directory = getattr(backend, "open_directory", None)  # the local backend's descriptors
    if open_directory is None:
        return None
    parent, _, name = directory.rpartition("/")
    hidden = f"{PRUNING_PREFIX}{name}-{secrets.token_hex(4)}"
    fd = open_directory(parent)
    try:
        try:
            os.rename(name, hidden, src_dir_fd=fd, dst_dir_fd=fd)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise StorageError(
                f"cannot rename {directory} for deletion: {exc}", path=directory, errno=exc.errno
            ) from exc
        try:
            os.fsync(fd)  # the rename is the unpublishing step: make it durable before deleting
        except OSError as exc:
            raise StorageError(f"cannot fsync {parent or '.'}: {exc}", path=parent, errno=exc.errno) from exc
    finally:
        os.close(fd)
    return join(parent, hidden)


def delete_checkpoint(backend: StorageBackend, directory: str) -> None:
    """Unpublish the checkpoint at ``directory`` in one step, then delete every file of it (module docstring).

    A checkpoint already gone is not an error. The store's root is refused (``ValueError``).
    """
    relative = safe_relative_path(directory)
    if not relative:
        raise ValueError("delete_checkpoint refuses the store's root")
    try:
        hidden = _rename_local(backend, relative)
    except FileNotFoundError:
        return
    if hidden is not None:
        backend.delete_tree(hidden)
        return
    backend.delete(index_path(relative))
    manifests = [
        path
        for path in backend.walk_files(join(relative, GYM_DIR))
        if path.rpartition("/")[2] == MANIFEST_NAME and path.count("/") == relative.count("/") + 4
    ]
    for path in manifests:
        backend.delete(path)
    backend.delete_tree(relative)
    walk_keys, delete_key = getattr(backend, "walk_keys", None), getattr(backend, "delete_key", None)
    if walk_keys is not None and delete_key is not None:  # keys no path names, which delete_tree never sees
        for key in [key for key, addressable in walk_keys(relative) if not addressable]:
            delete_key(key)


def remove_pruning_leftovers(backend: StorageBackend, parent: str = "") -> list[str]:
    """Delete the hidden directories a crashed :func:`delete_checkpoint` left in ``parent``; their paths."""
    removed = []
    for name in backend.list_dir(parent):
        if name.endswith("/") and is_pruning_name(name):
            path = join(parent, name.rstrip("/"))
            backend.delete_tree(path)  # one another prune removes meanwhile is no error
            removed.append(path)
    return removed
