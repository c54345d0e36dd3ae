"""``dataset``: a question-answer task read from a dataset file, without an Environment class.

Owns turning rows with a prompt and a reference answer into episodes: the field paths, the
train/held-out split and the seed -> row mapping, the reward functions, the optional
calculator tool and the demonstrations. The rows come from ``envs/dataset_files.py``
(JSONL or Parquet, local or any store URI such as gs://; ``hf:<name>`` with Hugging Face
``datasets`` installed), read once per process however many instances the actors build.

    env = make_env("dataset", path="examples/dataset_task/problems.jsonl",
                   prompt_field="question", answer_field="answer", reward="numeric")
    question = await env.reset(7)      # training row 7 % n_train, then the answer-format line
    result = await env.step(Action(content="<answer>42</answer>"))   # reward 1.0 or 0.0

    make_env("dataset", path="gs://bucket/gsm8k/train.parquet", eval_path="gs://.../test.parquet",
             answer_field="answer", reward="numeric", tools="calculator", max_turns=3)
    make_env("dataset", path="qa.jsonl", reward="my_pkg.rewards:score")  # (answer, ref, row)

Seeds -> rows (``tunix_tasks/seeds.py``): a training seed (below ``HELD_OUT_SEED_BASE``)
and a demonstration seed (``2**31`` and up) play training row ``seed % n_train``; a
held-out seed plays held-out row ``(seed - HELD_OUT_SEED_BASE) % n_held``, so evaluation's
first n seeds are the first n held-out rows. The held-out rows are the file ``eval_path``,
else the rows whose index hashes below ``eval_fraction`` (default 0.1; blake2b of the
index, so the split is the same in every process and does not move when rows are
appended). A split must leave both sides non-empty.

Answer: ``answer_format="tag"`` (default) reads it with ``envs/answers.py``'s
``extract_answer`` (the last ``<answer>`` span, else the whole content; the prompt then
ends with ``ANSWER_INSTRUCTION``), ``"content"`` takes the whole content, stripped.
Reward: ``exact``, ``numeric`` (last numbers within ``tolerance``), ``contains`` (the
reference occurs in the answer, ignoring case) or ``"pkg.module:function"``, called as
``function(answer_text, reference, row) -> float`` in a worker thread (an exception in it
ends the episode as ``env_error``). Without tools an episode is one turn; with
``tools="calculator"`` the ``calculate`` tool is offered until an answer or ``max_turns``.
``demonstration(seed)``: the reference answer, after a ``calculate`` call of the row's
``expression_field`` in the tool variant when that expression computes the answer.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from tunix_tasks.envs.answer_turns import AnswerTurns
from tunix_tasks.envs.answers import (
    ANSWER_INSTRUCTION,
    contains_match,
    exact_match,
    extract_answer,
    last_number,
    numeric_match,
)
from tunix_tasks.envs.base import StepResult
from tunix_tasks.envs.calculator import ToolError, calculate_tool, safe_eval
from tunix_tasks.envs.dataset_files import DEFAULT_MAX_BYTES, DatasetError, Rows, read_rows
from tunix_tasks.messages import Action, ToolCall
from tunix_tasks.seeds import HELD_OUT_SEED_BASE, seed_range

__all__ = ["ANSWER_FORMATS", "BUILTIN_REWARDS", "DatasetEnv", "DatasetError", "Item"]

BUILTIN_REWARDS = ("exact", "numeric", "contains")
ANSWER_FORMATS = ("tag", "content")
DEFAULT_EVAL_FRACTION = 0.1
RewardFn = Callable[[str, str, Mapping[str, Any]], float]


class Item(NamedTuple):
    """One row as the environment uses it."""

    prompt: str
    answer: str
    expression: str | None  # the calculator expression of the tool variant's demonstration
    row: Mapping[str, Any]


class _Fields(NamedTuple):
    """What `_items` needs to turn rows into items (hashable: part of the cache key)."""

    prompt: str
    answer: str
    expression: str | None
    numeric: bool  # every reference must hold a number
    max_prompt_chars: int


class DatasetEnv:
    """A dataset of prompts and reference answers as an environment (module docstring)."""

    name = "dataset"

    def __init__(
        self,
        path: str,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        reward: str = "exact",
        tolerance: float = 1e-6,
        answer_format: str = "tag",
        instruction: str | None = None,
        preamble: str = "",
        tools: str | None = None,
        expression_field: str | None = None,
        max_turns: int = 3,
        eval_path: str | None = None,
        eval_fraction: float | None = None,
        max_file_mb: float = DEFAULT_MAX_BYTES / 2**20,
        max_prompt_chars: int = 8192,
    ) -> None:
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(
                f"dataset: unknown answer_format {answer_format!r}; valid: {', '.join(ANSWER_FORMATS)}"
            )
        if tools not in (None, "", "calculator"):
            raise ValueError(f"dataset: tools must be 'calculator' or unset, got {tools!r}")
        if expression_field and not tools:
            raise ValueError("dataset: expression_field is for the tool variant: set tools")
        if max_turns < 1 or tolerance < 0 or max_file_mb <= 0 or max_prompt_chars < 1:
            raise ValueError(
                "dataset: need max_turns >= 1, tolerance >= 0, max_file_mb > 0 and "
                "max_prompt_chars >= 1"
            )
        if eval_path and eval_fraction is not None:
            raise ValueError("dataset: set eval_path or eval_fraction, not both")
        fraction = DEFAULT_EVAL_FRACTION if eval_fraction is None else eval_fraction
        if not eval_path and not 0 < fraction < 1:
            raise ValueError(
                f"dataset: eval_fraction must be in (0, 1), got {fraction} (the held-out "
                "rows evaluation plays; or give them as eval_path)"
            )
        self._reward_fn, self._custom = _reward(reward, tolerance)
        fields = _Fields(
            prompt_field, answer_field, expression_field, reward == "numeric", max_prompt_chars
        )
        max_bytes = int(max_file_mb * 2**20)
        rows = read_rows(path, max_bytes=max_bytes)
        eval_rows = read_rows(eval_path, max_bytes=max_bytes) if eval_path else None
        self.train, self.held_out = _split(rows, eval_rows, fraction, fields)
        self.answer_format = answer_format
        if instruction is None:
            instruction = ANSWER_INSTRUCTION if answer_format == "tag" else ""
        self._prefix, self._suffix = preamble.strip(), instruction.strip()
        self.tools = (calculate_tool("12 * 7 + 5"),) if tools else ()
        self.max_turns = max_turns if self.tools else 1  # without a tool: answer at once
        self._item: Item | None = None
        self._turns: AnswerTurns | None = None  # the episode's, from reset()

    def item(self, seed: int) -> Item:
        """The row ``seed`` plays (module docstring: the mapping)."""
        if seed_range(seed) == "held_out":
            return self.held_out[(seed - HELD_OUT_SEED_BASE) % len(self.held_out)]
        return self.train[seed % len(self.train)]

    async def reset(self, seed: int) -> str:
        self._item = self.item(seed)
        self._turns = AnswerTurns(self.tools, self.max_turns)
        return "\n\n".join(p for p in (self._prefix, self._item.prompt, self._suffix) if p)

    async def step(self, action: Action) -> StepResult:
        if self._turns is None or self._item is None:
            raise RuntimeError("step() called before reset(); call reset() first")
        item = self._item

        async def score(content: str, _info: dict[str, Any]) -> float:
            if self._custom:  # user code may be slow: off the actor's event loop
                return await asyncio.to_thread(self._score, content, item)
            return self._score(content, item)

        return await self._turns.step(action, score)

    def _score(self, content: str, item: Item) -> float:
        answer = extract_answer(content) if self.answer_format == "tag" else content.strip()
        return float(self._reward_fn(answer, item.answer, item.row))

    def demonstration(self, seed: int) -> list[Action]:
        item = self.item(seed)
        final = Action(content=item.answer)
        if not self.tools or item.expression is None:
            return [final]
        try:
            computes = self._score(str(safe_eval(item.expression)), item) >= 1.0
        except ToolError:  # not an expression the tool takes: answer without it
            computes = False
        call = ToolCall("calculate", {"expression": item.expression})
        return [Action(tool_calls=(call,)), final] if computes else [final]


def _reward(reward: str, tolerance: float) -> tuple[RewardFn, bool]:
    """The reward function named by ``reward`` and whether it is the user's own."""
    if reward == "exact":
        return lambda answer, ref, _row: exact_match(answer, ref), False
    if reward == "numeric":
        return lambda answer, ref, _row: numeric_match(answer, ref, tolerance), False
    if reward == "contains":
        return lambda answer, ref, _row: contains_match(answer, ref), False
    valid = f"valid: {', '.join(BUILTIN_REWARDS)}, or 'pkg.module:function'"
    module, colon, attr = reward.partition(":")
    if not colon or not module or not attr:
        raise ValueError(f"dataset: unknown reward {reward!r}; {valid}")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"dataset: cannot import reward {reward!r} ({e}); {valid}") from None
    try:
        inspect.signature(fn).bind("answer", "reference", {})
    except (TypeError, ValueError):
        raise ValueError(
            f"dataset: reward {reward!r} must be callable as function(answer_text, "
            "reference, row) -> float"
        ) from None
    return fn, True


