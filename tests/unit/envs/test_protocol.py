"""Every built-in environment keeps the message protocol of tunix_tasks/envs/base.py."""

import asyncio

import pytest

from tests.unit.envs.conftest import demo_policy, rollout
from tunix_tasks.envs import Action, Environment, check_tools, make_env

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
