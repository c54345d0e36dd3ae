"""Helpers shared by the environment tests: play episodes of `Action`s, random policies."""

from __future__ import annotations

import asyncio
import inspect
import random
from collections.abc import Awaitable, Callable

import pytest

from tunix_tasks.envs import Action, Environment, ToolCall
from tunix_tasks.messages import tool_argument_names

# What a text policy can write: printable ASCII and newline (the tokenizer is not involved).
_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))

PolicyFn = Callable[[str], Action | Awaitable[Action]]


async def rollout(
    env: Environment, policy_fn: PolicyFn, seed: int, max_turns: int
) -> tuple[float, int, list[Action]]:
    """Play one episode; returns (total_reward, turns, actions). ``policy_fn`` maps the
    latest observation to an `Action` and may be sync or async."""
    obs = await env.reset(seed)
    total, actions = 0.0, []
    for _ in range(max_turns):
        action = policy_fn(obs)
        if inspect.isawaitable(action):
            action = await action
        actions.append(action)
        result = await env.step(action)
        total += result.reward
        obs = result.observation
        if result.done:
            break
    return total, len(actions), actions


async def play(env: Environment, seed: int, actions: list[Action]):
    """(first observation, [StepResult per action]) of a scripted episode."""
    first = await env.reset(seed)
    return first, [await env.step(a) for a in actions]


def demo_policy(env: Environment, seed: int) -> PolicyFn:
    """A policy that replays ``env.demonstration(seed)``."""
    actions = iter(env.demonstration(seed))
    return lambda _obs: next(actions, Action())


def call(tool: str, **arguments: object) -> Action:
    """An action of one tool call."""
    return Action(tool_calls=(ToolCall(tool, arguments),))


def random_action(rng: random.Random, tools, max_chars: int = 16) -> Action:
    """Random text as the content, or (half the time, when there are tools) as the first
    argument of a call of a random tool."""
    text = "".join(rng.choices(_CHARS, k=rng.randint(1, max_chars)))
    if tools and rng.random() < 0.5:
        tool = rng.choice(list(tools))
        name, params = tool["function"]["name"], tool_argument_names(tool)
        return call(name, **{params[0]: text})
    return Action(content=text)


def random_baseline(make: Callable[[], Environment], seeds: range, max_turns: int) -> float:
    """Mean reward of a uniformly random text policy, episodes run concurrently."""

    async def run() -> list[float]:
        async def one(seed: int) -> float:
            rng = random.Random(10_000 + seed)
            env = make()
            total, _, _ = await rollout(
                env, lambda _o: random_action(rng, env.tools), seed, max_turns
            )
            return total

        return await asyncio.gather(*(one(s) for s in seeds))

    rewards = asyncio.run(run())
    return sum(rewards) / len(rewards)


@pytest.fixture
def run() -> Callable:
    return asyncio.run
