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
    assert 0.2 <= elapsed < 1.6  # overlapped: sequential would take 3.2 s


def test_a_latency_schedule_changes_the_delay_for_every_env_of_a_run_at_once(tmp_path):
    """`env.latency_schedule` counts from the run's preparation (config.json's time), so
    an env built late (an actor the autopilot started) sees the same phase as the first."""
    from tunix_tasks.config import RunConfig
    from tunix_tasks.envs import make_env
    from tunix_tasks.storage.runs import prepared_at, write_config

    cfg = RunConfig.model_validate(
        {
            "store": f"file://{tmp_path}",
            "env": {"latency_s": 0.2, "latency_schedule": [[60, 2.0], [120, 0.0]]},
        }
    )
    t0 = prepared_at(write_config(cfg))
    assert t0 is not None and abs(t0 - time.time()) < 60
    env = make_env("calculator", latency_schedule=cfg.env.latency_schedule, started_at=t0)
    assert isinstance(env, LatencyWrapper)  # a schedule alone wraps
    assert [env.current_latency(t0 + dt) for dt in (0, 59.9, 60, 119, 120, 1e6)] == [
        0.0,
        0.0,
        2.0,
        2.0,
        0.0,
        0.0,
    ]
    late = make_env(
        "calculator", latency_s=0.2, latency_schedule=cfg.env.latency_schedule, started_at=t0
    )
    assert late.current_latency(t0 + 30) == 0.2 and late.current_latency(t0 + 90) == 2.0


@pytest.mark.parametrize(
    "schedule",
    [[[60, 1.0], [30, 2.0]], [[60, 1.0], [60, 2.0]], [[-1, 1.0]], [[10, -0.5]]],
)
def test_a_latency_schedule_out_of_order_or_negative_is_refused(schedule):
    from tunix_tasks.config import RunConfig

    with pytest.raises(ValueError, match=r"env\.latency_schedule"):
        RunConfig.model_validate({"env": {"latency_schedule": schedule}})
