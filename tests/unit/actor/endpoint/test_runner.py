"""Tests for tunix_tasks.actor.endpoint.runner: loading a program, and a group of its
copies against the real endpoint: tasks from the env, rewards, failures dropped."""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.actor.endpoint.harness import endpoint
from tunix_tasks.actor.endpoint.runner import AgentRunner, load_program
from tunix_tasks.envs import make_env


async def answer_or_fail(client, task) -> float:
    """One turn; copies whose seed is odd fail after it, the others grade the answer."""
    r = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": task["prompt"]}], max_tokens=4
    )
    if task["seed"] % 2:
        raise RuntimeError("the agent crashed")
    if task["seed"] == 6:
        return 3e38  # a number no shard may hold
    return await task["grade"](r.choices[0].message.content or "") + 0.5


def sync_program(client, task):
    return 1.0


@pytest.mark.parametrize(
    ("path", "needle"),
    [
        ("no_such_module_xyz:run", "cannot import no_such_module_xyz"),
        (f"{__name__}:missing", "has no 'missing'"),
        (f"{__name__}:sync_program", "not an async function"),
    ],
)
def test_load_program_names_what_is_wrong(path, needle):
    with pytest.raises(ValueError, match=needle):
        load_program(path)


def test_a_group_runs_its_copies_and_drops_the_ones_that_fail():
    assert load_program(f"{__name__}:answer_or_fail") is answer_or_fail

    async def run():
        async with endpoint() as ep:
            runner = AgentRunner(answer_or_fail, ep.registry, ep.url, connections=4)
            try:
                envs = [make_env("calculator") for _ in range(3)]
                await runner.play_group("even", seed=4, envs=envs)
                await runner.play_group("odd", seed=7, envs=[make_env("calculator")])
                await runner.play_group("huge", seed=6, envs=[make_env("calculator")])
            finally:
                await runner.aclose()
            return ep

    ep = asyncio.run(run())
    [group] = ep.groups  # the odd and huge groups lost their only member: nothing to write
    assert len(group) == 3 and {e.seed for e in group} == {4}
    assert all(e.reward in (0.5, 1.5) for e in group)  # the env's grade (0 or 1) + 0.5
    assert len({e.group_id for e in group}) == 1
    assert ep.registry.dropped["agent_error"] == 2 and len(ep.registry) == 0


CANCELLED: list[int] = []


async def hangs(client, task) -> float:
    """Never calls the endpoint and never returns (a stuck tool, a lost await)."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        CANCELLED.append(task["seed"])
        raise
    return 1.0


def test_a_program_whose_episode_was_abandoned_is_cancelled_not_left_running():
    async def run():
        async with endpoint(timeout_s=0.3) as ep:
            runner = AgentRunner(hangs, ep.registry, ep.url, connections=2)
            try:
                await asyncio.wait_for(
                    runner.play_group("stuck", seed=9, envs=[make_env("calculator")]), 30
                )
            finally:
                await runner.aclose()
            return ep

    CANCELLED.clear()
    ep = asyncio.run(run())
    assert CANCELLED == [9]  # the program was cancelled when its episode was dropped
    assert ep.registry.dropped["abandoned"] == 1 and len(ep.registry) == 0
    assert ep.groups == []  # nothing written for it
