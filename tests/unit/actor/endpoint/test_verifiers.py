"""A `verifiers` environment drives the endpoint through verifiers' own rollout code
(`verifiers_rollouts.py`, run by `.venv-verifiers`: verifiers 0.4.0 needs openai<3): a
single-turn environment scored by its reward function and a tool environment with an MCP
calculator. Every rollout is one closed episode whose policy tokens are exactly the sampled
ids, with log-probs equal to the learner's recomputation (staleness 0)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from tests.unit.actor.endpoint.harness import endpoint
from tests.unit.actor.endpoint.test_choices import check_exact
from tests.unit.actor.endpoint.test_server import policy_spans

ROOT = Path(__file__).resolve().parents[4]
VF_PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
SCRIPT = Path(__file__).with_name("verifiers_rollouts.py")

pytestmark = pytest.mark.skipif(
    not VF_PYTHON.exists(), reason="no .venv-verifiers: `make venv-verifiers` (make test builds it)"
)


def test_verifiers_environments_train_through_the_endpoint(tmp_path):
    async def run():
        async with endpoint(max_new_tokens=24) as ep:
            proc = await asyncio.create_subprocess_exec(
                str(VF_PYTHON),
                str(SCRIPT),
                "--episodes-url",
                ep.url,
                "--model",
                "tiny-qwen3",
                cwd=tmp_path,
                env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), timeout=600)
            assert proc.returncode == 0, err.decode()[-3000:]
            return ep, [json.loads(line) for line in out.decode().splitlines()]

    ep, rollouts = asyncio.run(run())
    assert [r["env"] for r in rollouts] == ["single", "single", "tool"]
    assert all(r["ok"] and r["close"] == {"status": "closed"} for r in rollouts), rollouts
    assert rollouts[2]["tools"] == ["calc_evaluate"]
    episodes = {e.episode_id: e for group in ep.groups for e in group}
    assert set(episodes) == {r["episode_id"] for r in rollouts}
    for r in rollouts:
        episode = episodes[r["episode_id"]]
        assert episode.reward == r["reward"] and episode.num_turns >= 1
        assert len(policy_spans(episode)) == episode.num_turns
    text = ep.chat.tokenizer.decode(episodes[rollouts[2]["episode_id"]].tokens.tolist())
    assert '"name": "calc_evaluate"' in text and "17*23" in text  # the tool, rendered once
    check_exact(ep, list(episodes.values()))
