"""An S3 endpoint in this process: moto's server on 127.0.0.1 and a free port (demo, tests, benchmarks).

moto checks ``If-None-Match: *`` but not atomically: two conditional PUTs of one key
arriving together can both succeed, where S3 lets exactly one win. The endpoint
therefore runs conditional writes one at a time, so racing writers see S3's semantics.
Needs the ``moto[server]`` package (``pip install -e '.[demo-s3]' in the gymckpt clone``).
"""

from __future__ import annotations

import threading
import urllib.request
from typing import TYPE_CHECKING, Any

from gymckpt.errors import UnsupportedStorage

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

__all__ = ["DUMMY_KEY", "DUMMY_SECRET", "MotoEndpoint"]

#: moto accepts any credentials; these make it obvious none are real
DUMMY_KEY = "gymckpt-testing"
DUMMY_SECRET = "gymckpt-testing-secret"


class _ConditionalWritesInOrder:
    """WSGI middleware: requests carrying ``If-None-Match`` run one at a time (atomic check-then-write)."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") in {"PUT", "POST"} and environ.get("HTTP_IF_NONE_MATCH"):
            with self.lock:
                return list(self.app(environ, start_response))
        return self.app(environ, start_response)


def _server_class() -> type:
    try:
        from moto.moto_server.threaded_moto_server import ThreadedMotoServer
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server
    except ImportError as exc:
        raise UnsupportedStorage(
            f"an embedded S3 endpoint needs moto's server: pip install -e '.[demo-s3]' in the gymckpt clone ({exc})"
        ) from exc

    class QuietHandler(MotoRequestHandler):  # type: ignore[misc, valid-type]
        def log_request(self, *args: Any, **kwargs: Any) -> None:
            pass  # one line per request drowns the demo's and the tests' output

    class Server(ThreadedMotoServer):  # type: ignore[misc, valid-type]
        # ThreadedMotoServer._server_entry with the app wrapped and request logging off
        def _server_entry(self) -> None:
            app = _ConditionalWritesInOrder(DomainDispatcherApplication(create_backend_app))
            self._server = make_server(self._ip_address, self._port, app, True, request_handler=QuietHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    return Server


class MotoEndpoint:
    """moto's ``ThreadedMotoServer`` on ``host`` and ``port`` (0: a free one), with dummy credentials.

    ::

        with MotoEndpoint() as endpoint:
            endpoint.create_bucket("ckpt")
            store = open_store("s3://ckpt/run", **endpoint.storage_options())
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, region: str = "us-east-1") -> None:
        self.host = host
        self.port = port
        self.region = region
        self._server: Any = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``; valid once started."""
        if self._server is None:
            raise RuntimeError("the endpoint is not started")
        return f"http://{self.host}:{self.port}"

    def start(self) -> MotoEndpoint:
        """Start serving; the bound port is in :attr:`port` afterwards."""
        if self._server is None:
            server = _server_class()(ip_address=self.host, port=self.port, verbose=False)
            server.start()
            self.host, self.port = server.get_host_and_port()
            self._server = server
        return self

    def stop(self) -> None:
        """Stop serving (forgets every bucket)."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()

    def reset(self) -> None:
        """Forget every bucket and object (moto's reset API)."""
        request = urllib.request.Request(f"{self.url}/moto-api/reset", method="POST", data=b"")
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """Options for :func:`~gymckpt.store.open_store` that reach this endpoint."""
        return {"endpoint_url": self.url, "key": DUMMY_KEY, "secret": DUMMY_SECRET, "region": self.region, **extra}

    def client(self) -> Any:
        """A boto3 S3 client for this endpoint (needs boto3)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=DUMMY_KEY,
            aws_secret_access_key=DUMMY_SECRET,
            region_name=self.region,
        )

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (through s3fs, so boto3 is not needed)."""
        from gymckpt.store._fsspec import FsspecBackend

        backend = FsspecBackend(f"s3://{name}", **self.storage_options())
        try:
            backend.fs.call_s3("create_bucket", Bucket=name)
        finally:
            backend.close()

    def __enter__(self) -> MotoEndpoint:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
