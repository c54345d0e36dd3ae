"""Helpers shared by the environment tests."""

from __future__ import annotations

import asyncio
import inspect
import random
from collections.abc import Awaitable, Callable

import pytest

from tunix_tasks.envs import ANSWER, TOOL, Environment
from tunix_tasks.policy.tokenizer import Tokenizer

_TOK = Tokenizer()
# What a policy can emit before END: the two action markers and every character.
_ACTION_IDS = [_TOK.tool_id, _TOK.answer_id] + [
    i for i in range(_TOK.vocab_size) if not _TOK.is_special(i)
]
assert _TOK.decode([_TOK.tool_id, _TOK.answer_id]) == TOOL + ANSWER

PolicyFn = Callable[[str], str | Awaitable[str]]


async def rollout(
    env: Environment, policy_fn: PolicyFn, seed: int, max_turns: int
) -> tuple[float, int, list[str]]:
    """Play one episode in text; returns (total_reward, turns, actions). ``policy_fn``
    maps the latest observation to an action and may be sync or async."""
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


def demo_policy(env: Environment, seed: int) -> PolicyFn:
    """A policy that replays ``env.demonstration(seed)``."""
    actions = iter(env.demonstration(seed))
    return lambda _obs: next(actions, "")


def random_action(rng: random.Random, max_tokens: int = 16) -> str:
    return _TOK.decode(rng.choices(_ACTION_IDS, k=rng.randint(1, max_tokens)))


def random_baseline(make: Callable[[], Environment], seeds: range, max_turns: int) -> float:
    """Mean reward of a uniformly random token policy, episodes run concurrently."""

    async def run() -> list[float]:
        async def one(seed: int) -> float:
            rng = random.Random(10_000 + seed)
            total, _, _ = await rollout(make(), lambda _o: random_action(rng), seed, max_turns)
            return total

        return await asyncio.gather(*(one(s) for s in seeds))

    rewards = asyncio.run(run())
    return sum(rewards) / len(rewards)


@pytest.fixture
def run() -> Callable:
    return asyncio.run
