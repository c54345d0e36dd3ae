"""benchmarks/learning.py's report: table, goal lines, merge and curves from saved results
(the script run on them, `--merge`: no training)."""

from __future__ import annotations

import json

from tests.benchmark_scripts import run_benchmark


def _cell(reward: float, wall: float, dropped: float = 0.0) -> dict:
    curve = [(step, 2.0 * step, reward) for step in range(2, 12)]
    return {
        "reward": reward,
        "wall_s": wall,
        "dropped_frac": dropped,
        "staleness_mean": 1.5,
        "curve": curve,
    }


def _results(seed: int, sync_reward: float) -> dict:
    return {
        "warm": {seed: {"reward": 0.2}},
        "cells": {
            "0/none": {seed: _cell(sync_reward, 90.0)},
            "8/none": {seed: _cell(sync_reward - 0.1, 20.0)},
            "8/decoupled_ppo": {seed: _cell(sync_reward + 0.01, 40.0, dropped=0.25)},
        },
        "total_s": 60.0,
        "args": {"steps": 10, "latency": 3.0, "envs": 256},
    }


def test_table_goals_merge_and_plot(tmp_path):
    paths = []
    for seed, sync in ((0, 0.3), (1, 0.4)):
        paths.append(tmp_path / f"{seed}.json")
        paths[-1].write_text(json.dumps(_results(seed, sync)))
    out_dir = tmp_path / "merged"
    text = run_benchmark("learning.py", "--merge", *map(str, paths), "--out", str(out_dir))
    out = json.loads((out_dir / "learning.json").read_text())
    assert sorted(out["warm"]) == ["0", "1"] and sorted(out["cells"]["8/none"]) == ["0", "1"]
    assert "10 RL steps per cell" in text and "seeds [0, 1]" in text
    assert "| 0 | sync (any: on-policy) | 2 | 0.350 ± 0.071 |" in text
    assert "| 8 | decoupled_ppo | 2 | 0.360 ± 0.071 | +0.010 ± 0.000 |" in text
    assert "0.44 ± 0.00 | 0.25 ± 0.00 |" in text  # wall / sync 40/90, dropped
    lines = text.splitlines()
    assert any("none: Δ reward -0.100" in x and "NOT met" in x for x in lines)
    assert any("decoupled_ppo: Δ reward +0.010" in x and "wall/sync 0.44" in x for x in lines)
    assert (out_dir / "learning.png").stat().st_size > 10_000