@functools.lru_cache(maxsize=8)
def _split(
    rows: Rows, eval_rows: Rows | None, fraction: float, fields: _Fields
) -> tuple[tuple[Item, ...], tuple[Item, ...]]:
    """(training items, held-out items), once per process for each file version."""
    items = _items(rows, fields)
    if eval_rows is not None:
        train, held_out = items, _items(eval_rows, fields)
    else:
        held = [_unit_hash(i) < fraction for i in range(len(items))]
        train = tuple(it for it, h in zip(items, held, strict=True) if not h)
        held_out = tuple(it for it, h in zip(items, held, strict=True) if h)
        if not train or not held_out:
            raise DatasetError(
                f"dataset {rows.source}: eval_fraction={fraction} leaves "
                f"{len(train)} training and {len(held_out)} held-out rows of {len(items)}; "
                "both need rows (change eval_fraction, or give eval_path)"
            )
    return train, held_out


def _unit_hash(index: int) -> float:
    """A uniform number in [0, 1) fixed by the row index."""
    digest = hashlib.blake2b(str(index).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def _items(rows: Rows, fields: _Fields) -> tuple[Item, ...]:
    if not rows.rows:
        raise DatasetError(f"dataset {rows.source}: no rows")
    items = []
    for i, row in enumerate(rows.rows):
        prompt = _text(row, fields.prompt, i, rows.source)
        if len(prompt) > fields.max_prompt_chars:
            raise DatasetError(
                f"dataset {rows.source}, row {i}: the prompt has {len(prompt)} characters, "
                f"over max_prompt_chars={fields.max_prompt_chars}"
            )
        answer = _text(row, fields.answer, i, rows.source)
        if fields.numeric and last_number(answer) is None:
            raise DatasetError(
                f"dataset {rows.source}, row {i}: reward 'numeric' needs a number in the "
                f"reference answer, got {answer[:80]!r}"
            )
        expression = _text(row, fields.expression, i, rows.source) if fields.expression else None
        items.append(Item(prompt, answer, expression, row))
    return tuple(items)


def _text(row: Mapping[str, Any], path: str, index: int, source: str) -> str:
    """The value at dotted ``path`` (``a.b``, ``a.0``) of ``row`` as text."""
    value: Any = row
    for part in path.split("."):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, list | tuple) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            keys = ", ".join(map(str, value)) if isinstance(value, Mapping) else "none"
            raise DatasetError(
                f"dataset {source}, row {index}: no field {path!r} (at {part!r}; "
                f"fields there: {keys})"
            )
    if value is None or isinstance(value, Mapping | list | tuple):
        raise DatasetError(
            f"dataset {source}, row {index}: field {path!r} is {value!r}, not text or a number"
        )
    return str(value)
