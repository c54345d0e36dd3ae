"""``guess_number``: find a hidden integer in [1, N] from higher/lower feedback.

Task: "Guess a number from 1 to 16." No tools: the action's content is the guess
(``8``). Observations: ``higher`` (the hidden number is higher), ``lower``, ``correct``,
or ``invalid: ...`` for a content that is not an integer or a tool call (the turn is
spent, the episode continues). Reward: ``discount ** (turns - 1)`` when correct
(``discount=1.0`` by default, i.e. a flat 1.0), 0 otherwise. Done when correct or after
``max_turns``. The hidden number is ``random.Random(seed).randint(1, N)``; the
demonstration is binary search (at most ceil(log2(N+1)) guesses).
"""

from __future__ import annotations

import random
import re

from tunix_tasks.envs.base import StepResult
from tunix_tasks.messages import Action

_INT = re.compile(r"[+-]?\d{1,9}")


def parse_int(text: str) -> int | None:
    """An integer (surrounding whitespace allowed); None when malformed."""
    text = text.strip()
    return int(text) if _INT.fullmatch(text) else None


class GuessNumberEnv:
    name = "guess_number"
    tools = ()

    def __init__(self, max_n: int = 16, max_turns: int = 6, discount: float = 1.0) -> None:
        if max_n < 1 or max_turns < 1 or not 0.0 < discount <= 1.0:
            raise ValueError("need max_n >= 1, max_turns >= 1, 0 < discount <= 1")
        self.max_n, self.max_turns, self.discount = max_n, max_turns, discount
        self._target: int | None = None
        self._turns = 0
        self._done = True

    def _target_for(self, seed: int) -> int:
        return random.Random(seed).randint(1, self.max_n)

    async def reset(self, seed: int) -> str:
        self._target, self._turns, self._done = self._target_for(seed), 0, False
        return f"Guess a number from 1 to {self.max_n}."

    async def step(self, action: Action) -> StepResult:
        if self._done or self._target is None:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        self._turns += 1
        guess = None if action.tool_calls else parse_int(action.content)
        reward, info = 0.0, {"turns": self._turns, "valid": guess is not None}
        obs: str | tuple[str, ...]
        if action.tool_calls:
            invalid = f"invalid: there are no tools; reply with a number from 1 to {self.max_n}"
            obs = (invalid,) * len(action.tool_calls)
        elif guess is None:
            obs = f"invalid: reply with a number from 1 to {self.max_n}"
        elif guess < self._target:
            obs = "higher"
        elif guess > self._target:
            obs = "lower"
        else:
            obs, reward = "correct", self.discount ** (self._turns - 1)
        self._done = reward > 0 or self._turns >= self.max_turns
        info["correct"] = reward > 0
        return StepResult(obs, reward, self._done, info)

    def demonstration(self, seed: int) -> list[Action]:
        target, lo, hi, actions = self._target_for(seed), 1, self.max_n, []
        while True:
            mid = (lo + hi) // 2
            actions.append(Action(content=str(mid)))
            if mid == target:
                return actions
            lo, hi = (mid + 1, hi) if mid < target else (lo, mid - 1)
