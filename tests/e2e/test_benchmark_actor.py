"""benchmarks/actor.py runs end to end at a smoke size: its warm-up waits out every
compilation, its windows measure no compile, and one env is a valid baseline (it died
with a ZeroDivisionError when E=1 finished no episode inside the window)."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import run_benchmark


@pytest.mark.slow  # ~40 s on 2 cores: the tiny preset's sampler programs compile once
def test_actor_benchmark_measures_without_compiling_inside_a_window():
    smoke = "--envs 1 4 --window 2 --quiet 1 --min-episodes 1 --skip-sampler"
    stdout = run_benchmark("actor.py", *smoke.split())
    rows = {
        int(line.split()[0]): line.split()
        for line in stdout.splitlines()
        if line.strip() and line.split()[0] in ("1", "4")
    }
    assert set(rows) == {1, 4}
    for row in rows.values():
        assert float(row[1]) > 0 and float(row[2]) >= 1  # episodes/s, episodes
        assert float(row[6]) == 0  # compiles inside the window
    assert "s per episode" in stdout
