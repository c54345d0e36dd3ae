"""``calculator``: answer an arithmetic question, optionally after calling a calculator tool.

Task: ``23+45=?`` (operands with ``difficulty`` digits, operators from ``ops``).
Tool: ``calculate(expression)``. Actions:

* a tool call ``calculate({"expression": "23+45"})`` -> observation is the result
  (``68``) or ``error: ...`` (also for an unknown tool or a missing or non-string
  ``expression``); the episode continues. A turn's calls are each evaluated and answered.
  Expressions are parsed with ``ast`` and only integer literals, unary +/-, and binary
  ``+ - * //`` are evaluated (never ``eval``).
* no tool call: the content is the answer. An integer (``68``) -> reward 1.0 if it
  equals the true result, else 0; done. Anything else -> ``invalid: ...``; continues.

Each step's info has ``turns`` and ``kind`` (``tool`` / ``answer`` / ``invalid``); the
answer step's also ``used_tool`` (whether any earlier turn called the tool).

Done after an answer or ``max_turns`` (default 3). Demonstration: tool call, then answer.
"""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Callable, Sequence
from typing import Any

from tunix_tasks.envs.base import StepResult, string_argument
from tunix_tasks.envs.guess_number import parse_int
from tunix_tasks.messages import Action, ToolCall, function_tool

_BINOPS: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
}
_MAX_EXPR_CHARS = 64
_MAX_ABS = 10**18  # keeps repeated multiplication from building huge integers


class ToolError(ValueError):
    pass


def safe_eval(expr: str) -> int:
    """Evaluate an integer arithmetic expression; raises ToolError on anything else."""
    expr = expr.strip().removesuffix("=?").removesuffix("=").strip()
    if not expr or len(expr) > _MAX_EXPR_CHARS:
        raise ToolError("empty or too long expression")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ToolError("cannot parse expression") from e

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            value = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            value = -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.FloorDiv) and right == 0:
                raise ToolError("division by zero")
            value = _BINOPS[type(node.op)](left, right)
        else:
            raise ToolError(f"unsupported syntax: {type(node).__name__}")
        if abs(value) > _MAX_ABS:
            raise ToolError("number too large")
        return value

    try:
        return ev(tree)
    except RecursionError as e:
        raise ToolError("expression too deep") from e


def calculate_tool(example: str) -> dict[str, Any]:
    """The ``calculate`` tool's schema, its description showing ``example``."""
    return function_tool(
        "calculate",
        "Evaluate an integer arithmetic expression (+ - * //).",
        {"expression": f"the expression, e.g. {example}"},
    )


def calculate(call: ToolCall, tools: Sequence[dict]) -> str:
    """The observation of a ``calculate`` call: the value, or ``error: ...`` (a bad
    expression, a missing argument, or a tool ``tools`` does not offer)."""
    try:
        return str(safe_eval(string_argument(call, tools)))
    except ValueError as e:  # ToolError too
        return f"error: {e}"


class CalculatorEnv:
    name = "calculator"
    tools = (calculate_tool("23+45"),)

    def __init__(self, difficulty: int = 2, ops: str = "+-*", max_turns: int = 3) -> None:
        if difficulty < 1:
            raise ValueError("need difficulty >= 1")
        self.difficulty = difficulty
        self._setup(ops, max_turns)

    def _setup(self, ops: str, max_turns: int) -> None:
        """Check and set what subclasses share (their own question settings aside)."""
        if not ops or set(ops) - set("+-*") or max_turns < 1:
            raise ValueError("need ops a non-empty subset of '+-*' and max_turns >= 1")
        self.ops, self.max_turns = ops, max_turns
        self._answer = 0
        self._turns = 0
        self._used_tool = False
        self._done = True

    def question_for(self, seed: int) -> tuple[str, int]:
        """The expression of ``seed`` (e.g. ``23+45``) and its value."""
        rng = random.Random(seed)
        hi = 10**self.difficulty - 1
        a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(self.ops)
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
            obs: str | tuple[str, ...] = tuple(calculate(c, self.tools) for c in action.tool_calls)
        elif (value := parse_int(action.content)) is not None:
            info["kind"] = "answer"
            info["used_tool"] = self._used_tool  # lets evaluations tell copying from guessing
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
