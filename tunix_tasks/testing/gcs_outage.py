"""A fake-gcs-server that can be taken down and brought back (same port, same data), to
test what the store's clients do through a real outage: while it is down every request
gets "connection refused", as from a GCS endpoint that cannot be reached.

    with OutageGcs() as gcs:           # sets STORAGE_EMULATOR_HOST, like FakeGcs
        uri = gcs.new_bucket_uri()
        gcs.down(); ...; gcs.up()      # objects written before the outage are still there
"""

from __future__ import annotations

import subprocess

from tunix_tasks.testing.gcs_server import FakeGcs


class OutageGcs(FakeGcs):
    """A `FakeGcs` whose process can be stopped and restarted on the same port and data."""

    def down(self) -> None:
        """Stop the server process; its data folder stays."""
        proc, self._proc = self._proc, None
        assert proc is not None, "not running"
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def up(self) -> None:
        """Start the server again on the same port and data folder."""
        self._launch()
