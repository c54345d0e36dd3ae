import asyncio
import random
import time

import pytest

from tunix_tasks.envs import Action, LatencyWrapper, make_env


def test_jitter_range_and_fixed():
    w = LatencyWrapper(make_env("guess_number"), 0.2, 0.5, random.Random(0))
    samples = [w.sample_delay() for _ in range(1000)]
    assert 0.1 <= min(samples) < 0.12 and 0.28 < max(samples) <= 0.3
    assert LatencyWrapper(make_env("guess_number"), 0.2).sample_delay() == 0.2
    assert w.max_turns == 6  # attributes pass through
    assert w.tools == () and w.name == "guess_number"
    calc = make_env("calculator", latency_s=0.01)
    assert isinstance(calc, LatencyWrapper) and calc.tools == calc.env.tools
    assert calc.tools[0]["function"]["name"] == "calculate"
    with pytest.raises(ValueError):
        LatencyWrapper(make_env("guess_number"), 0.1, 1.5)


def test_concurrent_steps_overlap():
    envs = [make_env("guess_number", latency_s=0.2) for _ in range(16)]

    async def run() -> float:
        await asyncio.gather(*(e.reset(i) for i, e in enumerate(envs)))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(e.step(Action(content="8")) for e in envs))
        assert len(results) == 16
        return time.perf_counter() - t0

    elapsed = asyncio.run(run())
    print(f"16 concurrent steps at 0.2 s latency: {elapsed:.3f} s")
    assert 0.2 <= elapsed < 0.8  # sequential would take 3.2 s
