"""``gymckpt demo --store s3``: the demos against an S3 endpoint served by moto inside the demo process.

No account is needed: moto's server runs on 127.0.0.1 and a free port, the demo creates a
bucket there, and every Gym server (and the coordinator, and ``verify``) gets the endpoint
and dummy credentials through ``storage_options``. The endpoint stops when the demo ends.
Needs moto's server and s3fs (``pip install -e '.[demo-s3]' in the gymckpt clone``); without them the demo
stops before it starts anything, with a one-line error naming that extra.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from gymckpt.demo.full import run_demo
from gymckpt.demo.report import EXIT_SETUP, DemoOutcome, render
from gymckpt.demo.store_only import run_store_demo
from gymckpt.errors import UnsupportedStorage

if TYPE_CHECKING:
    from pathlib import Path

    from rich.console import Console

__all__ = ["DEMO_BUCKET", "S3_EXTRA", "require_s3_packages", "run_s3_demo", "run_s3_store_demo"]

#: the bucket ``gymckpt demo --store s3`` creates on its embedded endpoint
DEMO_BUCKET = "gymckpt-demo"
#: the install command of the extra that brings what ``--store s3`` needs
S3_EXTRA = "pip install -e '.[demo-s3]' in the gymckpt clone"
#: what the embedded endpoint imports (moto's server and werkzeug), then the store's S3 filesystem
_S3_MODULES = (
    "moto",
    "moto.moto_server.threaded_moto_server",
    "moto.moto_server.werkzeug_app",
    "werkzeug.serving",
    "s3fs",
)


def require_s3_packages() -> None:
    """Import what the embedded S3 endpoint needs; a missing package raises ``UnsupportedStorage`` naming the extra."""
    for name in _S3_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            missing = exc.name or name
            raise UnsupportedStorage(
                f"gymckpt demo --store s3 needs moto's server and s3fs, and {missing} is not installed: {S3_EXTRA}"
            ) from exc


def run_s3_demo(
    *,
    rollouts: int = 64,
    keep: bool = False,
    seed: int = 0,
    console: Console,
    progress_console: Console | None = None,
    timeout: float = 120.0,
    logs_dir: Path | None = None,
    workers: int = 2,
    restore_workers: int = 3,
) -> DemoOutcome:
    """The full demo with the checkpoint on an S3 endpoint served by moto in this process.

    Starts moto's server on 127.0.0.1 and a free port, creates a bucket, and runs the demo
    against ``s3://gymckpt-demo/checkpoints`` with the endpoint and dummy credentials in
    every Gym server's ``storage_options``; the endpoint stops when the demo ends.
    Raises ``UnsupportedStorage`` (naming ``gymckpt[demo-s3]``) when moto or s3fs is missing.
    """
    require_s3_packages()
    from gymckpt.testing.moto import MotoEndpoint

    store_url = f"s3://{DEMO_BUCKET}/checkpoints"
    try:
        endpoint = MotoEndpoint().start()
        endpoint.create_bucket(DEMO_BUCKET)
    except Exception as exc:  # no port, bucket refused: the demo cannot start
        outcome = DemoOutcome(rollouts=rollouts, store_url=store_url)
        outcome.error = f"the embedded S3 endpoint did not start: {exc}"
        outcome.exit_code = EXIT_SETUP
        render(outcome, console)
        return outcome
    try:
        (progress_console or console).print(
            f"embedded S3 endpoint (moto) at {endpoint.url}, bucket {DEMO_BUCKET}", highlight=False
        )
        return run_demo(
            rollouts=rollouts,
            store_url=store_url,
            keep=keep,
            seed=seed,
            console=console,
            progress_console=progress_console,
            storage_options=endpoint.storage_options(),
            embedded_endpoint=endpoint.url,
            timeout=timeout,
            logs_dir=logs_dir,
            workers=workers,
            restore_workers=restore_workers,
        )
    finally:
        endpoint.stop()


def run_s3_store_demo(*, episodes: int, seed: int, console: Console) -> int:
    """``gymckpt demo --store-only --store s3``: the store demo against an S3 endpoint served by moto in this process.

    Starts moto's server on 127.0.0.1 and a free port, creates a bucket, runs the demo
    against ``s3://gymckpt-demo/checkpoints`` (multipart upload, server-side copy,
    ``If-None-Match: *`` manifests), verifies it, and stops the server: no account needed.
    Raises ``UnsupportedStorage`` (naming ``gymckpt[demo-s3]``) when moto or s3fs is missing.
    """
    require_s3_packages()
    from gymckpt.testing.moto import MotoEndpoint

    with MotoEndpoint() as endpoint:
        endpoint.create_bucket(DEMO_BUCKET)
        console.print(
            f"embedded S3 endpoint (moto) at {endpoint.url}, bucket {DEMO_BUCKET}", highlight=False, markup=False
        )
        return run_store_demo(
            f"s3://{DEMO_BUCKET}/checkpoints",
            episodes=episodes,
            seed=seed,
            console=console,
            storage_options=endpoint.storage_options(),
            embedded_endpoint=True,
        )
