"""benchmarks/real_learning.py's report: the table with t-intervals, the paired gains, the
time to sync's final reward and the curves, from saved results (`--merge`: no training)."""

from __future__ import annotations

import json

from tests.benchmark_scripts import run_benchmark


def _run(reward: float, wall: float, slope: float) -> dict:
    curve = [(step, wall * step / 10, slope * step) for step in range(1, 11)]
    return {"reward": reward, "solved": reward, "wall_s": wall, "curve": curve, "seen": 0.3}


def _results(seed: str, sync: float, asyn: float) -> dict:
    return {
        "base": {"reward": 0.25, "solved": 0.25},
        "args": {"config": "configs/x.yaml", "steps": 10, "episodes": 64},
        "runs": {
            "sync": {seed: _run(sync, 200.0, 0.05)},
            "async": {seed: _run(asyn, 100.0, 0.05)},
        },
        "total_s": 600.0,
    }


def test_table_intervals_time_to_target_and_plot(tmp_path):
    paths = []
    for seed, sync, asyn in (("0", 0.35, 0.30), ("1", 0.45, 0.40), ("2", 0.40, 0.35)):
        paths.append(tmp_path / f"{seed}.json")
        paths[-1].write_text(json.dumps(_results(seed, sync, asyn)))
    out_dir = tmp_path / "merged"
    text = run_benchmark("real_learning.py", "--merge", *map(str, paths), "--out", str(out_dir))
    assert "configs/x.yaml: 10 learner steps per run, 64 held-out seeds, 30.0 min" in text
    assert "| base (pretrained) | - | 0.250 | 0.250 | | | |" in text
    # mean 0.40, sd 0.05 over 3 seeds: t(2) 4.303 * 0.05 / sqrt(3) = 0.124
    sync = "| sync, 10 steps | 3 | 0.400 ± 0.124 | 0.400 ± 0.124 | +0.150 ± 0.124 | 200 ± 0 |"
    assert f"{sync} 0.30 ± 0.00 | - | - | - |" in text
    assert "| async, 10 steps | 3 | 0.350 ± 0.124 |" in text
    out = json.loads((out_dir / "real_learning.json").read_text())
    # sync's final trained reward: mean of its last 5 steps (0.3..0.5) = 0.4, reached by
    # the 5-step mean at step 10 (wall 200 s sync, 100 s async)
    assert out["time_to_sync_final"]["sync"] == {"0": 200.0, "1": 200.0, "2": 200.0}
    assert out["time_to_sync_final"]["async"]["0"] == 100.0
    assert (out_dir / "real_learning.png").stat().st_size > 10_000


def test_a_studys_cells_are_rows_with_their_staleness_and_drops(tmp_path):
    """Files whose `--set` overrides differ (a staleness x correction study) are rows of
    their own, named by the overrides that differ; the trained episodes by staleness
    are summed over the seeds, the stale drops averaged."""
    paths = []
    for seed, correction, reward in (("0", "none", 0.5), ("1", "none", 0.7), ("0", "tis", 0.4)):
        run = {**_run(reward, 100.0, 0.05), "staleness": {"0": 2, "2": 5}, "dropped": {"stale": 9}}
        result = {
            "base": {"reward": 0.25, "solved": 0.25},
            "args": {
                "config": "c.yaml",
                "steps": 10,
                "episodes": 8,
                "set": ["actor.reload_every_versions=4", f"learner.correction={correction}"],
            },
            "runs": {"async": {seed: run}},
            "total_s": 60.0,
        }
        paths.append(tmp_path / f"{seed}-{correction}.json")
        paths[-1].write_text(json.dumps(result))
    text = run_benchmark("real_learning.py", "--merge", *map(str, paths), "--out", str(tmp_path))
    assert "| async, learner.correction=none, 10 steps | 2 | 0.600 ± 1.271 |" in text
    assert "| 4/0/10 | 9 ± 0 |" in text
    assert "| async, learner.correction=tis, 10 steps | 1 | 0.400 |" in text
    assert "| 2/0/5 | 9 |" in text
