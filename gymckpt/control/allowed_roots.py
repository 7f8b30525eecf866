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
        raise CheckpointDirNotAllowed(f"checkpoint_dir {location!r} must not contain '.' or '..' segments")
    return f"{scheme}://{posixpath.normpath(rest)}"


def check_allowed(checkpoint_dir: str, allowed_roots: list[str] | None) -> None:
    """Refuse ``checkpoint_dir`` outside every allowed root (no setting: everything is allowed)."""
    if allowed_roots is None:
        return
    target = normalize_location(checkpoint_dir)
    for root in allowed_roots:
        base = normalize_location(root)
        if target == base or target.startswith(base.rstrip("/") + "/"):
            return
    raise CheckpointDirNotAllowed(
        f"checkpoint_dir {checkpoint_dir!r} lies outside the setting checkpoint.allowed_roots ({allowed_roots})"
    )
