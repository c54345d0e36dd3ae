"""Environment contract: owns ``StepResult``, the ``Environment`` protocol and ``rollout``.

Environments speak plain text. The actor wraps each observation as
``USER <observation> ASSISTANT``, samples the action up to END, strips END and calls
``step``. One episode:

    env = make_env("calculator")
    obs = await env.reset(seed)                 # the task, e.g. "23+45=?"
    for _ in range(max_turns):
        action = policy(obs)                    # e.g. "<|tool|>23+45"
        result = await env.step(action)         # StepResult(observation, reward, done, info)
        obs = result.observation
        if result.done:
            break

``reset``/``step`` are coroutines so one actor can step many environments with
``asyncio.gather``; an environment that blocks (the sandbox) does so off the event loop.
``demonstration(seed)`` returns expert actions that solve that seed (supervised warm start).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    name: str

    async def reset(self, seed: int) -> str:
        """Start an episode deterministically from ``seed``; returns the first observation."""
        ...

    async def step(self, action: str) -> StepResult:
        """Apply one action (text without the END marker)."""
        ...

    def demonstration(self, seed: int) -> list[str]:
        """Expert actions that earn the maximum reward for ``seed``."""
        ...


PolicyFn = Callable[[str], str | Awaitable[str]]


async def rollout(
    env: Environment, policy_fn: PolicyFn, seed: int, max_turns: int
) -> tuple[float, int, list[str]]:
    """Play one episode; returns (total_reward, turns, actions). ``policy_fn`` maps the
    latest observation to an action and may be sync or async."""
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
    """A policy that replays ``env.demonstration(seed)`` (for tests and baselines)."""
    actions = iter(env.demonstration(seed))
    return lambda _obs: next(actions, "")
