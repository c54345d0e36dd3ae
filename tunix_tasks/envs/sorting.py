"""``sorting``: sort a row of distinct digits by swapping positions (a longer horizon).

Task: ``3142`` (``length`` distinct digits, shuffled). Tool: ``swap(positions)``, the two
0-based positions to exchange written as two digits (``"03"``). Actions:

* a tool call ``swap({"positions": "03"})`` -> observation is the row after the swap
  (``2143``), or ``error: ...`` when the argument is not two different positions; the
  episode continues. A turn's calls swap in order, each answered with the row after it.
* no tool call: the episode ends; reward 1.0 if the row is sorted ascending, else 0.

Done after an answer or ``max_turns`` (default 8). A shuffled row of 4 needs up to 3 swaps,
so an episode is up to 4 turns. Demonstration: selection sort's swaps, then ``done``.
The JAX twin is `envs/vectorized/sorting.py` (same task and rewards).
"""

from __future__ import annotations

import random
import re

from tunix_tasks.envs.base import StepResult, string_argument
from tunix_tasks.messages import Action, ToolCall, function_tool

__all__ = ["SortingEnv", "swap_error"]

_POSITIONS = re.compile(r"(\d)(\d)")


def swap_error(length: int) -> str:
    return f"error: give two different positions from 0 to {length - 1}, e.g. 01"


class SortingEnv:
    name = "sorting"
    tools = (
        function_tool(
            "swap",
            "Swap the digits at two positions.",
            {"positions": "the two 0-based positions, e.g. 03"},
        ),
    )

    def __init__(self, length: int = 4, max_turns: int = 8) -> None:
        if not 2 <= length <= 10 or max_turns < 1:
            raise ValueError("need 2 <= length <= 10 and max_turns >= 1")
        self.length, self.max_turns = length, max_turns
        self._row: list[int] = []
        self._turns = 0
        self._done = True

    def row_for(self, seed: int) -> list[int]:
        """The shuffled row of ``seed``."""
        return random.Random(seed).sample(range(10), self.length)

    def _text(self) -> str:
        return "".join(map(str, self._row))

    async def reset(self, seed: int) -> str:
        self._row, self._turns, self._done = self.row_for(seed), 0, False
        return self._text()

    async def step(self, action: Action) -> StepResult:
        if self._done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        self._turns += 1
        reward, answered, info = 0.0, False, {"turns": self._turns}
        obs: str | tuple[str, ...]
        if action.tool_calls:
            info["kind"] = "tool"
            obs = tuple(self._swap(call) for call in action.tool_calls)
        else:
            info["kind"] = "answer"
            answered = True
            reward = 1.0 if self._row == sorted(self._row) else 0.0
            obs = "sorted" if reward else "not sorted"
        self._done = answered or self._turns >= self.max_turns
        return StepResult(obs, reward, self._done, info)

    def _swap(self, call: ToolCall) -> str:
        """Apply one swap call; the row after it, or why it was not applied."""
        try:
            arg = string_argument(call, self.tools).strip()
        except ValueError as e:
            return f"error: {e}"
        m = _POSITIONS.fullmatch(arg)
        i, j = (int(m[1]), int(m[2])) if m else (0, 0)
        if not (m and i != j and max(i, j) < self.length):
            return swap_error(self.length)
        self._row[i], self._row[j] = self._row[j], self._row[i]
        return self._text()

    def demonstration(self, seed: int) -> list[Action]:
        row, actions = self.row_for(seed), []
        for i in range(len(row)):
            j = min(range(i, len(row)), key=row.__getitem__)
            if j != i:
                row[i], row[j] = row[j], row[i]
                actions.append(Action(tool_calls=(ToolCall("swap", {"positions": f"{i}{j}"}),)))
        return [*actions, Action(content="done")]
