"""`BatchingPolicy` once its engine thread has stopped: requests fail, nothing waits."""

from __future__ import annotations

import asyncio

import pytest

from tunix_tasks.actor.asynchronous.batching import BatchingPolicy
from tunix_tasks.config import ModelConfig
from tunix_tasks.policy.build import build_policy
from tunix_tasks.policy.sampling import Sampler


def test_requests_the_stopped_engine_cannot_answer_fail_instead_of_waiting():
    # A task that outlived its cancellation (asyncio.wait_for on Python 3.11) awaited a
    # request the stopped engine never answered, and its actor never finished stopping.
    chat, model = build_policy(ModelConfig(preset="tiny"), seed=0)
    sampler = Sampler(model, pad_id=chat.tokenizer.pad_id, stop_ids=chat.stop_ids, segment_steps=1)
    policy = BatchingPolicy(sampler, max_new_tokens=100, seed=0)

    async def run() -> None:
        async with policy:
            cut_short = asyncio.create_task(policy.sample([1, 2, 3]))
            while policy.calls < 2:  # a token a step: the request is far from done
                await asyncio.sleep(0.001)
        with pytest.raises(RuntimeError, match="engine has stopped"):
            await asyncio.wait_for(cut_short, 10)
        with pytest.raises(RuntimeError, match="engine is stopping"):
            await policy.sample([1, 2, 3])

    asyncio.run(run())
