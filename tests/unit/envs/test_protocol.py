"""Every built-in environment keeps the message protocol of tunix_tasks/envs/base.py."""

import asyncio

import pytest

from tests.unit.envs.conftest import demo_policy, rollout
from tunix_tasks.envs import Action, Environment, StepResult, ToolCall, check_tools, make_env

BUILTINS = ["arithmetic", "calculator", "guess_number", "python_exec", "reasoning_gym"]


@pytest.mark.parametrize("name", BUILTINS)
def test_tools_are_openai_function_schemas(name):
    env = make_env(name)
    assert isinstance(env, Environment) and env.name == name
    check_tools(env.tools, name)
    for tool in env.tools:
        assert tool["type"] == "function"
        fn = tool["function"]
        assert isinstance(fn["name"], str) and fn["name"].isidentifier()
        assert isinstance(fn["description"], str) and fn["description"]
        params = fn["parameters"]
        assert params["type"] == "object"
        assert params["properties"] and all(
            p["type"] == "string" and p["description"] for p in params["properties"].values()
        )
        assert params["required"] == list(params["properties"])


def test_the_builtin_tools():
    names = {n: [t["function"]["name"] for t in make_env(n).tools] for n in BUILTINS}
    assert names == {
        "arithmetic": ["calculate"],
        "calculator": ["calculate"],
        "guess_number": [],
        "python_exec": ["run_python"],
        "reasoning_gym": [],  # its calculator is opt-in: `tools="calculator"`
    }


@pytest.mark.parametrize("name", BUILTINS)
def test_demonstrations_earn_the_max_reward(name):
    seeds = range(8)
    env = make_env(name)
    offered = {t["function"]["name"] for t in env.tools}
    for seed in seeds:
        actions = env.demonstration(seed)
        assert actions and all(isinstance(a, Action) and a.error is None for a in actions)
        assert all(c.name in offered for a in actions for c in a.tool_calls)

    async def one(seed: int) -> float:
        env = make_env(name)  # a fresh instance per episode, as actors do
        return (await rollout(env, demo_policy(env, seed), seed, env.max_turns))[0]

    async def all_seeds() -> list[float]:
        return list(await asyncio.gather(*(one(s) for s in seeds)))

    assert asyncio.run(all_seeds()) == [1.0] * len(seeds)  # 1.0 is each env's max reward


def test_a_turns_tool_results_answer_each_call_or_all_at_once():
    calls = (ToolCall("f", {}, id="t0001c000"), ToolCall("g", {}, id="t0001c001"))
    turn = Action(tool_calls=calls)
    assert turn.replies(("1", "2")) == [
        {"role": "tool", "content": "1", "tool_call_id": "t0001c000"},
        {"role": "tool", "content": "2", "tool_call_id": "t0001c001"},
    ]
    # one string answers them all, naming the first call (environments before per-call results)
    assert turn.replies("1 and 2") == [
        {"role": "tool", "content": "1 and 2", "tool_call_id": "t0001c000"}
    ]
    assert Action(content="4").replies("right") == [{"role": "user", "content": "right"}]
    for wrong in [("1",), ("1", "2", "3")]:
        with pytest.raises(ValueError, match="one result per call"):
            turn.replies(wrong)
    with pytest.raises(ValueError, match="a turn without tool calls: answer it with one string"):
        Action(content="4").replies(("right",))


def test_a_step_result_holds_a_string_or_one_string_per_call():
    assert StepResult(["1", "2"], 0.0, False).observation == ("1", "2")  # a list reads as a tuple
    assert StepResult("1", 0.0, False).observation == "1"
    for bad in [b"1", ["1", 2], None, 7]:
        with pytest.raises(TypeError, match="one string per tool call"):
            StepResult(bad, 0.0, False)


def test_sorting_swaps_a_turns_calls_in_order():
    env = make_env("sorting", length=4)
    row = asyncio.run(env.reset(3))
    calls = tuple(ToolCall("swap", {"positions": p}) for p in ("01", "11", "12"))
    result = asyncio.run(env.step(Action(tool_calls=calls)))
    one = row[1] + row[0] + row[2:]
    two = one[0] + one[2] + one[1] + one[3]
    assert result.observation == (
        one,
        "error: give two different positions from 0 to 3, e.g. 01",
        two,
    )
    assert not result.done
