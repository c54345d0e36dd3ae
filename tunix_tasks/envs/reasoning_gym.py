"""``reasoning_gym``: any task generator of the reasoning-gym package, scored by its own scorer.

Owns the adapter from reasoning-gym's procedural datasets (PyPI ``reasoning-gym``: ~100
generators such as ``chain_sum``, ``products``, ``leg_counting``, ``sudoku``) to the
``Environment`` protocol, and the optional calculator tool for its arithmetic tasks.

    env = make_env("reasoning_gym", task="chain_sum", config={"min_terms": 2, "max_terms": 3})
    question = await env.reset(7)       # the generator's question + the answer-format line
    result = await env.step(Action(content="-4"))   # scored by the dataset: reward in [0, 1]

    env = make_env("reasoning_gym", task="products", tools="calculator", max_turns=3)
    # calculate({"expression": "1663 * 5242"}) -> "8717446", then the answer as above

The task of ``seed`` is the first item of the task's dataset built with ``seed=seed,
size=1``: reasoning-gym draws item ``i`` of a dataset seeded ``s`` from ``Random(s + i)``,
so this is the item a dataset seeded 0 has at index ``seed`` for most tasks, without a
dataset of that size (some tasks draw per-dataset choices of length ``size`` at
construction). Distinct env seeds give distinct random streams, so the project's seed
ranges (training, demonstrations, held-out evaluation) carry over unchanged; equal
questions from different seeds remain possible where a task's configuration allows few.

Answer: the content of a turn without tool calls, read by ``envs/answers.py``'s
``extract_answer``: the last ``<answer>...</answer>`` span when there is one (reasoning-gym's
own convention, so a chat model may think first), otherwise the whole content, stripped
(what the character presets' ``<|answer|>`` turn carries). The prompt ends with
``instruction`` saying so (``instruction=""``: the bare question). With
``answer_format="last_number"`` the scorer gets the last number of that answer instead
(``"9 - 7 = 2."`` -> ``"2"``, GSM8K's "flexible" extraction): for numeric tasks, where a
small chat model writes the equation or a sentence around a right number. Reward: the dataset's ``score_answer``, clipped
to [0, 1]; a scorer that raises on a malformed answer gives 0.

Without tools an episode is one turn: any action ends it (a tool call earns 0). With
``tools="calculator"`` (only for the integer-expression tasks in ``CALCULATOR_TASKS``) the
env offers the project's ``calculate`` tool (``envs/calculator.py``'s schema and
``safe_eval``), answers each call of a tool turn and continues until an answer or
``max_turns``. ``demonstration(seed)``: the reference answer (after a ``calculate`` call of
the item's expression in the tool variant); tasks without a reference answer (their scorer
accepts several, e.g. ``graph_color``) raise ``ValueError``: run them with no warm start.

reasoning-gym (sympy, matplotlib, ...; about 1 s) is imported on the first construction,
never by ``import tunix_tasks.envs``: config validation and the learner do not pay for it.
Generation and scoring run in a worker thread: a few tasks take up to ~0.6 s per item.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from tunix_tasks.envs.answer_turns import AnswerTurns
from tunix_tasks.envs.answers import ANSWER_INSTRUCTION, extract_answer, last_number_text
from tunix_tasks.envs.base import StepResult
from tunix_tasks.envs.calculator import calculate_tool, safe_eval
from tunix_tasks.messages import Action, ToolCall

__all__ = [
    "ANSWER_FORMATS",
    "ANSWER_INSTRUCTION",
    "CALCULATOR_TASKS",
    "ReasoningGymEnv",
    "task_names",
]

# Tasks whose question is an integer expression of + - * (and /, which basic_arithmetic's
# generator evaluates as floor division), so `calculate` can compute the answer exactly.
CALCULATOR_TASKS = frozenset({"basic_arithmetic", "chain_sum", "products"})
# How a turn's answer is read before the task's scorer sees it (module docstring).
ANSWER_FORMATS = {
    "tag": extract_answer,
    "last_number": lambda c: last_number_text(extract_answer(c)),
}
_ENV_SET_FIELDS = ("seed", "size")  # chosen per episode by the env, never by the config


def _datasets() -> dict[str, tuple[type, type]]:
    """reasoning-gym's registry: task name -> (dataset class, config dataclass)."""
    from reasoning_gym.factory import DATASETS  # importing the package registers every task

    return DATASETS


def task_names() -> list[str]:
    """Every task reasoning-gym registers (imports reasoning-gym)."""
    return sorted(_datasets())


def _tool_expression(item: Mapping[str, Any]) -> str:
    """The ``calculate`` argument that computes the item's answer (floor division, as
    basic_arithmetic's generator computes ``/``)."""
    return str(item["metadata"]["expression"]).replace("/", "//")


