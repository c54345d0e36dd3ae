"""benchmarks/remote_engine.py runs end to end at its smoke size: `tunix-tasks serve` as a
subprocess, the in-process and remote paths at two concurrencies with no compile inside
a timed window, the per-turn overhead, a weights push, and a fleet's pushes through its
own folders and through the shared one (written once, pushed once), and a LoRA run's
adapter push."""

from __future__ import annotations

import re

import pytest

from tests.benchmark_scripts import run_benchmark


@pytest.mark.slow  # ~60 s on 2 cores: two tiny-preset samplers compile their programs
def test_remote_engine_benchmark_runs_at_smoke_size():
    stdout = run_benchmark("remote_engine.py", "--smoke")
    rows = [line.split() for line in stdout.splitlines() if line.startswith(("    1 ", "    4 "))]
    assert [r[0] for r in rows] == ["1", "4"]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)  # turns/s, both paths
    assert "per-turn overhead at E=1" in stdout
    assert "weights push" in stdout and "MB/s" in stdout
    assert re.search(
        r"own folders \d+ ms, 4 folders written, 4 pushes reached the server; "
        r"shared \d+ ms, 1 written, 1 pushed",
        stdout,
    )
    assert re.search(r"adapter push \(rank 8, .*\): \d+ ms for [\d.]+ MB", stdout)
