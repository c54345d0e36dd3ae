import asyncio

import pytest

from tests.unit.envs.conftest import call, demo_policy, play, random_baseline, rollout
from tunix_tasks.envs import Action, CalculatorEnv, ToolCall, make_env
from tunix_tasks.envs.calculator import ToolError, safe_eval


def test_safe_eval():
    assert safe_eval("23+45") == 68
    assert safe_eval(" 7*-3 - 2 ") == -23
    assert safe_eval("9//2=?") == 4
    for bad in ["__import__('os')", "2**10", "1/2", "x+1", "1.5+1", "", "9//0", "(" * 200 + "1"]:
        with pytest.raises(ToolError):
            safe_eval(bad)


def test_hand_checked_episode():
    env = CalculatorEnv()
    question, answer = env.question_for(0)
    actions = [call("calculate", expression=question), Action(content=f" {answer}\n")]
    first, res = asyncio.run(play(env, 0, actions))
    assert first == f"{question}=?"
    assert res[0].observation == (str(answer),) and res[0].reward == 0 and not res[0].done
    assert res[0].info["kind"] == "tool"
    assert res[1].reward == 1.0 and res[1].done and res[1].observation == "correct"
    assert res[1].info == {"turns": 2, "kind": "answer", "used_tool": True}


def test_each_tool_call_of_a_turn_is_evaluated_and_answered():
    env = CalculatorEnv()
    calls = (
        ToolCall("calculate", {"expression": "2+3"}),
        ToolCall("calc", {"expression": "1"}),
        ToolCall("calculate", {"expression": "9*9"}),
    )
    _, res = asyncio.run(play(env, 0, [Action(content="let me see", tool_calls=calls)]))
    assert res[0].observation == ("5", "error: unknown tool calc; available: calculate", "81")
    assert not res[0].done and res[0].info["kind"] == "tool"


def test_bad_tool_calls_are_answered_with_errors():
    env = CalculatorEnv(max_turns=4)
    actions = [
        call("calc", expression="1+1"),  # unknown tool
        call("calculate"),  # missing argument
        call("calculate", expression=12),  # not a string
        call("calculate", expr="1+1"),  # wrong argument name
    ]
    _, res = asyncio.run(play(env, 2, actions))
    assert res[0].observation == ("error: unknown tool calc; available: calculate",)
    (two,), (three,), (four,) = (r.observation for r in res[1:])
    assert two.startswith("error:") and "expression" in two
    assert three.startswith("error:") and "string" in three
    assert four.startswith("error:") and "expression" in four
    assert [r.done for r in res] == [False, False, False, True]  # the last hits max_turns
    assert all(r.reward == 0.0 and r.info["kind"] == "tool" for r in res)


def test_wrong_malformed_and_max_turns():
    env = CalculatorEnv(max_turns=3)
    _, answer = env.question_for(1)
    _, res = asyncio.run(play(env, 1, [Action(content=str(answer + 1))]))
    assert res[0].reward == 0.0 and res[0].done and res[0].observation == "wrong"
    assert res[0].info["used_tool"] is False
    actions = [call("calculate", expression="os.system('x')"), Action(), Action(content="sixty")]
    _, res = asyncio.run(play(env, 1, actions))
    assert res[0].observation[0].startswith("error:") and not res[0].done
    assert res[1].observation == "invalid: call calculate or answer with an integer"
    assert not res[1].done and res[1].info["kind"] == "invalid"
    assert res[2].observation.startswith("invalid") and res[2].done  # max_turns
    assert sum(r.reward for r in res) == 0.0


def test_difficulty_determinism_and_demonstration():
    q1 = [CalculatorEnv(difficulty=1).question_for(s)[0] for s in range(100)]
    assert q1 == [CalculatorEnv(difficulty=1).question_for(s)[0] for s in range(100)]
    assert all(len(p) == 1 for q in q1 for p in q.replace("-", "+").replace("*", "+").split("+"))
    env = CalculatorEnv(difficulty=3, ops="*")
    assert "*" in asyncio.run(env.reset(7))
    for seed in range(50):
        assert asyncio.run(rollout(env, demo_policy(env, seed), seed, 3))[0] == 1.0
    question, answer = env.question_for(4)
    assert env.demonstration(4) == [
        Action(tool_calls=(ToolCall("calculate", {"expression": question}),)),
        Action(content=str(answer)),
    ]
    with pytest.raises(ValueError):
        CalculatorEnv(ops="/")


def test_random_baseline_is_low():
    mean = random_baseline(lambda: make_env("calculator"), range(200), max_turns=3)
    print(f"calculator random-policy mean reward over 200 seeds: {mean:.3f}")
    assert mean < 0.05
