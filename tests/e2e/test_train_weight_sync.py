"""End to end: a LoRA run syncs adapters only, through `tunix-tasks train` with real actor
and learner processes. (Full fine-tuning with deltas between full snapshots is the sync
run's of tests/e2e/test_train_e2e.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_train_e2e import _cmd, _run
from tunix_tasks.config import ModelConfig
from tunix_tasks.policy.build import build_policy
from tunix_tasks.policy.params import param_count
from tunix_tasks.storage.metrics import read_metrics
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.weights import read_latest, read_manifest

pytestmark = pytest.mark.slow


def _train(tmp_path: Path, run_name: str, *extra: str):
    summary = _run(_cmd(str(tmp_path / "runs"), run_name, "learner.max_steps=10", *extra), tmp_path)
    assert summary["learner_exit_code"] == 0 and summary["actor_exit_codes"] == [0, 0]
    return summary, open_store(summary["run_uri"])


def test_lora_run_syncs_adapters_only(tmp_path):
    _, store = _train(tmp_path, "lora", "model.lora_rank=4", "model.lora_targets=[q,v,up]")
    latest = read_latest(store)[0]
    manifest = read_manifest(store, latest)
    assert manifest.kind == "adapter" and manifest.base["fingerprint"]
    _, model = build_policy(ModelConfig(preset="tiny"))
    assert manifest.num_bytes < 0.1 * 4 * param_count(model)  # vs the full float32 params
    records = [r for r in read_metrics(store, "actor/") if r.get("reload_bytes")]
    assert records and max(r["weights_version"] for r in records) >= 2  # reloaded v2+
    assert max(r["reload_bytes"] for r in records) <= manifest.num_bytes  # adapters only
    assert all(r["publish_to_reload_s"] < 60 for r in records)
    page = store.read_bytes("report/index.html").decode()
    assert "Publish -&gt; actor reload latency" in page and "Weights version in use" in page
