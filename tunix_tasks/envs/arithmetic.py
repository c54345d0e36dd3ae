"""``arithmetic``: multi-digit arithmetic that is only reliably solved with the calculator.

Task: ``4821*37=?``, two operands of ``min_digits``..``max_digits`` digits each (2..4 by
default; each operand's length drawn uniformly, then a number of exactly that many
digits), an operator from ``ops``. Everything else is ``calculator``'s (this env subclasses
it): the ``calculate(expression)`` tool and its evaluator, the actions, the reward (1.0 for
the right integer answer only: no credit for calling the tool or for a near miss), the
step info (incl. ``used_tool`` on the answer step), ``max_turns`` (default 3) and the
demonstration (tool call, then answer).

What makes the tool matter: a 4-digit product has up to 8 digits, which a small policy
cannot compute in its head, while copying the question into the tool and the tool's result
into the answer is learnable (the demonstration does exactly that). Compared with
``calculator``, operands are longer and of varying length, so the policy must learn to
copy variable-length numbers.
"""

from __future__ import annotations

import random

from tunix_tasks.envs.calculator import CalculatorEnv, calculate_tool, safe_eval

__all__ = ["ArithmeticEnv"]


class ArithmeticEnv(CalculatorEnv):
    name = "arithmetic"
    tools = (calculate_tool("4821*37"),)

    def __init__(
        self, min_digits: int = 2, max_digits: int = 4, ops: str = "+-*", max_turns: int = 3
    ) -> None:
        if not 1 <= min_digits <= max_digits <= 9:
            raise ValueError("need 1 <= min_digits <= max_digits <= 9")
        self.min_digits, self.max_digits = min_digits, max_digits
        self._setup(ops, max_turns)  # not super().__init__: digits replace its difficulty

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)

    def question_for(self, seed: int) -> tuple[str, int]:
        """The expression of ``seed`` (e.g. ``4821*37``) and its value."""
        rng = random.Random(seed)
        a, b, op = self._operand(rng), self._operand(rng), rng.choice(self.ops)
        expr = f"{a}{op}{b}"
        return expr, safe_eval(expr)
