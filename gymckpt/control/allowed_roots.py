"""Where a request's ``checkpoint_dir`` may point (the ``allowed_roots`` setting, C2)."""

from __future__ import annotations

import os
import posixpath

from gymckpt.errors import CheckpointDirNotAllowed

__all__ = ["check_allowed", "normalize_location"]


def normalize_location(location: str) -> str:
    """A comparable form: absolute normalized path, or ``scheme://`` + normalized key path."""
    scheme, sep, rest = location.partition("://")
    if not sep:
        return os.path.normpath(os.path.abspath(location))
    if scheme == "file":
        return os.path.normpath(os.path.abspath(rest))
    parts = rest.split("/")
    if any(part in ("..", ".") for part in parts):
        raise CheckpointDirNotAllowed(
            f"checkpoint_dir {location!r} must not contain '.' or '..' segments (setting checkpoint.allowed_roots)"
        )
    return f"{scheme}://{posixpath.normpath(rest)}"


#: schemes a request may name when the settings name no allowed roots
DEFAULT_SCHEMES = frozenset({"file", "s3", "s3a"})


def check_allowed(checkpoint_dir: str, allowed_roots: list[str] | None) -> None:
    """Refuse ``checkpoint_dir`` outside every allowed root.

    Without the setting, local paths, ``file://`` and ``s3://`` URLs are allowed; any other
    scheme (``zip://``, ``ftp://``, ``github://``…) must be named by an allowed root.
    """
    if allowed_roots is None:
        scheme, sep, _ = checkpoint_dir.partition("://")
        if sep and scheme not in DEFAULT_SCHEMES:
            raise CheckpointDirNotAllowed(
                f"checkpoint_dir scheme {scheme!r} is not allowed; name it in the setting checkpoint.allowed_roots"
            )
        return
    target = normalize_location(checkpoint_dir)
    for root in allowed_roots:
        base = normalize_location(root)
        if target == base or target.startswith(base.rstrip("/") + "/"):
            return
    raise CheckpointDirNotAllowed(
        f"checkpoint_dir {checkpoint_dir!r} lies outside the setting checkpoint.allowed_roots ({allowed_roots})"
    )
