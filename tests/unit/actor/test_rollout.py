"""Tests for tunix_tasks.actor.asynchronous.rollout: the episode token layout and how episodes end.

Real environments registered through `tunix_tasks.envs.register_env` (unique names) are
built with `make_env` and driven by a scripted policy that returns fixed actions with
known, negative log-probs, so the layout, loss mask and log-probs can be checked exactly.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

import numpy as np
import pytest

from tunix_tasks.actor.asynchronous.rollout import EpisodeLimits, ScriptedPolicy, play_episode
from tunix_tasks.envs import Action, StepResult, make_env, register_env
from tunix_tasks.policy.tokenizer import CharChat, CharTokenizer

TOK = CharTokenizer()
CHAT = CharChat(TOK)


def _unique(prefix: str) -> str:
    return f"test_rollout_{prefix}_{uuid.uuid4().hex[:6]}"


class _CountdownEnv:
    """Observation 'n=<k>'; done (reward 1) after `turns` steps; optional slow/raising steps."""

    name = "countdown"
    tools = ()

    def __init__(
        self,
        turns: int = 2,
        step_sleep_s: float = 0.0,
        reset_sleep_s: float = 0.0,
        raise_on_step: int | None = None,
        raise_on_reset: bool = False,
        obs_chars: int = 3,
        final_reward: float = 1.0,
    ) -> None:
        self.final_reward = final_reward
        self.turns, self.step_sleep_s, self.reset_sleep_s = turns, step_sleep_s, reset_sleep_s
        self.raise_on_step, self.raise_on_reset, self.obs_chars = (
            raise_on_step,
            raise_on_reset,
            obs_chars,
        )
        self.actions: list[str] = []

    def _obs(self) -> str:
        return (f"n={self.turns - len(self.actions)}" + "x" * self.obs_chars)[: self.obs_chars]

    async def reset(self, seed: int) -> str:
        if self.reset_sleep_s:
            await asyncio.sleep(self.reset_sleep_s)
        if self.raise_on_reset:
            raise RuntimeError("reset exploded")
        self.actions = []
        return self._obs()

    async def step(self, action: Action) -> StepResult:
        if self.step_sleep_s:
            await asyncio.sleep(self.step_sleep_s)
        self.actions.append(action.content)
        if self.raise_on_step is not None and len(self.actions) == self.raise_on_step:
            raise ValueError("step exploded")
        done = len(self.actions) >= self.turns
        return StepResult(self._obs(), self.final_reward if done else 0.0, done)

    def demonstration(self, seed: int) -> list[Action]:
        return [Action(content="a")] * self.turns


ENV = _unique("countdown")
register_env(ENV)(_CountdownEnv)


class _Scripted:
    """Policy returning `actions[i]` + END with log-prob -0.25 * (j + 1) per token j;
    records every context it was called with."""

    def __init__(self, actions: Sequence[str], version: int = 3) -> None:
        self.actions = list(actions)
        self.version = version
        self.contexts: list[list[int]] = []

    async def __call__(
        self, context: Sequence[int], **_conversation
    ) -> tuple[list[int], list[float], int]:
        self.contexts.append(list(context))
        text = (
            self.actions[len(self.contexts) - 1] if len(self.contexts) <= len(self.actions) else ""
        )
        tokens = [*TOK.encode(text), TOK.end_id]
        return tokens, [-0.25 * (j + 1) for j in range(len(tokens))], self.version


def _limits(**kw) -> EpisodeLimits:
    base = dict(max_turns=4, max_episode_tokens=128, max_new_tokens=16, step_timeout_s=5.0)
    return EpisodeLimits(**{**base, **kw})


def _play(env, policy, *, step_times: list[float] | None = None, **limits):
    return asyncio.run(
        play_episode(
            env,
            policy,
            seed=11,
            limits=_limits(**limits),
            chat=CHAT,
            on_env_step=None if step_times is None else step_times.append,
        )
    )


def _check_invariants(rec) -> None:
    tokens, mask, lp = rec.tokens, rec.loss_mask, rec.behavior_logprobs
    assert len(tokens) == len(mask) == len(lp)
    assert tokens[0] == TOK.bos_id and tokens[-1] == TOK.eos_id
    assert np.all(lp[mask == 0] == 0.0)
    assert set(np.unique(mask)) <= {0, 1}


def test_layout_mask_and_logprobs_exact():
    env = make_env(ENV, turns=2)
    policy = _Scripted(["ab", "c"])
    step_times: list[float] = []
    rec = _play(env, policy, step_times=step_times)
    obs0, obs1 = "n=2", "n=1"
    u, a, e = TOK.user_id, TOK.assistant_id, TOK.end_id
    expected = [
        TOK.bos_id,
        *[u, *TOK.encode(obs0), a],
        *[*TOK.encode("ab"), e],
        *[u, *TOK.encode(obs1), a],
        *[*TOK.encode("c"), e],
        TOK.eos_id,
    ]
    tokens, mask, lp = rec.tokens, rec.loss_mask, rec.behavior_logprobs
    assert tokens.tolist() == expected
    policy_positions = [i for i, t in enumerate(expected) if i > 0 and expected[i - 1] == a]
    # mask is 1 exactly on the policy's tokens: the action characters and its END
    want_mask = np.zeros(len(expected), np.int8)
    first, second = policy_positions
    want_mask[first : first + 3] = 1
    want_mask[second : second + 2] = 1
    assert mask.tolist() == want_mask.tolist()
    want_lp = np.zeros(len(expected), np.float32)
    want_lp[first : first + 3] = [-0.25, -0.5, -0.75]
    want_lp[second : second + 2] = [-0.25, -0.5]
    np.testing.assert_array_equal(lp, want_lp)
    assert rec.status == "ok" and rec.num_turns == 2 and rec.reward == 1.0
    assert rec.policy_version == 3 and rec.seed == 11 and rec.env == env.name
    assert env.actions == ["ab", "c"]  # END is stripped before the env sees the action
    # the policy sees the whole episode so far, ending with ASSISTANT
    assert policy.contexts[0] == expected[:first]
    assert policy.contexts[1] == expected[:second]
    assert len(step_times) == 2
    _check_invariants(rec)


def test_scripted_policy_demonstration():
    env = make_env(ENV, turns=3)
    rec = _play(env, ScriptedPolicy(env.demonstration(0), CHAT))
    assert rec.status == "ok" and rec.reward == 1.0 and rec.num_turns == 3
    _check_invariants(rec)


def test_env_step_raising_is_env_error():
    env = make_env(ENV, turns=3, raise_on_step=2)
    rec = _play(env, _Scripted(["a", "b", "c"]))
    assert rec.status == "env_error"
    assert rec.num_turns == 2  # the failing step's action is kept, then EOS
    _check_invariants(rec)


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), -2e6])
def test_a_reward_that_cannot_be_stored_ends_the_episode_as_env_error(reward):
    """Not the learner's quarantine of the whole shard: this episode alone, reward 0."""
    rec = _play(make_env(ENV, turns=2, final_reward=reward), _Scripted(["a", "b"]))
    assert rec.status == "env_error" and rec.reward == 0.0 and rec.num_turns == 2
    _check_invariants(rec)


