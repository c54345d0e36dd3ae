"""Held-out evaluation of an `actor.kind: agent` run plays the run's agent program itself
(actor/endpoint/evaluation.py through frontdoor/evaluate.py): every seed is one episode
of the program against a private endpoint, greedy, its return value the reward, and an
episode the program fails is scored 0 under its own status."""

from __future__ import annotations

import pytest

from tests.paths import HF_FIXTURES
from tunix_tasks.config import config_from_dict
from tunix_tasks.frontdoor.evaluate import evaluate_params, held_out_seeds

PLAYED: list[tuple[int, str, float]] = []  # (seed, reply, reward) per program episode


async def answer(client, task) -> float:
    """Ask once; odd seeds fail after the turn, the others get a reward from the reply."""
    r = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task["prompt"]}]
    )
    reply = r.choices[0].message.content or ""
    if task["seed"] % 2:
        raise RuntimeError("the agent crashed")
    reward = 0.5 + len(reply) / 1000 + await task["grade"](reply)
    PLAYED.append((task["seed"], reply, reward))
    return reward


def _config(**actor):
    return config_from_dict(
        {
            "model": {"checkpoint": str(HF_FIXTURES / "tiny-qwen3"), "max_seq_len": 256},
            "env": {
                "name": "reasoning_gym",
                "max_turns": 1,
                "kwargs": {"task": "chain_sum", "answer_format": "last_number"},
            },
            "actor": {"max_new_tokens": 12, "max_episode_tokens": 256, **actor},
        }
    )


def test_an_agent_run_is_scored_by_its_program_greedily_and_failures_score_zero():
    cfg = _config(kind="agent", agent={"program": f"{__name__}:answer"})
    seeds = held_out_seeds(6)
    runs = []
    for _ in range(2):
        PLAYED.clear()
        result = evaluate_params(cfg, None, seeds)
        runs.append(sorted(PLAYED))
        assert result["harness"] == "program" and result["episodes"] == 6
        assert result["status"] == {"ok": 3, "agent_error": 3}
        # the program's own rewards (0.5 + ...), the failed episodes' 0s, over all seeds
        assert result["reward_mean"] == pytest.approx(sum(r for *_, r in PLAYED) / 6)
        assert result["turns_mean"] == pytest.approx(0.5)  # one turn each, 0 for a drop
    assert [s for s, *_ in runs[0]] == [s for s in seeds if s % 2 == 0]
    assert runs[0] == runs[1]  # greedy: the same replies both times


def test_the_harness_is_checked_before_any_model_is_built():
    with pytest.raises(ValueError, match=r"harness 'agents': expected one of \['env', 'program'\]"):
        evaluate_params(_config(), None, [1], harness="agents")
    with pytest.raises(ValueError, match=r"needs actor\.agent\.program"):
        evaluate_params(_config(), None, [1], harness="program")
