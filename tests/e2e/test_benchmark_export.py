"""benchmarks/export.py runs end to end at its smoke size: a random toy checkpoint, a run
of it with a published snapshot, and the export end to end and its writing against the
naive way, each in a fresh process."""

from __future__ import annotations

import re

import pytest

from tests.benchmark_scripts import run_benchmark


@pytest.mark.slow  # ~20 s: four fresh processes import JAX
def test_export_benchmark_runs_at_smoke_size():
    stdout = run_benchmark("export.py", "--smoke")
    for what in ("export \\(end to end\\)", "write: naive", "write: the export's"):
        m = re.search(rf"{what}\s+([\d.]+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)", stdout)
        assert m, (what, stdout)
        assert float(m[1]) > 0 and int(m[2]) > 0
    assert "plain write of as many bytes" in stdout
