"""End-to-end with a Hugging Face checkpoint: `tunix-tasks train --config configs/qwen3-tiny.yaml`
(the committed tiny Qwen3, 2 actors, the multi-turn calculator tool env) on gs://
(fake-gcs-server), the checkpoint itself read from the bucket too. One run: a checkpoint on
a local path is what the unit tests load (tests/unit/policy/), and a train run on file://
is every other end-to-end test's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.paths import REPO
from tunix_tasks.learner.source import EpisodeSource
from tunix_tasks.storage.runs import is_done
from tunix_tasks.storage.store import open_store
from tunix_tasks.storage.weights import load_snapshot, read_latest
from tunix_tasks.testing.shard_factory import block_episodes

pytestmark = pytest.mark.slow

CHECKPOINT = REPO / "tests" / "fixtures" / "hf" / "tiny-qwen3"
IM_START, IM_END = 392, 393  # ids in the fixture's tokenizer


def _checkpoint_uri(store_uri: str) -> str:
    """The fixture checkpoint copied into the bucket."""
    dst = open_store(f"{store_uri}/models/tiny-qwen3")
    for f in CHECKPOINT.iterdir():
        dst.write_bytes(f.name, f.read_bytes())
    return f"{store_uri}/models/tiny-qwen3"


def test_train_qwen3_checkpoint_end_to_end(tmp_path, gcs_server):
    store_uri = gcs_server.new_bucket_uri()
    cmd = [sys.executable, "-m", "tunix_tasks.frontdoor.cli", "train", "--quiet", "--json"]
    cmd += ["--config", str(REPO / "configs" / "qwen3-tiny.yaml"), "--store", store_uri]
    cmd += ["--set", f"model.checkpoint={_checkpoint_uri(store_uri)}"]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}  # its logs: not ~/.cache
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads(out.stdout[out.stdout.index("\n{") + 1 :])
    assert summary["learner_exit_code"] == 0 and summary["actor_exit_codes"] == [0, 0]
    store = open_store(summary["run_uri"])
    assert is_done(store)["reason"].startswith("learner max_steps")
    version = read_latest(store)[0]
    flat, manifest = load_snapshot(store, version)
    assert manifest.model["family"] == "qwen3" and manifest.model["tie_embeddings"]
    assert "unembed" not in flat and "blocks/0/attn/q_norm/scale" in flat

    # The shards hold chat-template episodes: multi-turn, tool responses in the
    # template's own tokens, sampled tokens only under the loss mask.
    episodes = block_episodes(EpisodeSource(store, vocab_size=400).poll(max_shards=100_000))
    assert episodes, "no episodes read back"
    multi = [ep for ep in episodes if ep.num_turns >= 2]
    assert multi, [ep.num_turns for ep in episodes]
    for ep in multi:
        assert ep.tokens[0] == IM_START and (ep.tokens == IM_END).sum() >= 4
        assert ep.loss_mask[: list(ep.tokens).index(IM_END) + 1].sum() == 0  # the prompt
