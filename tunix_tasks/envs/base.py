"""Environment contract: owns ``StepResult``, the ``Environment`` protocol and the action markers.

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

Actions use two text markers that belong to this protocol: ``TOOL`` starts a tool call
and ``ANSWER`` a final answer. A policy's tokenizer must know each as one token (the
character tokenizer does; a test checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

TOOL = "<|tool|>"
ANSWER = "<|answer|>"
ACTION_MARKERS = (TOOL, ANSWER)


@dataclass(frozen=True)
class StepResult:
    """What one action did: the next observation, its reward, whether the episode ended."""

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """A task the agent acts in, in text (see the module docstring for the episode loop)."""

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
