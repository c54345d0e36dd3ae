"""Helpers shared by the environment tests."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest

from tunix_tasks.envs import Environment, rollout
from tunix_tasks.policy.tokenizer import ANSWER, TOOL, Tokenizer

_TOK = Tokenizer()
# What a policy can emit before END: the two action markers and every character.
_ACTION_IDS = [_TOK.tool_id, _TOK.answer_id] + [
    i for i in range(_TOK.vocab_size) if not _TOK.is_special(i)
]
assert _TOK.decode([_TOK.tool_id, _TOK.answer_id]) == TOOL + ANSWER


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
