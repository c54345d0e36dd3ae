import asyncio

import pytest

from tests.unit.envs.conftest import call, demo_policy, play, random_baseline, rollout
from tunix_tasks.envs import Action, Environment, GuessNumberEnv, make_env


def _say(*texts: str) -> list[Action]:
    return [Action(content=t) for t in texts]


def test_protocol_and_hand_checked_rewards():
    env = GuessNumberEnv()
    assert isinstance(env, Environment) and env.tools == ()
    target = env._target_for(3)
    first, results = asyncio.run(play(env, 3, _say(str(target - 1), str(target + 1), str(target))))
    assert first == "Guess a number from 1 to 16."
    assert [r.observation for r in results] == ["higher", "lower", "correct"]
    assert [r.reward for r in results] == [0.0, 0.0, 1.0]
    assert [r.done for r in results] == [False, False, True]
    with pytest.raises(RuntimeError):
        asyncio.run(env.step(Action(content="1")))


def test_malformed_tool_calls_and_max_turns():
    env = GuessNumberEnv(max_turns=4)
    target = env._target_for(5)
    _, res = asyncio.run(play(env, 5, _say(f"  {target}\n")))
    assert res[0].reward == 1.0 and res[0].done
    wrong = str(target % 16 + 1)
    actions = [*_say("eight", "<|answer|>8"), call("guess", n=str(target)), *_say(wrong)]
    _, res = asyncio.run(play(env, 5, actions))
    assert res[0].observation.startswith("invalid") and not res[0].done
    assert res[0].info["valid"] is False
    assert res[1].observation.startswith("invalid")  # markers mean nothing to the env
    assert res[2].observation[0].startswith("invalid: there are no tools")  # the turn is spent
    assert res[2].reward == 0.0 and res[2].info["valid"] is False
    assert res[3].reward == 0.0 and res[3].done  # max_turns reached


def test_discount():
    env = GuessNumberEnv(discount=0.5)
    target = env._target_for(9)
    _, res = asyncio.run(play(env, 9, _say("0", "17", str(target))))
    assert res[-1].reward == pytest.approx(0.25)


def test_determinism_and_demonstration():
    env = GuessNumberEnv()
    targets = [env._target_for(s) for s in range(200)]
    assert targets == [GuessNumberEnv()._target_for(s) for s in range(200)]
    assert set(targets) == set(range(1, 17))
    for seed in range(50):
        demo = env.demonstration(seed)
        assert len(demo) <= 5 and all(not a.tool_calls for a in demo)
        total, _, _ = asyncio.run(rollout(env, demo_policy(env, seed), seed, max_turns=6))
        assert total == 1.0


def test_random_baseline_is_low():
    mean = random_baseline(lambda: make_env("guess_number"), range(200), max_turns=6)
    print(f"guess_number random-policy mean reward over 200 seeds: {mean:.3f}")
    assert mean < 0.1