def test_env_reset_raising_is_env_error():
    rec = _play(make_env(ENV, raise_on_reset=True), _Scripted(["a"]))
    assert rec.status == "env_error" and rec.num_turns == 0
    _check_invariants(rec)
    assert rec.loss_mask.sum() == 0


def test_slow_step_is_an_env_timeout():
    # Not `truncated`: a slow environment says nothing about the policy, so the learner
    # drops the episode instead of training on its partial reward.
    env = make_env(ENV, turns=3, step_sleep_s=60.0)
    rec, wall, step_times = asyncio.run(_timed(env, step_timeout_s=0.1))
    assert rec.status == "env_timeout" and rec.num_turns == 1
    assert wall < 10  # the slow step was abandoned at the timeout, not awaited
    assert step_times and step_times[0] < 10
    _check_invariants(rec)


def test_slow_reset_is_an_env_timeout():
    rec, wall, _ = asyncio.run(_timed(make_env(ENV, reset_sleep_s=60.0), step_timeout_s=0.1))
    assert rec.status == "env_timeout" and rec.num_turns == 0 and wall < 10
    _check_invariants(rec)


class _CancelsItsEpisode(_CountdownEnv):
    """Cancels `episode` (the task playing its episode), then answers at once: the
    cancellation and the answer land in the same loop iteration."""

    episode: asyncio.Task | None = None

    async def step(self, action: Action) -> StepResult:
        self.episode.cancel()
        return await super().step(action)


