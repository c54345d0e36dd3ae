"""The `arithmetic` environment: multi-digit questions, the calculator tool, exact reward."""

import asyncio
import collections
import re

import pytest

from tests.unit.envs.conftest import call, demo_policy, play, random_baseline, rollout
from tunix_tasks.actor.asynchronous.rollout import EpisodeLimits, ScriptedPolicy, play_episode
from tunix_tasks.envs import Action, ArithmeticEnv, ToolCall, make_env
from tunix_tasks.policy.tokenizer import CharChat


def operands(question: str) -> list[str]:
    return re.fullmatch(r"(\d+)[-+*](\d+)", question).groups()


def test_hand_checked_episode():
    env = ArithmeticEnv()
    question, answer = env.question_for(0)
    a, b = operands(question)
    assert answer == eval(question)  # plain integers and one operator: safe to check with
    actions = [call("calculate", expression=question), Action(content=f" {answer}\n")]
    first, res = asyncio.run(play(env, 0, actions))
    assert first == f"{question}=?" and 2 <= len(a) <= 4 and 2 <= len(b) <= 4
    assert res[0].observation == (str(answer),) and res[0].reward == 0 and not res[0].done
    assert res[0].info["kind"] == "tool"
    assert res[1].reward == 1.0 and res[1].done and res[1].observation == "correct"
    assert res[1].info == {"turns": 2, "kind": "answer", "used_tool": True}


def test_operand_lengths_ops_and_determinism():
    env = ArithmeticEnv()
    questions = [env.question_for(s)[0] for s in range(600)]
    assert questions == [ArithmeticEnv().question_for(s)[0] for s in range(600)]
    lengths = collections.Counter(len(x) for q in questions for x in operands(q))
    assert set(lengths) == {2, 3, 4} and min(lengths.values()) > 300  # each length ~1/3
    assert {op for q in questions for op in "+-*" if op in q} == {"+", "-", "*"}
    assert all(not x.startswith("0") for q in questions for x in operands(q))
    env = ArithmeticEnv(min_digits=3, max_digits=3, ops="*")
    assert all(re.fullmatch(r"\d{3}\*\d{3}", env.question_for(s)[0]) for s in range(50))
    assert asyncio.run(env.reset(7)) == f"{env.question_for(7)[0]}=?"
    for bad in [{"min_digits": 0}, {"min_digits": 3, "max_digits": 2}, {"ops": "/"}, {"ops": ""}]:
        with pytest.raises(ValueError):
            ArithmeticEnv(**bad)


def test_demonstrations_solve_every_seed():
    env = ArithmeticEnv()
    for seed in range(200):
        total, turns, _ = asyncio.run(rollout(env, demo_policy(env, seed), seed, 3))
        assert (total, turns) == (1.0, 2), seed
    question, answer = env.question_for(4)
    assert env.demonstration(4) == [
        Action(tool_calls=(ToolCall("calculate", {"expression": question}),)),
        Action(content=str(answer)),
    ]


def test_demonstrations_fit_the_char_policy_budget():
    """Through the actors' rollout and the char chat format, within configs/arithmetic.yaml's
    limits (12 new tokens a turn, 128 tokens an episode)."""
    chat = CharChat()
    limits = EpisodeLimits(max_turns=3, max_episode_tokens=128, max_new_tokens=12)

    async def demonstrate(seed: int):
        env = ArithmeticEnv()
        policy = ScriptedPolicy(env.demonstration(seed), chat)
        return await play_episode(env, policy, seed=seed, limits=limits, chat=chat)

    episodes = [asyncio.run(demonstrate(seed)) for seed in range(100)]
    assert all(ep.status == "ok" and ep.reward == 1.0 for ep in episodes)
    assert max(len(ep.tokens) for ep in episodes) <= 64  # one 64-token bucket holds them


def test_wrong_invalid_bad_calls_and_max_turns():
    env = ArithmeticEnv(max_turns=3)
    question, answer = env.question_for(1)
    _, res = asyncio.run(play(env, 1, [Action(content=str(answer + 1))]))
    assert res[0].reward == 0.0 and res[0].done and res[0].observation == "wrong"
    assert res[0].info["used_tool"] is False
    actions = [call("calc", expression=question), Action(content="sixty"), call("calculate")]
    _, res = asyncio.run(play(env, 1, actions))
    assert res[0].observation == ("error: unknown tool calc; available: calculate",)
    assert res[1].observation.startswith("invalid") and res[1].info["kind"] == "invalid"
    assert res[2].observation[0].startswith("error:") and "expression" in res[2].observation[0]
    assert [r.done for r in res] == [False, False, True] and sum(r.reward for r in res) == 0
    with pytest.raises(RuntimeError):
        asyncio.run(env.step(Action(content="1")))  # after max_turns: finished
    _, res = asyncio.run(play(env, 1, [call("calculate", expression="__import__('os')")]))
    assert res[0].observation[0].startswith("error:") and not res[0].done


def test_the_tool_is_needed():
    """Without the tool nothing simple works: a random policy scores ~0, and no constant
    answer is right for more than 1% of questions (answers are spread out)."""
    assert random_baseline(lambda: make_env("arithmetic"), range(200), max_turns=3) < 0.02
    env = ArithmeticEnv()
    answers = collections.Counter(env.question_for(s)[1] for s in range(2000))
    assert answers.most_common(1)[0][1] / 2000 < 0.01
