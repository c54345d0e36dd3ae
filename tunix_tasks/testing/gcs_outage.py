"""A fake-gcs-server that can be taken down and brought back (same port, same data), to
test what the store's clients do through a real outage: while it is down every request
gets "connection refused", as from a GCS endpoint that cannot be reached.

    with OutageGcs() as gcs:           # sets STORAGE_EMULATOR_HOST, like FakeGcs
        uri = gcs.new_bucket_uri()
        gcs.down(); ...; gcs.up()      # objects written before the outage are still there
"""

from __future__ import annotations

import socket
import subprocess

from tunix_tasks.testing.gcs_server import FakeGcs, hold_port


class OutageGcs(FakeGcs):
    """A `FakeGcs` whose process can be stopped and restarted on the same port and data."""

    _held: socket.socket | None = None

    def down(self) -> None:
        """Stop the server process; its data folder stays. Its port is held meanwhile
        (connections refused), so a server started beside this test (pytest-xdist) is
        not handed it and does not answer for it. Where the closed server's connections
        (TIME_WAIT) keep it from being bound, they keep it from being handed out too."""
        proc, self._proc = self._proc, None
        assert proc is not None, "not running"
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        try:
            self._held = hold_port(self.port)
        except OSError:
            self._held = None

    def up(self) -> None:
        """Start the server again on the same port and data folder."""
        self._release()
        self._launch()

    def stop(self) -> None:
        self._release()  # stopped while down
        super().stop()

    def _release(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None
