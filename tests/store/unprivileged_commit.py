"""Commit one participant as an unprivileged user (a helper program, not a test module).

Used by ``test_injected_failures.py`` for the read-only directory case: root ignores
permission bits, so the test runs this as root, and it drops to ``--uid``/``--gid``
(``nobody`` by default) itself. It cannot be started as that user directly: the
virtualenv's interpreter lives under ``/root``, which only root may enter. So it first
imports gymckpt and warms up the commit path (as root, in a scratch directory: every lazy
import and code path is loaded), then drops its privileges and commits into ``ROOT``.

Prints one JSON line: who it ran as, whether ``ROOT`` was listable (so a failure is not
just an unreachable path), and the outcome with the error's class, bases and errno.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import traceback

from gymckpt.store import open_store, verify
from gymckpt.testing.values import sample_records


def _commit(root: str) -> None:
    open_store(root).write_participant(
        "ck", kind="environment", instance="env-0", checkpoint_id="ck-1", records=sample_records(20)
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--uid", type=int, default=65534)
    parser.add_argument("--gid", type=int, default=65534)
    args = parser.parse_args()

    scratch = tempfile.mkdtemp(prefix="gymckpt-warmup-")
    try:
        _commit(scratch)  # as the starting user: loads every module the commit needs
        assert verify(os.path.join(scratch, "ck")).ok
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(args.gid)
        os.setuid(args.uid)
    result: dict[str, object] = {"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid()}
    try:
        result["listable"] = sorted(os.listdir(args.root))
    except OSError as exc:
        result["listable"] = None
        result["list_error"] = repr(exc)
    try:
        _commit(args.root)
        result["outcome"] = "committed"
    except Exception as exc:
        result.update(
            outcome="error",
            error_class=type(exc).__name__,
            error_bases=[cls.__name__ for cls in type(exc).__mro__],
            errno=getattr(exc, "errno", None),
            cause_errno=getattr(exc.__cause__, "errno", None),
            message=str(exc),
            traceback=traceback.format_exc(),
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
