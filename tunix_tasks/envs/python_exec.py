"""``python_exec``: write a tiny Python program whose output is the target; runs in the sandbox.

Task (from the seed): ``print the sum of 3 and 4``, ``print the product of 3 and 4``,
``print 5*6``, ``print 5+6``, ``print 9-2``. Tool: ``run_python(code)``. The program
is the first tool call's ``code`` (a chat model calling the tool) or, without a tool call,
the action's content with a surrounding markdown ``` fence removed (a plain-text policy),
e.g. ``print(3+4)``; an unknown tool or a missing or non-string ``code`` is answered
``error: ...``. One program runs a turn: a turn's further calls are answered
``error: not run: only a turn's first call runs``. A single bare expression is run
REPL-style, so ``3+4`` prints ``7`` too.
The program runs in :mod:`tunix_tasks.envs.sandbox` (off the event loop); text that does
not parse is answered without starting a process. Reward 1.0 when the run succeeds and its stripped
stdout equals the target, else 0. Observation: the (truncated) stdout, or the last line
of the error, or ``timeout``. Done when correct or after ``max_turns`` (default 2).
Demonstration: one ``run_python`` call of ``print(a+b)`` (or ``-``/``*``).

Isolation: ``sandbox`` (``env.kwargs.sandbox`` in a run config) is the sandbox mode:
``auto`` (default: bubblewrap, else kernel namespaces as root), ``bwrap``, or
``unsafe-audit-only`` (explicit opt-in to running model code without real isolation).
Construction raises :class:`~tunix_tasks.envs.sandbox.SandboxUnavailable`, naming how
to install bubblewrap, when the chosen mode cannot be provided (docs/sandbox.md).
"""

from __future__ import annotations

import ast
import dataclasses
import random
import re

from tunix_tasks.envs.base import StepResult, string_argument
from tunix_tasks.envs.sandbox import (
    SandboxLimits,
    SandboxResult,
    check_isolation,
    run_python_async,
)
from tunix_tasks.messages import Action, ToolCall, function_tool

_TEMPLATES: tuple[tuple[str, str], ...] = (
    ("print the sum of {a} and {b}", "+"),
    ("print the product of {a} and {b}", "*"),
    ("print {a}*{b}", "*"),
    ("print {a}+{b}", "+"),
    ("print {a}-{b}", "-"),
)
_MAX_SOURCE_CHARS = 1000
_MAX_OBS_CHARS = 120
_NOT_RUN = "error: not run: only a turn's first call runs"
DEFAULT_LIMITS = SandboxLimits(wall_s=3.0, cpu_s=1, max_output_bytes=4096)
_FENCE = re.compile(r"```[\w+.-]*[ \t]*\n(.*?)\n?[ \t]*```", re.S)
TOOLS = (
    function_tool(
        "run_python",
        "Run a Python program in a sandbox and see its output.",
        {"code": "Python source"},
    ),
)


def program_of(action: Action) -> str:
    """The program an action submits: the first tool call's ``code``, else the content
    without a surrounding ``` fence. Raises ValueError for a bad call (unknown tool,
    missing or non-string ``code``)."""
    if action.tool_calls:
        return string_argument(action.tool_calls[0], TOOLS)
    fenced = _FENCE.fullmatch(action.content.strip())
    return fenced.group(1) if fenced else action.content


def prepare_source(program: str) -> str:
    """Source to run; raises SyntaxError (checked here, in-process, without executing)."""
    if len(program) > _MAX_SOURCE_CHARS:
        raise SyntaxError("program too long")
    try:
        tree = ast.parse(program)
    except (ValueError, RecursionError, MemoryError) as e:
        raise SyntaxError(str(e)) from e
    if len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr):
        # REPL semantics for a bare expression; print(...) itself returns None.
        expr = ast.unparse(tree.body[0].value)
        return f"_r = ({expr})\nif _r is not None:\n    print(_r)\n"
    return program


class PythonExecEnv:
    name = "python_exec"
    tools = TOOLS

    def __init__(
        self,
        max_operand: int = 20,
        max_turns: int = 2,
        limits: SandboxLimits = DEFAULT_LIMITS,
        sandbox: str | None = None,
    ) -> None:
        if max_operand < 1 or max_turns < 1:
            raise ValueError("need max_operand >= 1 and max_turns >= 1")
        if sandbox is not None:
            limits = dataclasses.replace(limits, mode=sandbox)
        check_isolation(limits)  # refuse now, not at the first step (cached per process)
        self.max_operand, self.max_turns, self.limits = max_operand, max_turns, limits
        self._target = ""
        self._turns = 0
        self._done = True

    def _task_for(self, seed: int) -> tuple[str, str, str]:
        """(task text, target stdout, expert program)."""
        rng = random.Random(seed)
        template, op = rng.choice(_TEMPLATES)
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return template.format(a=a, b=b), str(value), f"print({a}{op}{b})"

    async def reset(self, seed: int) -> str:
        task, self._target, _ = self._task_for(seed)
        self._turns, self._done = 0, False
        return task

    async def step(self, action: Action) -> StepResult:
        if self._done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        self._turns += 1
        info: dict[str, object] = {"turns": self._turns, "ran": False}
        try:
            source = prepare_source(program_of(action))
        except ValueError as e:  # a bad tool call
            obs, reward = f"error: {e}"[:_MAX_OBS_CHARS], 0.0
        except SyntaxError as e:
            obs, reward = f"SyntaxError: {e.msg}"[:_MAX_OBS_CHARS], 0.0
        else:
            result = await run_python_async(source, limits=self.limits)
            info.update(ran=True, status=result.status, exit_code=result.exit_code)
            obs = _observe(result)
            reward = 1.0 if result.status == "ok" and result.stdout.strip() == self._target else 0.0
        self._done = reward > 0 or self._turns >= self.max_turns
        info["correct"] = reward > 0
        if not action.tool_calls:
            return StepResult(obs, reward, self._done, info)
        further = [_NOT_RUN] * (len(action.tool_calls) - 1)  # each call gets its answer
        return StepResult((obs, *further), reward, self._done, info)

    def demonstration(self, seed: int) -> list[Action]:
        call = ToolCall("run_python", {"code": self._task_for(seed)[2]})
        return [Action(tool_calls=(call,))]


def _observe(result: SandboxResult) -> str:
    if result.status == "ok":
        text = result.stdout.strip() or "(no output)"
    elif result.status in ("timeout", "memory", "output_limit", "killed"):
        text = result.status
    else:
        lines = [ln for ln in result.stderr.strip().splitlines() if ln.strip()]
        text = lines[-1].strip() if lines else f"exit code {result.exit_code}"
    return text[:_MAX_OBS_CHARS]
