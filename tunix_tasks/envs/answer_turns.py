"""The turn loop of question-answer environments (``dataset``, ``reasoning_gym``).

Owns one episode's turn state: a turn with tool calls runs each call on the calculator
(``envs/calculator.py``; without tools it answers "unknown tool"), answers each in its
own message, and the episode goes on; a turn without tool calls is the answer, scored,
and ends the episode; so does ``max_turns``. What an answer is worth is the environment's ``score``.

    turns = AnswerTurns(env.tools, env.max_turns)          # in reset()
    result = await turns.step(action, score)               # in step(): score(content, info)
    result.info   # {"turns": n, "kind": "tool" | "answer", "used_tool": ...}
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from tunix_tasks.envs.base import StepResult
from tunix_tasks.envs.calculator import calculate
from tunix_tasks.messages import Action

__all__ = ["AnswerTurns", "feedback"]

Score = Callable[[str, dict[str, Any]], Awaitable[float]]


def feedback(reward: float) -> str:
    """What the environment says after an answer."""
    if reward >= 1.0:
        return "correct"
    return "wrong" if reward <= 0 else f"wrong (score {reward:.2f})"


class AnswerTurns:
    """One episode's turns; a new one per `reset`."""

    def __init__(self, tools: Sequence[dict[str, Any]], max_turns: int) -> None:
        self.tools, self.max_turns = tuple(tools), max_turns
        self.turns, self.used_tool, self.done = 0, False, False

    async def step(self, action: Action, score: Score) -> StepResult:
        if self.done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        self.turns += 1
        info: dict[str, Any] = {"turns": self.turns}
        reward = 0.0
        if action.tool_calls:
            info["kind"] = "tool"
            self.used_tool = True
            # each call in order on the calculator (without tools: "unknown tool")
            obs: str | tuple[str, ...] = tuple(calculate(c, self.tools) for c in action.tool_calls)
        else:
            info.update(kind="answer", used_tool=self.used_tool)
            reward = await score(action.content, info)
            obs = feedback(reward)
        self.done = info["kind"] == "answer" or self.turns >= self.max_turns
        return StepResult(obs, reward, self.done, info)
