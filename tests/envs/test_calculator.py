import asyncio

import pytest

from tests.envs.conftest import demo_policy, random_baseline, rollout
from tunix_tasks.envs import CalculatorEnv, make_env
from tunix_tasks.envs.calculator import ToolError, safe_eval
from tunix_tasks.policy.tokenizer import ANSWER, TOOL


async def _play(env, seed, actions):
    first = await env.reset(seed)
    return first, [await env.step(a) for a in actions]


def test_safe_eval():
    assert safe_eval("23+45") == 68
    assert safe_eval(" 7*-3 - 2 ") == -23
    assert safe_eval("9//2=?") == 4
    for bad in ["__import__('os')", "2**10", "1/2", "x+1", "1.5+1", "", "9//0", "(" * 200 + "1"]:
        with pytest.raises(ToolError):
            safe_eval(bad)


def test_hand_checked_episode():
    env = CalculatorEnv()
    question, answer = env._question_for(0)
    first, res = asyncio.run(_play(env, 0, [f"{TOOL}{question}", f"{ANSWER}{answer}"]))
    assert first == f"{question}=?"
    assert res[0].observation == str(answer) and res[0].reward == 0 and not res[0].done
    assert res[1].reward == 1.0 and res[1].done and res[1].observation == "correct"


def test_wrong_malformed_and_max_turns():
    env = CalculatorEnv(max_turns=3)
    _, answer = env._question_for(1)
    _, res = asyncio.run(_play(env, 1, [f"{ANSWER}{answer + 1}"]))
    assert res[0].reward == 0.0 and res[0].done and res[0].observation == "wrong"
    _, res = asyncio.run(_play(env, 1, [f"{TOOL}os.system('x')", "68", f"{ANSWER}sixty"]))
    assert res[0].observation.startswith("error:") and not res[0].done
    assert res[1].observation.startswith("invalid") and not res[1].done
    assert res[2].observation.startswith("invalid") and res[2].done  # max_turns
    assert sum(r.reward for r in res) == 0.0


def test_difficulty_determinism_and_demonstration():
    q1 = [CalculatorEnv(difficulty=1)._question_for(s)[0] for s in range(100)]
    assert q1 == [CalculatorEnv(difficulty=1)._question_for(s)[0] for s in range(100)]
    assert all(len(p) == 1 for q in q1 for p in q.replace("-", "+").replace("*", "+").split("+"))
    env = CalculatorEnv(difficulty=3, ops="*")
    assert "*" in asyncio.run(env.reset(7))
    for seed in range(50):
        assert asyncio.run(rollout(env, demo_policy(env, seed), seed, 3))[0] == 1.0
    with pytest.raises(ValueError):
        CalculatorEnv(ops="/")


def test_random_baseline_is_low():
    mean = random_baseline(lambda: make_env("calculator"), range(200), max_turns=3)
    print(f"calculator random-policy mean reward over 200 seeds: {mean:.3f}")
    assert mean < 0.05
