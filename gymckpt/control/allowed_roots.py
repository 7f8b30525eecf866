"""Where a request's ``checkpoint_dir`` may point (the ``allowed_roots`` setting).

Local paths and ``file://`` URLs are compared as resolved real paths (symlinks followed,
:func:`os.path.realpath`), roots and directories alike, so a symlink inside an allowed root
that points outside it is refused. The path is resolved once: :func:`open_allowed_store`
opens the store on exactly the path that was checked, without following any symlink in it
(``LocalBackend(path, resolved=True)``), and the backend keeps that directory open and does
every later read and write relative to it, so a directory swapped for a symlink after the
check is refused (:class:`~gymckpt.errors.NotRegularFile`) instead of followed out of the root.
"""

from __future__ import annotations

import os
import posixpath
from typing import Any

from gymckpt.errors import CheckpointDirNotAllowed
from gymckpt.store import CheckpointStore, open_store
from gymckpt.store._local import LocalBackend

__all__ = ["check_allowed", "normalize_location", "open_allowed_store"]


def normalize_location(location: str) -> str:
    """A comparable form: the resolved real path (local), or ``scheme://`` + normalized key path."""
    scheme, sep, rest = location.partition("://")
    if not sep:
        return os.path.realpath(location)
    if scheme == "file":
        return os.path.realpath(rest)
    parts = rest.split("/")
    if any(part in ("..", ".") for part in parts):
        raise CheckpointDirNotAllowed(
            f"checkpoint_dir {location!r} must not contain '.' or '..' segments (setting checkpoint.allowed_roots)"
        )
    return f"{scheme}://{posixpath.normpath(rest)}"


#: schemes a request may name when the settings name no allowed roots
DEFAULT_SCHEMES = frozenset({"file", "s3", "s3a"})


def check_allowed(checkpoint_dir: str, allowed_roots: list[str] | None) -> str:
    """Refuse ``checkpoint_dir`` outside every allowed root; return the location to open.

    Without the setting, local paths, ``file://`` and ``s3://`` URLs are allowed (and
    returned as given); any other scheme (``zip://``, ``ftp://``, ``github://``…) must be
    named by an allowed root. With it, a local path or ``file://`` URL is returned resolved
    (the real path that was checked, ``file://`` kept), any other URL as given.
    """
    scheme, sep, _ = checkpoint_dir.partition("://")
    if allowed_roots is None:
        if sep and scheme not in DEFAULT_SCHEMES:
            raise CheckpointDirNotAllowed(
                f"checkpoint_dir scheme {scheme!r} is not allowed; name it in the setting checkpoint.allowed_roots"
            )
        return checkpoint_dir
    target = normalize_location(checkpoint_dir)
    for root in allowed_roots:
        base = normalize_location(root)
        if target == base or target.startswith(base.rstrip("/") + "/"):
            if not sep:
                return target
            return f"file://{target}" if scheme == "file" else checkpoint_dir
    raise CheckpointDirNotAllowed(
        f"checkpoint_dir {checkpoint_dir!r} lies outside the setting checkpoint.allowed_roots ({allowed_roots})"
    )


def open_allowed_store(checkpoint_dir: str, allowed_roots: list[str] | None, **storage_options: Any) -> CheckpointStore:
    """:func:`check_allowed`, then the store opened on what was checked.

    With ``allowed_roots``, a local directory (path or ``file://``) is opened on the resolved
    path the check compared, and a symlink anywhere in that path (a directory swapped after
    the check) is refused by the backend rather than followed; any other location is opened
    with :func:`~gymckpt.store.open_store` and ``storage_options``.
    """
    location = check_allowed(checkpoint_dir, allowed_roots)
    scheme, sep, rest = location.partition("://")
    if allowed_roots is None or storage_options or (sep and scheme != "file"):
        return open_store(location, **storage_options)  # also refuses options a local store would ignore
    return CheckpointStore(LocalBackend(rest if sep else location, resolved=True))
