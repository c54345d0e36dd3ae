"""``arithmetic``: multi-digit arithmetic that is only reliably solved with the calculator.

Task: ``4821*37=?``, two operands of ``min_digits``..``max_digits`` digits each (2..4 by
default; each operand's length drawn uniformly, then a number of exactly that many
digits), an operator from ``ops``. Tool: ``calculate(expression)``, the same tool and
evaluator as ``calculator`` (``safe_eval``: ast-parsed integer ``+ - * //``, never
``eval``). Actions:

* a tool call ``calculate({"expression": "4821*37"})`` -> observation is the result
  (``178377``) or ``error: ...`` (unknown tool, missing or non-string ``expression``,
  unparsable expression); the episode continues. Only the first call of a turn counts.
* no tool call: the content is the answer. An integer -> reward 1.0 if it equals the
  true result, else 0; done. Anything else -> ``invalid: ...``; the episode continues.

The reward is for the right answer only (no credit for calling the tool or for a near
miss). What makes the tool matter: a 4-digit product has up to 8 digits, which a small
policy cannot compute in its head, while copying the question into the tool and the
tool's result into the answer is learnable (the demonstration does exactly that).
Compared with ``calculator`` (same prompt, tool and reward), operands are longer and of
varying length, so the policy must learn to copy variable-length numbers.

Done after an answer or ``max_turns`` (default 3). Demonstration: tool call, then answer.
"""

from __future__ import annotations

import random

from tunix_tasks.envs.base import StepResult, string_argument
from tunix_tasks.envs.calculator import safe_eval
from tunix_tasks.envs.guess_number import parse_int
from tunix_tasks.messages import Action, ToolCall, function_tool

__all__ = ["ArithmeticEnv"]


class ArithmeticEnv:
    name = "arithmetic"
    tools = (
        function_tool(
            "calculate",
            "Evaluate an integer arithmetic expression (+ - * //).",
            {"expression": "the expression, e.g. 4821*37"},
        ),
    )

    def __init__(
        self, min_digits: int = 2, max_digits: int = 4, ops: str = "+-*", max_turns: int = 3
    ) -> None:
        if not 1 <= min_digits <= max_digits <= 9:
            raise ValueError("need 1 <= min_digits <= max_digits <= 9")
        if not ops or set(ops) - set("+-*") or max_turns < 1:
            raise ValueError("need ops a non-empty subset of '+-*' and max_turns >= 1")
        self.min_digits, self.max_digits = min_digits, max_digits
        self.ops, self.max_turns = ops, max_turns
        self._answer = 0
        self._turns = 0
        self._used_tool = False
        self._done = True

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)

    def question_for(self, seed: int) -> tuple[str, int]:
        """The expression of ``seed`` (e.g. ``4821*37``) and its value."""
        rng = random.Random(seed)
        a, b, op = self._operand(rng), self._operand(rng), rng.choice(self.ops)
        expr = f"{a}{op}{b}"
        return expr, safe_eval(expr)

    async def reset(self, seed: int) -> str:
        question, self._answer = self.question_for(seed)
        self._turns, self._used_tool, self._done = 0, False, False
        return f"{question}=?"

    async def step(self, action: Action) -> StepResult:
        if self._done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        self._turns += 1
        reward, answered = 0.0, False
        info: dict[str, object] = {"turns": self._turns}
        if action.tool_calls:
            info["kind"] = "tool"
            self._used_tool = True
            try:
                obs = str(safe_eval(string_argument(action.tool_calls[0], self.tools)))
            except ValueError as e:  # ToolError too
                obs = f"error: {e}"
        elif (value := parse_int(action.content)) is not None:
            info["kind"] = "answer"
            info["used_tool"] = self._used_tool
            answered = True
            reward = 1.0 if value == self._answer else 0.0
            obs = "correct" if reward else "wrong"
        else:
            info["kind"] = "invalid"
            obs = "invalid: call calculate or answer with an integer"
        self._done = answered or self._turns >= self.max_turns
        return StepResult(obs, reward, self._done, info)

    def demonstration(self, seed: int) -> list[Action]:
        question, answer = self.question_for(seed)
        call = ToolCall("calculate", {"expression": question})
        return [Action(tool_calls=(call,)), Action(content=str(answer))]
