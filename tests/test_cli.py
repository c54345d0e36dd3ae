"""The CLI: parses, calls the library, reports errors clearly (no JAX needed for these)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from tests.shard_factory import make_episode
from tunix_tasks.storage.shards import ShardWriter
from tunix_tasks.storage.store import open_store


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tunix_tasks.frontdoor.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_inspect_json_and_text(tmp_path):
    store = open_store(str(tmp_path))
    rng = np.random.default_rng(0)
    w = ShardWriter(store, actor_id="a", max_episodes=10)
    for i in range(25):
        w.add(make_episode(rng, length=20 + i, policy_version=i // 10))
    w.close()
    out = _cli("inspect", str(tmp_path / "shards"), "--json")
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert (s["shards"], s["rows"]) == (3, 25)
    assert s["policy_versions"] == {"0": 10, "1": 10, "2": 5}
    assert s["length"]["min"] == 20 and s["length"]["max"] == 44
    text = _cli("inspect", f"file://{tmp_path}/{w.shards_written[0]}")
    assert text.returncode == 0 and "rows: 10" in text.stdout and "length histogram" in text.stdout
    store.write_bytes("shards/a/broken.parquet", b"nope")
    bad = _cli("inspect", str(tmp_path / "shards"))
    assert (
        bad.returncode == 1
        and f"INVALID file://{tmp_path}/shards/a/broken.parquet: corrupt" in bad.stdout
    )


def test_config_errors_exit_2_with_message():
    out = _cli("config", "--set", "actor.num_actors=-1")
    assert out.returncode == 2
    assert "actor.num_actors" in out.stderr and "greater than or equal to 1" in out.stderr


def test_config_prints_validated_json():
    out = _cli("config", "--config", "configs/demo.yaml", "--set", "learner.max_steps=7")
    assert out.returncode == 0
    assert json.loads(out.stdout)["learner"]["max_steps"] == 7
