"""Tests for tunix_tasks.actor.endpoint.actor: `actor.kind: agent` runs the example agent
(examples/openai_agent, plain `openai` client, no tunix_tasks import) against its own
endpoint on a real store, and writes shards the learner reads, with exact log-probs."""

from __future__ import annotations

import numpy as np

from tests.paths import REPO
from tests.unit.actor.test_actor import (
    LOGPROB_ATOL,
    _config,
    _peaky,
    _publish,
    _read_episodes,
    _recompute_logprobs,
    _Running,
)
from tunix_tasks.actor.endpoint.actor import AgentActor
from tunix_tasks.frontdoor.entrypoints import ACTOR_KINDS
from tunix_tasks.storage.metrics import read_metrics
from tunix_tasks.storage.runs import mark_done, write_config

EXAMPLE = REPO / "examples" / "openai_agent"


def test_agent_actor_trains_the_example_agent_through_its_endpoint(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    assert ACTOR_KINDS["agent"] == "tunix_tasks.actor.endpoint.actor:AgentActor"
    assert "tunix_tasks" not in (EXAMPLE / "calculator_agent.py").read_text()
    cfg = _config(
        f"file://{tmp_path}",
        env={"name": "calculator", "max_turns": 3},
        kind="agent",
        agent={"program": "calculator_agent:run"},
        max_episode_tokens=96,
    )
    store = write_config(cfg)
    v0 = _peaky(123, cfg)
    _publish(store, cfg, v0, version=0)
    actor = AgentActor(cfg, store, actor_id="actor-agent")
    run = _Running(actor)
    run.episodes_at_least(8)
    assert actor.endpoint_url.startswith("http://127.0.0.1:")
    mark_done(store, "test finished")
    summary = run.join()

    assert summary["stop_reason"].startswith("run done")
    episodes = _read_episodes(store)  # the learner's validating reader
    assert len(episodes) == summary["episodes"] >= 8
    assert {e.env for e in episodes} == {"calculator"} and {e.policy_version for e in episodes} == {
        0
    }
    groups: dict[str, set[int]] = {}
    for e in episodes:
        groups.setdefault(e.group_id, set()).add(e.seed)
        assert e.loss_mask.sum() > 0 and e.length <= cfg.actor.max_episode_tokens
    assert all(len(seeds) == 1 for seeds in groups.values())
    assert all(sum(e.group_id == g for e in episodes) == cfg.actor.group_size for g in groups)

    recorded, fresh = _recompute_logprobs(cfg, v0, episodes[:16])
    np.testing.assert_allclose(recorded, fresh, atol=LOGPROB_ATOL, rtol=0)
    _, wrong = _recompute_logprobs(cfg, _peaky(0, cfg), episodes[:16])
    assert np.abs(recorded - wrong).max() > 1e-2

    final = [
        r for r in read_metrics(store) if r.get("final") and r.get("actor_id") == "actor-agent"
    ]
    assert final and final[-1]["endpoint_requests"] >= summary["episodes"]
    assert final[-1]["endpoint_dropped"]["agent_error"] == 0