class ReasoningGymEnv:
    """One reasoning-gym task as an environment (module docstring: seeds, answers, tools)."""

    name = "reasoning_gym"

    def __init__(
        self,
        task: str = "chain_sum",
        config: Mapping[str, Any] | None = None,
        tools: str | None = None,
        max_turns: int = 3,
        instruction: str = ANSWER_INSTRUCTION,
        answer_format: str = "tag",
    ) -> None:
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(
                f"reasoning_gym: unknown answer_format {answer_format!r}; "
                f"valid: {', '.join(ANSWER_FORMATS)}"
            )
        datasets = _datasets()
        if task not in datasets:
            close = difflib.get_close_matches(task, datasets, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(
                f"unknown reasoning_gym task {task!r}{hint}; valid: {', '.join(sorted(datasets))}"
            )
        if tools not in (None, "", "calculator"):
            raise ValueError(f"reasoning_gym: tools must be 'calculator' or unset, got {tools!r}")
        if tools and task not in CALCULATOR_TASKS:
            raise ValueError(
                f"reasoning_gym: tools='calculator' does not fit task {task!r} (its answers "
                f"are not integer expressions); it fits {', '.join(sorted(CALCULATOR_TASKS))}"
            )
        if max_turns < 1:
            raise ValueError("reasoning_gym: need max_turns >= 1")
        self.task = task
        self._dataset_cls, self._config = datasets[task][0], _build_config(task, datasets, config)
        self.tools = (calculate_tool("4 + 3 * 2"),) if tools else ()
        # Without a tool there is nothing to do but answer: one turn.
        self.max_turns = max_turns if self.tools else 1
        self.instruction = instruction
        self._read_answer = ANSWER_FORMATS[answer_format]
        self._dataset: Any = None
        self._item: dict[str, Any] = {}
        self._turns: AnswerTurns | None = None  # the episode's, from reset()

    def item(self, seed: int) -> tuple[Any, dict[str, Any]]:
        """(dataset, item) of ``seed``: the first item of the dataset seeded ``seed``."""
        dataset = self._dataset_cls(config=dataclasses.replace(self._config, seed=seed, size=1))
        return dataset, dataset[0]

    async def reset(self, seed: int) -> str:
        self._dataset, self._item = await asyncio.to_thread(self.item, seed)
        self._turns = AnswerTurns(self.tools, self.max_turns)
        question = str(self._item["question"]).rstrip()
        return f"{question}\n\n{self.instruction}" if self.instruction else question

    async def step(self, action: Action) -> StepResult:
        if self._turns is None:
            raise RuntimeError("step() called before reset(); call reset() first")

        async def score(content: str, info: dict[str, Any]) -> float:
            return await asyncio.to_thread(self._score, self._read_answer(content), info)

        return await self._turns.step(action, score)

    def _score(self, answer: str, info: dict[str, Any]) -> float:
        try:
            score = float(self._dataset.score_answer(answer, self._item))
        except Exception as e:  # some scorers parse the answer and raise when it is malformed
            info["score_error"] = repr(e)
            return 0.0
        return min(max(score, 0.0), 1.0)

    def demonstration(self, seed: int) -> list[Action]:
        _, item = self.item(seed)
        answer = item["answer"]
        if answer is None:
            raise ValueError(
                f"reasoning_gym task {self.task!r} has no reference answer (its scorer accepts "
                "several): no demonstrations; run it with warm_start_steps: 0"
            )
        final = Action(content=str(answer))
        if not self.tools:
            return [final]
        expression = _tool_expression(item)
        try:
            computes = str(safe_eval(expression)) == str(answer)
        except ValueError:  # longer than the tool accepts: answer without it
            computes = False
        call = ToolCall("calculate", {"expression": expression})
        return [Action(tool_calls=(call,)), final] if computes else [final]


def _build_config(
    task: str, datasets: Mapping[str, tuple[type, type]], config: Mapping[str, Any] | None
) -> Any:
    """The task's config dataclass from ``config``, validated; ``ValueError`` naming the
    bad key or the failed check otherwise."""
    config = dict(config or {})
    config_cls = datasets[task][1]
    valid = [f.name for f in dataclasses.fields(config_cls) if f.name not in _ENV_SET_FIELDS]
    for key in config:
        if key in _ENV_SET_FIELDS:
            raise ValueError(
                f"reasoning_gym task {task!r}: config key {key!r} is set by the environment "
                "(seed = the episode's env seed, size = 1); remove it"
            )
        if key not in valid:
            raise ValueError(
                f"reasoning_gym task {task!r}: unknown config key {key!r}; "
                f"valid: {', '.join(valid)}"
            )
    try:
        built = config_cls(**config)
        if callable(getattr(built, "validate", None)):
            built.validate()  # reasoning-gym checks with assert: AssertionError
    except (AssertionError, TypeError, ValueError) as e:
        raise ValueError(f"reasoning_gym task {task!r}: invalid config {config}: {e}") from e
    return built