def test_a_cancellation_that_lands_as_a_step_completes_ends_the_episode():
    # With asyncio.wait_for (Python 3.11) the step's result won and the cancelled episode
    # played on: an actor stopping on an error then waited forever on a stopped sampler.
    class Yielding(_Scripted):  # a real policy awaits its sampler
        async def __call__(self, context, **conversation):
            await asyncio.sleep(0)
            return await super().__call__(context, **conversation)

    policy = Yielding(["a"] * 8)

    async def play() -> None:
        env = _CancelsItsEpisode(turns=4)
        env.episode = asyncio.current_task()
        await play_episode(env, policy, seed=1, limits=_limits(), chat=CHAT)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(play())
    assert len(policy.contexts) == 1  # no turn after the cancellation


async def _timed(env, **limits):
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    times: list[float] = []
    rec = await play_episode(
        env,
        _Scripted(["a"] * 8),
        seed=1,
        limits=_limits(**limits),
        chat=CHAT,
        on_env_step=times.append,
    )
    return rec, loop.time() - t0, times


def test_token_budget_is_truncated():
    # Each turn: prompt 1 + 10 + 1 tokens, action 4 + END; budget 40 fits two turns.
    env = make_env(ENV, turns=10, obs_chars=10)
    rec = _play(env, _Scripted(["abcd"] * 10), max_episode_tokens=40, max_turns=10)
    assert rec.status == "truncated"
    assert rec.num_turns == 2
    assert len(rec.tokens) <= 40
    _check_invariants(rec)


def test_action_cut_to_remaining_budget():
    # Room for the prompt and 3 action tokens only: the action is cut, log-probs too.
    env = make_env(ENV, turns=1, obs_chars=3)
    budget = 1 + 5 + 3 + 2  # BOS + prompt + room for 3 tokens + END (closes the turn) + EOS
    rec = _play(env, _Scripted(["abcdefgh"]), max_episode_tokens=budget)
    tokens, mask, lp = rec.tokens, rec.loss_mask, rec.behavior_logprobs
    assert len(tokens) == budget
    assert mask.sum() == 3
    np.testing.assert_array_equal(lp[mask == 1], [-0.25, -0.5, -0.75])
    _check_invariants(rec)


def test_max_new_tokens_caps_action():
    env = make_env(ENV, turns=1)
    rec = _play(env, _Scripted(["abcdefgh"]), max_new_tokens=4)
    assert rec.loss_mask.sum() == 4
    assert env.actions == ["abcd"]


def test_max_turns_without_done_is_truncated():
    env = make_env(ENV, turns=100)
    rec = _play(env, _Scripted(["a"] * 10), max_turns=3)
    assert rec.status == "truncated" and rec.num_turns == 3
    _check_invariants(rec)


def test_done_on_last_allowed_turn_is_ok():
    env = make_env(ENV, turns=3)
    rec = _play(env, _Scripted(["a"] * 3), max_turns=3)
    assert rec.status == "ok" and rec.reward == 1.0


def test_unparsable_tool_call_is_answered_without_the_env():
    """`<|tool|>` with no tool on offer is a parse error: the rollout answers it, the env
    never sees it, the episode goes on."""
    env = make_env(ENV, turns=1)
    policy = _Scripted(["<|tool|>x", "done"])
    rec = _play(env, policy)
    assert env.actions == ["done"] and rec.num_turns == 2 and rec.status == "ok"
    second_prompt = policy.contexts[1][len(policy.contexts[0]) :]
    assert TOK.decode(second_prompt).startswith("<|tool|>x<|end|><|user|>error: no tool available")
    _check_invariants(rec)
