"""Running a benchmark script as its user would: `python benchmarks/NAME ARGS`, in a
subprocess, its exit status checked and its stdout returned."""

from __future__ import annotations

import subprocess
import sys

from tests.paths import REPO


def run_benchmark(name: str, *args: str, timeout: float = 600) -> str:
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout
