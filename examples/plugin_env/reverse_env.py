"""``reverse``: a plug-in environment for tunix-tasks (see docs/environments.md).

Task: ``reverse cab`` (a word of ``length`` letters from ``letters``). No tools: the
answer is the content of the policy's turn, ``bac``. Reward: the fraction of letters in
the right place (1.0 when the whole word is reversed), 0 for a tool call. One turn: done
after any action.
"""

from __future__ import annotations

import random

from tunix_tasks.envs import Action, StepResult


class ReverseEnv:
    name = "reverse"
    tools = ()  # OpenAI-style function schemas offered to the model; none here

    def __init__(self, length: int = 3, letters: str = "abcdef") -> None:
        if length < 1 or not letters:
            raise ValueError("need length >= 1 and some letters")
        self.length, self.letters = length, letters
        self._word: str | None = None

    def _word_for(self, seed: int) -> str:
        rng = random.Random(seed)  # the same seed always gives the same task
        return "".join(rng.choice(self.letters) for _ in range(self.length))

    async def reset(self, seed: int) -> str:
        self._word = self._word_for(seed)
        return f"reverse {self._word}"

    async def step(self, action: Action) -> StepResult:
        if self._word is None:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        target, self._word = self._word[::-1], None
        if action.tool_calls:  # a chat model may call a tool we do not offer
            return StepResult(
                "invalid: no tools; answer with the word", 0.0, True, {"valid": False}
            )
        guess = action.content.strip()
        right = sum(a == b for a, b in zip(guess, target, strict=False))
        reward = right / len(target) if len(guess) == len(target) else 0.0
        return StepResult(target, reward, True, {"valid": True, "correct": guess == target})

    def demonstration(self, seed: int) -> list[Action]:
        """Expert actions for ``seed``: what the warm start imitates."""
        return [Action(content=self._word_for(seed)[::-1])]
